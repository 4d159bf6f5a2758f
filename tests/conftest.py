"""Shared fixtures.

`patched_sglang_site`: a scratch site dir holding the test environment's pinned `sglang`
package (files symlinked, so it costs seconds) with the whole patch series applied to it
(patched files are real files; the environment's own SGLang is never touched).  Run code
against it in a subprocess with `run_patched` (PYTHONPATH=<site>:overlay).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OVERLAY = REPO / "overlay"
SITE = Path(__file__).resolve().parent / "site"     # tests/site/sitecustomize.py (start-up hook of children, below)
if str(OVERLAY) not in sys.path:
    sys.path.insert(0, str(OVERLAY))

from dsv4_sm120 import patching  # noqa: E402

from forkserver import ForkClient  # noqa: E402  (tests/ is on sys.path: pytest puts a rootless conftest's dir there)


def link_tree(src: Path, dst: Path) -> None:
    """Mirror src into dst: directories created, files symlinked, the compiled ``__pycache__/*.pyc`` included.

    A .pyc is checked against its source's modification time and size, which a symlink reports from its target:
    the environment's bytecode stays valid for every file left as it was (the patched ones, replaced by real
    files, are compiled from source). Without it each child compiles every SGLang module it imports (~3 s of
    CPU for SGLang's model registry alone)."""
    for dirpath, dirnames, filenames in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for f in filenames:
            os.symlink(Path(dirpath) / f, dst / rel / f)


@pytest.fixture(scope="session")
def sglang_pkg_dir() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.origin:
        pytest.fail("sglang is not installed in the test environment; run the suite with `make test`")
    return Path(spec.origin).parent


def shared_tmp_dir(tmp_path_factory) -> Path:
    """A temporary directory shared by every worker of this pytest run: under pytest-xdist each worker's
    base temp dir is a child of the controller's, so their parent is common; without xdist it is the base."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextmanager
def file_lock(path: Path):
    """An exclusive lock on ``path`` (created if missing) held for the with-block, across processes."""
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_patched_site(sglang_pkg_dir: Path, site: Path, series) -> None:
    link_tree(sglang_pkg_dir, site / "sglang")
    for di in sglang_pkg_dir.parent.glob("sglang-*.dist-info"):
        shutil.copytree(di, site / di.name)
    patching.apply(site / "sglang", series, install=False, say=lambda *_: None)


@pytest.fixture(scope="session")
def patched_sglang_site(tmp_path_factory, sglang_pkg_dir) -> Path:
    # Built once per run, under a lock, in the run's shared temp dir keyed by the series hash, so the
    # pytest-xdist workers share one tree (it is only read by the tests).
    series = patching.load_series()
    shared = shared_tmp_dir(tmp_path_factory)
    site = shared / f"patched_site_{series.hash[:16]}"
    with file_lock(shared / f"{site.name}.lock"):
        if not (site / ".complete").is_file():
            partial = shared / f"{site.name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            build_patched_site(sglang_pkg_dir, partial, series)
            shutil.rmtree(site, ignore_errors=True)
            partial.rename(site)
            (site / ".complete").write_text(series.hash + "\n")
    return site


@pytest.fixture(scope="session")
def python_child(tmp_path_factory):
    """python_child(code, args=(), env=None, cwd=REPO, timeout=600, input=None) -> CompletedProcess of
    ``python -c code *args`` (output captured as text); ``env`` is the child's whole environment (default: this
    process's). Forked from a server that has the third-party packages imported already (tests/forkserver.py)
    where that is faithful, else a plain subprocess. What the servers preloaded is remembered in the cache
    directory, per interpreter, for the next run's servers (a cold cache only means they learn it again)."""
    import hashlib
    key = hashlib.sha256(f"{sys.executable} {sys.version}".encode()).hexdigest()[:16]
    remember = patching.cache_dir() / f"forkserver-preload-{key}.txt"
    try:
        remember.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        remember = None
    client = ForkClient(tmp_path_factory.mktemp("forkserver"), remember)

    def run(code: str, args=(), env: dict | None = None, cwd=REPO, timeout: float | None = 600,
            input: str | None = None) -> subprocess.CompletedProcess:
        env = dict(os.environ if env is None else env)
        args = [str(a) for a in args]
        r = client.run(code, args, env, str(cwd), timeout, input=input)
        if r is None:
            r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                               env=env, cwd=str(cwd), timeout=timeout, input=input)
        return r

    yield run
    client.close()


def probe_result(run_patched, code: str, job: dict, env: dict | None = None, timeout: float = 600) -> dict:
    """Run a probe script in the patched SGLang and return its result.

    `code` reads its job from the literal ``sys.argv[1]`` (replaced here by the job as JSON) and prints
    one line ``RESULT<json>``; the last such line is returned (and echoed for -s runs).
    """
    r = run_patched(code.replace("sys.argv[1]", repr(json.dumps(job))), env=env, timeout=timeout)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert lines, f"probe crashed:\n{r.stderr[-4000:]}"
    out = json.loads(lines[-1][len("RESULT"):])
    print(json.dumps(out, indent=1))
    return out


@pytest.fixture(scope="session")
def run_patched(patched_sglang_site, python_child):
    """run_patched(code, env=None, timeout=600, overlay=True) -> CompletedProcess, in the patched SGLang
    (PYTHONPATH = the patched tree, then the overlay unless overlay=False, then tests/site; env adds to this
    process's)."""
    def run(code: str, env: dict | None = None, timeout: float = 600, overlay: bool = True):
        e = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        paths = [patched_sglang_site] + ([OVERLAY] if overlay else []) + [SITE]
        e["PYTHONPATH"] = os.pathsep.join(map(str, paths))
        e.update(env or {})
        return python_child(code, env=e, timeout=timeout)
    return run


def gpu_compile_result(code: str, timeout: float = 300) -> dict:
    """Run ``code`` (a script that compiles Triton kernels for a ``GPUTarget`` on this CPU box and prints
    ``RESULT<json>``) in a child without ``TRITON_INTERPRET``; return the JSON. Skips the calling test when
    this Triton has no ASTSource/GPUTarget API or no usable ptxas."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no ASTSource/GPUTarget compile API")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert lines, r.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT"):])
    if any("ptxas" in v.get("error", "").lower() for v in out.values()):
        pytest.skip(f"no usable ptxas here: {out}")
    return out


# --------------------------------------------------------------------------- Triton interpreter speed
# tests/site/sitecustomize.py: Triton's interpreter stops re-patching triton.language on every nested
# @triton.jit call (kernels compute what they did). Installed here for this process and its xdist workers; the
# children that run the interpreter get the folder on their PYTHONPATH (SITE).
_spec = importlib.util.spec_from_file_location("dsv4_tests_sitecustomize", SITE / "sitecustomize.py")
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))


# --------------------------------------------------------------------------- pytest-xdist distribution
# the files that build a module-scoped fixture stay on one worker, the longest work starts first, and each run
# records what its tests took for the next one's order (tests/xdist_groups.py)
from xdist_groups import (pytest_collection_modifyitems, pytest_configure_node,  # noqa: E402,F401
                          pytest_runtest_logreport, pytest_sessionfinish, pytest_xdist_make_scheduler)
