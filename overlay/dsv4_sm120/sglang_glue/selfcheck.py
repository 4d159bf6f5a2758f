"""Startup self-check: each of our kernels that will serve runs on this GPU at live shapes against the stock
implementation; what raises or misses the tolerance steps aside to the stock path in this process. The log names
the kernel, the shape and the error. ``DSV4_SM120_SELFCHECK=0`` skips it.

* Attention (:func:`run`): every distinct launch of our kernel that the given rows reach runs once. With CUDA
  graphs the rows are those the capture loop is about to capture (each capture batch size times the runner's
  rows per request: the draft tokens per request for target-verify and draft-extend), passed by the patched
  capture loop (patch 0006, :mod:`.graphs`) for each runner; without graphs, the first attention call outside
  capture checks ``T = 2`` rows. For each per-rank head count and each layout our kernel serves (SWA only / + c4
  / + c128), every row count ``T`` is mapped to the launches a call of ``T`` rows runs (:func:`call_launches`:
  the resolved launch keys of each row chunk and whether its split count is 1 or a multiple of 16, the integer
  specializations Triton compiles separately), and the smallest ``T`` that reaches a launch not yet checked in
  this process runs it: our kernel (the exact function serving calls, :func:`.attention.run_dsv4_kernel`) over random
  caches in the real page layout (SWA pages of 256 tokens, c4 pages of 64, c128 pages of 2;
  :mod:`dsv4_sm120.attention.cache`) with the real candidate counts (SWA 128, c4 512, c128 from the context
  length), up to :data:`SAMPLE_ROWS` of its rows compared with SGLang's torch path ``_sm120_sparse_decode_fwd``
  (exact; the float64 reference where SGLang is absent). Tolerance: relative Frobenius error 2e-2 (5e-2 for
  block-scaled QK), as ``make calibrate``'s gate (:mod:`dsv4_sm120.tolerances`). A launch that raises or misses
  takes the rows that reach it to the stock path (:func:`.attention.step_aside`: their launch-table entry, before
  any capture); rows whose launches passed keep our kernel; when every launch checked fails, our kernel is disabled
  for every row. With tensor parallelism the capture loop then has the ranks take the union of their fallbacks
  (:mod:`.graphs`); the first-call check without graphs stays per rank (it changes no collective, and no graph).
  ``python -m dsv4_sm120.sglang_glue.selfcheck --time`` runs the same set for given heads, capture sizes and
  draft tokens without SGLang and prints its seconds (docs/calibrate.md).
* MoE (:func:`check_moe`, at the first ``dsv4_triton_nvfp4`` layer's ``prepare_layer``, i.e. after its weights
  loaded and before capture): our NVFP4 runner on that layer's own weights, two tokens routed to random
  experts, against the float64 reference of the same dequantized experts (tolerance 0.3, ``make calibrate``'s
  NVFP4 gate). SGLang fixed the MoE runner server-wide when it built the layers, so no stock runner can take
  over here; the fallback is our kernel's other compute path (``DSV4_SM120_MOE_PATH``: ``fp4`` <-> ``bf16``),
  checked the same way. The ranks of the tensor-parallel group agree on each path's outcome (a path that fails on
  any rank is left on every rank); when both fail every rank stops with one line naming the ranks and
  ``DSV4_SM120_MOE_BACKEND=flashinfer_cutlass`` (:class:`~dsv4_sm120.rank_agreement.StopServer`). A serving call
  that raises takes the same fallback on its rank (:func:`moe_step_aside`).

Fault injection for tests (``DSV4_SM120_TEST_SELFCHECK_FAULT``, on the ranks of ``DSV4_SM120_TEST_FAULT_RANKS``,
default every rank): ``attention`` / ``moe`` make our kernel's result wrong (scaled by 2; for the MoE only on its
first path); ``attention-raise`` / ``attention-raise-T=<n>`` make our attention kernel raise (every call / calls of
n rows); ``moe-raise`` makes our MoE kernel raise on its first path.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Dict, Iterable, List, Optional, Sequence

from dsv4_sm120 import settings, tolerances

logger = logging.getLogger(__name__)

ATTN_TOL = tolerances.ATTN_BF16
ATTN_TOL_FP8QK = tolerances.ATTN_FP8QK
MOE_TOL = tolerances.MOE["nvfp4"]
ROWS = 2            # rows checked when the capture rows are unknown (no CUDA graphs)
SAMPLE_ROWS = 8     # rows of a case compared with the reference (first, last and spread between)
MOE_TOKENS = 2
SWA_PAGE, C4_PAGE, C128_PAGE = 256, 64, 2

_lock = threading.RLock()
_state: Dict[str, object] = {"attention": None, "moe": None, "skipped_logged": False, "checked": {}}


def enabled() -> bool:
    return bool(settings.get("DSV4_SM120_SELFCHECK"))


def done() -> bool:
    """Whether the attention self-check ran (or was switched off) in this process."""
    return _state["attention"] is not None or not enabled()


def results() -> Dict[str, object]:
    """``{"attention": [case dicts] or None, "moe": dict or None}`` of this process."""
    return {"attention": _state["attention"], "moe": _state["moe"]}


def reset() -> None:
    with _lock:
        _state.update(attention=None, moe=None, skipped_logged=False, checked={})
        for k in ("moe_fallback", "moe_fallbacks", "moe_fallback_why"):
            _state.pop(k, None)


def skipped(reason: str) -> None:
    if not _state["skipped_logged"]:
        _state["skipped_logged"] = True
        logger.warning("dsv4_sm120 self-check: not run (%s); our kernels serve unchecked", reason)


def first_call(q, num_heads: int) -> None:
    """The attention self-check at the first call of :func:`.attention.sparse_attention` on a GPU (once per
    process; skipped, with a warning, when that call is inside CUDA-graph capture)."""
    if q.device.type != "cuda" or done():
        return
    import torch

    if torch.cuda.is_current_stream_capturing():
        skipped("the first attention call is inside CUDA-graph capture")
        return
    run(heads=[num_heads], device=q.device)


# ---------------------------------------------------------------------------- attention

def c128_topk(context_len: int) -> int:
    """Candidates per row of a c128 layer at ``context_len``: ceil64(2 * ceil(context / 256))."""
    return 64 * math.ceil(2 * math.ceil(int(context_len) / 256) / 64)


def _interpreting() -> bool:
    from dsv4_sm120.attention.launch_plan import interpreting

    return interpreting()


def _sizes(device, context_len: Optional[int] = None) -> Dict[str, int]:
    """Candidates per row: SWA (``K1``), c4 and c128. Small under the interpreter or off CUDA."""
    if _interpreting() or getattr(device, "type", "cpu") != "cuda":
        return {"K1": 16, "swa_c4": 16, "swa_c128": 8}
    return {"K1": 128, "swa_c4": 512, "swa_c128": c128_topk(context_len) if context_len else 64}


def _pages(n: int, page: int, g, device, pool: Optional[dict]):
    from dsv4_sm120.attention.cache import random_cache

    key = (n, page, str(device))
    if pool is not None and key in pool:
        return pool[key]
    view = random_cache(n, page, generator=g, mode="bytes").view.to(device)
    if pool is not None:
        pool[key] = view
    return view


def attention_case(layout: str, T: int, H: int, device, seed: int = 0, sizes: Optional[Dict[str, int]] = None,
                   pool: Optional[dict] = None) -> dict:
    """Inputs of one attention call: ``q [T,1,H,512]`` bf16 and the keyword arguments SGLang passes (caches in the
    real page layout, some invalid slots, per-row lengths, a sink). The caches hold a fixed number of pages
    whatever ``T`` (rows draw their candidates from them), so a case of many rows stays cheap to build; ``pool``
    (a dict) shares them between the cases of one check."""
    import torch

    g = torch.Generator().manual_seed(seed)
    sz = sizes or _sizes(torch.device(device))
    K1 = sz["K1"]
    n_main = max(2, -(-2 * K1 // SWA_PAGE))
    main = _pages(n_main, SWA_PAGE, g, device, pool)
    idx = torch.randint(0, n_main * SWA_PAGE, (T, K1), generator=g, dtype=torch.int32)
    idx[:, -1] = -1                                   # an invalid slot in every row
    kw = dict(k_cache=main, indices=idx.view(T, 1, K1).to(device),
              topk_length=torch.full((T,), K1, dtype=torch.int32).to(device))
    if layout != "swa":
        page = C4_PAGE if layout == "swa_c4" else C128_PAGE
        K2 = sz[layout]
        pages = -(-2 * K2 // page)
        extra = _pages(pages, page, g, device, pool)
        e = torch.randint(0, pages * page, (T, K2), generator=g, dtype=torch.int32)
        kw.update(extra_k_cache=extra, extra_indices_in_kvcache=e.view(T, 1, K2).to(device),
                  extra_topk_length=(K2 - 1 - torch.arange(T, dtype=torch.int32) % 3).to(device))
    q = torch.randn(T, 1, H, 512, generator=g).to(torch.bfloat16).to(device)
    kw.update(attn_sink=torch.randn(H, generator=g).to(device), head_dim_v=512, softmax_scale=512 ** -0.5)
    return {"q": q, "kw": kw, "K1": K1, "K2": kw["extra_indices_in_kvcache"].shape[-1] if layout != "swa" else 0}


def stock_reference(q, kw):
    """SGLang's torch path on the same call (exact), or the float64 reference where SGLang does not import."""
    try:
        from sglang.kernels.ops.attention.flash_mla_sm120 import _sm120_sparse_decode_fwd
    except Exception:  # noqa: BLE001
        from dsv4_sm120.attention.reference import sparse_mla_decode_ref

        return sparse_mla_decode_ref(q, **kw)[0]
    return _sm120_sparse_decode_fwd(q, kw["k_cache"], kw["indices"], kw.get("topk_length"), kw.get("attn_sink"),
                                    kw["head_dim_v"], kw["softmax_scale"], kw.get("extra_k_cache"),
                                    kw.get("extra_indices_in_kvcache"), kw.get("extra_topk_length"))[0]


