"""``make calibrate``: the product decides by measurement on the box it runs on.

For every decision the patches make, every candidate available on this GPU is timed at the deployment's
shapes and checked against a float64 reference before it may win (``candidates``): sparse-MLA decode
(``attention``: ours and its launch variants, SGLang's sm_120 dispatcher backends, FlashMLA as a reference
point), the MoE runner (``moe``: SGLang's runners through its own ``FusedMoE`` layer, our kernel), the FP8
GEMM backend (``fp8``: through ``python -m dsv4_sm120.tune_fp8``). The result is a machine profile per GPU
model, written through :mod:`dsv4_sm120.machine_profile` (its schema, version keying and the glue's
``decision(name, bucket)``: calibrate only writes profiles, the reader sits beside the launch tables) and a report
(``report``). Shapes come from the serve settings (``deployment``).

CLI: ``python -m dsv4_sm120.calibrate --help``. Importing this package imports neither torch nor SGLang.
"""
