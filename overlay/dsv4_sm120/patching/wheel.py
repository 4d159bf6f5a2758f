"""The pristine pinned wheel: fetch it, extract the targets, make and check the lock against it."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Dict, List, Optional

from dsv4_sm120 import SGLANG_VERSION
from dsv4_sm120.paths import cache_dir

from .common import PINNED_WHEELS, PatchError, sha256_bytes, sha256_file, wheels_file
from .ops import apply, revert
from .series import Series, apply_series_to_contents, load_lock, read_text
from .tree import _say


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
