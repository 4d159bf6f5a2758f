"""The speculative-row targets, judged on one bench/bench_attention.py run's ``spec_rows`` rows (docs/attention.md,
"Speculative row counts"): at 16 heads ours at >= 0.70 of the gather floor from 32 to 384 rows; at 8, 16 and 32 heads
never slower than the baseline; at 64 heads within 1.25x of it. The baseline is FlashMLA where the run measured it
(sm_90 / sm_100) and FlashInfer otherwise (sm_120). Rows 1-8 "within 5% of before" needs an earlier run and is not
judged here."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from attn_timing import note_value

OURS = "ours-bf16"
BASELINES = ("flashmla", "flashinfer")   # the first one a case has is its baseline
SHARE_HEADS, SHARE_MIN, SHARE_ROWS = 16, 0.70, (32, 384)
LEAD_HEADS, WIDE_HEADS, WIDE_MAX = (8, 16, 32), 64, 1.25


def _num(v: str) -> Optional[float]:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _floor_share(notes: str) -> Optional[float]:
    return _num(note_value(notes, "floor_share"))


def judge(rows: List[Dict[str, str]]) -> List[Tuple[str, int, int, str]]:
    """[(target, points met, points judged, the worst point as text)] for the targets this run's spec_rows
    default rows can judge; a target with no points (e.g. no baseline measured) is left out."""
    spec = [r for r in rows if r["case"].startswith("spec_h") and r["variant"] == "default" and _num(r["us"])]
    by_point: Dict[Tuple[str, int], Dict[str, Dict[str, str]]] = {}
    for r in spec:
        by_point.setdefault((r["case"], int(r["batch"])), {})[r["impl"]] = r
    share, lead, wide = [], [], []
    for (case, rows_), impls in sorted(by_point.items()):
        ours = impls.get(OURS)
        if ours is None:
            continue
        heads = int(ours["heads"])
        fs = _floor_share(ours["notes"])
        if heads == SHARE_HEADS and SHARE_ROWS[0] <= rows_ <= SHARE_ROWS[1] and fs is not None:
            share.append((fs, case, rows_))
        base = next((b for b in BASELINES if b in impls), None)
        if base is None:
            continue
        ratio = float(ours["us"]) / float(impls[base]["us"])
        if heads in LEAD_HEADS:
            lead.append((ratio, case, rows_, base))
        elif heads == WIDE_HEADS:
            wide.append((ratio, case, rows_, base))
    out = []
    if share:
        fs, case, n = min(share)
        out.append((f"{SHARE_HEADS} heads, >= {SHARE_MIN:.2f} of the gather floor at {SHARE_ROWS[0]}-{SHARE_ROWS[1]} "
                    "rows", sum(s >= SHARE_MIN for s, *_ in share), len(share), f"lowest {fs:.3f}: {case} at {n} rows"))
    for pts, limit, what in ((lead, 1.0, "/".join(map(str, LEAD_HEADS)) + " heads, not slower than"),
                             (wide, WIDE_MAX, f"{WIDE_HEADS} heads, within {WIDE_MAX}x of")):
        if pts:
            ratio, case, n, base = max(pts)
            names = "/".join(dict.fromkeys(p[3] for p in pts))
            out.append((f"{what} {names}", sum(p[0] <= limit for p in pts), len(pts),
                        f"highest ours / {base} {ratio:.3f}: {case} at {n} rows"))
    return out


def report(rows: List[Dict[str, str]]) -> str:
    """The targets as lines to print at the end of a run; empty when the run has no judgeable spec_rows rows."""
    got = judge(rows)
    if not got:
        return ""
    lines = ["", "Speculative-row targets (this run's spec_rows rows; docs/attention.md):"]
    for target, met, n, worst in got:
        verdict = "met" if met == n else f"NOT met at {n - met} of {n} points"
        lines.append(f"- {target}: {verdict} ({met}/{n} points; {worst})")
    return "\n".join(lines)
