"""Diagnosis of the peer-to-peer path on a PCIe-only box, from the P2P probe's events (pure functions).

Known on RTX PRO 6000 / RTX 5090 boxes without NVLink: with the IOMMU translating DMA or ACS forcing
peer traffic up to the root complex, peer copies (and NCCL's first collective, and UCX's cuda_ipc) hang
or fail (``cudaIpcOpenMemHandle`` errors); when P2P works a peer copy runs at PCIe speed (tens of GB/s;
~104 GB/s reported). ``NCCL_P2P_DISABLE=1`` avoids the hang by bouncing NCCL traffic through host
memory, at the cost the probe measures (the ``staged`` copy); ``UCX_TLS=^cuda_ipc`` does the same for the
KV transfer.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

SLOW_GBPS = 20.0     # a PCIe 4.0/5.0 x16 peer copy runs well above this; below it the path is degraded


def iommu_state(sysfs: Path, cmdline: str) -> dict:
    """IOMMU facts: iommu groups present (DMA remapping on), the kernel command line's iommu flags."""
    try:
        groups = sum(1 for _ in (Path(sysfs) / "kernel" / "iommu_groups").iterdir())
    except OSError:
        groups = 0
    flags = re.findall(r"\b(?:intel_iommu|amd_iommu|iommu)=\S+", cmdline or "")
    passthrough = any(f in ("iommu=pt", "amd_iommu=pt", "intel_iommu=pt") for f in flags)
    off = any(f.endswith("=off") for f in flags)
    return {"groups": groups, "flags": flags, "on": groups > 0 and not off, "passthrough": passthrough}


def fix_hint(iommu: dict) -> str:
    if iommu.get("on") and not iommu.get("passthrough"):
        where = f"kernel command line: {' '.join(iommu['flags'])}" if iommu.get("flags") else "enabled by default or in the BIOS"
        first = (f"the IOMMU is on ({iommu['groups']} iommu groups; {where}): boot with iommu=pt "
                 f"(or disable VT-d / AMD-Vi in the BIOS)")
    elif iommu.get("on"):
        first = f"the IOMMU is in passthrough mode ({' '.join(iommu['flags'])}), so look at ACS first"
    else:
        first = "no IOMMU remapping seen"
    return (f"{first}; disable ACS on the PCIe switches / root ports (BIOS, or setpci; `sudo lspci -vvv | grep "
            f"ACSCtl` shows SrcValid+/ReqRedir+ where it is on)")


def _uses_fallback(env: Mapping[str, str]) -> bool:
    tls = env.get("UCX_TLS", "")
    no_ipc = tls.startswith("^") and "cuda_ipc" in tls or (bool(tls) and not tls.startswith("^") and "cuda_ipc" not in tls)
    return env.get("NCCL_P2P_DISABLE", "") == "1" and no_ipc


def diagnose_p2p(events: Sequence[dict], timed_out: bool, env: Mapping[str, str], iommu: dict,
                 topo: Optional[Dict[Tuple[int, int], str]] = None, timeout_s: float = 0.0,
                 roles: Optional[Mapping[Tuple[int, int], str]] = None) -> Tuple[List[str], List[str]]:
    """(failures, notes) from the probe's JSON events. ``roles`` names each pair's kind (``prefill TP``,
    ``decode TP``, ``prefill->decode``) for the summary; ``topo`` is ``nvidia-smi topo -m`` parsed."""
    topo = topo or {}
    roles = roles or {}
    fails: List[str] = []
    notes: List[str] = []
    errors = [e for e in events if e.get("event") == "error"]
    if errors:
        return [f"P2P probe could not run: {errors[0].get('error')}"], []
    pairs = {(e["src"], e["dst"]): e for e in events if e.get("event") == "pair"}
    staged = {(e["src"], e["dst"]): e.get("gbps") for e in events if e.get("event") == "staged"}
    started = [(e["src"], e["dst"]) for e in events if e.get("event") == "start"]
    fallback = "NCCL_P2P_DISABLE=1 UCX_TLS=^cuda_ipc"
    staged_all = [g for g in staged.values() if g]
    cost = (f"host-memory bounce measured at {statistics.median(staged_all):.1f} GB/s" if staged_all else
            "every TP all-reduce and KV page then bounces through host memory")
    hint = fix_hint(iommu)

    def path(a: int, b: int) -> str:
        return f", path {topo[(a, b)]}" if (a, b) in topo else ""

    hung = [p for p in started if p not in pairs]
    if timed_out and hung:
        a, b = hung[-1]
        fails.append(f"peer copy GPU {a} -> GPU {b} did not finish within {timeout_s:g} s{path(a, b)}: the P2P hang "
                     f"these cards show when P2P DMA is blocked (NCCL's first all-reduce and UCX cuda_ipc would hang "
                     f"the same way). Fix: {hint}; or start with {fallback} ({cost})")
    for (a, b), e in pairs.items():
        if e.get("error"):
            fails.append(f"peer copy GPU {a} -> GPU {b} failed{path(a, b)}: {e['error']}. Fix: {hint}; or start with "
                         f"{fallback} ({cost})")
        elif not e.get("ok"):
            fails.append(f"peer copy GPU {a} -> GPU {b} delivered wrong bytes{path(a, b)} (P2P DMA through a "
                         f"translating IOMMU / ACS). Fix: {hint}; or start with {fallback} ({cost})")
    if fails and _uses_fallback(env):
        notes += [f"WARNING (running with {fallback}): {f}" for f in fails]
        fails = []

    good = [e for e in pairs.values() if not e.get("error") and e.get("ok")]
    no_peer = sorted((e["src"], e["dst"]) for e in good if not e.get("can_access"))
    if no_peer:
        shown = ", ".join(f"{a}->{b}" for a, b in no_peer[:6]) + (" ..." if len(no_peer) > 6 else "")
        notes.append(f"WARNING: no CUDA peer access for {len(no_peer)} GPU pair(s) ({shown}): NCCL and UCX bounce "
                     f"through host memory there ({cost}). To enable P2P: {hint}")
    slow = sorted(((e["src"], e["dst"]), e["gbps"]) for e in good
                  if e.get("can_access") and e.get("gbps") is not None and e["gbps"] < SLOW_GBPS)
    for (a, b), g in slow[:4]:
        st = staged.get((a, b))
        notes.append(f"WARNING: peer copy GPU {a} -> GPU {b} runs at {g:.1f} GB/s{path(a, b)} (a PCIe 4/5 x16 peer "
                     f"copy runs above {SLOW_GBPS:g}){f'; through host memory {st:.1f} GB/s' if st else ''}: check the "
                     f"link width / speed (nvidia-smi -q -d PCI) and ACS redirection ({hint})")
    by_kind: Dict[str, List[float]] = {}
    for (a, b), e in pairs.items():
        if e.get("gbps") is not None and e.get("ok"):
            by_kind.setdefault(roles.get((a, b), "pairs"), []).append(e["gbps"])
    if by_kind:
        parts = [f"{k}: median {statistics.median(v):.1f} GB/s over {len(v)} pair(s)" for k, v in by_kind.items()]
        if staged_all:
            parts.append(f"through host memory: {statistics.median(staged_all):.1f} GB/s")
        notes.insert(0, "peer copies " + "; ".join(parts))
    if env.get("NCCL_P2P_DISABLE", "") == "1" and pairs and not fails and not no_peer and not slow and \
            all(e.get("ok") and not e.get("error") for e in pairs.values()):
        notes.append(f"NCCL_P2P_DISABLE=1 is set but peer copies work on every pair: unset it (it routes every TP "
                     f"all-reduce through host memory: {cost})")
    return fails, notes
