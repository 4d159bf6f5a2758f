#!/usr/bin/env bash
# H200 call 11 (session 2, 2026-11-30): first timing of the opt-in impl=wg split body (candidates on the MMA M
# dimension, wgmma) against the default tiled body and FlashMLA, H=16 SWA128+c4, B=16/64/128 (the bench checks every
# row against float64). ~1.5 min.
# Usage (repo root, device): OUT=/some/dir bash bench/h200_call11.sh   (carry .whl_attn)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/c11_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fm .whl_attn/sgl_flash_mla-*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/fm:$PWD/overlay
t0=$(date +%s)
W="impl=wg,num_warps=4,maxnreg=0,num_stages=1"
VA="$W;$W,PART_BF16=1;impl=wg,num_warps=4,maxnreg=0,num_stages=2,PART_BF16=1;$W,PART_BF16=1,waves=2;impl=wg,num_warps=4,maxnreg=168,num_stages=1,PART_BF16=1"
IFS=';' read -ra A <<<"$VA"
for v in "${A[@]}"; do
  timeout 150 python3 bench/bench_attention.py --layouts swa128+c4 --heads 16 --batches 16,128 --impls ours --layers 1 \
    --replays 1 --variants "$v" >/dev/null 2>&1 &
done
wait
echo "warm $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
timeout 150 python3 bench/bench_attention.py --layouts swa128+c4 --heads 16 --batches 1,16,64,128 --replays 20 \
  --impls ours,flashmla --variants "$VA" --out "$OUT/attn_wg" >"$OUT/attn.log" 2>&1
echo "attn rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
