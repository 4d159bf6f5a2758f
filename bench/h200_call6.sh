#!/usr/bin/env bash
# H200 call 6 (session 2, 2026-11-30): split-kernel launch sweep with the new combine (H=16 SWA128+c4, B=16/64/128),
# and MoE tile variants at M=16/64 with the DEQ 3 decode. ~3 min.
# Usage (repo root, device): OUT=/some/dir bash bench/h200_call6.sh   (carry .whl_attn)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/c6_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fm .whl_attn/sgl_flash_mla-*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/fm:$PWD/overlay
t0=$(date +%s)
VA="PART_BF16=1;waves=1;waves=4;num_warps=4;num_warps=4,num_stages=1;num_stages=1;BLOCK_N=32;min_blocks=2"
VA="$VA;PART_BF16=1,waves=4;maxnreg=0;num_warps=4,maxnreg=0;PREFETCH=1"
VM="BN1=64,BK1=128,BN2=128,BK2=128;stages=2;stages=4;warps1=8,warps2=8;BN1=32,BK1=256,BN2=64,BK2=256;BM=32"
IFS=';' read -ra A <<<"$VA"
for v in "${A[@]}"; do  # parallel compile warm-up, one process per variant
  timeout 120 python3 bench/bench_attention.py --layouts swa128+c4 --heads 16 --batches 16,128 --impls ours --layers 1 \
    --replays 1 --variants "$v" >/dev/null 2>&1 &
done
timeout 120 python3 bench/bench_moe.py --m 16 --no-baselines --no-check --variants "$VM" --variant-m 16,64 --reps 1 --rotate 1 \
  --out - >/dev/null 2>&1 &
wait
echo "warm $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
timeout 150 python3 bench/bench_attention.py --layouts swa128+c4 --heads 16 --batches 16,64,128 --replays 20 \
  --impls ours,flashmla --variants "$VA" --out "$OUT/attn_sweep" >"$OUT/attn.log" 2>&1
echo "attn rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
timeout 150 python3 bench/bench_moe.py --m 16 --no-baselines --no-check --variants "$VM" --variant-m 16,64 --reps 20 \
  --out "$OUT/moe_var.md" >"$OUT/moe.log" 2>&1
echo "moe rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
