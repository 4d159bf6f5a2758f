#!/usr/bin/env bash
# H200 call 10 (session 2, 2026-11-30): MoE decode tile variants (DEQ 3 defaults) at M=1/4/16, where M=16 ties the
# FP8 baseline. ~1.5 min.
# Usage (repo root, device): OUT=/some/dir bash bench/h200_call10.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/overlay
OUT=${OUT:-/tmp/c10_out}
mkdir -p "$OUT"
t0=$(date +%s)
VM="BN1=16;BN2=32;BN1=16,BN2=32;BK1=512;BK2=512;BK1=512,BK2=512;BN1=64,BK1=256;BN1=16,BK1=512;stages=2"
IFS=';' read -ra A <<<"$VM"
for v in "${A[@]}"; do
  timeout 120 python3 bench/bench_moe.py --m 16 --no-baselines --no-check --variants "$v" --variant-m 1,4,16 --reps 1 \
    --rotate 1 --out - >/dev/null 2>&1 &
done
wait
echo "warm $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
timeout 200 python3 bench/bench_moe.py --m 16 --no-check --variants "$VM" --variant-m 1,4,16 --reps 20 \
  --out "$OUT/moe_var.md" >"$OUT/moe.log" 2>&1
echo "moe rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
