"""float64 references for :func:`dsv4_sm120.moe.nvfp4_fused_moe`.

Weights are dequantized exactly with the shared format code
(:func:`dsv4_sm120.nvfp4.dequant_nvfp4`); everything after that is float64.
``act_quant=True`` additionally applies the FP4 path's activation
quantization (per-row dynamic NVFP4, :func:`quantize_rows_nvfp4`) to the
expert inputs and the SwiGLU output (after its bf16 store), so
``kernel - ref(act_quant=True)`` isolates the kernel's own error and
``ref(act_quant=True) - ref(act_quant=False)`` is the activation
quantization error.
"""

from __future__ import annotations

from typing import Optional

import torch

from dsv4_sm120.nvfp4 import (
    E2M1_MAX,
    E4M3_MAX,
    NVFP4_BLOCK,
    dequant_nvfp4,
    e2m1_to_float,
    float_to_e2m1_rne,
)


def quantize_rows_nvfp4(a: torch.Tensor) -> torch.Tensor:
    """Per-row dynamic NVFP4 fake-quantization, as the FP4 kernel path does it.

    ``a [R, K]`` -> float32 ``[R, K]`` of dequantized values. Per row
    ``gs = amax/(6*448)`` (1 for a zero row); then exactly
    :func:`dsv4_sm120.nvfp4.quantize_nvfp4` with ``scale_2 = gs`` (float32
    arithmetic, RNE E4M3 block scales, RNE e2m1 codes).
    """
    af = a.float()
    R, Kd = af.shape
    amax = af.abs().amax(dim=1)
    gs = torch.where(amax > 0, amax / (E4M3_MAX * E2M1_MAX), torch.ones_like(amax))
    blocks = af.reshape(R, Kd // NVFP4_BLOCK, NVFP4_BLOCK)
    bam = blocks.abs().amax(dim=-1)
    raw = (bam / (E2M1_MAX * gs[:, None])).clamp(max=E4M3_MAX)
    bs = raw.to(torch.float8_e4m3fn).float()
    denom = (bs * gs[:, None]).unsqueeze(-1)
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    q = torch.where(denom > 0, blocks / safe, torch.zeros_like(blocks))
    vals = e2m1_to_float(float_to_e2m1_rne(q))
    # (e2m1 * block scale) is exact; the row scale is applied last, like the kernel
    return ((vals * bs.unsqueeze(-1)).reshape(R, Kd)) * gs[:, None]


def dequant_expert(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, e: int):
    """Exact float64 (W_gate [I, H], W_up [I, H], W2 [H, I]) of expert ``e``."""
    I = w13.shape[1] // 2
    wg = dequant_nvfp4(w13[e, :I], w13_scale[e, :I], w13_scale_2[e, 0]).double()
    wu = dequant_nvfp4(w13[e, I:], w13_scale[e, I:], w13_scale_2[e, 1]).double()
    wd = dequant_nvfp4(w2[e], w2_scale[e], w2_scale_2[e]).double()
    return wg, wu, wd


def moe_reference(x, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
                  topk_weights, topk_ids, swiglu_limit: Optional[float] = None,
                  act_quant: bool = False) -> torch.Tensor:
    """float64 ``[M, H]`` reference of the fused MoE (on the inputs' device)."""
    M, H = x.shape
    E = w13.shape[0]
    k = topk_ids.shape[1]
    ids = topk_ids.long().reshape(-1)
    tw = topk_weights.double().reshape(-1)
    tok = torch.arange(M, device=x.device).repeat_interleave(k)
    out = torch.zeros((M, H), dtype=torch.float64, device=x.device)
    if act_quant:
        xin = quantize_rows_nvfp4(x).double()
    else:
        xin = x.double()
    valid = (ids >= 0) & (ids < E)
    for e in torch.unique(ids[valid]).tolist():
        sel = torch.nonzero(ids == e).squeeze(1)
        t = tok[sel]
        wg, wu, wd = dequant_expert(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, e)
        a = xin[t]
        g = a @ wg.T
        u = a @ wu.T
        if swiglu_limit is not None:
            g = g.clamp(max=swiglu_limit)
            u = u.clamp(min=-swiglu_limit, max=swiglu_limit)
        hh = g * torch.sigmoid(g) * u
        if act_quant:
            hh = quantize_rows_nvfp4(hh.to(torch.bfloat16)).double()
        y = hh @ wd.T
        out.index_add_(0, t, y * tw[sel, None])
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (inf for NaN / inf in ``out``)."""
    o = out.double()
    if not torch.isfinite(o).all():
        return float("inf")
    den = ref.norm().item()
    return (o - ref).norm().item() / (den if den > 0 else 1.0)
