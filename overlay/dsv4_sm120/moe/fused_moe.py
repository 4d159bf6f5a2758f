"""Host planning of the Triton NVFP4 fused MoE (DeepSeek-V4 routed experts).

Checks the inputs, picks the path (fp4 / bf16), the scaled-dot mode and where activations are quantized
(environment, see ``PATH_ENV`` and below), takes the launch configuration from the launch tables
(:mod:`dsv4_sm120.moe.config`), allocates the buffers, groups the (token, expert) pairs and launches the
kernels of :mod:`dsv4_sm120.moe.kernels`. Public entry: :func:`dsv4_sm120.moe.nvfp4_fused_moe`; contract in
``docs/moe.md``. Everything here depends only on tensor shapes: no ``.item()``, no data-dependent
allocation, so calls can be captured in CUDA graphs. Buffers come from ``torch.empty`` (no memset): the
kernels never read a row they did not write.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Optional

import torch
import triton

from .. import settings
from . import kernels as K
from .config import ALIGN_MODES, Config, legal_bk
from .config import choose_config as _table_config

__all__ = ["MoEInputError", "Config", "choose_config", "default_path", "nvfp4_fused_moe", "nvfp4_fused_moe_impl"]

# Environment knobs (each also an argument of nvfp4_fused_moe_impl, which wins over the environment):
PATH_ENV = "DSV4_SM120_MOE_PATH"  # auto (default) | fp4 | bf16: force a path (tests, debugging)
# native | emulated: the fp4 path's scaled dot. Default native on GPUs with FP4 block-scaled MMA (sm_100,
# sm_120), emulated elsewhere and under the interpreter (whose dot_scaled reads every scale as E8M0).
# emulated is the escape hatch should native dot_scaled misbehave on a GPU: same result, exact, slower.
SCALED_DOT_ENV = "DSV4_SM120_MOE_SCALED_DOT"
# fp4 path, where activations are quantized: 1 (default) once per row before each GEMM
# (kernels._quant_rows_kernel: x before w13, the real rows of h before w2), the GEMMs then load packed e2m1
# + e4m3 scales; 0 inside every GEMM program (each of an expert's N/BN programs re-quantizes the same tile).
# Same operands bit for bit. The pre-pass is the default because on sm_120 the in-loop quantizer is ~16x
# the instructions of the w13 K loop (bench/moe_sass_count.py --path fp4); `make bench-moe` times 0 too.
APRE_ENV = "DSV4_SM120_MOE_APRE"
# auto (default: the launch table's choice) | inkernel | triton | torch: override the token grouping.
# All three give the same bits; for tests and for timing one against another.
ALIGN_ENV = "DSV4_SM120_MOE_ALIGN"


class MoEInputError(ValueError):
    """Bad shapes / dtypes / devices / settings given to :func:`nvfp4_fused_moe`."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _env_choice(name: str, default: Optional[str] = None) -> str:
    """The setting's value (dsv4_sm120.settings); ``default`` where it is unset and has no default of its own."""
    try:
        v = settings.get(name)
    except settings.SettingsError as e:
        raise MoEInputError(str(e)) from None
    return default if v is None else v


def _has_fp4_mma(device: torch.device) -> bool:
    if device.type != "cuda" or _interpreting():
        return False
    return torch.cuda.get_device_capability(device)[0] in (10, 12)


def default_path(device: torch.device) -> str:
    """``fp4`` on GPUs with FP4 block-scaled MMA (sm_100, sm_120), else ``bf16``; ``DSV4_SM120_MOE_PATH`` wins."""
    forced = _env_choice(PATH_ENV)
    if forced != "auto":
        return forced
    return "fp4" if _has_fp4_mma(device) else "bf16"


def default_scaled_dot(device: torch.device) -> str:
    return _env_choice(SCALED_DOT_ENV, "native" if _has_fp4_mma(device) else "emulated")


def default_apre() -> bool:
    return _env_choice(APRE_ENV) == "1"


def choose_config(M: int, topk: int, E: int, H: int, I: int, path: str,
                  device: Optional[torch.device] = None) -> Config:
    """The launch for this shape on ``device`` (default: the current CUDA device) from the launch tables
    (:mod:`dsv4_sm120.moe.config`)."""
    if _interpreting():
        return _table_config(M, topk, E, H, I, path, interpreting=True)
    device = torch.device(device) if device is not None else torch.device("cuda")
    name, cap = _device_identity(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" and torch.cuda.is_available() else ("default", None)
    # the shift decode is inline PTX: NVIDIA only
    return _table_config(M, topk, E, H, I, path, device_name=name, capability=cap,
                         portable_decode=bool(getattr(torch.version, "hip", None)))


@lru_cache(maxsize=None)
def _device_identity(index: int):
    return torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index))


