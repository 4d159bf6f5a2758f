"""The fallbacks the ranks of a tensor-parallel group share: every launch of our attention kernel that stepped
aside, our attention kernel disabled, our MoE kernel on its other path.

A rank's fallbacks are its own decisions (a launch that failed its self-check, a call that raised inside a
capture). Ranks that decide differently capture different graphs and, where a capture is retried, issue different
collectives. So at each point where graphs are about to be captured (:mod:`.graphs`: the self-check before a
runner's capture loop, each captured size) the ranks exchange their fallbacks (:func:`state`) over the group
(:mod:`.group`), and every rank takes the union (:func:`adopt_union`): a launch that failed on any rank steps aside
on every rank, and one line per such fallback says which rank failed, its error, the rows it affects and the stock
path that now runs them, agreed by all ranks.
"""

from __future__ import annotations

import logging
from typing import Iterable, List, Optional

from . import attention as A
from . import selfcheck as S

logger = logging.getLogger(__name__)


def state() -> dict:
    """This process's fallbacks, as the ranks exchange them (JSON)."""
    return {"attention": A.failed_launches(), "attention_off": A.disabled("attention"),
            "moe": S.moe_fallback_path(), "moe_why": S._state.get("moe_fallback_why") or ""}


def _keys(st: dict) -> tuple:
    return (frozenset((lay, int(h), b) for lay, h, b, _ in st.get("attention") or ()),
            bool(st.get("attention_off")), st.get("moe") or None)


def differ(states: List[dict]) -> bool:
    """Whether the ranks' fallbacks differ (some rank would change by :func:`adopt_union`)."""
    return len({_keys(s) for s in states}) > 1


def _rows_text(rows: List[int]) -> str:
    return S._rows_text(rows) if rows else "-"


def adopt_union(states: List[dict], label: str, device, rows: Optional[Iterable[int]] = None) -> List[str]:
    """Take every rank's fallbacks (``states``, in rank order: the same list on every rank) in this process, and
    log one line per fallback that not every rank had (the same lines on every rank). ``rows``: the rows the runner
    captures, for the lines. Returns the lines."""
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
    from .group import who

    return who((r, why[:200]) for r, why in where)
