"""The README's commands exactly as written, from a fresh clone, and `make test-gpu` without a GPU.

The set-up test creates the real pinned environment in the clone's default `.venv` with `make setup` (uv links the
packages from its cache: seconds when the cache is warm, as after the test environment was made; see
scripts/setup_env.sh), patches it, and asks for the status the ways the README does.  The clone lives next to the
cache (one file system: hard links, not copies) and is deleted afterwards.  It tests the committed HEAD.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO
from dsv4_sm120 import patching


def _env() -> dict:
    env = dict(os.environ)
    for k in ("PYTHONPATH", "VENV", "SGLANG_ROOT", "DSV4_SM120_REPO_ROOT", "PYTHONDONTWRITEBYTECODE"):
        env.pop(k, None)
    # .pyc compilation (minutes on 2 cores) is left to Python's first import in this throwaway environment
    env["DSV4_SM120_COMPILE_BYTECODE"] = "0"
    return env


def _run(cmd, cwd, env, timeout=900) -> subprocess.CompletedProcess:
    t = time.monotonic()
    r = subprocess.run(cmd, cwd=str(cwd), env=env, capture_output=True, text=True, timeout=timeout)
    print(f"{' '.join(map(str, cmd))}: exit {r.returncode} in {time.monotonic() - t:.1f} s")
    return r


def _uv_cache_dir() -> Path:
    return Path(os.environ.get("UV_CACHE_DIR") or Path.home() / ".cache" / "uv")


@pytest.mark.slow
def test_readme_setup_apply_status_in_fresh_clone():
    scratch = patching.cache_dir() / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    clone = Path(tempfile.mkdtemp(prefix="readme-clone-", dir=scratch))
    env = _env()
    try:
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, capture_output=True)
        assert not (clone / ".venv").exists()

        r = _run(["make", "setup", "apply-patches"], clone, env)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-4000:]
        assert "Traceback" not in out
        assert "with uv" in out, out[-4000:]  # the fast installer, not the pip fallback
        assert "[setup] environment" in out and "ready in" in out
        assert "applied " in out and "installing dsv4_sm120" in out
        py = clone / ".venv" / "bin" / "python"
        assert py.exists()

        r = _run(["make", "patch-status"], clone, env)
        out = r.stdout + r.stderr
        assert r.returncode == 0 and "Traceback" not in out, out
        assert "matches this repo's series" in out and "DIFFERS" not in out and "differs" not in out, out

        r = _run(["make", "apply-patches"], clone, env)
        out = r.stdout + r.stderr
        assert r.returncode == 0 and "Traceback" not in out, out
        assert "already applied" in out and "nothing to do" in out and "reinstalling" not in out, out

        # `python -m dsv4_sm120.patching status`: run by the environment's python with no arguments (its own
        # SGLang and the installed overlay copy, which must find this checkout), by a python without SGLang from
        # the checkout (the default .venv), and with a relative --python
        site_sglang = json.loads(_run([str(py), "-c", "import json, importlib.util as u, os; print(json.dumps("
                                       "os.path.dirname(u.find_spec('sglang').origin)))"], "/", env).stdout)
        for cmd, extra in (([str(py), "-m", "dsv4_sm120.patching", "status"], {}),
                           (["python3", "-m", "dsv4_sm120.patching", "status"], {"PYTHONPATH": str(clone / "overlay")}),
                           ([".venv/bin/python", "-m", "dsv4_sm120.patching", "status", "--python", ".venv/bin/python"],
                            {})):
            r = _run(cmd, clone, {**env, **extra})
            out = r.stdout + r.stderr
            assert r.returncode == 0 and "Traceback" not in out, (cmd, out)
            assert "matches this repo's series" in out and "differs" not in out.lower(), (cmd, out)
            st = json.loads(_run(cmd + ["--json"], clone, {**env, **extra}).stdout)
            assert st["sglang_root"] == site_sglang and st["matches_repo"] and st["overlay_current"] is True, st

        # the environment's packages are hard links into uv's cache, not an 11 GB copy
        torch_init = next((clone / ".venv").glob("lib/python3*/site-packages/torch/__init__.py"))
        if os.stat(_uv_cache_dir()).st_dev == os.stat(clone).st_dev:
            assert os.stat(torch_init).st_nlink >= 2
    finally:
        t = time.monotonic()
        subprocess.run(["rm", "-rf", str(clone)])  # faster than shutil.rmtree on ~40,000 files
        print(f"removed the clone in {time.monotonic() - t:.1f} s")
    assert not clone.exists()


def test_make_test_gpu_without_a_gpu_fails_and_says_why(tmp_path):
    """`make test-gpu` where torch sees no CUDA GPU: a clear error and a non-zero exit, not '97 skipped'."""
    venv = Path(sys.executable).parent.parent  # the test environment: it has torch
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run(["make", "-s", "test-gpu", f"VENV={venv}"], cwd=str(REPO), env=env, capture_output=True,
                       text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "no CUDA GPU is visible" in out and "skipped" not in out and "passed" not in out, out
    # and where torch is missing altogether it says that (make falls back to python3 without an environment)
    if subprocess.run(["python3", "-c", "import torch"], capture_output=True).returncode == 0:
        return
    r = subprocess.run(["make", "-s", "test-gpu", f"VENV={tmp_path}/none"], cwd=str(REPO), capture_output=True,
                       text=True, timeout=120, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "torch is not importable" in out and "make setup" in out, out
