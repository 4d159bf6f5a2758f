#!/usr/bin/env bash
# Nsight Compute profile of our attention split kernel, FlashMLA and our MoE GEMMs on the H200: where the
# time goes (speed of light, warp stall reasons, occupancy). One device call, ~3 min.
# Usage (repo root, device): OUT=/some/dir bash bench/ncu_h200.sh   (carry .whl_attn)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ncu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fm .whl_attn/sgl_flash_mla-*.whl >"$OUT/pip.log" 2>&1
export PYTHONPATH=/tmp/fm:$PWD/overlay
SEC="--section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section SchedulerStats --section ComputeWorkloadAnalysis"
NCU="ncu --clock-control none $SEC"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/gpu.txt" 2>&1
t0=$(date +%s)
run() {  # name, kernel regex, count, command...
  local name=$1 rx=$2 cnt=$3; shift 3
  timeout 200 $NCU -k "regex:$rx" -c "$cnt" "$@" >"$OUT/$name.txt" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
}
A="bench/bench_attention.py --layouts swa128+c4 --heads 16 --layers 1 --replays 1 --torch-max-batch 0 --upstream-max-batch 0"
run attn_b128 '_dsv4_split|_dsv4_combine' 2 python3 $A --impls ours --batches 128 &
run attn_b1 '_dsv4_split|_dsv4_combine' 2 python3 $A --impls ours --batches 1 &
run fmla_b128 'flash|mla|combine' 3 python3 $A --impls flashmla --batches 128 &
run moe_m64 '_gemm1|_gemm2|_align|_reduce' 4 python3 bench/bench_moe.py --m 64 --no-baselines --rotate 1 --reps 1 --no-check &
run moe_m1 '_gemm1|_gemm2|_align|_reduce' 4 python3 bench/bench_moe.py --m 1 --no-baselines --rotate 1 --reps 1 --no-check &
wait
echo "end $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
