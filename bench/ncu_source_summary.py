#!/usr/bin/env python3
"""Summarize an Nsight Compute source-page export (``ncu -i R.ncu-rep --page source --csv --print-source sass``):
stall samples and executed instructions per opcode (with and without suffixes), and the stall-reason mix.

  python3 bench/ncu_source_summary.py bench/results/ncu_h200_call15_attn_b128_sass.csv.gz --blocks 1280

``--blocks N`` also divides the executed-instruction counts by N (e.g. the candidate blocks the kernel ran:
B=128 rows x 10 blocks of 64 for SWA128+c4), giving per-block figures for all warps of a CTA."""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import sys


def _open(path: str):
    return gzip.open(path, "rt") if path.endswith(".gz") else open(path, newline="")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="source-page CSV export (optionally .gz)")
    p.add_argument("--blocks", type=int, default=0, help="divide executed counts by this many blocks")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    with _open(args.csv) as f:
        rows = list(csv.reader(f))
    hdr_i = next((i for i, r in enumerate(rows) if "Source" in r and "Warp Stall Sampling (All Samples)" in r), None)
    if hdr_i is None:
        print(f"{args.csv}: no source-page header (Source, Warp Stall Sampling) found", file=sys.stderr)
        return 2
    hdr = rows[hdr_i]
    ix = {h: i for i, h in enumerate(hdr)}
    data = [r for r in rows[hdr_i + 1:] if len(r) == len(hdr)]
    samples_col = "Warp Stall Sampling (All Samples)"
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(int(r[ix[samples_col]] or 0) for r in data) or 1
    by_op, by_full, executed = collections.Counter(), collections.Counter(), collections.Counter()
    op_reasons = collections.defaultdict(collections.Counter)
    for r in data:
        words = r[ix["Source"]].split()
        if not words:
            continue
        full = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        op = full.split(".")[0]
        by_op[op] += int(r[ix[samples_col]] or 0)
        n = int(r[ix["Instructions Executed"]] or 0)
        executed[op] += n
        by_full[full.rstrip(",;")] += n
        for h in reasons:
            op_reasons[op][h] += int(r[ix[h]] or 0)
    print(f"{len(data)} SASS lines, {total} stall samples")
    print(f"{'opcode':10s} {'samples':>8s} {'executed':>10s}  top stall reasons (% of all samples)")
    for op, v in by_op.most_common(args.top):
        top = ", ".join(f"{k[6:]}={100 * c / total:.1f}" for k, c in op_reasons[op].most_common(3))
        print(f"{op:10s} {100 * v / total:7.1f}% {executed[op]:10d}  {top}")
    mix = collections.Counter()
    for c in op_reasons.values():
        mix.update(c)
    print("stall mix: " + ", ".join(f"{k[6:]} {100 * v / total:.1f}%" for k, v in mix.most_common(12)))
    if args.blocks:
        print(f"memory / shared / barrier instructions per block (all warps), {args.blocks} blocks:")
        for k, v in by_full.most_common():
            if k.startswith(("LDG", "LDS", "STS", "BAR", "HMMA")):
                print(f"  {k:28s} {v / args.blocks:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
