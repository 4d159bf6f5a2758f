"""Patch 0002: the DeepSeek-V4 attention backend's sm_120 sparse-attention call, the model's head count, and
the self-check before CUDA-graph capture.

The patched backend hands its sm_120 sparse-attention call (V4 cache layout, 584 bytes per token) to
:func:`sparse_attention`; the patched model's ``_kernel_num_heads`` asks :func:`kernel_num_heads`.

Who runs a call is decided from its rows T and layout (SWA only / + c4 / + c128), i.e. from shapes only, so
each captured CUDA graph routes statically (:func:`attention_route`, cached per ``(T, layout)``):

1. ``DSV4_SM120_ATTN_BACKEND`` set by the user (non-empty): that backend for every call (``env``);
2. else the machine profile's winner of ``attention.<layout>`` for the bucket of ``T``
   (:func:`dsv4_sm120.machine_profile.decision`: the first measured bucket ``>= T``; ``profile``);
3. else ``dsv4``, our kernel (``default``; ``make calibrate`` would pick by measurement).

A profile winner is ``dsv4``, ``dsv4:<launch keys>`` (ours with a launch variant, passed to the kernel per
call unless ``DSV4_SM120_ATTN_CONFIG`` is set), ``dsv4+fp8qk`` (block-scaled QK unless ``DSV4_SM120_ATTN_QK``
is set), ``flashinfer``, ``triton`` or ``torch``; any other name (e.g. the reference point ``flashmla``) is
not routable and leaves the default. :func:`log_decisions` writes one line per decision, once per process.
The backends:

* ``dsv4``: the overlay's tensor-core Triton kernel (:func:`dsv4_sm120.attention.sparse_mla_decode`) with the
  real per-rank heads, for decode-like rows (decode, target-verify, draft-extend; any T); prefill rows
  (extend / mixed) keep FlashInfer unless ``DSV4_SM120_ATTN_PREFILL=dsv4``;
* ``flashinfer`` / ``triton`` / ``torch``: SGLang 0.5.23's own sm_120 paths, called as stock SGLang calls
  them (``triton`` / ``torch`` with the stock 64-head padding);
* ``stock``: SGLang's own dispatcher ``flash_mla_with_kvcache_sm120``, unchanged; where a ``dsv4`` decision
  goes when our kernel stepped aside for those rows (below) or the self-check disabled it in this process.

Stepping aside: our kernel serves a call through one launch-table entry (:func:`launch_bucket`: the layout,
the heads and the table entry ``dsv4_sm120.attention.launch_plan`` gives the call's rows; rows that share it
share the launch). When a call raises (compile error, out of resources, a bad launch, any exception),
:func:`step_aside` records that entry as failed for the rest of the process and logs one line (exception,
T, H, layout, launch); the call itself is answered by SGLang's stock dispatcher, and every later call of
those rows goes there too (:func:`call_route`), including :func:`kernel_num_heads`, which then gives SGLang's
own head count for them. The startup self-check (:mod:`.selfcheck`, at the start of each CUDA-graph capture
loop over the rows it will capture; without graphs at the first call outside capture) steps aside the same
way for each launch that fails it, so a failing launch is on the stock path before any capture; when every
launch it ran fails, it disables our kernel for every row (:func:`disable`).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

from dsv4_sm120 import settings

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- decisions (who runs a call)

ENV_ATTN = "DSV4_SM120_ATTN_BACKEND"
LAYOUTS = ("swa", "swa_c4", "swa_c128")
ROUTABLE = ("dsv4", "flashinfer", "triton", "torch")
STOCK = "stock"
DEFAULT_ATTN = "dsv4"
C128_PAGE = 2   # page size of the c128 pool (dsv4_sm120.calibrate.deployment); the c4 pool has 64

_ROUTE_ENV = (ENV_ATTN, "DSV4_SM120_ATTN_CONFIG", "DSV4_SM120_ATTN_QK")


class GlueState:
    """What the attention glue remembers in a process: the decisions it made, our kernel disabled by the
    self-check, the launches it stepped aside from and the device they were resolved on, and its log marks.
    One object (:data:`STATE`); :func:`reset` forgets it all."""

    def __init__(self):
        self.lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        self.routes: Dict[tuple, Route] = {}        # (T, layout, settings) -> decision
        self.disabled: Dict[str, str] = {}          # kernel -> why the self-check disabled it
        self.logged: Dict[str, bool] = {}           # the decision lines written
        self.failed: Dict[tuple, str] = {}          # (layout, H, launch bucket) -> why our kernel stepped aside there
        self.call_routes: Dict[tuple, Route] = {}   # (T, layout, H, settings) -> route with the failures applied
        self.buckets: Dict[tuple, str] = {}         # launch_bucket's answers
        self.fail_device = None                     # the device facts the stepped-aside buckets were resolved on
        self.fail_count = 0                         # launch buckets this process stepped aside from


class Route(NamedTuple):
    backend: str                  # dsv4 | flashinfer | triton | torch | stock
    launch: Optional[str] = None  # dsv4: launch keys for this call (None: the launch tables / the env's)
    qk: Optional[str] = None      # dsv4: "fp8" for block-scaled QK (None: DSV4_SM120_ATTN_QK)
    source: str = "default"


STATE = GlueState()


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


def _profile():
    from dsv4_sm120 import machine_profile

    return machine_profile


def _decide(T: int, layout: str) -> Route:
    env = (settings.raw(ENV_ATTN) or "").strip()
    if env:
        return Route(settings.get(ENV_ATTN), source=f"env {ENV_ATTN}")
    choice, source = _profile().decision(f"attention.{layout}", T, DEFAULT_ATTN)
    parsed = parse_choice(choice)
    if parsed is None:
        return Route(DEFAULT_ATTN, source=f"default: profile winner {choice!r} is not routable")
    b, launch, qk = parsed
    from dsv4_sm120.attention.launch_plan import profile_in_force

    launch, qk = profile_in_force(launch, qk)   # the user's launch keys / QK mode win over the profile's
    if source == "default":
        source = _profile().default_reason(f"attention.{layout}")
    return Route(b, launch, qk, source)



def attention_route(T: int, layout: str) -> Route:
    """The route of an attention call of ``T`` rows with ``layout`` (module doc), cached."""
    key = (int(T), layout) + tuple(settings.raw(n) for n in _ROUTE_ENV)   # a changed setting decides anew
    r = STATE.routes.get(key)
    if r is None:
        r = _decide(int(T), layout)
        if r.backend == "dsv4" and "attention" in STATE.disabled:
            r = Route(STOCK, source=f"{r.source}; our kernel disabled by the self-check: {STATE.disabled['attention']}")
        STATE.routes[key] = r
    return r


def dsv4_serves_some_rows(layout: Optional[str] = None) -> bool:
    """Whether some call (of ``layout``, or any) would run our attention kernel: at one row, the env's choice,
    or any bucket of the profile."""
    for lay in ([layout] if layout else LAYOUTS):
        rows, _ = _profile().bucket_winners(f"attention.{lay}")
        for T in [1] + [b for b, _ in rows]:
            if _decide(T, lay).backend == "dsv4":
                return True
    return False


def our_launches(layout: str) -> List[Tuple[Optional[str], Optional[str]]]:
    """The distinct ``(launch, qk)`` of our kernel among the decisions of ``layout`` (what the self-check runs)."""
    rows, _ = _profile().bucket_winners(f"attention.{layout}")
    seen = []
    for T in [1] + [b for b, _ in rows]:
        r = _decide(T, layout)
        if r.backend == "dsv4" and (r.launch, r.qk) not in seen:
            seen.append((r.launch, r.qk))
    return seen


def disable(kernel: str, reason: str) -> None:
    """Take our ``kernel`` (``attention`` / ``moe``) out of this process: later decisions route to the stock
    path (the route cache is cleared)."""
    with STATE.lock:
        STATE.disabled[kernel] = reason
        STATE.routes.clear()


def disabled(kernel: str) -> Optional[str]:
    """Why our ``kernel`` is disabled in this process, or None."""
    return STATE.disabled.get(kernel)


def reset() -> None:
    """Forget every cached decision, disable, stepped-aside launch and log mark (tests; a changed environment)."""
    with STATE.lock:
        STATE.clear()
        _profile().clear_cache()


# ---- stepping aside per launch


def launch_bucket(T: int, layout: str, H: int, route: Route, device) -> str:
    """The launch-table entry our kernel's launch for ``T`` rows of ``H`` heads of ``layout`` comes from, with
    the route's launch keys and QK mode (``device``: :class:`dsv4_sm120.attention.config.Device` facts;
    :func:`dsv4_sm120.attention.launch_plan.plan_call`'s ``entry``). Rows with
    the same answer run the same table launch; under Triton's interpreter every row runs one launch. Cached."""
    key = (int(T), layout, int(H), route.launch, route.qk, tuple(device)) + tuple(
        settings.raw(n) for n in _ROUTE_ENV)
    b = STATE.buckets.get(key)
    if b is None:
        from dsv4_sm120.attention.launch_plan import plan_call

        # the route's launch keys and QK mode reach the kernel as the call's own (run_dsv4_kernel)
        plan = plan_call(H, T, device, qk=route.qk, launch=route.launch)
        b = f"{layout} H={int(H)} qk={plan.qk} {plan.entry}" + (f" launch={route.launch}" if route.launch else "")
        STATE.buckets[key] = b
    return b


