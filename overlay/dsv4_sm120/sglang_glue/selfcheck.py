"""Startup self-check: each of our kernels that will serve runs once on this GPU at a live shape against the
stock implementation; one that raises or misses the tolerance is disabled in this process and the stock path
serves instead. The log names the kernel, the shape and the error. ``DSV4_SM120_SELFCHECK=0`` skips it.

* Attention (:func:`run`, once per process): when some decision routes to our kernel (:mod:`.attention`), for
  each layout that does (SWA only / + c4 / + c128) and each distinct launch the routing gives it, our kernel
  (the exact function serving calls, :func:`.attention.ours`) runs ``T = 2`` rows with the layer's per-rank
  head count over small random caches in the real page layout (SWA pages of 256 tokens, c4 pages of 64, c128
  pages of 2; :mod:`dsv4_sm120.attention.cache`), against SGLang's torch path ``_sm120_sparse_decode_fwd``
  (exact, cheap at this size; the float64 reference where SGLang is absent). Tolerance: relative Frobenius
  error 2e-2 (5e-2 for block-scaled QK), as ``make calibrate``'s gate. On failure
  :func:`.attention.disable` sends every ``dsv4`` decision to SGLang's own dispatcher.
  When: the patched backend's ``init_cuda_graph_state`` calls :func:`before_graph_capture` (patch 0002, before
  any capture); without CUDA graphs, the first attention call.
* MoE (:func:`check_moe`, at the first ``dsv4_triton_nvfp4`` layer's ``prepare_layer``, i.e. after its weights
  loaded and before capture): our NVFP4 runner on that layer's own weights, two tokens routed to random
  experts, against the float64 reference of the same dequantized experts (tolerance 0.3, ``make calibrate``'s
  NVFP4 gate). The layer's weights were loaded for our kernel (no FlashInfer layout), so the fallback is our
  kernel's other compute path (``DSV4_SM120_MOE_PATH``: ``fp4`` <-> ``bf16``), checked the same way; when
  both fail the server stops with one line naming ``DSV4_SM120_MOE_BACKEND=flashinfer_cutlass``.

Fault injection for tests: ``DSV4_SM120_TEST_SELFCHECK_FAULT=attention|moe`` makes our kernel's result wrong
(scaled by 2; for the MoE only on its first path).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Dict, List, Optional, Sequence

from dsv4_sm120 import settings

logger = logging.getLogger(__name__)

ATTN_TOL = 2e-2
ATTN_TOL_FP8QK = 5e-2
MOE_TOL = 0.3
ROWS = 2
MOE_TOKENS = 2
SWA_PAGE, C4_PAGE, C128_PAGE = 256, 64, 2

_lock = threading.RLock()
_state: Dict[str, object] = {"attention": None, "moe": None, "skipped_logged": False}


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
        _state.update(attention=None, moe=None, skipped_logged=False)


def skipped(reason: str) -> None:
    if not _state["skipped_logged"]:
        _state["skipped_logged"] = True
        logger.warning("dsv4_sm120 self-check: not run (%s); our kernels serve unchecked", reason)


# ---------------------------------------------------------------------------- attention

def _sizes(device) -> Dict[str, int]:
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if interp or getattr(device, "type", "cpu") != "cuda":
        return {"K1": 16, "swa_c4": 16, "swa_c128": 8}
    return {"K1": 128, "swa_c4": 512, "swa_c128": 64}


def attention_case(layout: str, T: int, H: int, device, seed: int = 0) -> dict:
    """Inputs of one attention call: ``q [T,1,H,512]`` bf16 and the keyword arguments SGLang passes (caches in the
    real page layout, some invalid slots, per-row lengths, a sink)."""
    import torch

    from dsv4_sm120.attention.cache import random_cache

    g = torch.Generator().manual_seed(seed)
    sz = _sizes(torch.device(device))
    K1 = sz["K1"]
    main = random_cache(T + 1, SWA_PAGE, generator=g, mode="bytes")
    idx = torch.stack([torch.randperm((T + 1) * SWA_PAGE, generator=g)[:K1] for _ in range(T)]).to(torch.int32)
    idx[:, -1] = -1                                   # an invalid slot in every row
    kw = dict(k_cache=main.view.to(device), indices=idx.view(T, 1, K1).to(device),
              topk_length=torch.full((T,), K1, dtype=torch.int32).to(device))
    if layout != "swa":
        page = C4_PAGE if layout == "swa_c4" else C128_PAGE
        K2 = sz[layout]
        pages = -(-2 * K2 // page)
        extra = random_cache(pages, page, generator=g, mode="bytes")
        e = torch.stack([torch.randperm(pages * page, generator=g)[:K2] for _ in range(T)]).to(torch.int32)
        kw.update(extra_k_cache=extra.view.to(device), extra_indices_in_kvcache=e.view(T, 1, K2).to(device),
                  extra_topk_length=torch.tensor([K2 - 1 - (t % 3) for t in range(T)], dtype=torch.int32).to(device))
    q = torch.randn(T, 1, H, 512, generator=g).to(torch.bfloat16).to(device)
    kw.update(attn_sink=torch.randn(H, generator=g).to(device), head_dim_v=512, softmax_scale=512 ** -0.5)
    return {"q": q, "kw": kw, "K1": K1, "K2": kw["extra_indices_in_kvcache"].shape[-1] if layout != "swa" else 0}


def stock_reference(q, kw):
    """SGLang's torch path on the same call (exact), or the float64 reference where SGLang does not import."""
    try:
        from sglang.kernels.ops.attention.flash_mla_sm120 import _sm120_sparse_decode_fwd
    except Exception:  # noqa: BLE001
        from dsv4_sm120.attention.reference import sparse_mla_decode_ref

        args = {k: v for k, v in kw.items() if k != "head_dim_v"}
        return sparse_mla_decode_ref(q, **args)[0]
    return _sm120_sparse_decode_fwd(q, kw["k_cache"], kw["indices"], kw.get("topk_length"), kw.get("attn_sink"),
                                    kw["head_dim_v"], kw["softmax_scale"], kw.get("extra_k_cache"),
                                    kw.get("extra_indices_in_kvcache"), kw.get("extra_topk_length"))[0]


