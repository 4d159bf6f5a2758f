#!/usr/bin/env bash
# H200 call (2026-11-30, session 2): GPU tests of the new MoE decodes (DEQ 3 shift decode, DEQ 4 natural-K order)
# and the in-kernel grouping, then the MoE table with the variants. ~6 min on a cold H200.
# Usage (repo root, device): OUT=/some/dir bash bench/moe_h200_call4.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/overlay
OUT=${OUT:-/tmp/moe_out}
mkdir -p "$OUT"
t0=$(date +%s)
V="deq=2,align=triton;deq=2;deq=3;deq=4;deq=3,stages=4;deq=3,align=triton;deq=3,BN1=32,BN2=64;deq=4,BN1=32,BN2=64"
# warm the compile cache for every variant while the tests run (timings come later, alone on the GPU)
timeout 240 python3 bench/bench_moe.py --m 1,64 --deq 3 --variants "$V" --variant-m 1,4,16,64 --reps 1 --rotate 1 \
  --no-baselines --no-check --out - >"$OUT/warm.log" 2>&1 &
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_gpu.py -k "deq2 or deq3 or deq4 or graph or exact" \
  >"$OUT/pytest.log" 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
wait
echo "warm $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
timeout 300 python3 bench/bench_moe.py --m 1,4,16,64,128,1024 --deq 3 --variants "$V" --variant-m 1,4,16,64 --reps 20 \
  --out "$OUT/moe.md" >"$OUT/bench.log" 2>&1
echo "bench rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