def _bucket_or_rows(T: int, layout: str, H: int, route: Route, device) -> str:
    try:
        return launch_bucket(T, layout, H, route, device)
    except Exception as e:  # noqa: BLE001 - no launch for these rows: they alone step aside
        return f"{layout} H={int(H)} T={int(T)} (no launch: {type(e).__name__})"


def step_aside(T: int, layout: str, H: int, route: Route, device, why: str, during: str = "serving",
               log: bool = True) -> str:
    """Send the rows of the launch bucket of ``(T, layout, H)`` (``route``: the decision our kernel served them by)
    to SGLang's stock path for the rest of the process and log it once (``why``: the exception or the self-check's
    finding; ``log=False``: the caller logs). Returns the bucket."""
    facts = _device_facts(device)
    b = _bucket_or_rows(T, layout, H, route, facts)
    with STATE.lock:
        new = (layout, int(H), b) not in STATE.failed
        if new:
            STATE.failed[(layout, int(H), b)] = f"{during} T={int(T)}: {why}"
            STATE.fail_device = facts
            STATE.fail_count += 1
            STATE.call_routes.clear()
    if new and log:
        logger.error("dsv4_sm120: our attention kernel failed (%s) at %s T=%d H=%d launch %s: %s; the rows of that "
                     "launch step aside to SGLang's stock path for the rest of this process", during, layout, T, H,
                     b, why)
    return b


