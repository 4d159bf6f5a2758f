"""The speculative-row targets, judged on bench/bench_attention.py rows of the ``spec_rows`` cases (docs/attention.md,
"Benchmark"): at 16 heads ours at >= 0.70 of the gather floor from 32 to 384 rows; at 8, 16 and 32 heads never slower
than the baseline; at 64 heads within 1.25x of it. The baseline is FlashMLA where the run measured it (sm_90 /
sm_100) and FlashInfer otherwise (sm_120). With reference rows (an earlier run's, ``--targets-reference COMMIT``):
at 1-8 rows ours within 5% of its time there. A point where ours failed (no time) counts as not met.

Rows of ours timed with another architecture's launch (``--device-table arch_sm_120``: the ``device_table`` note)
are judged by the targets of that launch instead (issue 52, the sm_120 launch timed on this GPU): from 8 to 384 rows
at 32 heads not slower than the baseline and at 64 heads within 1.15x of it; with reference rows (the same
``device_table``), 16 heads within 3% of ours there at every row count."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

from attn_timing import FLOOR, note_value

OURS = "ours-bf16"
BASELINES = ("flashmla", "flashinfer")   # the first one a point has is its baseline
SHARE_HEADS, SHARE_MIN, SHARE_ROWS = 16, 0.70, (32, 384)
LEAD_HEADS, WIDE_HEADS, WIDE_MAX = (8, 16, 32), 64, 1.25
SMALL_ROWS, SMALL_MAX = 8, 1.05
# the forced-architecture run's targets: rows judged, 32 heads <= 1.0x, 64 heads <= 1.15x, 16 heads within 3%
FORCED_ROWS, FORCED_LEAD_HEADS, FORCED_WIDE_HEADS, FORCED_WIDE_MAX = (8, 384), 32, 64, 1.15
FORCED_SAME_HEADS, FORCED_SAME_MAX = 16, 1.03


def _down(x: float) -> str:
    """``x`` to 3 decimals, rounded down (a share just below a bound never prints as the bound)."""
    return f"{math.floor(x * 1000 + 1e-9) / 1000:.3f}"


def _up(x: float) -> str:
    """``x`` to 3 decimals, rounded up (a ratio just above a bound never prints as the bound)."""
    return f"{math.ceil(x * 1000 - 1e-9) / 1000:.3f}"


def _num(v) -> Optional[float]:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _share(ours: Dict[str, str], impls: Dict[str, Dict[str, str]]) -> Optional[float]:
    # the floor's time over ours from the two rows' times (the note's value is rounded to 3 decimals), else the note
    floor = _num(impls[FLOOR]["us"]) if FLOOR in impls else None
    if floor:
        return floor / float(ours["us"])
    return _num(note_value(ours["notes"], "floor_share"))


def _is_default(r: Dict[str, str]) -> bool:
    # the default launch's row: variant "default", or "default @arch_sm_XY" for another architecture's launch
    return r["variant"] == "default" or r["variant"] == f"default @{forced_table(r)}"


def forced_table(r: Dict[str, str]) -> str:
    """The architecture table a row of ours was timed with (``--device-table``), or "" for this GPU's own."""
    return note_value(r.get("notes", ""), "device_table") or ""


def _verdict(pts, limit: float, what: str, against: str) -> Tuple[str, int, int, str]:
    # one ratio target's line: points (ratio or None, case, rows, baseline name) at or under ``limit``
    bad = [p for p in pts if p[0] is None]
    ratio, case, n, base = bad[0] if bad else max(pts)
    names = "/".join(dict.fromkeys(p[3] for p in pts))
    return (f"{what} {names}", sum(p[0] is not None and p[0] <= limit for p in pts), len(pts),
            f"ours failed: {case} at {n} rows" if ratio is None
            else f"highest ours / {against or base} {_up(ratio)}: {case} at {n} rows")


def judge_forced(points, then, reference_name: str) -> List[Tuple[str, int, int, str]]:
    """The targets of a run timed with another architecture's launch (module docstring): ``points`` as in
    :func:`judge` (its forced ones), ``then`` the reference run's ours per (case, rows)."""
    lead, wide, same, table = [], [], [], ""
    for (_, _, case, n), impls in points:
        ours = impls[OURS]
        table = forced_table(ours)
        heads = int(ours["heads"])
        failed = _num(ours["us"]) is None
        if heads == FORCED_SAME_HEADS and (case, n) in then:
            same.append((None if failed else float(ours["us"]) / then[(case, n)], case, n, reference_name))
        base = next((b for b in BASELINES if b in impls and _num(impls[b]["us"])), None)
        if base is None or not FORCED_ROWS[0] <= n <= FORCED_ROWS[1]:
            continue
        ratio = None if failed else float(ours["us"]) / float(impls[base]["us"])
        if heads == FORCED_LEAD_HEADS:
            lead.append((ratio, case, n, base))
        elif heads == FORCED_WIDE_HEADS:
            wide.append((ratio, case, n, base))
    rows = f"at {FORCED_ROWS[0]}-{FORCED_ROWS[1]} rows ({table} launch)"
    out = []
    if lead:
        out.append(_verdict(lead, 1.0, f"{FORCED_LEAD_HEADS} heads {rows}, not slower than", ""))
    if wide:
        out.append(_verdict(wide, FORCED_WIDE_MAX, f"{FORCED_WIDE_HEADS} heads {rows}, within {FORCED_WIDE_MAX}x of",
                            ""))
    if same:
        out.append(_verdict(same, FORCED_SAME_MAX, f"{FORCED_SAME_HEADS} heads ({table} launch), within "
                            f"{FORCED_SAME_MAX - 1:.0%} of ours at", "ours then"))
    return out


