#!/usr/bin/env bash
# H200 call 8 (session 2, 2026-11-30): last split-plan sweep around the call-7 defaults at B=16/64/128 (H=16
# SWA128+c4), where B=64 is 5% behind FlashMLA. ~1.5 min.
# Usage (repo root, device): OUT=/some/dir bash bench/h200_call8.sh   (carry .whl_attn)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/c8_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fm .whl_attn/sgl_flash_mla-*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/fm:$PWD/overlay
t0=$(date +%s)
VA="PREFETCH=1;waves=2;waves=3;waves=6;waves=8;PREFETCH=1,waves=6;num_stages=3;min_blocks=2;waves=6,min_blocks=2;waves=8,min_blocks=2"
IFS=';' read -ra A <<<"$VA"
for v in "${A[@]}"; do
  timeout 120 python3 bench/bench_attention.py --layouts swa128+c4 --heads 16 --batches 64,128 --impls ours --layers 1 \
    --replays 1 --variants "$v" >/dev/null 2>&1 &
done
wait
echo "warm $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
timeout 150 python3 bench/bench_attention.py --layouts swa128+c4 --heads 16 --batches 16,64,128 --replays 20 \
  --impls ours,flashmla --variants "$VA" --out "$OUT/attn_sweep" >"$OUT/attn.log" 2>&1
echo "attn rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
