"""Developer tools: looking at the code Triton generates for this package's kernels without a GPU
(:mod:`dsv4_sm120.devtools.sass`). Used by ``bench/attn_sass_count.py``, ``bench/moe_sass_count.py`` and the
compile tests; nothing in serving imports them. Torch-free."""