def sample_rows(T: int) -> List[int]:
    """The rows of a ``T``-row case compared with the reference: all up to :data:`SAMPLE_ROWS`, else the first
    two, the last two and rows spread evenly between."""
    if T <= SAMPLE_ROWS:
        return list(range(T))
    inner = SAMPLE_ROWS - 4
    mid = [2 + (T - 4) * (i + 1) // (inner + 1) for i in range(inner)]
    return sorted({0, 1, T - 2, T - 1, *mid})


def _row_slice(kw: dict, rows) -> dict:
    out = dict(kw)
    for k in ("indices", "topk_length", "extra_indices_in_kvcache", "extra_topk_length"):
        if out.get(k) is not None:
            out[k] = out[k][rows]
    return out


def call_launches(layout: str, T: int, H: int, K1: int, K2: int, route, device) -> tuple:
    """The kernel launches a call of ``T`` rows runs through our kernel with ``route``'s launch keys and QK mode:
    per row chunk, the split kernel ``("split", layout, H, qk, its resolved keys, S == 1, S % 16 == 0)`` and the
    combine kernel ``("combine", its resolved keys, S == 1, S % 16 == 0)`` (``S``: the split count, whose integer
    specializations Triton compiles separately; the combine does not depend on the layout). Host-only (the launch
    resolution; no GPU work)."""
    from dsv4_sm120.attention.config import COMBINE_KEYS
    from dsv4_sm120.attention.launch_plan import plan_call

    from .attention import _device_facts

    plan = plan_call(int(H), int(T), _device_facts(device), int(K1), int(K2), qk=route.qk, launch=route.launch)
    keys = []
    for chunk in plan.chunks:
        launch = chunk.launch
        S = launch.plan[0] + launch.plan[2]
        split = tuple(sorted((k, v) for k, v in launch.config.items() if k not in COMBINE_KEYS))
        comb = tuple(sorted((k, v) for k, v in launch.config.items() if k in COMBINE_KEYS))
        keys.append(("split", layout, int(H), plan.qk, split, S == 1, S % 16 == 0))
        keys.append(("combine", int(H) % 16 == 0, comb, S == 1, S % 16 == 0))
    return tuple(dict.fromkeys(keys))


def plan_attention(heads: Sequence[int], rows: Iterable[int], device, sizes: Dict[str, int],
                   skip: Optional[dict] = None, layouts: Optional[Sequence[str]] = None) -> List[dict]:
    """The cases of the attention check: per head count and layout our kernel serves, the smallest row count of
    ``rows`` for each launch (:func:`call_launches`) not yet in ``skip``. Each case lists every row count
    whose launches include one of its new launches (``rows``; ``other_rows``: ``(layout, T)`` of other layouts
    that share its combine kernel), the rows that step aside if it fails."""
    from . import attention as A

    skip = skip or {}
    cases: List[dict] = []
    rows = sorted({int(t) for t in rows if int(t) > 0})
    for H in sorted({int(h) for h in heads if h}):
        for lay in [x for x in A.LAYOUTS if layouts is None or x in layouts]:
            mine: List[dict] = []
            for T in rows:
                r = A.call_route(T, lay, H)
                if r.backend != "dsv4":
                    continue
                try:
                    keys = call_launches(lay, T, H, sizes["K1"], sizes.get(lay, 0), r, device)
                except Exception as e:  # noqa: BLE001 - no launch: the case runs and fails like a serving call
                    keys = ((lay, H, "error", T, type(e).__name__),)
                new = [k for k in keys if k not in skip and not any(k in c["new"] for c in cases + mine)]
                if new:
                    mine.append({"layout": lay, "H": H, "T": T, "route": r, "keys": keys, "new": new, "rows": [T],
                                 "other_rows": []})
                for c in cases + mine:
                    if (c["layout"], c["T"]) != (lay, T) and any(k in c["new"] for k in keys):
                        (c["rows"] if c["layout"] == lay else c["other_rows"]).append(
                            T if c["layout"] == lay else (lay, T))
            cases.extend(mine)
    return cases


def _qk_is_fp8(qk: Optional[str]) -> bool:
    """Whether our kernel runs block-scaled QK for a route's ``qk``: the route's own (a profile winner
    ``dsv4+fp8qk``), else ``DSV4_SM120_ATTN_QK``, as the kernel resolves it."""
    from dsv4_sm120.attention.config import DecodeInputError
    from dsv4_sm120.attention.launch_plan import settle_qk

    try:
        return settle_qk(qk)[0] == "fp8"
    except DecodeInputError:    # an unknown QK mode: the kernel refuses it too, nothing runs block-scaled
        return False


def _check_one(case: dict, device, seed: int, sizes: Dict[str, int], pool: Optional[dict] = None) -> dict:
    import torch

    from dsv4_sm120.attention.reference import rel_fro

    from .attention import run_dsv4_kernel

    layout, H, T, r = case["layout"], case["H"], case["T"], case["route"]
    launch, qk = r.launch, r.qk
    t0 = time.monotonic()
    fp8 = _qk_is_fp8(qk)
    tol = ATTN_TOL_FP8QK if fp8 else ATTN_TOL
    res = {"kernel": "attention", "layout": layout, "H": H, "T": T, "rows": list(case["rows"]),
           "other_rows": list(case.get("other_rows", [])),
           "launches": len(case["new"]), "tol": tol, "err": None, "ok": False, "error": None}

    def shape(K1="?", K2=0):
        return (f"{layout} T={T} H={H} K={K1}" + (f"+{K2}" if K2 else "") + f" launch={launch or 'default'}"
                + (" qk=fp8" if fp8 else ""))

    res["shape"] = shape()
    try:            # building the case is inside: a case that cannot be built fails the launch, never the server
        c = attention_case(layout, T, H, device, seed, sizes, pool)
        res["shape"] = shape(c["K1"], c["K2"])
        out = run_dsv4_kernel(c["q"], H, c["kw"], launch, qk)
        pick = torch.tensor(sample_rows(T), dtype=torch.long, device=c["q"].device)
        ref = stock_reference(c["q"][pick], _row_slice(c["kw"], pick))
        err = rel_fro(out[pick][:, :, :H], ref[:, :, :H])
        res["err"] = err
        res["ok"] = err <= tol          # NaN compares False
        if not res["ok"]:
            res["error"] = f"relative error {err:.3g} > tolerance {tol:g}"
    except Exception as e:  # noqa: BLE001 - any failure of ours means the stock path serves
        res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    res["seconds"] = time.monotonic() - t0
    return res


def run(heads: Sequence[int], device, force: bool = False, rows: Optional[Iterable[int]] = None,
        context_len: Optional[int] = None, label: str = "", layouts: Optional[Sequence[str]] = None) -> List[dict]:
    """The attention self-check (module doc) over ``rows`` (default: ``T = 2``) for ``heads`` and ``layouts``
    (default: all three). Launches checked earlier in this process are not run again; without ``rows``, it runs
    once per process (``force``: again). Returns the cases of this process so far."""
    with _lock:
        if not enabled():
            return []
        if rows is None and _state["attention"] is not None and not force:
            return _state["attention"]
        if force:
            _state["checked"] = {}
        from . import attention as A
        t0 = time.monotonic()
        import torch

        device = torch.device(device)
        sizes = _sizes(device, context_len)
        rows = [ROWS] if rows is None else sorted({int(t) for t in rows})
        checked: Dict[tuple, Optional[str]] = _state["checked"]      # launch -> None (passed) or why it failed
        cases_so_far: List[dict] = [] if force or _state["attention"] is None else list(_state["attention"])
        plan = plan_attention(heads, rows, device, sizes, skip=checked, layouts=layouts) if heads else []
        if not plan and not cases_so_far:
            logger.info("dsv4_sm120 self-check: our attention kernel does not serve here; nothing to check")
        new_cases, pool = [], {}
        for i, case in enumerate(plan):
            res = _check_one(case, device, seed=1000 * case["H"] + 10 * A.LAYOUTS.index(case["layout"]) + i,
                             sizes=sizes, pool=pool)
            new_cases.append(res)
            for k in case["new"]:
                checked[k] = None if res["ok"] else f"{res['shape']}: {res['error']}"
        _state["attention"] = cases_so_far + new_cases
        failed = [c for c in new_cases if not c["ok"]]
        for c, case in zip(new_cases, plan):
            if c["ok"]:
                continue
            logger.error("dsv4_sm120 self-check: our attention kernel FAILED at %s: %s; rows %s of %s H=%d step aside "
                         "to SGLang's stock path (their launch), the other rows keep our kernel", c["shape"],
                         c["error"], _rows_text(c["rows"]), c["layout"], c["H"])
            for lay, T in [(c["layout"], t) for t in c["rows"]] + [tuple(x) for x in c["other_rows"]]:
                A.step_aside(T, lay, c["H"], A.attention_route(T, lay), device, c["error"], during="self-check",
                             log=False)
        all_cases = _state["attention"]
        if all_cases and all(not c["ok"] for c in all_cases) and A.disabled("attention") is None:
            logger.error("dsv4_sm120 self-check: every launch of our attention kernel failed; disabled in this "
                         "process, SGLang's stock path serves instead")
            A.disable("attention", f"{failed[0]['shape']}: {failed[0]['error']}" if failed else "self-check failed")
        if failed:
            A.relog()
        dt = time.monotonic() - t0
        if new_cases:
            ok = [c for c in new_cases if c["ok"]]
            logger.info("dsv4_sm120 self-check%s: attention %d launches over rows %s: %d ok (max error %s), %d failed, "
                        "in %.2f s", f" ({label})" if label else "", len(new_cases), _rows_text(rows), len(ok),
                        f"{max(c['err'] for c in ok):.2g}" if ok else "-", len(failed), dt)
        return _state["attention"]


def _rows_text(rows) -> str:
    rows = sorted(rows)
    return ",".join(map(str, rows)) if len(rows) <= 12 else f"{','.join(map(str, rows[:6]))},...,{rows[-1]} " \
        f"({len(rows)} counts)"


def model_heads(model) -> List[int]:
    """The per-rank query head counts of the model's attention layers (``n_local_heads``)."""
    if model is None:
        return []
    return sorted({int(m.n_local_heads) for m in model.modules()
                   if hasattr(m, "n_local_heads") and hasattr(m, "compress_ratio")})


def model_layouts(model) -> List[str]:
    """The layouts of the model's attention layers (compress ratio 0 -> ``swa``, 4 -> ``swa_c4``, 128 ->
    ``swa_c128``; an MTP draft model has only ``swa``); all three when a ratio is not one of those."""
    names = {0: "swa", 4: "swa_c4", 128: "swa_c128"}
    ratios = {getattr(m, "compress_ratio", None) for m in model.modules()
              if hasattr(m, "n_local_heads") and hasattr(m, "compress_ratio")} if model is not None else set()
    if not ratios or any(r not in names for r in ratios):
        return list(names.values())
    return [names[r] for r in sorted(ratios)]


def before_graph_capture(model_runner=None) -> List[dict]:
    """Called by the patched backend's ``init_cuda_graph_state`` (patch 0002) before CUDA-graph capture: log the
    attention decisions. The check itself runs at the start of each runner's capture loop, with the rows it
    captures (:func:`run_for_runner`, from :mod:`.graphs`)."""
    from . import attention

    attention.log_decisions()
    return []


def _runner_device(model_runner):
    import torch

    dev = getattr(model_runner, "device", "cuda")
    if str(dev) == "cuda" and hasattr(model_runner, "gpu_id"):
        return torch.device(dev, int(model_runner.gpu_id))
    return torch.device(dev)


def _context_len(model_runner) -> Optional[int]:
    for obj in (getattr(model_runner, "model_config", None), getattr(model_runner, "server_args", None)):
        v = getattr(obj, "context_len", None) or getattr(obj, "context_length", None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def run_for_runner(model_runner, rows: Optional[Iterable[int]] = None, label: str = "") -> List[dict]:
    """:func:`run` with the heads of ``model_runner.model`` on its device, over ``rows`` (the rows a CUDA-graph
    runner captures) and the c128 candidates of its context length."""
    if model_runner is None or not enabled():
        return []
    heads = model_heads(getattr(model_runner, "model", None))
    if not heads:
        skipped("no attention layer with n_local_heads found in the model")
        return []
    return run(heads, _runner_device(model_runner), rows=rows, context_len=_context_len(model_runner), label=label,
               layouts=model_layouts(model_runner.model) if rows is not None else None)


# ---------------------------------------------------------------------------- MoE

def _moe_err(layer, run_fn, device) -> float:
    import torch

    from dsv4_sm120.moe.reference import moe_reference, rel_err

    E, two_i, h2 = layer.w13_weight.shape
    H = h2 * 2
    cfg = getattr(layer, "moe_runner_config", None)
    k = max(1, min(int(getattr(cfg, "top_k", None) or 2), E))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(MOE_TOKENS, H, generator=g).to(torch.bfloat16).to(device)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(MOE_TOKENS)]).to(torch.int32).to(device)
    tw = torch.rand(MOE_TOKENS, k, generator=g).float().to(device)
    out = run_fn(x, tw, ids)
    ref = moe_reference(x, layer.w13_weight.data, layer.w13_weight_scale.data, layer._dsv4_w13_scale_2,
                        layer.w2_weight.data, layer.w2_weight_scale.data, layer._dsv4_w2_scale_2, tw, ids,
                        swiglu_limit=getattr(cfg, "swiglu_limit", None))
    return rel_err(out.float(), ref)


