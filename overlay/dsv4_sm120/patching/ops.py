"""The all-or-nothing apply / revert state machine with its manifest, status, and installing the overlay."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Dict, Optional

from dsv4_sm120 import SGLANG_VERSION, __version__, settings
from dsv4_sm120.fileio import atomic_write_bytes
from dsv4_sm120.paths import BACKUP_DIR, STATE_DIR, caller_environ, read_manifest, repo_root

from .common import PatchError, sha256_bytes, sha256_file
from .series import Series, apply_series_to_contents, load_lock, read_text
from .tree import _say, _write_manifest, check_version, record_hashes, run_python, tree_version


def expected_pristine(series: Series, root: Path, path: str) -> Optional[str]:
    """Pristine sha256 for a target: the lock first, then the wheel's RECORD. None = must be absent."""
    lock = load_lock(series)
    if lock and path in lock.get("files", {}):
        return lock["files"][path]["pristine"]
    if path in series.created:
        return None
    rec = record_hashes(root)
    if path in rec:
        return rec[path]
    raise PatchError(
        f"cannot tell whether {path} is pristine: not in patches/targets.lock nor in the wheel's RECORD "
        "(run `python -m dsv4_sm120.patching lock`)", 2)


def _rollback(root: Path, manifest: dict, say=_say) -> None:
    """Restore every file recorded in the manifest from its backup; verify; drop the state dir."""
    bdir = root / STATE_DIR / BACKUP_DIR
    bad = []
    for path, info in manifest["files"].items():
        target = root / path
        if info["pristine"] is None:
            if target.exists():
                target.unlink()
            continue
        b = bdir / path
        if not b.is_file():
            bad.append(f"{path} (backup missing)")
            continue
        data = b.read_bytes()
        if sha256_bytes(data) != info["pristine"]:
            bad.append(f"{path} (backup corrupt)")
            continue
        if sha256_file(target) != info["pristine"]:
            atomic_write_bytes(target, data, mode=info.get("mode"))
    if bad:
        raise PatchError("cannot restore: " + ", ".join(bad) + f"; reinstall sglang=={SGLANG_VERSION}")
    for path, info in manifest["files"].items():
        cur = sha256_file(root / path)
        if cur != info["pristine"]:
            raise PatchError(f"restore of {path} did not verify")
    shutil.rmtree(root / STATE_DIR)


def status(root: Path, series: Optional[Series], python: Optional[str] = None) -> dict:
    m = read_manifest(root)
    out = {
        "sglang_root": str(root),
        "sglang_version": tree_version(root),
        "patched": False,
        "state": None,
        "series_hash": None,
        "repo_series_hash": series.hash if series else None,
        "matches_repo": False,
        "applied_at": None,
        "overlay_version": None,
        "patches": [],
        "modified_files": [],
    }
    if m:
        out.update(state=m.get("state"), series_hash=m.get("series_hash"), applied_at=m.get("applied_at"),
                   overlay_version=m.get("overlay_version"), patches=m.get("patches", []))
        modified = [p for p, i in m["files"].items() if sha256_file(root / p) != i["patched"]]
        out["modified_files"] = modified
        out["patched"] = m.get("state") == "applied" and not modified
        out["matches_repo"] = bool(series) and out["patched"] and m.get("series_hash") == series.hash
    # Is the overlay that `python` imports this checkout's (None: not asked)?
    out["overlay_current"] = installed_overlay(python)["current"] if python else None
    return out


