#!/usr/bin/env bash
# DeepSeek-V4-Flash, PD-disaggregated on one 8-GPU sm_120 box (default):
#   prefill server  TP4 on GPUs 0-3   (--disaggregation-mode prefill, KV out over NIXL)
#   decode server   TP4 on GPUs 4-7   (--disaggregation-mode decode, CUDA graphs up to MAX_RUNNING)
#   router          sglang_router --pd-disaggregation in front, on ROUTER_PORT (default 30000)
# Preflight first (GPUs, ports, model, patches, NIXL); all-or-nothing start; supervises in the
# foreground (Ctrl-C or serve/stop.sh stops everything).
#
# Options (everything else is an environment variable, see --help-vars and docs/serving.md):
#   --dry-run     print the exact commands and their environment and run the checks that need no GPU
#                 (exit 1 when one fails); start nothing (= DRY_RUN=1)
#   --detach      return once healthy, keep supervising in the background (= DETACH=1)
#   --help-vars   list the variables with their defaults
#   -h, --help    this text
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# serve_dsv4_mtp.sh runs this script with DSV4_SM120_VARIANT=mtp; it is not passed on to the servers.
dsv4_variant="${DSV4_SM120_VARIANT:-base}"
unset DSV4_SM120_VARIANT
dsv4_self="${BASH_SOURCE[0]}"
[ "$dsv4_variant" = mtp ] && dsv4_self="$(dirname "${BASH_SOURCE[0]}")/serve_dsv4_mtp.sh"
dsv4_opts=()
for a in "$@"; do
  case "$a" in
    -h|--help) dsv4_help "$dsv4_self"; exit 0 ;;
    --help-vars) dsv4_launch vars ;;
    --dry-run|--detach) dsv4_opts+=("$a") ;;
    *) dsv4_usage_error "$dsv4_self" "$a" ;;
  esac
done
dsv4_launch start --variant "$dsv4_variant" ${dsv4_opts[@]+"${dsv4_opts[@]}"}
