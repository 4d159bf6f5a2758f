#!/usr/bin/env python3
"""Capture a torch-profiler trace of the decode server under a fixed-concurrency load, then summarise it.

    python bench/profile_capture.py [--concurrency 16] [--num-steps 30] [--warmup-s 30]

1. checks the deployment (newest run in ``LOG_DIR/latest``, or ``--router``/``--decode-url``): router and
   decode server healthy;
2. starts ``python -m sglang.benchmark.serving`` at ``--max-concurrency C`` (fixed lengths) in the background;
3. after ``--warmup-s``, POSTs ``/start_profile`` to the decode server (``num_steps`` decode steps,
   GPU + CPU activities, into the decode server's ``SGLANG_TORCH_PROFILER_DIR``, which the serving
   script sets to ``RUN_DIR/profile``);
4. waits for one trace per decode TP rank, stops the load, and runs ``bench/profile_summary.py`` on the
   new traces: kernel groups by GPU time share and the largest remaining bottleneck.

Outputs in ``--out-dir`` (default ``bench/results/profile-<UTC time>``): ``summary.json``,
``summary.txt``, ``capture.json`` (what was captured, from where), ``load.log``.
Exit codes: 0 ok, 1 capture failed, 2 no healthy deployment / bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import List, Optional

from dsv4_sm120 import hints
from dsv4_sm120.fileio import atomic_write_text
from dsv4_sm120.paths import CHECKOUT_DIR
from dsv4_sm120.perf import measure, profile_summary

# the checkout this runs from (see measure.REPO); bench/profile_capture.py sets it to its own checkout
REPO = CHECKOUT_DIR


class CaptureError(Exception):
    def __init__(self, msg: str, code: int = 1):
        super().__init__(msg)
        self.code = code


def post_json(url: str, body: dict, timeout: float = 60) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError) as e:
        raise CaptureError(f"POST {url} failed: {e}")


def start_profile_body(trace_dir: str, num_steps: int, profile_id: str) -> dict:
    """The /start_profile request (fields of SGLang 0.5.23's ProfileReq)."""
    return {"output_dir": trace_dir, "num_steps": num_steps, "activities": ["GPU", "CPU"],
            "profile_id": profile_id, "record_shapes": False, "with_stack": False}


def new_traces(trace_dir: Path, profile_id: str) -> List[Path]:
    if not trace_dir.is_dir():
        return []
    return sorted(p for p in trace_dir.iterdir()
                  if p.is_file() and profile_id in p.name and (p.name.endswith(".json") or p.name.endswith(".json.gz")))


def wait_for_traces(trace_dir: Path, profile_id: str, expected: int, timeout_s: float) -> List[Path]:
    """Wait until `expected` trace files exist and their sizes stay put for 2 s."""
    t0 = time.monotonic()
    last, stable_since = None, None
    while time.monotonic() - t0 < timeout_s:
        files = new_traces(trace_dir, profile_id)
        sig = [(p.name, p.stat().st_size) for p in files]
        if len(files) >= expected:
            if sig == last:
                if time.monotonic() - stable_since >= 2.0:
                    return files
            else:
                stable_since = time.monotonic()
        last = sig
        time.sleep(0.25)
    found = new_traces(trace_dir, profile_id)
    raise CaptureError(f"{len(found)} of {expected} trace file(s) for profile {profile_id} appeared in {trace_dir} "
                       f"within {timeout_s:g} s (is it the decode server's SGLANG_TORCH_PROFILER_DIR on this host?)")


def stop_load(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait(timeout=5)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", help="router URL (default: the newest run's)")
    ap.add_argument("--decode-url", help="decode server URL (default: the newest run's)")
    ap.add_argument("--trace-dir", type=Path, help="where the decode server writes traces (default: its "
                                                   "SGLANG_TORCH_PROFILER_DIR from the run's plan)")
    ap.add_argument("--decode-tp", type=int, help="trace files to wait for (default: the run's decode GPU count)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=1024, help="long enough to keep decode busy (default 1024)")
    ap.add_argument("--num-prompts", type=int, help="default 4 x concurrency")
    ap.add_argument("--num-steps", type=int, default=30, help="decode steps profiled (default 30)")
    ap.add_argument("--warmup-s", type=float, default=30.0, help="load time before profiling starts")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the trace files")
    ap.add_argument("--dataset", choices=("random-ids", "random"), default="random-ids")
    ap.add_argument("--model", help="tokenizer path for the load (default: the run's MODEL_PATH)")
    ap.add_argument("--python", help="python with sglang (default: VENV's, else this one)")
    ap.add_argument("--out-dir", type=Path)
    ap.add_argument("--log-dir", default=None, help="serving LOG_DIR (default $LOG_DIR or logs)")
    ap.add_argument("--top", type=int, default=15)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    a = _parser().parse_args(argv)
    run_dir = measure.latest_run(a.log_dir, "profile")
    dep = measure.deployment_info(run_dir)
    plan = measure.read_json(run_dir / "plan.json") if run_dir else None
    plan = plan or {}
    state = (measure.read_json(run_dir / "state.json") if run_dir else None) or {}
    urls = state.get("urls") or plan.get("urls") or {}
    router = (a.router or urls.get("router") or "").rstrip("/")
    decode = (a.decode_url or urls.get("decode") or "").rstrip("/")
    decode_proc = next((p for p in plan.get("procs", []) if p.get("role") == "decode"), {})
    trace_dir = a.trace_dir or (Path(decode_proc["env"]["SGLANG_TORCH_PROFILER_DIR"])
                                if decode_proc.get("env", {}).get("SGLANG_TORCH_PROFILER_DIR") else None)
    tp = a.decode_tp or len(decode_proc.get("gpus") or []) or None
    try:
        if not router or not decode:
            raise CaptureError("no deployment found (LOG_DIR/latest); name its servers "
                               f"({hints.args('--router URL --decode-url URL')})", 2)
        if trace_dir is None or tp is None:
            raise CaptureError("unknown trace directory / decode TP: name them "
                               f"({hints.args('--trace-dir DIR --decode-tp N')})", 2)
        if a.concurrency < 1 or a.num_steps < 1 or a.output_len < 2:
            raise CaptureError("--concurrency, --num-steps must be >= 1 and --output-len >= 2", 2)
        try:
            measure.require_healthy_router(router)
        except measure.MeasureError as e:
            raise CaptureError(str(e), 2)
        if measure.http_status(decode + "/health", 10) != 200:
            raise CaptureError(f"decode server at {decode} is not healthy", 2)
    except CaptureError as e:
        print(f"profile: {e}", file=sys.stderr)
        return e.code

    model = a.model or (dep.get("settings") or {}).get("MODEL_PATH") or measure.DEFAULT_MODEL
    problem = measure.tokenizer_problem(model)
    if problem:
        print(f"profile: the load generator needs the tokenizer of {model}: {problem}; name a directory that holds "
              f"it ({hints.args('--model DIR')}) or make it reachable", file=sys.stderr)
        return 2
    python = measure.serving_python(a.python)
    out_dir = a.out_dir or REPO / "bench" / "results" / time.strftime("profile-%Y%m%d-%H%M%S", time.gmtime())
    out_dir.mkdir(parents=True, exist_ok=True)
    profile_id = f"dsv4-decode-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}"
    n = a.num_prompts or 4 * a.concurrency
    cmd = measure.bench_cmd(python, router, model, a.concurrency, a.input_len, a.output_len, n,
                            str(out_dir / "load.jsonl"), a.dataset, 1, 0)
    print(f"profile: load C={a.concurrency} ({n} requests, in {a.input_len} / out {a.output_len}) via {router}; "
          f"profiling {a.num_steps} decode steps of {decode} after {a.warmup_s:g} s; traces -> {trace_dir}", flush=True)
    log = open(out_dir / "load.log", "w")
    load = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=str(out_dir))
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < a.warmup_s:
            if load.poll() is not None:
                raise CaptureError(f"the load generator exited ({load.returncode}) before profiling started; "
                                   f"see {out_dir / 'load.log'} (raise --output-len / --num-prompts: "
                                   f"{hints.args('--output-len N --num-prompts N')})")
            time.sleep(0.2)
        body = start_profile_body(str(trace_dir), a.num_steps, profile_id)
        st = post_json(decode + "/start_profile", body)
        if st != 200:
            raise CaptureError(f"/start_profile on {decode} answered HTTP {st}")
        traces = wait_for_traces(trace_dir, profile_id, tp, a.timeout)
        if load.poll() is not None and load.returncode != 0:
            raise CaptureError(f"the load generator failed ({load.returncode}) during profiling; see load.log")
    except CaptureError as e:
        stop_load(load)
        print(f"profile: {e}", file=sys.stderr)
        return e.code
    finally:
        stop_load(load)
        log.close()
    try:
        summ = profile_summary.summarise(traces, top=a.top)
    except profile_summary.TraceError as e:
        print(f"profile: captured {len(traces)} trace(s) but cannot summarise them: {e}", file=sys.stderr)
        return 1
    text = profile_summary.render(summ)
    atomic_write_text(out_dir / "summary.json", json.dumps(summ, indent=2) + "\n")
    atomic_write_text(out_dir / "summary.txt", text + "\n")
    atomic_write_text(out_dir / "capture.json", json.dumps({
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git": measure.git_rev(),
        "router": router, "decode": decode, "profile_id": profile_id, "request": body, "traces": [str(p) for p in traces],
        "load_command": cmd, "concurrency": a.concurrency, "warmup_s": a.warmup_s,
        "environment": measure.environment(python), "deployment": dep}, indent=2) + "\n")
    print(text)
    print(f"profile: wrote {out_dir / 'summary.json'} ({len(traces)} trace file(s) in {trace_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
