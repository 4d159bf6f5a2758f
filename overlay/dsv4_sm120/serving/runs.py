"""Where `make stop`, `make measure` and `make profile` find the running deployment, whatever LOG_DIR it was
started with.

Every start records its run directory in the project's cache, one symbolic link per run under
``DSV4_SM120_CACHE/deployments/<checkout>/`` (``<checkout>``: a hash of the checkout's path, so two checkouts
keep separate records). :func:`find` takes ``LOG_DIR/latest`` when it is running, else the one running
deployment recorded for this checkout; with several running it names them instead of choosing one.
Links to runs that no longer exist or have stopped are removed as they are found.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import List, Optional, Tuple

from .. import settings
from ..paths import checkout_root
from . import supervisor as sv


def record_dir() -> Path:
    """This checkout's record of deployments in the project's cache."""
    key = hashlib.sha256(str(checkout_root()).encode()).hexdigest()[:16]
    return Path(os.path.expanduser(settings.get("DSV4_SM120_CACHE"))) / "deployments" / key


def record(run_dir: Path) -> Optional[str]:
    """Record a starting deployment's run directory; a one-line note when that is not possible (else None)."""
    run_dir = Path(run_dir).resolve()
    d = record_dir()
    link = d / hashlib.sha256(str(run_dir).encode()).hexdigest()[:16]
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    try:
        d.mkdir(parents=True, exist_ok=True)
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(run_dir, tmp)
        os.replace(tmp, link)
    except OSError as e:
        return f"could not record the deployment in {d} ({e.strerror or e}): make stop finds it only via LOG_DIR"
    return None


def is_running(run_dir: Path) -> bool:
    """True while the run's supervisor or one of its recorded parts is alive."""
    st = sv.read_state(Path(run_dir))
    if st is None:
        return False
    if st.get("supervisor_pid") and sv.is_alive(st["supervisor_pid"], st.get("supervisor_start")):
        return True
    return any(sv.is_alive(p["pid"], p.get("start")) or (p.get("pgid") and sv.group_members(p["pgid"]))
               for p in st.get("procs", []))


def running() -> List[Path]:
    """This checkout's recorded deployments that are running, newest first; records of finished runs are removed
    (a run directory without state yet is a start in progress: kept, not listed)."""
    d = record_dir()
    try:
        links = [p for p in d.iterdir() if p.is_symlink() and not p.name.startswith(".")]
    except OSError:
        return []
    out = []
    for link in links:
        try:
            target = Path(os.readlink(link))
        except OSError:
            continue
        if is_running(target):
            out.append(target)
        elif not target.is_dir() or (target / "state.json").exists():
            try:
                link.unlink()
            except OSError:
                pass

    def started(p: Path) -> float:
        try:
            return (p / "state.json").stat().st_mtime
        except OSError:
            return 0.0

    return sorted(out, key=started, reverse=True)


def find(log_dir: Path) -> Tuple[Optional[Path], str]:
    """(the run directory to act on, a note for the user). ``LOG_DIR/latest`` when it is running; else the one
    running deployment recorded for this checkout (the note says where it is); with several running, None and
    a note naming them; with none, ``LOG_DIR/latest`` (or None when it does not exist) and no note."""
    latest = Path(log_dir) / "latest"
    cur = latest.resolve() if latest.exists() else None
    if cur is not None and is_running(cur):
        return cur, ""
    others = [r for r in running() if cur is None or r != cur]
    where = f"{latest} is not running" if cur is not None else f"nothing is recorded under {latest.parent}"
    if len(others) == 1:
        return others[0], f"{where}; the deployment running from this checkout is {others[0]}"
    if others:
        return None, (f"{where}; {len(others)} deployments are running from this checkout: "
                      + ", ".join(map(str, others)))
    return cur, ""
