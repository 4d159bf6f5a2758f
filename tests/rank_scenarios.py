"""What each rank runs in the multi-rank tests (tests/test_rank_agreement*.py, through tests/rank_harness.py).

Every function is ``fn(rank, size, **args)`` on a gloo world that is already up and returns JSON. Faults are
planted on one rank only: through the product's own test settings (``DSV4_SM120_TEST_SELFCHECK_FAULT`` with
``DSV4_SM120_TEST_FAULT_RANKS``) where they reach the code path, else by the scenario on that rank. The kernels are
stand-ins (SGLang's torch attention path, the float64 MoE reference): these tests are about what the ranks decide
together, not about the kernels, and the stand-ins keep them cheap.
"""

from __future__ import annotations

import os
import time
import types


# ---------------------------------------------------------------------------- rank_agreement alone (plain gloo)

def agree_rounds(rank, size, rounds=3):
    from dsv4_sm120 import rank_agreement as RA

    g = RA.group_of()
    got = [g.agree(f"round {i}", {"rank": rank, "value": rank * rank + i}) for i in range(rounds)]
    return {"statuses": got, "group": [g.name, g.rank, g.size, g.step], "same": RA.group_of() is g}


def agree_one_missing(rank, size, missing, sleep=30.0):
    from dsv4_sm120 import rank_agreement as RA

    g = RA.group_of()
    g.agree("first", rank)
    if rank == missing:
        time.sleep(sleep)                       # never answers the second agreement
        return {"slept": True}
    t0 = time.monotonic()
    try:
        g.agree("second", rank)
    except RA.RankTimeout as e:
        return {"error": str(e), "missing": e.missing, "waited": time.monotonic() - t0, "stop": True}
    return {"error": None}


def agree_mispaired(rank, size, odd):
    from dsv4_sm120 import rank_agreement as RA

    g = RA.group_of()
    g.agree("first", rank)
    try:
        g.agree("capture of size 8 again" if rank == odd else "capture of size 4", rank)
    except RA.RanksDisagree as e:
        return {"error": str(e), "topics": {str(k): v for k, v in e.topics.items()}}
    return {"error": None}


def agree_store_host_exits(rank, size):
    """Rank 0 (which hosts the rendezvous store) ends after the first agreement; the others' next agreement."""
    from dsv4_sm120 import rank_agreement as RA

    g = RA.group_of()
    g.agree("first", rank)
    if rank == 0:
        time.sleep(0.5)          # the others have read the first agreement
        os._exit(0)
    time.sleep(1.0)
    t0 = time.monotonic()
    try:
        g.agree("second", rank)
    except RA.StopServer as e:
        return {"error": str(e), "waited": time.monotonic() - t0}
    return {"error": None}


# ---------------------------------------------------------------------------- the patched SGLang (sglang init)

def _cheap_kernels():
    """Our attention kernel and MoE kernel replaced by stand-ins that give the stock answers (no Triton)."""
    import torch

    import dsv4_sm120.attention as attn_pkg
    import dsv4_sm120.moe as moe_pkg
    from dsv4_sm120.moe.reference import moe_reference
    from sglang.kernels.ops.attention.flash_mla_sm120 import _sm120_sparse_decode_fwd

    def attention(q, k_cache, indices, topk_length=None, attn_sink=None, head_dim_v=512, softmax_scale=None,
                  extra_k_cache=None, extra_indices_in_kvcache=None, extra_topk_length=None, **_):
        return _sm120_sparse_decode_fwd(q, k_cache, indices, topk_length, attn_sink, head_dim_v, softmax_scale,
                                        extra_k_cache, extra_indices_in_kvcache, extra_topk_length)

    def moe(x, *w, swiglu_limit=None, **_):
        return moe_reference(x, *w, swiglu_limit=swiglu_limit).to(torch.bfloat16)

    attn_pkg.sparse_mla_decode = attention
    moe_pkg.nvfp4_fused_moe = moe


def _no_agreement():
    """Every agreement becomes the rank's own status: what each rank decided alone before the ranks agreed."""
    from dsv4_sm120 import rank_agreement as RA

    RA.group_of = lambda *a, **k: RA.SINGLE


def _capture_loop(capture_bs, capture_one, heads=8, ratios=(0, 4)):
    """The patched ``DecodeCudaGraphRunner._capture_one_stream`` (patch 0006) on a stand-in runner whose model has
    DeepSeek-V4 attention layers of ``ratios`` and ``capture_one`` as its per-size capture."""
    import torch

    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.runtime_context import override_platform

    class Attn(torch.nn.Module):
        n_local_heads = heads

        def __init__(self, ratio):
            super().__init__()
            self.compress_ratio = ratio

    r = DecodeCudaGraphRunner.__new__(DecodeCudaGraphRunner)
    r.model_runner = types.SimpleNamespace(model=torch.nn.Sequential(*[Attn(x) for x in ratios]), device="cpu",
                                           gpu_id=0)
    r.capture_bs, r.captured_req_width = list(capture_bs), 1
    r.record_nolora_graph, r.attention_graph_variants, r.compile_bs = False, None, []
    r._set_profile_trace_tag = lambda *a: None
    r.capture_one_shape = capture_one
    with override_platform(is_sm120=True):
        r._capture_one_stream()


