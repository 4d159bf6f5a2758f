#!/usr/bin/env bash
# The same deployment as serve_dsv4_tp4.sh with MTP speculative decoding (EAGLE/NEXTN, topk 1)
# on both servers: the prefill server runs the draft layer's extend so the decode server gets
# the draft state with the KV. Steps and draft tokens: SPEC_NUM_STEPS (3), SPEC_NUM_DRAFT_TOKENS (4).
# All options, preflight, supervision and dry-run are the base script's (no copy of its logic).
set -euo pipefail
case "${1-}" in
  -h|--help) awk 'NR>1 && /^#/ {sub(/^# ?/, ""); print; next} NR>1 {exit}' "${BASH_SOURCE[0]}"; exit 0 ;;
esac
DSV4_VARIANT=mtp exec bash "$(dirname "${BASH_SOURCE[0]}")/serve_dsv4_tp4.sh" "$@"