def _check_one(layout: str, H: int, launch, qk, device, seed: int) -> dict:
    from dsv4_sm120.attention.reference import rel_fro

    from .attention import ours

    c = attention_case(layout, ROWS, H, device, seed)
    shape = (f"{layout} T={ROWS} H={H} K={c['K1']}" + (f"+{c['K2']}" if c["K2"] else "")
             + f" launch={launch or 'default'}" + (" qk=fp8" if qk == "fp8" else ""))
    tol = ATTN_TOL_FP8QK if qk == "fp8" else ATTN_TOL
    res = {"kernel": "attention", "shape": shape, "tol": tol, "err": None, "ok": False, "error": None}
    try:
        out = ours(c["q"], H, c["kw"], launch, qk)
        ref = stock_reference(c["q"], c["kw"])
        err = rel_fro(out[:, :, :H], ref[:, :, :H])
        res["err"] = err
        res["ok"] = err <= tol          # NaN compares False
        if not res["ok"]:
            res["error"] = f"relative error {err:.3g} > tolerance {tol:g}"
    except Exception as e:  # noqa: BLE001 - any failure of ours means the stock path serves
        res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return res


def run(heads: Sequence[int], device, force: bool = False) -> List[dict]:
    """The attention self-check (module doc), once per process (``force``: again). Returns its cases."""
    with _lock:
        if not enabled():
            return []
        if _state["attention"] is not None and not force:
            return _state["attention"]
        from . import attention as A
        t0 = time.monotonic()
        cases: List[dict] = []
        heads = sorted({int(h) for h in heads if h})
        layouts = [lay for lay in A.LAYOUTS if A.uses_ours(lay)] if heads else []
        if not layouts:
            logger.info("dsv4_sm120 self-check: our attention kernel does not serve here; nothing to check")
        failed = None
        for H in heads:
            for i, lay in enumerate(layouts):
                for launch, qk in A.our_launches(lay):
                    r = _check_one(lay, H, launch, qk, device, seed=1000 * H + i)
                    cases.append(r)
                    if not r["ok"]:
                        failed = r
                        break
                if failed:
                    break
            if failed:
                break
        _state["attention"] = cases
        dt = time.monotonic() - t0
        if failed:
            logger.error("dsv4_sm120 self-check: our attention kernel FAILED at %s: %s; disabled in this process, "
                         "SGLang's stock path serves instead", failed["shape"], failed["error"])
            A.disable("attention", f"{failed['shape']}: {failed['error']}")
            A.relog()
        elif cases:
            logger.info("dsv4_sm120 self-check: attention ok (%d shapes, max error %.2g) in %.2f s", len(cases),
                        max(c["err"] for c in cases), dt)
        return cases


