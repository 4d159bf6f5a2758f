#!/usr/bin/env bash
# H200 call 15 (session 4, 2026-11-30): after call 14 made KCVT=1 the default (and PREFETCH=2 from a third of the
# SMs in grid rows), find out where the B = 128 split kernel's time goes and whether occupancy moves it.
# Expectations (written before the call):
#   - the whole attention GPU test file passes under the new defaults (88 tests, as call 7);
#   - ncu, B = 128 H = 16 SWA128+c4 split kernel: issue-active ~25%; stalls mostly barrier, long scoreboard
#     (global/L1 gathers and the PV re-reads) and short scoreboard (shared-memory layout conversions); 1 CTA per
#     SM (160 KB of shared memory with two stages). FlashMLA's kernel for comparison.
#   - sweep at B = 16/64/128 (new default = KCVT=1 + PREFETCH=2 at B >= 44): default 15.9 / 42.2 / 69.2 us (call
#     14) within 2%; maxnreg=0 (1 CTA per SM anyway at two stages) 0-10% faster at B >= 64; num_stages=1 (2 CTAs
#     by registers, no cp.async staging) slower at B >= 64 (call 4); BLOCK_N=32 with 2-3 stages (~80-120 KB: 2 or
#     1 CTAs) unknown, +-15%; waves=2 slower at B = 128 (call 6).
# Usage (repo root, device): OUT=/some/dir bash bench/h200_call15.sh   (carry .whl_attn)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/c15_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fm .whl_attn/sgl_flash_mla-*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/fm:$PWD/overlay
t0=$(date +%s)
VA="maxnreg=0;num_stages=1;BLOCK_N=32,num_stages=2;BLOCK_N=32,num_stages=3;BLOCK_N=32,num_stages=2,maxnreg=0"
VA="$VA;num_warps=4,BLOCK_N=32,num_stages=2;num_warps=4,maxnreg=0;waves=2;waves=2,num_stages=1;waves=2,maxnreg=0"
IFS=';' read -ra A <<<"$VA"
for v in "${A[@]}"; do  # warm the Triton cache for every variant in parallel
  timeout 200 python3 bench/bench_attention.py --layouts swa128+c4 --heads 16 --batches 16,128 --impls ours --layers 1 \
    --replays 1 --variants "$v" >/dev/null 2>&1 &
done
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention_gpu.py >"$OUT/pytest_attn.log" 2>&1 &
wait
{ echo "tests+warm $(( $(date +%s) - t0 ))s"; tail -1 "$OUT/pytest_attn.log"; } >>"$OUT/times.txt"
# where the B=128 split kernel's time goes (stall reasons per SASS line), and FlashMLA's stall mix
A1="bench/bench_attention.py --layouts swa128+c4 --heads 16 --layers 1 --replays 1 --torch-max-batch 0 --upstream-max-batch 0 --batches 128"
SEC="--section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SourceCounters --section MemoryWorkloadAnalysis"
timeout 150 ncu --clock-control none $SEC -k regex:_dsv4_split -c 1 -o /tmp/attn_b128 python3 $A1 --impls ours >"$OUT/ncu_run.log" 2>&1
echo "ncu ours rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
timeout 100 ncu --clock-control none --section WarpStateStats --section SpeedOfLight --section Occupancy \
  -k regex:sparse -c 1 -o /tmp/fmla_b128 python3 $A1 --impls flashmla >>"$OUT/ncu_run.log" 2>&1
echo "ncu fmla rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
for r in attn_b128 fmla_b128; do
  ncu -i /tmp/$r.ncu-rep --page details >"$OUT/${r}_details.txt" 2>&1
  ncu -i /tmp/$r.ncu-rep --page raw --csv 2>/dev/null | python3 -c "
import csv,sys
rows=list(csv.reader(sys.stdin))
for k,v in zip(rows[0],rows[-1]):
    if 'stall' in k or 'warps_active' in k or 'issue_active' in k or 'inst_executed' in k: print(k, v)" >"$OUT/${r}_stalls.txt" 2>&1
done
ncu -i /tmp/attn_b128.ncu-rep --page source --csv --print-source sass >"$OUT/attn_b128_sass.csv" 2>&1
echo "ncu export $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
timeout 200 python3 bench/bench_attention.py --layouts swa128+c4 --heads 16 --batches 16,64,128 --replays 20 \
  --impls ours,flashmla --variants "$VA" --out "$OUT/attn_sweep" >"$OUT/attn.log" 2>&1
echo "attn rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