def _prefill_loop(capture_num_tokens, capture_one):
    """The patched ``PrefillCudaGraphRunner._capture_one_stream`` (patch 0006) on a stand-in runner."""
    import torch

    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner
    from sglang.srt.runtime_context import override_platform

    r = PrefillCudaGraphRunner.__new__(PrefillCudaGraphRunner)
    r.model_runner = types.SimpleNamespace(model=torch.nn.Sequential(), device="cpu", gpu_id=0)
    r.capture_num_tokens, r.max_context_size, r._capture_chunked_prefix = list(capture_num_tokens), None, False
    r.capture_one_shape = capture_one
    with override_platform(is_sm120=True):
        r._capture_one_stream()


def _routes(sizes, layouts=("swa", "swa_c4"), heads=8):
    from dsv4_sm120.sglang_glue import attention as A

    return {f"{lay}:{t}": A.call_route(t, lay, heads).backend for lay in layouts for t in sizes}


def capture(rank, size, capture_bs=(4, 8, 16), fail_rank=-1, fail_size=-1, fail_times=1, step_aside=True,
            check_fail_rank=-1, check_fail_layout="swa_c4", stall_rank=-1, no_agreement=False, prefill=False):
    """The capture loop with a stand-in capture that issues three all-reduces per size on the TP group's CPU group
    (as a capture's warm-up does) and checks each sum. ``fail_rank`` raises at ``fail_size`` (``fail_times``
    times), after our kernel stepped aside there (``step_aside``) and after one of its three all-reduces;
    ``check_fail_rank``'s self-check fails the launches of ``check_fail_layout``; ``stall_rank`` never reaches the
    self-check's agreement; ``prefill``: the prefill runner's loop (``capture_bs`` are its token counts)."""
    import torch
    import torch.distributed as dist

    from dsv4_sm120.sglang_glue import attention as A
    from dsv4_sm120.sglang_glue import selfcheck as S
    from sglang.srt.runtime_context import get_parallel

    _cheap_kernels()
    if no_agreement:
        _no_agreement()
    if rank == check_fail_rank:
        real = A.run_dsv4_kernel

        def failing(q, num_heads, kw, launch=None, qk=None):
            if A.layout_of(kw.get("extra_k_cache")) == check_fail_layout:
                raise RuntimeError("out of resources: shared memory (planted on this rank)")
            return real(q, num_heads, kw, launch, qk)
        A.run_dsv4_kernel = failing
    if rank == stall_rank:
        S.run_for_runner = lambda *a, **k: time.sleep(60)
    cpu = get_parallel().tp_group.cpu_group
    captured, sums, fails = [], [], {"n": 0}

    def capture_one(bs, forward=None, *a, **k):
        captured.append(bs)
        failing = rank == fail_rank and bs == fail_size and fails["n"] < fail_times
        for i in range(3):
            x = torch.tensor([float(1000 * bs + 10 * i + 1)])
            y = x.clone()
            dist.all_reduce(y, group=cpu)
            sums.append(bool(y.item() == x.item() * size))
            if i == 0 and failing and step_aside:      # our kernel fails during the forward; stock answers it
                A.step_aside(bs, "swa", 8, A.attention_route(bs, "swa"), "cpu",
                             "RuntimeError: illegal instruction (planted on this rank)")
        if failing:                                    # ... and the capture raises at its end
            fails["n"] += 1
            raise RuntimeError("operation failed due to a previous error during capture")

    (_prefill_loop if prefill else _capture_loop)(capture_bs, capture_one)
    return {"captured": captured, "sums_ok": all(sums), "n_sums": len(sums), "routes": _routes(capture_bs),
            "disabled": A.disabled("attention")}


def moe(rank, size, fail_rank=-1, both=False, no_agreement=False):
    """The MoE self-check at the first layer's ``prepare_layer``: ``DSV4_SM120_TEST_SELFCHECK_FAULT=moe-raise`` on
    the ranks of ``DSV4_SM120_TEST_FAULT_RANKS`` fails the first path there; ``both``: ``fail_rank`` fails every
    path."""
    import dsv4_sm120.moe as moe_pkg
    from dsv4_sm120.moe.testing import make_layer
    from dsv4_sm120.sglang_glue import moe as M
    from dsv4_sm120.sglang_glue import selfcheck as S

    _cheap_kernels()
    if no_agreement:
        _no_agreement()
    if both and rank == fail_rank:
        def broken(*a, **k):
            raise RuntimeError("illegal instruction (planted on this rank)")
        moe_pkg.nvfp4_fused_moe = broken
    layer, _ = make_layer(6, 64, 32, 2, 3)
    M.prepare_layer(layer)
    res = S.results()["moe"]
    return {"path": os.environ.get("DSV4_SM120_MOE_PATH"), "ok": res["ok"], "first": res["path"],
            "fallback": res["fallback"], "fallback_active": S.moe_fallback_active()}