def check_moe(layer, run_fn, device) -> Optional[dict]:
    """The MoE self-check on ``layer`` (module doc), once per process: ``run_fn(x, topk_weights, topk_ids)`` is our
    runner on that layer. The ranks of the tensor-parallel group agree on each path's outcome: a path that fails on
    any rank is left on every rank. Returns the result; raises :class:`~dsv4_sm120.rank_agreement.StopServer`
    (one line, every rank) when no path passes on every rank."""
    from . import allreduce as G

    with _lock:
        if not enabled() or _state["moe"] is not None:
            return _state["moe"]
        from dsv4_sm120.moe.fused_moe import default_path

        t0 = time.monotonic()
        E, two_i, h2 = layer.w13_weight.shape
        first = default_path(device)
        other = "bf16" if first == "fp4" else "fp4"
        shape = f"M={MOE_TOKENS} E={E} H={h2 * 2} I={two_i // 2}"
        res = {"kernel": "moe", "shape": shape, "tol": MOE_TOL, "path": first, "err": None, "ok": False,
               "error": None, "fallback": None}

        def attempt():           # the path in force: DSV4_SM120_MOE_PATH (auto: the first)
            try:
                err = _moe_err(layer, run_fn, device)
            except Exception as e:  # noqa: BLE001
                return None, f"{type(e).__name__}: {str(e)[:300]}"
            return err, (None if err <= MOE_TOL else f"relative error {err:.3g} > tolerance {MOE_TOL:g}")

        group = G.tp_group()
        res["err"], res["error"] = attempt()
        res["ok"] = res["error"] is None
        if res["error"] is not None:
            logger.error("dsv4_sm120 self-check: our MoE kernel (path %s) FAILED at %s: %s; trying its %s path",
                         first, shape, res["error"], other)
        failed = [(r, e) for r, e in enumerate(group.agree(f"MoE self-check, path {first}", res["error"])) if e]
        if not failed:
            logger.info("dsv4_sm120 self-check: MoE ok (%s, path %s, error %.2g) in %.2f s%s", shape, first,
                        res["err"], time.monotonic() - t0, _agreed(group))
            _state["moe"] = res
            return res
        if group.size > 1:
            logger.error("dsv4_sm120 self-check: our MoE kernel (path %s) failed at %s on %s; agreed by all %d ranks: "
                         "every rank tries its %s path", first, shape, G.who(failed), group.size, other)
        _switch_moe_path(other, f"self-check on {G.who(failed)}")
        err2, why2 = attempt()
        res.update(fallback=other, fallback_err=err2, fallback_error=why2)
        failed2 = [(r, e) for r, e in enumerate(group.agree(f"MoE self-check, path {other}", why2)) if e]
        _state["moe"] = res
        if failed2:
            from dsv4_sm120.rank_agreement import StopServer

            raise StopServer(f"dsv4_sm120 self-check: our MoE kernel fails at {shape} (path {first}: "
                             f"{_where(failed, group)}; path {other}: {_where(failed2, group)})"
                             + (f", every rank stops{_agreed(group)}" if group.size > 1 else "")
                             + "; restart with DSV4_SM120_MOE_BACKEND=flashinfer_cutlass")
        logger.warning("dsv4_sm120 self-check: our MoE kernel serves on its %s path in this process (error %.2g)%s",
                       other, err2, _agreed(group))
        return res


