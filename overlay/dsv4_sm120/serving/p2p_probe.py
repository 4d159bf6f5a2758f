"""Peer-to-peer probe: for each GPU pair, can CUDA peer access be enabled, and how fast does a short copy run.

Run by the serving preflight in the serving environment's python (torch needed, SGLang not):

  python -m dsv4_sm120.serving.p2p_probe --pairs 0:1,0:4 [--mib 64] [--staged]

GPU indices are nvidia-smi's (the probe sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and expects every GPU
visible). It prints one JSON line per event, flushed, so a caller that times out still knows which pair
hung: ``{"event": "start", "src", "dst"}`` before a copy and ``{"event": "pair", "src", "dst",
"can_access", "gbps", "ok", "error"}`` after it (``ok``: the destination holds exactly the source bytes).
``--staged`` adds one ``{"event": "staged", ...}`` per pair: the same copy bounced through pinned host
memory, what NCCL_P2P_DISABLE=1 / a P2P-less transfer costs. Exit 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import List, Optional, Tuple


def _emit(obj: dict) -> None:
    print(json.dumps(obj, sort_keys=True), flush=True)


def parse_pairs(text: str) -> List[Tuple[int, int]]:
    pairs = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        a, sep, b = part.partition(":")
        if not sep or not a.isdigit() or not b.isdigit():
            raise ValueError(f"bad pair {part!r}: expected SRC:DST GPU indices, e.g. 0:4")
        pairs.append((int(a), int(b)))
    if not pairs:
        raise ValueError("no pairs given")
    return pairs


def _time_copy(torch, dst, src, reps: int) -> float:
    """Seconds per copy (median of reps), timed with events on the destination's stream."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize(src.device)
        torch.cuda.synchronize(dst.device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(dst.device)
        torch.cuda.synchronize(src.device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def probe_pair(torch, a: int, b: int, nbytes: int, reps: int, staged: bool) -> List[dict]:
    out = []
    can = bool(torch.cuda.can_device_access_peer(a, b)) if a != b else True
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=f"cuda:{a}")
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{b}")
    try:
        sec = _time_copy(torch, dst, src, reps)   # cudaMemcpyPeerAsync under the hood (P2P, or staged by the driver)
        ok = bool(torch.equal(dst.cpu(), src.cpu()))
        out.append({"event": "pair", "src": a, "dst": b, "can_access": can, "gbps": round(nbytes / sec / 1e9, 2),
                    "ok": ok, "error": None, "bytes": nbytes})
    except RuntimeError as e:
        out.append({"event": "pair", "src": a, "dst": b, "can_access": can, "gbps": None, "ok": False,
                    "error": str(e).splitlines()[0], "bytes": nbytes})
    if staged:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        times = []
        for _ in range(reps):
            torch.cuda.synchronize(a)
            t0 = time.perf_counter()
            host.copy_(src, non_blocking=True)
            torch.cuda.synchronize(a)
            dst.copy_(host, non_blocking=True)
            torch.cuda.synchronize(b)
            times.append(time.perf_counter() - t0)
        times.sort()
        out.append({"event": "staged", "src": a, "dst": b, "gbps": round(nbytes / times[len(times) // 2] / 1e9, 2)})
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_sm120.serving.p2p_probe",
                                 description="CUDA peer access and peer-copy bandwidth per GPU pair (JSON lines).")
    ap.add_argument("--pairs", required=True, help="comma list of SRC:DST nvidia-smi GPU indices")
    ap.add_argument("--mib", type=int, default=64, help="bytes per copy, MiB (default 64)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--staged", action="store_true", help="also time the copy bounced through pinned host memory")
    a = ap.parse_args(argv)
    try:
        pairs = parse_pairs(a.pairs)
    except ValueError as e:
        print(f"p2p probe: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    try:
        import torch
    except ImportError:
        _emit({"event": "error", "error": "torch is not installed"})
        return 2
    if not torch.cuda.is_available():
        _emit({"event": "error", "error": "no CUDA device"})
        return 2
    n = torch.cuda.device_count()
    for s, d in pairs:
        if max(s, d) >= n:
            _emit({"event": "error", "error": f"GPU {max(s, d)} is not visible (CUDA sees {n})"})
            return 2
    for s, d in pairs:
        _emit({"event": "start", "src": s, "dst": d})
        for ev in probe_pair(torch, s, d, a.mib << 20, max(1, a.reps), a.staged):
            _emit(ev)
    _emit({"event": "done"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
