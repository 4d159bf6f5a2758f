"""What UCX (under NIXL) will do with KV pages: its version and the protocol it selects per memory type.

* Version: ``ucp_get_version_string()`` of the libucp the NIXL UCX plugin loaded (:func:`loaded_ucx_version`).
* Protocols: with ``UCX_PROTO_INFO=y`` UCX prints one table per operation when an endpoint is set up, e.g.
  ``remote memory write by ucp_put* from cuda/GPU0 to cuda`` followed by ``| Range | Description | Config |``
  rows (``0..inf | zero-copy | cuda_ipc/cuda``). :func:`parse_proto_info` reads them;
  :func:`judge_cuda_put` says whether GPU-to-GPU writes (SGLang's NIXL connector only WRITEs) take the
  direct ``cuda_ipc`` zero-copy path or something slower (a staging pipeline, host bounce, tcp).

UCX before PR #11865 (merged 2026-08-31; backported to v1.23.x as PR #11897) estimated RTX PRO 6000
Blackwell (compute capability 12.x, no NVLink) ``cuda_ipc`` bandwidth at 6911 MB/s, which can make its
protocol selection prefer a GPU-staging pipeline over ``cuda_ipc`` put zero-copy. ``UCX_CUDA_IPC_BW``
(the ``cuda_ipc`` transport's "effective p2p memory bandwidth", default ``auto``) sets the estimate by
hand in builds whose performance estimate reads it; the preflight re-runs the protocol probe with it to
see whether it restores the direct path on the box at hand.
"""

from __future__ import annotations

import ctypes
import re
from typing import Dict, List, Optional, Tuple

FIX_PR = "UCX PR #11865"
BW_OVERRIDE = "UCX_CUDA_IPC_BW=50GBs"
TITLE = re.compile(r"^\|?\s*(?P<op>.+?) from (?P<src>[\w/]+)(?: memory)? to (?P<dst>[\w/]+?)\s*\|?\s*$")


def parse_version(text: str) -> Optional[Tuple[int, int, int]]:
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def loaded_ucx_version() -> Optional[str]:
    """Version string of the libucp mapped into this process (after a NIXL UCX backend was created)."""
    try:
        maps = open("/proc/self/maps").read().splitlines()
    except OSError:
        return None
    paths = sorted({line.split()[-1] for line in maps if re.search(r"/libucp[-.][^/]*\.so", line)})
    for p in paths:
        try:
            lib = ctypes.CDLL(p)
            lib.ucp_get_version_string.restype = ctypes.c_char_p
            return lib.ucp_get_version_string().decode()
        except (OSError, AttributeError):
            continue
    return None


def _strip_prefix(line: str) -> str:
    # "[1796102267.245077] [host:27162:0]   | ... |" -> "| ... |"
    i = line.find("|")
    j = line.find("+")
    k = min(x for x in (i, j) if x >= 0) if (i >= 0 or j >= 0) else -1
    return line[k:].strip() if k >= 0 else ""


def parse_proto_info(text: str) -> List[dict]:
    """UCX_PROTO_INFO tables -> [{"op", "src", "dst", "header", "rows": [(range, description, config)]}]."""
    tables: List[dict] = []
    cur: Optional[dict] = None
    state = "out"
    for raw in text.splitlines():
        line = _strip_prefix(raw)
        if not line:
            continue
        if line.startswith("+"):
            if state == "rows" and cur is not None and cur["rows"]:
                tables.append(cur)
                cur, state = None, "out"
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if state == "out" and len(cells) == 1:
            cur, state = {"header": cells[0], "op": "", "src": "", "dst": "", "rows": []}, "title"
            continue
        if state == "title" and cur is not None and len(cells) == 1:
            m = TITLE.match(cells[0])
            if m:
                cur.update(op=m.group("op"), src=m.group("src"), dst=m.group("dst"))
            continue
        if state == "title" and cells[:1] == ["Range"]:
            state = "rows"
            continue
        if state == "rows" and cur is not None and len(cells) >= 3:
            cur["rows"].append((cells[0], cells[1], cells[-1]))
    return tables


def cuda_put_tables(tables: List[dict]) -> List[dict]:
    return [t for t in tables if t["op"].startswith("remote memory write by ucp_put")
            and t["src"].startswith("cuda") and t["dst"].startswith("cuda")]


def judge_cuda_put(tables: List[dict]) -> Tuple[Optional[bool], str]:
    """(direct?, what UCX selects) for GPU-to-GPU puts: True = cuda_ipc zero-copy for large messages,
    False = another path, None = no such table (the probe moved no GPU memory)."""
    puts = cuda_put_tables(tables)
    if not puts:
        return None, "no GPU-to-GPU put protocol in the UCX output"
    used = []
    direct = True
    for t in puts:
        big = t["rows"][-1] if t["rows"] else ("", "", "")
        used.append(f"{big[0]}: {big[1]} via {big[2]}")
        if not ("cuda_ipc" in big[2] and "zero-copy" in big[1] and "pipeline" not in big[1]):
            direct = False
    return direct, "; ".join(dict.fromkeys(used))


def version_note(version: Optional[str]) -> Tuple[str, str]:
    """(state, one line) for the UCX version NIXL uses: state ``old`` (predates the fix: warn), ``backport``
    (a v1.23.x build: has the fix if built after the backport; the protocol probe on a GPU box decides),
    ``fixed`` (1.24 and later) or ``unknown``."""
    v = parse_version(version or "")
    if v is None:
        return "unknown", "UCX version unknown (libucp not found in the NIXL process)"
    if v < (1, 23, 0):
        return "old", (f"UCX {version} predates {FIX_PR} (RTX PRO 6000 cuda_ipc bandwidth estimated at 6.9 GB/s, "
                       f"so UCX may stage KV through a pipeline instead of cuda_ipc zero-copy); try {BW_OVERRIDE} "
                       f"(the preflight's protocol probe shows whether it restores the direct path)")
    if v[:2] == (1, 23):
        return "backport", (f"UCX {version}: {FIX_PR} reached the v1.23.x branch as a backport (PR #11897); "
                            f"the GPU protocol probe shows whether this build selects cuda_ipc zero-copy")
    return "fixed", f"UCX {version} (after {FIX_PR})"


def transports(tables: List[dict]) -> Dict[str, List[str]]:
    """memory-type pair -> transports UCX configured for puts (for the preflight's report)."""
    out: Dict[str, List[str]] = {}
    for t in tables:
        if not t["op"].startswith("remote memory write by ucp_put"):
            continue
        key = f"{t['src'].split('/')[0]}->{t['dst'].split('/')[0]}"
        for _, _, cfg in t["rows"]:
            for tl in re.findall(r"([a-z_0-9]+)/", cfg):
                out.setdefault(key, [])
                if tl not in out[key]:
                    out[key].append(tl)
    return out
