"""Run a function on N ranks of a CPU torch.distributed world (gloo), each a forked process, bounded in time.

``run(specs)`` runs each spec (a dict) in turn and returns ``{name: outcome}``:

* ``fn``: ``"module:function"`` called as ``fn(rank, size, **args)`` on every rank after the world is up; its
  return value (JSON) is the rank's ``result``;
* ``ranks`` (default 2), ``deadline`` (s, default 20): ranks still running then are killed (SIGKILL) and listed
  in ``unfinished``; ``wait_for``: the ranks expected to report (default all: the harness ends the scenario once
  they have); ``gloo_timeout`` (s, default 10);
* ``env`` for every rank, ``rank_env`` ``{rank: {...}}`` for one; ``before``: ``"module:function"`` called on
  every rank before the world starts;
* ``init``: ``plain`` (``init_process_group("gloo")``) or ``sglang`` (the patched SGLang's
  ``init_distributed_environment`` on gloo and its tensor-parallel ``GroupCoordinator``, published as
  ``get_parallel().tp_group``; with ``SGLANG_ENABLE_PCIE_IPC_ALLREDUCE`` set it builds the PCIe-IPC communicator
  class the spec's ``ipc`` names, ``"module:Class"``).

Each rank's outcome: ``result`` or ``error`` (``"Type: message"``, ``stop``: whether it is a
``dsv4_sm120.rank_agreement.StopServer``), ``logs`` (the messages of the ``dsv4_sm120`` loggers) and ``seconds``.
Used by the multi-rank tests (tests/test_rank_agreement*.py) inside one child process, which imports what the
ranks share once before forking them.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import socket
import sys
import time
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Grab(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, rec):
        if rec.name.startswith("dsv4_sm120"):
            self.lines.append(rec.getMessage())


def _resolve(name: str):
    mod, _, attr = name.partition(":")
    return getattr(importlib.import_module(mod), attr)


def _init_plain(rank: int, size: int, port: int, gloo_timeout: float) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=gloo_timeout))


def _init_sglang(rank: int, size: int, port: int, gloo_timeout: float, spec: dict) -> None:
    from datetime import timedelta

    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import get_parallel

    if spec.get("ipc"):
        from sglang.srt.distributed.device_communicators import pcie_ipc_ar

        pcie_ipc_ar.PcieIpcCommunicator = _resolve(spec["ipc"])
    ps.init_distributed_environment(world_size=size, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                    local_rank=rank, backend="gloo", timeout=int(gloo_timeout))
    tp = ps.GroupCoordinator(group_ranks=[list(range(size))], local_rank=rank, torch_distributed_backend="gloo",
                             use_pynccl=False, use_mscclpp=False, use_custom_allreduce=False,
                             use_torch_symm_mem_all_reduce=False, use_hpu_communicator=False,
                             use_xpu_communicator=False, group_name="tp",
                             gloo_timeout=timedelta(seconds=gloo_timeout))
    ps._TP = tp
    get_parallel().override_permanently(tp_group=tp, tp_rank=rank, tp_size=size)


def _rank_main(spec: dict, rank: int, port: int, q) -> None:
    t0 = time.monotonic()
    os.environ.update(spec.get("env") or {})
    os.environ.update((spec.get("rank_env") or {}).get(str(rank)) or {})
    grab = _Grab()
    root = logging.getLogger()
    root.addHandler(grab)
    root.setLevel(logging.INFO)
    size = int(spec.get("ranks", 2))
    out = {"rank": rank}
    try:
        if spec.get("before"):
            _resolve(spec["before"])()
        if spec.get("init", "plain") == "sglang":
            _init_sglang(rank, size, port, float(spec.get("gloo_timeout", 10)), spec)
        else:
            _init_plain(rank, size, port, float(spec.get("gloo_timeout", 10)))
        out["result"] = _resolve(spec["fn"])(rank, size, **(spec.get("args") or {}))
        out["error"] = None
    except BaseException as e:  # noqa: BLE001 - reported to the test
        from dsv4_sm120.rank_agreement import StopServer

        first = (str(e).splitlines() or [""])[0]
        out.update(error=f"{type(e).__name__}: {first}", stop=isinstance(e, StopServer),
                   trace=traceback.format_exc()[-1500:])
    out["logs"] = grab.lines
    out["seconds"] = round(time.monotonic() - t0, 3)
    try:
        q.put(json.dumps(out, default=str))
        q.close()
        q.join_thread()     # the queue's feeder thread writes it before the process goes on
        sys.stdout.flush()
        sys.stderr.flush()
        # stay up until the harness ends every rank: rank 0 hosts the rendezvous store the others may still read
        time.sleep(float(spec.get("deadline", 20)) + 5)
    finally:
        os._exit(0)         # no atexit: torch.distributed's teardown could wait for peers that were killed


def run_one(spec: dict) -> dict:
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    size = int(spec.get("ranks", 2))
    port = _free_port()
    t0 = time.monotonic()
    procs = [ctx.Process(target=_rank_main, args=(spec, r, port, q), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    got = {}
    deadline = t0 + float(spec.get("deadline", 20))
    wait_for = set(spec.get("wait_for", range(size)))     # ranks expected to report (a stalled rank is not)
    while not wait_for <= set(got) and time.monotonic() < deadline:
        try:
            item = json.loads(q.get(timeout=max(0.05, min(0.5, deadline - time.monotonic()))))
        except queue.Empty:
            continue
        got[item["rank"]] = item
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.join(5)
    return {"ranks": [got.get(r, {"rank": r, "killed": True}) for r in range(size)],
            "unfinished": [r for r in range(size) if r not in got], "seconds": round(time.monotonic() - t0, 3)}


def run(specs) -> dict:
    """Each spec in turn (module doc); the modules the ranks share (torch.distributed, the overlay, the specs'
    ``preload``) are imported once here, before the ranks fork."""
    import torch.distributed  # noqa: F401

    import dsv4_sm120.rank_agreement  # noqa: F401

    for s in specs:
        for m in [s["fn"].partition(":")[0], *(s.get("preload") or ())]:
            importlib.import_module(m)
    return {s["name"]: run_one(s) for s in specs}


def main() -> None:
    specs = json.loads(sys.argv[1])
    print("RESULT" + json.dumps(run(specs)), flush=True)


if __name__ == "__main__":
    main()
