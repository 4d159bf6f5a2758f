"""One rank of the all-reduce measurement: ``python -m dsv4_sm120.calibrate.allreduce_worker JOB.json``.

Started by :mod:`dsv4_sm120.calibrate.allreduce`, one process per GPU of a group (torchrun's variables:
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; every rank sees the group's GPUs and
uses ``cuda:LOCAL_RANK``, as SGLang's TP workers do). One method per run, so ``NCCL_PROTO`` / ``NCCL_ALGO`` are in
the process environment before any communicator exists. The methods, as the servers run them:

* ``nccl*``: SGLang's ``PyNcclCommunicator`` (its own NCCL binding: the communicator the decode server captures in
  its CUDA graphs), in place; ``torch.distributed``'s NCCL group where SGLang does not import;
* ``pcie_ipc``: SGLang's ``PcieIpcCommunicator`` over FlashInfer's PCIe-IPC workspace, out of place, built and
  autotuned by its own ``prepare`` with ``SGLANG_PCIE_IPC_MAX_NUMEL`` set to the job's workspace tier;
* ``gloo``: ``torch.distributed`` on CPU tensors (the stand-in the CPU tests run).

Per size (rows x hidden, ascending): one eager call, then a CUDA graph of one call and one of ``calls`` calls
(captured as the decode server captures), each verified: every rank fills a known integer pattern (values in
-15..15, different per rank and per pass), output buffers are poisoned with NaN, and the result must equal the
float64 host sum on every element (every partial sum is an integer below 256 in magnitude, exact in bf16
whatever the reduction order, so the check is exact). Timing: graph replays between CUDA events, ``reps``
samples of enough replays for ``target_ms``, the median per call, the slowest rank's. The graph is verified once
more after timing. Decisions that change what a rank does next (skip, iterations) are agreed over the gloo
group first, so the ranks never issue different collectives.

Prints JSON lines on stdout: ``method`` (rank 0: ok / unavailable / failed, backend, versions), ``start`` and
``size`` per size (rank 0), ``error`` (any rank), ``done``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Callable, List, Optional

PATTERN_MOD, PATTERN_HALF = 31, 15
MAX_RANKS = 16                     # 15 x 16 = 240 < 256: sums stay exact in bf16


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0][:300] if s else ''}".rstrip(": ")


# ----------------------------------------------------------------------------- pattern and verification

def _values(idx, rank: int, seed: int):
    return (idx * 2654435761 + (rank + 1) * 40503 + seed * 9973) % PATTERN_MOD - PATTERN_HALF


def pattern(n: int, rank: int, seed: int, device, dtype):
    """Rank ``rank``'s integer pattern of ``n`` elements, built on ``device``."""
    import torch

    return _values(torch.arange(n, dtype=torch.int64, device=device), rank, seed).to(dtype)


def expected_sum(n: int, world: int, seed: int):
    """The float64 sum over ranks of the patterns, on the host."""
    import torch

    idx = torch.arange(n, dtype=torch.int64)
    total = torch.zeros(n, dtype=torch.float64)
    for r in range(world):
        total += _values(idx, r, seed).to(torch.float64)
    return total


def check(out, want) -> dict:
    """Exact comparison of ``out`` with the float64 sum: mismatching elements, max |diff| (inf for NaN), the
    first bad element."""
    import torch

    o = out.detach().reshape(-1).to("cpu", torch.float64)
    if o.numel() != want.numel():
        return {"mismatches": want.numel(), "max_abs": math.inf, "err": math.inf, "first": None,
                "why": f"output has {o.numel()} elements, expected {want.numel()}"}
    d = (o - want).abs()
    bad = ~(d == 0)
    n_bad = int(bad.sum())
    max_abs = float(torch.nan_to_num(d, nan=math.inf).max()) if d.numel() else 0.0
    res = {"mismatches": n_bad, "max_abs": max_abs,
           "err": max_abs / max(float(want.abs().max()) if want.numel() else 1.0, 1.0), "first": None}
    if n_bad:
        i = int(bad.nonzero()[0])
        res.update(first=i, got=float(o[i]), want=float(want[i]))
    return res


def verdict(per_rank: List[dict], what: str, numel: int) -> Optional[str]:
    """The rejection reason from every rank's :func:`check` results, None when all are exact."""
    for r, res in enumerate(per_rank):
        if res["mismatches"]:
            at = f" (first at element {res['first']}: got {res['got']:g}, want {res['want']:g})" \
                if res.get("first") is not None else f" ({res.get('why')})"
            return (f"{what}: rank {r} has {res['mismatches']} of {numel} elements off the float64 sum, max "
                    f"|diff| {res['max_abs']:g}{at}")
    return None