def model_heads(model) -> List[int]:
    """The per-rank query head counts of the model's attention layers (``n_local_heads``)."""
    if model is None:
        return []
    return sorted({int(m.n_local_heads) for m in model.modules()
                   if hasattr(m, "n_local_heads") and hasattr(m, "compress_ratio")})


def before_graph_capture(model_runner=None) -> List[dict]:
    """Called by the patched backend before CUDA-graph capture: log the attention decisions and run the self-check
    with the model's per-rank head counts on the runner's device."""
    from . import attention

    attention.log_decisions()
    return run_for_runner(model_runner)


def run_for_runner(model_runner) -> List[dict]:
    """:func:`run` with the heads of ``model_runner.model`` on its device (the hook before graph capture)."""
    if model_runner is None or not enabled():
        return []
    import torch

    heads = model_heads(getattr(model_runner, "model", None))
    dev = getattr(model_runner, "device", "cuda")
    device = torch.device(dev, int(model_runner.gpu_id)) if str(dev) == "cuda" and hasattr(model_runner, "gpu_id") \
        else torch.device(dev)
    if not heads:
        skipped("no attention layer with n_local_heads found in the model")
        return []
    return run(heads, device)


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
    runner on that layer. Returns its result; raises SystemExit when no path of our kernel passes."""
    with _lock:
        if not enabled() or _state["moe"] is not None:
            return _state["moe"]
        from dsv4_sm120.moe.fused_moe import default_path

        t0 = time.monotonic()
        E, two_i, h2 = layer.w13_weight.shape
        first = default_path(device)
        shape = f"M={MOE_TOKENS} E={E} H={h2 * 2} I={two_i // 2}"
        res = {"kernel": "moe", "shape": shape, "tol": MOE_TOL, "path": first, "err": None, "ok": False,
               "error": None, "fallback": None}

        def attempt(path):
            try:
                err = _moe_err(layer, run_fn, device)
            except Exception as e:  # noqa: BLE001
                return None, f"{type(e).__name__}: {str(e)[:300]}"
            return err, (None if err <= MOE_TOL else f"relative error {err:.3g} > tolerance {MOE_TOL:g}")

        res["err"], res["error"] = attempt(first)
        res["ok"] = res["error"] is None
        if not res["ok"]:
            other = "bf16" if first == "fp4" else "fp4"
            logger.error("dsv4_sm120 self-check: our MoE kernel (path %s) FAILED at %s: %s; trying its %s path",
                         first, shape, res["error"], other)
            settings.put("DSV4_SM120_MOE_PATH", other)    # this process: every later call takes that path
            _state["moe_fallback"] = other
            err2, why2 = attempt(other)
            res.update(fallback=other, fallback_err=err2, fallback_error=why2)
            if why2 is not None:
                _state["moe"] = res
                raise SystemExit(f"dsv4_sm120 self-check: our MoE kernel fails on this GPU at {shape} (path {first}: "
                                 f"{res['error']}; path {other}: {why2}); restart with "
                                 f"DSV4_SM120_MOE_BACKEND=flashinfer_cutlass")
            logger.warning("dsv4_sm120 self-check: our MoE kernel serves on its %s path in this process "
                           "(error %.2g)", other, err2)
        else:
            logger.info("dsv4_sm120 self-check: MoE ok (%s, path %s, error %.2g) in %.2f s", shape, first,
                        res["err"], time.monotonic() - t0)
        _state["moe"] = res
        return res


def moe_fallback_active() -> bool:
    return bool(_state.get("moe_fallback"))
