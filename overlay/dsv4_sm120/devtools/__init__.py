"""Developer tools: looking at the code Triton generates for this package's kernels without a GPU
(:mod:`dsv4_sm120.devtools.sass`), and the sm_120 compile coverage built on it: every distinct launch the product
can make on an sm_120 GPU (:mod:`dsv4_sm120.devtools.sm120_launches`), compiled and checked against sm_120's limits
(:mod:`dsv4_sm120.devtools.sm120_compile`); a source check of the kernels for loop carries Triton 3.6 drops
(:mod:`dsv4_sm120.devtools.jit_lint`). Used by ``bench/attn_sass_count.py``, ``bench/moe_sass_count.py`` and
the compile tests; nothing in serving imports them. Torch-free."""
