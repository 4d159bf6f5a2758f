"""Patch 0006: SGLang's CUDA-graph capture loop (``DecodeCudaGraphRunner._capture_one_stream``, which the decode,
target-verify, EAGLE draft and draft-extend runners share) on sm_120.

* :func:`before_capture`, at the start of each runner's capture loop: the startup self-check of our attention
  kernel over every launch the rows this runner captures reach (:func:`capture_rows`: each capture batch size
  times the runner's rows per request, plus its compact verify token buckets), so a failing launch is on the
  stock path before any graph holds it (:func:`dsv4_sm120.sglang_glue.selfcheck.run`).
* :func:`retrying`, around the capture of one batch size: when the capture raises and one of our kernels stepped
  aside to a stock path during it (a call that raised inside the capture: its CUDA stream capture may be
  invalidated even though the stock path answered the call), that size is captured once more, now on the stock
  path, and the warning says so. A capture that raises without such a fallback raises as before.
"""

from __future__ import annotations

import logging
from typing import Callable, List

logger = logging.getLogger(__name__)


def capture_rows(runner) -> List[int]:
    """The attention rows ``runner`` captures: ``capture_bs`` times ``captured_req_width``, and its
    ``capture_num_tokens`` (compact verify buckets) where it has them."""
    width = int(getattr(runner, "captured_req_width", 1) or 1)
    rows = {int(bs) * width for bs in (getattr(runner, "capture_bs", None) or [])}
    rows |= {int(t) for t in (getattr(runner, "capture_num_tokens", None) or [])}
    return sorted(t for t in rows if t > 0)


def before_capture(runner) -> None:
    """The attention self-check over :func:`capture_rows` with the heads of the runner's model (nothing when the
    model has no DeepSeek-V4 attention layer or our kernel serves no row). Never raises."""
    from . import selfcheck

    try:
        model_runner = getattr(runner, "model_runner", None)
        if not selfcheck.model_heads(getattr(model_runner, "model", None)):
            return
        selfcheck.run_for_runner(model_runner, rows=capture_rows(runner), label=type(runner).__name__)
    except Exception as e:  # noqa: BLE001 - the check must never stop a capture; serving falls back per call
        logger.warning("dsv4_sm120 self-check before CUDA-graph capture could not run (%s: %s); our kernels fall "
                       "back per call if they fail", type(e).__name__, e)


def fallbacks() -> int:
    """How many times one of our kernels stepped aside to a stock path in this process (attention launch buckets
    and MoE path switches)."""
    from . import attention, selfcheck

    return attention.fallback_count() + selfcheck.moe_fallback_count()


def retrying(capture_one: Callable) -> Callable:
    """``capture_one(size, *args, **kwargs)`` that captures ``size`` once more when it raised after one of our
    kernels stepped aside during it (module doc)."""
    def capture(size, *args, **kwargs):
        before = fallbacks()
        try:
            return capture_one(size, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised unless our kernel stepped aside during this capture
            if fallbacks() == before:
                raise
            logger.warning("dsv4_sm120: CUDA-graph capture of size %s raised (%s: %s) after our kernel stepped aside "
                           "to the stock path during it; capturing that size again, on the stock path", size,
                           type(e).__name__, str(e)[:300])
        return capture_one(size, *args, **kwargs)
    return capture
