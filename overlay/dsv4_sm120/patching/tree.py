"""The SGLang tree the series applies to: where it is, its version, its wheel RECORD; running its Python."""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

from dsv4_sm120 import SGLANG_VERSION, settings
from dsv4_sm120.fileio import atomic_write_bytes
from dsv4_sm120.paths import MANIFEST, STATE_DIR

from .common import PatchError


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
