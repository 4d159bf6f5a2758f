"""`serve_dsv4_tp4.sh --detach` returns once state.json says ready; the supervisor writes that state a
moment before its READY line reaches the log. The follower must still print every line of the start
(the READY line included) and, on a failed start, the failure lines written while tearing down.
Driven by a child process that plays the supervisor with a deliberate lag between state and log."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dsv4_sm120.serving import deploy

LAGGING_SUPERVISOR = textwrap.dedent("""
    import json, os, sys, time
    run_dir, status, lag = sys.argv[1], sys.argv[2], float(sys.argv[3])
    def state(s):
        tmp = os.path.join(run_dir, "state.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"status": s, "message": "decode exited with code 3" if s == "failed" else ""}, f)
        os.replace(tmp, os.path.join(run_dir, "state.json"))
    def say(line):
        print("[serve] " + line, flush=True)
    say("router healthy after 1 s")
    time.sleep(0.3)
    state(status)
    time.sleep(lag)
    if status == "ready":
        say("READY: prefill, decode, router; stop with serve/stop.sh")
        time.sleep(30)
    else:
        say("FAILED: decode exited with code 3")
        say("all parts stopped")
""")


def start(tmp_path: Path, status: str, lag: float) -> subprocess.Popen:
    log = open(tmp_path / "supervisor.log", "ab")
    return subprocess.Popen([sys.executable, "-c", LAGGING_SUPERVISOR, str(tmp_path), status, str(lag)],
                            stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("lag", [0.0, 1.0])
def test_ready_line_is_printed_even_when_it_lags_the_state(tmp_path, capsys, lag):
    child = start(tmp_path, "ready", lag)
    try:
        t0 = time.monotonic()
        rc = deploy.follow_detached(tmp_path, child, limit_s=30)
        out = capsys.readouterr().out
        assert rc == 0
        assert "router healthy" in out and "[serve] READY: prefill, decode, router" in out, out
        assert time.monotonic() - t0 < 10
        assert child.poll() is None          # the supervisor keeps running: detached, not waited for
    finally:
        child.kill()
        child.wait()


def test_failed_start_prints_the_teardown_and_returns_1(tmp_path, capsys):
    child = start(tmp_path, "failed", 1.0)
    rc = deploy.follow_detached(tmp_path, child, limit_s=30)
    cap = capsys.readouterr()
    assert rc == 1
    assert "FAILED: decode exited with code 3" in cap.out and "all parts stopped" in cap.out, cap.out
    assert "startup failed (decode exited with code 3)" in cap.err
    assert json.loads((tmp_path / "state.json").read_text())["status"] == "failed"


def test_no_verdict_within_the_limit_raises(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(TimeoutError, match="did not report ready within 1 s"):
            deploy.follow_detached(tmp_path, child, limit_s=1)
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("detach,dry,expect", [
    ("no", "false", "foreground"), ("0", "", "foreground"), ("off", "No", "foreground"),
    ("yes", "0", "detached"), ("1", "off", "detached"), ("TRUE", "", "detached"),
    ("", "yes", "dry run"), ("0", "1", "dry run"), ("no", "on", "dry run"),
])
def test_yes_no_switches_mean_what_they_say(tmp_path, monkeypatch, detach, dry, expect):
    """DETACH / DRY_RUN take 0/1 and the usual words; "no" and "false" are off (anything but 0 used to count as on)."""
    seen = []

    class Supervisor:
        def __init__(self, plan):
            pass

        def run(self):
            seen.append("foreground")
            return 0

    monkeypatch.setattr(deploy, "run_preflight", lambda plan, say: [])
    monkeypatch.setattr(deploy.sv, "Supervisor", Supervisor)
    monkeypatch.setattr(deploy, "_start_detached", lambda plan: seen.append("detached") or 0)
    monkeypatch.setattr(deploy, "dry_run", lambda plan: seen.append("dry run") or 0)
    monkeypatch.setattr(deploy, "_link_latest", lambda plan: None)
    monkeypatch.setattr(deploy.runs, "record", lambda run_dir: None)
    for k, v in {"VENV": str(Path(sys.executable).parents[1]), "RUN_DIR": str(tmp_path / "run"),
                 "LOG_DIR": str(tmp_path / "logs"), "NVIDIA_SMI": "/nonexistent/nvidia-smi",
                 "DSV4_SM120_SERVE_STANDIN": "1", "DETACH": detach, "DRY_RUN": dry}.items():
        monkeypatch.setenv(k, v)
    assert deploy.main(["start"]) == 0
    assert seen == [expect]


@pytest.mark.parametrize("name,value", [("DETACH", "nope"), ("DRY_RUN", "maybe"), ("DRY_RUN", "2")])
def test_a_switch_that_is_neither_yes_nor_no_is_refused(tmp_path, monkeypatch, capsys, name, value):
    monkeypatch.setattr(deploy, "run_preflight", lambda plan, say: pytest.fail("the start went on"))
    monkeypatch.setattr(deploy, "dry_run", lambda plan: pytest.fail("the dry run went on"))
    for k, v in {"VENV": str(Path(sys.executable).parents[1]), "RUN_DIR": str(tmp_path / "run"),
                 "NVIDIA_SMI": "/nonexistent/nvidia-smi", name: value}.items():
        monkeypatch.setenv(k, v)
    assert deploy.main(["start"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"[serve] configuration error: {name}={value!r} is not valid: expected 0 or 1 (also true/false, "
                   f"yes/no, on/off)"], err
