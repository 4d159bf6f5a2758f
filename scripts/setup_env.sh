#!/usr/bin/env bash
# Create (or bring up to date) the pinned environment in VENV_DIR:
#   sglang==0.5.23 from its sha256-verified wheel, the packages of requirements/runtime.txt and
#   requirements/nodeps.txt, every version fixed by requirements/constraints.txt.
# Usage: scripts/setup_env.sh VENV_DIR        (PYTHON=python3.11 to choose the interpreter)
# Nothing is installed outside VENV_DIR (wheels are cached in ${DSV4_CACHE:-~/.cache/dsv4_sm120}).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:?usage: scripts/setup_env.sh VENV_DIR}
py=${PYTHON:-python3}
say() { echo "[setup] $*"; }

stamp=$(cat "$here/requirements/runtime.txt" "$here/requirements/nodeps.txt" "$here/requirements/constraints.txt" \
        "$here/overlay/dsv4_sm120/patching.py" | sha256sum | cut -c1-16)
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.dsv4_env_stamp" 2>/dev/null)" = "$stamp" ]; then
  say "environment $venv is up to date ($stamp)"
  exit 0
fi
if ! command -v "$py" >/dev/null; then say "error: $py not found (set PYTHON=...)"; exit 2; fi
if ! "$py" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] <= (3, 13) else 1)'; then
  say "error: $("$py" --version 2>&1) is not supported: sglang==0.5.23 wheels exist for CPython 3.11-3.13 (set PYTHON=python3.11)"
  exit 2
fi
t0=$(date +%s)
if [ ! -x "$venv/bin/python" ]; then
  say "creating $venv"
  "$py" -m venv "$venv"
fi
rm -f "$venv/.dsv4_env_stamp"
pyver=$("$venv/bin/python" -c 'import sys; print("%d%d" % sys.version_info[:2])')
wheel=$(PYTHONPATH="$here/overlay" "$venv/bin/python" -m dsv4_sm120.patching fetch-wheel --py "$pyver")
say "installing $(basename "$wheel") (sha256 verified) and requirements/runtime.txt (a few minutes cold)"
"$venv/bin/python" -m pip install -q --disable-pip-version-check \
  -c "$here/requirements/constraints.txt" "$wheel" -r "$here/requirements/runtime.txt"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$here/requirements/nodeps.txt"
got=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang"))')
if [ "$got" != "0.5.23" ]; then say "error: installed sglang is $got, expected 0.5.23"; exit 1; fi
echo "$stamp" > "$venv/.dsv4_env_stamp"
say "environment $venv ready in $(( $(date +%s) - t0 )) s"
