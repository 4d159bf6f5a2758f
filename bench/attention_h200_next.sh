#!/usr/bin/env bash
# Proposed next H200 call (not run yet): confirm the call-4 defaults, run the GPU correctness tests with
# the defaults (odd pages, all-invalid rows, graph replay, the matrix), and time the small-B candidates
# that call 4 pointed at (the combine is a large share at B <= 16: one-pass combine saved 3.2 us at
# B=1, bf16 partials 2.3 us on the pipe body): bf16 partials on the tiled body, a wider combine grid,
# fewer splits (min_blocks=2) with the pipelined body. ~150 s on a warm H200.
# Usage (repo root, device): OUT=/some/dir bash bench/attention_h200_next.sh   (carry .whl_attn)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/attn_out}
mkdir -p "$OUT" /tmp/logs
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fm .whl_attn/sgl_flash_mla-*.whl \
  >/tmp/logs/pip.log 2>&1 || echo "flash_mla wheel did not install" >>/tmp/logs/pip.log
export PYTHONPATH=/tmp/fm:$PWD/overlay
V16="PART_BF16=1;BLOCK_D=32;BLOCK_D=32,PART_BF16=1;BLOCK_HC=8,BLOCK_D=32,PART_BF16=1;combine_warps=8,BLOCK_D=32"
V16="$V16;min_blocks=2;min_blocks=2,PART_BF16=1;min_blocks=2,PART_BF16=1,BLOCK_D=32"
V64="PART_BF16=1,BLOCK_D=32;impl=flat,BLOCK_H=64,BLOCK_N=32,maxnreg=0,num_stages=1"
t0=$(date +%s)
# phase 1 (parallel): warm the compile cache for every variant + GPU tests with the defaults
i=0
IFS=';' read -ra A16 <<<"$V16"
for v in "${A16[@]}"; do
  i=$((i+1))
  timeout 60 python3 bench/bench_attention.py --layouts swa128+c4 --heads 16 --impls ours --layers 1 --replays 1 \
    --variants "$v" >/tmp/logs/warm16_$i.log 2>&1 &
done
timeout 60 python3 bench/bench_attention.py --layouts swa128+c4 --heads 64 --impls ours --layers 1 --replays 1 \
  --batches 1,16,64,128 --variants "$V64" >/tmp/logs/warm64.log 2>&1 &
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention_gpu.py -k "variants or odd_pages or graph" \
  >/tmp/logs/pytest_default.log 2>&1 &
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention_gpu.py -k "matrix and bf16" \
  >/tmp/logs/pytest_matrix_bf16.log 2>&1 &
wait
echo "phase1 $(( $(date +%s) - t0 ))s" >>/tmp/logs/times.txt
tar czf "$OUT/logs.tgz" -C /tmp logs
timeout 45 python3 bench/bench_attention.py --layouts swa128+c4 --heads 16 --replays 10 --impls ours,flashmla \
  --variants "$V16" --out "$OUT/h16" >/tmp/logs/h16.log 2>&1
timeout 25 python3 bench/bench_attention.py --layouts swa128+c4 --heads 64 --batches 1,16,64,128 --replays 10 \
  --impls ours,flashmla --variants "$V64" --out "$OUT/h64" >/tmp/logs/h64.log 2>&1
echo "end $(( $(date +%s) - t0 ))s" >>/tmp/logs/times.txt
tar czf "$OUT/logs.tgz" -C /tmp logs
