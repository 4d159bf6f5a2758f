"""The ``allreduce`` decision: which TP all-reduce each server runs, measured on its own GPU group.

Per server of the serve plan (prefill on ``PREFILL_GPUS``, decode on ``DECODE_GPUS``, TP = their count) and per
method (``pcie_ipc``: FlashInfer's PCIe-IPC all-reduce through SGLang's ``PcieIpcCommunicator``; ``nccl``: NCCL's
own protocol choice; ``nccl_LL`` / ``nccl_LL128`` / ``nccl_Simple``: one forced ``NCCL_PROTO``; ``nccl_LL_Ring``:
today's ``serve/env/10-nccl.env``), one set of processes, one per GPU
(:mod:`dsv4_sm120.calibrate.allreduce_worker`), in the servers' environment (``serve/env/*.env``, the caller's
values winning) with the method's ``NCCL_PROTO`` / ``NCCL_ALGO`` set before any communicator exists. Each run is
bounded (:data:`LAUNCH_TIMEOUT_S`): a hang or a crash is that method's failure, with its reason, at the size it
reached. Sizes are rows x the checkpoint's hidden size, bf16:

* decode: rows 1 up to ``MAX_RUNNING`` (the captured max batch) x the MTP draft tokens, powers of two and both
  ends (what SGLang sizes its own IPC workspace for);
* prefill: powers of two from 1 row up to the prefill chunk (``CHUNKED_PREFILL_SIZE``, else SGLang's default
  for a 90-160 GB card, 8192): short prompts reduce few rows, long ones whole chunks.

The IPC method builds one workspace per tier (the decode width, then the chunk), each size timed with the
smallest tier that holds it. :mod:`dsv4_sm120.machine_profile.allreduce_choice` makes the choice; :mod:`dsv4_sm120.serving.allreduce_env` turns it into a
server's environment; docs/pcie.md describes the whole.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional

from ..machine_profile.allreduce_choice import (DEFAULT_METHODS, GLOO, IPC, ROLES, choose, describe_nccl, fastest, ipc_numel,
                               parse_method)
from ..paths import OVERLAY_DIR, repo_root

WORKER = "dsv4_sm120.calibrate.allreduce_worker"
LAUNCH_TIMEOUT_S = 600.0     # one method on one group: process start, NCCL/IPC set-up (FlashInfer's first JIT
                             # build and autotune included), every size
KILL_GRACE_S = 15.0          # after one rank exits with an error, the others (waiting in a collective) get this
SGLANG_DEFAULT_CHUNK = 8192  # SGLang 0.5.23's chunked_prefill_size for a 90-160 GB GPU (the RTX PRO 6000: 96 GB)
IPC_WORLD_SIZES = (2, 4, 8)
NOT_OURS = ("NCCL_PROTO", "NCCL_ALGO", "NCCL_DEBUG_SUBSYS", "SGLANG_PCIE_IPC_MAX_NUMEL",
            "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE")
NOTE = ("µs per all-reduce of rows x hidden bf16 on each server's GPU group (CUDA-graph replay of 8 calls, "
        "median, slowest rank); every call verified exactly against the float64 sum on every rank.")


class AllreduceError(ValueError):
    """Bad settings or arguments for the all-reduce measurement (one line)."""


@dataclass
class Server:
    role: str
    gpus: List[int]
    world: int
    rows: List[int]
    hidden: int
    tiers: List[int]
    dtype: str = "bf16"
    where: str = ""


@dataclass
class Plan:
    servers: List[Server]
    methods: List[str]
    device: str = "cuda"
    calls: int = 8
    target_ms: float = 20.0
    reps: int = 5
    max_iters: int = 2000
    timeout_s: float = LAUNCH_TIMEOUT_S
    seed: int = 0
    fault: Optional[dict] = None         # tests only: see allreduce_worker.Ctx.fault
    notes: List[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- sizes and plan

def _pow2_upto(n: int, step: int = 2) -> List[int]:
    out, r = [], 1
    while r <= n:
        out.append(r)
        r *= step
    return out


def decode_rows(max_bs: int, draft: int, quick: bool = False) -> List[int]:
    top = max_bs * max(1, draft)
    rows = set(_pow2_upto(top, 4 if quick else 2)) | {top} | (set() if quick else {max_bs})
    return sorted(rows)


def prefill_rows(chunk: int, quick: bool = False) -> List[int]:
    return sorted(set(_pow2_upto(chunk, 4 if quick else 2)) | {chunk})


def _int(s: Mapping[str, str], key: str, default: Optional[int], lo: int, hi: int) -> int:
    text = (s.get(key) or "").strip()
    if not text and default is not None:
        return default
    try:
        v = int(text)
    except ValueError:
        raise AllreduceError(f"{key}={text!r}: expected an integer {lo}..{hi}") from None
    if not lo <= v <= hi:
        raise AllreduceError(f"{key}={v}: expected {lo}..{hi}")
    return v


def build_plan(environ: Mapping[str, str], hidden: int, draft: int, device: str = "cuda", quick: bool = False,
               methods: Optional[List[str]] = None, roles=ROLES, rows: Optional[Dict[str, List[int]]] = None,
               gpus: Optional[Dict[str, List[int]]] = None) -> Plan:
    """The servers, sizes and methods from the serve settings (``MAX_RUNNING``, ``CHUNKED_PREFILL_SIZE``,
    ``PREFILL_GPUS``, ``DECODE_GPUS``); ``rows`` / ``gpus`` override per role. ``device="cpu"``: the gloo
    stand-in, two processes per server at tiny sizes (tests)."""
    from dsv4_sm120.serving.plan import ConfigError, parse_gpus, settings_from_env

    s = settings_from_env(environ)
    rows, gpus = dict(rows or {}), dict(gpus or {})
    max_bs = _int(s, "MAX_RUNNING", 16, 1, 4096)
    chunk = _int(s, "CHUNKED_PREFILL_SIZE", SGLANG_DEFAULT_CHUNK, 1, 1 << 20)
    if device == "cpu":
        hidden, where = 64, "gloo stand-in: 2 CPU processes, tiny sizes"
        servers = [Server(r, [], 2, rows.get(r) or ([1, 2, 4] if r == "decode" else [1, 8]), hidden,
                          [ipc_numel(8, hidden)], where=where) for r in roles]
        return Plan(servers, list(methods or [GLOO]), device="cpu", calls=1, target_ms=1.0, reps=2, max_iters=50)
    servers = []
    dmax = max_bs * max(1, draft)
    for role in roles:
        try:
            g = gpus.get(role) or parse_gpus(f"{role.upper()}_GPUS", s[f"{role.upper()}_GPUS"])
        except ConfigError as e:
            raise AllreduceError(str(e)) from None
        if role == "decode":
            r = rows.get(role) or decode_rows(max_bs, draft, quick)
            where = f"MAX_RUNNING {max_bs} x {max(1, draft)} draft tokens"
        else:
            r = rows.get(role) or prefill_rows(chunk, quick)
            where = (f"chunk {chunk} (CHUNKED_PREFILL_SIZE)" if (s.get("CHUNKED_PREFILL_SIZE") or "").strip()
                     else f"chunk {chunk}: SGLang's default on a 90-160 GB GPU (CHUNKED_PREFILL_SIZE sets it)")
        tiers = sorted({ipc_numel(min(dmax, max(r)), hidden), ipc_numel(max(r), hidden)})
        servers.append(Server(role, list(g), len(g), sorted(set(r)), hidden, tiers, where=where))
    return Plan(servers, list(methods or DEFAULT_METHODS))


def _size_text(n_bytes: int) -> str:
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n_bytes >= k:
            return f"{n_bytes / k:g} {unit}"
    return f"{n_bytes} B"


def dry_run_lines(plan: Plan) -> List[str]:
    out = []
    for s in plan.servers:
        group = f"GPUs {','.join(map(str, s.gpus))} (TP{s.world})" if s.gpus else f"{s.world} processes"
        out.append(f"allreduce.{s.role}: {group}: rows {','.join(map(str, s.rows))} x hidden {s.hidden} {s.dtype} "
                   f"({_size_text(s.rows[0] * s.hidden * 2)} .. {_size_text(s.rows[-1] * s.hidden * 2)}; {s.where}); "
                   f"IPC workspace tiers {', '.join(map(str, s.tiers))} elements")
    out.append(f"allreduce: methods {', '.join(plan.methods)}; one set of processes per method and server "
               f"(NCCL_PROTO / NCCL_ALGO set before NCCL starts), each bounded by {plan.timeout_s:.0f} s")
    return out


# ----------------------------------------------------------------------------- environment

def base_env(environ: Mapping[str, str]) -> Dict[str, str]:
    """What a server process gets: the caller's environment plus ``serve/env/*.env`` where the caller is silent."""
    from dsv4_sm120.serving.envfiles import EnvFileError, load_env_dir

    env = dict(environ)
    d = repo_root() / "serve" / "env"
    if d.is_dir():
        try:
            for k, v, _ in load_env_dir(d, environ):
                env.setdefault(k, v)
        except EnvFileError as e:
            raise AllreduceError(str(e)) from None
    return env


