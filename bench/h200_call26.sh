#!/usr/bin/env bash
# H200 call 26 (session 5, 2026-11-30): the register body as the bf16 default for every H up to 4 group rows per SM
# (calls 24-25), so H = 32 / 64 / 128 rows of the GPU test matrix now run it in 16-row head groups: the bf16 half of
# the attention GPU file under the final defaults, then the GPU fuzzer on the register body for 90 s.
# Expectations (before the call): 48 passed (the bf16 half); fuzz: no failure.
# Usage (repo root, device): OUT=/some/dir bash bench/h200_call26.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/c26_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/overlay
t0=$(date +%s)
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention_gpu.py -k "bf16" >"$OUT/pytest_bf16.log" 2>&1
{ echo "tests rc=$? $(( $(date +%s) - t0 ))s"; tail -2 "$OUT/pytest_bf16.log"; } >>"$OUT/times.txt"
timeout 150 python3 tests/fuzz_attention.py --impl reg --seconds 90 --device cuda >"$OUT/fuzz_reg.log" 2>&1
{ echo "fuzz rc=$? $(( $(date +%s) - t0 ))s"; tail -2 "$OUT/fuzz_reg.log"; } >>"$OUT/times.txt"