def _agreed(group) -> str:
    return f" (agreed by all {group.size} ranks)" if group.size > 1 else ""


def _where(failed, group) -> str:
    from . import allreduce as G

    return G.who(failed) if group.size > 1 else failed[0][1]


def _switch_moe_path(other: str, why: str = "") -> None:
    settings.put("DSV4_SM120_MOE_PATH", other)    # this process: every later call takes that path
    _state["moe_fallback"] = other
    _state["moe_fallback_why"] = why[:200]
    _state["moe_fallbacks"] = int(_state.get("moe_fallbacks", 0)) + 1


def moe_fallback_active() -> bool:
    return bool(_state.get("moe_fallback"))


def moe_fallback_path() -> Optional[str]:
    """The path our MoE kernel switched to in this process (None: its first)."""
    return _state.get("moe_fallback") or None


def adopt_moe_path(path: str, why: str) -> bool:
    """Switch to ``path`` because another rank did (:func:`.graphs.adopt_union`); not counted as a fallback of
    this process. True when this process switched now."""
    with _lock:
        if moe_fallback_active():
            return False
        settings.put("DSV4_SM120_MOE_PATH", path)
        _state["moe_fallback"] = path
        _state["moe_fallback_why"] = why[:200]
        return True


def moe_fallback_count() -> int:
    """How many times our MoE kernel switched to its other path in this process (0 or 1)."""
    return int(_state.get("moe_fallbacks", 0))


