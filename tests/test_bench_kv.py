"""bench/bench_kv.py end to end on the CPU: real NIXL agents (UCX, two processes) move one TP4 rank's DSv4
KV pages in host memory, rows land in a kv results file that the table renderer reads; without a GPU the
GPU run says what it cannot measure; the byte table matches kv_bytes."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "overlay"))
from dsv4_sm120.dev import bench_results as R  # noqa: E402
from dsv4_sm120.serving import kv_bytes as kb  # noqa: E402

BENCH = REPO / "bench" / "bench_kv.py"


def run(*args, timeout=300, env=None):
    env = {k: v for k, v in (env or os.environ).items() if not k.startswith("UCX_")}
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, env=env, timeout=timeout)


def _tracked(rel: str) -> bytes:
    return (REPO / rel).read_bytes()


def test_dram_run_moves_verified_pages_and_appends_kv_rows(tmp_path):
    """The run the refusal suggests (`make bench-kv ARGS='--mem dram'`): its rows go outside the tracked tree by
    default (DSV4_SM120_CACHE/bench/kv.csv), the run says where, and bench/results/kv.csv is untouched."""
    out = tmp_path / "cache" / "bench" / "kv.csv"
    prompts = [1000, 4096 + 7]
    before = _tracked("bench/results/kv.csv")
    r = run("--mem", "dram", "--prompts", ",".join(map(str, prompts)), "--reps", "2",
            env=dict(os.environ, DSV4_SM120_CACHE=str(tmp_path / "cache")))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert _tracked("bench/results/kv.csv") == before
    assert f"rows appended to {out}" in r.stdout, r.stdout[-2000:]
    assert "UCX_NET_DEVICES=lo" in r.stdout and "SGLANG_DISAGGREGATION_NIXL_BACKEND=UCX" in r.stdout
    rows = R.read_rows(out, "kv")
    assert [(x["impl"], int(x["prompt"])) for x in rows] == [(i, n) for n in prompts for i in ("nixl-ucx", "memcpy-peer")]
    for x in rows:
        n = int(x["prompt"])
        assert int(x["bytes"]) == kb.transfer_bytes(n) and int(x["descs"]) == kb.summary(n)["descriptors"]
        assert float(x["us"]) > 0 and abs(float(x["gbps"]) - int(x["bytes"]) / float(x["us"]) / 1e3) < 1e-3 * float(x["gbps"]) + 1e-3
        assert x["gpu"] == "host memory (dram)" and "--mem dram" in x["command"]
    nixl = [x for x in rows if x["impl"] == "nixl-ucx"]
    assert all("first_us=" in x["notes"] and "ucx=1." in x["notes"] for x in nixl)
    table = R.render_table("kv", rows, "host memory (dram)")
    assert "| nixl-ucx | default |" in table and "N=1000" in table and "nixl-ucx / memcpy-peer" in table
    # appending again keeps one header
    with open(out) as f:
        assert sum(1 for line in csv.reader(f) if line and line[0] == "subject") == 1


def test_without_a_gpu_it_says_what_it_cannot_measure():
    import importlib.util
    if importlib.util.find_spec("torch"):
        import torch
        if torch.cuda.is_available():
            import pytest
            pytest.skip("this box has a GPU")
    r = run("--prompts", "1024", timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "cannot measure GPU-to-GPU KV transfer" in r.stderr and "--mem dram" in r.stderr
    assert "prompt    1024:" in r.stdout       # what it would move is still printed


def test_dry_run_table_and_bad_input(tmp_path):
    r = run("--dry-run", timeout=60)
    assert r.returncode == 0, r.stderr
    for n in (1024, 8192, 32768, 131072):
        s = kb.summary(n)
        line = next(x for x in r.stdout.splitlines() if x.startswith(f"prompt {n:>7}:"))
        assert f"{s['total'] / 2**20:9.2f} MiB in {s['descriptors']:>6} pages" in line
    for bad, msg in ((["--prompts", "1k"], "expected a comma list"), (["--prompts", "0"], "expected a comma list"),
                     (["--config", str(tmp_path / "none.json")], "cannot read")):
        r = run(*bad, "--dry-run", timeout=60)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_every_bench_target_writes_outside_the_tree_by_default(tmp_path):
    """attention, moe, fp8, kv: the make targets and the drivers themselves append to DSV4_SM120_CACHE/bench by
    default; the committed rows stay where they are, and `make bench-tables` still reads them."""
    import re
    import shutil

    import pytest

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "BENCH_OUT")}
    env["DSV4_SM120_CACHE"] = str(tmp_path / "cache")
    for subject in ("attention", "moe", "fp8", "kv"):
        r = subprocess.run(["make", "-n", f"bench-{subject}"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=60)
        assert f"--results {tmp_path}/cache/bench/{subject}.csv" in r.stdout, (subject, r.stdout)
        r = subprocess.run(["make", "-n", f"bench-{subject}", "BENCH_OUT=bench/results"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=60)
        assert f"--results bench/results/{subject}.csv" in r.stdout, (subject, r.stdout)
        src = (REPO / "bench" / f"bench_{subject}.py").read_text()
        assert re.search(rf'"--results", type=Path, default=R\.user_results\("{subject}"\)', src), subject
        assert R.user_results(subject) == Path(os.path.expanduser(os.environ.get(
            "DSV4_SM120_CACHE", "~/.cache/dsv4_sm120"))) / "bench" / f"{subject}.csv"
    r = subprocess.run(["make", "-n", "bench-tables"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert "--results bench/results/$s.csv" in r.stdout and "--out" not in r.stdout, r.stdout
    r = subprocess.run(["make", "-n", "bench-tables", f"BENCH_OUT={tmp_path}"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert f"--results {tmp_path}/$s.csv" in r.stdout and f"--out {tmp_path}/$s.md" in r.stdout, r.stdout
    help_text = subprocess.run(["make", "-s", "help"], cwd=REPO, env=env, capture_output=True, text=True).stdout
    assert f"BENCH_OUT={tmp_path}/cache/bench: where every bench-* target appends its rows" in help_text
