"""Apply, revert, check and inspect the patch series on a pinned SGLang tree.

Usage: ``python -m dsv4_sm120.patching {apply,revert,status,check,lock} --help``

One module of ~1000 lines on purpose: it must run with the standard library alone from a bare checkout
(``make apply-patches`` before any environment has the package), and its parts (series parsing, the strict
applier, the all-or-nothing apply / revert state machine with its manifest, the pinned-wheel fetch) share one
set of hashing and file helpers; split, it would need a package importable before installation.

Model
-----
* ``patches/series`` lists ``*.patch`` files in order.  Each patch is a unified
  diff whose paths are relative to the ``sglang`` package directory
  (``--- a/srt/...`` / ``+++ b/srt/...``); text before the first ``---`` line is
  the patch's header (what and why).
* ``SGLANG_ROOT`` is the ``sglang`` package directory (the one holding
  ``__init__.py`` and ``srt/``).  A directory that *contains* ``sglang/`` is
  accepted too.
* ``patches/targets.lock`` records, for the pinned SGLang release, the sha256
  of every target file before (``pristine``; ``null`` for files the series
  creates) and after (``patched``) the whole series, and the series hash it was
  made with.
* Applying is all-or-nothing: the target files are copied to a scratch
  directory, every patch is applied there (a strict applier: context must match
  exactly), the results are checked against the lock, and only then are the
  originals backed up and the targets replaced one by one with atomic renames.
  The record lives in ``SGLANG_ROOT/.dsv4_sm120/manifest.json`` with the backups
  beside it; a crash half-way leaves ``state: applying`` and the next ``apply``
  or ``revert`` rolls it back from the backups first.

Exit codes: 0 success (or nothing to do), 1 refused/failed with nothing changed,
2 bad usage or environment.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from dsv4_sm120 import SGLANG_VERSION, __version__, settings
from dsv4_sm120.fileio import atomic_write_bytes

STATE_DIR = ".dsv4_sm120"
MANIFEST = "manifest.json"
BACKUP_DIR = "backup"

class PatchError(Exception):
    """A refusal or failure with a one-line message for the user."""

    def __init__(self, msg: str, code: int = 1):
        super().__init__(msg)
        self.code = code


def repo_root() -> Path:
    """The product checkout this module belongs to.

    Run from the checkout (PYTHONPATH=overlay) that is overlay/dsv4_sm120/../..; the copy `make apply-patches`
    installs into an environment records its checkout in ``_build.REPO_ROOT``.  DSV4_SM120_REPO_ROOT overrides both.
    """
    env = settings.get("DSV4_SM120_REPO_ROOT")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve().parents[2]
    if (here / "patches" / "series").is_file():
        return here
    try:
        from dsv4_sm120 import _build  # only in an installed copy
    except ImportError:
        return here
    recorded = Path(getattr(_build, "REPO_ROOT", "") or here)
    return recorded if (recorded / "patches" / "series").is_file() else here


def wheels_file() -> Path:
    return repo_root() / "requirements" / "sglang-wheels.txt"


def load_pinned_wheels(path: Optional[Path] = None) -> Dict[str, str]:
    """{wheel file name: sha256} of the pinned SGLang wheels (requirements/sglang-wheels.txt); {} if absent."""
    path = path or wheels_file()
    out: Dict[str, str] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for raw in text.splitlines():
        parts = raw.split("#", 1)[0].split()
        if len(parts) == 2 and parts[0].endswith(".whl") and re.fullmatch(r"[0-9a-f]{64}", parts[1]):
            out[parts[0]] = parts[1]
    return out


# sha256 of the pinned wheel(s) on PyPI; `check` and `setup` refuse anything else.
PINNED_WHEELS = load_pinned_wheels()


def default_series_path() -> Path:
    return repo_root() / "patches" / "series"


def cache_dir() -> Path:
    return Path(settings.get("DSV4_SM120_CACHE"))


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> Optional[str]:
    try:
        return sha256_bytes(path.read_bytes())
    except FileNotFoundError:
        return None


# --------------------------------------------------------------------------
# Unified diff parsing and a strict applier (no fuzz; offsets allowed)
# --------------------------------------------------------------------------


@dataclass
class Hunk:
    old_start: int
    old_lines: List[str]
    new_lines: List[str]


@dataclass
class FilePatch:
    path: str  # relative to SGLANG_ROOT
    is_new: bool
    is_delete: bool
    hunks: List[Hunk] = field(default_factory=list)


@dataclass
class Patch:
    name: str
    text: str
    header: str
    files: List[FilePatch]


_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _strip_prefix(p: str) -> str:
    p = p.split("\t")[0].strip()
    if p == "/dev/null":
        return p
    if p.startswith("a/") or p.startswith("b/"):
        return p[2:]
    raise PatchError(f"path {p!r} does not start with a/ or b/")


def split_lines(s: str) -> List[str]:
    """Split on '\n' only (str.splitlines also splits on form feeds and friends), keeping ends."""
    parts = s.split("\n")
    out = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        out.append(parts[-1])
    return out


def read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8")


def parse_patch(name: str, text: str) -> Patch:
    lines = split_lines(text)
    i = 0
    header: List[str] = []
    while i < len(lines) and not (lines[i].startswith("--- ") and i + 1 < len(lines)
                                  and lines[i + 1].startswith("+++ ")):
        header.append(lines[i])
        i += 1
    files: List[FilePatch] = []
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old = _strip_prefix(line[4:])
            new = _strip_prefix(lines[i + 1][4:])
            path = new if new != "/dev/null" else old
            fp = FilePatch(path=path, is_new=old == "/dev/null", is_delete=new == "/dev/null")
            files.append(fp)
            i += 2
            continue
        m = _HUNK_RE.match(line)
        if m:
            if not files:
                raise PatchError(f"{name}: hunk before any file header")
            n_old = int(m.group(2)) if m.group(2) is not None else 1
            n_new = int(m.group(4)) if m.group(4) is not None else 1
            old_l: List[str] = []
            new_l: List[str] = []
            i += 1
            last = ""
            while i < len(lines):
                l = lines[i]
                if l.startswith("\\"):  # "\ No newline at end of file": previous line has no newline
                    for tag_, seq in ((" ", old_l), (" ", new_l), ("-", old_l), ("+", new_l)):
                        if last == tag_ and seq and seq[-1].endswith("\n"):
                            seq[-1] = seq[-1][:-1]
                    i += 1
                    continue
                if len(old_l) >= n_old and len(new_l) >= n_new:
                    break
                tag, body = l[:1], l[1:]
                if l == "\n":  # an empty context line whose leading space was stripped
                    tag, body = " ", "\n"
                if tag == " ":
                    old_l.append(body)
                    new_l.append(body)
                elif tag == "-":
                    old_l.append(body)
                elif tag == "+":
                    new_l.append(body)
                else:
                    raise PatchError(f"{name}: malformed hunk line {i + 1}: {l[:60]!r}")
                last = tag
                i += 1
            if len(old_l) != n_old or len(new_l) != n_new:
                raise PatchError(f"{name}: truncated hunk in {files[-1].path}")
            files[-1].hunks.append(Hunk(int(m.group(1)), old_l, new_l))
            continue
        i += 1
    if not files:
        raise PatchError(f"{name}: no file diffs found")
    return Patch(name=name, text=text, header="".join(header), files=files)


def apply_hunks(content: Optional[str], fp: FilePatch, patch_name: str) -> Optional[str]:
    """Apply one file's hunks strictly. Returns new content (None = deleted)."""
    if fp.is_new:
        if content is not None:
            raise PatchError(f"{patch_name}: {fp.path} should not exist yet but does")
        return "".join(h for hk in fp.hunks for h in hk.new_lines)
    if content is None:
        raise PatchError(f"{patch_name}: {fp.path} does not exist")
    src = split_lines(content)
    out: List[str] = []
    pos = 0  # index in src of next unconsumed line
    for hk in fp.hunks:
        want = hk.old_start - 1 if hk.old_lines else hk.old_start
        n = len(hk.old_lines)
        found = None
        # exact position first, then nearest offset, never before `pos`
        for delta in range(0, len(src) + 1):
            for cand in (want + delta, want - delta) if delta else (want,):
                if cand < pos or cand + n > len(src):
                    continue
                if src[cand:cand + n] == hk.old_lines:
                    found = cand
                    break
            if found is not None:
                break
        if found is None:
            raise PatchError(
                f"{patch_name}: hunk at line {hk.old_start} of {fp.path} does not match "
                "(file differs from what the patch expects)")
        out.extend(src[pos:found])
        out.extend(hk.new_lines)
        pos = found + n
    out.extend(src[pos:])
    if fp.is_delete:
        return None
    return "".join(out)


