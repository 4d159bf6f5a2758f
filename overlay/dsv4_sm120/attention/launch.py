"""Host side of the sparse MLA decode: argument checks, the launch plan (``launch_plan.plan_call``: the QK mode,
the launch keys, the row chunks and their resolved launches), the workspace, and the two kernel launches (split
body, combine).

No host synchronization, no data-dependent shapes: the launch depends only on the shapes and the device, and the
workspace is a grow-only per-device buffer (a fresh graph-pool allocation under CUDA-graph capture), so a call
can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .config import DecodeInputError, Device, Launch
from .keys import GPU_ONLY_IMPLS, WGMMA_IMPLS, producer_regs
from .kernels import SPLIT_KERNELS, combine_kernel, q_fp8_kernel
from .launch_plan import interpreting, plan_call, row_chunks
from .plan import balanced_sizes, cdiv, plan_span, plan_splits, ws_words

__all__ = ["sparse_mla_decode", "DecodeInputError", "plan_splits", "plan_span", "device_facts", "row_chunks",
           "interpreting"]

LOG2E = 1.4426950408889634
BYTES_PER_TOKEN = 584

# Device facts the launches are resolved with instead of the GPU's own, for benchmarks that time another
# architecture's launch on this GPU (bench_attention.py --device-table arch_sm_120: the launch an sm_120 GPU with this
# GPU's SM count resolves); None in production.
DEVICE_OVERRIDE: Optional[Device] = None

_DEVICES: Dict[int, Device] = {}
_WORKSPACE: Dict[str, torch.Tensor] = {}


def device_facts(device: torch.device) -> Device:
    """Name, compute capability and SM count of ``device`` (``cpu``: no capability, 4 SMs), cached per GPU;
    ``DEVICE_OVERRIDE`` where a benchmark set it."""
    if device.type != "cuda":
        return Device("cpu", None, 4)
    if DEVICE_OVERRIDE is not None:
        return DEVICE_OVERRIDE
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _DEVICES:
        p = torch.cuda.get_device_properties(i)
        _DEVICES[i] = Device(p.name, (p.major, p.minor), p.multi_processor_count)
    return _DEVICES[i]


def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    """fp32 workspace for the partial results.

    Eager calls reuse one grow-only buffer per device. Under CUDA-graph capture the workspace is a fresh
    allocation from the graph's memory pool instead: a graph must never point into the shared eager buffer,
    which a later, larger eager call may replace (and free)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.empty(numel, dtype=torch.float32, device=device)
    key = str(device)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        _WORKSPACE.pop(key, None)
        with torch.inference_mode(False):
            buf = torch.empty(max(numel, 1 << 16), dtype=torch.float32, device=device)
        _WORKSPACE[key] = buf
    return buf


def poison_workspace(value: float = float("nan")) -> None:
    """Fill every cached workspace with ``value`` (tests: a kernel that reads a partial it did not write fails)."""
    for buf in _WORKSPACE.values():
        buf.fill_(value)


# ---- argument checks


def _cache_params(k_cache: torch.Tensor, name: str):
    if k_cache.ndim == 3:
        k_cache = k_cache.unsqueeze(2)
    if k_cache.ndim != 4 or k_cache.shape[2] != 1 or k_cache.shape[3] != BYTES_PER_TOKEN:
        raise DecodeInputError(
            f"{name} must be the DeepSeek-V4 page view [num_pages, page_size, 1, 584], got {tuple(k_cache.shape)}")
    if k_cache.element_size() != 1:
        raise DecodeInputError(f"{name} must have a 1-byte dtype (float8_e4m3fn/uint8), got {k_cache.dtype}")
    P = k_cache.shape[1]
    PB = k_cache.stride(0)
    if P < 1 or PB < P * BYTES_PER_TOKEN or PB % 2 != 0 or k_cache.stride(1) != BYTES_PER_TOKEN:
        raise DecodeInputError(
            f"{name}: page stride {PB} / token stride {k_cache.stride(1)} do not fit page size {P} in the V4 layout")
    return k_cache.view(torch.uint8), P, PB


