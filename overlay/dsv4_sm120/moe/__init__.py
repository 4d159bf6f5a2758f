"""Triton NVFP4 fused MoE for DeepSeek-V4 routed experts.

``nvfp4_fused_moe(x, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
topk_weights, topk_ids, swiglu_limit=None) -> [M, H] bf16`` (see
:func:`dsv4_sm120.moe.fused_moe.nvfp4_fused_moe` and ``docs/moe.md``).
Importing this package does not import torch or triton; the first call does.
"""

from __future__ import annotations

from ..moe_runner import TRITON_NVFP4_BACKEND as BACKEND_NAME  # the runner name SGLang knows it by

__all__ = ["BACKEND_NAME", "nvfp4_fused_moe"]


def nvfp4_fused_moe(x, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
                    topk_weights, topk_ids, swiglu_limit=None):
    from .fused_moe import nvfp4_fused_moe as _impl

    return _impl(x, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
                 topk_weights, topk_ids, swiglu_limit)


nvfp4_fused_moe.__doc__ = (
    "Fused MoE over NVFP4 routed experts -> [M, H] bf16; "
    "see dsv4_sm120.moe.fused_moe.nvfp4_fused_moe for the full contract."
)