# --------------------------------------------------------------------------
# Series
# --------------------------------------------------------------------------


@dataclass
class Series:
    path: Path
    patches: List[Patch]

    @property
    def hash(self) -> str:
        h = hashlib.sha256()
        for p in self.patches:
            h.update(p.name.encode() + b"\0" + p.text.encode() + b"\0")
        return h.hexdigest()

    @property
    def targets(self) -> List[str]:
        seen: List[str] = []
        for p in self.patches:
            for f in p.files:
                if f.path not in seen:
                    seen.append(f.path)
        return seen

    @property
    def created(self) -> List[str]:
        """Targets that do not exist in the pristine tree (first touch creates them)."""
        first: Dict[str, bool] = {}
        for p in self.patches:
            for f in p.files:
                first.setdefault(f.path, f.is_new)
        return [k for k, v in first.items() if v]

    def lock_path(self) -> Path:
        return self.path.parent / "targets.lock"


def load_series(path: Optional[Path] = None) -> Series:
    path = Path(path) if path else default_series_path()
    if not path.is_file():
        raise PatchError(f"series file not found: {path}", 2)
    names = []
    for raw in path.read_text().splitlines():
        s = raw.split("#", 1)[0].strip()
        if s:
            names.append(s)
    if not names:
        raise PatchError(f"{path} lists no patches", 2)
    patches = []
    for n in names:
        pf = path.parent / n
        if not pf.is_file():
            raise PatchError(f"{path} names {n}, which does not exist", 2)
        patches.append(parse_patch(n, read_text(pf)))
    return Series(path=path, patches=patches)


