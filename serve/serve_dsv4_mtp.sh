#!/usr/bin/env bash
# The same deployment as serve_dsv4_tp4.sh with MTP speculative decoding (EAGLE/NEXTN, topk 1)
# on both servers: the prefill server runs the draft layer's extend so the decode server gets
# the draft state with the KV. Steps and draft tokens: SPEC_NUM_STEPS (3), SPEC_NUM_DRAFT_TOKENS (4).
# Options, variables, preflight, supervision and dry run are the base script's (no copy of its logic).
#
# Options (everything else is an environment variable, see --help-vars and docs/serving.md):
#   --dry-run     print the exact commands and their environment, start nothing (= DRY_RUN=1)
#   --detach      return once healthy, keep supervising in the background (= DETACH=1)
#   --help-vars   list the variables with their defaults
#   -h, --help    this text
set -euo pipefail
DSV4_VARIANT=mtp exec bash "$(dirname "${BASH_SOURCE[0]}")/serve_dsv4_tp4.sh" "$@"
