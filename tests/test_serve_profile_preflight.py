"""The serve scripts and the machine profile: preflight's ``profile`` check warns (never fails) when no profile
matches a server's GPU model and the serving environment's versions, naming why; ``CALIBRATE=1`` puts the
calibration command in the plan (shown by the dry run) and runs it before the checks; its failure stops the start."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "overlay"))
from dsv4_sm120 import machine_profile as P  # noqa: E402
from dsv4_sm120.serving import preflight as pf  # noqa: E402
from dsv4_sm120.serving.plan import build_plan  # noqa: E402

VENV = str(Path(sys.executable).parent.parent)
PRO = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
OTHER = "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"


def smi(tmp_path, names):
    """A fake nvidia-smi answering ``--query-gpu=index,name`` with GPUs 0..7 named by ``names(i)``."""
    p = tmp_path / "nvidia-smi"
    rows = "\n".join(f"{i}, {names(i)}" for i in range(8))
    p.write_text(f"#!/bin/sh\ncat <<'EOF'\n{rows}\nEOF\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(p)


def plan_for(**kv):
    env = {"VENV": VENV, "RUN_DIR": "/tmp/dsv4-profile-run", "NVIDIA_SMI": "/nonexistent/nvidia-smi",
           "FP8_GEMM_BACKEND": "cutlass"}
    env.update(kv)
    return build_plan(env, "base")


def save(directory, gpu, versions):
    row = {"winner": "dsv4", "candidates": {"dsv4": {"status": "ok", "us": 1.0, "err": 0.0, "tol": 0.02}}}
    return P.save({"schema": P.SCHEMA, "gpu": gpu, "created_at": P.now_iso(), "versions": versions,
                   "deployment": {}, "decisions": {"attention.swa": {"buckets": {"1": row}}}},
                  P.profile_path(gpu, directory))


def test_profile_check_warns_per_gpu_model_and_never_fails(tmp_path, monkeypatch):
    d = tmp_path / "profiles"
    monkeypatch.setenv("DSV4_SM120_PROFILE_DIR", str(d))
    versions = P.running_versions()
    good = save(d, PRO, versions)
    save(d, OTHER, dict(versions, torch="2.0.0", driver="1.0"))
    # prefill on GPUs 0-3 (Server Edition, matching profile), decode on 4-7 (Workstation, other torch)
    plan = plan_for(NVIDIA_SMI=smi(tmp_path, lambda i: PRO if i < 4 else OTHER))
    failures, notes = pf.check_profile(plan)
    assert failures == []
    assert len(notes) == 2, notes
    assert notes[0].startswith(f"machine profile {good} applies to {PRO} (prefill GPU 0, prefill GPU 1"), notes
    assert notes[1].startswith(f"WARNING: no matching machine profile for {OTHER} (decode GPU 4"), notes
    assert "torch 2.0.0 in profile" in notes[1] and "CALIBRATE=1" in notes[1] and "make calibrate" in notes[1]
    # no file at all, and nvidia-smi missing: warnings too
    rows = [{"gpu": PRO, "usable": False, "path": None, "reasons": [f"no profile {d}/x.json (run `make calibrate`)"]}]
    (note,) = pf.interpret_profile_status(rows, {PRO: "decode GPU 4"})
    assert note.startswith(f"WARNING: no matching machine profile for {PRO} (decode GPU 4): no profile ")
    assert pf.check_profile(plan_for()) == ([], ["WARNING: could not check the machine profile (nvidia-smi "
                                                 "(/nonexistent/nvidia-smi) did not run: [Errno 2] No such file or "
                                                 "directory: '/nonexistent/nvidia-smi')"])
    assert "profile" in pf.CHECKS
    assert pf.check_profile(plan_for(DSV4_SM120_SERVE_STANDIN="1")) == ([], [])   # stand-ins read no profile


def test_calibrate_in_the_plan_the_dry_run_and_before_the_checks(tmp_path):
    plan = plan_for(CALIBRATE="1", MODEL_PATH="/models/v4", DECODE_GPUS="5,6")
    assert plan.calibrate_argv == [f"{VENV}/bin/python", "-m", "dsv4_sm120.calibrate"]
    assert plan.calibrate_env == {"CUDA_VISIBLE_DEVICES": "5", "DECODE_GPUS": "5,6", "MODEL_PATH": "/models/v4"}
    assert plan_for().calibrate_argv == [] and plan_for(CALIBRATE="1", NODE_ROLE="router").calibrate_argv == []
    assert plan_for(CALIBRATE="1", NODE_ROLE="prefill").calibrate_env["DECODE_GPUS"] == "0,1,2,3"
    # the serve script's dry run shows the command (its model check skipped: /models/v4 exists on no test machine;
    # the test environment's SGLang is not patched)
    env = dict(os.environ, VENV=VENV, CALIBRATE="1", DECODE_GPUS="4,5,6,7", MODEL_PATH="/models/v4",
               RUN_DIR=str(tmp_path / "run"), FP8_GEMM_BACKEND="cutlass", PREFLIGHT_SKIP="model,patches,ports")
    out = subprocess.run([str(REPO / "serve" / "serve_dsv4_tp4.sh"), "--dry-run"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = [x for x in out.stdout.splitlines() if x.startswith("cmd calibrate: ")]
    assert line == [f"cmd calibrate: CUDA_VISIBLE_DEVICES=4 DECODE_GPUS=4,5,6,7 MODEL_PATH=/models/v4 "
                    f"{VENV}/bin/python -m dsv4_sm120.calibrate"], out.stdout
    assert "setting CALIBRATE=1" in out.stdout
    # run before the checks: a failing calibration stops the start, a passing one lets the checks run
    marker = tmp_path / "ran"
    skip = ",".join(pf.CHECKS)
    failing = plan_for(CALIBRATE="1", PREFLIGHT_SKIP=skip)
    failing.calibrate_argv = [sys.executable, "-c", "import sys; sys.exit(3)"]
    said = []
    assert pf.run_preflight(failing, say=said.append) == [
        "CALIBRATE=1: `python -m dsv4_sm120.calibrate` failed (exit 3); its output is above (CALIBRATE=0 starts "
        "with the profile there is)"]
    assert not any(x.startswith("preflight ports") for x in said)
    passing = plan_for(CALIBRATE="1", PREFLIGHT_SKIP=skip)
    passing.calibrate_argv = [sys.executable, "-c",
                              f"import os; open({str(marker)!r}, 'w').write(os.environ['DECODE_GPUS'])"]
    said.clear()
    assert pf.run_preflight(passing, say=said.append) == []
    assert marker.read_text() == "4,5,6,7" and "preflight profile: skipped" in said
