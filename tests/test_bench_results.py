"""dsv4_sm120.dev.bench_results: the append-only benchmark results files and the tables generated from them; the bench
drivers' --dry-run / no-GPU behaviour (through their command lines)."""

from __future__ import annotations

import csv
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_sm120.dev import bench_results as R

REPO = Path(__file__).resolve().parents[1]


def _row(subject="attention", **kw):
    base = dict(case="tp4_decode", impl="ours-bf16", layout="swa128+c4", heads=16, batch=1, context=16384,
                gpu="NVIDIA H200", torch="2.11.0+cu130", triton="3.6.0", cuda="13.0", driver="580.1",
                commit="abc1234", date="2026-11-30T07:43:21+00:00", command="python3 bench/bench_attention.py",
                us=7.62, gbps=53.3, rel_err=6.2e-4)
    base.update(kw)
    return R.make_row(subject, **base)


def test_header_once_and_rows_round_trip(tmp_path):
    path = tmp_path / "sub" / "attention.csv"
    # fields with commas, quotes and a newline must come back as one line each
    cmd = 'python3 bench/bench_attention.py --variants "SPAN=0;BLOCK_N=64,num_warps=8"\n--cases tp4_decode'
    assert R.append_rows(path, "attention", [_row(command=cmd)]) == 1
    assert R.append_rows(path, "attention", [_row(batch=4, us=7.9), _row(batch=16, us=12.4)]) == 2
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and lines[0] == ",".join(R.columns("attention"))
    assert sum(1 for ln in lines if ln.startswith("subject,")) == 1
    rows = R.read_rows(path)
    assert [r["batch"] for r in rows] == ["1", "4", "16"] and [r["_line"] for r in rows] == [2, 3, 4]
    assert rows[0]["command"] == " ".join(cmd.split())
    assert float(rows[2]["us"]) == 12.4 and rows[0]["variant"] == "default"
    # csv's own reader agrees on every field count
    assert all(len(r) == len(R.columns("attention")) for r in csv.reader(path.open()))


def test_append_refuses_another_subjects_file(tmp_path):
    path = tmp_path / "moe.csv"
    R.append_rows(path, "attention", [_row()])
    before = path.read_bytes()
    with pytest.raises(R.ResultsError, match="header is not the moe header"):
        R.append_rows(path, "moe", [R.make_row("moe", case="tp4", impl="nvfp4-bf16", tokens=1,
                                               date="2026-11-30T00:00:00+00:00")])
    assert path.read_bytes() == before


def test_make_row_rejects_bad_fields():
    with pytest.raises(R.ResultsError, match="unknown field"):
        _row(bogus=1)
    with pytest.raises(R.ResultsError, match="us must be a number"):
        _row(us="fast")
    with pytest.raises(R.ResultsError, match="date must be ISO 8601"):
        _row(date="yesterday")
    with pytest.raises(R.ResultsError, match="case is empty"):
        _row(case="")


_WRITER = """
import sys
from dsv4_sm120.dev import bench_results as R
path, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
for i in range(n):
    R.append_rows(path, "moe", [R.make_row("moe", case="tp4", impl=tag, tokens=i, date="2026-11-30T00:00:00+00:00",
                                          command="x" * 3000, us=i + 0.5) for _ in range(3)])
"""


