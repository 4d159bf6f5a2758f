"""bench/attn_targets.py: the speculative-row targets judged on a run's rows (no GPU): each target's boundary, the
baseline per GPU (FlashMLA, else FlashInfer), and the rows it must ignore."""

from __future__ import annotations

import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import attn_targets as T  # noqa: E402


def row(case, impl, rows, us, share=None, variant="default"):
    heads = case.split("_")[1][1:]
    notes = "layers=4" + (f"; floor_share={share:.3f}" if share is not None else "")
    return dict(case=case, impl=impl, variant=variant, heads=heads, batch=str(rows), us="" if us is None else str(us),
                notes=notes)


def test_share_target_boundary_and_row_range():
    rows = [row("spec_h16_c4", "ours-bf16", 48, 10.0, 0.70), row("spec_h16_c4", "ours-bf16", 384, 80.0, 0.71),
            row("spec_h16_c4", "ours-bf16", 24, 9.0, 0.10),       # below 32 rows: not judged
            row("spec_h16_c4", "ours-bf16", 768, 9.0, 0.10),      # above 384 rows: not judged
            row("spec_h8_c4", "ours-bf16", 96, 9.0, 0.10)]        # 8 heads: not this target
    (target, met, n, worst), = T.judge(rows)
    assert target.startswith("16 heads") and (met, n) == (2, 2) and worst == "lowest 0.700: spec_h16_c4 at 48 rows"
    rows.append(row("spec_h16_swa", "ours-bf16", 192, 20.0, 0.699))
    (target, met, n, worst), = T.judge(rows)
    assert (met, n) == (2, 3) and worst == "lowest 0.699: spec_h16_swa at 192 rows"
    assert "NOT met at 1 of 3 points" in T.report(rows)


def test_baseline_is_flashmla_where_measured_else_flashinfer():
    sm90 = [row("spec_h32_c4", "ours-bf16", 96, 30.0), row("spec_h32_c4", "flashmla", 96, 29.0),
            row("spec_h32_c4", "flashinfer", 96, 60.0)]   # both present: FlashMLA judges
    (target, met, n, worst), = T.judge(sm90)
    assert target.endswith("not slower than flashmla") and (met, n) == (0, 1) and "30.0" not in worst
    assert worst == "highest ours / flashmla 1.034: spec_h32_c4 at 96 rows"
    sm120 = [row("spec_h8_swa", "ours-bf16", 6, 5.0), row("spec_h8_swa", "flashinfer", 6, 5.0)]
    (target, met, n, _), = T.judge(sm120)
    assert target.endswith("not slower than flashinfer") and (met, n) == (1, 1)   # equal is not slower
    assert T.judge([row("spec_h8_swa", "ours-bf16", 6, 5.0)]) == []                 # no baseline: not judged


def test_wide_heads_within_the_allowance():
    rows = [row("spec_h64_c4", "ours-bf16", 384, 125.0), row("spec_h64_c4", "flashmla", 384, 100.0),
            row("spec_h64_swa", "ours-bf16", 48, 12.6), row("spec_h64_swa", "flashmla", 48, 10.0)]
    (target, met, n, worst), = T.judge(rows)
    assert target == "64 heads, within 1.25x of flashmla" and (met, n) == (1, 2) and "1.260: spec_h64_swa" in worst


def test_variants_errors_and_other_cases_are_ignored():
    rng = random.Random()
    share = rng.uniform(0.2, 0.6)
    rows = [row("spec_h16_c4", "ours-bf16", 96, 25.0, share),
            row("spec_h16_c4", "ours-bf16", 96, 20.0, 0.9, variant="impl=reg"),   # a variant: not the default
            row("spec_h16_c4", "flashmla", 96, None),                             # an error row: no time
            row("tp4_decode", "ours-bf16", 64, 9.0, 0.95),                         # not a spec_rows case
            row("spec_h16_c128", "flashmla", 48, 10.0)]                            # no ours row at that point
    got = T.judge(rows)
    assert [(g[1], g[2]) for g in got] == [(0, 1)] and f"{share:.3f}" in got[0][3]
    assert T.report([row("tp4_decode", "ours-bf16", 64, 9.0, 0.95)]) == ""
