#!/usr/bin/env bash
# H200 call 14 (prepared in session 3, 2026-11-30, when no device time was left): measure and check the two
# opt-in changes of session 3 before any default moves.
#   - KCVT=1: e4m3 -> bf16 on the integer pipes in the tiled body (no F2F / F2FP.E4M3 left in its loop:
#     bench/attn_sass_count.py). Expectation: B >= 64 faster by 5-25% (the loop issues 1810 instead of 1662
#     instructions per warp and block, but 336 conversion-pipe ops per thread and block go away; at 16 per SM
#     and clock they need ~5.6k cycles per block against ~3.3k issue cycles), B <= 16 unchanged within noise.
#   - PREFETCH=2: the next block's tile-scale bytes read one block early (they are synchronous byte loads).
#   - impl=wg with PV_AGAIN=1: the wgmma-shaped body without its spills (STACK 80 -> 0 B: the PV re-read is no
#     longer merged with the QK read). Session 2 measured it spilling: 15.7 us at B=16 (best), 100 us at B=128.
#   - impl=bt: the batched body (one 64-dim tile per warp). Expectation: unclear (2436 instructions per 64
#     candidates vs 1662, but 7 barriers per 32 candidates vs 22 per 64); if it loses everywhere, delete it.
#   - MoE: the fp4 path's activations quantized once per row (APRE, now the default there) must give the in-loop
#     result bit for bit on the GPU too (fp4 runs emulated on sm_90; the speed question is sm_120's).
# Steps: bf16 GPU attention tests under KCVT=1 and under bt, the MoE APRE tests (all in the background, ~3-4
# min), then the H=16
# SWA128+c4 sweep at B = 1..128 against FlashMLA (~2 min). Everything lands in $OUT (<= 8 files).
# Usage (repo root, device): OUT=/some/dir bash bench/h200_call14.sh   (carry .whl_attn)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/c14_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fm .whl_attn/sgl_flash_mla-*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/fm:$PWD/overlay
t0=$(date +%s)
WG="impl=wg,num_warps=4,maxnreg=0,num_stages=1,BLOCK_N=64,PV_AGAIN=1"
VA="KCVT=1;KCVT=1,PREFETCH=2;PREFETCH=2;impl=bt,BLOCK_N=32,maxnreg=0;impl=bt,BLOCK_N=32,maxnreg=0,KCVT=1;$WG;$WG,KCVT=1"
# warm the Triton cache for every variant in parallel (compiles dominate a cold call)
IFS=';' read -ra A <<<"$VA"
for v in "${A[@]}"; do
  timeout 150 python3 bench/bench_attention.py --layouts swa128+c4 --heads 16 --batches 16,128 --impls ours --layers 1 \
    --replays 1 --variants "$v" >/dev/null 2>&1 &
done
DSV4_ATTN_TEST_CONFIG='KCVT=1' timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention_gpu.py \
  -k "bf16" >"$OUT/pytest_kcvt.log" 2>&1 &
DSV4_ATTN_TEST_CONFIG='impl=bt,BLOCK_N=32,maxnreg=0' timeout 240 python3 -m pytest -q -p no:cacheprovider \
  tests/gpu/test_attention_gpu.py -k "bf16" >"$OUT/pytest_bt.log" 2>&1 &
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_gpu.py -k "pre_quantized or fp4-emulated" \
  >"$OUT/pytest_moe_apre.log" 2>&1 &
# fp8 QK now quantizes Q once per (row, head) before the launch (QPRE, default of that path): its GPU subset
DSV4_ATTN_TEST_CONFIG='KCVT=1' timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention_gpu.py \
  -k "fp8" >"$OUT/pytest_fp8_qpre.log" 2>&1 &
wait
{ echo "tests+warm $(( $(date +%s) - t0 ))s"; tail -1 "$OUT/pytest_kcvt.log"; tail -1 "$OUT/pytest_bt.log";
  tail -1 "$OUT/pytest_moe_apre.log"; tail -1 "$OUT/pytest_fp8_qpre.log"; } >>"$OUT/times.txt"
timeout 240 python3 bench/bench_attention.py --layouts swa128+c4 --heads 16 --batches 1,16,32,64,128 --replays 20 \
  --impls ours,flashmla --variants "$VA" --out "$OUT/attn_sweep" >"$OUT/attn.log" 2>&1
echo "attn rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
