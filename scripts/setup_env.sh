#!/usr/bin/env bash
# Create (or bring up to date) the pinned environment in VENV_DIR:
#   sglang==0.5.23 from its sha256-verified wheel (requirements/sglang-wheels.txt), the packages of
#   requirements/runtime.txt and requirements/nodeps.txt, every version fixed by requirements/constraints.txt.
# Usage: scripts/setup_env.sh VENV_DIR        (PYTHON=python3.11 to choose the interpreter)
# Nothing is installed outside VENV_DIR: the SGLang wheel and the installer uv (requirements/tools.txt) are cached in
# ${DSV4_SM120_CACHE:-~/.cache/dsv4_sm120}, the packages in uv's cache (${UV_CACHE_DIR:-~/.cache/uv}), from which uv
# hard-links them into VENV_DIR when both are on one file system: a second environment costs little disk, and its time
# is mostly compiling the .pyc files after linking the packages (seconds): 50-200 CPU-seconds, by the CPU, spread over
# its cores; the last line says how long the whole set-up took.
# DSV4_SM120_INSTALLER=pip installs with pip instead (also the fallback when uv cannot be installed).
# DSV4_SM120_COMPILE_BYTECODE=0 skips compiling the .pyc files (uv); Python then compiles each module on its first
# import (and writes the .pyc where it may).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:?usage: scripts/setup_env.sh VENV_DIR}
case "$venv" in /*) ;; *) venv="$PWD/$venv" ;; esac
py=${PYTHON:-python3}
cache=${DSV4_SM120_CACHE:-$HOME/.cache/dsv4_sm120}
t0=$(date +%s)
say() { echo "[setup] $*"; }
elapsed() { echo "$(( $(date +%s) - t0 )) s"; }

# A retired name of a setting (dsv4_sm120.settings.RENAMED, as CHANGELOG.md lists them) is refused, not ignored.
retired=$(PYTHONPATH="$here/overlay" "$py" -m dsv4_sm120.retired_names 2>/dev/null) || true
if [ -n "$retired" ]; then say "error: $retired"; exit 2; fi

# The stamp covers exactly what determines the environment's contents.
req="$here/requirements"
stamp=$(cat "$req/runtime.txt" "$req/nodeps.txt" "$req/constraints.txt" "$req/sglang-wheels.txt" \
        | sha256sum | cut -c1-16)
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.dsv4_env_stamp" 2>/dev/null)" = "$stamp" ]; then
  say "environment $venv is up to date ($stamp)"
  exit 0
fi
if ! command -v "$py" >/dev/null; then say "error: $py not found (set PYTHON=...)"; exit 2; fi
if ! "$py" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] <= (3, 13) else 1)'; then
  say "error: $("$py" --version 2>&1) is not supported: sglang==0.5.23 wheels exist for CPython 3.11-3.13 (set PYTHON=python3.11)"
  exit 2
fi

# A heartbeat while packages install: a cold install downloads several GB and can be quiet for minutes.
ticker=
stop_ticker() { if [ -n "$ticker" ]; then kill "$ticker" 2>/dev/null || true; wait "$ticker" 2>/dev/null || true; ticker=; fi; }
start_ticker() {  # $1: what is running
  stop_ticker
  # sleep's output goes nowhere: a sleep left over from the killed loop must not hold our stdout open (a caller
  # reading it through a pipe would wait up to 30 s for its end)
  ( while sleep 30 </dev/null >/dev/null 2>&1; do say "... still $1 ($(elapsed) elapsed)"; done ) &
  ticker=$!
}
trap stop_ticker EXIT

# uv: the pinned version from requirements/tools.txt, installed once into the cache (UV=/path/to/uv uses that one).
uv_bin=
find_uv() {
  [ "${DSV4_SM120_INSTALLER:-uv}" = pip ] && return 0
  if [ -n "${UV:-}" ]; then uv_bin=$UV; return 0; fi
  local spec ver dir tmp
  spec=$(grep -E '^uv==' "$req/tools.txt" | head -1)
  ver=${spec#uv==}
  dir="$cache/tools/uv-$ver"
  if [ ! -x "$dir/bin/uv" ]; then
    say "installing $spec into $dir (once; the environment itself is installed with it)"
    mkdir -p "$cache/tools"
    tmp=$(mktemp -d "$cache/tools/.uv-$ver.XXXXXX")
    if "$py" -m pip install -q --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
          --target "$tmp" "$spec" >"$tmp.log" 2>&1 \
        && [ -x "$tmp/bin/uv" ] && mv -T "$tmp" "$dir" 2>/dev/null; then rm -f "$tmp.log"; else
      tail -5 "$tmp.log" 2>/dev/null || true
      rm -rf "$tmp" "$tmp.log"
      [ -x "$dir/bin/uv" ] || { say "could not install $spec: installing with pip instead (slower)"; return 0; }
    fi
  fi
  uv_bin="$dir/bin/uv"
}

# uv does not read pip's configuration: hand it the same package sources (find-links, index URLs, constraint files)
# that pip sees here, so that both resolve to the same files.
uv_source_args() {
  "$venv/bin/python" -m pip config list 2>/dev/null | "$venv/bin/python" -c '
import shlex, sys
vals = {}
for line in sys.stdin:
    key, sep, val = line.strip().partition("=")
    if not sep:
        continue
    section, _, name = key.rpartition(".")
    rank = {":env:": 0, "install": 1, "global": 2}.get(section)
    if rank is None:
        continue
    try:
        val = " ".join(shlex.split(val))
    except ValueError:
        continue
    if name not in vals or rank < vals[name][0]:
        vals[name] = (rank, val)
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
for name, flag in flags.items():
    for v in vals.get(name, (0, ""))[1].split():
        print(flag)
        print(v)
if vals.get("no-index", (0, ""))[1].lower() in ("1", "true", "yes", "on"):
    print("--no-index")
if vals.get("cert"):
    print("SSL_CERT_FILE=" + vals["cert"][1])
'
}

# uv install from its cache alone first: every version is pinned (requirements/constraints.txt), so what the cache
# holds is what the index would give, and uv otherwise asks the index again about every package whose cached
# answer is older than ten minutes (tens of seconds for ~220 packages). Whatever is missing is resolved online.
uv_install() {
  local log why rc=0
  if [ -d "$("$uv_bin" cache dir 2>/dev/null)" ]; then
    log=$(mktemp)
    "${uvi[@]}" --offline "$@" >"$log" 2>&1 || rc=$?
    if [ $rc -eq 0 ]; then cat "$log"; rm -f "$log"; return 0; fi
    why=$(grep -m1 -i "error" "$log" | cut -c1-200)
    rm -f "$log"
    say "not everything is in uv's cache yet (uv offline: ${why:-exit $rc}): resolving against the package index"
  fi
  "${uvi[@]}" "$@"
}

find_uv
if [ ! -x "$venv/bin/python" ]; then
  say "creating $venv ($("$py" --version 2>&1))"
  "$py" -m venv "$venv"  # with pip: `make apply-patches` installs the overlay with the environment's pip
fi
rm -f "$venv/.dsv4_env_stamp"
pyver=$("$venv/bin/python" -c 'import sys; print("%d%d" % sys.version_info[:2])')
wheel=$(PYTHONPATH="$here/overlay" "$venv/bin/python" -m dsv4_sm120.patching fetch-wheel --py "$pyver")
if [ -n "$uv_bin" ]; then
  mapfile -t src < <(uv_source_args)
  # pip's CA bundle (a TLS-inspecting proxy needs it) goes to uv through SSL_CERT_FILE
  for i in "${!src[@]}"; do
    case "${src[$i]}" in SSL_CERT_FILE=*) [ -n "${SSL_CERT_FILE:-}" ] || export "${src[$i]}"; unset "src[$i]";; esac
  done
  if [ "${DSV4_SM120_COMPILE_BYTECODE:-1}" = 0 ]; then
    pyc="then no .pyc compilation (DSV4_SM120_COMPILE_BYTECODE=0: Python compiles each module on its first import)"
  else
    pyc="then compiling the .pyc files, most of a warm install's time: 50-200 CPU-seconds by the CPU, spread over its cores (DSV4_SM120_COMPILE_BYTECODE=0 skips it)"
  fi
  say "installing $(basename "$wheel") (sha256 verified) and requirements/runtime.txt with $("$uv_bin" --version)" \
      "(cold: several GB of downloads, minutes; warm: linked from $("$uv_bin" cache dir) in seconds; $pyc)"
  start_ticker "installing"
  # unsafe-best-match: like pip, consider every index for every package (uv's default stops at the first that has it)
  uvi=("$uv_bin" pip install --python "$venv/bin/python" --index-strategy unsafe-best-match "${src[@]}")
  [ "${DSV4_SM120_COMPILE_BYTECODE:-1}" = 0 ] || uvi+=(--compile-bytecode)
  uv_install -c "$req/constraints.txt" "$wheel" -r "$req/runtime.txt"
  say "installing requirements/nodeps.txt (no dependencies) ($(elapsed) elapsed)"
  uv_install --no-deps -r "$req/nodeps.txt"
else
  say "installing $(basename "$wheel") (sha256 verified) and requirements/runtime.txt with pip (several minutes cold)"
  start_ticker "installing"
  "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off \
    -c "$req/constraints.txt" "$wheel" -r "$req/runtime.txt"
  say "installing requirements/nodeps.txt (no dependencies) ($(elapsed) elapsed)"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$req/nodeps.txt"
fi
stop_ticker
got=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang"))')
if [ "$got" != "0.5.23" ]; then say "error: installed sglang is $got, expected 0.5.23"; exit 1; fi
echo "$stamp" > "$venv/.dsv4_env_stamp"
say "environment $venv ready in $(elapsed) (measured on this machine: the time of a set-up depends on its CPU, disk and network)"
