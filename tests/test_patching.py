"""The patch machinery: all-or-nothing apply, byte-exact revert, refusals, status, check.

Trees are scratch extractions of the pinned wheel (only the target files + version files +
dist-info), so every test starts from real pristine bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import OVERLAY, REPO
from dsv4_sm120 import SGLANG_VERSION, patching

SERIES = patching.load_series()


def cli(*args, env=None, cwd=REPO, python=sys.executable):
    e = dict(os.environ, PYTHONPATH=str(OVERLAY))
    e.update(env or {})
    return subprocess.run([python, "-m", "dsv4_sm120.patching", *args], capture_output=True,
                          text=True, env=e, cwd=str(cwd))


def snapshot(root: Path) -> dict:
    """sha256 of every file under root (the state dir included), to prove 'nothing changed'."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            out[str(p.relative_to(root))] = patching.sha256_file(p)
    return out


@pytest.fixture
def tree(tmp_path) -> Path:
    """A pristine scratch sglang tree holding the series' target files."""
    return patching.extract_pristine(tmp_path, SERIES.targets + ["srt/server_args.py"])


def write_series(tmp_path: Path, patches: dict) -> Path:
    d = tmp_path / "series_dir"
    d.mkdir()
    for name, text in patches.items():
        (d / name).write_text(text)
    (d / "series").write_text("\n".join(patches) + "\n")
    return d / "series"


def test_repo_series_has_headers_and_a_current_lock():
    assert SERIES.patches[0].name == "0001-overlay-hook.patch"
    for p in SERIES.patches:
        assert p.header.strip(), f"{p.name} has no header"
    lock = patching.load_lock(SERIES)
    assert lock is not None, "patches/targets.lock missing: run make lock-patches"
    assert lock["series_hash"] == SERIES.hash, "patches/targets.lock is stale: run make lock-patches"