def apply_series_to_contents(series: Series, contents: Dict[str, Optional[str]]) -> Dict[str, Optional[str]]:
    cur = dict(contents)
    for p in series.patches:
        for f in p.files:
            cur[f.path] = apply_hunks(cur.get(f.path), f, p.name)
    return cur


def load_lock(series: Series) -> Optional[dict]:
    lp = series.lock_path()
    if not lp.is_file():
        return None
    return json.loads(lp.read_text())


# --------------------------------------------------------------------------
# SGLang tree
# --------------------------------------------------------------------------


def resolve_root(arg: Optional[str], python: Optional[str]) -> Path:
    cand = arg or settings.get("SGLANG_ROOT")
    python = absolute_python(python)
    if not cand and python:
        if not os.path.lexists(python):
            raise PatchError(
                f"no environment at {python}: run `make setup` first (or pass SGLANG_ROOT=/path/to/sglang)", 2)
        check_python(python)
        code = ("import importlib.util, os; s = importlib.util.find_spec('sglang'); "
                "print(os.path.dirname(s.origin) if s and s.origin else '')")
        r = run_python(python, ["-c", code], cwd="/")
        cand = r.stdout.strip()
        if r.returncode != 0 or not cand:
            raise PatchError(
                f"SGLang is not installed in the environment of {python}; expected sglang=={SGLANG_VERSION} "
                "(run `make setup`)", 2)
    if not cand:
        raise PatchError("no SGLang tree given: pass --sglang-root DIR (or SGLANG_ROOT=...) or --python PY", 2)
    root = Path(cand).resolve()
    if (root / "sglang" / "__init__.py").is_file():
        root = root / "sglang"
    if not (root / "__init__.py").is_file() or not (root / "srt").is_dir():
        raise PatchError(f"{root} is not an SGLang package directory (no __init__.py and srt/)", 2)
    return root


def tree_version(root: Path) -> str:
    vf = root / "_version.py"
    if vf.is_file():
        m = re.search(r"^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", vf.read_text(), re.M)
        if m:
            return m.group(1)
    for di in root.parent.glob("sglang-*.dist-info"):
        meta = di / "METADATA"
        if meta.is_file():
            m = re.search(r"^Version:\s*(\S+)", meta.read_text(), re.M)
            if m:
                return m.group(1)
    return "unknown"


def check_version(root: Path) -> None:
    v = tree_version(root)
    if v != SGLANG_VERSION:
        raise PatchError(
            f"SGLang at {root} is version {v}; this patch series needs sglang=={SGLANG_VERSION} exactly "
            f"(`make setup` installs it)", 2)


