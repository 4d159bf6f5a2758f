"""The all-reduce measurement (dsv4_sm120.calibrate.allreduce + allreduce_worker) on CPU: the sizes and groups from
the serve settings, each method's environment, the timing loop on a fake clock, the exact verification (a wrong
sum, one element off by one, a poisoned output, a missing rank), the launcher's handling of a hang and of a rank
that dies (fake workers, no torch), and two real gloo processes running the worker with a one-element fault."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from dsv4_sm120.calibrate import allreduce as A
from dsv4_sm120.calibrate import allreduce_worker as W
from dsv4_sm120.machine_profile.allreduce_choice import IPC, validate_entry


def test_sizes_from_the_serve_settings():
    assert A.decode_rows(16, 4) == [1, 2, 4, 8, 16, 32, 64]
    assert A.decode_rows(16, 1) == [1, 2, 4, 8, 16]
    assert A.decode_rows(12, 3) == [1, 2, 4, 8, 12, 16, 32, 36]
    assert A.decode_rows(16, 4, quick=True) == [1, 4, 16, 64]
    assert A.prefill_rows(8192) == [2 ** i for i in range(14)]
    assert A.prefill_rows(6000)[-2:] == [4096, 6000] and A.prefill_rows(6000, quick=True) == [1, 4, 16, 64, 256,
                                                                                               1024, 4096, 6000]
    p = A.build_plan({"MAX_RUNNING": "32", "CHUNKED_PREFILL_SIZE": "4096", "PREFILL_GPUS": "0,1",
                      "DECODE_GPUS": "2,3,4,5"}, 4096, 2)
    pre, dec = p.servers
    assert (pre.role, pre.gpus, pre.world, pre.rows[-1]) == ("prefill", [0, 1], 2, 4096)
    assert (dec.role, dec.gpus, dec.world, dec.rows) == ("decode", [2, 3, 4, 5], 4, [1, 2, 4, 8, 16, 32, 64])
    # the IPC workspace tiers: the decode width first (small sizes timed with a decode-sized workspace), then
    # the largest size
    assert pre.tiers == [64 * 4096, 4096 * 4096] and dec.tiers == [64 * 4096]
    assert p.methods == list(A.DEFAULT_METHODS) and "nccl_LL_Ring" in p.methods
    d = A.build_plan({}, 4096, 4)   # the defaults: 0-3 / 4-7, MAX_RUNNING 16, SGLang's chunk 8192
    assert [s.gpus for s in d.servers] == [[0, 1, 2, 3], [4, 5, 6, 7]] and d.servers[0].rows[-1] == 8192
    assert "SGLang's default" in d.servers[0].where and "16 x 4 draft tokens" in d.servers[1].where
    lines = A.dry_run_lines(d)
    assert lines[0].startswith("allreduce.prefill: GPUs 0,1,2,3 (TP4): rows 1,2,4,") and "64 MiB" in lines[0]
    assert lines[1].startswith("allreduce.decode: GPUs 4,5,6,7 (TP4): rows 1,2,4,8,16,32,64 x hidden 4096 bf16")
    for bad in ({"MAX_RUNNING": "x"}, {"MAX_RUNNING": "0"}, {"CHUNKED_PREFILL_SIZE": "-1"}, {"DECODE_GPUS": "a"}):
        with pytest.raises(A.AllreduceError):
            A.build_plan(bad, 4096, 4)


def test_each_method_gets_its_own_nccl_environment():
    s = A.Server("decode", [4, 5, 6, 7], 4, [1], 4096, [4096])
    base = {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "SGLANG_PCIE_IPC_MAX_NUMEL": "9", "NCCL_P2P_DISABLE": "0",
            "PYTHONPATH": "/x", "CUDA_VISIBLE_DEVICES": "0"}
    e = A.method_env(base, "nccl_LL128", s, "cuda")
    assert e["NCCL_PROTO"] == "LL128" and "NCCL_ALGO" not in e and "SGLANG_PCIE_IPC_MAX_NUMEL" not in e
    assert e["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and e["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert e["NCCL_P2P_DISABLE"] == "0" and e["PYTHONPATH"].split(os.pathsep) == [str(A.OVERLAY_DIR), "/x"]
    assert e["NCCL_DEBUG"] == "INFO" and e["NCCL_DEBUG_SUBSYS"] == "ENV"   # NCCL then says what it was given
    e = A.method_env(base, "nccl_Simple_Tree", s, "cuda")
    assert (e["NCCL_PROTO"], e["NCCL_ALGO"]) == ("Simple", "Tree")
    for m in ("nccl", IPC):
        e = A.method_env(base, m, s, "cuda")
        assert "NCCL_PROTO" not in e and "NCCL_ALGO" not in e
    assert base["NCCL_PROTO"] == "LL"   # the caller's mapping untouched


def test_timing_loop_on_a_fake_clock():
    clock = {"t": 0.0, "calls": 0}
    samples = iter([0.010, 0.011, 0.500, 0.009, 0.010])   # one sample hit by a stall

    def run():
        clock["calls"] += 1

    def timer(fn, n):
        for _ in range(n):
            fn()
        if n == 1:
            return 0.002   # one run of 8 calls: 2 ms -> 10 iterations for 20 ms
        return next(samples) * n / 10
    other_rank = []
    barriers = []
    sec, iters = W.time_loop(run, timer, lambda v: (other_rank.append(v), max(v, 0.0011 if v < 1e-3 else v))[1],
                             lambda: barriers.append(1), calls=8, target_s=0.020, reps=5, max_iters=1000)
    assert iters == 10 and len(barriers) == 5
    assert sec == pytest.approx(0.0011)   # the slower rank's value wins
    assert other_rank[-1] == pytest.approx(0.010 / 10 / 8)   # median sample / iters / calls: the stall ignored
    assert clock["calls"] == 1 + 5 * (1 + 10)
    # a slow single run still gets one timed iteration; a fast one is capped
    assert W.time_loop(run, lambda f, n: 1.0 * n, lambda v: v, lambda: None, calls=1, target_s=0.02, reps=1,
                       max_iters=99)[1] == 1
    assert W.time_loop(run, lambda f, n: 1e-9 * n, lambda v: v, lambda: None, calls=1, target_s=0.02, reps=1,
                       max_iters=99)[1] == 99


@pytest.mark.parametrize("world", [2, 4, 8, 16])
def test_the_sum_is_exact_in_bf16_in_any_order(world):
    n, seed = 4096 + 7, 11
    parts = [W.pattern(n, r, seed, "cpu", torch.bfloat16) for r in range(world)]
    assert all(p.abs().max() <= W.PATTERN_HALF for p in parts)
    assert len({tuple(p[:64].tolist()) for p in parts}) == world   # every rank's pattern differs
    want = W.expected_sum(n, world, seed)
    for order in (range(world), reversed(range(world))):
        acc = torch.zeros(n, dtype=torch.bfloat16)
        for r in order:
            acc += parts[r]
        assert W.check(acc, want)["mismatches"] == 0
    # pairwise (tree) order too
    level = parts
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    assert W.check(level[0], want) == {"mismatches": 0, "max_abs": 0.0, "err": 0.0, "first": None}


def test_verification_catches_small_and_gross_errors():
    world, n, seed = 4, 3000, 5
    want = W.expected_sum(n, world, seed)
    good = want.to(torch.bfloat16)
    one = good.clone()
    one[1234] += 1
    res = W.check(one, want)
    assert res["mismatches"] == 1 and res["first"] == 1234 and res["max_abs"] == 1.0
    assert res["got"] == res["want"] + 1
    poisoned = torch.full((n,), float("nan"), dtype=torch.bfloat16)
    assert W.check(poisoned, want)["mismatches"] == n and W.check(poisoned, want)["max_abs"] == float("inf")
    missing = W.expected_sum(n, world - 1, seed).to(torch.bfloat16)   # a rank's contribution left out
    assert W.check(missing, want)["mismatches"] > n // 2
    stale = W.expected_sum(n, world, seed + 1).to(torch.bfloat16)     # the previous call's result
    assert W.check(stale, want)["mismatches"] > n // 2
    assert W.check(good[:-1], want)["mismatches"] == n
    why = W.verdict([W.check(good, want), res], "graph replay", n)
    assert why.startswith("graph replay: rank 1 has 1 of 3000 elements off the float64 sum") and "1234" in why
    assert W.verdict([W.check(good, want)] * 2, "x", n) is None


# ----------------------------------------------------------------------------- the launcher

FAKE = r"""
import json, os, sys, time
rank = int(os.environ["RANK"])
mode = json.load(open(sys.argv[1]))["fault"]["mode"]
def say(**e):
    print(json.dumps(e), flush=True)