def moe_step_aside(shape: str, why: str, device) -> None:
    """A serving call of our MoE kernel raised (``why``) at ``shape``: switch this process to the kernel's other
    compute path (the weights stay as loaded, which both paths read) and log it once; when the other path is the
    one that raised, stop the server with one line (:class:`~dsv4_sm120.rank_agreement.StopServer`, a
    ``RuntimeError``: SGLang's scheduler catches it and shuts the whole server down) naming the CUTLASS runner.
    Local to this rank: a serving call is mid-forward, where the ranks cannot agree; the MoE kernel issues no
    collective, so the ranks still issue the same ones (inside a CUDA-graph capture the capture loop agrees,
    :mod:`.graphs`)."""
    from dsv4_sm120.moe.fused_moe import default_path
    from dsv4_sm120.rank_agreement import StopServer

    with _lock:
        if moe_fallback_active():
            raise StopServer(f"dsv4_sm120: our MoE kernel fails on this GPU at {shape} on its "
                             f"{_state['moe_fallback']} path too ({why}); restart with "
                             f"DSV4_SM120_MOE_BACKEND=flashinfer_cutlass")
        first = default_path(device)
        other = "bf16" if first == "fp4" else "fp4"
        _switch_moe_path(other, f"serving at {shape}: {why}")
    logger.error("dsv4_sm120: our MoE kernel (path %s) failed while serving at %s: %s; this process serves on its %s "
                 "path from now on", first, shape, why, other)


