"""What the serve plan takes from the machine profile, per server, at plan time: the TP all-reduce environment.

The plan runs in the launcher's python (the serving environment's where it exists) and never imports torch or
SGLang (``tests/test_import_graph.py`` holds it to that): the profile is found and matched through
:mod:`dsv4_sm120.calibrate.machine_profile` (versions read from package metadata, torch's CUDA version from its
``version.py``), the all-reduce environment comes from the pure :mod:`dsv4_sm120.calibrate.allreduce_env`.

* :func:`gpu_names`: nvidia-smi's name of every GPU (one call per plan), ``{}`` without nvidia-smi;
* :func:`server_profile`: the profile matching a server's GPU model and this environment's versions, and where it
  came from (or why none applies), as the all-reduce line names it;
* :func:`allreduce`: one server's :class:`~dsv4_sm120.calibrate.allreduce_env.ServerEnv` (the variables to set,
  the ones it must not inherit from ``serve/env/*.env``, one line saying where the choice came from).
"""

from __future__ import annotations

import logging
import subprocess
from typing import Dict, Mapping, Optional, Sequence, Tuple

from ..calibrate import allreduce_env
from ..calibrate.allreduce_env import ServerEnv

_NAMES: Dict[str, Dict[int, str]] = {}


def gpu_names(smi: str) -> Dict[int, str]:
    """{index: name} from ``nvidia-smi --query-gpu=index,name`` (cached per executable; {} when it does not answer)."""
    if smi in _NAMES:
        return _NAMES[smi]
    out: Dict[int, str] = {}
    try:
        r = subprocess.run([smi, "--query-gpu=index,name", "--format=csv,noheader"], capture_output=True, text=True,
                           timeout=20)
        lines = r.stdout.splitlines() if r.returncode == 0 else []
    except (OSError, subprocess.SubprocessError):
        lines = []
    for line in lines:
        i, _, name = (x.strip() for x in line.partition(","))
        if i.isdigit() and name:
            out[int(i)] = name
    _NAMES[smi] = out
    return out


def server_profile(gpu: Optional[str]) -> Tuple[Optional[dict], str]:
    """(the machine profile that applies to GPU model ``gpu`` with this environment's versions, its path) or
    (None, why none applies). The lookup's own log lines are silenced: the preflight's profile check says why, under
    its own name."""
    if not gpu:
        return None, "no GPU name from nvidia-smi, so no machine profile applies"
    from ..calibrate import machine_profile as P

    log = logging.getLogger(P.__name__)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        prof, path, reasons = P.active_profile(gpu)
    except Exception as e:  # noqa: BLE001 - an unreadable profile leaves the defaults in charge
        return None, f"machine profile unreadable ({type(e).__name__}: {e})"
    finally:
        log.setLevel(level)
    if prof is not None:
        return prof, str(path)
    why = [r for r in reasons if not r.startswith("warning:")]
    return None, "; ".join(why) or f"no machine profile for {gpu}"


def static_ipc_blocker(gpus: Sequence[int], env: Mapping[str, str]) -> Optional[str]:
    """What already rules the PCIe-IPC path out at plan time, before any GPU is touched (the group's size,
    ``NCCL_P2P_DISABLE=1``); the start's p2p check adds peer access (``allreduce_env.ipc_blocker``)."""
    return allreduce_env.ipc_blocker(gpus, [{"event": "pair", "src": a, "dst": b, "ok": True, "can_access": True}
                                            for a in gpus for b in gpus if a != b], env)


def allreduce(role: str, gpus: Sequence[int], environ: Mapping[str, str], smi: str,
              ipc_blocked: Optional[str] = None) -> ServerEnv:
    """The all-reduce environment of the ``role`` server on ``gpus`` (nvidia-smi indices): the user's settings
    win, else the profile of its first GPU's model measured at this TP size, else the documented defaults."""
    prof, source = server_profile(gpu_names(smi).get(gpus[0]) if gpus else None)
    blocked = ipc_blocked or (static_ipc_blocker(gpus, environ) if len(gpus) > 1 else None)
    return allreduce_env.server_env(role, len(gpus), environ, prof, source, blocked)
