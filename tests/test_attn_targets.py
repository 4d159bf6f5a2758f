"""bench/attn_targets.py: the speculative-row targets judged on a run's rows (no GPU): each target's boundary, the
baseline per GPU (FlashMLA, else FlashInfer), a point where ours failed, rows of several runs, and the rows it must
ignore."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import attn_targets as T  # noqa: E402


def row(case, impl, rows, us, share=None, variant="default", date="2026-12-04T10:00:00+00:00"):
    heads = case.split("_")[1][1:]
    notes = "layers=4" + (f"; floor_share={share:.3f}" if share is not None else "")
    return dict(case=case, impl=impl, variant=variant, heads=heads, batch=str(rows), us="" if us is None else str(us),
                notes=notes, gpu="NVIDIA H200", date=date)


def test_share_target_boundary_and_row_range():
    rows = [row("spec_h16_c4", "ours-bf16", 32, 10.0, 0.70), row("spec_h16_c4", "ours-bf16", 384, 80.0, 0.71),
            row("spec_h16_c4", "ours-bf16", 24, 9.0, 0.10),       # below 32 rows: not judged
            row("spec_h16_c4", "ours-bf16", 390, 9.0, 0.10),      # above 384 rows: not judged
            row("spec_h8_c4", "ours-bf16", 96, 9.0, 0.10)]        # 8 heads: not this target
    (target, met, n, worst), = T.judge(rows)
    assert target.startswith("16 heads") and (met, n) == (2, 2) and worst == "lowest 0.700: spec_h16_c4 at 32 rows"
    rows.append(row("spec_h16_swa", "ours-bf16", 192, 20.0, 0.699))
    (target, met, n, worst), = T.judge(rows)
    assert (met, n) == (2, 3) and worst == "lowest 0.699: spec_h16_swa at 192 rows"
    assert "NOT met at 1 of 3 points" in T.report(rows)


def test_share_from_the_floor_rows_time_not_the_rounded_note():
    # 6.996 / 10.0 = 0.6996: the note says 0.700, the times say just below the target
    rows = [row("spec_h16_c4", "ours-bf16", 96, 10.0, 0.6996), row("spec_h16_c4", "gather-floor", 96, 6.996)]
    (_, met, n, worst), = T.judge(rows)
    assert (met, n) == (0, 1) and worst == "lowest 0.699: spec_h16_c4 at 96 rows"   # rounded down


def test_baseline_is_flashmla_where_measured_else_flashinfer():
    sm90 = [row("spec_h32_c4", "ours-bf16", 96, 30.0), row("spec_h32_c4", "flashmla", 96, 29.0),
            row("spec_h32_c4", "flashinfer", 96, 60.0)]   # both present: FlashMLA judges
    (target, met, n, worst), = T.judge(sm90)
    assert target.endswith("not slower than flashmla") and (met, n) == (0, 1)
    assert worst == "highest ours / flashmla 1.035: spec_h32_c4 at 96 rows"   # 1.0345, rounded up
    sm120 = [row("spec_h8_swa", "ours-bf16", 6, 5.0), row("spec_h8_swa", "flashinfer", 6, 5.0)]
    (target, met, n, _), = T.judge(sm120)
    assert target.endswith("not slower than flashinfer") and (met, n) == (1, 1)   # equal is not slower
    assert T.judge([row("spec_h8_swa", "ours-bf16", 6, 5.0)]) == []                 # no baseline: not judged
    # a baseline that failed at a point leaves that point unjudged, not a division by nothing
    assert T.judge([row("spec_h8_swa", "ours-bf16", 6, 5.0), row("spec_h8_swa", "flashmla", 6, None)]) == []


def test_wide_heads_within_the_allowance():
    rows = [row("spec_h64_c4", "ours-bf16", 384, 125.0), row("spec_h64_c4", "flashmla", 384, 100.0),
            row("spec_h64_swa", "ours-bf16", 48, 12.6), row("spec_h64_swa", "flashmla", 48, 10.0)]
    (target, met, n, worst), = T.judge(rows)
    assert target == "64 heads, within 1.25x of flashmla" and (met, n) == (1, 2) and "1.260: spec_h64_swa" in worst
    # just above the bound prints above it (rounded up)
    (_, met, n, worst), = T.judge([row("spec_h64_c4", "ours-bf16", 384, 125.01),
                                   row("spec_h64_c4", "flashmla", 384, 100.0)])
    assert (met, n) == (0, 1) and "1.251" in worst


def test_a_point_where_ours_failed_is_not_met():
    rows = [row("spec_h16_c4", "ours-bf16", 48, 10.0, 0.9), row("spec_h16_c4", "flashmla", 48, 20.0),
            row("spec_h16_c4", "ours-bf16", 96, None), row("spec_h16_c4", "flashmla", 96, 30.0),
            row("spec_h16_c4", "gather-floor", 96, 12.0)]
    share, lead = T.judge(rows)
    assert share[1:] == (1, 2, "ours failed: spec_h16_c4 at 96 rows"), share
    assert lead[1:] == (1, 2, "ours failed: spec_h16_c4 at 96 rows"), lead
    assert "NOT met at 1 of 2 points" in T.report(rows)


def test_rows_of_several_runs_pair_within_their_run():
    a = [row("spec_h32_c4", "ours-bf16", 96, 30.0), row("spec_h32_c4", "flashmla", 96, 40.0)]
    later = "2026-12-05T10:00:00+00:00"
    b = [row("spec_h32_c4", "ours-bf16", 96, 50.0, date=later), row("spec_h32_c4", "flashmla", 96, 45.0, date=later)]
    (_, met, n, worst), = T.judge(a + b)
    # run a: 0.75 (met), run b: 1.11 (not); never ours of one run against the other's FlashMLA (50 / 40, 30 / 45)
    assert (met, n) == (1, 2) and worst == "highest ours / flashmla 1.112: spec_h32_c4 at 96 rows"


def test_variants_other_cases_and_lonely_rows_are_ignored():
    share = random.Random(28).uniform(0.2, 0.6)
    rows = [row("spec_h16_c4", "ours-bf16", 96, 25.0, share),
            row("spec_h16_c4", "ours-bf16", 96, 20.0, 0.9, variant="impl=reg"),   # a variant: not the default
            row("tp4_decode", "ours-bf16", 64, 9.0, 0.95),                         # not a spec_rows case
            row("spec_h16_c128", "flashmla", 48, 10.0)]                            # no ours row at that point
    got = T.judge(rows)
    assert [(g[1], g[2]) for g in got] == [(0, 1)] and f"{math.floor(share * 1000) / 1000:.3f}" in got[0][3]
    assert T.report([row("tp4_decode", "ours-bf16", 64, 9.0, 0.95)]) == ""


def test_small_rows_against_the_reference_run():
    then = [row("spec_h16_c4", "ours-bf16", 6, 9.0, date="2026-12-02T10:00:00+00:00"),
            row("spec_h16_c4", "ours-bf16", 6, 8.0, date="2026-12-03T10:00:00+00:00"),   # the latest is taken
            row("spec_h16_swa", "ours-bf16", 1, 6.0), row("spec_h16_c4", "ours-bf16", 12, 5.0)]
    now = [row("spec_h16_c4", "ours-bf16", 6, 8.4), row("spec_h16_swa", "ours-bf16", 1, 6.31),
           row("spec_h16_c4", "ours-bf16", 12, 50.0)]                                    # 12 rows: not this target
    assert T.judge(now) == [] and T.judge(now, [], "abc1234") == []                      # no reference: not judged
    (target, met, n, worst), = T.judge(now, then, "abc1234")
    # 8.4 / 8.0 = 1.05 (met, the bound itself), 6.31 / 6.0 = 1.0517 (not)
    assert target == "1-8 rows, within 5% of ours at abc1234" and (met, n) == (1, 2), (target, met, n)
    assert worst == "highest ours / ours then 1.052: spec_h16_swa at 1 rows"
    now[1]["us"] = ""                                                                    # ours failed there
    assert T.judge(now, then, "abc1234")[0][1:] == (1, 2, "ours failed: spec_h16_swa at 1 rows")


def test_driver_refuses_a_reference_that_is_not_a_commit(tmp_path):
    import subprocess

    base = [sys.executable, str(REPO / "bench" / "bench_attention.py"), "--dry-run", "--cases", "spec_h16_c4",
            "--batches", "6", "--results", str(tmp_path / "a.csv")]
    bad = subprocess.run(base + ["--targets-reference", "not-a-sha"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--targets-reference must be a commit id" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr
    ok = subprocess.run(base + ["--targets-reference", "57127da"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr


def forced(case, impl, rows, us, date="2026-12-05T10:00:00+00:00", table="arch_sm_120"):
    r = row(case, impl, rows, us, date=date)
    if impl == "ours-bf16" and table:
        r["notes"] += f"; device_table={table}; device_sms=132"
        r["variant"] = f"default @{table}"
    return r


def test_a_run_with_the_sm120_launch_is_judged_by_its_own_targets():
    """Rows timed with --device-table arch_sm_120: 32 heads not slower than FlashMLA and 64 within 1.15x at 8-384
    rows (each bound at and just past it), 16 heads within 3% of the reference run's forced rows; the H200 launch's
    targets (share, 1.25x) are not applied to them."""
    rows = [forced("spec_h32_c4", "ours-bf16", 8, 10.0), forced("spec_h32_c4", "flashmla", 8, 10.0),
            forced("spec_h32_c4", "ours-bf16", 384, 100.01), forced("spec_h32_c4", "flashmla", 384, 100.0),
            forced("spec_h32_c4", "ours-bf16", 6, 50.0), forced("spec_h32_c4", "flashmla", 6, 10.0),   # < 8 rows
            forced("spec_h64_swa", "ours-bf16", 96, 11.5), forced("spec_h64_swa", "flashmla", 96, 10.0),
            forced("spec_h64_c4", "ours-bf16", 192, 11.51), forced("spec_h64_c4", "flashmla", 192, 10.0),
            forced("spec_h16_c4", "ours-bf16", 48, 10.3), forced("spec_h16_c4", "gather-floor", 48, 1.0),
            forced("spec_h16_c4", "ours-bf16", 1, 5.2)]
    then = [forced("spec_h16_c4", "ours-bf16", 48, 10.0, date="2026-12-04T10:00:00+00:00"),
            forced("spec_h16_c4", "ours-bf16", 1, 5.0, date="2026-12-04T10:00:00+00:00"),
            forced("spec_h16_c4", "ours-bf16", 1, 1.0, date="2026-12-04T11:00:00+00:00", table="")]  # not forced
    lead, wide = T.judge(rows)
    assert lead[0] == "32 heads at 8-384 rows (arch_sm_120 launch), not slower than flashmla"
    assert lead[1:] == (1, 2, "highest ours / flashmla 1.001: spec_h32_c4 at 384 rows"), lead
    assert wide[0] == "64 heads at 8-384 rows (arch_sm_120 launch), within 1.15x of flashmla"
    assert wide[1:] == (1, 2, "highest ours / flashmla 1.151: spec_h64_c4 at 192 rows"), wide
    lead, wide, same = T.judge(rows, then, "59fc5a7")
    assert same[0] == "16 heads (arch_sm_120 launch), within 3% of ours at 59fc5a7"
    # 10.3 / 10.0 = 1.03 (met, the bound itself), 5.2 / 5.0 = 1.04 (not); the unforced 1.0 us row is no reference
    assert same[1:] == (1, 2, "highest ours / ours then 1.040: spec_h16_c4 at 1 rows"), same
    rows[2]["us"] = ""
    assert T.judge(rows)[0][1:] == (1, 2, "ours failed: spec_h32_c4 at 384 rows")
    # a variant of the forced run is not its default
    rows.append(dict(forced("spec_h32_c4", "ours-bf16", 24, 99.0), variant="impl=reg @arch_sm_120"))
    rows.append(forced("spec_h32_c4", "flashmla", 24, 10.0))
    assert T.judge(rows)[0][1:3] == (1, 2)
    assert "NOT met at 1 of 2 points" in T.report(rows)