# ---------------------------------------------------------------------------- timing command

def default_capture_bs(max_bs: int, speculative: bool) -> List[int]:
    """The decode batch sizes SGLang 0.5.23 captures up to ``--cuda-graph-max-bs-decode`` by default: without
    speculation 1, 2, 4, 8, 12, then steps of 8 to 256, 16 to 512, 32 above; with it every size to 8, steps of 2
    to 32, 4 to 64, 8 to 256, 16 above; ``max_bs`` itself always."""
    if speculative:
        bs = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8), *range(272, max_bs + 1, 16)]
    else:
        bs = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    bs = [b for b in bs if b <= max_bs]
    return bs if max_bs in bs else bs + [max_bs]


def runner_rows(capture_bs: Sequence[int], draft_tokens: int) -> List[tuple]:
    """``(label, rows, layouts)`` of the CUDA-graph runners a server captures: without speculation the decode
    runner (rows = batch sizes, every layout); with ``draft_tokens`` > 1 the target-verify runner (batch sizes x
    draft tokens, every layout) and the MTP draft's decode and draft-extend runners (batch sizes, and batch sizes
    x draft tokens; its one layer is SWA only)."""
    bs = sorted({int(b) for b in capture_bs})
    if draft_tokens <= 1:
        return [("decode", bs, None)]
    d = int(draft_tokens)
    return [("target-verify", [b * d for b in bs], None), ("draft decode", bs, ["swa"]),
            ("draft extend", [b * d for b in bs], ["swa"])]


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m dsv4_sm120.sglang_glue.selfcheck",
        description="Run the startup self-check of our attention kernel (every launch the CUDA-graph capture rows "
                    "reach) for given heads, capture sizes and draft tokens, without SGLang (float64 reference), and "
                    "print what it ran and its seconds. Run it twice: the second run is the warm-Triton-cache cost "
                    "of a server start.")
    ap.add_argument("--time", action="store_true", help="print the seconds per case and in total (the default)")
    ap.add_argument("--heads", default="16", help="per-rank query heads, comma-separated (64 / TP; default 16)")
    ap.add_argument("--max-bs", type=int, default=16,
                    help="--cuda-graph-max-bs-decode (default 16, the serve scripts' MAX_RUNNING)")
    ap.add_argument("--capture-bs", default="", help="the capture batch sizes, comma-separated (default: SGLang's "
                                                      "schedule up to --max-bs)")
    ap.add_argument("--draft-tokens", type=int, default=0,
                    help="MTP draft tokens per request (0: no speculation; SGLang's default with MTP is 4)")
    ap.add_argument("--context-len", type=int, default=0,
                    help="context length (sets the c128 candidates; default: 64 candidates)")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    import torch

    from dsv4_sm120.sglang_glue import attention as A
    from dsv4_sm120.sglang_glue import selfcheck as S

    heads = [int(h) for h in a.heads.split(",") if h.strip()]
    bs = ([int(b) for b in a.capture_bs.split(",") if b.strip()] if a.capture_bs
          else S.default_capture_bs(a.max_bs, a.draft_tokens > 1))
    device = torch.device(a.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}; heads {heads}; capture batch sizes {bs}; draft tokens {a.draft_tokens}; "
          f"context {a.context_len or '-'}")
    t0 = time.monotonic()
    A.log_decisions()
    before = 0
    for label, rows, layouts in S.runner_rows(bs, a.draft_tokens):
        t1 = time.monotonic()
        cases = S.run(heads, device, rows=rows, context_len=a.context_len or None, label=label, layouts=layouts)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        new = cases[before:]
        before = len(cases)
        print(f"{label}: rows {S._rows_text(rows)}: {len(new)} launches in {time.monotonic() - t1:.2f} s")
        for c in new:
            print(f"  {'ok  ' if c['ok'] else 'FAIL'} {c['shape']:<58} rows {S._rows_text(c['rows']):<28} "
                  f"err {c['err'] if c['err'] is None else format(c['err'], '.2g')!s:<8} {c['seconds']:.3f} s"
                  + (f"  {c['error']}" if c["error"] else ""))
    total = time.monotonic() - t0
    failed = [c for c in (S.results()["attention"] or []) if not c["ok"]]
    print(f"self-check total: {before} launches, {len(failed)} failed, {total:.2f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