# ---------------------------------------------------------------------------- PCIe-IPC all-reduce (patch 0007)

class StandInIpc:
    """Stands in for SGLang's ``PcieIpcCommunicator`` at the group's set-up: raises on the rank in
    ``RANK_HARNESS_IPC_FAIL``; its all-reduce is an all-gather on the CPU group (another collective than the
    device group's all-reduce, as the PCIe-IPC kernels are)."""

    def __init__(self, group, device, cpu_group=None):
        import torch.distributed as dist

        if str(dist.get_rank()) == os.environ.get("RANK_HARNESS_IPC_FAIL"):
            raise RuntimeError("cudaIpcOpenMemHandle failed: invalid device context (planted on this rank)")
        self.disabled, self.cpu_group = False, cpu_group

    def all_reduce(self, x):
        import torch
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(self.cpu_group))]
        dist.all_gather(parts, x, group=self.cpu_group)
        return sum(parts)


def ipc_setup(rank, size):
    """Which all-reduce each rank issues after the set-up (the group's dispatch: the PCIe-IPC communicator when it
    is on, else the device group's), and whether the sums are right."""
    import torch
    import torch.distributed as dist

    from sglang.srt.runtime_context import get_parallel

    g = get_parallel().tp_group
    comm = g.pcie_ipc_comm
    x = torch.full((2, 4), float(rank + 1))
    if comm is not None and not comm.disabled:
        y, path = comm.all_reduce(x), "pcie_ipc"
    else:
        y, path = x.clone(), "nccl"
        dist.all_reduce(y, group=g.device_group)
    return {"path": path, "sum_ok": bool((y == size * (size + 1) / 2).all())}


class StandInWorkspace:
    """Stands in for FlashInfer's ``PcieIpcAllReduceWorkspace``: a barrier on the group (the IPC handshake), then
    a failure where ``RANK_HARNESS_WS_FAIL`` says (``build:<rank>`` / ``tune:<rank>``)."""

    def __init__(self, group, max_numel, dtype, tune_batches=None, tune_cache=None):
        import torch.distributed as dist

        dist.barrier(group=group)
        if os.environ.get("RANK_HARNESS_WS_FAIL") == f"build:{dist.get_rank()}":
            raise RuntimeError("create_shared_buffer: cudaIpcGetMemHandle failed (planted on this rank)")
        self.max_numel = max_numel

    def tune(self, hiddens, dtype=None, tune_group=None):
        import torch.distributed as dist

        if os.environ.get("RANK_HARNESS_WS_FAIL") == f"tune:{dist.get_rank()}":
            raise OSError("cannot write the tune cache (planted on this rank)")
        return {(hiddens[0], 1): "cfg"}

    def supports(self, inp):
        return True


def ipc_workspace(rank, size, no_agreement=False):
    """SGLang's ``PcieIpcCommunicator`` (patched by 0007) with the stand-in workspace: ``prepare()`` builds and
    tunes it; then whether this rank would all-reduce through it."""
    import sys

    import torch

    from sglang.srt.distributed.device_communicators import pcie_ipc_ar as P
    from sglang.srt.runtime_context import get_parallel

    if no_agreement:
        _no_agreement()
    tuner = types.SimpleNamespace(get=lambda: types.SimpleNamespace(is_tuning_mode=False))
    sys.modules["flashinfer.autotuner"] = types.SimpleNamespace(AutoTuner=tuner)   # no FlashInfer import here
    P._tune_cache_path = lambda world_size: None
    torch.cuda.is_current_stream_capturing = lambda: False     # this CPU box has no CUDA driver to ask
    P._autotune_disabled = lambda: False
    g = get_parallel().tp_group
    comm = P.PcieIpcCommunicator.__new__(P.PcieIpcCommunicator)
    comm.__dict__.update(disabled=False, max_numel=0, _workspace=None, _bound_stream=None, _cpu_group=g.cpu_group,
                         _max_rows=None, _group=g.device_group, _device=torch.device("cpu"), _world_size=size,
                         _workspace_cls=StandInWorkspace, _build_failed=False)
    comm.prepare(hidden=64, max_rows=8)
    uses = comm.should_pcie_ipc_ar(torch.zeros(2, 64, dtype=torch.bfloat16))
    return {"uses_ipc": bool(uses), "disabled": comm.disabled, "workspace": comm._workspace is not None}
