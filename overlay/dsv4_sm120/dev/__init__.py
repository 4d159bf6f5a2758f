"""Developer tools, imported by nothing that serves (the top layer of docs/DEVELOPING.md's "Layers").

* The benchmark results files: :mod:`.bench_results` (append-only CSVs, the tables generated from them; the bench
  drivers and ``bench/results_table.py`` write and read through it), :mod:`.bench_rows` (reading rows), and
  :mod:`.launch_sweep` (a GPU's launch tables from its launch-sweep rows: ``make launch-tables``).
* Looking at the code Triton generates for this package's kernels without a GPU (:mod:`.sass`), and the sm_120
  compile coverage built on it: every distinct launch the product can make on an sm_120 GPU
  (:mod:`.sm120_launches`), compiled and checked against sm_120's limits (:mod:`.sm120_compile`); a source check of
  the kernels for loop carries Triton 3.6 drops (:mod:`.jit_lint`). Used by ``bench/attn_sass_count.py``,
  ``bench/moe_sass_count.py`` and the compile tests.

Torch-free.
"""