def stepped_aside() -> Dict[tuple, str]:
    """``{(layout, H, launch bucket): why}`` of every launch our kernel stepped aside from in this process."""
    return dict(STATE.failed)


def failed_launches() -> List[list]:
    """``[[layout, H, launch bucket, why], ...]``: :func:`stepped_aside` as the ranks exchange it
    (:func:`.graphs.adopt_union`)."""
    return sorted([lay, h, b, why[:200]] for (lay, h, b), why in STATE.failed.items())


def adopt(entries, device, source: str) -> List[list]:
    """Step aside from the launches another rank stepped aside from (``entries`` as :func:`failed_launches`
    gives them; ``source`` names that rank in the reason). Does not count as a fallback of this process
    (:func:`fallback_count`) and logs nothing (the caller logs the agreed decision). Returns the entries new
    here."""
    new = []
    with STATE.lock:
        for lay, h, b, why in entries:
            if (lay, int(h), b) not in STATE.failed:
                STATE.failed[(lay, int(h), b)] = f"{source}: {why}"
                new.append([lay, int(h), b, why])
        if new:
            if STATE.fail_device is None:
                STATE.fail_device = _device_facts(device)
            STATE.call_routes.clear()
    return new


def rows_of_launch(rows, layout: str, H: int, bucket: str, device) -> List[int]:
    """The row counts of ``rows`` whose calls of ``layout`` and ``H`` heads run launch ``bucket`` (host only)."""
    facts = _device_facts(device)
    return [int(t) for t in rows if attention_route(t, layout).backend == "dsv4"
            and _bucket_or_rows(t, layout, H, attention_route(t, layout), facts) == bucket]


def stock_name() -> str:
    """What SGLang's stock dispatcher runs, for log lines."""
    try:
        backend = getattr(_stock(), "_sm120_default_backend", "flashinfer")
    except Exception:  # noqa: BLE001 - SGLang absent (tests): the name alone
        return "SGLang's stock dispatcher flash_mla_with_kvcache_sm120"
    return f"SGLang's stock dispatcher flash_mla_with_kvcache_sm120 ({backend})"


def fallback_count() -> int:
    """How many launch buckets stepped aside so far (the CUDA-graph capture hook compares it around a capture)."""
    return STATE.fail_count


def _device_facts(device):
    from dsv4_sm120.attention.config import Device

    if isinstance(device, Device):
        return device
    import torch

    from dsv4_sm120.attention.launch import device_facts

    return device_facts(torch.device(device))


def call_route(T: int, layout: str, H: int) -> Route:
    """:func:`attention_route` for a call of ``H`` heads, with the launches our kernel stepped aside from applied."""
    r = attention_route(T, layout)
    if r.backend != "dsv4" or not STATE.failed:
        return r
    key = (int(T), layout, int(H)) + tuple(settings.raw(n) for n in _ROUTE_ENV)
    c = STATE.call_routes.get(key)
    if c is None:
        b = _bucket_or_rows(T, layout, H, r, STATE.fail_device)
        why = STATE.failed.get((layout, int(H), b))
        c = r if why is None else Route(STOCK, source=f"{r.source}; our kernel stepped aside for {b} ({why})")
        STATE.call_routes[key] = c
    return c


