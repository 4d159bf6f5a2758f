#!/usr/bin/env bash
# The same deployment as serve_dsv4_tp4.sh with speculative decoding on both servers. The draft
# kind comes from MODEL_PATH's config.json: a DSpark head (dspark_* keys, or a dspark/ subfolder;
# DeepSeek-V4-Flash-0731) is served with SGLang's DSPARK path, block size = the checkpoint's
# dspark_block_size; an MTP layer (num_nextn_predict_layers > 0; DeepSeek-V4-Flash) with
# EAGLE/NEXTN, topk 1, 3 steps, 4 draft tokens; a checkpoint with neither is an error.
# Both servers get the same flags: the prefill server writes the draft layer's SWA rows for the
# prompt and 0.5.23 sends them to the decode server with the KV (docs/speculative.md).
# Knobs: SPEC_ALGORITHM (auto|EAGLE|DSPARK), SPEC_NUM_STEPS, SPEC_NUM_DRAFT_TOKENS,
# SPEC_DSPARK_BLOCK_SIZE, SPEC_EAGLE_TOPK. Options, variables, preflight, supervision and dry run
# are the base script's (no copy of its logic).
#
# Options (everything else is an environment variable, see --help-vars and docs/serving.md):
#   --dry-run     print the exact commands and their environment and run the checks that need no GPU
#                 (exit 1 when one fails); start nothing (= DRY_RUN=1)
#   --detach      return once healthy, keep supervising in the background (= DETACH=1)
#   --help-vars   list the variables with their defaults
#   -h, --help    this text
set -euo pipefail
DSV4_SM120_VARIANT=mtp exec bash "$(dirname "${BASH_SOURCE[0]}")/serve_dsv4_tp4.sh" "$@"
