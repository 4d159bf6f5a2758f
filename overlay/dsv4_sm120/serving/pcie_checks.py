"""Preflight checks for a PCIe-only box: NUMA placement, peer-to-peer copies, the UCX path of the KV transfer.

Each returns ``(failures, notes)``; failures stop the start, notes are printed. The probes are parameters
(``probe=``, ``runner=``, ``sysfs=``, ``cmdline=``, ``topo=``) so tests inject fake boxes; by default they
run ``dsv4_sm120.serving.p2p_probe`` and ``dsv4_sm120.serving.nixl_check`` in the serving environment's
python and read ``/sys`` and ``/proc/cmdline``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from .plan import Plan
from .p2p_diag import diagnose_p2p, iommu_state
from .topology import TopologyError, parse_topo_matrix, run_smi
from .ucx_info import BW_OVERRIDE, judge_cuda_put, parse_proto_info, transports, version_note
from .. import settings

P2P_TIMEOUT_S = 120.0
UCX_TIMEOUT_S = 120.0
Result = Tuple[List[str], List[str]]


def _servers(plan: Plan):
    """{label: Proc} of the servers on this host (replicas by their own names)."""
    return {p.label: p for p in plan.procs if p.role in ("prefill", "decode")}


def _first(plan: Plan, role: str):
    return next((p for p in plan.procs if p.role == role), None)


def server_env(plan: Plan, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment a server gets (inherited + serve/env files + the decode server's own), with this
    checkout's overlay importable and every GPU visible (the probes use nvidia-smi's indices)."""
    env = dict(os.environ if base is None else base)
    for k, v, _ in plan.common_env:
        env[k] = v
    srv = _first(plan, "decode") or _first(plan, "prefill")
    for k, v in srv.env.items() if srv else ():
        if k != "CUDA_VISIBLE_DEVICES":
            env[k] = v
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    ov = str(Path(plan.repo) / "overlay")
    env["PYTHONPATH"] = ov + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _sysfs() -> Path:
    return Path(settings.get("DSV4_SM120_SERVE_SYSFS_ROOT") or "/sys")


# ---------------------------------------------------------------------------- numa

def check_numa(plan: Plan) -> Result:
    notes = []
    for role, p in _servers(plan).items():
        if p.numa:
            notes.append(f"{role} (GPUs {','.join(map(str, p.gpus))}): {p.numa.get('text', '')}")
    return [], notes


# ---------------------------------------------------------------------------- p2p

def probe_pairs(plan: Plan) -> Tuple[List[Tuple[int, int]], Dict[Tuple[int, int], str]]:
    """Ordered pairs within each server's TP group, and from every prefill GPU to every decode GPU."""
    srv = _servers(plan)
    pairs: Dict[Tuple[int, int], str] = {}
    for label, p in srv.items():
        for a in p.gpus:
            for b in p.gpus:
                if a != b:
                    pairs[(a, b)] = f"{label} TP"
    prefill = [g for p in srv.values() if p.role == "prefill" for g in p.gpus]
    decode = [g for p in srv.values() if p.role == "decode" for g in p.gpus]
    for a in prefill:
        for b in decode:
            pairs[(a, b)] = "prefill->decode"
    return list(pairs), pairs


def run_p2p_probe(plan: Plan, pairs: List[Tuple[int, int]], timeout_s: float) -> Tuple[List[dict], bool]:
    """Run p2p_probe in the serving python; (events, timed_out). Events already printed survive a timeout."""
    cmd = [plan.python, "-m", "dsv4_sm120.serving.p2p_probe", "--staged",
           "--pairs", ",".join(f"{a}:{b}" for a, b in pairs)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=server_env(plan), cwd=plan.repo, start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, 9)
        except OSError:
            pass
        out, err = proc.communicate()
    events = []
    for line in (out or "").splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    if not events and not timed_out and proc.returncode:
        tail = (err or "").strip().splitlines()
        events.append({"event": "error", "error": f"exit {proc.returncode}: {tail[-1] if tail else ''}"})
    return events, timed_out


