"""Block-FP8 GEMM tuning for SGLang's Triton kernel (``w8a8_block_fp8_matmul_triton``).

Modules, by role:

* :mod:`.shapes`  -- the DeepSeek-V4-Flash dense FP8 weight shapes per TP size, the token counts M, and the
  parsing of ``--shapes`` / ``--ms``;
* :mod:`.search`  -- the candidate tile configs, the search fingerprint, and the ``Bench`` interface the
  tuner times candidates through;
* :mod:`.tuner`   -- the resumable search loop writing one JSON per shape;
* :mod:`.summary` -- the summary's comparisons, backend decision and Markdown table;
* :mod:`.kernel`  -- loading SGLang's own kernel module (installed, or from the pinned wheel);
* :mod:`.gpu`     -- ``GpuBench``: checks and times candidates on the GPU (or Triton's interpreter);
* :mod:`.cli`     -- ``python -m dsv4_sm120.tune_fp8``.

SGLang 0.5.23's config file naming scheme and the schema check of a config table are
:mod:`dsv4_sm120.fp8_configs` (the lookup patched SGLang calls): the tuner writes what that module reads.

Importing this package, :mod:`.shapes`, :mod:`.search`, :mod:`.summary`, :mod:`.tuner` or
:mod:`.cli` never imports torch, triton or SGLang; only :mod:`.gpu` and :mod:`.kernel` do, when used.
"""
