#!/usr/bin/env bash
# H200 call 9 (session 2, 2026-11-30): GPU tests (bf16 matrix, graph replay, odd pages, launch variants) and the
# committed attention table under the final defaults (PREFETCH added after call 8). ~4 min.
# Usage (repo root, device): OUT=/some/dir bash bench/h200_call9.sh   (carry .whl_attn)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/c9_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fm .whl_attn/sgl_flash_mla-*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/fm:$PWD/overlay
t0=$(date +%s)
timeout 260 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention_gpu.py -k "bf16" >"$OUT/pytest_attn.log" 2>&1
{ echo "tests rc=$? $(( $(date +%s) - t0 ))s"; tail -1 "$OUT/pytest_attn.log"; } >>"$OUT/times.txt"
timeout 150 python3 bench/bench_attention.py --replays 20 --impls ours,flashmla,upstream --upstream-max-batch 16 \
  --torch-max-batch 0 --upstream-file .whl_attn/flash_mla_sm120_triton.py --out "$OUT/attn" >"$OUT/attn.log" 2>&1
echo "attn rc=$? $(( $(date +%s) - t0 ))s" >>"$OUT/times.txt"