def apply(root: Path, series: Series, python: Optional[str] = None, install: bool = True,
          say=_say) -> str:
    """Apply the series. Returns 'applied' or 'already'. Raises PatchError on refusal."""
    check_version(root)
    m = read_manifest(root)
    if m is not None:
        if m.get("state") == "applied" and m.get("series_hash") == series.hash:
            modified = [p for p, i in m["files"].items() if sha256_file(root / p) != i["patched"]]
            if modified:
                raise PatchError(
                    f"{modified[0]} was modified after patching (neither pristine nor patched by this series); "
                    "refusing to touch it: reinstall sglang or restore the file")
            say(f"already applied (series {series.hash[:12]}, {len(series.patches)} patches): nothing to do")
            if install and python:
                _install_overlay(python, say, only_if_missing=True)
            return "already"
        # Another series, or a half-finished apply: roll back to pristine first.
        modified = [p for p, i in m["files"].items()
                    if sha256_file(root / p) not in (i["patched"], i["pristine"])
                    and not (m.get("state") == "applying")]
        if modified:
            raise PatchError(f"{modified[0]} was modified locally (neither pristine nor patched); refusing")
        why = "an interrupted apply" if m.get("state") != "applied" else \
            f"a different series ({str(m.get('series_hash'))[:12]})"
        say(f"tree carries {why}: restoring pristine files first")
        _rollback(root, m, say)

    targets = series.targets
    pristine: Dict[str, Optional[str]] = {}
    contents: Dict[str, Optional[str]] = {}
    modes: Dict[str, Optional[int]] = {}
    for path in targets:
        exp = expected_pristine(series, root, path)
        cur_file = root / path
        cur = sha256_file(cur_file)
        if cur != exp:
            if exp is None:
                raise PatchError(f"{path} should not exist in a pristine sglang=={SGLANG_VERSION} but does; "
                                 "refusing (nothing changed)")
            if cur is None:
                raise PatchError(f"{path} is missing from the SGLang tree; refusing (nothing changed)")
            raise PatchError(f"{path} is modified locally (neither pristine nor patched by this series); "
                             "refusing (nothing changed)")
        pristine[path] = exp
        contents[path] = read_text(cur_file) if cur is not None else None
        modes[path] = (cur_file.stat().st_mode & 0o777) if cur is not None else None

    # Stage: apply everything in memory first (the dry run): all or nothing.
    new = apply_series_to_contents(series, contents)
    lock = load_lock(series)
    if lock and lock.get("series_hash") == series.hash:
        for path in targets:
            want = lock["files"][path]["patched"]
            got = sha256_bytes(new[path].encode()) if new[path] is not None else None
            if got != want:
                raise PatchError(f"staged result for {path} differs from patches/targets.lock; refusing")

    # Commit: backups + manifest(state=applying) first, then atomic replaces.
    sdir = root / STATE_DIR
    if sdir.exists():
        shutil.rmtree(sdir)
    for path in targets:
        if contents[path] is not None:
            atomic_write_bytes(sdir / BACKUP_DIR / path, (root / path).read_bytes())
    manifest = {
        "state": "applying",
        "series_hash": series.hash,
        "patches": [p.name for p in series.patches],
        "sglang_version": SGLANG_VERSION,
        "overlay_version": __version__,
        "repo_root": str(repo_root()),
        "applied_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": {
            p: {"pristine": pristine[p],
                "patched": sha256_bytes(new[p].encode()) if new[p] is not None else None,
                "mode": modes[p]}
            for p in targets
        },
    }
    _write_manifest(root, manifest)
    fail_after = settings.get("DSV4_SM120_TEST_PATCHING_FAIL_AFTER")  # test hook: simulate a crash
    for n, path in enumerate(targets):
        if n == fail_after:
            raise PatchError(f"simulated failure after {n} files (DSV4_SM120_TEST_PATCHING_FAIL_AFTER)")
        if new[path] is None:
            (root / path).unlink()
        else:
            atomic_write_bytes(root / path, new[path].encode(), mode=modes[path] or 0o644)
    manifest["state"] = "applied"
    _write_manifest(root, manifest)
    say(f"applied {len(series.patches)} patches (series {series.hash[:12]}) to {root}: "
        + ", ".join(p.name for p in series.patches))
    if install and python:
        _install_overlay(python, say)
    return "applied"


def apply_safely(root: Path, series: Series, **kw) -> str:
    """apply(), rolling back whatever it did if it fails after starting to write."""
    try:
        return apply(root, series, **kw)
    except PatchError as e:
        m = read_manifest(root)
        if m is not None and m.get("state") == "applying":
            _rollback(root, m)
            raise PatchError(f"{e}; rolled back, tree is pristine again", e.code) from None
        raise