# ---- the startup log


def _describe_route(r: Route) -> str:
    name = r.backend + (f":{r.launch}" if r.launch else "") + ("+fp8qk" if r.qk == "fp8" else "")
    return name


def describe_attention(layout: str) -> str:
    """One line: what runs for each row bucket of ``layout``, and why (profile / env / default)."""
    rows, _ = _profile().bucket_winners(f"attention.{layout}")
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
    with STATE.lock:
        if STATE.logged.get("attention"):
            return
        STATE.logged["attention"] = True
    for layout in LAYOUTS:
        try:
            logger.info("dsv4_sm120 decision attention.%s: %s", layout, describe_attention(layout))
        except Exception as e:  # noqa: BLE001 - a log line must never stop the server
            logger.warning("dsv4_sm120 decision attention.%s: could not describe (%s: %s)", layout,
                           type(e).__name__, e)


def relog() -> None:
    with STATE.lock:
        STATE.logged.pop("attention", None)
    log_decisions()


# ---------------------------------------------------------------------------- the calls SGLang makes


def prefill_backend() -> str:
    return settings.get("DSV4_SM120_ATTN_PREFILL")


_PADDED = ("triton", "torch")


def kernel_num_heads(n_local_heads: int, n_heads: int, num_tokens: int):
    """Heads the attention kernel gets on sm_120, or None to keep SGLang's own choice.

    From the decisions of the three layouts at ``num_tokens`` rows (the model asks once per layer call, before
    it knows the layout): all ``dsv4`` -> the real per-rank heads (our kernel and FlashInfer's prefill kernel
    take any H); any ``triton`` / ``torch`` -> the stock padded shape (64, or all heads above 64; our kernel
    and FlashInfer read only the real heads of it); else SGLang decides."""
    log_decisions()
    routes = {call_route(num_tokens, lay, n_local_heads).backend for lay in LAYOUTS}
    if routes == {"dsv4"}:
        return n_local_heads
    if routes & set(_PADDED):
        return 64 if n_local_heads <= 64 else n_heads
    return None


def is_decode_like(forward_mode) -> bool:
    """Rows with one query each that CUDA graphs capture: decode, target-verify, draft-extend."""
    for attr in ("is_decode", "is_target_verify", "is_draft_extend_v2", "is_idle"):
        f = getattr(forward_mode, attr, None)
        if f is not None and f():
            return True
    return False


def _stock():
    from sglang.kernels.ops.attention import flash_mla_sm120 as m

    return m


def _args(q, kw):
    return (q, kw["k_cache"], kw["indices"], kw.get("topk_length"), kw.get("attn_sink"), kw["head_dim_v"],
            kw["softmax_scale"], kw.get("extra_k_cache"), kw.get("extra_indices_in_kvcache"),
            kw.get("extra_topk_length"))


def _pad_heads(q, kw, heads: int):
    """``q`` (and the sink) zero-padded to ``heads`` heads, for a stock path that needs more heads than given."""
    import torch

    qp = torch.zeros(*q.shape[:-2], heads, q.shape[-1], dtype=q.dtype, device=q.device)
    qp[..., : q.shape[-2], :] = q
    kw = dict(kw)
    if kw.get("attn_sink") is not None:
        s = torch.zeros(heads, dtype=kw["attn_sink"].dtype, device=q.device)
        s[: q.shape[-2]] = kw["attn_sink"].reshape(-1)[: q.shape[-2]]
        kw["attn_sink"] = s
    return qp, kw


def _flashinfer(m, q, kw):
    T, H = q.shape[0], q.shape[-2]
    if T <= m.SM120_DECODE_MAX_TOKENS:
        if not m.flashinfer_dsv4_decode_supports_num_heads(H, T) and H < 64:
            q, kw = _pad_heads(q, kw, 64)   # FlashInfer's decode kernel takes the stock 64-head shape
        return m._flash_mla_flashinfer(*_args(q, kw))[0]
    return m._flash_mla_sm120_prefill(*_args(q, kw))[0]


def test_fault() -> str:
    """``DSV4_SM120_TEST_SELFCHECK_FAULT`` (tests plant faults with it; empty in production) on the ranks of
    ``DSV4_SM120_TEST_FAULT_RANKS`` (empty: every rank), else empty."""
    fault = (settings.get("DSV4_SM120_TEST_SELFCHECK_FAULT") or "").strip()
    ranks = (settings.get("DSV4_SM120_TEST_FAULT_RANKS") or "").replace(" ", "")
    if fault and ranks:
        from dsv4_sm120.rank_agreement import process_rank

        return fault if str(process_rank()) in ranks.split(",") else ""
    return fault


