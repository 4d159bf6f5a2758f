#!/usr/bin/env python3
"""Summarise torch-profiler (Chrome) traces: GPU time by kernel and by group, and the largest bottleneck.

    python bench/profile_summary.py TRACE [TRACE ...] [--top 15] [--json OUT.json]
    python bench/profile_summary.py RUN_DIR/profile/      # every *.trace.json[.gz] in a directory

Works offline on any trace file (``.json`` or ``.json.gz``; SGLang writes one per TP rank,
``<profile_id>-TP-<rank>.trace.json.gz``). GPU events are the ``X`` events of category
``kernel``, ``gpu_memcpy`` and ``gpu_memset``. Groups (first matching rule wins):

  communication      NCCL / custom all-reduce / all-gather / all-to-all kernels
  sparse attention   sparse MLA decode (FlashMLA, FlashInfer, dsv4_sm120, Triton fallback), the indexer
  MoE                routed experts: fused MoE GEMMs, routing/top-k, align/sort, FP4 kernels
  dense GEMM         other matmuls: cuBLAS/CUTLASS/nvjet/xmma, FP8 block GEMMs, Triton matmuls
  norm/rope/other    everything else (norms, rope, activations, copies, sampling, ...)

Shares are of the summed kernel time; "GPU idle" is the part of each rank's traced window
(first kernel start to last kernel end) with no kernel running on any stream. The last line
names the largest remaining bottleneck: the biggest group, or GPU idle time when that is larger.
Exit codes: 0 ok, 1 no GPU kernels in the traces, 2 unreadable input.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from dsv4_sm120.fileio import atomic_write_text

GROUPS = ("sparse attention", "MoE", "dense GEMM", "communication", "norm/rope/other")
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}

RULES: List[Tuple[str, "re.Pattern[str]"]] = [
    ("communication", re.compile(
        r"nccl|all_?reduce|all_?gather|reduce_?scatter|cross_device_reduce|custom_?ar\b|alltoall|all_to_all|"
        r"deep_?ep|one_?shot_?(all)?reduce|two_?shot|mscclpp|quick_?ar|symm_?mem", re.I)),
    ("sparse attention", re.compile(
        r"flash_?mla|flash_fwd|splitkv|mla_kernel|sparse_?mla|sparse.?decode|sparse_?attn|mla_?decode|"
        r"_dsv4_(split|combine)_kernel|^(split_kernel_(flat|tiled|reg)|combine_kernel|_?q_fp8_kernel)$|"
        r"tiled_sparse|sm120.*(attn|mla)|indexer|mqa_logits|lightning|flash_?attn|fmha|paged_?attention|"
        r"batch_?(decode|prefill)|single_?(decode|prefill)|merge_?state|attention", re.I)),
    ("MoE", re.compile(
        r"moe|expert|grouped_?gemm|group_?gemm|mxfp4|nvfp4|e2m1|fp4|topk_?softmax|topk_?sigmoid|"
        r"biased_?grouped_?topk|grouped_?topk|routing|router|marlin|humming|"
        r"^_(align|gemm1|gemm2|reduce|quant_rows)_kernel$", re.I)),
    ("dense GEMM", re.compile(
        r"gemm|matmul|gemv|sgemm|hgemm|cutlass|cublas|nvjet|xmma|wgmma|hmma|w8a8|_mm_|\bmm_|bmm|"
        r"splitk|deep_?gemm|fp8_blockwise|scaled_mm|linear", re.I)),
]


class TraceError(Exception):
    pass


def classify(name: str) -> str:
    for group, rx in RULES:
        if rx.search(name):
            return group
    return "norm/rope/other"


def load_events(path: Path) -> list:
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        data = json.loads(raw)
    except (OSError, ValueError, EOFError) as e:
        raise TraceError(f"{path}: not a readable JSON trace ({type(e).__name__}: {e})")
    if isinstance(data, dict):
        ev = data.get("traceEvents")
    elif isinstance(data, list):
        ev = data
    else:
        ev = None
    if not isinstance(ev, list):
        raise TraceError(f"{path}: no traceEvents list (not a Chrome/torch-profiler trace)")
    return ev


def gpu_kernels(events: Iterable[dict]) -> List[Tuple[str, float, float]]:
    """(name, ts_us, dur_us) of the GPU events."""
    out = []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or e.get("cat") not in GPU_CATS:
            continue
        try:
            ts, dur = float(e["ts"]), float(e.get("dur", 0))
        except (KeyError, TypeError, ValueError):
            continue
        if dur < 0:
            continue
        out.append((str(e.get("name", "?")), ts, dur))
    return out


def busy_time(intervals: List[Tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def summarise(paths: List[Path], top: int = 15) -> dict:
    per_kernel: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0])
    group_us: Dict[str, float] = {g: 0.0 for g in GROUPS}
    window_us = busy_us = 0.0
    files = []
    for p in paths:
        ks = gpu_kernels(load_events(p))
        files.append({"file": str(p), "kernels": len(ks)})
        if not ks:
            continue
        for name, _ts, dur in ks:
            per_kernel[name][0] += dur
            per_kernel[name][1] += 1
            group_us[classify(name)] += dur
        window_us += max(t + d for _, t, d in ks) - min(t for _, t, _ in ks)
        busy_us += busy_time([(t, t + d) for _, t, d in ks])
    total = sum(group_us.values())
    if total <= 0:
        raise TraceError("no GPU kernel events in " + ", ".join(str(p) for p in paths)
                         + " (was the profile captured with activities GPU?)")
    kernels = sorted(((n, us, c) for n, (us, c) in per_kernel.items()), key=lambda x: -x[1])
    groups = sorted(({"group": g, "us": us, "share": us / total,
                      "top_kernel": next((n for n, _, _ in kernels if classify(n) == g), None)}
                     for g, us in group_us.items()), key=lambda x: -x["us"])
    idle_us = max(window_us - busy_us, 0.0)
    big = groups[0]
    if idle_us > big["us"]:
        bottleneck = (f"GPU idle between kernels: {100 * idle_us / window_us:.1f}% of the traced window "
                      f"(host/launch overhead or synchronisation) exceeds the largest group, "
                      f"{big['group']} ({100 * big['share']:.1f}% of kernel time)")
        kind = "idle"
    else:
        bottleneck = (f"{big['group']}: {100 * big['share']:.1f}% of GPU kernel time"
                      + (f", led by {big['top_kernel']}" if big["top_kernel"] else ""))
        kind = big["group"]
    return {
        "files": files,
        "total_kernel_us": total,
        "window_us": window_us,
        "busy_us": busy_us,
        "idle_us": idle_us,
        "idle_share_of_window": idle_us / window_us if window_us else 0.0,
        "groups": groups,
        "top_kernels": [{"name": n, "us": us, "count": c, "share": us / total, "group": classify(n)}
                        for n, us, c in kernels[:top]],
        "distinct_kernels": len(kernels),
        "bottleneck": bottleneck,
        "bottleneck_kind": kind,
    }


def _short(name: str, n: int = 90) -> str:
    return name if len(name) <= n else name[:n - 3] + "..."


def render(s: dict) -> str:
    lines = [f"GPU kernel time {s['total_kernel_us'] / 1e3:.2f} ms over {len(s['files'])} trace file(s), "
             f"{s['distinct_kernels']} distinct kernels; GPU idle {100 * s['idle_share_of_window']:.1f}% of the window",
             "", f"{'group':<18} {'ms':>10} {'share':>7}  top kernel"]
    for g in s["groups"]:
        lines.append(f"{g['group']:<18} {g['us'] / 1e3:>10.3f} {100 * g['share']:>6.1f}%  {_short(g['top_kernel'] or '-', 70)}")
    lines += ["", f"{'top kernels':<92} {'ms':>9} {'calls':>7} {'share':>7}  group"]
    for k in s["top_kernels"]:
        lines.append(f"{_short(k['name']):<92} {k['us'] / 1e3:>9.3f} {k['count']:>7} {100 * k['share']:>6.1f}%  {k['group']}")
    lines += ["", f"largest remaining bottleneck: {s['bottleneck']}"]
    return "\n".join(lines)


def expand(inputs: List[str]) -> List[Path]:
    out = []
    for x in inputs:
        p = Path(x)
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.is_file() and (q.name.endswith(".json") or q.name.endswith(".json.gz")))
            if not found:
                raise TraceError(f"{p}: no *.json / *.json.gz trace files in the directory")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise TraceError(f"{p}: no such file or directory")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Groups and rules: see the module docstring (bench/profile_summary.py).")
    ap.add_argument("traces", nargs="+", help="trace files (.json / .json.gz) or directories holding them")
    ap.add_argument("--top", type=int, default=15, help="kernels listed (default 15)")
    ap.add_argument("--json", type=Path, help="also write the summary as JSON here")
    a = ap.parse_args(argv)
    try:
        s = summarise(expand(a.traces), top=a.top)
    except TraceError as e:
        print(f"profile_summary: {e}", file=sys.stderr)
        return 1 if "no GPU kernel events" in str(e) else 2
    print(render(s))
    if a.json:
        atomic_write_text(a.json, json.dumps(s, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
