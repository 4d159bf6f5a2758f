"""bench/profile_capture.py. End to end (in tests/test_serve_measure.py, sharing one stand-in deployment
with the measure test): the load runs through the real sglang.benchmark.serving and the real router,
/start_profile reaches the decode server with a body that SGLang 0.5.23's ProfileReq accepts, the
per-rank trace files (synthetic, written by the stand-in) are awaited and summarised."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_serve_orchestration import free_ports  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CAPTURE = REPO / "bench" / "profile_capture.py"


def test_refuses_without_a_deployment(tmp_path):
    (p1, p2) = free_ports(2)
    r = subprocess.run([sys.executable, str(CAPTURE), "--router", f"http://127.0.0.1:{p1}",
                        "--decode-url", f"http://127.0.0.1:{p2}", "--trace-dir", str(tmp_path), "--decode-tp", "4"],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, LOG_DIR=str(tmp_path)))
    assert r.returncode == 2 and "no healthy router" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([sys.executable, str(CAPTURE)], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, LOG_DIR=str(tmp_path / "none")))
    assert r.returncode == 2 and "no deployment found" in r.stderr


def check_capture(env, out: Path, stdout: str) -> None:
    """Assertions on a finished capture against the stand-in deployment (DSV4_SM120_STANDIN_TRACE_TP=4).
    Called from tests/test_serve_measure.py, which runs measure and profile on one deployment."""
    cap = json.loads((out / "capture.json").read_text())
    assert len(cap["traces"]) == 4 and all(f"{cap['profile_id']}-TP-{r}" in t for r, t in enumerate(cap["traces"]))
    run_dir = Path(env["LOG_DIR"]) / "latest"
    assert all(Path(t).parent == (run_dir / "profile").resolve() for t in cap["traces"])
    summ = json.loads((out / "summary.json").read_text())
    # stand-in step: MoE 40 us, sparse attention 34, dense GEMM 12, communication 9, other 2 (x 3 steps x 4 ranks)
    got = {g["group"]: round(g["us"], 6) for g in summ["groups"]}
    assert got == {"MoE": 480.0, "sparse attention": 408.0, "dense GEMM": 144.0, "communication": 108.0,
                   "norm/rope/other": 24.0}
    assert summ["bottleneck_kind"] == "MoE"
    assert "largest remaining bottleneck: MoE" in stdout
    # the decode server got exactly the body bench/profile_capture.py builds (validated against SGLang's
    # ProfileReq in tests/test_serve_dryrun.py::test_start_profile_body_is_an_sglang_profile_request)
    from dsv4_sm120.perf import profile_capture as pc
    rec = [json.loads(x) for x in Path(env["DSV4_SM120_STANDIN_RECORD"]).read_text().splitlines()]
    prof = [e for e in rec if e["path"] == "/start_profile"]
    assert len(prof) == 1 and prof[0]["role"] == "decode"
    assert prof[0]["body"] == pc.start_profile_body(str((run_dir / "profile").resolve()), 3, cap["profile_id"])
    assert cap["request"] == prof[0]["body"]


def test_wait_for_traces(tmp_path):
    from dsv4_sm120.perf import profile_capture as pc

    (tmp_path / "other-TP-0.trace.json.gz").write_bytes(b"x")          # another profile: ignored
    (tmp_path / "pid7-TP-0.trace.json.gz.part").write_bytes(b"x")      # still being written: ignored
    with pytest.raises(pc.CaptureError, match="0 of 2 trace file"):
        pc.wait_for_traces(tmp_path, "pid7", 2, 1.0)
    (tmp_path / "pid7-TP-0.trace.json.gz").write_bytes(b"x")
    (tmp_path / "pid7-TP-1.trace.json.gz").write_bytes(b"y")
    got = pc.wait_for_traces(tmp_path, "pid7", 2, 10.0)
    assert [p.name for p in got] == ["pid7-TP-0.trace.json.gz", "pid7-TP-1.trace.json.gz"]
    body = pc.start_profile_body("/d", 5, "pid7")
    assert body["num_steps"] == 5 and body["activities"] == ["GPU", "CPU"] and body["output_dir"] == "/d"
