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
from dsv4_sm120 import bench_results as R  # noqa: E402
from dsv4_sm120.serving import kv_bytes as kb  # noqa: E402

BENCH = REPO / "bench" / "bench_kv.py"


def run(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_dram_run_moves_verified_pages_and_appends_kv_rows(tmp_path):
    out = tmp_path / "kv.csv"
    prompts = [1000, 4096 + 7]
    r = run("--mem", "dram", "--prompts", ",".join(map(str, prompts)), "--reps", "2", "--results", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
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