def align_torch(ids: torch.Tensor, E: int, BM: int, sorted_pair: torch.Tensor,
                block_expert: torch.Tensor) -> None:
    """What ``kernels._align_kernel`` computes, with fixed-shape torch ops (a
    stable sort and scans: no host sync, CUDA-graph safe); for large P, where
    the one-program kernel walks every pair twice on one SM."""
    P = ids.numel()
    dev = ids.device
    valid = (ids >= 0) & (ids < E)
    key = torch.where(valid, ids, torch.full_like(ids, E)).long()
    sorted_key, order = torch.sort(key, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:E] + BM - 1) // BM * BM
    end = torch.cumsum(padded, 0)
    start = end - padded
    first = torch.cumsum(counts, 0) - counts  # first sorted position of each key
    ok = sorted_key < E
    kk = torch.where(ok, sorted_key, torch.zeros_like(sorted_key))
    dest = start[kk] + torch.arange(P, device=dev) - first[kk]
    max_slots = sorted_pair.numel()
    dest = torch.where(ok, dest, torch.full_like(dest, max_slots))  # dropped -> spill slot
    buf = torch.full((max_slots + 1,), P, dtype=torch.int32, device=dev)
    buf.scatter_(0, dest, order.to(torch.int32))
    sorted_pair.copy_(buf[:max_slots])
    pos = torch.arange(block_expert.numel(), device=dev) * BM
    e_of_b = torch.searchsorted(end, pos, right=True)
    used = e_of_b < E
    e_safe = torch.where(used, e_of_b, torch.zeros_like(e_of_b))
    used &= pos >= start[e_safe]
    block_expert.copy_(torch.where(used, e_of_b, torch.full_like(e_of_b, -1)).to(torch.int32))


