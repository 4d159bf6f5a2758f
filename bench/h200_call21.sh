#!/usr/bin/env bash
# H200 call 21 (session 5, 2026-11-30): DEC_LATE for the register body.
# The register body carried the next block's raw e4m3 bytes across the loop; Triton holds a uint8 tensor one byte
# per register, so the carried block cost 144 registers and ~220 PRMT per block to unpack after the load and repack
# for the decode asm. DEC_LATE=1 decodes the next block at the end of the iteration (after its gathers had the whole
# block's math to land) and carries the decoded bf16 tiles instead: CPU SASS (sm_90, triton 3.6, BN64, 8 warps,
# Q_RES=1) loop 805 instructions per warp and block against 1117 (PRMT 284 -> 72, LOP3 233 -> 119), 218 registers
# against 246, 16 barriers against 9; BN32 with 4 warps no longer spills (241 registers: two CTAs per SM).
# Expectations (before the call): DEC_LATE=1 at B = 64 / 128 10-20% faster than 33.8 / 51.3 us (the loop is
# issue-bound by the integer pipe, ~35% of its cycles); B = 1 / 4 unchanged (one block per program, decoded in the
# prologue either way); 4-warp rows (two CTAs per SM): unknown, a guess at better latency hiding at B = 128.
# GPU tests: the bf16 half of the attention GPU file under DEC_LATE=1 plus the two new DEC_LATE variant rows: pass.
# Usage (repo root, device): OUT=/some/dir bash bench/h200_call21.sh   (carry .whl_attn)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/c21_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fm .whl_attn/sgl_flash_mla-*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/fm:$PWD/overlay
t0=$(date +%s)
VA="DEC_LATE=1;DEC_LATE=1,waves=2;impl=reg,Q_RES=1,DEC_LATE=1,BLOCK_N=64;impl=reg,Q_RES=1,DEC_LATE=1,BLOCK_N=32,num_warps=8,waves=2"
VA="$VA;impl=reg,Q_RES=1,DEC_LATE=1,BLOCK_N=32,num_warps=4,waves=1;impl=reg,Q_RES=1,DEC_LATE=1,BLOCK_N=32,num_warps=4,waves=2"
VA="$VA;impl=reg,Q_RES=1,DEC_LATE=1,BLOCK_N=32,num_warps=4,waves=4;impl=reg,Q_RES=1,DEC_LATE=1,BLOCK_N=16,num_warps=4,waves=2"
IFS=';' read -ra VS <<<"$VA"
for v in "" "${VS[@]}"; do for l in swa128+c4 single512; do  # warm the Triton cache in parallel
  timeout 200 python3 bench/bench_attention.py --layouts $l --heads 16 --batches 1,4,16,64,128 --impls ours \
    --layers 1 --replays 1 --variant-layouts $l ${v:+--variants "$v"} >/dev/null 2>&1 &
done; done
DSV4_ATTN_TEST_CONFIG="DEC_LATE=1" timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention_gpu.py \
  -k "bf16" >"$OUT/pytest_bf16_declate.log" 2>&1
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention_gpu.py -k "variants and declate" \
  >>"$OUT/pytest_bf16_declate.log" 2>&1
{ echo "tests $(( $(date +%s) - t0 ))s"; grep -E "passed|failed" "$OUT/pytest_bf16_declate.log"; } >>"$OUT/times.txt"
wait
echo "warm $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
timeout 260 python3 bench/bench_attention.py --layouts swa128+c4,single512 --heads 16 --batches 1,4,16,64,128 \
  --replays 20 --impls ours,flashmla --variant-layouts swa128+c4,single512 --variants "$VA" --out "$OUT/sweep" >"$OUT/attn.log" 2>&1
echo "attn rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
