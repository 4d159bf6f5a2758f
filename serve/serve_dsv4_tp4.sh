#!/usr/bin/env bash
# DeepSeek-V4-Flash, PD-disaggregated on one 8-GPU sm_120 box (default):
#   prefill server  TP4 on GPUs 0-3   (--disaggregation-mode prefill, KV out over NIXL)
#   decode server   TP4 on GPUs 4-7   (--disaggregation-mode decode, CUDA graphs up to MAX_RUNNING)
#   router          sglang_router --pd-disaggregation in front, on ROUTER_PORT (default 30000)
# Preflight first (GPUs, ports, model, patches, NIXL); all-or-nothing start; supervises in the
# foreground (Ctrl-C or serve/stop.sh stops everything). Everything is an environment variable:
#   serve/serve_dsv4_tp4.sh --help-vars     list them with defaults (see docs/serving.md)
#   DRY_RUN=1 serve/serve_dsv4_tp4.sh       print the exact commands and environment, start nothing
#   DETACH=1  serve/serve_dsv4_tp4.sh       return once healthy, keep supervising in the background
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
case "${1-}" in
  -h|--help) awk 'NR>1 && /^#/ {sub(/^# ?/, ""); print; next} NR>1 {exit}' "${BASH_SOURCE[0]}"; exit 0 ;;
  --help-vars) dsv4_launch vars ;;
esac
dsv4_launch start --variant "${DSV4_VARIANT:-base}" "$@"
