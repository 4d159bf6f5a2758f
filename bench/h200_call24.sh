#!/usr/bin/env bash
# H200 call 24 (session 5, 2026-11-30): the new register-body launch at H = 64 (TP1-like head counts; outside the
# issue's target, ~3x behind FlashMLA from B = 16 in call 23). 16-row head groups (HG = 4 programs per row and split),
# 32-candidate blocks on 4 warps, DEC_LATE, Q_RES, SPAN with the head groups counted as rows of the plan.
# Expectations (before the call): faster than the current H = 64 defaults (10.9 / 14.4 / 43.2 / 135.5 / 149.9 us at
# SWA128+c4) where the grid is small (B <= 16: ~8 / ~10 / ~25 us); at B = 128 each K byte is gathered by 4 head
# groups (L2 absorbs part of it): about the same or slower than 149.9. Correctness: the sweep's rel_err vs float64.
# Usage (repo root, device): OUT=/some/dir bash bench/h200_call24.sh   (carry .whl_attn)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/c24_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fm .whl_attn/sgl_flash_mla-*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/fm:$PWD/overlay
t0=$(date +%s)
R="impl=reg,BLOCK_H=16,BLOCK_N=32,num_warps=4,Q_RES=1,DEC_LATE=1,SPAN=1,PART_BF16=1"
VA="$R,waves=2;$R,waves=4;impl=reg,BLOCK_H=16,BLOCK_N=64,num_warps=8,Q_RES=1,DEC_LATE=1,SPAN=1,PART_BF16=1,waves=1"
IFS=';' read -ra VS <<<"$VA"
WP=()
for l in swa128+c4 single512; do for v in "" "${VS[@]}"; do  # warm the Triton cache
  timeout 200 python3 bench/bench_attention.py --layouts $l --heads 64 --batches 1,4,16,64,128 --impls ours \
    --layers 1 --replays 1 --variant-heads 64 --variant-layouts $l ${v:+--variants "$v"} >/dev/null 2>&1 &
  WP+=($!)
done; done
wait "${WP[@]}"
echo "warm $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
timeout 150 python3 bench/bench_attention.py --layouts swa128+c4,single512 --heads 64 --batches 1,4,16,64,128 \
  --replays 20 --impls ours,flashmla --variant-heads 64 --variant-layouts swa128+c4,single512 --variants "$VA" \
  --out "$OUT/h64" >"$OUT/attn.log" 2>&1
echo "attn rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