def test_check_patches_against_pristine_wheel():
    r = cli("check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "series OK" in r.stdout


def test_apply_twice_revert_apply_round_trip(tree):
    pristine = snapshot(tree)
    r = cli("apply", "--sglang-root", str(tree), "--no-install")
    assert r.returncode == 0, r.stderr
    assert "applied" in r.stdout
    once = snapshot(tree)
    assert once != pristine
    for path in SERIES.targets:  # every target matches the lock's patched hash
        assert patching.sha256_file(tree / path) == patching.load_lock(SERIES)["files"][path]["patched"]
    r = cli("apply", "--sglang-root", str(tree), "--no-install")
    assert r.returncode == 0 and "already applied" in r.stdout and "nothing to do" in r.stdout
    assert snapshot(tree) == once
    r = cli("revert", "--sglang-root", str(tree))
    assert r.returncode == 0 and "byte-identical" in r.stdout, r.stdout + r.stderr
    assert snapshot(tree) == pristine
    r = cli("revert", "--sglang-root", str(tree))
    assert r.returncode == 0 and "not patched" in r.stdout and "nothing to revert" in r.stdout
    r = cli("apply", "--sglang-root", str(tree), "--no-install")
    assert r.returncode == 0
    again = snapshot(tree)
    # byte-identical to a single apply, except the record's timestamp
    manifest = ".dsv4_sm120/manifest.json"
    assert {k: v for k, v in again.items() if k != manifest} == {k: v for k, v in once.items() if k != manifest}
    assert manifest in again


def test_status_reports_series(tree):
    r = cli("status", "--sglang-root", str(tree), "--json")
    st = json.loads(r.stdout)
    assert st["patched"] is False and st["state"] is None and st["sglang_version"] == SGLANG_VERSION
    cli("apply", "--sglang-root", str(tree), "--no-install")
    st = json.loads(cli("status", "--sglang-root", str(tree), "--json").stdout)
    assert st["patched"] and st["matches_repo"] and st["series_hash"] == SERIES.hash
    assert st["patches"] == [p.name for p in SERIES.patches]
    # the hook module inside the tree can read the same record
    assert patching.read_manifest(tree)["series_hash"] == SERIES.hash


def test_parent_dir_is_accepted_as_root(tree):
    r = cli("apply", "--sglang-root", str(tree.parent), "--no-install")
    assert r.returncode == 0, r.stderr


def test_wrong_version_refused_and_nothing_changed(tree):
    vf = tree / "_version.py"
    vf.write_text(vf.read_text().replace(f"'{SGLANG_VERSION}'", "'0.5.22'"))
    before = snapshot(tree)
    r = cli("apply", "--sglang-root", str(tree), "--no-install")
    assert r.returncode == 2
    assert "0.5.22" in r.stderr and f"sglang=={SGLANG_VERSION}" in r.stderr
    assert "Traceback" not in r.stderr
    assert snapshot(tree) == before


def test_sglang_missing(tmp_path):
    r = cli("apply", "--sglang-root", str(tmp_path / "nope"), "--no-install")
    assert r.returncode == 2 and "not an SGLang package directory" in r.stderr
    # an environment without SGLang: this interpreter's base (no sglang there)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    r = cli("apply", "--python", str(venv / "bin" / "python"))
    assert r.returncode == 2
    assert "SGLang is not installed" in r.stderr and f"sglang=={SGLANG_VERSION}" in r.stderr
    r = cli("apply", "--python", str(tmp_path / "missing" / "bin" / "python"))
    assert r.returncode == 2 and "make setup" in r.stderr


def test_make_apply_without_environment_says_setup(tmp_path):
    r = subprocess.run(["make", "-s", "apply-patches", f"VENV={tmp_path}/none"], capture_output=True,
                       text=True, cwd=str(REPO))
    assert r.returncode != 0
    assert "make setup" in (r.stdout + r.stderr)


def test_locally_modified_target_refused(tree):
    target = tree / "srt/models/deepseek_v4.py"
    target.write_text(target.read_text() + "\n# a local edit\n")
    before = snapshot(tree)
    r = cli("apply", "--sglang-root", str(tree), "--no-install")
    assert r.returncode == 1
    assert "srt/models/deepseek_v4.py" in r.stderr and "modified locally" in r.stderr
    assert snapshot(tree) == before


def test_modified_after_patching_refused_by_apply_and_revert(tree):
    cli("apply", "--sglang-root", str(tree), "--no-install")
    target = tree / "srt/models/deepseek_v4.py"
    target.write_text(target.read_text() + "\n# edited after patching\n")
    before = snapshot(tree)
    for cmd in ("apply", "revert"):
        args = [cmd, "--sglang-root", str(tree)] + (["--no-install"] if cmd == "apply" else [])
        r = cli(*args)
        assert r.returncode == 1, (cmd, r.stdout, r.stderr)
        assert "srt/models/deepseek_v4.py" in r.stderr
        assert snapshot(tree) == before


def test_failing_patch_leaves_nothing_half_applied(tree, tmp_path):
    good = {p.name: p.text for p in SERIES.patches}
    bad = ("header: a patch whose context does not exist\n\n"
           "--- a/srt/server_args.py\n+++ b/srt/server_args.py\n@@ -1,3 +1,3 @@\n"
           " this line is not in server_args.py\n-nor this\n+replacement\n still not\n")
    series_file = write_series(tmp_path, {**good, "0099-broken.patch": bad})
    before = snapshot(tree)
    r = cli("apply", "--sglang-root", str(tree), "--no-install", "--series", str(series_file))
    assert r.returncode == 1
    assert "0099-broken.patch" in r.stderr and "does not match" in r.stderr
    assert snapshot(tree) == before  # the good patches before it were not applied either


def test_crash_while_writing_rolls_back(tree):
    before = snapshot(tree)
    r = cli("apply", "--sglang-root", str(tree), "--no-install", env={"DSV4_SM120_TEST_PATCHING_FAIL_AFTER": "1"})
    assert r.returncode == 1
    assert "simulated failure" in r.stderr and "rolled back" in r.stderr
    assert snapshot(tree) == before


def test_hard_crash_mid_apply_is_recovered(tree):
    """A killed apply (state 'applying', some files written) is rolled back by the next apply or revert."""
    pristine = snapshot(tree)
    with pytest.raises(patching.PatchError):
        os.environ["DSV4_SM120_TEST_PATCHING_FAIL_AFTER"] = "1"
        try:
            patching.apply(tree, SERIES, install=False, say=lambda *_: None)  # no rollback: like a kill
        finally:
            del os.environ["DSV4_SM120_TEST_PATCHING_FAIL_AFTER"]
    assert patching.read_manifest(tree)["state"] == "applying"
    assert snapshot(tree) != pristine
    r = cli("revert", "--sglang-root", str(tree))
    assert r.returncode == 0, r.stderr
    assert snapshot(tree) == pristine
    # and once more, recovered by apply this time
    os.environ["DSV4_SM120_TEST_PATCHING_FAIL_AFTER"] = "1"
    try:
        with pytest.raises(patching.PatchError):
            patching.apply(tree, SERIES, install=False, say=lambda *_: None)
    finally:
        del os.environ["DSV4_SM120_TEST_PATCHING_FAIL_AFTER"]
    r = cli("apply", "--sglang-root", str(tree), "--no-install")
    assert r.returncode == 0 and "interrupted apply" in r.stdout
    assert patching.read_manifest(tree)["state"] == "applied"


def test_different_series_is_replaced(tree, tmp_path):
    """A tree patched by an older series is restored to pristine and patched with the current one."""
    extra = ("header: an extra one-line change, standing in for an older series\n\n"
             "--- a/srt/dsv4_sm120_hook.py\n+++ b/srt/dsv4_sm120_hook.py\n@@ -1,1 +1,2 @@\n"
             + "".join(" " + l for l in patching.split_lines(
                 patching.apply_series_to_contents(SERIES, {p: (None if p in SERIES.created else
                                                                patching.read_text(tree / p))
                                                            for p in SERIES.targets})["srt/dsv4_sm120_hook.py"])[:1])
             + "+# older series\n")
    series_file = write_series(tmp_path, {**{p.name: p.text for p in SERIES.patches}, "0099-old.patch": extra})
    r = cli("apply", "--sglang-root", str(tree), "--no-install", "--series", str(series_file))
    assert r.returncode == 0, r.stderr
    assert "# older series" in (tree / "srt/dsv4_sm120_hook.py").read_text()
    r = cli("apply", "--sglang-root", str(tree), "--no-install")
    assert r.returncode == 0 and "different series" in r.stdout, r.stdout + r.stderr
    assert "# older series" not in (tree / "srt/dsv4_sm120_hook.py").read_text()
    st = json.loads(cli("status", "--sglang-root", str(tree), "--json").stdout)
    assert st["matches_repo"]


def test_strict_applier_handles_offsets_and_no_newline_at_eof():
    text = "a\nb\nc\nd\ne"
    patch = ("h\n\n--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n@@ -4,2 +4,2 @@\n d\n-e\n\\ No newline at end of file\n"
             "+E\n\\ No newline at end of file\n")
    fp = patching.parse_patch("t", patch).files[0]
    assert patching.apply_hunks(text, fp, "t") == "a\nB\nc\nd\nE"
    # shifted by two lines: still applies at the offset
    assert patching.apply_hunks("x\ny\n" + text, fp, "t") == "x\ny\na\nB\nc\nd\nE"
    with pytest.raises(patching.PatchError):
        patching.apply_hunks(text.replace("c", "C"), fp, "t")
    # splitting is on \n only: a form feed inside a line is not a line break
    assert patching.split_lines("a\x0cb\nc") == ["a\x0cb\n", "c"]


def test_cli_help_and_usage_errors():
    r = cli("--help")
    assert r.returncode == 0 and "apply" in r.stdout and "revert" in r.stdout
    r = cli("apply")
    assert r.returncode == 2 and "no SGLang tree given" in r.stderr and "Traceback" not in r.stderr


def test_apply_installs_overlay_and_revert_removes_it(tree, tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_SM120_ORIG_PYTHONPATH", "")  # as the Makefile does: ask the env, not the checkout
    venv = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    r = cli("apply", "--sglang-root", str(tree), "--python", py)
    assert r.returncode == 0, r.stdout + r.stderr
    chk = subprocess.run([py, "-c", "import dsv4_sm120, sys; print(dsv4_sm120.__version__, dsv4_sm120.__file__)"],
                         capture_output=True, text=True, cwd="/", env={"PATH": os.environ["PATH"]})
    assert chk.returncode == 0 and str(venv) in chk.stdout, chk.stderr
    assert not (OVERLAY / "build").exists()
    st = json.loads(cli("status", "--sglang-root", str(tree), "--python", py, "--json").stdout)
    assert st["patched"] and st["overlay_current"] is True
    # the installed copy goes stale (as when the checkout's overlay code changes): status says so,
    # preflight refuses, and a re-apply (otherwise a no-op) reinstalls it
    build = next(venv.glob("lib/python*/site-packages/dsv4_sm120/_build.py"))
    build.write_text(build.read_text().replace("OVERLAY_HASH = '", "OVERLAY_HASH = 'stale"))
    st = json.loads(cli("status", "--sglang-root", str(tree), "--python", py, "--json").stdout)
    assert st["patched"] and st["matches_repo"] and st["overlay_current"] is False
    from dsv4_sm120.serving.preflight import interpret_patch_status
    assert "make apply-patches" in interpret_patch_status(st)[0]
    r = cli("apply", "--sglang-root", str(tree), "--python", py)
    assert r.returncode == 0 and "already applied" in r.stdout and "reinstalling" in r.stdout, r.stdout + r.stderr
    st = json.loads(cli("status", "--sglang-root", str(tree), "--python", py, "--json").stdout)
    assert st["overlay_current"] is True and interpret_patch_status(st) == []
    r = cli("revert", "--sglang-root", str(tree), "--python", py)
    assert r.returncode == 0
    assert f"uninstalled dsv4_sm120 from {py}" in r.stdout, r.stdout  # the revert says it also uninstalls
    chk = subprocess.run([py, "-c", "import dsv4_sm120"], capture_output=True, text=True, cwd="/",
                         env={"PATH": os.environ["PATH"]})
    assert chk.returncode != 0


def test_fetch_wheel_cold_cache_prints_only_the_path(tmp_path):
    """scripts/setup_env.sh captures stdout as the wheel path: progress must not end up there."""
    cache = tmp_path / "cache"
    r = cli("fetch-wheel", "--py", "311", env={"DSV4_SM120_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip().splitlines()
    assert len(out) == 1 and out[0].endswith(".whl") and Path(out[0]).is_file()
    assert patching.sha256_file(Path(out[0])) == patching.PINNED_WHEELS[Path(out[0]).name]
    assert "downloading" in r.stderr
    r = cli("fetch-wheel", "--py", "39", env={"DSV4_SM120_CACHE": str(cache)})
    assert r.returncode == 2 and "3.11, 3.12 or 3.13" in r.stderr


@pytest.mark.parametrize("compile_pyc", ["1", "0"])
def test_setup_env_states_what_a_warm_install_costs(tmp_path, compile_pyc):
    """The install line says what a warm run spends its time on: linking (seconds), then compiling the .pyc files
    (minutes on few cores) unless DSV4_SM120_COMPILE_BYTECODE=0; README says the same."""
    co = _fake_checkout(tmp_path)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    calls, uv = tmp_path / "calls.txt", tmp_path / "uv"
    uv.write_text(f"""#!/bin/bash
echo "$*" >> {calls}
case "$1" in --version) echo "uv 0.0-standin"; exit 0;; cache) echo {tmp_path}; exit 0;; esac
""")
    uv.chmod(0o755)
    env = dict(os.environ, UV=str(uv), DSV4_SM120_COMPILE_BYTECODE=compile_pyc)
    r = subprocess.run(["bash", str(co / "scripts" / "setup_env.sh"), str(venv)], capture_output=True, text=True,
                       env=env, timeout=25)
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("[setup] installing") and "cold:" in x)
    compiled = all("--compile-bytecode" in c for c in calls.read_text().splitlines() if c.startswith("pip install"))
    assert compiled == (compile_pyc == "1")
    if compile_pyc == "1":
        assert "compiling the .pyc files" in line and "DSV4_SM120_COMPILE_BYTECODE=0 skips it" in line, line
    else:
        assert "no .pyc compilation" in line, line
    readme = (REPO / "README.md").read_text()
    assert "re-creating it takes seconds" not in readme
    assert "`DSV4_SM120_COMPILE_BYTECODE=0 make setup` skips the compilation" in readme


def test_relative_python_is_taken_from_the_callers_cwd(tree, tmp_path):
    """--python .venv/bin/python works from the directory it is relative to (subprocesses run elsewhere)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / ".venv")], check=True)
    r = cli("status", "--sglang-root", str(tree), "--python", ".venv/bin/python", "--json", cwd=tmp_path,
            env={"DSV4_SM120_ORIG_PYTHONPATH": ""})  # as the Makefile does: ask the env, not the checkout
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    st = json.loads(r.stdout)
    assert st["overlay_current"] is False  # asked of that environment, which has no overlay
    r = cli("apply", "--python", ".venv/bin/python", cwd=tmp_path)  # no SGLang there: a clear refusal
    assert r.returncode == 2 and "SGLang is not installed" in r.stderr and "Traceback" not in r.stderr


def test_missing_python_is_a_clear_error_and_changes_nothing(tree, tmp_path):
    before = snapshot(tree)
    for cmd in (["apply", "--sglang-root", str(tree)], ["status", "--sglang-root", str(tree)], ["status"],
                ["revert", "--sglang-root", str(tree)]):
        r = cli(*cmd, "--python", "nowhere/bin/python", cwd=tmp_path)
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and "make setup" in r.stderr, r.stderr
        assert str(tmp_path / "nowhere/bin/python") in r.stderr
    assert snapshot(tree) == before


def test_status_without_arguments_uses_this_interpreters_sglang():
    import importlib.util
    r = cli("status", "--json")  # the test environment has SGLang
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["sglang_root"] == str(Path(importlib.util.find_spec("sglang").origin).parent)


def test_status_without_arguments_and_without_sglang_names_the_missing_env(tmp_path):
    venv = tmp_path / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    bare = str(venv / "bin" / "python")  # no SGLang: status looks for $VENV / the checkout's .venv
    r = cli("status", python=bare, env={"VENV": str(tmp_path / "absent")})
    assert r.returncode == 2 and "make setup" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = cli("status", "--json", python=bare, env={"VENV": sys.prefix})  # $VENV: the test environment
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["sglang_version"] == SGLANG_VERSION


def test_installed_copy_finds_its_checkout(tree, tmp_path):
    """The overlay copy installed into an environment (run as `.venv/bin/python -m dsv4_sm120.patching status`)
    compares against the checkout it was installed from, not against its own site-packages location."""
    site = tmp_path / "site"
    shutil.copytree(OVERLAY / "dsv4_sm120", site / "dsv4_sm120", ignore=shutil.ignore_patterns("__pycache__"))
    (site / "dsv4_sm120" / "_build.py").write_text(
        f"OVERLAY_HASH = {patching.overlay_tree_hash()!r}\nREPO_ROOT = {str(REPO)!r}\n")
    assert cli("apply", "--sglang-root", str(tree), "--no-install").returncode == 0
    env = {"PYTHONPATH": str(site)}
    r = cli("status", "--sglang-root", str(tree), cwd=tmp_path, env=env)
    assert r.returncode == 0 and "matches this repo's series" in r.stdout, r.stdout + r.stderr
    st = json.loads(cli("status", "--sglang-root", str(tree), "--json", cwd=tmp_path, env=env).stdout)
    assert st["matches_repo"] and st["repo_series_hash"] == SERIES.hash
    # a copy whose checkout is gone says so instead of claiming the series differs
    (site / "dsv4_sm120" / "_build.py").write_text(f"OVERLAY_HASH = 'x'\nREPO_ROOT = {str(tmp_path / 'gone')!r}\n")
    r = cli("status", "--sglang-root", str(tree), cwd=tmp_path, env=env)
    assert "cannot be read" in r.stdout and "DIFFERS" not in r.stdout, r.stdout + r.stderr


def test_pinned_wheels_come_from_the_data_file(tmp_path):
    assert len(patching.PINNED_WHEELS) == 3
    assert patching.load_pinned_wheels(REPO / "requirements" / "sglang-wheels.txt") == patching.PINNED_WHEELS
    assert all(f"cp3{v}-cp3{v}" in "".join(patching.PINNED_WHEELS) for v in (11, 12, 13))
    assert patching.load_pinned_wheels(tmp_path / "absent.txt") == {}


def _fake_checkout(tmp_path: Path) -> Path:
    co = tmp_path / "co"
    for d in ("scripts", "requirements", "overlay"):
        shutil.copytree(REPO / d, co / d, ignore=shutil.ignore_patterns("__pycache__"))
    return co


def test_setup_env_stamp_covers_the_environment_not_the_patch_tool(tmp_path):
    """Editing patching.py must not force a reinstall; changing a pin must."""
    co = _fake_checkout(tmp_path)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")
    run = lambda: subprocess.run(["bash", str(co / "scripts" / "setup_env.sh"), str(venv)], capture_output=True,
                                 text=True, env=dict(os.environ, PYTHON=str(tmp_path / "no-python")))
    (venv / ".dsv4_env_stamp").write_text("0" * 16 + "\n")
    r = run()  # stale stamp: it would reinstall, and stops at the missing interpreter
    assert r.returncode == 2 and "not found" in r.stdout, r.stdout + r.stderr
    import hashlib
    stamp = hashlib.sha256(b"".join((co / "requirements" / f).read_bytes() for f in (
        "runtime.txt", "nodeps.txt", "constraints.txt", "sglang-wheels.txt"))).hexdigest()[:16]
    (venv / ".dsv4_env_stamp").write_text(stamp + "\n")
    r = run()
    assert r.returncode == 0 and "up to date" in r.stdout, r.stdout + r.stderr
    with open(co / "overlay" / "dsv4_sm120" / "patching" / "__init__.py", "a") as fh:
        fh.write("\n# an edit to the patch tool\n")
    r = run()
    assert r.returncode == 0 and "up to date" in r.stdout, r.stdout + r.stderr
    wf = co / "requirements" / "sglang-wheels.txt"
    wf.write_text(wf.read_text().replace("00b3cd5b", "11b3cd5b"))
    r = run()
    assert r.returncode == 2 and "up to date" not in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("cached", [True, False], ids=["all-cached", "cache-miss"])
def test_setup_env_installs_from_uvs_cache_first(tmp_path, cached):
    """uv installs offline from its cache first (no index round trip per package); on a miss it says so and
    resolves online with the same arguments. A stand-in uv records each call."""
    co = _fake_checkout(tmp_path)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"  # the test environment's python (it has sglang 0.5.23 and pip) under this name
    py.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    calls, uv_cache = tmp_path / "calls.txt", tmp_path / "uv-cache"
    uv_cache.mkdir()
    uv = tmp_path / "uv"
    uv.write_text(f"""#!/bin/bash
echo "$*" >> {calls}
case "$1" in --version) echo "uv 0.0-standin"; exit 0;; cache) echo {uv_cache}; exit 0;; esac
for a; do [ "$a" = --offline ] && [ "$MISS" = 1 ] && {{ echo "error: not in the cache" >&2; exit 1; }}; done
echo " + a-package==1.0"
""")
    uv.chmod(0o755)
    env = dict(os.environ, UV=str(uv), MISS="0" if cached else "1", DSV4_SM120_COMPILE_BYTECODE="0")
    # the output pipe reaches its end when the script exits (the progress ticker's sleep must not hold it open
    # for 30 s): a reader such as `make setup | tee log` returns at once
    r = subprocess.run(["bash", str(co / "scripts" / "setup_env.sh"), str(venv)], capture_output=True, text=True,
                       env=env, timeout=25)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "ready in" in out, out
    installs = [c.split() for c in calls.read_text().splitlines() if c.startswith("pip install")]
    offline = [c for c in installs if "--offline" in c]
    online = [c for c in installs if "--offline" not in c]
    assert len(offline) == 2 and any("-r" in c and str(co / "requirements" / "nodeps.txt") in c for c in offline)
    if cached:
        assert online == [] and "resolving against the package index" not in out, out
        assert out.count("+ a-package==1.0") == 2, out  # uv's own report is shown, not swallowed
    else:
        assert [[a for a in c if a != "--offline"] for c in offline] == online, (offline, online)
        assert out.count("not everything is in uv's cache yet (uv offline: error: not in the cache): resolving "
                         "against the package index") == 2, out


def test_readme_names_every_patch_of_the_series():
    """README's ranges of call-site patches ("0002-000N") end at the series' last patch, and make help's maintainer
    targets are all named in README (they drift when a patch or a target is added)."""
    import re

    series = [x for x in (REPO / "patches" / "series").read_text().splitlines() if x and not x.startswith("#")]
    last = series[-1][:4]
    readme = (REPO / "README.md").read_text()
    ranges = re.findall(r"0002-(\d{4})", readme)
    assert ranges and all(r == last for r in ranges), (ranges, last)
    makefile = (REPO / "Makefile").read_text()
    maint = re.findall(r"^([a-zA-Z0-9_-]+):.*##m ", makefile, flags=re.M)
    assert maint, "no maintainer targets found in the Makefile"
    para = next(p for p in readme.split("\n\n") if p.startswith("Maintainer targets"))
    missing = [t for t in maint if f"`{t}" not in para]
    assert not missing, f"maintainer targets not named in README's 'Maintainer targets' paragraph: {missing}"
