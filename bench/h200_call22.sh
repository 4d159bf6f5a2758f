#!/usr/bin/env bash
# H200 call 22 (session 5, 2026-11-30): spanning splits (SPAN=1) for the register body.
# Call 21 showed DEC_LATE=1 cut the loop to 805 instructions but barely moved SWA128+c4 B = 128 (51.1 vs 51.5 us):
# the time is in the split plan, not the loop. Main (128) and extra (512) candidates were split separately, so at
# B = 128 one program per row owned all 512 c4 candidates while the SWA programs finished early; single-512, whose
# splits are even, reached 36.8 us with 4-warp 32-candidate programs (two CTAs per SM) against FlashMLA's 39.8.
# SPAN=1 cuts main ++ extra into equal whole-block chunks, as many per row as fill the GPU's program slots in one
# round (waves = CTAs per SM): B = 128 -> 2 programs of 320 candidates per row, 256 programs in 264 slots.
# CPU SASS (sm_90, triton 3.6): BN32 4 warps 236 registers, 853 instructions per block, no stack.
# Expectations (before the call): SWA128+c4 B = 128 42-47 us with SPAN, BN32, 4 warps, waves=2 (against 51.1 and
# FlashMLA's 46.2); B = 64 ~25 us (30.0 best in call 21); B = 16 10-12 us; B = 1 / 4 ~7.5. single-512 about as call
# 21's best (its splits were already even). GPU tests: the bf16 half under that config and the new variant rows pass.
# Usage (repo root, device): OUT=/some/dir bash bench/h200_call22.sh   (carry .whl_attn)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/c22_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fm .whl_attn/sgl_flash_mla-*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/fm:$PWD/overlay
t0=$(date +%s)
R="impl=reg,Q_RES=1,DEC_LATE=1"
VA="$R,SPAN=1,BLOCK_N=32,num_warps=4,waves=2;$R,SPAN=1,BLOCK_N=32,num_warps=4,waves=4;$R,SPAN=1,BLOCK_N=64,waves=1"
VA="$VA;$R,SPAN=1,BLOCK_N=16,num_warps=4,waves=2;$R,SPAN=1,BLOCK_N=32,num_warps=4,waves=2,min_blocks=2"
VA="$VA;$R,BLOCK_N=32,num_warps=4,waves=2;$R,SPAN=1,BLOCK_N=32,num_warps=8,waves=1"
IFS=';' read -ra VS <<<"$VA"
for v in "" "${VS[@]}"; do for l in swa128+c4 single512; do  # warm the Triton cache in parallel
  timeout 200 python3 bench/bench_attention.py --layouts $l --heads 16 --batches 1,4,16,64,128 --impls ours \
    --layers 1 --replays 1 --variant-layouts $l ${v:+--variants "$v"} >/dev/null 2>&1 &
done; done
DSV4_ATTN_TEST_CONFIG="${VS[0]}" timeout 280 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention_gpu.py \
  -k "bf16" >"$OUT/pytest_bf16_span.log" 2>&1
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention_gpu.py -k "variants and (span or declate)" \
  >>"$OUT/pytest_bf16_span.log" 2>&1
{ echo "tests $(( $(date +%s) - t0 ))s"; grep -E "passed|failed" "$OUT/pytest_bf16_span.log"; } >>"$OUT/times.txt"
wait
echo "warm $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
timeout 150 python3 bench/bench_attention.py --layouts swa128+c4,single512 --heads 16 --batches 1,4,16,64,128 \
  --replays 20 --impls ours,flashmla --variant-layouts swa128+c4,single512 --variants "$VA" --out "$OUT/sweep" \
  >"$OUT/attn.log" 2>&1
echo "attn rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
