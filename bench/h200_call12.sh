#!/usr/bin/env bash
# H200 call 12 (session 2, 2026-11-30): impl=wg on mid-size grids. The bf16 GPU tests under the wg launch
# configuration, then tiled vs wg at B = 2..32 (H=16 SWA128+c4 and single-512). ~3.5 min.
# Usage (repo root, device): OUT=/some/dir bash bench/h200_call12.sh   (carry .whl_attn)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/c12_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fm .whl_attn/sgl_flash_mla-*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/fm:$PWD/overlay
t0=$(date +%s)
W="impl=wg,num_warps=4,maxnreg=0,num_stages=1,BLOCK_H=16,BLOCK_N=64"
timeout 150 python3 bench/bench_attention.py --layouts swa128+c4,single512 --heads 16 --batches 2,4,8,16,32 --impls ours \
  --layers 1 --replays 1 --variants "$W" >/dev/null 2>&1 &
DSV4_ATTN_TEST_CONFIG="$W" timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention_gpu.py \
  -k "bf16 and not variants" >"$OUT/pytest_wg.log" 2>&1
{ echo "tests rc=$? $(( $(date +%s) - t0 ))s"; tail -1 "$OUT/pytest_wg.log"; } >>"$OUT/times.txt"
wait
timeout 100 python3 bench/bench_attention.py --layouts swa128+c4,single512 --heads 16 --batches 2,4,8,16,32 --replays 20 \
  --impls ours,flashmla --variants "$W" --out "$OUT/attn_wg_mid" >"$OUT/attn.log" 2>&1
echo "attn rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