def record_hashes(root: Path) -> Dict[str, str]:
    """sha256 (hex) of files as the installed wheel's RECORD lists them, keyed relative to root."""
    out: Dict[str, str] = {}
    for di in root.parent.glob("sglang-*.dist-info"):
        rec = di / "RECORD"
        if not rec.is_file():
            continue
        for row in csv.reader(io.StringIO(rec.read_text())):
            if len(row) < 2 or not row[0].startswith("sglang/") or not row[1].startswith("sha256="):
                continue
            b64 = row[1][len("sha256="):]
            digest = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
            out[row[0][len("sglang/"):]] = digest
    return out


def read_manifest(root: Path) -> Optional[dict]:
    mf = Path(root) / STATE_DIR / MANIFEST
    if not mf.is_file():
        return None
    return json.loads(mf.read_text())


def installed_sglang_root() -> Optional[Path]:
    """The directory of the ``sglang`` package this interpreter imports, or None when there is none."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).resolve().parent


def applied_repo_root(sglang_root: Optional[Path] = None) -> Optional[Path]:
    """The checkout the patches were applied from, as recorded in the apply manifest of ``sglang_root``
    (default: the installed SGLang); None when there is no SGLang, no manifest, or it names no checkout."""
    if sglang_root is None:
        sglang_root = installed_sglang_root()
    if sglang_root is None:
        return None
    try:
        repo = (read_manifest(sglang_root) or {}).get("repo_root")
    except (OSError, ValueError, AttributeError):
        return None
    return Path(repo) if repo and isinstance(repo, str) else None


def _write_manifest(root: Path, manifest: dict) -> None:
    atomic_write_bytes(root / STATE_DIR / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())


def _say(msg: str) -> None:
    print(f"[dsv4_sm120.patching] {msg}", flush=True)


def absolute_python(python: Optional[str]) -> Optional[str]:
    """`python` made absolute against the caller's cwd (subprocesses here run elsewhere); symlinks kept, since a
    venv's bin/python is a symlink whose own location selects the environment."""
    return os.path.abspath(os.path.expanduser(python)) if python else python


def check_python(python: str) -> None:
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        raise PatchError(f"no Python interpreter at {python}: run `make setup` first "
                         "(or pass --python PATH of an environment's python)", 2)


def run_python(python: str, args: List[str], **kw) -> subprocess.CompletedProcess:
    """subprocess.run([python, *args]) with a one-line error instead of a traceback when python is missing."""
    try:
        return subprocess.run([python, *args], capture_output=True, text=True, **kw)
    except OSError as e:
        raise PatchError(f"cannot run {python}: {e.strerror}; run `make setup` first "
                         "(or pass --python PATH of an environment's python)", 2) from None


# --------------------------------------------------------------------------
# Operations
# --------------------------------------------------------------------------


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
    env = dict(os.environ)
    # Launchers (the Makefile, serve/) put the checkout's overlay on PYTHONPATH to run our own modules and keep
    # the caller's value in DSV4_SM120_ORIG_PYTHONPATH: ask what the environment imports without that addition.
    orig = settings.raw("DSV4_SM120_ORIG_PYTHONPATH")
    if orig is not None:
        if orig:
            env["PYTHONPATH"] = orig
        else:
            env.pop("PYTHONPATH", None)
    r = run_python(python, ["-c", code], cwd="/", env=env)
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


# --------------------------------------------------------------------------
# Pristine wheel (for check / lock)
# --------------------------------------------------------------------------


