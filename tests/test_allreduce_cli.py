"""The all-reduce decision in `make calibrate` (dry run, the profile and report it writes, a box of one GPU) and
`make bench-allreduce` (dry-run rows, the one-line refusal without GPUs, bad arguments, rows and table of a run),
the measurements answered by a fake launcher (the real processes are tests/test_allreduce_harness.py's)."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from dsv4_sm120.dev import bench_results as R
from dsv4_sm120.calibrate import __main__ as M
from dsv4_sm120.calibrate import allreduce as A
from dsv4_sm120 import machine_profile as P
from dsv4_sm120.machine_profile.allreduce_choice import IPC

BENCH = REPO / "bench" / "bench_allreduce.py"


def fake_launch(server, method, plan, env, on_size=lambda e: None, worker=None):
    """IPC 2 us + 1 us per row, NCCL LL 6 us + 0.5 per row, Simple 20 us flat; LL128 wrong everywhere."""
    sizes = {}
    for r in server.rows:
        us = {IPC: 2 + r, "nccl_LL": 6 + r / 2, "nccl_Simple": 20.0, "gloo": 50.0}.get(method)
        sizes[r] = {"status": "ok", "us": us, "err": 0.0, "timing": "graph"} if us else \
            {"status": "rejected", "reason": "graph replay: rank 2 has 7 of 512 elements off the float64 sum"}
        on_size({"rows": r, **sizes[r]})
    return {"status": "ok", "reason": "", "info": {"backend": "fake", "nccl": "2.30.7"}, "sizes": sizes}


def test_calibrate_dry_run_lists_the_allreduce_decision(capsys, monkeypatch):
    monkeypatch.setenv("DECODE_GPUS", "4,5,6,7")
    monkeypatch.setenv("MAX_RUNNING", "8")
    monkeypatch.setenv("SPEC_NUM_DRAFT_TOKENS", "2")
    assert M.main(["--dry-run", "--decisions", "allreduce", "--out", "/nonexistent"]) == 0
    out = capsys.readouterr().out
    assert "allreduce.decode: GPUs 4,5,6,7 (TP4): rows 1,2,4,8,16 x hidden 4096 bf16" in out
    assert "allreduce.prefill: GPUs 0,1,2,3 (TP4): rows 1,2,4," in out and ",4096,8192 x hidden" in out
    assert "methods pcie_ipc, nccl, nccl_LL, nccl_LL128, nccl_Simple, nccl_LL_Ring" in out
    assert "attention.swa" not in out
    monkeypatch.setenv("MAX_RUNNING", "lots")
    assert M.main(["--dry-run", "--decisions", "allreduce"]) == 2
    assert "MAX_RUNNING='lots'" in capsys.readouterr().err


def test_calibrate_writes_the_decision_the_report_and_the_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")   # --device cpu sets it in this process; restored after
    monkeypatch.setattr(A, "launch", fake_launch)
    assert M.main(["--device", "cpu", "--decisions", "allreduce", "--out", str(tmp_path), "--quiet"]) == 0
    out = capsys.readouterr().out
    prof = P.load(tmp_path / "cpu-interpreter.json")   # validated on load
    d = prof["decisions"]["allreduce"]
    assert set(d["servers"]) == {"prefill", "decode"} and d["servers"]["decode"]["choice"]["nccl"] == "gloo"
    assert "allreduce.decode (TP2): gloo (CPU stand-in) at every size" in out
    md = (tmp_path / "cpu-interpreter.md").read_text()
    assert "## allreduce" in md and "### decode" in md and "| rows | KiB | runs | `gloo` |" in md
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "cpu-interpreter-allreduce.png").stat().st_size > 1000
        assert "![µs per all-reduce](cpu-interpreter-allreduce.png)" in md


def test_a_box_of_one_gpu(monkeypatch, capsys):
    monkeypatch.setattr(A, "visible_gpus", lambda: 1)
    a = M.build_parser().parse_args([])
    assert M._allreduce_gpus(a, list(M.DECISIONS)) == ["attention", "moe", "fp8"]
    assert "allreduce: skipped: 1 GPU on this box" in capsys.readouterr().err
    a = M.build_parser().parse_args(["--decisions", "allreduce"])
    with pytest.raises(M.UsageError, match="needs a box with 2 or more GPUs"):
        M._allreduce_gpus(a, ["allreduce"])
    monkeypatch.setattr(A, "visible_gpus", lambda: 8)
    assert M._allreduce_gpus(a, ["allreduce"]) == ["allreduce"]


def _bench(*args, env=None):
    e = dict(os.environ, CUDA_VISIBLE_DEVICES="", **(env or {}))
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, env=e, timeout=300)


def test_bench_dry_run_no_gpu_and_bad_arguments(tmp_path):
    res = tmp_path / "a.csv"
    r = _bench("--dry-run", "--servers", "decode", "--methods", "pcie_ipc,nccl_LL", "--decode-rows", "1,64",
               "--results", str(res))
    assert r.returncode == 0, r.stderr
    rows = [x for x in csv.reader(ln for ln in r.stdout.splitlines() if ln.startswith("allreduce,"))]
    cols = R.columns("allreduce")
    got = [dict(zip(cols, x)) for x in rows]
    assert [(g["case"], g["impl"], g["rows"], g["bytes"], g["gpus"], g["tp"]) for g in got] == [
        ("decode", "pcie_ipc", "1", "8192", "4,5,6,7", "4"), ("decode", "nccl_LL", "1", "8192", "4,5,6,7", "4"),
        ("decode", "pcie_ipc", "64", "524288", "4,5,6,7", "4"), ("decode", "nccl_LL", "64", "524288", "4,5,6,7", "4")]
    assert not res.exists()
    r = _bench("--results", str(res))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no CUDA GPU visible" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not res.exists()
    for args, needle in ((["--methods", "nccl_Fast"], "nccl_Fast"), (["--servers", "router"], "--servers"),
                         (["--decode-rows", "0,4"], "--decode-rows"), (["--decode-gpus", "a"], "--decode-gpus")):
        r = _bench("--dry-run", *args)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_bench_rows_and_table_of_a_run(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import bench_allreduce as B
    finally:
        sys.path.remove(str(REPO / "bench"))
    plan = A.build_plan({}, 4096, 1, methods=[IPC, "nccl_LL", "nccl_LL128", "nccl"], roles=("decode",),
                        rows={"decode": [1, 8, 64]})
    s = plan.servers[0]

    def launch(server, method, plan, env, on_size=lambda e: None, worker=None):
        if method == "nccl":
            return {"status": "ok", "info": {}, "sizes": {r: {"status": "ok", "us": 7.0 + r} for r in server.rows}}
        return fake_launch(server, method, plan, env, on_size)
    res = A.measure_server(s, plan, {}, 8, None, launch)
    info = {"gpu": "NVIDIA RTX PRO 6000 Blackwell Server Edition", "date": R.now(), "command": "x", "commit": "abc"}
    rows = B.rows_of(s, res, info)
    assert R.append_rows(tmp_path / "allreduce.csv", "allreduce", rows) == 12
    back = R.read_rows(tmp_path / "allreduce.csv", "allreduce")
    ipc1 = next(r for r in back if r["impl"] == IPC and r["rows"] == "1")
    assert float(ipc1["us"]) == 3.0 and "chosen=1" in ipc1["notes"] and "backend=fake" in ipc1["notes"]
    # bus bandwidth: 2 (n-1)/n x bytes / time
    assert float(ipc1["gbps"]) == pytest.approx(8192 * 2 * 3 / 4 / 3e-6 / 1e9, rel=1e-3)
    wrong = next(r for r in back if r["impl"] == "nccl_LL128" and r["rows"] == "8")
    assert wrong["us"] == "" and "error=rejected: graph replay: rank 2" in wrong["notes"]
    text = R.render_table("allreduce", back, info["gpu"])
    assert "## decode: tp 4, gpus 4,5,6,7, hidden 4096, dtype bf16" in text
    assert "| nccl_LL128 | default | failed | failed | failed |" in text
    assert "| pcie_ipc / nccl | default | 0.38 | 0.67 | 0.93 |" in text
    json.dumps(res)   # the server result is plain JSON (it goes into the profile as is)
