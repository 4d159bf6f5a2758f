#!/usr/bin/env bash
# The CPU test suite: brings the pinned test environment up to date (cached under
# ${DSV4_SM120_CACHE:-~/.cache/dsv4_sm120}/test-venv, created on demand), then runs pytest on tests/.
# Arguments go to pytest (default: `tests -q`).  "No tests ran" (pytest exit 5) is a failure, on purpose.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${DSV4_SM120_CACHE:-$HOME/.cache/dsv4_sm120}
venv=${TEST_VENV:-$cache/test-venv}
t0=$(date +%s)
"$here/scripts/setup_env.sh" "$venv" || { echo "[test] could not set up the test environment"; exit 2; }
cd "$here"
export PYTHONPATH="$here/overlay${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
[ $# -gt 0 ] || set -- tests -q
"$venv/bin/python" -m pytest -p no:cacheprovider "$@"
rc=$?
if [ $rc -eq 5 ]; then
  echo "[test] error: pytest collected no tests; treating as a failure"
  rc=1
fi
echo "[test] make test finished in $(( $(date +%s) - t0 )) s with exit code $rc"
exit $rc