def test_concurrent_appends_from_two_processes(tmp_path):
    path = tmp_path / "moe.csv"
    env = dict(os.environ, PYTHONPATH=str(REPO / "overlay"))
    n = 150
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), tag, str(n)], env=env)
             for tag in ("proc-a", "proc-b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    lines = path.read_text().splitlines()
    assert lines.count(",".join(R.columns("moe"))) == 1 and lines[0].startswith("subject,")
    rows = R.read_rows(path)  # raises on any torn or interleaved line
    assert len(rows) == 2 * n * 3
    for tag in ("proc-a", "proc-b"):
        mine = [r for r in rows if r["impl"] == tag]
        assert sorted(int(r["tokens"]) for r in mine) == sorted(list(range(n)) * 3)
        assert all(r["command"] == "x" * 3000 and float(r["us"]) == int(r["tokens"]) + 0.5 for r in mine)


def test_malformed_rows_are_clear_errors(tmp_path):
    path = tmp_path / "attention.csv"
    R.append_rows(path, "attention", [_row(), _row(batch=4)])
    good = path.read_text()
    path.write_text(good + "attention,tp4_decode,default,ours-bf16,swa128+c4,16\n")
    with pytest.raises(R.ResultsError, match=r"attention.csv:4: expected 20 fields, got 6"):
        R.read_rows(path)
    bad_us = good.splitlines()[1].replace(",7.62,", ",seven,")
    path.write_text(good + bad_us + "\n")
    with pytest.raises(R.ResultsError, match=r":4: us must be a number"):
        R.read_rows(path)
    path.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(R.ResultsError, match=r":1: not a results header"):
        R.read_rows(path)
    # the CLI says the same in one line, without a traceback
    r = subprocess.run([sys.executable, "-m", "dsv4_sm120.dev.bench_results", "check", str(path)], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(REPO / "overlay")))
    assert r.returncode == 2 and "not a results header" in r.stderr and "Traceback" not in r.stderr


def test_latest_row_per_key_and_table(tmp_path):
    path = tmp_path / "attention.csv"
    rnd = random.Random()
    old, new = rnd.uniform(20, 30), rnd.uniform(5, 10)
    fm = rnd.uniform(11, 14)
    rows = [
        _row(us=old, date="2026-11-30T01:00:00+00:00"),                        # superseded by a later date
        _row(us=new, date="2026-11-30T05:00:00+00:00"),
        _row(us=99.0, date="2026-11-30T03:00:00+00:00"),                       # appended later, measured earlier
        _row(impl="flashmla", us=fm, date="2026-11-30T05:00:00+00:00"),
        _row(variant="SPAN=0", us=new * 1.5, date="2026-11-30T05:00:00+00:00"),  # current variant: shown
        _row(variant="KCVT=0", us=55.5, date="2026-11-30T01:00:00+00:00"),       # stale variant: hidden
        _row(batch=4, us=33.3, date="2026-11-30T01:00:00+00:00"),                # older cell: marked
        _row(gpu="NVIDIA RTX PRO 6000", us=3.3, date="2026-12-01T00:00:00+00:00"),
    ]
    R.append_rows(path, "attention", rows)
    got = R.read_rows(path)
    lat = R.latest_rows(got, "attention", "nvidia_h200")
    ours = [r for r in lat if r["impl"] == "ours-bf16" and r["variant"] == "default" and r["batch"] == "1"]
    assert len(ours) == 1 and float(ours[0]["us"]) == pytest.approx(new, abs=1e-3)
    # same date: the later line wins
    R.append_rows(path, "attention", [_row(us=new + 1, date="2026-11-30T05:00:00+00:00")])
    lat = R.latest_rows(R.read_rows(path), "attention", "NVIDIA H200")
    assert [float(r["us"]) for r in lat if r["impl"] == "ours-bf16" and r["variant"] == "default"
            and r["batch"] == "1"] == [pytest.approx(new + 1, abs=1e-3)]
    text = R.render_table("attention", R.read_rows(path), "NVIDIA H200")
    line = next(ln for ln in text.splitlines() if ln.startswith("| ours-bf16 | default |"))
    cells = [c.strip() for c in line.split("|")]
    assert cells[3] == f"{new + 1:.1f} (53 GB/s, 6.2e-04)"  # B=1: the latest row (not old, 99.0 or the other GPU)
    assert cells[4] == "33.3 (53 GB/s, 6.2e-04) *"  # B=4: only an older run measured it
    assert "| ours-bf16 | SPAN=0 |" in text and "KCVT=0" not in text
    ratio = next(ln for ln in text.splitlines() if ln.startswith("| ours-bf16 / flashmla"))
    assert f"{(new + 1) / fm:.2f}" in ratio
    assert "KCVT=0" in R.render_table("attention", R.read_rows(path), "NVIDIA H200", all_variants=True)
    with pytest.raises(R.ResultsError, match="no attention rows for GPU"):
        R.render_table("attention", R.read_rows(path), "NVIDIA B200")


