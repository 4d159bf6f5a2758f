"""Relative-error bounds of the overlay's correctness gates, one table for all of them.

Each bound is a relative error of a result against a float64 reference (attention: relative Frobenius error of
the output, :func:`dsv4_sm120.attention.reference.rel_fro`; MoE: :func:`dsv4_sm120.moe.reference.rel_err`).
The gates that read this table:

* the startup self-check (:mod:`dsv4_sm120.sglang_glue.selfcheck`): :data:`ATTN_BF16`, :data:`ATTN_FP8QK`,
  ``MOE["nvfp4"]``;
* ``make calibrate``'s gate (:mod:`dsv4_sm120.calibrate.candidates` default :data:`BF16_RESULT`,
  :mod:`dsv4_sm120.calibrate.attention`, :mod:`dsv4_sm120.calibrate.moe`): the same attention and MoE bounds,
  so a launch the calibration accepts passes the self-check;
* the launch sweep (:mod:`dsv4_sm120.dev.launch_sweep`) that turns benchmark rows into launch tables:
  :data:`LAUNCH_SWEEP`, :data:`LAUNCH_SWEEP_REL`.

Torch-free; imports nothing from the package.
"""

from __future__ import annotations

# A result computed from exact inputs with fp32 accumulation and stored in bf16: the bf16 output rounding alone is
# ~1.5e-3 and our attention kernel's bf16 P before the PV product adds 3-5e-3 (docs/attention.md, Accuracy);
# 2e-2 leaves room for that and for other implementations' rounding, while a wrong result (a missing term, a
# swapped operand, garbage) lands near 1.
BF16_RESULT = 2e-2

# Attention with bf16 QK (our kernel's default, SGLang's stock paths, FlashMLA): a bf16 result, as above.
ATTN_BF16 = BF16_RESULT

# Attention with block-scaled QK (``DSV4_SM120_ATTN_QK=fp8``, ``dsv4+fp8qk``): Q is quantized to e4m3 per 32
# (:func:`dsv4_sm120.attention.reference.quantize_q_mx`), which costs 2-3% on realistic caches against the
# unquantized reference; 5e-2 admits that loss.
ATTN_FP8QK = 5e-2

# MoE per activation format of the runner. NVFP4 activations (the NVFP4 runners on sm_120) carry ~15-20% relative
# error on random data, so 0.3; FP8 / MXFP8 / bf16 activations (the MXFP4 runners) stay under 0.08. A broken
# runner (wrong gate/up halves, a missing SwiGLU clamp on large data, garbage) lands far above either.
MOE = {"nvfp4": 0.3, "mxfp4": 0.08}

# The launch sweep: largest relative error a benchmark row (``rel_err`` of bench/bench_attention.py /
# bench/bench_moe.py) may show and still win, per ``impl``. ``ours-bf16`` and ``nvfp4-bf16`` are bf16 results of
# exact inputs (:data:`BF16_RESULT`); ``nvfp4-fp4`` gets the same bound (the bench compares it with the reference
# without activation quantization, which the fp4 path alone costs 0.16-0.18 on the bench's inputs, so an fp4
# row passes only if that loss is absent). ``ours-fp8`` rows are compared with the float64 result of the
# unquantized Q, so every correct candidate shows the same e4m3 loss (0.08-0.4 on the bench's random inputs):
# 1.0 only rejects garbage, and :data:`LAUNCH_SWEEP_REL` does the real gating.
LAUNCH_SWEEP = {"ours-bf16": BF16_RESULT, "ours-fp8": 1.0, "nvfp4-bf16": BF16_RESULT, "nvfp4-fp4": BF16_RESULT}

# impls whose error is mostly their inputs' quantization: a row passes when its error is within this fraction
# of the smallest error among the candidates of its size (the same quantized inputs give the same loss).
LAUNCH_SWEEP_REL = {"ours-fp8": 0.05}