# ----------------------------------------------------------------------------- timing

def time_loop(run: Callable[[], None], timer: Callable[[Callable[[], None], int], float],
              agree_max: Callable[[float], float], barrier: Callable[[], None], *, calls: int, target_s: float,
              reps: int, max_iters: int) -> tuple:
    """(seconds per call, iterations per sample): ``run`` does ``calls`` all-reduces; the iterations come from
    one timed run (the slowest rank's, so every rank runs the same count), then ``reps`` samples, each after a
    barrier and one untimed run; the median sample per call, the slowest rank's."""
    once = agree_max(timer(run, 1))
    iters = int(max(1, min(max_iters, math.ceil(target_s / max(once, 1e-9)))))
    samples = []
    for _ in range(max(1, reps)):
        barrier()
        run()
        samples.append(timer(run, iters) / iters)
    return agree_max(statistics.median(samples) / calls), iters


def wall_timer(run, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        run()
    return time.perf_counter() - t0


def cuda_timer(run, n: int) -> float:
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        run()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3


# ----------------------------------------------------------------------------- methods

class _Logs(logging.Handler):
    """SGLang's IPC adapter says why it stays off, and what its autotune covered, only in its log."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: List[tuple] = []

    def emit(self, record):
        self.records.append((record.levelno, record.getMessage()))

    def warnings(self) -> str:
        return "; ".join(m for lv, m in self.records if lv >= logging.WARNING)


class Method:
    inplace = True
    info: dict

    def __init__(self, job: dict, rank: int, world: int, device):
        self.job, self.rank, self.world, self.device = job, rank, world, device
        self.info = {}

    def setup(self) -> Optional[str]:
        return None

    def begin_size(self, numel: int) -> Optional[str]:
        """Per size, before the calls (collective: every rank calls it); an unavailable reason or None."""
        return None

    def call(self, x):
        raise NotImplementedError

    def close(self) -> None:
        pass


class Gloo(Method):
    def call(self, x):
        import torch.distributed as dist

        dist.all_reduce(x)
        return x


class Nccl(Method):
    def setup(self):
        import torch
        import torch.distributed as dist

        self.comm = self.group = None
        if self.job.get("backend", "auto") in ("auto", "pynccl"):
            try:
                from sglang.srt.distributed.device_communicators.pynccl import PyNcclCommunicator
            except Exception as e:  # noqa: BLE001
                if self.job.get("backend") == "pynccl":
                    return f"SGLang's PyNcclCommunicator does not import: {first_line(e)}"
            else:
                self.comm = PyNcclCommunicator(group=dist.group.WORLD, device=self.device)
                if not getattr(self.comm, "available", False):
                    return "SGLang's PyNcclCommunicator found no NCCL library"
                self._state = self.comm.change_state(enable=True)
                self._state.__enter__()
                self.info.update(backend="pynccl", nccl=str(self.comm.nccl.ncclGetVersion()))
                return None
        self.group = dist.new_group(backend="nccl")
        v = torch.cuda.nccl.version()
        self.info.update(backend="torch.distributed", nccl=".".join(map(str, v)) if isinstance(v, tuple) else str(v))
        return None

    def call(self, x):
        if self.comm is not None:
            self.comm.all_reduce(x)
        else:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x


class PcieIpc(Method):
    inplace = False

    def setup(self):
        import torch.distributed as dist

        try:
            from sglang.srt.distributed.device_communicators import pcie_ipc_ar
        except Exception as e:  # noqa: BLE001
            return f"SGLang's pcie_ipc_ar does not import: {first_line(e)}"
        self.mod, self.comm, self.tier = pcie_ipc_ar, None, 0
        self.logs = _Logs()
        log = logging.getLogger(pcie_ipc_ar.__name__)
        log.setLevel(logging.INFO)
        log.addHandler(self.logs)
        self.group = dist.new_group(backend="nccl")   # the IPC handshake runs on the device group, as in SGLang
        try:
            from importlib.metadata import version

            self.info.update(backend="sglang PcieIpcCommunicator", flashinfer=version("flashinfer-python"))
        except Exception:  # noqa: BLE001
            self.info.update(backend="sglang PcieIpcCommunicator")
        return None

    def begin_size(self, numel):
        import torch.distributed as dist

        tier = next((t for t in self.job["ipc_tiers"] if t >= numel), None)
        if tier is None:
            return f"beyond the largest workspace tier ({self.job['ipc_tiers'][-1]} elements)"
        if tier != self.tier:
            if self.comm is not None:
                self.comm.destroy()
            os.environ["SGLANG_PCIE_IPC_MAX_NUMEL"] = str(tier)
            self.logs.records.clear()
            self.comm = self.mod.PcieIpcCommunicator(group=self.group, device=self.device,
                                                     cpu_group=dist.group.WORLD)
            self.tier = tier
            if self.comm.disabled:
                return self.logs.warnings() or f"SGLang left it off (world size {self.world})"
            self.comm.prepare(hidden=self.job["hidden"])
            if self.comm._workspace is None:
                return "workspace not built: " + (self.logs.warnings() or "no reason logged")
            self.info[f"tuning_{tier}"] = [m for _, m in self.logs.records if "autotun" in m.lower()][-1:]
        return None

    def admits(self, x) -> Optional[str]:
        if self.comm is None or not self.comm.should_pcie_ipc_ar(x):
            return f"SGLang would not route a {tuple(x.shape)} tensor to it (workspace {self.tier} elements)"
        return None

    def call(self, x):
        return self.comm.pcie_ipc_all_reduce(x)

    def close(self):
        if getattr(self, "comm", None) is not None:
            self.comm.destroy()


def make_method(job: dict, rank: int, world: int, device) -> Method:
    kind = job["kind"]
    return {"gloo": Gloo, "nccl": Nccl, "pcie_ipc": PcieIpc}[kind](job, rank, world, device)


# ----------------------------------------------------------------------------- one size

class Ctx:
    """What every step of a size needs: the group's agreement calls, the device, the test-only fault."""

    def __init__(self, job: dict, rank: int, world: int, device):
        import torch

        self.job, self.rank, self.world, self.device = job, rank, world, device
        self.cuda = device.type == "cuda"
        self.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[job.get("dtype", "bf16")]

    def gather(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def agree_max(self, v: float) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(v)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def fill(self, x, seed: int) -> None:
        x.view(-1).copy_(pattern(x.numel(), self.rank, seed, self.device, self.dtype))

    def fault(self, out, rows: int, key: str) -> None:
        """Test-only (``job["fault"]``): add ``delta`` to element ``element`` of rank ``rank``'s result at ``rows``
        in pass ``pass`` (``eager``, ``replay``, ``after`` or ``any``)."""
        f = self.job.get("fault")
        if f and f.get("rank") == self.rank and f.get("rows") == rows and f.get("pass", "any") in (key, "any"):
            out.view(-1)[int(f.get("element", 0))] += float(f.get("delta", 1.0))
            self.sync()

    def step(self, fn):
        """Run ``fn`` locally, then agree: (value, None) everywhere, or (None, error) on every rank when any rank
        raised (so all ranks take the same branch)."""
        try:
            val, err = fn(), None
        except Exception as e:  # noqa: BLE001
            val, err = None, first_line(e)
        errs = [e for e in self.gather(err) if e]
        return (None, errs[0]) if errs else (val, None)

    def verified(self, fn, seed: int, rows: int, where: str, key: str) -> tuple:
        """(rejection reason or None, error or None): ``fn()`` gives this rank's result, checked here against the
        float64 sum; the per-rank results are then gathered so every rank reaches the same verdict."""
        def local():
            out = fn()
            self.sync()
            self.fault(out, rows, key)
            return check(out, expected_sum(out.numel(), self.world, seed)), out.numel()
        got, err = self.step(local)
        if err:
            return None, f"{where}: {err}"
        res, numel = got
        return verdict(self.gather(res), where, numel), None


def capture(m: Method, x, calls: int, cuda: bool):
    """(one-call runner returning its output, ``calls``-call runner, output tensor, timing mode): CUDA graphs
    captured as SGLang's runners capture them (a warm-up call on the capture stream first); eager runners on
    CPU."""
    if not cuda:
        return (lambda: m.call(x)), (lambda: [m.call(x) for _ in range(calls)]), None, "wall"
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m.call(x)
    torch.cuda.current_stream().wait_stream(s)
    g1, gk = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1, stream=s):
        out = m.call(x)
    with torch.cuda.graph(gk, stream=s):
        for _ in range(calls):
            m.call(x)
    torch.cuda.synchronize()

    def one():
        g1.replay()
        return out
    return one, gk.replay, out, "graph"


def measure_size(m: Method, ctx: Ctx, rows: int, k: int) -> dict:
    """One size: admitted?, eager call verified, graphs captured, replay verified, timed, verified again. Every
    rank takes the same branches (each step ends in an agreement over the gloo group)."""
    import torch

    job = ctx.job
    numel, calls = rows * job["hidden"], int(job.get("calls", 8))
    seed = int(job.get("seed", 0)) * 100003 + 3 * k
    x = torch.empty((rows, job["hidden"]), dtype=ctx.dtype, device=ctx.device)
    why, err = ctx.step(lambda: m.begin_size(numel) or (m.admits(x) if hasattr(m, "admits") else None))
    whys = [w for w in ctx.gather(why) if w]
    if err or whys:
        return {"status": "failed" if err else "unavailable", "reason": err or whys[0]}
    info = {"workspace_numel": getattr(m, "tier", None)} if isinstance(m, PcieIpc) else {}

    def eager():
        ctx.fill(x, seed)
        return m.call(x)
    bad, err = ctx.verified(eager, seed, rows, "eager call", "eager")
    if err or bad:
        return {"status": "failed" if err else "rejected", "reason": err or bad, **info}
    got, err = ctx.step(lambda: capture(m, x, calls, ctx.cuda))
    if err:   # not capturable here: time the eager calls, as a server without CUDA graphs runs them
        got = ((lambda: m.call(x)), (lambda: [m.call(x) for _ in range(calls)]), None, "events")
        info["capture_error"] = err
    one, many, out, how = got

    def replay(s: int):
        def fn():
            ctx.fill(x, s)
            if out is not None and not m.inplace:
                out.fill_(float("nan"))   # poisoned: a replay that writes nothing cannot pass
            return one()
        return fn
    bad, err = ctx.verified(replay(seed + 1), seed + 1, rows, "graph replay" if how == "graph" else "second call",
                            "replay")
    if err or bad:
        return {"status": "failed" if err else "rejected", "reason": err or bad, "timing": how, **info}
    x.zero_()
    timed, err = ctx.step(lambda: time_loop(
        many, cuda_timer if ctx.cuda else wall_timer, ctx.agree_max, ctx.barrier, calls=calls,
        target_s=float(job.get("target_ms", 20)) / 1e3, reps=int(job.get("reps", 5)),
        max_iters=int(job.get("max_iters", 2000))))
    if err:
        return {"status": "failed", "reason": f"timing: {err}", "timing": how, **info}
    sec, iters = timed
    bad, err = ctx.verified(replay(seed + 2), seed + 2, rows, "after timing", "after")
    if err or bad:
        return {"status": "failed" if err else "rejected", "reason": err or bad, "timing": how,
                "us": sec * 1e6, **info}
    return {"status": "ok", "us": sec * 1e6, "err": 0.0, "timing": how, "iters": iters, "calls": calls, **info}


# ----------------------------------------------------------------------------- main

def run(job: dict, rank: int, world: int, local: int) -> int:
    import torch
    import torch.distributed as dist

    if world > MAX_RANKS:
        raise ValueError(f"{world} ranks: the exact-sum check holds up to {MAX_RANKS}")
    cuda = job["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:"
                            f"{os.environ['MASTER_PORT']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=float(job.get("timeout_s", 600))))
    ctx = Ctx(job, rank, world, device)
    m = make_method(job, rank, world, device)
    why, err = ctx.step(m.setup)
    whys = [w for w in ctx.gather(why) if w]
    status = "failed" if err else "unavailable" if whys else "ok"
    if rank == 0:
        emit({"event": "method", "status": status, "reason": err or (whys[0] if whys else ""), "info": m.info})
    if status == "ok":
        for k, rows in enumerate(job["rows"]):
            if rank == 0:
                emit({"event": "start", "rows": rows})
            res = measure_size(m, ctx, rows, k)
            if rank == 0:
                emit({"event": "size", "rows": rows, **res})
            if res["status"] == "failed":
                break
        m.close()
    if rank == 0:
        emit({"event": "done", "info": m.info})
    ctx.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    try:
        with open(argv[0]) as fh:
            job = json.load(fh)
        return run(job, rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank)))
    except Exception as e:  # noqa: BLE001 - one line for the launcher, never a traceback
        emit({"event": "error", "rank": rank, "error": first_line(e)})
        return 1


if __name__ == "__main__":
    sys.exit(main())
