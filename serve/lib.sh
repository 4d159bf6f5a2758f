# Shared by serve_dsv4_tp4.sh, serve_dsv4_mtp.sh and stop.sh (sourced, not run).
# Finds the serving environment's python (VENV, default .venv in the repo) and runs the
# launcher module from this checkout's overlay; all logic lives in
# overlay/dsv4_sm120/serving/ (plan.py, preflight.py, supervisor.py, deploy.py).

dsv4_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

dsv4_python() {
  local venv="${VENV:-.venv}"
  case "$venv" in /*) ;; *) venv="$dsv4_repo/$venv" ;; esac
  if [ -x "$venv/bin/python" ]; then
    echo "$venv/bin/python"
  elif command -v python3 >/dev/null 2>&1; then
    # Dry runs and stop work without the environment; a real start's preflight reports it missing.
    command -v python3
  else
    echo "[serve] error: no python: neither $venv/bin/python nor python3" >&2
    return 2
  fi
}

# dsv4_help SCRIPT: print the script's header comment (its --help).
dsv4_help() {
  awk 'NR>1 && /^#/ {sub(/^# ?/, ""); print; next} NR>1 {exit}' "$1"
}

# dsv4_usage_error SCRIPT ARG: one line naming the bad argument, the script's usage, exit 2.
dsv4_usage_error() {
  local name="serve/$(basename "$1")"
  {
    echo "[serve] error: unknown argument '$2' (settings are environment variables: $name --help-vars)"
    echo "usage: [VAR=value ...] $name [--dry-run] [--detach] [--help] [--help-vars]"
  } >&2
  exit 2
}

# dsv4_launch SUBCOMMAND [ARGS...]
dsv4_launch() {
  local py
  py="$(dsv4_python)" || exit 2
  export DSV4_SM120_ORIG_PYTHONPATH="${DSV4_SM120_ORIG_PYTHONPATH-${PYTHONPATH-}}"
  export DSV4_SM120_REPO_ROOT="$dsv4_repo"
  PYTHONPATH="$dsv4_repo/overlay${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m dsv4_sm120.serving.deploy "$@"
}