def pinned_wheel(download: bool = True, py: str = "311") -> Path:
    """The pinned wheel for CPython `py` (e.g. '311'), from the cache or PyPI, sha256-verified."""
    wdir = cache_dir() / "wheels"
    if not PINNED_WHEELS:
        raise PatchError(f"{wheels_file()} is missing or lists no wheels: cannot verify the pinned SGLang wheel", 2)
    names = [n for n in PINNED_WHEELS if f"-cp{py}-" in n]
    if not names:
        raise PatchError(f"no pinned sglang=={SGLANG_VERSION} wheel for CPython {py} "
                         f"(have: {', '.join(sorted(PINNED_WHEELS))}); use Python 3.11, 3.12 or 3.13", 2)
    for name in names:
        p = wdir / name
        if p.is_file() and sha256_file(p) == PINNED_WHEELS[name]:
            return p
    if not download:
        raise PatchError("pinned SGLang wheel not in cache", 2)
    wdir.mkdir(parents=True, exist_ok=True)
    # progress on stderr: `fetch-wheel` prints only the path on stdout (scripts capture it)
    print(f"[dsv4_sm120.patching] downloading sglang=={SGLANG_VERSION} wheel (cp{py}) into {wdir}",
          file=sys.stderr, flush=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", py[0] + "." + py[1:], "--platform", "manylinux_2_34_x86_64",
                        f"sglang=={SGLANG_VERSION}", "-d", str(wdir)], capture_output=True, text=True)
    for name in names:
        sha = PINNED_WHEELS[name]
        p = wdir / name
        if p.is_file():
            got = sha256_file(p)
            if got != sha:
                p.unlink()
                raise PatchError(f"downloaded {name} has sha256 {got}, expected {sha}; refusing")
            return p
    raise PatchError("could not download the pinned SGLang wheel:\n" + r.stderr[-1500:], 2)


def extract_pristine(dest: Path, paths: List[str]) -> Path:
    """Extract `paths` (relative to the package) + version files of the pinned wheel into dest/sglang."""
    whl = pinned_wheel()
    root = dest / "sglang"
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        want = set(paths) | {"__init__.py", "_version.py", "version.py"}
        for p in want:
            zn = "sglang/" + p
            if zn in names:
                out = root / p
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(z.read(zn))
        (root / "srt").mkdir(parents=True, exist_ok=True)
        for zn in names:
            if zn.startswith(f"sglang-{SGLANG_VERSION}.dist-info/") and not zn.endswith("/"):
                out = dest / zn
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(z.read(zn))
    return root


def pristine_contents(series: Series) -> Dict[str, Optional[str]]:
    with tempfile.TemporaryDirectory() as td:
        root = extract_pristine(Path(td), series.targets)
        created = set(series.created)
        out: Dict[str, Optional[str]] = {}
        for p in series.targets:
            f = root / p
            if p in created:
                if f.exists():
                    raise PatchError(f"{p} is created by the series but exists in the pristine wheel")
                out[p] = None
            else:
                if not f.is_file():
                    raise PatchError(f"{p} is not in the pinned wheel")
                out[p] = read_text(f)
        return out


def make_lock(series: Series) -> dict:
    pristine = pristine_contents(series)
    new = apply_series_to_contents(series, pristine)
    return {
        "sglang_version": SGLANG_VERSION,
        "series_hash": series.hash,
        "patches": [p.name for p in series.patches],
        "files": {
            p: {"pristine": sha256_bytes(pristine[p].encode()) if pristine[p] is not None else None,
                "patched": sha256_bytes(new[p].encode()) if new[p] is not None else None}
            for p in series.targets
        },
    }


