"""Launcher of the Triton NVFP4 fused MoE (DeepSeek-V4 routed experts).

Public entry: :func:`dsv4_sm120.moe.nvfp4_fused_moe` (re-exported by the
package). Shapes, dtypes and semantics are documented there and in
``docs/moe.md``. Everything here depends only on tensor shapes: no
``.item()``, no data-dependent allocation, so calls can be captured in CUDA
graphs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from . import kernels as K

PATH_ENV = "DSV4_SM120_MOE_PATH"  # auto | fp4 | bf16 (force a path; tests / debugging)
SCALED_DOT_ENV = "DSV4_SM120_MOE_SCALED_DOT"  # native | emulated (fp4 path only)
DEQ_ENV = "DSV4_SM120_MOE_DEQ"  # 0 | 1 | 2: weight decode of the bf16 path (kernels._dequant_w)
# Activation tile load: "split" = one contiguous load (cp.async-pipelined, 16-byte vectors), even/odd
# halves split in registers; "strided" = two stride-2 loads (what bench/results/moe_h200.md measured:
# in the PTX they are 32 scalar, unpipelined 2-byte loads per thread per K step). Default split:
# same results bit for bit (tests), fewer and asynchronous loads; not yet timed on a GPU.
ALOAD_ENV = "DSV4_SM120_MOE_ALOAD"
# Token grouping: "inkernel" = no grouping launch: each GEMM program is an expert slot and finds its
# pairs itself (histogram + ranks over the routing, O(P) per program: decode sizes); "triton" = the
# one-program align kernel (sorted, padded order); "torch" = stable sort + scans; "auto" (default) =
# inkernel up to INKERNEL_MAX_PAIRS pairs, triton up to 2048, torch above (the one-program kernel walks
# every pair twice on one SM; ncu on the H200: 47 us at 384 pairs, 9 us at 6). H200 call 4 (DEQ 3): inkernel
# 27.8 vs 32.2 us at M=1, a tie at M=4 (61.1 vs 60.4), slower from M=16 (206.9 vs 171.1; M=64 487 vs 382):
# every program's walk over the routing is serial latency before its GEMM starts.
ALIGN_ENV = "DSV4_SM120_MOE_ALIGN"
INKERNEL_MAX_PAIRS = 32
# fp4 path, activation quantization: "1" (default) = once per row before each GEMM (kernels._quant_rows_kernel:
# x before w13, h before w2) and the GEMMs load packed e2m1 + e4m3 scales; "0" = inside every GEMM program
# (each of the N/BN programs of an expert re-quantizes the same tile: on sm_120, triton 3.8, the w13 loop is
# 1949 SASS instructions per K step that way against 119 with the tile pre-quantized,
# bench/moe_sass_count.py --path fp4). Same operands bit for bit (tests); unmeasured on sm_120 hardware.
APRE_ENV = "DSV4_SM120_MOE_APRE"
DEFAULT_DEQ = 3  # H200 call 4 (bench/results/moe_h200_call4.md): shift decode 1.3-1.5x faster than DEQ 2; 0 under the interpreter / off NVIDIA


class MoEInputError(ValueError):
    """Bad shapes / dtypes / devices given to :func:`nvfp4_fused_moe`."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_path(device: torch.device) -> str:
    """``fp4`` on GPUs with FP4 block-scaled MMA (sm_100, sm_120), else ``bf16``."""
    forced = os.environ.get(PATH_ENV, "auto").strip().lower()
    if forced in ("fp4", "bf16"):
        return forced
    if forced not in ("", "auto"):
        raise MoEInputError(f"{PATH_ENV}={forced!r}: expected auto, fp4 or bf16")
    if device.type != "cuda" or _interpreting():
        return "bf16"
    major, _ = torch.cuda.get_device_capability(device)
    return "fp4" if major in (10, 12) else "bf16"


def default_scaled_dot(device: torch.device) -> str:
    forced = os.environ.get(SCALED_DOT_ENV, "").strip().lower()
    if forced in ("native", "emulated"):
        return forced
    if forced:
        raise MoEInputError(f"{SCALED_DOT_ENV}={forced!r}: expected native or emulated")
    # the interpreter's dot_scaled reads every scale as E8M0, and Triton 3.6 cannot
    # lower E4M3-scaled (nvfp4) dot_scaled on GPUs without FP4 MMA: emulate there
    if _interpreting() or device.type != "cuda":
        return "emulated"
    major, _ = torch.cuda.get_device_capability(device)
    return "native" if major in (10, 12) else "emulated"