def _indices(ind: torch.Tensor, T: int, name: str) -> torch.Tensor:
    if ind.ndim == 2:
        ind = ind.unsqueeze(1)
    if ind.ndim != 3 or ind.shape[0] != T or ind.shape[1] != 1:
        raise DecodeInputError(f"{name} must be [T, 1, K] with T={T}, got {tuple(ind.shape)}")
    if ind.dtype not in (torch.int32, torch.int64):
        raise DecodeInputError(f"{name} must be int32/int64, got {ind.dtype}")
    if ind.dtype != torch.int32:
        ind = ind.to(torch.int32)
    if ind.stride(2) != 1:
        ind = ind.contiguous()
    return ind


def _lengths(x, T: int, name: str):
    if x is None:
        return None
    if x.numel() != T:
        raise DecodeInputError(f"{name} must have T={T} entries, got shape {tuple(x.shape)}")
    x = x.reshape(T)
    if x.dtype != torch.int32:
        x = x.to(torch.int32)
    return x.contiguous()


# ---- launches


def writes_output(L: Launch) -> bool:
    """Whether the split launch of ``L`` writes ``out`` / ``lse`` itself (the warpgroup-MMA body with one split per
    row), so no combine follows it."""
    s1, _, s2, _ = L.plan
    return L.config["impl"] in WGMMA_IMPLS and s1 + s2 == 1


def balanced(L: Launch) -> bool:
    """Whether ``L`` is a balanced launch (``plan.plan_balanced``): its split programs write the rows they hold
    whole and the combine merges the others."""
    return bool(L.config.get("balanced", 0))


def balanced_grid(L: Launch, T: int, H: int, device) -> Tuple[int, int, int]:
    """``(C, NB, W)`` of the balanced launch ``L`` over ``T`` rows (``plan.plan_balanced``; its plan's chunk is a
    whole row): programs, blocks per grid row, blocks."""
    return balanced_sizes(T, cdiv(H, L.config["BLOCK_H"]), L.plan[1], device_facts(device).num_sms)


