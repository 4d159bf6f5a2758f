"""The environment that selects each server's TP all-reduce, from the machine profile (pure: no torch, no SGLang).

:func:`server_env` is what the serve plan calls per server (prefill, decode). It returns the variables to set for
that server, the ones it must not inherit from ``serve/env/*.env``, and one line saying where the choice came
from. Precedence, per variable: the user's explicit setting wins (a value is left as it is; an empty value means
"not set" and the name goes to ``unset``: NCCL reads an empty list as no override, SGLang's integer reader warns
on it); else the profile's measured choice for that server (``allreduce`` decision, the server's role, measured at
the same TP size); else the defaults:

* decode: ``NCCL_PROTO=LL NCCL_ALGO=Ring`` (what ``serve/env/10-nccl.env`` sets today: decode all-reduces are a
  few KiB to a few hundred KiB, latency-bound, where LL is NCCL's low-latency protocol and Ring works on a
  PCIe-only box), PCIe-IPC off;
* prefill: no protocol and no algorithm forced (NCCL picks per size: its latency protocols for short prompts,
  Simple for megabyte chunks, where LL moves half the payload per transfer), PCIe-IPC off.

PCIe-IPC is off without a measurement because SGLang ships it off, its kernels spin without a timeout when
ranks disagree, and a workspace sized wrong costs prefill (SGLang's own figures: TTFT +66% with a prefill-sized
workspace). The variables are the ones SGLang 0.5.23 reads (``srt/environ.py``: ``SGLANG_ENABLE_PCIE_IPC_ALLREDUCE``
bool, ``SGLANG_PCIE_IPC_MAX_NUMEL`` int) and NCCL reads at communicator creation (``NCCL_PROTO``, ``NCCL_ALGO``).

:func:`ipc_blocker` / :func:`preflight_ipc` say what the IPC path needs from the box (for the serve preflight):
a group of 2, 4 or 8 ranks, CUDA peer access between every ordered pair of the group's GPUs and correct peer
copies (the ``p2p`` check's probe events), and peer DMA not switched off (``NCCL_P2P_DISABLE=1``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..machine_profile.allreduce_choice import IPC, describe_nccl, parse_method

ENABLE = "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"
MAX_NUMEL = "SGLANG_PCIE_IPC_MAX_NUMEL"
PROTO, ALGO = "NCCL_PROTO", "NCCL_ALGO"
NAMES = (ENABLE, MAX_NUMEL, PROTO, ALGO)
DEFAULTS: Dict[str, Dict[str, Optional[str]]] = {
    "decode": {PROTO: "LL", ALGO: "Ring"},
    "prefill": {PROTO: None, ALGO: None},
}
DEFAULT_WHY = {"decode": "decode all-reduces are latency-bound", "prefill": "NCCL picks per size; no decode-size "
               "protocol on prefill chunks"}
IPC_WORLD_SIZES = (2, 4, 8)


@dataclass
class ServerEnv:
    role: str
    env: Dict[str, str] = field(default_factory=dict)   # to set for this server
    unset: Tuple[str, ...] = ()                          # not to inherit from serve/env files
    source: str = ""                                     # one line: the choice and where it came from

    def line(self) -> str:
        return f"all-reduce {self.role}: {self.source}"


def env_true(value: Optional[str]) -> bool:
    """SGLang's EnvBool reading (``true/1/yes/y``, any case)."""
    return (value or "").strip().lower() in ("true", "1", "yes", "y")


def measured_server(profile: Optional[Mapping], role: str, gpus: int) -> Tuple[Optional[Mapping], str]:
    """(the profile's usable measurement of ``role`` at TP ``gpus``, else None; why not)."""
    d = ((profile or {}).get("decisions") or {}).get("allreduce")
    if profile is None:
        return None, ""
    if not isinstance(d, Mapping):
        return None, "the profile has no allreduce decision"
    s = (d.get("servers") or {}).get(role)
    if not isinstance(s, Mapping) or s.get("status") != "ok":
        return None, f"the profile has no {role} measurement" + (f" ({s.get('reason')})" if s else "")
    if s.get("tp") != gpus:
        return None, f"the profile measured {role} at TP{s.get('tp')}, this {role} server runs TP{gpus}"
    c = s.get("choice") or {}
    if c.get("status") != "ok":
        return None, f"the profile's {role} measurement has no choice ({c.get('reason', 'none')})"
    return s, ""


def _nccl_vars(method: str) -> Dict[str, Optional[str]]:
    m = parse_method(method)
    return {PROTO: m["proto"], ALGO: m["algo"]}


