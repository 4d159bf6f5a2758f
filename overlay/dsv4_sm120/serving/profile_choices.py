"""What the serve plan takes from the machine profile at plan time: each server's TP all-reduce environment, the
recorded serving shape and draft length.

The plan runs in the launcher's python (the serving environment's where it exists) and never imports torch or
SGLang (``tests/test_import_graph.py`` holds it to that): the profile is found and matched through
:mod:`dsv4_sm120.machine_profile` (versions read from package metadata, torch's CUDA version from its
``version.py``), the all-reduce environment comes from the pure :mod:`dsv4_sm120.serving.allreduce_env`.

* :func:`gpu_names`: nvidia-smi's name of every GPU (one call per plan), ``{}`` without nvidia-smi;
* :func:`server_profile`: the profile matching a server's GPU model and this environment's versions, and where it
  came from (or why none applies), as the all-reduce line names it;
* :func:`allreduce`: one server's :class:`~dsv4_sm120.serving.allreduce_env.ServerEnv` (the variables to set,
  the ones it must not inherit from ``serve/env/*.env``, one line saying where the choice came from);
* :func:`recorded_shape`: the layout (``PREFILL_GPUS`` / ``DECODE_GPUS``) and draft length ``make verify
  ARGS='--stages shape'`` recorded as the winner at the deployment's concurrency, where you set none.
"""

from __future__ import annotations

import logging
import subprocess
from typing import Dict, Mapping, Optional, Sequence, Tuple

from . import allreduce_env
from .allreduce_env import ServerEnv

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
    from .. import machine_profile as P

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


LAYOUT = ("PREFILL_GPUS", "DECODE_GPUS")
DRAFT = ("SPEC_NUM_STEPS", "SPEC_NUM_DRAFT_TOKENS", "SPEC_DSPARK_BLOCK_SIZE")


def draft_algorithm(s: Mapping[str, str], environ: Mapping[str, str]) -> Optional[str]:
    """DSPARK / EAGLE as the MTP plan will serve it (SPEC_ALGORITHM, else the checkpoint's draft); None: unknown."""
    from .speculative import ALGORITHMS, SpecError, detect_draft

    want = ALGORITHMS.get((s.get("SPEC_ALGORITHM") or "auto").strip().lower())
    if want and want != "auto":
        return want
    try:
        return detect_draft(s.get("MODEL_PATH", ""), environ).kind
    except SpecError:
        return None


def recorded_shape(variant: str, environ: Mapping[str, str], s: Mapping[str, str], standin: bool, smi: str,
                   concurrency: int, conc_var: str) -> Tuple[Dict[str, str], str]:
    """({serve variable: value} to use, the line saying which shape and why): the ``shape`` decision's winner for
    ``variant`` at ``concurrency`` (``machine_profile.shape_decision.pick``) from the machine profile of the decode GPU's
    model, where you set neither ``PREFILL_GPUS`` nor ``DECODE_GPUS`` (the layout) nor a draft length (MTP).
    A record of a stand-in rehearsal applies only to stand-in servers."""
    from ..machine_profile.shape_decision import pick, shape_text, spec_text

    mine = [k for k in LAYOUT if (environ.get(k) or "").strip()]
    mine_draft = [k for k in DRAFT if (environ.get(k) or "").strip()] if variant == "mtp" else []
    yours = f"yours ({' / '.join(mine + mine_draft)} set)"
    if mine and (variant != "mtp" or mine_draft):
        return {}, yours
    names = gpu_names(smi)
    first = gpu_groups_first(s.get("DECODE_GPUS", ""))
    prof, source = server_profile(names.get(first) if first is not None else None)
    default = f"{s.get('PREFILL_GPUS')} / {s.get('DECODE_GPUS')}"
    if prof is None:
        return {}, (yours if mine else f"the default layout {default} ({source}; make verify ARGS='--stages "
                                                  f"shape' measures the shapes)")
    entry = (prof.get("decisions") or {}).get("shape")
    rec = ((entry or {}).get("variants") or {}).get(variant) or {}
    cand, c, why = pick(entry, variant, concurrency)
    if cand is not None and rec.get("standin") and not standin:
        cand, why = None, "the recorded shape comes from a stand-in rehearsal, not a measurement"
    if cand is None:
        return {}, yours if mine else f"the default layout {default} ({why} in {source})"
    apply: Dict[str, str] = {}
    used = []
    if not mine:
        apply.update(PREFILL_GPUS=cand["prefill_gpus"], DECODE_GPUS=cand["decode_gpus"])
        used.append(f"PREFILL_GPUS={cand['prefill_gpus']} DECODE_GPUS={cand['decode_gpus']} "
                    f"({shape_text(cand['prefill_gpus'], cand['decode_gpus'])})")
    spec = cand.get("spec")
    if variant == "mtp" and not mine_draft and spec:
        algo = draft_algorithm(s, environ)
        if algo == spec["algorithm"]:
            key = "SPEC_DSPARK_BLOCK_SIZE" if algo == "DSPARK" else "SPEC_NUM_STEPS"
            apply[key] = str(spec["block_size" if algo == "DSPARK" else "steps"])
            used.append(f"{key}={apply[key]} ({spec_text(spec)})")
        else:
            used.append(f"not its draft length ({spec_text(spec)}: this plan serves {algo or 'an unknown draft'})")
    tok = (cand.get("per_concurrency") or {}).get(str(c), {}).get("output_tok_s")
    where = (f"the recorded winner at C={c} for {conc_var}={concurrency} ({tok:.0f} output tok/s there; profile "
             f"{source}, measured {rec.get('measured_at', '?')})" if tok else f"the recorded winner at C={c}")
    mine_text = f"; yours: {' / '.join(mine + mine_draft)}" if mine or mine_draft else ""
    return apply, f"{where}: {', '.join(used)}{mine_text} (set {' / '.join(LAYOUT)} to choose yourself)"


def gpu_groups_first(text: str) -> Optional[int]:
    """The first GPU of a PREFILL_GPUS / DECODE_GPUS text, or None when it is not valid (the plan says why)."""
    from ..serve_variables import gpu_groups

    try:
        return gpu_groups(text)[0][0]
    except (ValueError, IndexError):
        return None
