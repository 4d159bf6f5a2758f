#!/usr/bin/env bash
# The CPU test suite: brings the pinned test environment up to date (cached under
# ${DSV4_SM120_CACHE:-~/.cache/dsv4_sm120}/test-venv, created on demand), then runs pytest on tests/.
# Arguments go to pytest (default: `tests -q`).  "No tests ran" (pytest exit 5) is a failure, on purpose.
# The tests run on one pytest-xdist worker per CPU core (at most 8); TEST_WORKERS=N sets the count,
# TEST_WORKERS=0 runs them in this one process.  A `-n` among the arguments overrides it too.
# The `python -c` children that import SGLang fork from a server that has the third-party packages imported
# (tests/forkserver.py); TEST_FORK_SERVER=0 starts each as a plain process instead.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${DSV4_SM120_CACHE:-$HOME/.cache/dsv4_sm120}
venv=${TEST_VENV:-$cache/test-venv}
t0=$(date +%s)
workers=${TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}
case $workers in ''|*[!0-9]*) echo "[test] error: TEST_WORKERS must be a number of workers (0 for none), got '$workers'"; exit 2;; esac
[ "$workers" -le 8 ] || workers=8
"$here/scripts/setup_env.sh" "$venv" || { echo "[test] could not set up the test environment"; exit 2; }
cd "$here"
export PYTHONPATH="$here/overlay${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
[ $# -gt 0 ] || set -- tests -q
# loadgroup: the tests of a file that builds an expensive module fixture stay on one worker, the rest go to
# whichever worker is free (tests/conftest.py)
xdist=()
[ "$workers" -le 1 ] || xdist=(-n "$workers" --dist loadgroup)
"$venv/bin/python" -m pytest -p no:cacheprovider "${xdist[@]}" "$@"
rc=$?
if [ $rc -eq 5 ]; then
  echo "[test] error: pytest collected no tests; treating as a failure"
  rc=1
fi
echo "[test] make test finished in $(( $(date +%s) - t0 )) s with exit code $rc"
exit $rc
