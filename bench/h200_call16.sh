#!/usr/bin/env bash
# H200 call 16 (session 4, 2026-11-30): the register body (impl=reg) against the new defaults.
# Why: call 15's ncu of the B=128 split kernel (tiled, two stages) showed 112 LDS.U8 per thread and block (the PV
# operand read back one byte per instruction from the cp.async copy), each K tile staged twice (QK and the PV
# re-read), 21% of the stall samples on the LSU queue (lg_throttle) and 16% issuing. impl=reg reads and decodes each
# K byte once per block into registers (next block loaded while the current computes, indices two blocks ahead), no
# cp.async: sm_90 loop 1141 instructions per block vs 1781, 234 registers, no stack (CPU SASS, triton 3.6).
# Expectations (before the call): impl=reg 20-35% faster than the default at B = 64/128 (~32 / ~50 us), within 10% at
# B <= 16 (one block per program there, so nothing to prefetch; 1 CTA per SM); BLOCK_N=32 variants slower
# (769 instructions per 32 candidates); KCVT=0 slower by ~5%. The maxnreg=128 row re-measures the old cap (default
# now drops it at two stages: expect the default ~3% faster at B >= 64). impl=reg GPU tests (bf16 subset) pass.
# Usage (repo root, device): OUT=/some/dir bash bench/h200_call16.sh   (carry .whl_attn)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/c16_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fm .whl_attn/sgl_flash_mla-*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/fm:$PWD/overlay
t0=$(date +%s)
VA="impl=reg;impl=reg,waves=2;impl=reg,waves=4;impl=reg,BLOCK_N=32;impl=reg,BLOCK_N=32,maxnreg=128;impl=reg,KCVT=0;maxnreg=128"
IFS=';' read -ra A <<<"$VA"
for v in "${A[@]}"; do  # warm the Triton cache for every variant in parallel
  timeout 200 python3 bench/bench_attention.py --layouts swa128+c4 --heads 16 --batches 16,128 --impls ours --layers 1 \
    --replays 1 --variants "$v" >/dev/null 2>&1 &
done
DSV4_ATTN_TEST_CONFIG='impl=reg' timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention_gpu.py \
  -k "bf16" >"$OUT/pytest_reg.log" 2>&1 &
wait
{ echo "tests+warm $(( $(date +%s) - t0 ))s"; tail -3 "$OUT/pytest_reg.log"; } >>"$OUT/times.txt"
timeout 200 python3 bench/bench_attention.py --layouts swa128+c4 --heads 16 --batches 1,4,16,64,128 --replays 20 \
  --impls ours,flashmla --variants "$VA" --out "$OUT/attn_sweep" >"$OUT/attn.log" 2>&1
echo "attn rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