if rank == 0:
    say(event="method", status="ok", reason="", info={"backend": "fake"})
    say(event="start", rows=1)
    say(event="size", rows=1, status="ok", us=3.5, timing="graph")
    say(event="start", rows=2)
if mode == "die" and rank == 1:
    say(event="error", rank=1, error="RuntimeError: NCCL error: unhandled system error")
    sys.exit(1)
time.sleep(120)
"""


@pytest.mark.parametrize("mode", ["hang", "die"])
def test_a_hang_or_a_dead_rank_is_a_failure_with_its_reason(mode, monkeypatch):
    monkeypatch.setattr(A, "KILL_GRACE_S", 0.5)
    s = A.Server("decode", [0, 1], 2, [1, 2, 4], 64, [512])
    plan = A.Plan([s], ["nccl_LL"], timeout_s=3.0 if mode == "hang" else 60, fault={"mode": mode})
    seen = []
    t0 = time.monotonic()
    res = A.launch(s, "nccl_LL", plan, dict(os.environ), seen.append, worker=[sys.executable, "-c", FAKE])
    assert time.monotonic() - t0 < 30
    assert [e["rows"] for e in seen] == [1]   # progress as it came
    assert res["status"] == "failed" and res["sizes"][1] == {"status": "ok", "us": 3.5, "timing": "graph"}
    want = "timed out after 3 s" if mode == "hang" else "rank 1: RuntimeError: NCCL error: unhandled system error"
    assert res["sizes"][2]["status"] == "failed" and res["sizes"][2]["reason"] == f"{want} at rows 2"
    assert res["sizes"][4]["reason"].startswith("not measured: the run stopped at rows 2")


def test_collect_reports_setup_failures_for_every_size():
    s = A.Server("decode", [0, 1], 2, [1, 2], 64, [512])
    ipc = {"kind": IPC, "proto": None, "algo": None}
    r = A.collect(s, ipc, [[{"event": "method", "status": "unavailable", "reason": "world size 3"}], []], False,
                  [0, 0], ["", ""], 60)
    assert r["status"] == "unavailable" and all(o == {"status": "unavailable", "reason": "world size 3"}
                                                for o in r["sizes"].values())
    r = A.collect(s, ipc, [[], []], True, [None, None], ["", ""], 600)
    assert r["status"] == "failed" and "before the method was ready (FlashInfer's first JIT" in r["sizes"][1]["reason"]
    r = A.collect(s, ipc, [[], []], False, [0, 139], ["", "Segmentation fault"], 600)
    assert r["sizes"][2]["reason"] == "rank 1 exited with code 139: Segmentation fault"
    # a size that raised on every rank ends the run (the communicator may be unusable): the rest say so
    ev = [{"event": "method", "status": "ok"}, {"event": "start", "rows": 1},
          {"event": "size", "rows": 1, "status": "failed", "reason": "eager call: RuntimeError: x"}, {"event": "done"}]
    r = A.collect(s, ipc, [ev, []], False, [0, 0], ["", ""], 600)
    assert r["sizes"][1]["reason"] == "eager call: RuntimeError: x"
    assert r["sizes"][2] == {"status": "failed",
                             "reason": "not measured: the run stopped at rows 1 (it failed at rows 1)"}


def fake_launcher(table):
    """A launcher that answers from {method: {rows: us or status}} without processes."""
    def launch(server, method, plan, env, on_size=lambda e: None, worker=None):
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, server.gpus))
        sizes = {}
        for r in server.rows:
            v = table[method][r]
            sizes[r] = {"status": "ok", "us": v} if isinstance(v, (int, float)) else {"status": v, "reason": v}
            on_size({"rows": r, **sizes[r]})
        return {"status": "ok", "reason": "", "info": {"backend": "fake"}, "sizes": sizes, "wall_s": 0.1}
    return launch


class Steps:
    def __init__(self):
        self.units, self.lines = 0, []

    def step(self, what, units=1):
        self.units += units
        self.lines.append(what)


def test_measure_and_calibrate_with_a_fake_launcher(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())   # sglang + flashinfer "installed"
    plan = A.build_plan({"DECODE_GPUS": "4,5,6,7"}, 4096, 1, methods=[IPC, "nccl_LL"],
                        rows={"prefill": [1, 8], "decode": [1, 4, 16]}, gpus={"prefill": [0, 1, 2]})
    table = {IPC: {1: 4, 4: 5, 16: "rejected", 8: 1}, "nccl_LL": {1: 9, 4: 9, 16: 10, 8: 9}}
    prog = Steps()
    entry = A.calibrate(plan, {}, visible=8, progress=prog, launcher=fake_launcher(table))
    assert prog.units == A.units(plan) == 2 * 2 + 3 * 2
    dec, pre = entry["servers"]["decode"], entry["servers"]["prefill"]
    assert dec["choice"]["ipc_max_rows"] == 4 and dec["sizes"]["16"]["chosen"] == "nccl_LL"
    assert dec["sizes"]["16"]["winner"] == "nccl_LL" and dec["sizes"]["1"]["winner"] == IPC
    # TP3: IPC is not even started there
    assert pre["methods"][IPC]["status"] == "unavailable" and "not TP3" in pre["methods"][IPC]["reason"]
    assert pre["choice"]["ipc_max_numel"] == 0 and pre["choice"]["nccl"] == "nccl_LL"
    assert validate_entry(entry) is None
    lines = A.summary_lines(entry)
    assert lines[1] == ("allreduce.decode (GPUs 4,5,6,7, TP4): pcie_ipc up to 4 rows, NCCL LL above "
                        "(SGLANG_PCIE_IPC_MAX_NUMEL=16384); with IPC off: NCCL LL")
    # GPUs this box does not have: the server is unavailable, nothing launched
    prog = Steps()
    small = A.calibrate(plan, {}, visible=4, progress=prog, launcher=fake_launcher(table))
    assert small["servers"]["decode"]["status"] == "unavailable" and "4 visible" in small["servers"]["decode"]["reason"]
    assert small["servers"]["decode"]["choice"] is None and small["servers"]["prefill"]["status"] == "ok"
    assert prog.units == A.units(plan) and validate_entry(small) is None


def test_two_gloo_processes_run_the_worker_and_catch_one_wrong_element():
    """The real worker in two processes (gloo on CPU): per size the eager call, the second call and the call
    after timing are verified on both ranks; rank 1's result is off by one in one element at 3 rows, in the
    last pass only."""
    plan = A.build_plan({}, 0, 1, device="cpu", rows={"decode": [1, 3]}, roles=("decode",))
    plan.timeout_s, plan.reps = 120.0, 1
    plan.fault = {"rank": 1, "rows": 3, "pass": "after", "element": 77, "delta": 1.0}
    s = plan.servers[0]
    env = A.method_env(A.base_env(os.environ), "gloo", s, "cpu")
    t0 = time.monotonic()
    res = A.launch(s, "gloo", plan, env)
    assert time.monotonic() - t0 < 110, res
    assert res["status"] == "ok", res
    o1, o3 = res["sizes"][1], res["sizes"][3]
    assert o1["status"] == "ok" and o1["us"] > 0 and o1["timing"] == "wall" and o1["err"] == 0.0
    assert o3["status"] == "rejected" and o3["reason"].startswith(
        "after timing: rank 1 has 1 of 192 elements off the float64 sum, max |diff| 1 (first at element 77")
    assert o3["us"] > 0   # it was timed before the last check caught it


def test_ipc_method_builds_one_workspace_per_tier_through_sglangs_adapter(monkeypatch):
    """The worker's pcie_ipc method against a stand-in for SGLang's adapter module: the workspace tier each size
    gets (SGLANG_PCIE_IPC_MAX_NUMEL as the adapter reads it at prepare), the old workspace destroyed, the
    adapter's own warning as the reason when it stays off, a size it would not route reported as such."""
    import logging
    import types

    import torch.distributed as dist

    built = []

    class FakeComm:
        def __init__(self, group, device, cpu_group):
            self.max = int(os.environ["SGLANG_PCIE_IPC_MAX_NUMEL"])
            self.disabled = self.max > 10 ** 6
            self._workspace, self.destroyed = None, False
            if self.disabled:
                logging.getLogger(mod.__name__).warning("FlashInfer build has no pcie_ipc_comm")
            built.append(self)

        def prepare(self, hidden):
            self._workspace = object()
            logging.getLogger(mod.__name__).info("autotuned 3 shape(s) (hidden=%d)", hidden)

        def should_pcie_ipc_ar(self, x):
            return x.numel() <= self.max and x.shape[0] != 3

        def destroy(self):
            self.destroyed = True

    mod = types.ModuleType("sglang.srt.distributed.device_communicators.pcie_ipc_ar")
    mod.PcieIpcCommunicator = FakeComm
    pkg = types.ModuleType("sglang.srt.distributed.device_communicators")
    pkg.pcie_ipc_ar = mod
    for name, m in (("sglang", types.ModuleType("sglang")), ("sglang.srt", types.ModuleType("sglang.srt")),
                    ("sglang.srt.distributed", types.ModuleType("sglang.srt.distributed")),
                    ("sglang.srt.distributed.device_communicators", pkg), (mod.__name__, mod)):
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.setattr(dist, "new_group", lambda backend=None: "nccl-group")
    # the worker writes SGLANG_PCIE_IPC_MAX_NUMEL into os.environ (its own process in a real run): setenv first so
    # that the test's undo removes it again (a bare delenv of an unset variable records nothing to restore)
    monkeypatch.setenv("SGLANG_PCIE_IPC_MAX_NUMEL", "0")
    monkeypatch.delenv("SGLANG_PCIE_IPC_MAX_NUMEL")
    job = {"hidden": 64, "ipc_tiers": [4 * 64, 64 * 64, 2 * 10 ** 6]}
    m = W.make_method(dict(job, kind="pcie_ipc"), 0, 4, torch.device("cpu"))
    assert m.setup() is None and m.inplace is False
    assert m.begin_size(1 * 64) is None and m.begin_size(4 * 64) is None and len(built) == 1
    assert built[0].max == 256 and m.info["tuning_256"] == ["autotuned 3 shape(s) (hidden=64)"]
    assert m.admits(torch.empty(4, 64)) is None
    assert "would not route a (3, 64) tensor" in m.admits(torch.empty(3, 64))
    assert m.begin_size(16 * 64) is None and len(built) == 2 and built[0].destroyed and built[1].max == 4096
    assert m.begin_size(10 ** 6) == "FlashInfer build has no pcie_ipc_comm" and built[1].destroyed
    assert m.begin_size(3 * 10 ** 6).startswith("beyond the largest workspace tier")
    m.close()
    assert built[-1].destroyed