def judge(rows: List[Dict[str, str]], reference: Optional[List[Dict[str, str]]] = None,
          reference_name: str = "the reference") -> List[Tuple[str, int, int, str]]:
    """[(target, points met, points judged, the worst point as text)] for the targets the spec_rows default rows can
    judge; a target with no points (e.g. no baseline measured) is left out. A point is one run's (GPU and start
    date) case and row count: rows of several runs are never paired across runs. ``reference``: rows of an earlier
    run (same GPU), the latest of each case and row count taken, for the small-row target."""
    by_point: Dict[Tuple[str, str, str, int], Dict[str, Dict[str, str]]] = {}
    for r in rows:
        if r["case"].startswith("spec_h") and _is_default(r):
            key = (r.get("gpu", ""), r.get("date", ""), r["case"], int(r["batch"]))
            by_point.setdefault(key, {})[r["impl"]] = r
    forced = sorted((k, v) for k, v in by_point.items() if OURS in v and forced_table(v[OURS]))
    table = forced_table(forced[0][1][OURS]) if forced else ""
    then = {}   # the reference run's time of ours per (case, rows), the latest row of each, timed with the same table
    for r in sorted(reference or [], key=lambda r: (r.get("date", ""), r.get("_line", 0))):
        if r["case"].startswith("spec_h") and _is_default(r) and r["impl"] == OURS and _num(r["us"]) \
                and forced_table(r) == table:
            then[(r["case"], int(r["batch"]))] = float(r["us"])
    out = judge_forced(forced, then, reference_name) if forced else []
    share, lead, wide, small = [], [], [], []   # (value, case, rows[, against]); value None: ours failed there
    for (_, _, case, n), impls in sorted(by_point.items()):
        ours = impls.get(OURS)
        if ours is None or forced_table(ours):
            continue
        heads = int(ours["heads"])
        failed = _num(ours["us"]) is None
        if n <= SMALL_ROWS and (case, n) in then:
            small.append((None if failed else float(ours["us"]) / then[(case, n)], case, n, reference_name))
        if heads == SHARE_HEADS and SHARE_ROWS[0] <= n <= SHARE_ROWS[1]:
            fs = None if failed else _share(ours, impls)
            if failed or fs is not None:
                share.append((fs, case, n))
        base = next((b for b in BASELINES if b in impls and _num(impls[b]["us"])), None)
        if base is None or heads not in LEAD_HEADS + (WIDE_HEADS,):
            continue
        ratio = None if failed else float(ours["us"]) / float(impls[base]["us"])
        (lead if heads in LEAD_HEADS else wide).append((ratio, case, n, base))
    if share:
        bad = [p for p in share if p[0] is None]
        fs, case, n = bad[0] if bad else min(share)
        out.append((f"{SHARE_HEADS} heads, >= {SHARE_MIN:.2f} of the gather floor at {SHARE_ROWS[0]}-{SHARE_ROWS[1]} "
                    "rows", sum(p[0] is not None and p[0] >= SHARE_MIN for p in share), len(share),
                    f"ours failed: {case} at {n} rows" if fs is None else f"lowest {_down(fs)}: {case} at {n} rows"))
    for pts, limit, what in ((lead, 1.0, "/".join(map(str, LEAD_HEADS)) + " heads, not slower than"),
                             (wide, WIDE_MAX, f"{WIDE_HEADS} heads, within {WIDE_MAX}x of"),
                             (small, SMALL_MAX, f"1-{SMALL_ROWS} rows, within {SMALL_MAX - 1:.0%} of ours at")):
        if pts:
            out.append(_verdict(pts, limit, what, "ours then" if pts is small else ""))
    return out


def report(rows: List[Dict[str, str]], reference: Optional[List[Dict[str, str]]] = None,
           reference_name: str = "the reference") -> str:
    """The targets as lines to print at the end of a run; empty when the run has no judgeable spec_rows rows."""
    got = judge(rows, reference, reference_name)
    if not got:
        return ""
    lines = ["", "Speculative-row targets (the spec_rows rows of this run; docs/attention.md, \"How to benchmark\"):"]
    for target, met, n, worst in got:
        verdict = "met" if met == n else f"NOT met at {n - met} of {n} points"
        lines.append(f"- {target}: {verdict} ({met}/{n} points; {worst})")
    return "\n".join(lines)