def revert(root: Path, series: Optional[Series], python: Optional[str] = None, say=_say) -> str:
    m = read_manifest(root)
    if m is None:
        if series is not None:
            dirty = []
            for path in series.targets:
                try:
                    exp = expected_pristine(series, root, path)
                except PatchError:
                    continue
                if sha256_file(root / path) != exp:
                    dirty.append(path)
            if dirty:
                raise PatchError(f"no record of our patches in {root}, yet {dirty[0]} is not pristine; "
                                 f"reinstall sglang=={SGLANG_VERSION}")
        say(f"{root} is not patched (pristine): nothing to revert")
        return "pristine"
    modified = [p for p, i in m["files"].items()
                if sha256_file(root / p) not in (i["patched"], i["pristine"])]
    if modified and m.get("state") == "applied":
        raise PatchError(f"{modified[0]} was modified after patching; refusing to overwrite local changes")
    _rollback(root, m, say)
    say(f"reverted {len(m['files'])} files to pristine sglang=={SGLANG_VERSION} (byte-identical, verified)")
    if python:
        r = run_python(python, ["-m", "pip", "uninstall", "-y", "-q", "dsv4_sm120"])
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1]
            say(f"could not uninstall dsv4_sm120 from {python}: {last}")
        elif "not installed" in r.stdout + r.stderr:
            say(f"dsv4_sm120 was not installed in {python}: nothing to uninstall")
        else:
            say(f"uninstalled dsv4_sm120 from {python} (`make apply-patches` installs it again)")
    return "reverted"


def overlay_tree_hash() -> str:
    """sha256 over this checkout's overlay sources (what `apply` installs)."""
    pkg = repo_root() / "overlay" / "dsv4_sm120"
    h = hashlib.sha256()
    for f in sorted(pkg.rglob("*.py")):
        rel = f.relative_to(pkg).as_posix()
        if "__pycache__" in rel or rel == "_build.py":
            continue
        h.update(rel.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def installed_overlay(python: str) -> dict:
    """What `python` imports as dsv4_sm120: {'importable', 'file', 'hash', 'current'}."""
    code = ("import json, dsv4_sm120\n"
            "try:\n    from dsv4_sm120 import _build; h = _build.OVERLAY_HASH\n"
            "except ImportError:\n    h = None\n"
            "print(json.dumps({'file': dsv4_sm120.__file__, 'hash': h}))")
    # what the environment imports without the launcher's PYTHONPATH addition
    r = run_python(python, ["-c", code], cwd="/", env=caller_environ())
    if r.returncode != 0:
        return {"importable": False, "file": None, "hash": None, "current": False}
    info = json.loads(r.stdout.strip().splitlines()[-1])
    checkout = (repo_root() / "overlay").resolve()
    from_checkout = Path(info["file"]).resolve().is_relative_to(checkout)
    info.update(importable=True, current=from_checkout or info["hash"] == overlay_tree_hash())
    return info


def _install_overlay(python: str, say=_say, only_if_missing: bool = False) -> None:
    overlay = repo_root() / "overlay"
    if only_if_missing:
        if installed_overlay(python)["current"]:
            return
        say("the dsv4_sm120 installed in the environment differs from this checkout: reinstalling")
    say(f"installing dsv4_sm120 {__version__} into {python}")
    base = ["-m", "pip", "install", "-q", "--no-deps", "--no-cache-dir", "--disable-pip-version-check"]
    # Without build isolation first (works offline where setuptools is in the env, as in the pinned env);
    # with it otherwise (pip fetches setuptools).
    with tempfile.TemporaryDirectory() as td:  # build from a copy: never leave build/ or egg-info in the repo
        src = Path(td) / "overlay"
        shutil.copytree(overlay, src, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
        (src / "dsv4_sm120" / "_build.py").write_text(
            f'"""Written by `make apply-patches`: the checkout this copy was installed from."""\n'
            f"OVERLAY_HASH = {overlay_tree_hash()!r}\nREPO_ROOT = {str(repo_root())!r}\n")
        r = run_python(python, base + ["--no-build-isolation", str(src)])
        if r.returncode != 0:
            r = run_python(python, base + [str(src)])
    if r.returncode != 0:
        raise PatchError("installing the overlay failed:\n" + r.stderr[-2000:])
    r = run_python(python, ["-c", "import dsv4_sm120; print(dsv4_sm120.__version__)"], cwd="/")
    if r.returncode != 0 or r.stdout.strip() != __version__ or not installed_overlay(python)["current"]:
        raise PatchError(f"dsv4_sm120 {__version__} is not importable from {python} after installing it")