def test_best_variant_summary():
    """A DSV4_SM120_ATTN_CONFIG suggestion only for a variant never >2% slower than the default and >3% faster
    somewhere; the fastest row per B named."""
    def rows(us):
        return [_row(variant=v, batch=b, us=t) for v, per_b in us.items() for b, t in per_b.items()] + [
            _row(impl="flashmla", batch=b, us=1.0) for b in (16, 128)]

    lines = "\n".join(R.best_variants(rows({"default": {16: 17.0, 128: 76.0}, "KCVT=1": {16: 17.1, 128: 60.0},
                                              "impl=reg": {16: 25.0, 128: 50.0}})))
    assert "B=16: default 17.0 us" in lines and "B=128: impl=reg 50.0 us (1.52x)" in lines
    assert "DSV4_SM120_ATTN_CONFIG='KCVT=1'" in lines  # reg is faster at 128 but 47% slower at 16
    lines = "\n".join(R.best_variants(rows({"default": {16: 17.0}, "KCVT=1": {16: 18.0}})))
    assert "keep the default" in lines and "DSV4_SM120_ATTN_CONFIG" not in lines
    assert R.best_variants(rows({"default": {16: 17.0}})) == []


def test_results_table_command(tmp_path):
    path = tmp_path / "fp8.csv"
    R.append_rows(path, "fp8", [R.make_row("fp8", case="tp4_gemms", impl=i, n=1024, k=4096, m=m, us=u,
                                           gpu="NVIDIA H200", date="2026-11-29T23:40:44Z")
                                for i, m, u in (("triton-tuned", 1, 5.8), ("triton-sglang-default-cfg", 1, 20.6))])
    out = tmp_path / "t.md"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "results_table.py"), "table", "fp8", "--results",
                        str(path), "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "| triton-tuned | default | 5.8 |" in text and "3.55" in text
    R.append_rows(path, "fp8", [R.make_row("fp8", case="tp4_gemms", impl="triton-tuned", n=1024, k=4096, m=1,
                                           us=6.0, gpu="NVIDIA B200", date="2026-11-29T23:40:44Z")])
    r = subprocess.run([sys.executable, str(REPO / "bench" / "results_table.py"), "table", "fp8", "--results",
                        str(path), "--out", "-"], capture_output=True, text=True)
    assert r.returncode == 2 and "pick one with --gpu" in r.stderr and "Traceback" not in r.stderr
    # without --gpu and --out, into a results dir: one table per GPU the rows hold
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "fp8.csv").write_text(path.read_text())
    assert R.main(["table", "fp8"], results_dir=tmp_path / "res") == 0
    assert sorted(p.name for p in (tmp_path / "res").glob("*.md")) == ["fp8_b200.md", "fp8_h200.md"]
    b200 = (tmp_path / "res" / "fp8_b200.md").read_text()
    assert "| triton-tuned | default | 6.0 |" in b200 and "5.8" not in b200
    assert "| triton-tuned | default | 5.8 |" in (tmp_path / "res" / "fp8_h200.md").read_text()


def test_committed_tables_are_generated_from_the_results_files(tmp_path):
    """The committed tables are exactly what the generator makes from the committed results files."""
    results = REPO / "bench" / "results"
    seen = set()
    for subject in ("attention", "moe", "fp8", "kv"):
        found = R.gpus(R.read_rows(results / f"{subject}.csv", subject))
        assert "NVIDIA H200" in found
        for gpu in found:      # every GPU the rows hold has its table, and it is what the rows make
            committed = results / f"{subject}_{R.gpu_slug(gpu)}.md"
            seen.add(committed.name)
            out = tmp_path / f"{subject}.md"
            assert R.main(["table", subject, "--gpu", gpu, "--out", str(out)], results_dir=results) == 0
            assert committed.is_file() and out.read_text() == committed.read_text(), (
                f"regenerate {committed.name}: make bench-tables")
    assert {p.name for p in results.glob("*_*.md")} - {"README.md"} <= seen, "a table no results file makes"
    # the README's headline numbers are the table's (tp4_decode, B = 1/4/16/64/128, ours and FlashMLA)
    lines = (REPO / "bench" / "results" / "attention_h200.md").read_text().split("## tp4_decode")[1].splitlines()
    head = next(ln for ln in lines if ln.startswith("| impl |")).split("|")
    cols = [head.index(f" B={b} ") for b in (1, 4, 16, 64, 128)]
    readme = " ".join((REPO / "README.md").read_text().split())
    for impl, before in (("ours-bf16", "(H=16, SWA128+c4) "), ("flashmla", "against FlashMLA's ")):
        cells = next(ln for ln in lines if ln.startswith(f"| {impl} | default |")).split("|")
        quoted = " / ".join(cells[c].split()[0] for c in cols)
        assert before + quoted in readme, (impl, quoted)