@dataclass(frozen=True)
class Config:
    BM: int
    BN1: int
    BK1: int
    BN2: int
    BK2: int
    warps1: int
    warps2: int
    stages: int
    deq: int = DEFAULT_DEQ
    aload_split: bool = True


def _pick_bk(K: int, want: int) -> int:
    bk = want
    while bk > 32 and K % bk:
        bk //= 2
    return bk


def default_deq() -> int:
    v = os.environ.get(DEQ_ENV, "").strip()
    if not v:
        if _interpreting() or getattr(torch.version, "hip", None):
            return 0
        return DEFAULT_DEQ
    if v not in ("0", "1", "2", "3", "4"):
        raise MoEInputError(f"{DEQ_ENV}={v!r}: expected 0, 1, 2, 3 or 4")
    if v in ("2", "3", "4") and _interpreting():
        raise MoEInputError(f"{DEQ_ENV}=2 (inline PTX) cannot run under TRITON_INTERPRET")
    return int(v)


def _env_choice(name: str, choices, default: str) -> str:
    v = os.environ.get(name, "").strip().lower() or default
    if v not in choices:
        raise MoEInputError(f"{name}={v!r}: expected one of {', '.join(choices)}")
    return v


def choose_config(M: int, topk: int, E: int, H: int, I: int, path: str) -> Config:
    """Tile sizes chosen by the number of (token, slot) pairs per expert.

    Decode tiles from the H200 sweep (bench/results/moe_h200.md): at M=1,
    BN1=32/BK=256 (56 us) beat BN1=64/BK=128 (81-88 us); at M=64 the wider tile
    won (670 vs 735 us), hence the switch at 256 pairs.
    """
    deq = default_deq()
    split = _env_choice(ALOAD_ENV, ("strided", "split"), "split") == "split"
    if _interpreting():
        return Config(16, 16, _pick_bk(H, 32), 16, _pick_bk(I, 32), 4, 4, 1, deq, split)
    P = M * topk
    per_expert = P / max(1, min(E, P))
    if per_expert <= 16 and P < 256:  # small decode batches: many narrow programs
        # H200 call 10 (DEQ 3): from 64 pairs a 64-wide w13 tile is a little faster (M=16: 169.0 vs
        # 172.1 us; M=4: 66.7 vs 61.0, so not below)
        BM, BN1, BN2, w1, w2 = 16, (64 if P >= 64 else 32), 64, 4, 4
        BK1, BK2 = _pick_bk(H, 256), _pick_bk(I, 256)
    elif per_expert <= 16:
        BM, BN1, BN2, w1, w2 = 16, 64, 128, 4, 4
        BK1, BK2 = _pick_bk(H, 128), _pick_bk(I, 128)
    elif per_expert <= 48:
        BM, BN1, BN2, w1, w2 = 32, 64, 64, 4, 4
        BK1, BK2 = _pick_bk(H, 128), _pick_bk(I, 128)
    else:  # prefill
        BM, BN1, BN2, w1, w2 = 64, 64, 128, 8, 8
        BK1, BK2 = _pick_bk(H, 128), _pick_bk(I, 128)
    return Config(BM, BN1, BK1, BN2, BK2, w1, w2, 3, deq, split)


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


def default_apre() -> bool:
    v = os.environ.get(APRE_ENV, "").strip()
    if v not in ("", "0", "1"):
        raise MoEInputError(f"{APRE_ENV}={v!r}: expected 0 or 1")
    return v != "0"


