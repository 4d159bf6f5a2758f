"""Retired names of settings are refused by every make target and by scripts/setup_env.sh (which runs before any
environment exists), with the registry's list (dsv4_sm120.settings.RENAMED) and one line naming the new name."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_sm120 import settings as S
from dsv4_sm120 import retired_names

REPO = Path(__file__).resolve().parents[1]


def old_name(new: str) -> str:
    return next(o for o, n in S.RENAMED.items() if n == new)


INSTALLER, CACHE = old_name("DSV4_SM120_INSTALLER"), old_name("DSV4_SM120_CACHE")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in S.RENAMED and k not in ("MAKEFLAGS", "MAKELEVEL")}
    env.update(extra)
    return env


def test_found_and_message():
    assert retired_names.found({"PATH": "/bin"}) == []
    assert retired_names.found({CACHE: "/x"}, [INSTALLER, "VENV"]) == sorted([CACHE, INSTALLER])
    msg = retired_names.message([INSTALLER])
    assert msg.startswith(f"{INSTALLER} was renamed to DSV4_SM120_INSTALLER (CHANGELOG.md") and "\n" not in msg


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_targets_refuse_retired_names_in_the_environment_and_on_the_command_line(tmp_path):
    venv = tmp_path / "venv"
    for argv, env in ((["setup", f"VENV={venv}"], _env(**{INSTALLER: "pip"})),
                      (["help"], _env(**{CACHE: str(tmp_path / "c")})),
                      (["setup", f"VENV={venv}", f"{INSTALLER}=pip"], _env())):
        r = subprocess.run(["make", "--no-print-directory", *argv], cwd=REPO, capture_output=True, text=True, env=env,
                           timeout=120)
        old = INSTALLER if INSTALLER in " ".join(argv) or INSTALLER in env else CACHE
        assert r.returncode == 2, (argv, r.stdout, r.stderr)
        assert f"{old} was renamed to {S.RENAMED[old]}" in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert r.stdout == "" and not venv.exists()
    r = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 0 and "was renamed" not in r.stdout + r.stderr


def test_setup_script_refuses_retired_names_before_doing_anything(tmp_path):
    venv = tmp_path / "venv"
    r = subprocess.run(["bash", str(REPO / "scripts" / "setup_env.sh"), str(venv)], capture_output=True, text=True,
                       env=_env(**{INSTALLER: "pip", "PYTHON": sys.executable}), timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == f"[setup] error: {retired_names.message([INSTALLER])}\n", r.stdout
    assert not venv.exists()
