#!/usr/bin/env python3
"""TP all-reduce benchmark: FlashInfer's PCIe-IPC all-reduce (through SGLang's own communicator) against NCCL with
each protocol, on each server's GPU group, at decode and prefill sizes, every call verified.

The same harness as ``make calibrate``'s ``allreduce`` decision (``dsv4_sm120.calibrate.allreduce``): one set of
processes per method and server (one per GPU, the servers' environment, ``NCCL_PROTO`` / ``NCCL_ALGO`` set before
NCCL starts), CUDA-graph replay, the exact float64 check on every rank, each run bounded in time. Rows go to
``--results`` (default ``DSV4_SM120_CACHE/bench/allreduce.csv``, outside the tracked tree; the project's own rows: ``--results bench/results/allreduce.csv``; subject ``allreduce``); the choice per server is printed, not
recorded (``make calibrate`` records it in the machine profile). Groups and sizes come from the serve settings
(``PREFILL_GPUS``, ``DECODE_GPUS``, ``MAX_RUNNING``, ``CHUNKED_PREFILL_SIZE``, ``MODEL_PATH``'s hidden size),
overridable here. Needs 2 or more GPUs; ``--dry-run`` lists the rows without one; ``--device cpu`` runs the gloo
stand-in (two CPU processes, tiny sizes: the harness only).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "overlay"))

from dsv4_sm120.dev import bench_results as R  # noqa: E402
from dsv4_sm120 import hints  # noqa: E402
from dsv4_sm120.calibrate import allreduce as A  # noqa: E402
from dsv4_sm120.machine_profile.allreduce_choice import ROLES, MethodError, parse_methods  # noqa: E402

PROG = "bench_allreduce"


class Progress:
    def step(self, what: str, units: int = 1) -> None:
        print(f"[{PROG}] {what}", file=sys.stderr, flush=True)


def _ints(opt: str, text: Optional[str]) -> Optional[List[int]]:
    if text is None:
        return None
    try:
        v = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        v = []
    if not v or v[0] < 0 or (opt.endswith("rows") and v[0] < 1):
        raise ValueError(f"--{opt} {text!r}: expected a comma list of {'positive ' if 'rows' in opt else ''}integers")
    return v


def parse_args(argv: Optional[List[str]]):
    ap = argparse.ArgumentParser(prog="bench/bench_allreduce.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default=",".join(ROLES), help="prefill, decode or both (default both)")
    ap.add_argument("--methods", default=None, help=f"comma list (default {','.join(A.DEFAULT_METHODS)}; "
                    "nccl_<LL|LL128|Simple>[_<Ring|Tree>], nccl = NCCL's own choice)")
    ap.add_argument("--prefill-gpus", help="GPU indices of the prefill group (default PREFILL_GPUS)")
    ap.add_argument("--decode-gpus", help="GPU indices of the decode group (default DECODE_GPUS)")
    ap.add_argument("--prefill-rows", help="rows to reduce on prefill (default powers of two up to the chunk)")
    ap.add_argument("--decode-rows", help="rows to reduce on decode (default powers of two up to MAX_RUNNING x "
                    "draft tokens)")
    ap.add_argument("--hidden", type=int, help="hidden size (default: MODEL_PATH's config.json, 4096 for V4-Flash)")
    ap.add_argument("--quick", action="store_true", help="fewer sizes")
    ap.add_argument("--reps", type=int, default=5, help="timed samples per size (median)")
    ap.add_argument("--timeout", type=float, default=A.LAUNCH_TIMEOUT_S, help="seconds per method and server")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the gloo stand-in (harness)")
    ap.add_argument("--results", type=Path, default=R.user_results("allreduce"),
                    help="results file to append to (default: DSV4_SM120_CACHE/bench/allreduce.csv, outside the tree)")
    ap.add_argument("--dry-run", action="store_true", help="list the rows it would write; no GPU")
    return ap.parse_args(argv)


def make_plan(a) -> A.Plan:
    from dsv4_sm120.calibrate.deployment import DeploymentError, from_env

    roles = [r.strip() for r in a.servers.split(",") if r.strip()]
    if not roles or any(r not in ROLES for r in roles):
        raise ValueError(f"--servers {a.servers!r}: expected prefill, decode or both")
    methods = parse_methods(a.methods) if a.methods is not None else None
    rows = {k: v for k, v in (("prefill", _ints("prefill-rows", a.prefill_rows)),
                              ("decode", _ints("decode-rows", a.decode_rows))) if v}
    gpus = {k: v for k, v in (("prefill", _ints("prefill-gpus", a.prefill_gpus)),
                              ("decode", _ints("decode-gpus", a.decode_gpus))) if v}
    try:
        dep = from_env(os.environ)
    except DeploymentError as e:
        raise ValueError(str(e)) from None
    hidden = a.hidden or dep.hidden
    if hidden <= 0:
        raise ValueError(f"--hidden {hidden}: expected a positive integer")
    plan = A.build_plan(os.environ, hidden, dep.draft_tokens, a.device, a.quick, methods, roles, rows, gpus)
    plan.reps, plan.timeout_s = max(1, a.reps), a.timeout
    return plan


def rows_of(server: A.Server, res: dict, info: Dict[str, str]) -> List[dict]:
    out = []
    shape = {"tp": server.world, "gpus": ",".join(map(str, server.gpus)) or "cpu", "hidden": server.hidden,
             "dtype": server.dtype}
    for r, size in (res.get("sizes") or {}).items():
        for m, o in size["candidates"].items():
            us = o.get("us") if o.get("status") == "ok" else None
            meta = (res.get("methods", {}).get(m) or {}).get("info") or {}
            notes = [f"{k}={v}" for k, v in (("timing", o.get("timing")), ("calls", o.get("calls")),
                                              ("workspace_numel", o.get("workspace_numel")),
                                              ("backend", meta.get("backend")), ("nccl", meta.get("nccl")),
                                              ("chosen", 1 if size.get("chosen") == m else None)) if v]
            if o.get("status") != "ok":
                notes.append("error=" + f"{o.get('status')}: {o.get('reason', '')}".replace(";", ","))
            busbw = size["bytes"] * 2 * (server.world - 1) / server.world / (us * 1e-6) / 1e9 if us else None
            out.append(dict(case=server.role, impl=m, rows=int(r), bytes=size["bytes"], us=us, gbps=busbw,
                            rel_err=o.get("err"), notes=";".join(notes), **shape, **info))
    return out


def print_table(role: str, res: dict) -> None:
    methods = list(res.get("methods") or {})
    print(f"# {role}: " + (A.summary_lines({"servers": {role: res}}) or [""])[0])
    if res.get("status") != "ok":
        return
    print(f"{'rows':>6} {'KiB':>9} " + " ".join(f"{m:>13}" for m in methods) + "  runs")
    for r, size in res["sizes"].items():
        cells = []
        for m in methods:
            o = size["candidates"][m]
            cells.append(f"{o['us']:>13.1f}" if o.get("status") == "ok" else f"{o.get('status'):>13}")
        print(f"{r:>6} {size['bytes'] / 1024:>9g} " + " ".join(cells) + f"  {size.get('chosen') or '-'}")


def main(argv: Optional[List[str]] = None) -> int:
    a = parse_args(argv)
    try:
        plan = make_plan(a)
    except (ValueError, MethodError, A.AllreduceError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    command = "python bench/bench_allreduce.py " + " ".join(shlex.quote(x) for x in (argv if argv is not None
                                                                                    else sys.argv[1:]))
    if a.dry_run:
        print("\n".join("# " + x for x in A.dry_run_lines(plan)))
        for s in plan.servers:
            res = {"sizes": {str(r): {"bytes": r * s.hidden * 2, "candidates": {m: {"status": "ok"} for m in
                                                                             plan.methods}} for r in s.rows}}
            for row in rows_of(s, res, {"date": R.now(), "command": command}):
                print(R.csv_line("allreduce", R.make_row("allreduce", **row)))
        return 0
    visible = 0
    if a.device == "cuda":
        bad = R.missing_gpu(PROG, ("torch",))
        if bad:
            print(bad, file=sys.stderr)
            return 2
        visible = A.visible_gpus()
        if visible < 2:
            print(f"{PROG}: error: an all-reduce needs 2 or more GPUs; this box has {visible} "
                  f"({hints.args('--dry-run')} lists the rows)", file=sys.stderr)
            return 2
    elif R.commit_env_error(PROG):
        print(R.commit_env_error(PROG), file=sys.stderr)
        return 2
    try:
        env = A.base_env(os.environ)
    except A.AllreduceError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print("\n".join("# " + x for x in A.dry_run_lines(plan)))
    info = R.environment(REPO, command)
    if a.device == "cpu":
        info["gpu"] = "cpu (gloo stand-in)"
    written, measured = 0, 0
    for s in plan.servers:
        res = A.measure_server(s, plan, env, visible, Progress())
        print_table(s.role, res)
        if res.get("status") == "ok":
            measured += 1
            written += R.append_rows(a.results, "allreduce", rows_of(s, res, info))
    print(f"# {written} rows appended to {a.results}; make calibrate records the choice in the machine profile")
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