@pytest.mark.parametrize("script,args", [
    ("bench_attention.py", ["--cases", "tp4_decode,h32", "--variants", "SPAN=0", "--batches", "1,64"]),
    ("bench_moe.py", ["--m", "1,64", "--variants", "align=torch", "--variant-m", "64"]),
])
def test_drivers_dry_run_and_no_gpu(script, args, tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    res = tmp_path / "r.csv"
    r = subprocess.run([sys.executable, str(REPO / "bench" / script), *args, "--dry-run", "--results", str(res)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    subject = "attention" if "attention" in script else "moe"
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith(subject + ",")]
    if subject == "attention":
        # 2 cases x 2 B x (default + SPAN=0 at tp4_decode only, 4 baselines)
        assert sum(",SPAN=0,ours-bf16," in ln for ln in rows) == 2
        assert sum(",h32,default,ours-bf16," in ln for ln in rows) == 2
    else:
        assert sum(",align=torch," in ln for ln in rows) == 1 and len(rows) == 2 * 3 + 1
    assert not res.exists()  # a dry run writes nothing
    r = subprocess.run([sys.executable, str(REPO / "bench" / script), *args, "--results", str(res)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "error:" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not res.exists()
    r = subprocess.run([sys.executable, str(REPO / "bench" / script), "--dry-run", "--variants", "NOPE=1"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "NOPE" in r.stderr and "Traceback" not in r.stderr


def test_attention_driver_notes_variants_that_run_nowhere():
    """--variants with none of the chosen cases among --variant-cases (default tp4_decode) times the default launch
    only and says so on stderr (not silently); naming the case in --variant-cases times the variant there."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(REPO / "bench" / "bench_attention.py"), "--dry-run", "--cases", "spec_h16_c4",
           "--batches", "1,6", "--impls", "ours", "--variants", "waves=4"]
    for extra, n_variant in (([], 0), (["--variant-cases", "spec_h16_c4"], 2)):
        r = subprocess.run(cmd + extra, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        noted = "--variant-cases spec_h16_c4 to time them" in r.stderr
        assert noted == (n_variant == 0), r.stderr
        rows = [ln for ln in r.stdout.splitlines() if ln.startswith("attention,spec_h16_c4,")]
        assert sum(",waves=4,ours-bf16," in ln for ln in rows) == n_variant
        assert sum(",default,ours-bf16," in ln for ln in rows) == 2


@pytest.mark.parametrize("variant,needle", [("deq=3", "'deq' no longer exists"),
                                             ("BN1=64,aload=strided", "'aload' no longer exists"),
                                             ("align=sorted", "align must be one of"),
                                             ("BN1=wide", "BN1 needs an integer")])
def test_moe_driver_refuses_removed_and_bad_variant_keys(variant, needle):
    """A variant naming a knob the kernel no longer has is an error, not a run timed as the default."""
    r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_moe.py"), "--dry-run", "--variants", variant],
                       capture_output=True, text=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), timeout=300)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not r.stdout.strip()


def test_fp8_driver_dry_run_and_no_gpu(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    script = str(REPO / "bench" / "bench_fp8.py")
    summary = REPO / "configs" / "fp8" / "summary_NVIDIA_H200.json"
    r = subprocess.run([sys.executable, script, "--from-summary", str(summary), "--dry-run", "--results",
                        str(tmp_path / "f.csv")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("fp8,tp4_gemms,default,triton-tuned,1024,4096,1,")]
    assert len(rows) == 1 and ",2026-11-29T23:40:44Z," in rows[0]  # the tuner's date, not today's
    r = subprocess.run([sys.executable, script, "--dry-run"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "case tp4_gemms: python -m dsv4_sm120.tune_fp8 --tp 4 --quick" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, script, "--results", str(tmp_path / "f.csv")], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 2 and "no CUDA GPU" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "f.csv").exists()


def test_floor_rows_keep_the_attention_columns(tmp_path):
    """The gather floor is an impl row and its share a notes key: the attention columns stay those of the committed
    results file (whose rows all stay readable), and a table renders the floor next to the impls it bounds."""
    committed = REPO / "bench" / "results" / "attention.csv"
    assert next(csv.reader([committed.read_text().split("\n", 1)[0]])) == R.columns("attention")
    assert R.read_rows(committed)
    path = tmp_path / "attention.csv"
    rows = [_row(case="spec_h16_c4", impl="gather-floor", batch=96, us=19.1, rel_err=None,
                 notes="layers=4; checksum=ok; plan=S=2 (1+1),BLOCK_N=16,waves=8,num_warps=4"),
            _row(case="spec_h16_c4", batch=96, us=34.2, notes="layers=4; floor_share=0.558")]
    R.append_rows(path, "attention", rows)
    back = R.read_rows(path)
    assert [r["impl"] for r in back] == ["gather-floor", "ours-bf16"] and "floor_share=0.558" in back[1]["notes"]
    table = R.render_table("attention", back, "NVIDIA H200")
    assert "| gather-floor | default | 19.1" in table and "| ours-bf16 | default | 34.2" in table


def test_commit_override(tmp_path, monkeypatch):
    # a tree copied to another machine records the commit it is, not its stale .git's HEAD
    repo = tmp_path / "r"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "f").write_text("a")
    subprocess.run(["git", "-C", str(repo), "add", "f"], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"],
                   check=True)
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    monkeypatch.delenv(R.COMMIT_ENV, raising=False)
    assert R.git_commit(repo) == head
    (repo / "f").write_text("b")
    assert R.git_commit(repo) == head + "-dirty"
    sha = "%07x" % random.randrange(16 ** 7)
    monkeypatch.setenv(R.COMMIT_ENV, sha)
    assert R.git_commit(repo) == sha and R.environment(repo, "cmd")["commit"] == sha
    assert R.commit_env_error("p") is None
    monkeypatch.setenv(R.COMMIT_ENV, f" {sha} ")   # the registry's settings are read stripped
    assert R.git_commit(repo) == sha
    for bad in ("HEAD", "abc", "ABCDEF0", "12345 67", "1234567-wip"):
        monkeypatch.setenv(R.COMMIT_ENV, bad)
        err = R.commit_env_error("bench_x")
        assert err and err.startswith("bench_x: error: DSV4_SM120_COMMIT=") and "\n" not in err, bad
        assert R.missing_gpu("bench_x") == err   # every driver stops on it before measuring
        assert R.git_commit(repo) == head + "-dirty"   # never recorded


def test_driver_stops_on_a_bad_commit_override(tmp_path):
    env = dict(os.environ, DSV4_SM120_COMMIT="not-a-sha")
    res = tmp_path / "r.csv"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_attention.py"), "--cases", "tp4_decode",
                        "--batches", "1", "--results", str(res)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "DSV4_SM120_COMMIT" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not res.exists()


def test_attention_tables_compare_with_flashinfer_where_flashmla_is_absent():
    """On sm_120 FlashMLA does not run and FlashInfer is the baseline: the table gets an ours / flashinfer row (and
    no flashmla one); where both are measured, both rows."""
    gpu = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    rows = [_row(gpu=gpu, batch=b, us=us) for b, us in ((1, 8.0), (16, 20.0))]
    rows += [_row(gpu=gpu, impl="flashinfer", batch=b, us=us) for b, us in ((1, 10.0), (16, 16.0))]
    for r in rows:
        r["_line"] = 0
    text = R.render_table("attention", rows, gpu)
    ratio = next(ln for ln in text.splitlines() if ln.startswith("| ours-bf16 / flashinfer"))
    assert [c.strip() for c in ratio.split("|")][3:5] == ["0.80", "1.25"], ratio
    assert "/ flashmla" not in text
    both = rows + [_row(gpu=gpu, impl="flashmla", batch=1, us=4.0)]
    text = R.render_table("attention", both, gpu)
    assert "| ours-bf16 / flashmla | default | 2.00 | - |" in text and "| ours-bf16 / flashinfer |" in text
