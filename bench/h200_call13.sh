#!/usr/bin/env bash
# H200 call 13 (session 2, 2026-11-30): the MoE table under the final defaults (DEQ 3; inkernel grouping up to 32
# pairs, align kernel above; 64-wide w13 tile from 64 pairs), M = 1..1024, with the FP8 / bf16 baselines. ~1.5 min.
# Usage (repo root, device): OUT=/some/dir bash bench/h200_call13.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/overlay
OUT=${OUT:-/tmp/c13_out}
mkdir -p "$OUT"
t0=$(date +%s)
timeout 200 python3 bench/bench_moe.py --m 1,4,16,64,128,1024 --reps 20 --out "$OUT/moe_final.md" >"$OUT/moe.log" 2>&1
echo "moe rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
