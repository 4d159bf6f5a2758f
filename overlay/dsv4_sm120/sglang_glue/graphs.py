"""Patch 0006: SGLang's CUDA-graph capture loops on sm_120: ``DecodeCudaGraphRunner._capture_one_stream`` (which
the decode, target-verify, EAGLE draft and draft-extend runners share) and
``PrefillCudaGraphRunner._capture_one_stream``. The ranks of the tensor-parallel group agree at each step
(:func:`.allreduce.tp_group`; :func:`adopt_union`), so they capture the same graphs and issue the same collectives.

* :func:`before_capture`, at the start of each runner's capture loop: the startup self-check of our attention
  kernel over every launch the rows this runner captures reach (:func:`capture_rows`: each capture batch size
  times the runner's rows per request, plus its compact verify token buckets; the prefill runner's token counts
  when our kernel serves prefill rows), so a failing launch is on the stock path before any graph holds it
  (:func:`dsv4_sm120.sglang_glue.selfcheck.run`). Then the ranks exchange their fallbacks and every rank takes
  the union: a launch that failed on any rank steps aside on every rank.
* :func:`retrying`, around the capture of one size: after the capture returns or raises, the ranks exchange
  whether it raised, whether one of our kernels stepped aside during it, and their fallbacks. Every rank then
  takes the same decision: nothing to do (no rank raised, the same fallbacks everywhere); or every rank takes the
  union of the fallbacks and captures that size again, together (a rank raised after our kernel stepped aside
  there -- its CUDA stream capture may be invalidated even though the stock path answered the call -- or the
  ranks' fallbacks differ); or every rank stops with one line naming the rank and its exception
  (:class:`~dsv4_sm120.rank_agreement.StopServer`): a capture that raised without a fallback of ours (SGLang's own
  error, which stock SGLang would stop on too), a stop of ours, or a second capture that raised anywhere. A rank
  never captures alone: that would issue the warm-up and capture collectives of one size on one rank only.

The fallbacks the ranks share (:func:`ranks_state`, :func:`adopt_union`): every launch of our attention kernel
that stepped aside, our attention kernel disabled, our MoE kernel on its other path. Each is a rank's own decision
(a launch that failed its self-check, a call that raised inside a capture); at the two points above every rank
takes the union, and one line per fallback that not every rank had says which rank failed, its error, the rows it
affects and the stock path that now runs them, agreed by all ranks (the same line on every rank).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, List, Optional

logger = logging.getLogger(__name__)


def capture_rows(runner) -> List[int]:
    """The attention rows ``runner`` captures: ``capture_bs`` times ``captured_req_width``, and its
    ``capture_num_tokens`` (compact verify buckets, prefill token counts) where it has them."""
    width = int(getattr(runner, "captured_req_width", 1) or 1)
    rows = {int(bs) * width for bs in (getattr(runner, "capture_bs", None) or [])}
    rows |= {int(t) for t in (getattr(runner, "capture_num_tokens", None) or [])}
    return sorted(t for t in rows if t > 0)


def runner_label(runner) -> str:
    """``decode``, ``target-verify``, ``draft``, ``draft-extend`` or ``prefill``: which runner captures."""
    name = type(runner).__name__ if runner is not None else ""
    if "Prefill" in name:
        return "prefill"
    if "DraftExtend" in name:
        return "draft-extend"
    if "Draft" in name or getattr(getattr(runner, "model_runner", None), "is_draft_worker", False) is True:
        return "draft"
    mode = getattr(getattr(runner, "capture_forward_mode", None), "name", "")
    return "target-verify" if mode == "TARGET_VERIFY" else "decode"


def _device(runner):
    from . import selfcheck

    try:
        return selfcheck._runner_device(getattr(runner, "model_runner", None))
    except Exception:  # noqa: BLE001 - a stand-in runner without a device: the CPU facts
        return "cpu"


def before_capture(runner) -> None:
    """The attention self-check over :func:`capture_rows` with the heads of the runner's model (nothing when the
    model has no DeepSeek-V4 attention layer, our kernel serves no row, or -- prefill -- our kernel does not serve
    prefill rows), then the ranks' agreement on their fallbacks. Raises only
    :class:`~dsv4_sm120.rank_agreement.StopServer` (a rank that does not answer, a mis-paired agreement)."""
    from . import attention, selfcheck
    from .allreduce import tp_group

    label = runner_label(runner)
    try:
        model_runner = getattr(runner, "model_runner", None)
        if selfcheck.model_heads(getattr(model_runner, "model", None)) and (
                label != "prefill" or attention.prefill_backend() == "dsv4"):
            selfcheck.run_for_runner(model_runner, rows=capture_rows(runner), label=label)
    except Exception as e:  # noqa: BLE001 - the check must never stop a capture; serving falls back per call
        logger.warning("dsv4_sm120 self-check before CUDA-graph capture (%s) could not run (%s: %s); our kernels "
                       "fall back per call if they fail", label, type(e).__name__, e)
    states = tp_group().agree(f"{label} self-check before capture", ranks_state())
    if ranks_differ(states):
        adopt_union(states, f"{label} self-check", _device(runner), capture_rows(runner))


def fallbacks() -> int:
    """How many times one of our kernels stepped aside to a stock path in this process (attention launch buckets
    and MoE path switches; a fallback taken because another rank had it does not count)."""
    from . import attention, selfcheck

    return attention.fallback_count() + selfcheck.moe_fallback_count()


def _variant(args, kwargs) -> str:
    """The capture arguments that name a variant of one size (LoRA / attention variant, prefix chunks)."""
    parts = [repr(a) for a in args if isinstance(a, (str, int)) and not isinstance(a, bool)]
    parts += [f"{k}={v!r}" for k, v in sorted(kwargs.items()) if isinstance(v, (str, int, type(None)))]
    return f" ({', '.join(parts)})" if parts else ""


def _attempt(capture_one: Callable, size, args, kwargs):
    from dsv4_sm120.rank_agreement import StopServer

    before = fallbacks()
    try:
        result, error = capture_one(size, *args, **kwargs), None
    except Exception as e:  # noqa: BLE001 - agreed below; re-raised (as the stop) where the ranks decide so
        result, error = None, e
    text = None
    if error is not None:
        first = (str(error).splitlines() or [""])[0][:300]
        text = f"{type(error).__name__}: {first}" if first else type(error).__name__
    return result, error, {"error": text, "stepped": fallbacks() != before, "stop": isinstance(error, StopServer)}


def retrying(capture_one: Callable, runner=None) -> Callable:
    """``capture_one(size, *args, **kwargs)`` with the ranks' agreement after it, and the agreed second capture
    (module doc). ``runner``: the CUDA-graph runner (its label, device and rows for the log lines)."""
    from .allreduce import tp_group, who

    label = runner_label(runner)

    def capture(size, *args, **kwargs):
        from dsv4_sm120.rank_agreement import StopServer

        topic = f"{label} capture of size {size}{_variant(args, kwargs)}"
        group = tp_group()
        result, error, mine = _attempt(capture_one, size, args, kwargs)
        statuses = group.agree(topic, dict(mine, state=ranks_state()))
        raised = [(r, s["error"]) for r, s in enumerate(statuses) if s["error"]]
        fatal = [(r, e) for r, s in enumerate(statuses) for e in [s["error"]] if e and (s["stop"] or not s["stepped"])]
        n = f" (agreed by all {group.size} ranks)" if group.size > 1 else ""
        if fatal and group.size == 1:
            raise error          # one rank, nothing of ours stepped aside: SGLang's own error, as in stock SGLang
        if fatal:
            raise StopServer(f"dsv4_sm120 {label}: CUDA-graph capture of size {size} raised on {who(fatal)}, not "
                             f"after a fallback of ours; every rank stops{n}") from error
        states = [s["state"] for s in statuses]
        if not raised and not ranks_differ(states):
            return result
        adopt_union(states, f"{label} capture of size {size}", _device(runner), capture_rows(runner))
        if group.size == 1:
            logger.warning("dsv4_sm120 %s: CUDA-graph capture of size %s raised (%s) after our kernel stepped aside "
                           "during it; capturing that size again, on the stock path", label, size, raised[0][1])
        else:
            logger.warning("dsv4_sm120 %s: CUDA-graph capture of size %s %s; agreed by all %d ranks: every rank "
                           "captures that size again, with the fallbacks of every rank", label, size,
                           f"raised on {who(raised)} after our kernel stepped aside there" if raised
                           else "left the ranks with different fallbacks", group.size)
        result, error, mine = _attempt(capture_one, size, args, kwargs)
        again = group.agree(f"{topic} again", dict(mine, state=ranks_state()))
        raised = [(r, s["error"]) for r, s in enumerate(again) if s["error"]]
        if raised:
            raise StopServer(f"dsv4_sm120 {label}: CUDA-graph capture of size {size} raised again on {who(raised)} "
                             f"after every rank took the fallbacks; every rank stops{n}") from error
        if ranks_differ([s["state"] for s in again]):
            adopt_union([s["state"] for s in again], f"{label} capture of size {size} again", _device(runner),
                        capture_rows(runner))
        logger.warning("dsv4_sm120 %s: CUDA-graph capture of size %s again succeeded%s", label, size,
                       f" on all {group.size} ranks" if group.size > 1 else "")
        return result
    return capture


# ---------------------------------------------------------------------------- the fallbacks the ranks share


def ranks_state() -> dict:
    """This process's fallbacks, as the ranks exchange them (JSON): every launch of our attention kernel that
    stepped aside, our attention kernel disabled, our MoE kernel on its other path."""
    from . import attention as A
    from . import selfcheck as S

    return {"attention": A.failed_launches(), "attention_off": A.disabled("attention"),
            "moe": S.moe_fallback_path(), "moe_why": S._state.get("moe_fallback_why") or ""}


def _keys(st: dict) -> tuple:
    return (frozenset((lay, int(h), b) for lay, h, b, _ in st.get("attention") or ()),
            bool(st.get("attention_off")), st.get("moe") or None)


def ranks_differ(states: List[dict]) -> bool:
    """Whether the ranks' fallbacks differ (some rank would change by :func:`adopt_union`)."""
    return len({_keys(s) for s in states}) > 1


