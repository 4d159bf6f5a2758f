"""CLI behind ``serve/serve_dsv4_tp4.sh``, ``serve/serve_dsv4_mtp.sh`` and ``serve/stop.sh``.

  python -m dsv4_sm120.serving.deploy start [--variant base|mtp] [--dry-run] [--detach]
  python -m dsv4_sm120.serving.deploy stop [RUN_DIR]
  python -m dsv4_sm120.serving.deploy vars          # the variables, defaults and meaning

Configuration is by environment variables (``vars`` lists them; ``docs/serving.md``).
Exit codes: 0 ok / stopped on request, 1 preflight or runtime failure (everything torn
down; for a dry run: one of the checks that need no GPU failed), 2 configuration error.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

from .. import settings
from ..fileio import atomic_write_text
from ..paths import checkout_root
from . import runs
from . import supervisor as sv
from .plan import VARIABLES, ConfigError, Plan, build_plan, render_dry_run
from .preflight import run_dry_checks, run_preflight


def _say(msg: str) -> None:
    sv.say(msg)


def _log_dir(environ) -> Path:
    d = Path(os.path.expanduser(settings.get("LOG_DIR", environ) or VARIABLES["LOG_DIR"][0]))
    return d if d.is_absolute() else checkout_root() / d


def _link_latest(plan: Plan) -> None:
    latest = _log_dir(os.environ) / "latest"
    tmp = latest.with_name(f".latest.{os.getpid()}")
    try:
        latest.parent.mkdir(parents=True, exist_ok=True)
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(plan.run_dir, tmp)
        os.replace(tmp, latest)
    except OSError as e:
        _say(f"note: could not update {latest}: {e}")


def print_header(plan: Plan) -> None:
    _say(f"DeepSeek-V4-Flash PD deployment, variant {plan.variant}, roles {','.join(plan.roles)}"
         f"{' (STAND-IN servers, no GPU)' if plan.standin else ''}")
    for k in ("MODEL_PATH", "PREFILL_GPUS", "DECODE_GPUS", "CONTEXT_LEN", "MAX_RUNNING", "NODE_ROLE"):
        _say(f"  {k}={plan.settings[k]}")
    _say(f"  fp8 gemm backend: {plan.fp8_reason}")
    _say("environment for both servers:")
    for k, v, src in plan.common_env:
        _say(f"  {k}={v}   ({src})")
    for p in plan.procs:
        _say(f"{p.label}: " + " ".join([f"{k}={v}" for k, v in p.env.items()] + p.argv))
    for p in plan.procs:
        if p.allreduce:
            _say(f"all-reduce {p.label}: {p.allreduce}")
    if plan.shape_reason:
        _say(f"serving shape: {plan.shape_reason}")


def dry_run(plan: Plan) -> int:
    """Print the plan, then run the preflight's checks that need no GPU (``run_dry_checks``). 0 when they pass,
    1 when one fails (each failure one line on stderr, as a start's preflight prints it), 2 for a bad
    PREFLIGHT_SKIP."""
    print(render_dry_run(plan))
    try:
        failures = run_dry_checks(plan, say=print)
    except ValueError as e:
        print(f"[serve] configuration error: {e}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    if failures:
        for f in failures:
            print(f"[serve] preflight: {f}", file=sys.stderr)
        print(f"[serve] dry run: {len(failures)} preflight failure(s); a start with these settings would refuse",
              file=sys.stderr)
        return 1
    return 0


def cmd_start(a) -> int:
    env = dict(os.environ)
    if a.dry_run:
        env["DRY_RUN"] = "1"
    try:
        plan = build_plan(env, a.variant)
    except ConfigError as e:
        print(f"[serve] configuration error: {e}", file=sys.stderr)
        return 2
    if plan.value("DRY_RUN"):
        return dry_run(plan)
    detach = a.detach or plan.value("DETACH")
    print_header(plan)
    try:
        failures = run_preflight(plan, say=lambda m: _say(m))
    except ValueError as e:
        print(f"[serve] configuration error: {e}", file=sys.stderr)
        return 2
    if failures:
        for f in failures:
            print(f"[serve] preflight: {f}", file=sys.stderr)
        print(f"[serve] refused to start: {len(failures)} preflight failure(s); nothing was started", file=sys.stderr)
        return 1
    run_dir = Path(plan.run_dir)
    if (run_dir / "state.json").exists():
        st = sv.read_state(run_dir) or {}
        if st.get("supervisor_pid") and sv.is_alive(st["supervisor_pid"], st.get("supervisor_start")):
            print(f"[serve] refused: a deployment is running in {run_dir} (stop it with serve/stop.sh {run_dir})",
                  file=sys.stderr)
            return 1
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "plan.json", plan.to_json())
    except OSError as e:     # the plan checked the directory; it changed since
        print(f"[serve] configuration error: cannot write the run directory {run_dir} ({e.strerror or e})",
              file=sys.stderr)
        return 2
    _link_latest(plan)
    note = runs.record(Path(plan.run_dir))
    if note:
        _say(f"note: {note}")
    if not detach:
        sv.LOG_FILE = str(run_dir / "supervisor.log")
        return sv.Supervisor(plan).run()
    try:
        return _start_detached(plan)
    except KeyboardInterrupt:
        print("[serve] interrupted while starting: stopping the deployment", file=sys.stderr)
        sv.stop_run(run_dir, float(plan.settings["STOP_GRACE_S"]))
        return 130


def _start_detached(plan: Plan) -> int:
    run_dir = Path(plan.run_dir)
    log = run_dir / "supervisor.log"
    with open(log, "ab") as f:
        child = subprocess.Popen([sys.executable, "-m", "dsv4_sm120.serving.deploy", "supervise", str(run_dir)],
                                 stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True, env=dict(os.environ), cwd=str(run_dir))
    _say(f"supervisor detached (pid {child.pid}), log {log}")
    try:
        return follow_detached(run_dir, child, float(plan.settings["HEALTH_TIMEOUT_S"]) * 2 + 120)
    except TimeoutError as e:
        print(f"[serve] {e}; stopping", file=sys.stderr)
        sv.stop_run(run_dir, float(plan.settings["STOP_GRACE_S"]))
        return 1


READY_MARK = b"[serve] READY:"


def follow_detached(run_dir: Path, child: subprocess.Popen, limit_s: float) -> int:
    """Echo the detached supervisor's log until state.json says ready (0) or failed / stopped / the
    supervisor exited (1). The supervisor writes the state before the line that announces it, so on
    "ready" the log is read on until its READY line (a few seconds at most), and on a failure until
    the supervisor has exited: the caller sees every line of the start, never a cut-off log.
    Raises TimeoutError after limit_s without a verdict."""
    log = run_dir / "supervisor.log"
    t0 = time.monotonic()
    pos = 0
    tail = b""          # the last bytes read, so a READY line split across two reads is still found
    ready_line = False

    def drain() -> None:
        nonlocal pos, tail, ready_line
        try:
            with open(log, "rb") as f:
                f.seek(pos)
                chunk = f.read()
        except OSError:
            return
        if chunk:
            pos += len(chunk)
            tail = (tail + chunk)[-4096:]
            ready_line = ready_line or READY_MARK in tail
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()

    while True:
        time.sleep(0.2)
        drain()
        st = sv.read_state(run_dir) or {}
        status = st.get("status")
        if status == "ready":
            t_ready = time.monotonic()
            while not ready_line and child.poll() is None and time.monotonic() - t_ready < 10:
                time.sleep(0.05)
                drain()
            return 0
        if status in ("failed", "stopped") or child.poll() is not None:
            child.wait()        # a failing supervisor tears everything down, logs it, then exits
            drain()
            st = sv.read_state(run_dir) or {}
            print(f"[serve] startup failed ({st.get('message') or 'supervisor exited'}); see {log}", file=sys.stderr)
            return 1
        if time.monotonic() - t0 > limit_s:
            raise TimeoutError(f"supervisor did not report ready within {limit_s:g} s")


def cmd_supervise(a) -> int:
    run_dir = Path(a.run_dir)
    try:
        plan = Plan.from_json((run_dir / "plan.json").read_text())
    except (OSError, ValueError, TypeError) as e:
        print(f"[serve] cannot read {run_dir}/plan.json: {e}", file=sys.stderr)
        return 2
    return sv.Supervisor(plan).run()


def cmd_stop(a) -> int:
    if a.run_dir:
        run_dir = Path(a.run_dir)
    else:
        log_dir = _log_dir(os.environ)
        found, note = runs.find(log_dir)
        if note:
            _say(note)
        if found is None and note:
            print("[serve] stop one of them: serve/stop.sh RUN_DIR (or make stop RUN_DIR=...)", file=sys.stderr)
            return 2
        if found is None:
            _say(f"no deployment recorded under {log_dir} (nothing to stop)")
            return 0
        run_dir = found
    try:
        grace = settings.get("STOP_GRACE_S")
    except settings.SettingsError as e:
        print(f"[serve] configuration error: {e}", file=sys.stderr)
        return 2
    return sv.stop_run(run_dir, float(grace))


def cmd_vars(_a) -> int:
    print("Set these in the environment, e.g. MAX_RUNNING=8 serve/serve_dsv4_tp4.sh (docs/serving.md, \"Variables\").")
    print(f"Each line: NAME  [valid values; default]. Yes/no switches take 0 or 1 ({settings.BOOL_WORDS}); an empty "
          f"value means the default.")
    for line in settings.text_listing("serve").splitlines():
        print(line.replace("[serve; ", "[", 1))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_sm120.serving.deploy",
                                 description="PD-disaggregated DeepSeek-V4-Flash deployment (prefill TP + decode TP + router).",
                                 epilog="Configured by environment variables: run the `vars` command to list them.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("start", help="preflight, start, wait for health, supervise")
    p.add_argument("--variant", choices=("base", "mtp"), default="base", help="mtp = MTP speculative decoding")
    p.add_argument("--dry-run", action="store_true", help="print commands and environment, start nothing (= DRY_RUN=1)")
    p.add_argument("--detach", action="store_true", help="return once healthy; supervision continues (= DETACH=1)")
    p = sub.add_parser("stop", help="stop a deployment (default: LOG_DIR/latest)")
    p.add_argument("run_dir", nargs="?", default=None)
    p = sub.add_parser("supervise", help=argparse.SUPPRESS)
    p.add_argument("run_dir")
    sub.add_parser("vars", help="list the configuration variables")
    a = ap.parse_args(argv)
    return {"start": cmd_start, "stop": cmd_stop, "supervise": cmd_supervise, "vars": cmd_vars}[a.cmd](a)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:   # output piped into e.g. head: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