def check_p2p(plan: Plan, probe: Optional[Callable] = None, sysfs: Optional[Path] = None,
              cmdline: Optional[str] = None, topo: Optional[str] = None, env: Optional[Dict[str, str]] = None,
              timeout_s: float = P2P_TIMEOUT_S) -> Result:
    pairs, roles = probe_pairs(plan)
    if not pairs:
        return [], ["one GPU per server on this host: no GPU pair to probe"]
    events, timed_out = (probe or run_p2p_probe)(plan, pairs, timeout_s)
    if cmdline is None:
        try:
            cmdline = Path("/proc/cmdline").read_text()
        except OSError:
            cmdline = ""
    if topo is None:
        try:
            topo = run_smi(plan.settings.get("NVIDIA_SMI") or "nvidia-smi", ["topo", "-m"])
        except TopologyError:
            topo = ""
    fails, notes = diagnose_p2p(events, timed_out, server_env(plan, env), iommu_state(sysfs or _sysfs(), cmdline),
                                parse_topo_matrix(topo), timeout_s, roles)
    ipc_fails, ipc_notes = check_ipc(plan, events, env)
    return fails + ipc_fails, notes + ipc_notes


# ---------------------------------------------------------------------------- the PCIe-IPC all-reduce

def inherited_env(plan: Plan, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """What every server inherits: serve/env/*.env under the caller's environment (the plan's ``common_env``)."""
    env = dict(os.environ if base is None else base)
    env.update({k: v for k, v, _ in plan.common_env})
    return env


def ipc_servers(plan: Plan, base: Optional[Dict[str, str]] = None) -> Dict[str, Tuple[List[int], Dict[str, str]]]:
    """{server: (its GPUs, the all-reduce variables it starts with)} of the servers on this host."""
    from .allreduce_env import NAMES

    inherited = inherited_env(plan, base)
    out = {}
    for name, p in _servers(plan).items():
        env = {k: inherited[k] for k in NAMES if k in inherited and k not in p.unset}
        env.update({k: v for k, v in p.env.items() if k in NAMES})
        out[name] = (list(p.gpus), env)
    return out


def check_ipc(plan: Plan, events: List[dict], base: Optional[Dict[str, str]] = None) -> Result:
    """What FlashInfer's PCIe-IPC all-reduce needs, from the p2p probe's events (``allreduce_env.ipc_blocker``: CUDA
    peer access and correct copies between every pair of the server's GPUs, no NCCL_P2P_DISABLE=1). A server the
    machine profile put on it where it cannot run is switched to the profile's NCCL-only choice (one note line, the
    plan changed before anything starts); one where your ``SGLANG_ENABLE_PCIE_IPC_ALLREDUCE`` turns it on is a
    failure (its first reduction would fault or hang)."""
    from .allreduce_env import ENABLE, NAMES, env_true, ipc_blocker, preflight_ipc
    from .profile_choices import allreduce

    inherited = inherited_env(plan, base)
    notes: List[str] = []
    for name, p in _servers(plan).items():
        if not env_true(p.env.get(ENABLE)):        # not on, or on by your setting (preflight_ipc below)
            continue
        why = ipc_blocker(p.gpus, events, {**inherited, **p.env})
        if why is None:
            continue
        senv = allreduce(p.role, p.gpus, inherited, plan.settings.get("NVIDIA_SMI") or "nvidia-smi", ipc_blocked=why)
        for k in NAMES:
            p.env.pop(k, None)
        p.env.update(senv.env)
        p.unset = list(senv.unset)
        p.allreduce = senv.source
        notes.append(f"{name} (GPUs {','.join(map(str, p.gpus))}) runs NCCL, not the profile's PCIe-IPC all-reduce: "
                     f"{why} ({senv.line()})")
    fails, more = preflight_ipc(ipc_servers(plan, base), events, inherited)
    return fails, notes + more


def ipc_unverified(plan: Plan, why: str) -> List[str]:
    """Notes for the servers that start with the PCIe-IPC all-reduce on when the p2p check does not run (``why``):
    what the IPC path needs that nothing verified."""
    from .allreduce_env import ENABLE, env_true

    out = []
    for name, (gpus, env) in ipc_servers(plan).items():
        if env_true(env.get(ENABLE)):
            out.append(f"{name} (GPUs {','.join(map(str, gpus))}) starts with the PCIe-IPC all-reduce, which needs CUDA "
                       f"peer access between every pair of its GPUs: {why}")
    return out


# ---------------------------------------------------------------------------- ucx

def run_nixl_vram(plan: Plan, src: int, dst: int, extra_env: Dict[str, str], timeout_s: float) -> Tuple[int, str]:
    """Two-process NIXL VRAM write prefill GPU -> decode GPU with UCX_PROTO_INFO=y; (exit code, all output)."""
    env = server_env(plan)
    env.update(extra_env)
    env["UCX_PROTO_INFO"] = "y"
    cmd = [plan.python, "-m", "dsv4_sm120.serving.nixl_check", "--json", "--mem", "vram", "--src-gpu", str(src),
           "--dst-gpu", str(dst), "--page-tokens", "256", "--pages", "16", "--layers", "4", "--moved", "8",
           "--timeout", str(int(timeout_s / 2))]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=plan.repo, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        return 124, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    return r.returncode, r.stdout + "\n" + r.stderr


def _report(text: str) -> dict:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and '"ok"' in line:
            try:
                return json.loads(line)
            except ValueError:
                continue
    return {}


def check_ucx(plan: Plan, runner: Optional[Callable] = None, timeout_s: float = UCX_TIMEOUT_S) -> Result:
    pre, dec = _first(plan, "prefill"), _first(plan, "decode")
    if pre is None or dec is None:
        return [], ["prefill and decode are not both on this host: the GPU-to-GPU UCX path is checked where both run"]
    src, dst = pre.gpus[0], dec.gpus[0]
    run = runner or run_nixl_vram
    t0 = time.monotonic()
    rc, text = run(plan, src, dst, {}, timeout_s)
    rep = _report(text)
    notes: List[str] = []
    if rc == 124:
        return [f"NIXL/UCX GPU {src} -> GPU {dst} KV write did not finish within {timeout_s:g} s: the transfer hang "
                f"seen with unpinned UCX_NET_DEVICES or blocked P2P; set UCX_NET_DEVICES (e.g. lo on one host) and see "
                f"the p2p check"], []
    if rc != 0 or not rep.get("ok"):
        lines = [x for x in text.splitlines() if "nixl check" in x]
        why = lines[-1] if lines else (f"{rep.get('bad_moved_pages')} moved pages differ" if rep else f"exit {rc}")
        return [f"NIXL/UCX GPU {src} -> GPU {dst} KV write failed: {why}"], []
    state, line = version_note(rep.get("ucx_version"))
    notes.append(("WARNING: " if state == "old" else "") + line)
    tables = parse_proto_info(text)
    tl = transports(tables)
    if tl:
        notes.append("UCX put transports per memory type: " + "; ".join(f"{k} {','.join(v)}" for k, v in tl.items()))
    direct, used = judge_cuda_put(tables)
    if direct is None:
        notes.append(f"UCX printed no GPU-to-GPU put protocol ({used}); the transfer itself verified "
                     f"({time.monotonic() - t0:.1f} s)")
    elif direct:
        notes.append(f"GPU {src} -> GPU {dst} KV writes take the direct path: {used}")
    else:
        msg = f"WARNING: GPU {src} -> GPU {dst} KV writes do not take cuda_ipc zero-copy: {used}"
        env = server_env(plan)
        if "UCX_CUDA_IPC_BW" not in env:
            key, val = BW_OVERRIDE.split("=", 1)
            rc2, text2 = run(plan, src, dst, {key: val}, timeout_s)
            d2, used2 = judge_cuda_put(parse_proto_info(text2))
            if rc2 == 0 and d2:
                msg += f"; with {BW_OVERRIDE} UCX selects {used2}: set {BW_OVERRIDE} (caller environment or serve/env/20-nixl.env)"
            else:
                msg += f"; {BW_OVERRIDE} does not change it here ({used2}); check the p2p check's findings"
        notes.append(msg)
    return [], notes