def method_env(base: Mapping[str, str], method: str, server: Server, device: str) -> Dict[str, str]:
    m = parse_method(method)
    env = {k: v for k, v in base.items() if k not in NOT_OURS}
    if m["proto"]:
        env["NCCL_PROTO"] = m["proto"]
    if m["algo"]:
        env["NCCL_ALGO"] = m["algo"]
    if m["kind"] == "nccl":   # NCCL then logs "NCCL_PROTO set by environment to ..." (checked by the launcher)
        env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="ENV")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, server.gpus)) if device == "cuda" else ""
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["PYTHONPATH"] = os.pathsep.join([str(OVERLAY_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                            if p])
    return env


def visible_gpus() -> int:
    """GPUs on this box, by nvidia-smi's index (the plan's numbering); torch's count without nvidia-smi."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)
        if r.returncode == 0:
            return len([x for x in r.stdout.splitlines() if x.strip()])
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


# ----------------------------------------------------------------------------- one method on one group

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _events(path: Path) -> List[dict]:
    out = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)   # the rank and anything it started (own session)
            except OSError:
                pass
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def _wait(procs, timeout_s: float, rank0: Path, on_size: Callable[[dict], None]) -> tuple:
    """(timed out?, seconds): poll until every rank exits, the limit passes, or a rank failed and the others
    outlived the grace period; rank 0's size events reach ``on_size`` as they come."""
    t0, seen, failed_at = time.monotonic(), 0, None
    while True:
        codes = [p.poll() for p in procs]
        ev = [e for e in _events(rank0) if e.get("event") == "size"]
        for e in ev[seen:]:
            on_size(e)
        seen = len(ev)
        now = time.monotonic()
        if all(c is not None for c in codes):
            return False, now - t0
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if now - t0 > timeout_s:
            return True, now - t0
        if failed_at is not None and now - failed_at > KILL_GRACE_S:
            return False, now - t0
        time.sleep(0.2)


def _tail(path: Path) -> str:
    try:
        lines = [x.strip() for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return next((x for x in reversed(lines) if "Error" in x or "error" in x), lines[-1] if lines else "")[:300]


def launch(server: Server, method: str, plan: Plan, env: Mapping[str, str],
           on_size: Callable[[dict], None] = lambda e: None, worker: Optional[List[str]] = None) -> dict:
    """Run ``method`` on ``server``'s group: ``{"status", "reason", "info", "wall_s", "sizes": {rows: outcome}}``;
    never raises for what happens in the ranks."""
    m = parse_method(method)
    job = {"kind": m["kind"], "device": plan.device, "rows": server.rows, "hidden": server.hidden,
           "dtype": server.dtype, "ipc_tiers": server.tiers, "calls": plan.calls, "target_ms": plan.target_ms,
           "reps": plan.reps, "max_iters": plan.max_iters, "seed": plan.seed, "timeout_s": plan.timeout_s,
           "fault": plan.fault}
    argv = list(worker or [sys.executable, "-m", WORKER])
    with tempfile.TemporaryDirectory(prefix="dsv4_allreduce_") as tmp:
        d = Path(tmp)
        (d / "job.json").write_text(json.dumps(job))
        port, procs, files = _free_port(), [], []
        try:
            for r in range(server.world):
                out, err = open(d / f"rank{r}.out", "w"), open(d / f"rank{r}.err", "w")
                files += [out, err]
                e = dict(env, RANK=str(r), WORLD_SIZE=str(server.world), LOCAL_RANK=str(r),
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                procs.append(subprocess.Popen(argv + [str(d / "job.json")], stdout=out, stderr=err, env=e,
                                              cwd=tmp, start_new_session=True))
            timed_out, wall = _wait(procs, plan.timeout_s, d / "rank0.out", on_size)
        finally:
            _kill(procs)
            for f in files:
                f.close()
        events = [_events(d / f"rank{r}.out") for r in range(server.world)]
        errs = [(d / f"rank{r}.err") for r in range(server.world)]
        res = collect(server, m, events, timed_out, [p.returncode for p in procs], [_tail(p) for p in errs],
                      plan.timeout_s)
        if m["proto"] and res["status"] == "ok":
            seen = any(f"NCCL_PROTO set by environment to {m['proto']}" in p.read_text(errors="replace")
                       for p in errs if p.is_file())
            res["info"]["nccl_reported_proto"] = seen
    res["wall_s"] = round(wall, 1)
    return res


def collect(server: Server, m: dict, events: List[List[dict]], timed_out: bool, codes: List[Optional[int]],
            tails: List[str], timeout_s: float) -> dict:
    """The per-size outcomes of one run from its ranks' events, exit codes and stderr tails."""
    ev0 = events[0] if events else []
    head = next((e for e in ev0 if e.get("event") == "method"), None)
    errors = [(r, e["error"]) for r, evs in enumerate(events) for e in evs if e.get("event") == "error"]
    crashed = [(r, c) for r, c in enumerate(codes) if c not in (0, None, -signal.SIGKILL)]
    if timed_out:
        stop = f"timed out after {timeout_s:.0f} s"
    elif errors:
        stop = f"rank {errors[0][0]}: {errors[0][1]}"
    elif crashed:
        r, c = crashed[0]
        stop = f"rank {r} exited with code {c}" + (f": {tails[r]}" if tails[r] else "")
    else:
        stop = "the ranks ended without a result"
    if head is None or head.get("status") != "ok":
        status = head.get("status", "failed") if head else "failed"
        reason = (head or {}).get("reason") or stop
        if head is None and timed_out and m["kind"] == IPC:
            reason += " before the method was ready (FlashInfer's first JIT build and autotune can take minutes)"
        return {"status": status, "reason": reason, "info": (head or {}).get("info", {}),
                "sizes": {r: {"status": status, "reason": reason} for r in server.rows}}
    got = {e["rows"]: {k: v for k, v in e.items() if k not in ("event", "rows") and v is not None}
           for e in ev0 if e.get("event") == "size"}
    started = [e["rows"] for e in ev0 if e.get("event") == "start"]
    done = any(e.get("event") == "done" for e in ev0)
    last = started[-1] if started else None
    sizes = {}
    for r in server.rows:
        if r in got:
            sizes[r] = got[r]
        elif r == last and not done:
            sizes[r] = {"status": "failed", "reason": f"{stop} at rows {r}"}
        else:
            why = f"it failed at rows {last}" if done else stop
            sizes[r] = {"status": "failed", "reason": f"not measured: the run stopped at rows {last} ({why})"}
    info = next((e.get("info") for e in reversed(ev0) if e.get("event") == "done"), head.get("info", {})) or {}
    return {"status": "ok" if done else "failed", "reason": "" if done else stop, "info": dict(info),
            "sizes": sizes}


# ----------------------------------------------------------------------------- a server, the decision

def server_unavailable(server: Server, plan: Plan, visible: int) -> Optional[str]:
    if server.world < 2:
        return f"TP{server.world}: no all-reduce to choose"
    if plan.device == "cuda" and max(server.gpus) >= visible:
        return f"GPUs {','.join(map(str, server.gpus))} are not all on this box ({visible} visible)"
    return None


def method_unavailable(method: str, server: Server, plan: Plan) -> Optional[str]:
    kind = parse_method(method)["kind"]
    if kind == GLOO:
        return None if plan.device == "cpu" else "the CPU stand-in (--device cpu only)"
    if plan.device != "cuda":
        return f"{method} needs CUDA GPUs"
    if kind == IPC:
        if server.world not in IPC_WORLD_SIZES:
            return (f"FlashInfer's PCIe-IPC all-reduce runs at {', '.join(map(str, IPC_WORLD_SIZES))} ranks, "
                    f"not TP{server.world}")
        missing = [p for p in ("sglang", "flashinfer") if importlib.util.find_spec(p) is None]
        if missing:
            return f"{' and '.join(missing)} not installed in this environment"
    return None


def measure_server(server: Server, plan: Plan, env: Mapping[str, str], visible: int, progress=None,
                   launcher: Optional[Callable] = None) -> dict:
    """Every method on one server's group (``launcher``, default :func:`launch`), then its choice
    (:func:`dsv4_sm120.machine_profile.allreduce_choice.choose`)."""
    launcher = launcher or launch
    res = {"gpus": server.gpus, "tp": server.world, "hidden": server.hidden, "dtype": server.dtype,
           "device": plan.device, "where": server.where, "methods": {}, "sizes": {}, "choice": None}
    step = progress.step if progress else (lambda what, units=1: None)
    why = server_unavailable(server, plan, visible)
    if why:
        step(f"allreduce {server.role}: unavailable: {why}", len(server.rows) * len(plan.methods))
        return {**res, "status": "unavailable", "reason": why}
    measured = {k: v for k, v in method_env(env, "nccl", server, plan.device).items()
                if k.startswith("NCCL_") and k not in NOT_OURS + ("NCCL_DEBUG",)}
    per_rows: Dict[int, Dict[str, dict]] = {r: {} for r in server.rows}
    for method in plan.methods:
        why = method_unavailable(method, server, plan)
        if why:
            run = {"status": "unavailable", "reason": why, "sizes": {r: {"status": "unavailable", "reason": why}
                                                                     for r in server.rows}}
            step(f"allreduce {server.role} {method}: unavailable: {why}", len(server.rows))
        else:
            count = [0]

            def on_size(e, method=method, count=count):
                count[0] += 1
                detail = f"{e['us']:.1f} us" if e.get("status") == "ok" else f"{e.get('status')}: {e.get('reason')}"
                step(f"allreduce {server.role} {method} rows={e.get('rows')}: {detail}")
            run = launcher(server, method, plan, method_env(env, method, server, plan.device), on_size)
            if len(server.rows) > count[0]:
                step(f"allreduce {server.role} {method}: {run['status']} {run.get('reason', '')}".rstrip(),
                     len(server.rows) - count[0])
        res["methods"][method] = {k: run[k] for k in ("status", "reason", "info", "wall_s") if run.get(k)}
        for r in server.rows:
            per_rows[r][method] = run["sizes"][r]
    choice = choose(per_rows, server.hidden)
    res["sizes"] = {str(r): {"numel": r * server.hidden, "bytes": r * server.hidden * 2,
                             "winner": fastest(per_rows[r]), "chosen": (choice.get("per_size") or {}).get(str(r)),
                             "candidates": per_rows[r]} for r in server.rows}
    return {**res, "status": "ok", "env": measured, "choice": choice}


def calibrate(plan: Plan, env: Mapping[str, str], visible: int, progress=None,
              launcher: Optional[Callable] = None) -> dict:
    """The decision entry of the machine profile (schema: docs/pcie.md; validated by
    :func:`dsv4_sm120.machine_profile.allreduce_choice.validate_entry`)."""
    return {"bucket_kind": "rows", "default": "nccl", "note": NOTE, "methods": plan.methods,
            "timing": {"calls": plan.calls, "target_ms": plan.target_ms, "reps": plan.reps},
            "servers": {s.role: measure_server(s, plan, env, visible, progress, launcher) for s in plan.servers}}


def units(plan: Plan) -> int:
    return sum(len(s.rows) * len(plan.methods) for s in plan.servers)


def summary_lines(entry: Mapping) -> List[str]:
    """One line per server: its choice, or why there is none."""
    out = []
    for role, s in entry.get("servers", {}).items():
        group = f"GPUs {','.join(map(str, s.get('gpus') or []))}, TP{s.get('tp')}" if s.get("gpus") else \
            f"TP{s.get('tp')}"
        c = s.get("choice") or {}
        if s.get("status") != "ok":
            out.append(f"allreduce.{role} ({group}): {s.get('status')}: {s.get('reason')}")
        elif c.get("status") != "ok":
            out.append(f"allreduce.{role} ({group}): no choice: {c.get('reason')}")
        else:
            out.append(f"allreduce.{role} ({group}): {c['reason']}"
                       + (f" (SGLANG_PCIE_IPC_MAX_NUMEL={c['ipc_max_numel']}); with IPC off: "
                          f"{describe_nccl(c['nccl_only']['nccl'])}" if c["ipc_max_numel"] else ""))
    return out
