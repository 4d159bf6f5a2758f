#!/usr/bin/env bash
# One device call (H200): correctness of every split-kernel variant on the GPU, then the timing sweep
# (all variants + FlashMLA) at H=16 SWA128+c4 and H=64, then a per-kernel profile. Results under $OUT.
# Usage (from the repo root, on the device): OUT=/some/dir bash bench/attention_h200_call4.sh
# (this is the script of call 4 as it ran; results: bench/results/attention_h200_call4_*)
# Needs .whl_attn/sgl_flash_mla-*.whl (carried) for the FlashMLA baseline.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/attn_out}
mkdir -p "$OUT" /tmp/logs
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fm .whl_attn/sgl_flash_mla-*.whl \
  >/tmp/logs/pip.log 2>&1 || echo "flash_mla wheel did not install" >>/tmp/logs/pip.log
export PYTHONPATH=/tmp/fm:$PWD/overlay
UP="--upstream-file .whl_attn/flash_mla_sm120_triton.py --sglang-sm120-file .whl_attn/flash_mla_sm120.py"
# H=16 variants (keys of kernel._default_config); the bench always adds the current default first
P=impl=pipe
V16="impl=flat;PREFETCH=1;BLOCK_S=16;num_stages=2"
V16="$V16;$P,NUM_STAGES=2,maxnreg=0;$P,NUM_STAGES=3,maxnreg=0;$P,NUM_STAGES=2,BLOCK_N=32,maxnreg=0"
V16="$V16;$P,NUM_STAGES=3,BLOCK_N=32,num_warps=4,maxnreg=0;$P,NUM_STAGES=2,PART_BF16=1,maxnreg=0"
V16="$V16;$P,NUM_STAGES=2,BLOCK_N=32,PV_RELOAD=1,maxnreg=128;$P,NUM_STAGES=3,BLOCK_N=32,PV_RELOAD=1,maxnreg=128"
V16="$V16;$P,NUM_STAGES=2,PV_RELOAD=1,maxnreg=128;$P,NUM_STAGES=2,BLOCK_N=32,PV_RELOAD=1,maxnreg=128,PART_BF16=1,BLOCK_S=16"
V16="$V16;$P,NUM_STAGES=2,BLOCK_N=32,PV_RELOAD=1,maxnreg=128,waves=1;$P,NUM_STAGES=2,BLOCK_N=32,PV_RELOAD=1,maxnreg=128,waves=4"
V16="$V16;$P,NUM_STAGES=2,maxnreg=0,waves=1;$P,NUM_STAGES=2,BLOCK_N=16,PV_RELOAD=1,maxnreg=128"
V64="impl=flat;$P,BLOCK_H=16,BLOCK_N=64,NUM_STAGES=2,maxnreg=0;$P,BLOCK_H=16,BLOCK_N=32,NUM_STAGES=2,PV_RELOAD=1,maxnreg=128"
V64="$V64;impl=tiled,BLOCK_H=16,BLOCK_N=64,maxnreg=128;$P,BLOCK_H=32,BLOCK_N=32,NUM_STAGES=2,PV_RELOAD=1;$P,BLOCK_H=32,BLOCK_N=32,NUM_STAGES=2"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv >/tmp/logs/smi.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >>/tmp/logs/smi.txt 2>&1

# phase 1 (parallel): compile every variant (warm Triton's cache, check errors vs float64 per point) and run
# the GPU correctness tests under the main candidate configurations
t0=$(date +%s)
i=0
IFS=';' read -ra A16 <<<"$V16"
for v in "${A16[@]}"; do
  i=$((i+1))
  timeout 70 python3 bench/bench_attention.py --layouts swa128+c4 --heads 16 --impls ours --layers 1 --replays 1 \
    --variants "$v" >/tmp/logs/warm16_$i.log 2>&1 &
done
IFS=';' read -ra A64 <<<"$V64"
for v in "${A64[@]}"; do
  i=$((i+1))
  timeout 70 python3 bench/bench_attention.py --layouts swa128+c4 --heads 64 --impls ours --layers 1 --replays 1 \
    --batches 1,16,128 --variants "$v" >/tmp/logs/warm64_$i.log 2>&1 &
done
for cfg in "$P,NUM_STAGES=2,maxnreg=0" "$P,NUM_STAGES=2,BLOCK_N=32,PV_RELOAD=1,maxnreg=128,PART_BF16=1,BLOCK_S=16"; do
  i=$((i+1))
  DSV4_ATTN_TEST_CONFIG="$cfg" timeout 70 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_attention_gpu.py \
    -k "variants or odd_pages or graph" >/tmp/logs/pytest_$i.log 2>&1 &
done
DSV4_ATTN_TEST_CONFIG="$P,NUM_STAGES=2,BLOCK_H=16,BLOCK_N=32,PV_RELOAD=1,maxnreg=128" timeout 70 python3 -m pytest -q -p no:cacheprovider \
  tests/gpu/test_attention_gpu.py -k "matrix and bf16" >/tmp/logs/pytest_matrix.log 2>&1 &
wait
echo "phase1 $(( $(date +%s) - t0 ))s" >>/tmp/logs/smi.txt
tar czf "$OUT/logs.tgz" -C /tmp logs

# phase 2: timing, one process at a time
timeout 55 python3 bench/bench_attention.py --layouts swa128+c4 --heads 16 --replays 10 --impls ours,flashmla,upstream \
  --upstream-max-batch 1 $UP --variants "$V16" --out "$OUT/h16" >/tmp/logs/h16.log 2>&1
echo "phase2 $(( $(date +%s) - t0 ))s" >>/tmp/logs/smi.txt
timeout 25 python3 bench/bench_attention.py --layouts swa128+c4 --heads 64 --batches 1,16,128 --replays 10 \
  --impls ours,flashmla --variants "$V64" --out "$OUT/h64" >/tmp/logs/h64.log 2>&1
echo "phase3 $(( $(date +%s) - t0 ))s" >>/tmp/logs/smi.txt
tar czf "$OUT/logs.tgz" -C /tmp logs
