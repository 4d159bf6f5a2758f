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


# ---- the front page: what a user needs first, and every path, target and command it names real

README = (REPO / "README.md").read_text()
MADE_BY_SETUP = (".venv",)          # paths the README's own commands create


def _repo_glob(rel: str) -> bool:
    """``rel`` (``<x>`` placeholders allowed) names something in the checkout."""
    import glob
    import re

    pattern = re.sub(r"<[^>]*>", "*", rel.rstrip("/"))
    return bool(glob.glob(str(REPO / pattern)))


def _module_exists(name: str) -> bool:
    import importlib.util
    import sys as _sys

    _sys.path.insert(0, str(REPO / "overlay"))
    try:
        return importlib.util.find_spec(name) is not None
    finally:
        _sys.path.remove(str(REPO / "overlay"))


def test_readme_links_and_paths_are_real():
    import re

    links = re.findall(r"\]\(([^)#\s]+)(?:#([a-z0-9-]+))?\)", README)
    assert len(links) >= 10, links
    for target, anchor in links:
        if target.startswith("http"):
            continue
        assert (REPO / target).exists(), f"README links to {target}, which does not exist"
        if anchor:
            heads = [re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
                     for h in re.findall(r"^#+ (.+)$", (REPO / target).read_text(), re.M)]
            assert anchor in heads, (target, anchor, heads)
    paths = set()
    for span in re.findall(r"`([^`\n]+)`", README):
        for tok in span.split():
            tok = tok.split("=", 1)[-1].rstrip(",;:)")
            if "/" in tok and not tok.startswith(("http", "~", "$", "-", "/")) and re.fullmatch(r"[\w.<>/*-]+", tok) \
                    and not re.match(r"[A-Z_]+/", tok):      # BENCH_OUT/<subject>.csv: a variable's directory
                paths.add(tok)
    assert {"serve/serve_dsv4_tp4.sh", "bench/results/attention_h200.md"} <= paths, paths
    missing = sorted(p for p in paths if not p.startswith(MADE_BY_SETUP) and not _repo_glob(p)
                     and not p.startswith(("sglang/", "dsv4_sm120/")))
    assert not missing, f"README names paths that do not exist: {missing}"


def test_readme_commands_are_real():
    """Every command in the README's code blocks and `...` spans: make targets exist, scripts exist and are
    executable with the options named, `python -m` modules exist, VAR= prefixes are settings the product reads."""
    import re
    import shlex

    from dsv4_sm120 import settings

    known_vars = set(settings.registry()) | {"VENV", "ARGS", "SRC", "DST", "GPU", "BENCH_OUT", "TRACE", "RUN_DIR"}
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-zA-Z0-9_-]+):(?!=)", makefile, re.M))
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    spans = [s for s in re.findall(r"`([^`\n]+)`", README) if re.match(r"(?:[A-Z_0-9]+=\S* )*(?:make|bash|\.venv/bin/python) ", s)]
    commands = [c for b in blocks for line in b.splitlines() for c in line.split("#")[0].split("&&") if c.strip()]
    commands += [c for s in spans for c in s.split("&&")]
    assert len(commands) >= 8, commands
    seen = set()
    for cmd in commands:
        words = shlex.split(re.sub(r"<[^>]*>", "PLACEHOLDER", cmd))
        while words and re.fullmatch(r"[A-Z][A-Z0-9_]*=.*", words[0]):
            var = words.pop(0).split("=", 1)[0]
            assert var in known_vars, (cmd, var)
        prog, args = words[0], words[1:]
        if prog == "make":
            named = [a for a in args if "=" not in a]
            assert named and set(named) <= targets, (cmd, set(named) - targets)
            for a in args:
                if "=" in a:
                    assert a.split("=", 1)[0] in known_vars, (cmd, a)
            seen.add("make")
        elif prog == "bash":
            script = REPO / args[0]
            assert script.is_file() and os.access(script, os.X_OK), cmd
            help_text = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True,
                                       timeout=60).stdout
            for opt in (a for a in args[1:] if a.startswith("--")):
                assert opt in help_text, (cmd, opt)
            seen.add("bash")
        elif prog == ".venv/bin/python":
            assert args[0] == "-m" and _module_exists(args[1]), cmd
            seen.add("python")
        else:
            raise AssertionError(f"README command of an unknown kind: {cmd}")
    assert seen == {"make", "bash", "python"}, seen
    # the two commands and the test suite, literally
    assert "make setup apply-patches && bash serve/serve_dsv4_tp4.sh" in README and "\nmake test\n" in README


def test_readme_is_a_front_page():
    """What a user needs first (what it is, the two commands, what they do, where to go next, the make targets,
    the settings a user sets); set-up internals, test and internal settings and benchmark detail live in docs/."""
    import re

    heads = re.findall(r"^## (.+)$", README, re.M)
    assert heads == ["The two commands", "Where to go next", "Make targets", "Settings"], heads
    words = len(README.split())
    assert words < 2500, f"README has {words} words"
    for hidden in ("DSV4_SM120_TEST_", "DSV4_SM120_STANDIN_", "DSV4_SM120_REPO_ROOT", "hard-linked", "tcp/lo"):
        assert hidden not in README, hidden
    for doc in ("docs/setup.md", "docs/benchmarks.md", "docs/serving.md", "docs/DEVELOPING.md"):
        assert f"]({doc}" in README, doc


def test_links_between_the_docs_resolve():
    """The README's content moved to docs/ (setup.md, benchmarks.md, DEVELOPING.md): their links still resolve."""
    import re

    for f in [*(REPO / "docs").glob("*.md"), REPO / "README.md", REPO / "bench" / "results" / "README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", f.read_text()):
            if not target.startswith("http"):
                assert (f.parent / target).exists(), f"{f.relative_to(REPO)} links to {target}"
