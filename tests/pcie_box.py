"""A fake 8-GPU PCIe box for the NUMA / P2P / UCX tests: an nvidia-smi script and a sysfs tree.

GPUs 0-3 hang off NUMA node 0, GPUs 4-7 off node 1 (the seeds' layout) unless a test says otherwise;
bus ids as nvidia-smi prints them (8-digit domain, upper case) so the code has to turn them into
sysfs's form.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Dict, Optional

BUS = {i: f"00000000:{0x18 + 0x10 * i:02X}:00.0" for i in range(8)}
SMI_TABLE = "\n".join(f"{i}, NVIDIA RTX PRO 6000 Blackwell Server Edition, 12.0, 97887, 97000" for i in range(8))
TOPO_M = """\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tPIX\tPXB\tPXB\tSYS\tSYS\tSYS\tSYS\t0-1\t0\t\tN/A
GPU1\tPIX\t X \tPXB\tPXB\tSYS\tSYS\tSYS\tSYS\t0-1\t0\t\tN/A
GPU2\tPXB\tPXB\t X \tPIX\tSYS\tSYS\tSYS\tSYS\t0-1\t0\t\tN/A
GPU3\tPXB\tPXB\tPIX\t X \tSYS\tSYS\tSYS\tSYS\t0-1\t0\t\tN/A
GPU4\tSYS\tSYS\tSYS\tSYS\t X \tPIX\tPXB\tPXB\t2-3\t1\t\tN/A
GPU5\tSYS\tSYS\tSYS\tSYS\tPIX\t X \tPXB\tPXB\t2-3\t1\t\tN/A
GPU6\tSYS\tSYS\tSYS\tSYS\tPXB\tPXB\t X \tPIX\t2-3\t1\t\tN/A
GPU7\tSYS\tSYS\tSYS\tSYS\tPXB\tPXB\tPIX\t X \t2-3\t1\t\tN/A

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes
"""


def sysfs_bdf(i: int) -> str:
    return f"0000:{0x18 + 0x10 * i:02x}:00.0"


def make_sysfs(root: Path, gpu_nodes: Dict[int, int], node_cpus: Dict[int, str], iommu_groups: int = 0) -> Path:
    for i, n in gpu_nodes.items():
        d = root / "bus" / "pci" / "devices" / sysfs_bdf(i)
        d.mkdir(parents=True, exist_ok=True)
        (d / "numa_node").write_text(f"{n}\n")
    for n, cpus in node_cpus.items():
        d = root / "devices" / "system" / "node" / f"node{n}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpulist").write_text(cpus + "\n")
    g = root / "kernel" / "iommu_groups"
    g.mkdir(parents=True, exist_ok=True)
    for k in range(iommu_groups):
        (g / str(k)).mkdir(exist_ok=True)
    return root


def make_smi(path: Path, n_gpus: int = 8, topo: Optional[str] = TOPO_M) -> str:
    """An nvidia-smi script answering the queries the serving code makes."""
    bus = "\n".join(f"{i}, {BUS[i]}" for i in range(n_gpus))
    table = "\n".join(SMI_TABLE.splitlines()[:n_gpus])
    (path.parent / "smi_bus.txt").write_text(bus + "\n")
    (path.parent / "smi_table.txt").write_text(table + "\n")
    (path.parent / "smi_topo.txt").write_text(topo or "")
    d = path.parent
    path.write_text(f"""#!/bin/sh
case "$*" in
  *index,pci.bus_id*) cat "{d}/smi_bus.txt" ;;
  *index,name,compute_cap*) cat "{d}/smi_table.txt" ;;
  *query-gpu=name*) echo "NVIDIA RTX PRO 6000 Blackwell Server Edition" ;;
  "topo -m") cat "{d}/smi_topo.txt" ;;
  *) echo "unexpected: $*" >&2; exit 9 ;;
esac
""")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)
