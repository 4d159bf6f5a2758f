#!/usr/bin/env bash
# H200 call (session 2, 2026-11-30): the new combine kernel (one head per program, in-thread online merge).
# GPU tests of the attention kernel with the new combine, the full attention table (H 16/64, both layouts, ours vs
# FlashMLA, upstream fallback to B=16), combine variants, and a confirmation of today's MoE defaults. ~5 min.
# Usage (repo root, device): OUT=/some/dir bash bench/attention_h200_call5.sh   (carry .whl_attn)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/attn_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fm .whl_attn/sgl_flash_mla-*.whl >"$OUT/pip.log" 2>&1
export PYTHONPATH=/tmp/fm:$PWD/overlay
t0=$(date +%s)
VC="${VC:-combine_waves=1;combine_waves=4;BLOCK_D=128;BLOCK_D=256}"
# compile warm-up for the variants while the tests run
timeout 150 python3 bench/bench_attention.py --layouts swa128+c4 --heads 16 --impls ours --layers 1 --replays 1 \
  --variants "$VC" >"$OUT/warm.log" 2>&1 &
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention_gpu.py -k "variants or odd_pages or graph or (matrix and bf16)" \
  >"$OUT/pytest_attn.log" 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
wait
timeout 150 python3 bench/bench_attention.py --replays 20 --impls ours,flashmla,upstream --upstream-max-batch 16 \
  --torch-max-batch 0 --upstream-file .whl_attn/flash_mla_sm120_triton.py --out "$OUT/attn" >"$OUT/attn.log" 2>&1
echo "attn rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
timeout 60 python3 bench/bench_attention.py --layouts swa128+c4 --heads 16 --replays 20 --impls ours \
  --variants "$VC" --out "$OUT/attn_var" >"$OUT/attn_var.log" 2>&1
echo "variants rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
timeout 90 python3 bench/bench_moe.py --m 1,4,16,64 --no-baselines --no-check --reps 20 --out "$OUT/moe_defaults.md" \
  >"$OUT/moe.log" 2>&1
echo "moe rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
