#!/usr/bin/env bash
# Stop a running deployment: SIGTERM to its supervisor (which tears the parts down), then
# SIGTERM / SIGKILL (after STOP_GRACE_S, default 30) to any recorded part still alive.
#   serve/stop.sh             the newest run (LOG_DIR/latest)
#   serve/stop.sh RUN_DIR     a given run directory
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
case "${1-}" in
  -h|--help) awk 'NR>1 && /^#/ {sub(/^# ?/, ""); print; next} NR>1 {exit}' "${BASH_SOURCE[0]}"; exit 0 ;;
esac
dsv4_launch stop "$@"