def run_dsv4_kernel(q, num_heads: int, kw: dict, launch=None, qk=None):
    """Our kernel on the real heads of ``q`` -> ``[T, 1, num_heads, 512]`` (what serving and the self-check
    call). ``DSV4_SM120_TEST_SELFCHECK_FAULT`` plants faults (tests): ``attention`` makes the result wrong,
    ``attention-raise`` makes every call raise and ``attention-raise-T=<n>`` the calls of n rows, before any launch
    (as a compile error would)."""
    from dsv4_sm120.attention import sparse_mla_decode

    fault = test_fault()
    if fault == "attention-raise" or fault == f"attention-raise-T={q.shape[0]}":
        raise RuntimeError(f"planted test fault {fault} (DSV4_SM120_TEST_SELFCHECK_FAULT) at T={q.shape[0]}")
    kw = dict(kw)
    sink = kw.pop("attn_sink", None)
    if sink is not None:
        sink = sink[:num_heads]
    out = sparse_mla_decode(q[..., :num_heads, :], attn_sink=sink, launch=launch, qk_mode=qk, **kw)[0]
    if fault == "attention":
        out = out * 2
    return out


def stock_dispatch(q, kw):
    """SGLang's own sm_120 dispatcher, as unpatched SGLang calls it (``SGLANG_SM120_FLASHMLA_BACKEND`` picks)."""
    m = _stock()
    if (getattr(m, "_sm120_default_backend", "flashinfer") == "flashinfer" and q.shape[0] <= m.SM120_DECODE_MAX_TOKENS
            and not m.flashinfer_dsv4_decode_supports_num_heads(q.shape[-2], q.shape[0]) and q.shape[-2] < 64):
        q, kw = _pad_heads(q, kw, 64)
    return m.flash_mla_with_kvcache_sm120(q=q, **kw)[0]


# The startup self-check of a call outside CUDA-graph capture (``check(q, num_heads)``):
# :func:`.selfcheck.first_call`, set by the package (``sglang_glue/__init__.py``) since .selfcheck imports this
# module.
first_call_check: Optional[Callable] = None


def sparse_attention(forward_mode, *, q, num_heads: int, **kw):
    """Drop-in for ``flash_mla_with_kvcache_sm120(**kw)[0]`` in the DSv4 backend's sm_120 branch.

    ``q`` may carry padded heads (``q.shape[-2] > num_heads``); the output has ``q``'s head count
    for the stock paths and ``num_heads`` for ours (the model reads only the real heads). When our kernel raises,
    SGLang's stock dispatcher answers the call and the launch steps aside (:func:`step_aside`)."""
    if kw.get("softmax_scale") is None:
        kw["softmax_scale"] = q.shape[-1] ** (-0.5)
    if first_call_check is not None:
        first_call_check(q, num_heads)
    log_decisions()
    layout = layout_of(kw.get("extra_k_cache"))
    r = call_route(q.shape[0], layout, num_heads)
    b = r.backend
    if b == "dsv4" and (is_decode_like(forward_mode) or prefill_backend() == "dsv4"):
        try:
            return run_dsv4_kernel(q, num_heads, kw, r.launch, r.qk)
        except Exception as e:  # noqa: BLE001 - any failure of ours: the stock path answers, the server keeps serving
            step_aside(q.shape[0], layout, num_heads, r, q.device, f"{type(e).__name__}: {str(e)[:300]}")
            return stock_dispatch(q, kw)
    if b == STOCK:
        return stock_dispatch(q, kw)
    m = _stock()
    if b == "triton":
        from sglang.kernels.ops.attention.flash_mla_sm120_triton import flash_mla_sparse_decode_triton

        return flash_mla_sparse_decode_triton(*_args(q, kw))[0]
    if b == "torch":
        return m._sm120_sparse_decode_fwd(*_args(q, kw))[0]
    # FlashInfer (prefill rows under dsv4, or the flashinfer backend): real heads if it can
    if q.shape[-2] > num_heads and (q.shape[0] > m.SM120_DECODE_MAX_TOKENS
                                    or m.flashinfer_dsv4_decode_supports_num_heads(num_heads, q.shape[0])):
        q = q[..., :num_heads, :].contiguous()
        if kw.get("attn_sink") is not None:
            kw["attn_sink"] = kw["attn_sink"][:num_heads]
    return _flashinfer(m, q, kw)