def _rows_text(rows: List[int]) -> str:
    from .selfcheck import _rows_text as text

    return text(rows) if rows else "-"


def adopt_union(states: List[dict], label: str, device, rows: Optional[Iterable[int]] = None) -> List[str]:
    """Take every rank's fallbacks (``states``, in rank order: the same list on every rank) in this process, and
    log one line per fallback that not every rank had (the same lines on every rank). ``rows``: the rows the runner
    captures, for the lines. Returns the lines."""
    from . import attention as A
    from . import selfcheck as S

    n = len(states)
    lines: List[str] = []
    entries = {}
    for r, st in enumerate(states):
        for lay, h, b, why in st.get("attention") or ():
            entries.setdefault((lay, int(h), b), []).append((r, why))
    changed = False
    for (lay, h, b), where in sorted(entries.items()):
        changed |= bool(A.adopt([[lay, h, b, where[0][1]]], device, f"rank {where[0][0]}"))
        if len(where) < n:
            hit = A.rows_of_launch(rows, lay, h, b, device) if rows is not None else []
            lines.append(f"our attention kernel failed on {_who(where)} at launch {b}; rows "
                         f"{_rows_text(hit) if rows is not None else 'of that launch'} of {lay} H={h} run "
                         f"{A.stock_name()} on every rank")
    off = [(r, st["attention_off"]) for r, st in enumerate(states) if st.get("attention_off")]
    if off and A.disabled("attention") is None:
        A.disable("attention", f"rank {off[0][0]}: {off[0][1]}")
        changed = True
    if off and len(off) < n:
        lines.append(f"every launch of our attention kernel failed its self-check on {_who(off)}; our kernel is "
                     f"disabled on every rank and {A.stock_name()} serves every row")
    moe = [(r, st["moe"], st.get("moe_why") or "") for r, st in enumerate(states) if st.get("moe")]
    if moe:
        S.adopt_moe_path(moe[0][1], f"rank {moe[0][0]}: {moe[0][2]}")
    if moe and len(moe) < n:
        lines.append(f"our MoE kernel switched to its {moe[0][1]} path on {_who([(r, w) for r, _, w in moe])}; "
                     f"every rank serves on its {moe[0][1]} path")
    for line in lines:
        logger.error("dsv4_sm120 %s: %s (agreed by all %d ranks)", label, line, n)
    if changed:
        A.relog()               # the decision lines again, with what this rank now runs
    return lines


def _who(where) -> str:
    from .allreduce import who

    return who((r, why[:200]) for r, why in where)