def check(series: Series, say=_say) -> None:
    """Verify the series against a pristine scratch copy of the pinned wheel; touches no environment."""
    problems = []
    for p in series.patches:
        if not p.header.strip():
            problems.append(f"{p.name}: no header saying what and why")
    lock = load_lock(series)
    want = make_lock(series)  # raises if any patch fails on the pristine files
    if lock is None:
        problems.append("patches/targets.lock is missing (run `python -m dsv4_sm120.patching lock`)")
    elif lock != want:
        problems.append("patches/targets.lock is stale for this series (run `python -m dsv4_sm120.patching lock`)")
    with tempfile.TemporaryDirectory() as td:
        root = extract_pristine(Path(td), series.targets)
        before = {p: sha256_file(root / p) for p in series.targets}
        quiet = lambda *_: None  # noqa: E731
        apply(root, series, install=False, say=quiet)
        after1 = {p: sha256_file(root / p) for p in series.targets}
        if apply(root, series, install=False, say=quiet) != "already":
            problems.append("second apply was not a no-op")
        revert(root, series, say=quiet)
        if {p: sha256_file(root / p) for p in series.targets} != before:
            problems.append("revert is not byte-identical to pristine")
        apply(root, series, install=False, say=quiet)
        if {p: sha256_file(root / p) for p in series.targets} != after1:
            problems.append("apply -> revert -> apply differs from a single apply")
    if problems:
        raise PatchError("check failed:\n  " + "\n  ".join(problems))
    say(f"series OK: {len(series.patches)} patches, {len(series.targets)} files, hash {series.hash[:12]}, "
        f"applies cleanly to pristine sglang=={SGLANG_VERSION}; round trip byte-identical; lock up to date")


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def default_status_python() -> Optional[str]:
    """The environment `status` inspects when given no tree: this interpreter if it has SGLang (as when run as
    `.venv/bin/python -m dsv4_sm120.patching status`), else the checkout's default environment ($VENV or .venv,
    what `make setup` creates)."""
    import importlib.util
    if importlib.util.find_spec("sglang") is not None:
        return sys.executable
    venv = Path(settings.get("VENV") or ".venv")
    venv = venv if venv.is_absolute() else repo_root() / venv
    py = venv / "bin" / "python"
    return str(py) if os.path.lexists(py) else None


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_sm120.patching", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p, root=True):
        p.add_argument("--series", type=Path, default=None, help="series file (default: patches/series)")
        if root:
            p.add_argument("--sglang-root", help="the sglang package dir (or env SGLANG_ROOT)")
            p.add_argument("--python", help="python of the environment to patch (finds sglang, installs overlay)")

    p = sub.add_parser("apply", help="apply the series (all or nothing) and install the overlay")
    common(p)
    p.add_argument("--no-install", action="store_true", help="do not pip-install dsv4_sm120 into the env")
    p = sub.add_parser("revert", help="restore every touched file byte-for-byte")
    common(p)
    p = sub.add_parser("status", help="is this tree patched, and with which series? (without --sglang-root/--python: "
                                      "this interpreter's SGLang, else the checkout's .venv or $VENV)")
    common(p)
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("check", help="verify the series against a pristine copy of the pinned wheel")
    common(p, root=False)
    p = sub.add_parser("lock", help="rewrite patches/targets.lock from the pinned wheel")
    common(p, root=False)
    p = sub.add_parser("fetch-wheel", help="download (cached) and sha256-verify the pinned wheel; print its path")
    p.add_argument("--py", default="%d%d" % sys.version_info[:2], help="CPython version, e.g. 311 (default: this one)")
    a = ap.parse_args(argv)
    try:
        if getattr(a, "python", None):
            a.python = absolute_python(a.python)
            check_python(a.python)
        if a.cmd == "status" and not (a.sglang_root or settings.get("SGLANG_ROOT") or a.python):
            a.python = default_status_python()
            if a.python is None:
                raise PatchError(f"no SGLang here and no environment at {repo_root() / '.venv'}: run `make setup` "
                                 "(or pass --python PY / --sglang-root DIR)", 2)
        if a.cmd == "fetch-wheel":
            print(pinned_wheel(py=a.py))
            return 0
        if a.cmd in ("check", "lock"):
            series = load_series(a.series)
            if a.cmd == "check":
                check(series)
            else:
                lock = make_lock(series)
                atomic_write_bytes(series.lock_path(), (json.dumps(lock, indent=2, sort_keys=True) + "\n").encode())
                _say(f"wrote {series.lock_path()} ({len(lock['files'])} files, series {series.hash[:12]})")
            return 0
        root = resolve_root(a.sglang_root, a.python)
        if a.cmd == "status":
            try:
                series = load_series(a.series)
            except PatchError:
                series = None
            st = status(root, series, python=a.python)
            if a.json:
                print(json.dumps(st, indent=2))
            else:
                if st["patched"]:
                    if series is None:
                        versus = f"this checkout's series cannot be read: {a.series or default_series_path()}"
                    else:
                        versus = ("matches" if st["matches_repo"] else "DIFFERS from") + " this repo's series"
                    _say(f"{root}: patched with series {st['series_hash'][:12]} at {st['applied_at']} ({versus})")
                    if st["overlay_current"] is False:
                        _say("the dsv4_sm120 the environment imports differs from this checkout: "
                             "run `make apply-patches`")
                elif st["state"]:
                    _say(f"{root}: state {st['state']}, modified files: {st['modified_files']}")
                else:
                    _say(f"{root}: not patched")
            return 0 if st["patched"] or not st["state"] else 1
        series = load_series(a.series)
        if a.cmd == "apply":
            apply_safely(root, series, python=a.python, install=not a.no_install)
        else:
            revert(root, series, python=a.python)
        return 0
    except PatchError as e:
        print(f"[dsv4_sm120.patching] error: {e}", file=sys.stderr)
        return e.code


if __name__ == "__main__":
    sys.exit(main())
