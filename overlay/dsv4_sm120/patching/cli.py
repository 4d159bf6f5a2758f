"""Apply, revert, check and inspect the patch series on a pinned SGLang tree.

The command line: ``python -m dsv4_sm120.patching {apply,revert,status,check,lock,fetch-wheel}`` (its
description is this docstring's first paragraph).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import List, Optional

from dsv4_sm120 import settings
from dsv4_sm120.fileio import atomic_write_bytes
from dsv4_sm120.paths import repo_root

from .common import PatchError, default_series_path
from .ops import apply_safely, revert, status
from .series import load_series
from .tree import _say, absolute_python, check_python, resolve_root
from .wheel import check, make_lock, pinned_wheel


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