def _check(x, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, topk_weights, topk_ids):
    def need(cond, msg):
        if not cond:
            raise MoEInputError(f"nvfp4_fused_moe: {msg}")

    need(x.dim() == 2 and x.dtype == torch.bfloat16, f"x must be bf16 [M, H], got {x.dtype} {tuple(x.shape)}")
    M, H = x.shape
    need(w13.dim() == 3 and w13.dtype == torch.uint8, f"w13 must be uint8 [E, 2I, H/2], got {w13.dtype} {tuple(w13.shape)}")
    E, two_i, h2 = w13.shape
    need(two_i % 2 == 0, f"w13 dim 1 must be 2*I (even), got {two_i}")
    I = two_i // 2
    need(h2 * 2 == H, f"w13 is [E, 2I, {h2}] but x has H={H} (expected H/2={H // 2})")
    need(H % 32 == 0 and I % 32 == 0, f"H and I must be multiples of 32 (got H={H}, I={I})")
    need(w13_scale.dtype == torch.float8_e4m3fn and tuple(w13_scale.shape) == (E, two_i, H // 16),
         f"w13_scale must be float8_e4m3fn [{E}, {two_i}, {H // 16}], got {w13_scale.dtype} {tuple(w13_scale.shape)}")
    need(w13_scale_2.dtype == torch.float32 and tuple(w13_scale_2.shape) == (E, 2),
         f"w13_scale_2 must be float32 [{E}, 2], got {w13_scale_2.dtype} {tuple(w13_scale_2.shape)}")
    need(w2.dtype == torch.uint8 and tuple(w2.shape) == (E, H, I // 2),
         f"w2 must be uint8 [{E}, {H}, {I // 2}], got {w2.dtype} {tuple(w2.shape)}")
    need(w2_scale.dtype == torch.float8_e4m3fn and tuple(w2_scale.shape) == (E, H, I // 16),
         f"w2_scale must be float8_e4m3fn [{E}, {H}, {I // 16}], got {w2_scale.dtype} {tuple(w2_scale.shape)}")
    need(w2_scale_2.dtype == torch.float32 and tuple(w2_scale_2.shape) == (E,),
         f"w2_scale_2 must be float32 [{E}], got {w2_scale_2.dtype} {tuple(w2_scale_2.shape)}")
    need(topk_ids.dim() == 2 and topk_ids.shape[0] == M and topk_ids.dtype in (torch.int32, torch.int64),
         f"topk_ids must be int32 [M={M}, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    need(topk_weights.shape == topk_ids.shape and topk_weights.dtype in (torch.float32, torch.bfloat16, torch.float16),
         f"topk_weights must be float32 {tuple(topk_ids.shape)}, got {topk_weights.dtype} {tuple(topk_weights.shape)}")
    dev = x.device
    for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w13_scale_2", w13_scale_2), ("w2", w2),
                    ("w2_scale", w2_scale), ("w2_scale_2", w2_scale_2), ("topk_weights", topk_weights),
                    ("topk_ids", topk_ids)):
        need(t.device == dev, f"{name} is on {t.device}, x on {dev}")
    for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        need(t.stride(-1) == 1, f"{name} must be contiguous in its last dim")
    return M, H, E, I


def _quantize_rows(a: torch.Tensor, R: int, K_: int, BK: int, sel=None, sel_hi: int = 0):
    """NVFP4 of rows ``a[:R, :K_]`` (bf16): packed e2m1 ``[R, K_/2]`` u8, e4m3 block scales ``[R, K_/16]``,
    per-row global scale ``[R]`` fp32 (the fp4 path's own quantization, run once per row). With ``sel``
    (int32 ``[R]``) only rows ``r`` with ``0 <= sel[r] < sel_hi`` are read and written: the rows of h that
    GEMM 1 wrote. The others hold whatever the allocator left there and are never read as valid."""
    if K_ % BK:
        raise MoEInputError(f"nvfp4_fused_moe: activation quantization chunk {BK} must divide K={K_}")
    q = torch.empty((R, K_ // 2), dtype=torch.uint8, device=a.device)
    s = torch.empty((R, K_ // 16), dtype=torch.float8_e4m3fn, device=a.device)
    gs = torch.empty((R,), dtype=torch.float32, device=a.device)
    BR = 16
    K._quant_rows_kernel[(triton.cdiv(R, BR), K_ // BK)](
        a, q, s, gs, R, K_, a.stride(0), sel if sel is not None else gs, sel_hi,
        BR=BR, BK=BK, HAS_SEL=sel is not None, num_warps=4)
    return q, s, gs


def nvfp4_fused_moe_impl(x, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
                         topk_weights, topk_ids, swiglu_limit: Optional[float] = None,
                         path: Optional[str] = None, scaled_dot: Optional[str] = None,
                         config: Optional[Config] = None, apre: Optional[bool] = None) -> torch.Tensor:
    """:func:`nvfp4_fused_moe` with the path, scaled-dot mode, launch configuration and activation
    pre-quantization (fp4 path) explicit; ``None`` takes the default (environment, launch table)."""
    M, H, E, I = _check(x, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, topk_weights, topk_ids)
    topk = topk_ids.shape[1]
    dev = x.device
    path = path or default_path(dev)
    if path not in ("fp4", "bf16"):
        raise MoEInputError(f"nvfp4_fused_moe: path must be fp4 or bf16, got {path!r}")
    scaled_dot = scaled_dot or default_scaled_dot(dev)
    out = torch.empty((M, H), dtype=torch.bfloat16, device=dev)
    if M == 0:
        return out
    if topk == 0:
        return out.zero_()
    cfg = config or choose_config(M, topk, E, H, I, path, dev)
    if H % cfg.BK1 or I % cfg.BK2:
        raise MoEInputError(f"nvfp4_fused_moe: tile K ({cfg.BK1}, {cfg.BK2}) must divide H={H} and I={I} "
                            f"(largest legal: {legal_bk(H, cfg.BK1)}, {legal_bk(I, cfg.BK2)})")
    if cfg.deq not in (0, 3) or (cfg.deq and _interpreting()):
        raise MoEInputError(f"nvfp4_fused_moe: weight decode deq={cfg.deq}: expected 0, or 3 on an NVIDIA GPU "
                            "(inline PTX; not under TRITON_INTERPRET)")
    x = x.contiguous()
    ids = topk_ids.to(torch.int32).contiguous().view(-1)
    tw = topk_weights.to(torch.float32).contiguous().view(-1)
    P = M * topk
    BM = cfg.BM
    align = _env_choice(ALIGN_ENV)
    if align == "auto":
        align = cfg.align
    if align not in ALIGN_MODES:
        raise MoEInputError(f"nvfp4_fused_moe: grouping {align!r}: expected one of {', '.join(ALIGN_MODES)}")
    grouped = align == "inkernel"
    fp4 = path == "fp4"
    native = scaled_dot == "native"
    interp = _interpreting()
    has_limit = swiglu_limit is not None
    if grouped:
        # no grouping launch: the GEMM programs are (expert, row tile) slots found in-kernel; h rows = pairs
        grid_m = min(E, P) + triton.cdiv(P, BM)  # row tiles: sum_e ceil(count_e / BM) <= this
        rows_ptr, blocks_ptr, h_rows = ids, ids, P
        grp = dict(GROUPED=True, E=E, P_PAD=max(16, triton.next_power_of_2(P)),
                   E_PAD=max(16, triton.next_power_of_2(E)))
    else:
        grid_m = triton.cdiv(P, BM) + min(E, P)
        h_rows = grid_m * BM
        rows_ptr = torch.empty(h_rows, dtype=torch.int32, device=dev)  # sorted, padded pair order
        blocks_ptr = torch.empty(grid_m, dtype=torch.int32, device=dev)  # expert of each row block
        grp = {}
        if align == "torch":
            align_torch(ids, E, BM, rows_ptr, blocks_ptr)
        else:
            e_pad = triton.next_power_of_2(E)
            chunk = max(16, min(128, 16384 // e_pad))
            bchunk = max(16, min(64, 8192 // e_pad))
            K._align_kernel[(1,)](ids, rows_ptr, blocks_ptr, P, E, h_rows, grid_m,
                                  BM=BM, E_PAD=e_pad, CHUNK=chunk, FILL=1024, BCHUNK=bchunk,
                                  num_warps=4 if interp else 8)
    h = torch.empty((h_rows, I), dtype=torch.bfloat16, device=dev)
    y = torch.empty((P, H), dtype=torch.float32, device=dev)
    apre = (apre if apre is not None else default_apre()) and fp4  # env read (checked) on both paths
    pre1, pre2 = {}, {}
    if apre:
        xq, xs, xgs = _quantize_rows(x, M, H, cfg.BK1)
        pre1 = dict(APRE=True, xq_ptr=xq, xs_ptr=xs, xgs_ptr=xgs)
    K._gemm1_kernel[(grid_m, triton.cdiv(I, cfg.BN1))](
        x, w13, w13_scale, w13_scale_2.contiguous(), rows_ptr, blocks_ptr, h,
        P, topk, H, I,
        x.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1),
        float(swiglu_limit) if has_limit else 0.0,
        HAS_LIMIT=has_limit, BM=BM, BN=cfg.BN1, BK=cfg.BK1, PATH_FP4=fp4, NATIVE=native,
        INTERP=interp, DEQ=cfg.deq, **grp, **pre1,
        num_warps=cfg.warps1, num_stages=cfg.stages)
    if apre:
        # only the h rows GEMM 1 wrote: grouped, row = pair, written iff its expert id is in [0, E);
        # aligned, row = slot of the sorted order, written iff it holds a pair (< P) and not padding
        hq, hs, hgs = _quantize_rows(h, h_rows, I, cfg.BK2, ids if grouped else rows_ptr, E if grouped else P)
        pre2 = dict(APRE=True, hq_ptr=hq, hs_ptr=hs, hgs_ptr=hgs)
    K._gemm2_kernel[(grid_m, triton.cdiv(H, cfg.BN2))](
        h, w2, w2_scale, w2_scale_2.contiguous(), rows_ptr, blocks_ptr, tw, y,
        P, H, I,
        w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        BM=BM, BN=cfg.BN2, BK=cfg.BK2, PATH_FP4=fp4, NATIVE=native, INTERP=interp, DEQ=cfg.deq,
        **grp, **pre2, num_warps=cfg.warps2, num_stages=cfg.stages)
    rb = min(1024, triton.next_power_of_2(H))
    K._reduce_kernel[(M, triton.cdiv(H, rb))](y, ids, out, H, E, TOPK=topk, BLOCK=rb, INTERP=interp)
    return out


def nvfp4_fused_moe(x, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
                    topk_weights, topk_ids, swiglu_limit=None):
    """Fused MoE over NVFP4 routed experts -> ``[M, H]`` bf16.

    ``x [M, H]`` bf16; ``w13 u8 [E, 2I, H/2]`` (gate rows ``0..I-1``, up rows
    ``I..2I-1``), ``w13_scale e4m3 [E, 2I, H/16]``, ``w13_scale_2 f32 [E, 2]``
    (gate, up), ``w2 u8 [E, H, I/2]``, ``w2_scale e4m3 [E, H, I/16]``,
    ``w2_scale_2 f32 [E]``; ``topk_ids [M, k]`` int32 (ids outside ``[0, E)``,
    e.g. -1, are dropped), ``topk_weights [M, k]`` fp32.

    ``out[t] = sum_j w[t,j] * W2[e] (silu(min(g, L)) * clamp(u, -L, L))`` with
    ``g, u = W13[e] x[t]`` split into gate / up halves, ``e = ids[t,j]`` and
    ``L = swiglu_limit`` (no clamp when ``None``), as DeepSeek-V4 defines it.
    On sm_100 / sm_120 activations are quantized to NVFP4 on the fly (per-row
    dynamic global scale); elsewhere weights are upcast to bf16 in-kernel.
    """
    return nvfp4_fused_moe_impl(x, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
                                topk_weights, topk_ids, swiglu_limit)
