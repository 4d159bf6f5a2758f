#!/usr/bin/env bash
# Stop a running deployment: SIGTERM to its supervisor (which tears the parts down), then
# SIGTERM / SIGKILL (after STOP_GRACE_S, default 30) to any recorded part still alive.
#   serve/stop.sh             the running deployment: LOG_DIR/latest, else the one started from this checkout with
#                             another LOG_DIR (recorded in DSV4_SM120_CACHE/deployments)
#   serve/stop.sh RUN_DIR     a given run directory
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
case "${1-}" in
  -h|--help) dsv4_help "${BASH_SOURCE[0]}"; exit 0 ;;
  -*) echo "[serve] error: unknown option '$1'" >&2; echo "usage: serve/stop.sh [RUN_DIR]" >&2; exit 2 ;;
esac
if [ $# -gt 1 ]; then
  echo "[serve] error: one run directory at most, got $#" >&2; echo "usage: serve/stop.sh [RUN_DIR]" >&2; exit 2
fi
dsv4_launch stop "$@"
