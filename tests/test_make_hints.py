"""Hints that name options are typed where the command runs: under make as the whole make command
(`make calibrate ARGS=--dry-run`: a bare `--dry-run` after `make calibrate` is make's own dry run), run
directly as the options themselves."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAKEFILE = (REPO / "Makefile").read_text()


def test_args_names_the_make_command_under_make_only(monkeypatch):
    from dsv4_sm120 import hints

    monkeypatch.delenv("DSV4_SM120_MAKE_TARGET", raising=False)
    assert hints.args("--dry-run") == "--dry-run"
    monkeypatch.setenv("DSV4_SM120_MAKE_TARGET", "calibrate")
    assert hints.args("--dry-run") == "make calibrate ARGS=--dry-run"
    monkeypatch.setenv("DSV4_SM120_MAKE_TARGET", "bench-kv")
    assert hints.args("--mem dram") == "make bench-kv ARGS='--mem dram'"


def _recipes():
    """{target: recipe text} of the Makefile's rules."""
    out, cur = {}, None
    for line in MAKEFILE.splitlines():
        m = re.match(r"^([a-zA-Z0-9_-]+):(?!=)", line)
        if m:
            cur = m.group(1)
            out[cur] = ""
        elif line.startswith("\t") and cur:
            out[cur] += line + "\n"
        elif line.strip() and not line.startswith("#"):
            cur = None
    return out


def test_every_target_taking_args_tells_its_command_its_name():
    hinted = set(re.search(r"^HINTED_TARGETS := (.*)$", MAKEFILE, re.M).group(1).split())
    assert "$(HINTED_TARGETS): export DSV4_SM120_MAKE_TARGET = $@" in MAKEFILE
    takes_args = {t for t, r in _recipes().items() if "$(ARGS)" in r or "$(or $(ARGS)" in r}
    assert {"calibrate", "tune-fp8", "bench-kv", "bench-attention", "measure", "verify"} <= takes_args
    assert takes_args <= hinted, sorted(takes_args - hinted)


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_hints_printed_under_make_name_the_make_command(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MAKEFLAGS", "MAKELEVEL")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    venv = str(Path(sys.executable).parents[1])   # the test environment: torch without a GPU
    want = {"calibrate": ("make calibrate ARGS=--dry-run shows the plan", f"ARGS=--out {tmp_path}"),
            "tune-fp8": ("use make tune-fp8 ARGS=--dry-run to see the plan", f"ARGS=--out-dir {tmp_path}"),
            "bench-kv": ("make bench-kv ARGS='--mem dram' exercises", "ARGS=--prompts 1024"),
            "bench-attention": ("make bench-attention ARGS=--dry-run lists the rows", "")}
    for target, (text, args) in want.items():
        r = subprocess.run(["make", "-s", "--no-print-directory", target, f"VENV={venv}", f"BENCH_OUT={tmp_path}",
                            *([args] if args else [])], cwd=REPO, capture_output=True, text=True, env=env,
                           timeout=300)
        assert r.returncode != 0 and text in r.stderr, (target, r.stdout[-2000:], r.stderr[-2000:])
        assert "Traceback" not in r.stderr
    # run directly, the same hint names the option itself
    r = subprocess.run([sys.executable, "-m", "dsv4_sm120.calibrate", "--out", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, env={**env, "PYTHONPATH": str(REPO / "overlay")}, timeout=300)
    assert r.returncode == 2 and "(--dry-run shows the plan; --device cpu tests the harness)" in r.stderr, r.stderr