def server_env(role: str, gpus: int, environ: Mapping[str, str], profile: Optional[Mapping] = None,
               source: str = "", ipc_blocked: Optional[str] = None) -> ServerEnv:
    """The all-reduce environment of one server (module doc). ``profile``: the matching machine profile (or
    None); ``source``: its path, or why none matched; ``ipc_blocked``: why the preflight found the IPC path
    unusable on this box (IPC then stays off unless the user turned it on)."""
    if role not in DEFAULTS:
        raise ValueError(f"unknown server role {role!r}: expected prefill or decode")
    user = {k: environ[k] for k in NAMES if k in environ}
    if gpus < 2:
        return ServerEnv(role, {}, (), f"TP{gpus}: no all-reduce" + _user_text(user))
    meas, why = measured_server(profile, role, gpus)
    want: Dict[str, Optional[str]] = {ENABLE: None, MAX_NUMEL: None}
    if meas is not None:
        c = meas["choice"]
        ipc_on = env_true(user[ENABLE]) if ENABLE in user else bool(c["ipc_max_numel"]) and not ipc_blocked
        uses_bound = ipc_on and bool(c["ipc_max_numel"])
        want.update(_nccl_vars(c["nccl"] if uses_bound else c["nccl_only"]["nccl"]))
        if uses_bound:
            want.update({ENABLE: "1", MAX_NUMEL: str(c["ipc_max_numel"])})
        text = _profile_text(meas, c, uses_bound, ipc_blocked, source)
    else:
        want.update(DEFAULTS[role])
        shown = " ".join(f"{k}={v}" for k, v in DEFAULTS[role].items() if v) or "no NCCL_PROTO / NCCL_ALGO"
        text = (f"default: {shown} ({DEFAULT_WHY[role]}), {IPC} off ("
                + (why or source or "no matching machine profile") + "; make calibrate measures it)")
        if ipc_blocked:
            text += f"; {IPC} could not run here anyway: {ipc_blocked}"
    env = {k: v for k, v in want.items() if v is not None and k not in user}
    unset = tuple(k for k, v in want.items() if (v is None and k not in user) or user.get(k, None) == "")
    if ENABLE in user and env_true(user[ENABLE]) and ipc_blocked:
        text += f"; WARNING: {ENABLE}={user[ENABLE]} is yours but {ipc_blocked}"
    return ServerEnv(role, env, unset, (_user_text(user) + "; " if user else "") + text)


def _user_text(user: Mapping[str, str]) -> str:
    return "env " + " ".join(f"{k}={v}" if v else f"{k} unset" for k, v in user.items()) + " (yours)" if user else ""


def _profile_text(meas: Mapping, c: Mapping, uses_bound: bool, ipc_blocked: Optional[str], source: str) -> str:
    where = f"profile {source}" if source else "profile"
    if uses_bound:
        return (f"{where}: {IPC} up to {c['ipc_max_numel']} elements ({c['ipc_max_rows']} rows x "
                f"{meas.get('hidden')}), {describe_nccl(c['nccl'])} above")
    if c["ipc_max_numel"] and ipc_blocked:
        return (f"{where}: {describe_nccl(c['nccl_only']['nccl'])} at every size ({IPC} would serve up to "
                f"{c['ipc_max_numel']} elements but cannot run here: {ipc_blocked})")
    if c["ipc_max_numel"]:
        return f"{where}: {describe_nccl(c['nccl_only']['nccl'])} at every size ({IPC} turned off)"
    return f"{where}: {c.get('reason') or describe_nccl(c['nccl_only']['nccl'])}"


# ----------------------------------------------------------------------------- what the preflight checks

def ipc_blocker(gpus: Sequence[int], events: Sequence[Mapping], env: Mapping[str, str]) -> Optional[str]:
    """None when FlashInfer's PCIe-IPC all-reduce can run on the group ``gpus`` (nvidia-smi indices), judged
    from the ``p2p`` check's probe events (``serving/p2p_probe.py``: one ``pair`` event per ordered pair with
    ``can_access``, ``ok``, ``error``); else why not, one line."""
    n = len(gpus)
    if n not in IPC_WORLD_SIZES:
        return f"TP{n}: the PCIe-IPC kernels run at {', '.join(map(str, IPC_WORLD_SIZES))} ranks"
    if env.get("NCCL_P2P_DISABLE", "") == "1":
        return "NCCL_P2P_DISABLE=1 is set (peer DMA unusable on this box), and the IPC kernels write peer memory"
    errors = [e for e in events if e.get("event") == "error"]
    if errors:
        return f"the p2p probe could not run: {errors[0].get('error')}"
    pairs = {(e.get("src"), e.get("dst")): e for e in events if e.get("event") == "pair"}
    for a in gpus:
        for b in gpus:
            if a == b:
                continue
            e = pairs.get((a, b))
            if e is None:
                return f"no p2p probe result for GPU {a} -> GPU {b}"
            if e.get("error") or not e.get("ok"):
                return f"peer copy GPU {a} -> GPU {b} failed ({e.get('error') or 'wrong bytes'})"
            if not e.get("can_access"):
                return (f"no CUDA peer access GPU {a} -> GPU {b} (the IPC kernels read and write every peer's "
                        f"memory directly)")
    return None


def preflight_ipc(servers: Mapping[str, Tuple[Sequence[int], Mapping[str, str]]], events: Sequence[Mapping],
                  env: Mapping[str, str]) -> Tuple[List[str], List[str]]:
    """(failures, notes) for the preflight: ``servers`` maps a role to (its GPUs, the environment it starts
    with). A server that turns the IPC path on where :func:`ipc_blocker` finds it cannot run is a failure (its
    kernels would fault or hang at the first reduction); a server that leaves it off gets a note when only the
    box stands in the way."""
    fails, notes = [], []
    for role, (gpus, senv) in servers.items():
        why = ipc_blocker(gpus, events, {**env, **senv})
        group = f"GPUs {','.join(map(str, gpus))}"
        if env_true(senv.get(ENABLE)):
            if why:
                fails.append(f"{role} ({group}) turns the PCIe-IPC all-reduce on ({ENABLE}=1) but it cannot run "
                             f"there: {why}. Start with {ENABLE}=0 (NCCL then serves every size)")
            else:
                k = len(gpus) * (len(gpus) - 1)
                notes.append(f"{role} ({group}): PCIe-IPC all-reduce on, peer access on all {k} ordered pairs")
        elif why and len(gpus) in IPC_WORLD_SIZES:
            notes.append(f"{role} ({group}): PCIe-IPC all-reduce off; it could not run here: {why}")
    return fails, notes
