"""The box's PCIe / NUMA topology, read from nvidia-smi and sysfs (never assumed).

Each GPU's PCI bus id comes from ``nvidia-smi --query-gpu=index,pci.bus_id``; the NUMA node it hangs
off is ``/sys/bus/pci/devices/<bdf>/numa_node`` (-1 = the firmware gives none), and the node's CPUs are
``/sys/devices/system/node/node<N>/cpulist``. The sysfs root and the nvidia-smi executable are
parameters so tests feed fake trees.

A server whose GPUs all hang off one node N is bound to N: the supervisor pins the server's main
process (and so every process it starts) to N's CPUs with N as the preferred memory node
(:func:`apply_binding`), and SGLang gets ``--numa-node N ...`` (one entry per TP rank, SGLang 0.5.23's
``numa_node`` server arg, ``srt/utils/numa_utils.py``) so its TP workers bind themselves to the same node.
``nvidia-smi topo -m`` / ``topo -p2p r|w`` matrices are parsed for the preflight's P2P diagnosis.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

BDF = re.compile(r"^([0-9a-fA-F]+):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


class TopologyError(Exception):
    """The topology could not be read (one line saying why)."""


@dataclass
class NumaBinding:
    """Where one server runs: ``node`` None = unbound (``note`` says why)."""
    role: str
    gpus: List[int]
    gpu_nodes: Dict[int, Optional[int]] = field(default_factory=dict)
    node: Optional[int] = None
    cpus: List[int] = field(default_factory=list)
    note: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gpu_nodes"] = {str(k): v for k, v in self.gpu_nodes.items()}
        return d

    def describe(self) -> str:
        where = ", ".join(f"GPU {g}: node {'?' if n is None else n}" for g, n in self.gpu_nodes.items())
        if self.node is None:
            return f"unbound ({self.note})" + (f" [{where}]" if where else "")
        return f"NUMA node {self.node}, CPUs {format_cpus(self.cpus)} [{where}]"


# ---------------------------------------------------------------------------- parsing

def sysfs_bdf(bus_id: str) -> str:
    """nvidia-smi's ``00000000:01:00.0`` -> sysfs's ``0000:01:00.0`` (lower case, 4-digit domain)."""
    m = BDF.match(bus_id.strip())
    if not m:
        raise TopologyError(f"unexpected PCI bus id {bus_id!r} from nvidia-smi")
    dom, bus, dev, fn = m.groups()
    return f"{int(dom, 16):04x}:{bus.lower()}:{dev.lower()}.{fn}"


def parse_bus_ids(text: str) -> Dict[int, str]:
    """``index, pci.bus_id`` csv rows -> {index: sysfs bdf}."""
    out: Dict[int, str] = {}
    for line in text.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != 2 or not parts[0].isdigit():
            raise TopologyError(f"unexpected nvidia-smi line: {line!r}")
        out[int(parts[0])] = sysfs_bdf(parts[1])
    return out


def parse_cpulist(text: str) -> List[int]:
    """``0-3,8,10-11`` -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: List[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise TopologyError(f"unexpected cpulist {text.strip()!r}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        cpus.extend(range(lo, hi + 1))
    return sorted(set(cpus))


def format_cpus(cpus: Iterable[int]) -> str:
    """[0, 1, 2, 3, 8] -> ``0-3,8``."""
    cs = sorted(set(cpus))
    out, i = [], 0
    while i < len(cs):
        j = i
        while j + 1 < len(cs) and cs[j + 1] == cs[j] + 1:
            j += 1
        out.append(str(cs[i]) if i == j else f"{cs[i]}-{cs[j]}")
        i = j + 1
    return ",".join(out)


def parse_topo_matrix(text: str) -> Dict[Tuple[int, int], str]:
    """``nvidia-smi topo -m`` / ``topo -p2p r`` output -> {(gpu_i, gpu_j): cell} for GPU rows and columns.

    Cells are e.g. ``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``, ``NV4`` (topo -m) or ``OK``, ``CNS``,
    ``GNS``, ``TNS``, ``NS``, ``U`` (topo -p2p); ``X`` on the diagonal."""
    header: Optional[List[str]] = None
    out: Dict[Tuple[int, int], str] = {}
    for raw in text.splitlines():
        toks = raw.split()
        if not toks:
            continue
        if header is None:
            # the header starts with GPU0 too, but a row's second cell is its diagonal "X"
            if re.fullmatch(r"GPU\d+", toks[0]) and (len(toks) < 2 or toks[1] != "X"):
                header = toks
            continue
        if not re.fullmatch(r"GPU\d+", toks[0]):
            if toks[0].startswith("Legend"):
                break
            continue
        i = int(toks[0][3:])
        for col, cell in zip(header, toks[1:]):
            if re.fullmatch(r"GPU\d+", col):
                out[(i, int(col[3:]))] = cell
    return out


# ---------------------------------------------------------------------------- reading the box

def run_smi(smi: str, args: Sequence[str], timeout: float = 30) -> str:
    try:
        r = subprocess.run([smi, *args], capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise TopologyError(f"nvidia-smi not found ({smi})")
    except subprocess.TimeoutExpired:
        raise TopologyError(f"nvidia-smi {' '.join(args)} did not answer within {timeout:g} s")
    except OSError as e:
        raise TopologyError(f"nvidia-smi could not run ({e})")
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()
        raise TopologyError(f"nvidia-smi {' '.join(args)} failed (exit {r.returncode}): {tail[-1] if tail else ''}")
    return r.stdout


def gpu_bus_ids(smi: str) -> Dict[int, str]:
    return parse_bus_ids(run_smi(smi, ["--query-gpu=index,pci.bus_id", "--format=csv,noheader"]))


def gpu_numa_node(sysfs: Path, bdf: str) -> Optional[int]:
    """The NUMA node of PCI device ``bdf`` (None: no file, unreadable, or -1)."""
    try:
        v = int((Path(sysfs) / "bus" / "pci" / "devices" / bdf / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return v if v >= 0 else None


def node_cpus(sysfs: Path, node: int) -> List[int]:
    try:
        return parse_cpulist((Path(sysfs) / "devices" / "system" / "node" / f"node{node}" / "cpulist").read_text())
    except OSError:
        return []


def numa_node_count(sysfs: Path) -> int:
    d = Path(sysfs) / "devices" / "system" / "node"
    try:
        return sum(1 for p in d.iterdir() if re.fullmatch(r"node\d+", p.name))
    except OSError:
        return 0


def numa_bindings(groups: Mapping[str, List[int]], smi: str = "nvidia-smi", sysfs: Path = Path("/sys"),
                  enabled: bool = True) -> Dict[str, NumaBinding]:
    """Per role (``{"prefill": [0, 1, 2, 3], ...}``) the node its GPUs hang off, with the node's CPUs.

    Unbound, with the reason in ``note``, when binding is off, when nvidia-smi or sysfs give no node
    for a GPU, when the box has a single node, or when a server's GPUs span nodes (then SGLang still
    binds each TP worker through ``gpu_nodes``)."""
    out = {r: NumaBinding(r, list(g)) for r, g in groups.items()}
    if not enabled:
        for b in out.values():
            b.note = "NUMA_BIND=0"
        return out
    try:
        bus = gpu_bus_ids(smi)
    except TopologyError as e:
        for b in out.values():
            b.note = f"no NUMA information: {e}"
        return out
    nodes = numa_node_count(sysfs)
    for b in out.values():
        missing = [g for g in b.gpus if g not in bus]
        if missing:
            b.note = f"nvidia-smi does not list GPU {','.join(map(str, missing))}"
            continue
        b.gpu_nodes = {g: gpu_numa_node(sysfs, bus[g]) for g in b.gpus}
        unknown = [g for g, n in b.gpu_nodes.items() if n is None]
        if unknown:
            b.note = (f"no NUMA information for GPU {','.join(map(str, unknown))} "
                      f"({Path(sysfs) / 'bus/pci/devices' / bus[unknown[0]] / 'numa_node'} missing or -1)")
            continue
        found = sorted(set(b.gpu_nodes.values()))
        if nodes <= 1 and found == [0]:
            b.note = "one NUMA node on this box: nothing to bind"
            continue
        if len(found) > 1:
            b.note = (f"its GPUs hang off NUMA nodes {','.join(map(str, found))}: the server stays unbound, "
                      f"each TP worker binds to its GPU's node")
            continue
        cpus = node_cpus(sysfs, found[0])
        if not cpus:
            b.note = f"NUMA node {found[0]} lists no CPUs ({Path(sysfs) / 'devices/system/node'})"
            continue
        b.node, b.cpus = found[0], cpus
    return out


def sglang_numa_args(b: NumaBinding) -> List[str]:
    """``--numa-node`` for SGLang: one node per TP rank (logical GPU order), when every GPU's node is known."""
    if not b.gpu_nodes or any(n is None for n in b.gpu_nodes.values()):
        return []
    if b.node is None and len(set(b.gpu_nodes.values())) <= 1:
        return []      # binding off or a one-node box
    return ["--numa-node", *[str(b.gpu_nodes[g]) for g in b.gpus]]


# ---------------------------------------------------------------------------- applying a binding

MPOL_PREFERRED = 1
SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237, "ppc64le": 261}


def apply_binding(cpus: Sequence[int], node: Optional[int]) -> str:
    """Pin the calling process to ``cpus`` (intersected with what it may use) and prefer ``node`` for its
    memory (set_mempolicy MPOL_PREFERRED: allocations fall back to other nodes instead of failing).
    Both are inherited by every process it starts. Returns what it did, for the log."""
    done = []
    allowed = os.sched_getaffinity(0)
    target = set(cpus) & allowed
    if target:
        os.sched_setaffinity(0, target)
        done.append(f"CPUs {format_cpus(target)}")
    else:
        done.append(f"CPU pinning skipped (none of {format_cpus(cpus)} allowed)")
    nr = SYS_SET_MEMPOLICY.get(platform.machine())
    if node is not None and nr is not None:
        mask = ctypes.c_ulong(1 << node)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            rc = libc.syscall(nr, MPOL_PREFERRED, ctypes.byref(mask), ctypes.c_ulong(node + 2))
            done.append(f"memory preferred on node {node}" if rc == 0 else
                        f"memory policy not set (errno {ctypes.get_errno()})")
        except (OSError, AttributeError):
            done.append("memory policy not set (no libc syscall)")
    return ", ".join(done)


def allowed_cpus(pid: int) -> List[int]:
    """The CPUs ``pid`` may run on (``Cpus_allowed_list`` of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpulist(line.split(":", 1)[1])
    return []