def _quantize_rows(a: torch.Tensor, R: int, K_: int, BK: int, split: bool, sel=None, P: int = 0):
    """NVFP4 of rows ``a[:R, :K_]`` (bf16): packed e2m1 ``[R, K_/2]`` u8, e4m3 block scales ``[R, K_/16]``,
    per-row global scale ``[R]`` fp32 (the fp4 path's own quantization, run once per row); with ``sel``
    only the rows whose ``sel`` entry is a real pair (``< P``)."""
    if K_ % BK:
        raise MoEInputError(f"nvfp4_fused_moe: activation quantization chunk {BK} must divide K={K_}")
    q = torch.empty((R, K_ // 2), dtype=torch.uint8, device=a.device)
    s = torch.empty((R, K_ // 16), dtype=torch.float8_e4m3fn, device=a.device)
    gs = torch.empty((R,), dtype=torch.float32, device=a.device)
    BR = 16
    K._quant_rows_kernel[(triton.cdiv(R, BR), K_ // BK)](
        a, q, s, gs, R, K_, a.stride(0), sel if sel is not None else gs, P,
        BR=BR, BK=BK, ALOAD_SPLIT=split, HAS_SEL=sel is not None, num_warps=4)
    return q, s, gs


def nvfp4_fused_moe_impl(x, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
                         topk_weights, topk_ids, swiglu_limit: Optional[float] = None,
                         path: Optional[str] = None, scaled_dot: Optional[str] = None,
                         config: Optional[Config] = None, apre: Optional[bool] = None) -> torch.Tensor:
    """:func:`nvfp4_fused_moe` with the path / scaled-dot mode / tiles / activation pre-quantization
    (fp4 path; default ``DSV4_SM120_MOE_APRE``, on) explicit."""
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
    cfg = config or choose_config(M, topk, E, H, I, path)
    if H % cfg.BK1 or I % cfg.BK2:
        raise MoEInputError(f"nvfp4_fused_moe: tile K ({cfg.BK1}, {cfg.BK2}) must divide H={H} and I={I}")
    x = x.contiguous()
    ids = topk_ids.to(torch.int32).contiguous().view(-1)
    tw = topk_weights.to(torch.float32).contiguous().view(-1)
    P = M * topk
    BM = cfg.BM
    align = _env_choice(ALIGN_ENV, ("inkernel", "triton", "torch", "auto"), "auto")
    if align == "auto":
        align = "inkernel" if P <= INKERNEL_MAX_PAIRS else ("triton" if P <= 2048 else "torch")
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
                                  num_warps=4 if _interpreting() else 8)
    h = torch.empty((h_rows, I), dtype=torch.bfloat16, device=dev)
    y = torch.empty((P, H), dtype=torch.float32, device=dev)
    apre = fp4 and (apre if apre is not None else default_apre())
    pre1, pre2 = {}, {}
    if apre:
        xq, xs, xgs = _quantize_rows(x, M, H, cfg.BK1, cfg.aload_split)
        pre1 = dict(APRE=True, xq_ptr=xq, xs_ptr=xs, xgs_ptr=xgs)
    K._gemm1_kernel[(grid_m, triton.cdiv(I, cfg.BN1))](
        x, w13, w13_scale, w13_scale_2.contiguous(), rows_ptr, blocks_ptr, h,
        P, topk, H, I,
        x.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1),
        float(swiglu_limit) if has_limit else 0.0,
        HAS_LIMIT=has_limit, BM=BM, BN=cfg.BN1, BK=cfg.BK1, PATH_FP4=fp4, NATIVE=native,
        INTERP=interp, DEQ=cfg.deq, ALOAD_SPLIT=cfg.aload_split, **grp, **pre1,
        num_warps=cfg.warps1, num_stages=cfg.stages)
    if apre:
        # the h rows of real pairs (grouped: all P rows; aligned: the sorted order's non-padding rows)
        hq, hs, hgs = _quantize_rows(h, h_rows, I, cfg.BK2, cfg.aload_split,
                                     None if grouped else rows_ptr, P)
        pre2 = dict(APRE=True, hq_ptr=hq, hs_ptr=hs, hgs_ptr=hgs)
    K._gemm2_kernel[(grid_m, triton.cdiv(H, cfg.BN2))](
        h, w2, w2_scale, w2_scale_2.contiguous(), rows_ptr, blocks_ptr, tw, y,
        P, H, I,
        w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        BM=BM, BN=cfg.BN2, BK=cfg.BK2, PATH_FP4=fp4, NATIVE=native, INTERP=interp, DEQ=cfg.deq,
        ALOAD_SPLIT=cfg.aload_split, **grp, **pre2, num_warps=cfg.warps2, num_stages=cfg.stages)
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