def _launch_split(L: Launch, q, main, extra, acc_ws, m_ws, l_ws, H: int, HP: int, fp8: bool, softmax_scale: float,
                  interp: bool, final=None) -> None:
    """The split launch of ``L``; ``final`` = ``(out, lse, attn_sink)`` where it writes the output itself
    (``writes_output``)."""
    cfg = L.config
    s1, c1, s2, c2 = L.plan
    T = q.shape[0]
    BH = cfg["BLOCK_H"]
    HG = HP // BH
    main_u8, idx1, len1, K1, P1, PB1 = main
    extra_u8, idx2, len2, K2, P2, PB2 = extra
    qa = (q, q.stride(0), q.stride(2))
    main_a = (main_u8, idx1, idx1.stride(0), len1 if len1 is not None else idx1, K1, P1, PB1, PB1 // 2)
    extra_a = (extra_u8, idx2, idx2.stride(0), len2 if len2 is not None else idx2, K2, P2, PB2, PB2 // 2)
    ws_a = (acc_ws, m_ws, l_ws, H, s1 + s2, HP, float(softmax_scale) * LOG2E)
    # the Triton bodies: per-cache split counts and chunks; the Gluon ones: spanning splits of c1 candidates only
    args = (*qa, *main_a, s1, c1, *extra_a, c2, *ws_a)
    span_args = (*qa, *main_a, *extra_a, c1, *ws_a)
    flags = dict(HAS_MAIN_LEN=len1 is not None, HAS_EXTRA=K2 > 0, HAS_EXTRA_LEN=len2 is not None, BLOCK_H=BH,
                 BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if cfg["maxnreg"]:
        flags["maxnreg"] = cfg["maxnreg"]
    impl = cfg["impl"]
    if impl not in GPU_ONLY_IMPLS:
        flags.update(FP8_QK=fp8, INTERP=interp)
    if impl == "tiled":
        if fp8:
            # the fp8 path's Q quantization once per (row, head), not once per candidate block
            q8 = torch.empty((T * HP * 448,), dtype=torch.uint8, device=q.device)
            qsc = torch.empty((T * HP * 14,), dtype=torch.uint8, device=q.device)
            q_fp8_kernel[(T, HG)](q, q.stride(0), q.stride(2), q8, qsc, H, HP, BLOCK_H=BH, INTERP=interp, num_warps=4)
            flags.update(q8_ptr=q8, qsc_ptr=qsc)
        SPLIT_KERNELS["tiled"][(T, s1 + s2, HG)](*args, PREFETCH=cfg["PREFETCH"], KCVT=bool(cfg["e4m3_int_decode"]),
                                                 **flags)
    elif impl == "reg":
        SPLIT_KERNELS["reg"][(T, s1 + s2, HG)](*args, KCVT=bool(cfg["e4m3_int_decode"]),
                                               DEC_LATE=bool(cfg["late_decode"]),
                                               SPAN=bool(cfg["spanning_splits"]), **flags)
    elif impl in GPU_ONLY_IMPLS:
        if impl not in SPLIT_KERNELS:
            raise DecodeInputError(f"impl={impl} is a Gluon kernel and this Triton has no Gluon "
                                   "(triton.experimental.gluon) or not its Hopper module; use another impl")
        if final is not None:
            out, lse, sink = final
            flags.update(out_ptr=out, lse_ptr=lse, sink_ptr=sink if sink is not None else m_ws, FINAL=not balanced(L),
                         HAS_SINK=sink is not None)
        if balanced(L):
            C, NB, W = balanced_grid(L, T, H, q.device)
            SPLIT_KERNELS[impl][(C,)](*span_args, PRODUCER_REGS=producer_regs(impl, cfg["maxnreg"]), NB=NB, W=W, C=C,
                                      BALANCED=True, **flags)
            return
        if impl == "wgmma":
            # the output / partial through shared memory where most of a program's 64 head rows are real (with 16
            # heads the direct stores of 16 rows cost less than staging 64: H200, 384 rows, 99.6 against 109.5 us)
            flags["STAGE_OUT"] = H > 16
        if impl == "wspec":
            flags["CWARPS"] = cfg["num_warps"]   # the consumer warps (the default partition)
        SPLIT_KERNELS[impl][(T, s1 + s2, HG)](*span_args, PRODUCER_REGS=producer_regs(impl, cfg["maxnreg"], BH),
                                              **flags)
    else:
        SPLIT_KERNELS["flat"][(T, s1 + s2, HG)](*args, **flags)


def launch_combine(L: Launch, acc_ws, m_ws, l_ws, attn_sink, out, lse, H: int, HP: int, interp: bool) -> None:
    """Merge the ``S`` partials of each (row, head) (workspace rows ``(t*S + s)*HP + h``; ``acc_ws`` fp32 or bf16,
    512 values a row) with the sink into ``out`` [T, 1, H, 512] bf16 and ``lse`` [T, H, 1], with the combine keys
    of ``L.config`` and ``S`` from ``L.plan``."""
    cfg = L.config
    s1, _, s2, _ = L.plan
    T = out.shape[0]
    extra = {}
    if cfg["combine_maxnreg"] and not interp:
        extra["maxnreg"] = cfg["combine_maxnreg"]
    if balanced(L):
        # only the rows cut between programs, each with its own count of partials
        C, NB, W = balanced_grid(L, T, H, out.device)
        extra.update(BALANCED=True, NB=NB, W=W, C=C, BH=cfg["BLOCK_H"])
    combine_kernel[(T, H, 512 // cfg["BLOCK_D"])](
        acc_ws, m_ws, l_ws, attn_sink if attn_sink is not None else m_ws, out, lse, H, s1 + s2, HP,
        HAS_SINK=attn_sink is not None, BLOCK_D=cfg["BLOCK_D"], BLOCK_S=cfg["BLOCK_S"],
        num_warps=cfg["combine_warps"], **extra,
    )


def _run(L: Launch, q, main, extra, attn_sink, softmax_scale, fp8, out, lse, H: int, interp: bool) -> None:
    cfg = L.config
    s1, _, s2, _ = L.plan
    T = q.shape[0]
    HP = cdiv(H, cfg["BLOCK_H"]) * cfg["BLOCK_H"]
    nrow = T * (s1 + s2) * HP
    ws = _workspace(q.device, nrow * ws_words(cfg["impl"], cfg.get("PART_BF16", 0)))
    if ws_words(cfg["impl"], cfg.get("PART_BF16", 0)) == 258:
        acc_ws = ws[: nrow * 256].view(torch.bfloat16)
        m_ws, l_ws = ws[nrow * 256: nrow * 257], ws[nrow * 257: nrow * 258]
    else:
        acc_ws = ws[: nrow * 512]
        m_ws, l_ws = ws[nrow * 512: nrow * 513], ws[nrow * 513: nrow * 514]
    # the split programs write the rows they hold whole themselves (one split, or a balanced plan); the combine
    # merges the rest
    final = (out, lse, attn_sink) if writes_output(L) or balanced(L) else None
    _launch_split(L, q, main, extra, acc_ws, m_ws, l_ws, H, HP, fp8, softmax_scale, interp, final=final)
    if not writes_output(L):
        launch_combine(L, acc_ws, m_ws, l_ws, attn_sink, out, lse, H, HP, interp)


def sparse_mla_decode(
    q,
    k_cache,
    indices,
    topk_length=None,
    attn_sink=None,
    head_dim_v=512,
    softmax_scale=None,
    extra_k_cache=None,
    extra_indices_in_kvcache=None,
    extra_topk_length=None,
    *,
    qk_mode=None,
    launch=None,
):
    """Sparse MLA decode over DeepSeek-V4 FP8 paged caches; see the package docstring.

    ``launch``: launch keys for this call only (text as in ``DSV4_SM120_ATTN_CONFIG``, e.g. ``"impl=tiled"``, or a
    mapping), applied over the environment's; the SGLang glue passes a machine profile's launch variant this way,
    benchmarks and calibration their variants (``launch_plan.plan_call``)."""
    if not isinstance(q, torch.Tensor) or q.ndim != 4 or q.shape[1] != 1 or q.shape[3] != 512:
        raise DecodeInputError(f"q must be [T, 1, H, 512], got {getattr(q, 'shape', type(q))}")
    if q.dtype != torch.bfloat16:
        raise DecodeInputError(f"q must be bfloat16, got {q.dtype}")
    if head_dim_v != 512:
        raise DecodeInputError(f"head_dim_v must be 512 for DeepSeek-V4, got {head_dim_v}")
    T, _, H, D = q.shape
    if H < 1:
        raise DecodeInputError("q has no heads")
    if q.stride(3) != 1:
        q = q.contiguous()
    main_u8, P1, PB1 = _cache_params(k_cache, "k_cache")
    idx1 = _indices(indices, T, "indices")
    len1 = _lengths(topk_length, T, "topk_length")
    if extra_k_cache is not None and extra_indices_in_kvcache is not None:
        extra_u8, P2, PB2 = _cache_params(extra_k_cache, "extra_k_cache")
        idx2 = _indices(extra_indices_in_kvcache, T, "extra_indices_in_kvcache")
        len2 = _lengths(extra_topk_length, T, "extra_topk_length")
        K2 = idx2.shape[2]
    else:
        extra_u8, P2, PB2, idx2, len2, K2 = main_u8, P1, PB1, idx1, None, 0
    K1 = idx1.shape[2]
    if attn_sink is not None:
        if attn_sink.numel() < H:
            raise DecodeInputError(f"attn_sink must have at least H={H} entries, got {attn_sink.numel()}")
        attn_sink = attn_sink.reshape(-1)
        if attn_sink.dtype != torch.float32:
            attn_sink = attn_sink.float()
        if attn_sink.stride(0) != 1:
            attn_sink = attn_sink.contiguous()
    if softmax_scale is None:
        softmax_scale = D ** (-0.5)

    out = torch.empty((T, 1, H, 512), dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((T, H, 1), dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse

    # the launch plan (launch_plan.plan_call): QK mode, launch keys over the tables, and rows per launch bounded so
    # the workspace stays under DSV4_SM120_ATTN_WS_MB (only huge T, prefill through this kernel, is cut; decode /
    # verify batches run in one launch)
    plan = plan_call(H, T, device_facts(q.device), K1, K2, qk=qk_mode, launch=launch)
    interp = plan.interpret
    for t0, t1, L, _ in plan.chunks:
        sl = slice(t0, t1)
        main = (main_u8, idx1[sl], None if len1 is None else len1[sl], K1, P1, PB1)
        extra = (extra_u8, idx2[sl], None if len2 is None else len2[sl], K2, P2, PB2)
        _run(L, q[sl], main, extra, attn_sink, softmax_scale, plan.qk == "fp8", out[sl], lse[sl], H, interp)
    return out, lse
