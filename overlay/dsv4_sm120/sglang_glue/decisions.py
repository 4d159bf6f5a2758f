"""Which implementation runs each decision the patches make, and why: explicit setting > machine profile >
default; the startup self-check can then disable our kernels in this process.

Attention (patch 0002) is decided per call from its rows ``T`` and its layout (:func:`layout_of`: SWA only,
+ the c4 pool, + the c128 pool), i.e. from shapes only, so each captured CUDA graph routes statically:

1. ``DSV4_SM120_ATTN_BACKEND`` set by the user (non-empty): that backend for every call (``env``);
2. else the machine profile's winner of ``attention.<layout>`` for the bucket of ``T``
   (:func:`dsv4_sm120.calibrate.profile.decision`: the first measured bucket ``>= T``; ``profile``);
3. else ``dsv4``, our kernel (``default``; ``make calibrate`` would pick by measurement).

A profile winner is ``dsv4``, ``dsv4:<launch keys>`` (ours with a launch variant, passed to the kernel per
call unless ``DSV4_SM120_ATTN_CONFIG`` is set), ``dsv4+fp8qk`` (block-scaled QK unless ``DSV4_SM120_ATTN_QK``
is set), ``flashinfer``, ``triton`` or ``torch``; any other name (e.g. the reference point ``flashmla``) is
not routable and leaves the default. When the self-check (:mod:`.selfcheck`) disabled our attention kernel,
a ``dsv4`` decision becomes ``stock``: SGLang's own sm_120 dispatcher, as unpatched SGLang calls it.

Decisions are cached per ``(T, layout)`` (a pure function of them while the process runs); :func:`disable`
clears the cache. :func:`log_decisions` writes one line per decision, once per process.
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, List, NamedTuple, Optional, Tuple

from dsv4_sm120 import settings

logger = logging.getLogger(__name__)

ENV_ATTN = "DSV4_SM120_ATTN_BACKEND"
ENV_TEST_GPU = "DSV4_SM120_TEST_GPU_NAME"
LAYOUTS = ("swa", "swa_c4", "swa_c128")
ROUTABLE = ("dsv4", "flashinfer", "triton", "torch")
STOCK = "stock"
DEFAULT_ATTN = "dsv4"
C128_PAGE = 2   # page size of the c128 pool (dsv4_sm120.calibrate.deployment); the c4 pool has 64

_lock = threading.Lock()
_ROUTES: Dict[Tuple[int, str], "Route"] = {}
_DISABLED: Dict[str, str] = {}
_LOGGED: Dict[str, bool] = {}


class Route(NamedTuple):
    backend: str                  # dsv4 | flashinfer | triton | torch | stock
    launch: Optional[str] = None  # dsv4: launch keys for this call (None: the launch tables / the env's)
    qk: Optional[str] = None      # dsv4: "fp8" for block-scaled QK (None: DSV4_SM120_ATTN_QK)
    source: str = "default"


def layout_of(extra_k_cache) -> str:
    """``swa`` (no extra cache), ``swa_c128`` (extra pages of 2 tokens) or ``swa_c4`` (any other extra cache)."""
    if extra_k_cache is None:
        return "swa"
    return "swa_c128" if int(extra_k_cache.shape[1]) == C128_PAGE else "swa_c4"


def parse_choice(choice: str) -> Optional[Tuple[str, Optional[str], Optional[str]]]:
    """``(backend, launch, qk)`` of a profile winner name, or None when the glue cannot route to it."""
    c = str(choice).strip()
    qk = None
    if c.endswith("+fp8qk"):
        c, qk = c[: -len("+fp8qk")], "fp8"
    name, sep, launch = c.partition(":")
    if name not in ROUTABLE or (name != "dsv4" and (sep or qk)):
        return None
    if sep:
        from dsv4_sm120.attention.config import DecodeInputError, parse_config

        try:
            parse_config(launch, "profile launch")
        except DecodeInputError:
            return None
    return name, (launch or None), qk


def gpu_name() -> Optional[str]:
    """The GPU whose profile applies (None: the current CUDA device, found by the profile module)."""
    return settings.get(ENV_TEST_GPU) or None


def _profile():
    from dsv4_sm120.calibrate import profile

    return profile


def _decide(T: int, layout: str) -> Route:
    env = (settings.raw(ENV_ATTN) or "").strip()
    if env:
        return Route(settings.get(ENV_ATTN), source=f"env {ENV_ATTN}")
    choice, source = _profile().decision(f"attention.{layout}", T, DEFAULT_ATTN, gpu=gpu_name())
    parsed = parse_choice(choice)
    if parsed is None:
        return Route(DEFAULT_ATTN, source=f"default: profile winner {choice!r} is not routable")
    b, launch, qk = parsed
    if launch and (settings.raw("DSV4_SM120_ATTN_CONFIG") or "").strip():
        launch = None   # the user's launch keys win over the profile's
    if qk and (settings.raw("DSV4_SM120_ATTN_QK") or "").strip():
        qk = None
    if source == "default":
        source = default_reason(f"attention.{layout}")
    return Route(b, launch, qk, source)


def default_reason(name: str) -> str:
    """Why decision ``name`` runs its default: no matching profile, or a profile without a winner for it."""
    prof, path, _ = _profile().active_profile(gpu_name())
    if prof is not None:
        return f"default: profile {path} has no winner for {name} here"
    return "default: no matching profile for this GPU; make calibrate picks by measurement"


def attention_route(T: int, layout: str) -> Route:
    """The route of an attention call of ``T`` rows with ``layout`` (module doc), cached."""
    key = (int(T), layout)
    r = _ROUTES.get(key)
    if r is None:
        r = _decide(int(T), layout)
        if r.backend == "dsv4" and "attention" in _DISABLED:
            r = Route(STOCK, source=f"{r.source}; our kernel disabled by the self-check: {_DISABLED['attention']}")
        _ROUTES[key] = r
    return r


def uses_ours(layout: Optional[str] = None) -> bool:
    """Whether some call (of ``layout``, or any) would run our attention kernel: at one row, the env's choice,
    or any bucket of the profile."""
    for lay in ([layout] if layout else LAYOUTS):
        rows, _ = _profile().bucket_winners(f"attention.{lay}", gpu=gpu_name())
        for T in [1] + [b for b, _ in rows]:
            if _decide(T, lay).backend == "dsv4":
                return True
    return False


def our_launches(layout: str) -> List[Tuple[Optional[str], Optional[str]]]:
    """The distinct ``(launch, qk)`` of our kernel among the decisions of ``layout`` (what the self-check runs)."""
    rows, _ = _profile().bucket_winners(f"attention.{layout}", gpu=gpu_name())
    seen = []
    for T in [1] + [b for b, _ in rows]:
        r = _decide(T, layout)
        if r.backend == "dsv4" and (r.launch, r.qk) not in seen:
            seen.append((r.launch, r.qk))
    return seen


def disable(kernel: str, reason: str) -> None:
    """Take our ``kernel`` (``attention`` / ``moe``) out of this process: later decisions route to the stock
    path (the route cache is cleared)."""
    with _lock:
        _DISABLED[kernel] = reason
        _ROUTES.clear()


def disabled(kernel: str) -> Optional[str]:
    """Why our ``kernel`` is disabled in this process, or None."""
    return _DISABLED.get(kernel)


def reset() -> None:
    """Forget every cached decision, disable and log mark (tests; a changed environment)."""
    with _lock:
        _ROUTES.clear()
        _DISABLED.clear()
        _LOGGED.clear()
        _profile().clear_cache()


# ---- the startup log


def _describe_route(r: Route) -> str:
    name = r.backend + (f":{r.launch}" if r.launch else "") + ("+fp8qk" if r.qk == "fp8" else "")
    return name


def describe_attention(layout: str) -> str:
    """One line: what runs for each row bucket of ``layout``, and why (profile / env / default)."""
    rows, _ = _profile().bucket_winners(f"attention.{layout}", gpu=gpu_name())
    buckets = [b for b, _ in rows] or [1]
    routes = [attention_route(b, layout) for b in buckets]
    groups: List[list] = []
    for b, r in zip(buckets, routes):
        if groups and _describe_route(groups[-1][1]) == _describe_route(r):
            groups[-1][2] = b
        else:
            groups.append([groups[-1][2] if groups else None, r, b])
    parts = []
    for i, (lo, r, hi) in enumerate(groups):
        if len(groups) == 1:
            rng = "every T"
        elif i == 0:
            rng = f"T<={hi}"
        elif i == len(groups) - 1:
            rng = f"T>{lo}"
        else:
            rng = f"{lo}<T<={hi}"
        parts.append(f"{_describe_route(r)} for {rng}")
    sources = list(dict.fromkeys(part for r in routes for part in r.source.split("; ")))
    return f"{', '.join(parts)} ({'; '.join(sources)})"


def log_decisions() -> None:
    """Log one line per attention decision (once per process; again after a self-check disable)."""
    with _lock:
        if _LOGGED.get("attention"):
            return
        _LOGGED["attention"] = True
    for layout in LAYOUTS:
        try:
            logger.info("dsv4_sm120 decision attention.%s: %s", layout, describe_attention(layout))
        except Exception as e:  # noqa: BLE001 - a log line must never stop the server
            logger.warning("dsv4_sm120 decision attention.%s: could not describe (%s: %s)", layout,
                           type(e).__name__, e)


def relog() -> None:
    with _lock:
        _LOGGED.pop("attention", None)
    log_decisions()
