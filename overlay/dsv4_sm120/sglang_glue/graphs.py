"""Patch 0006: SGLang's CUDA-graph capture loops on sm_120: ``DecodeCudaGraphRunner._capture_one_stream`` (which
the decode, target-verify, EAGLE draft and draft-extend runners share) and
``PrefillCudaGraphRunner._capture_one_stream``. The ranks of the tensor-parallel group agree at each step
(:mod:`.group`, :mod:`.ranks`), so they capture the same graphs and issue the same collectives.

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
"""

from __future__ import annotations

import logging
from typing import Callable, List, Optional

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
    from . import attention, ranks, selfcheck
    from .group import tp_group

    label = runner_label(runner)
    try:
        model_runner = getattr(runner, "model_runner", None)
        if selfcheck.model_heads(getattr(model_runner, "model", None)) and (
                label != "prefill" or attention.prefill_backend() == "dsv4"):
            selfcheck.run_for_runner(model_runner, rows=capture_rows(runner), label=label)
    except Exception as e:  # noqa: BLE001 - the check must never stop a capture; serving falls back per call
        logger.warning("dsv4_sm120 self-check before CUDA-graph capture (%s) could not run (%s: %s); our kernels "
                       "fall back per call if they fail", label, type(e).__name__, e)
    states = tp_group().agree(f"{label} self-check before capture", ranks.state())
    if ranks.differ(states):
        ranks.adopt_union(states, f"{label} self-check", _device(runner), capture_rows(runner))


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
    from . import ranks
    from .group import tp_group, who

    label = runner_label(runner)

    def capture(size, *args, **kwargs):
        from dsv4_sm120.rank_agreement import StopServer

        topic = f"{label} capture of size {size}{_variant(args, kwargs)}"
        group = tp_group()
        result, error, mine = _attempt(capture_one, size, args, kwargs)
        statuses = group.agree(topic, dict(mine, state=ranks.state()))
        raised = [(r, s["error"]) for r, s in enumerate(statuses) if s["error"]]
        fatal = [(r, e) for r, s in enumerate(statuses) for e in [s["error"]] if e and (s["stop"] or not s["stepped"])]
        n = f" (agreed by all {group.size} ranks)" if group.size > 1 else ""
        if fatal and group.size == 1:
            raise error          # one rank, nothing of ours stepped aside: SGLang's own error, as in stock SGLang
        if fatal:
            raise StopServer(f"dsv4_sm120 {label}: CUDA-graph capture of size {size} raised on {who(fatal)}, not "
                             f"after a fallback of ours; every rank stops{n}") from error
        states = [s["state"] for s in statuses]
        if not raised and not ranks.differ(states):
            return result
        ranks.adopt_union(states, f"{label} capture of size {size}", _device(runner), capture_rows(runner))
        if group.size == 1:
            logger.warning("dsv4_sm120 %s: CUDA-graph capture of size %s raised (%s) after our kernel stepped aside "
                           "during it; capturing that size again, on the stock path", label, size, raised[0][1])
        else:
            logger.warning("dsv4_sm120 %s: CUDA-graph capture of size %s %s; agreed by all %d ranks: every rank "
                           "captures that size again, with the fallbacks of every rank", label, size,
                           f"raised on {who(raised)} after our kernel stepped aside there" if raised
                           else "left the ranks with different fallbacks", group.size)
        result, error, mine = _attempt(capture_one, size, args, kwargs)
        again = group.agree(f"{topic} again", dict(mine, state=ranks.state()))
        raised = [(r, s["error"]) for r, s in enumerate(again) if s["error"]]
        if raised:
            raise StopServer(f"dsv4_sm120 {label}: CUDA-graph capture of size {size} raised again on {who(raised)} "
                             f"after every rank took the fallbacks; every rank stops{n}") from error
        if ranks.differ([s["state"] for s in again]):
            ranks.adopt_union([s["state"] for s in again], f"{label} capture of size {size} again", _device(runner),
                              capture_rows(runner))
        logger.warning("dsv4_sm120 %s: CUDA-graph capture of size %s again succeeded%s", label, size,
                       f" on all {group.size} ranks" if group.size > 1 else "")
        return result
    return capture
