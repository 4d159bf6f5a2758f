"""Float64 reference for DeepSeek-V4 sparse MLA decode (independent of SGLang).

Decodes the V4 page bytes itself (e4m3 bits -> value, UE8M0 -> power of two, bf16 rope bits),
then computes, per row ``t`` and head ``h`` with ``s_j = scale * <q_h, k_j>`` over the valid
candidates of the main and extra caches:

    lse_h = log(sum_j e^{s_j})                    (natural log, sink excluded; -inf if none valid)
    out_h = sum_j e^{s_j} k_j / (sum_j e^{s_j} + e^{sink_h})   (zeros if none valid)

``K = V``: the value vector is the whole 512-wide dequantized key (448 nope + 64 rope).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .cache import BYTES_PER_TOKEN, NOPE_DIM, NUM_TILES, ROPE_DIM, ROW_BYTES, TILE


def _e4m3_table() -> torch.Tensor:
    """Value of every e4m3fn byte, decoded from the bit fields (NaN for 0x7F/0xFF)."""
    vals = []
    for b in range(256):
        s = -1.0 if b & 0x80 else 1.0
        e = (b >> 3) & 0xF
        m = b & 0x7
        if e == 0xF and m == 0x7:
            vals.append(float("nan"))
        elif e == 0:
            vals.append(s * (m / 8.0) * 2.0**-6)
        else:
            vals.append(s * (1.0 + m / 8.0) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


_E4M3 = _e4m3_table()


def _bf16_bits_to_f64(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    bits = (hi.to(torch.int64) << 24) | (lo.to(torch.int64) << 16)
    return bits.to(torch.int32).view(torch.float32).to(torch.float64)


def dequant_tokens(k_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """float64 ``[n, 512]`` vectors of token ``slots`` (int, all >= 0) of a ``[N, P, 1, 584]`` view.

    Only the needed bytes are gathered (on the cache's device), then decoded on the CPU."""
    P = k_cache.shape[1]
    pb = k_cache.stride(0)
    n_pages = k_cache.shape[0]
    flat = torch.as_strided(k_cache.view(torch.uint8), (n_pages * pb,), (1,))
    slots = slots.to(torch.long).to(flat.device).reshape(-1)
    page = slots // P
    off = slots % P
    row0 = page * pb + off * ROW_BYTES
    data = flat[row0[:, None] + torch.arange(ROW_BYTES, device=flat.device)[None, :]].cpu()
    s0 = page * pb + P * ROW_BYTES + off * 8
    sc = flat[s0[:, None] + torch.arange(NUM_TILES, device=flat.device)[None, :]].cpu()
    nope = _E4M3[data[:, :NOPE_DIM].to(torch.long)]
    scale = torch.pow(2.0, sc.to(torch.float64) - 127.0)
    nope = (nope.view(-1, NUM_TILES, TILE) * scale[:, :, None]).view(-1, NOPE_DIM)
    rb = data[:, NOPE_DIM:].reshape(-1, ROPE_DIM, 2)
    rope = _bf16_bits_to_f64(rb[..., 0], rb[..., 1])
    return torch.cat([nope, rope], dim=1)


def _valid(indices: torch.Tensor, lengths: Optional[torch.Tensor]) -> torch.Tensor:
    T, _, K = indices.shape
    v = indices[:, 0, :] >= 0
    if lengths is not None:
        v &= torch.arange(K)[None, :] < lengths.to(torch.long).cpu().view(T, 1)
    return v


def sparse_mla_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    head_dim_v: int = 512,
    softmax_scale: Optional[float] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns float64 ``out [T,1,H,head_dim_v]`` and ``lse [T,H,1]`` on the CPU."""
    T, _, H, D = q.shape
    if softmax_scale is None:
        softmax_scale = D ** (-0.5)
    qf = q[:, 0].to(torch.float64).cpu()  # [T,H,D]
    idx = indices.cpu().to(torch.long)
    valid = _valid(idx, topk_length)
    kv = dequant_tokens(k_cache, idx[:, 0, :].clamp(min=0).reshape(-1)).view(T, -1, D)
    if extra_k_cache is not None and extra_indices_in_kvcache is not None:
        eidx = extra_indices_in_kvcache.cpu().to(torch.long)
        ev = _valid(eidx, extra_topk_length)
        ekv = dequant_tokens(extra_k_cache, eidx[:, 0, :].clamp(min=0).reshape(-1)).view(T, -1, D)
        kv = torch.cat([kv, ekv], 1)
        valid = torch.cat([valid, ev], 1)
    kv = torch.where(valid[:, :, None], kv, torch.zeros((), dtype=torch.float64))
    s = torch.einsum("thd,tkd->thk", qf, kv) * softmax_scale
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # [T,H]
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    denom = e.sum(-1)
    if attn_sink is not None:
        denom = denom + torch.exp(attn_sink.cpu().to(torch.float64)[None, :] - m[..., 0])
    out = torch.einsum("thk,tkd->thd", e, kv[..., :head_dim_v]) / denom[..., None]
    lonely = ~valid.any(1)
    out[lonely] = 0.0
    return out[:, None], lse[:, :, None]


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error ``|a-b| / max(|b|, tiny)`` in float64."""
    a = a.to(torch.float64).cpu()
    b = b.to(torch.float64).cpu()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


__all__ = ["sparse_mla_decode_ref", "dequant_tokens", "rel_fro", "BYTES_PER_TOKEN"]


def quantize_q_mx(q: torch.Tensor) -> torch.Tensor:
    """float64 model of the sm_120 path's on-the-fly Q quantization: the 448 nope dims of each head
    in groups of 32, UE8M0 scale ``2**ceil(log2(amax/448))``, e4m3 round-to-nearest-even; rope
    untouched. Returns float64 ``q`` with the nope part replaced by its quantized value."""
    qf = q.to(torch.float64).cpu().clone()
    nope = qf[..., :NOPE_DIM].reshape(*qf.shape[:-1], NOPE_DIM // 32, 32)
    amax = nope.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    e = torch.ceil(torch.log2(amax / 448.0)).clamp(-126, 127)
    sc = torch.pow(2.0, e)
    q8 = (nope / sc).to(torch.float32).to(torch.float8_e4m3fn).to(torch.float64) * sc
    qf[..., :NOPE_DIM] = q8.reshape(*qf.shape[:-1], NOPE_DIM)
    return qf
