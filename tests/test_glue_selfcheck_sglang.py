"""The patched pinned SGLang serving from a machine profile, and the startup self-check with fault injection (CPU,
Triton interpreter, one subprocess on the `patched_sglang_site` copy).

* Bucket routing: a profile saying ``dsv4`` (ours) for c4-layout calls up to 4 rows and ``torch`` above; calls at
  T=2 and T=8 through the glue SGLang imports reach the intended implementation (calls counted by wrapping our
  kernel's entry point and SGLang's torch path in the probe), both equal SGLang's torch path; the patched model's
  ``_kernel_num_heads`` gives the real heads at T=2 and the stock 64-head padding at T=8.
* The patched CUDA-graph capture loop (patch 0006, on a stand-in runner): its hook runs the self-check with the
  model's per-rank heads over the rows it captures, once per layout of the model's layers; it passes on the clean
  kernel (every layout ours runs, error small).
* Fault injection: ``DSV4_SM120_TEST_SELFCHECK_FAULT=attention`` makes our kernel wrong (shown: its output is
  2x SGLang's); the same hook's self-check catches it at every launch, logs kernel, shape and error, disables our
  kernel, and the patched SGLang's attention output for a decode call then equals the stock dispatcher's, bit for
  bit, with no call into our kernel.
* Raising faults (``attention-raise-T=4``): the first call of 4 rows raises inside our kernel and is answered by
  the stock dispatcher, bit for bit, with one line naming the exception; in the capture loop the size whose rows
  raise (its stand-in capture fails as an invalidated CUDA capture would) is captured again, on the stock path.
"""

from __future__ import annotations

import textwrap

from conftest import probe_result

from dsv4_sm120 import machine_profile as P

GPU = "NVIDIA RTX PRO 6000 Blackwell Server Edition"

PROBE = textwrap.dedent(r'''
    import json, logging, os, sys, types
    import torch
    sys.path.insert(0, "tests")
    job = json.loads(sys.argv[1])
    logs = []
    class Grab(logging.Handler):
        def emit(self, rec):
            logs.append(rec.getMessage())
    logging.getLogger().addHandler(Grab())
    logging.getLogger().setLevel(logging.INFO)
    out = {}
    from sglang.srt.dsv4_sm120_hook import import_glue
    route = import_glue("attention")
    from sglang.srt.runtime_context import override_platform
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    import sglang.srt.models.deepseek_v4 as mdl
    import sglang.srt.layers.attention.deepseek_v4_backend as be
    from sglang.kernels.ops.attention import flash_mla_sm120 as fm
    import dsv4_sm120.attention.launch as launch
    from dsv4_sm120.attention.reference import rel_fro
    from dsv4_sm120.sglang_glue import attention as decisions, selfcheck
    from attention_cases import Case, build

    calls = {"ours": 0, "torch": 0}
    orig_ours, orig_torch = launch.sparse_mla_decode, fm._sm120_sparse_decode_fwd
    def ours(*a, **k):
        calls["ours"] += 1
        return orig_ours(*a, **k)
    def torch_path(*a, **k):
        calls["torch"] += 1
        return orig_torch(*a, **k)
    launch.sparse_mla_decode, fm._sm120_sparse_decode_fwd = ours, torch_path

    def call(T, seed):
        kw = build(Case(T=T, H=8, K=16, extra="c4", extra_K=16, lengths="random", seed=seed))
        q = kw.pop("q")
        before = dict(calls)
        o = route.sparse_attention(ForwardMode.DECODE, q=q, num_heads=8, **kw)
        n = {k: calls[k] - before[k] for k in calls}
        ref = orig_torch(q, kw["k_cache"], kw["indices"], kw.get("topk_length"), kw.get("attn_sink"), 512,
                         kw["softmax_scale"], kw.get("extra_k_cache"), kw.get("extra_indices_in_kvcache"),
                         kw.get("extra_topk_length"))[0]
        stock = fm.flash_mla_with_kvcache_sm120(q=q, **kw)[0]
        return dict(n, err=rel_fro(o[:, :, :8], ref), equals_stock=bool(torch.equal(o, stock)))

    fake = types.SimpleNamespace(n_local_heads=8, n_heads=64, attn_tp_size=8)
    def heads(T):
        with override_platform(is_sm120=True):
            return mdl.MqaAttentionBase._kernel_num_heads(fake, T)

    # bucket routing
    out["T2"], out["T8"] = call(2, 1), call(8, 2)
    out["heads"] = [heads(2), heads(8)]

    # the patched CUDA-graph capture loop (patch 0006) on a stand-in runner: its hook runs the self-check over the
    # rows the runner captures, then each size is captured through the glue's retrying wrapper
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.runtime_context import get_parallel
    class Attn(torch.nn.Module):
        n_local_heads = 8
        def __init__(self, ratio):
            super().__init__()
            self.compress_ratio = ratio
    model = torch.nn.Sequential(Attn(0), Attn(4), Attn(128))
    runner = types.SimpleNamespace(model=model, device="cpu", gpu_id=0)
    def capture_loop(capture_bs, width, capture_one_shape):
        r = DecodeCudaGraphRunner.__new__(DecodeCudaGraphRunner)
        r.model_runner, r.capture_bs, r.captured_req_width = runner, capture_bs, width
        r.record_nolora_graph, r.attention_graph_variants, r.compile_bs = False, None, []
        r._set_profile_trace_tag = lambda *a: None
        r.capture_one_shape = capture_one_shape
        with get_parallel().override(tp_rank=1, tp_group=None), override_platform(is_sm120=True):
            r._capture_one_stream()
    def capture_state():
        capture_loop([1], 2, lambda *a: None)
        return selfcheck.results()["attention"]
    before = calls["ours"]
    clean = capture_state()
    out["clean"] = {"cases": [[c["shape"], c["ok"], c["err"]] for c in clean], "ours_calls": calls["ours"] - before,
                    "disabled": decisions.disabled("attention")}

    # fault injection: our kernel wrong on purpose
    os.environ["DSV4_SM120_TEST_SELFCHECK_FAULT"] = "attention"
    selfcheck.reset(); decisions.reset(); logs.clear()
    kw = build(Case(T=2, H=8, K=16, extra="c4", extra_K=16, seed=5))
    q = kw.pop("q")
    live = route.run_dsv4_kernel(q, 8, kw)
    out["fault_live_ratio"] = float(live.float().norm() / orig_torch(
        q, kw["k_cache"], kw["indices"], kw.get("topk_length"), kw.get("attn_sink"), 512, kw["softmax_scale"],
        kw.get("extra_k_cache"), kw.get("extra_indices_in_kvcache"), kw.get("extra_topk_length"))[0].float().norm())
    faulty = capture_state()
    out["faulty"] = {"cases": [[c["shape"], c["ok"], c["err"], c["error"]] for c in faulty],
                     "disabled": decisions.disabled("attention")}
    out["after"] = call(2, 1)
    out["heads_after"] = heads(2)
    out["logs"] = [x for x in logs if x.startswith("dsv4_sm120")]

    # raising faults: a first call of 4 rows raises (answered by the stock dispatcher), and in the capture loop the
    # size whose rows raise is captured again after the fallback (the stand-in capture fails as an invalidated CUDA
    # capture would when our kernel stepped aside inside it)
    os.environ["DSV4_SM120_TEST_SELFCHECK_FAULT"] = "attention-raise-T=4"
    os.environ["DSV4_SM120_PROFILE_DIR"] = ""          # ours for every row
    selfcheck.reset(); decisions.reset(); logs.clear()
    graphs = import_glue("graphs")
    out["heads_before_raise"] = heads(4)
    out["first_call"] = call(4, 3)
    out["heads_after_raise"] = heads(4)
    captured = []
    def capture_one(bs, forward, *a):
        n0 = graphs.fallbacks()
        kw = build(Case(T=bs * 2, H=8, K=16, seed=bs))          # SWA-only calls of the captured rows
        q = kw.pop("q")
        o = route.sparse_attention(ForwardMode.DECODE, q=q, num_heads=8, **kw)
        if graphs.fallbacks() != n0:
            raise RuntimeError("operation failed due to a previous error during capture")
        captured.append([bs, bool(torch.equal(o, fm.flash_mla_with_kvcache_sm120(q=q, **kw)[0]))])
    before = dict(calls)
    capture_loop([1, 2], 2, capture_one)
    out["captured"] = captured
    out["capture_calls"] = {k: calls[k] - before[k] for k in calls}
    out["capture_check"] = [[c["shape"], c["ok"]] for c in selfcheck.results()["attention"]]
    out["raise_logs"] = [x for x in logs if x.startswith("dsv4_sm120")]
    print("RESULT" + json.dumps(out))
''')


def test_profile_routing_and_self_check_through_patched_sglang(run_patched, tmp_path):
    rows = {str(b): {"winner": w, "candidates": {w: {"status": "ok", "us": 1.0, "err": 1e-3, "tol": 2e-2}}}
            for b, w in ((1, "dsv4"), (4, "dsv4"), (16, "torch"), (64, "torch"))}
    P.save({"schema": P.SCHEMA, "gpu": GPU, "created_at": P.now_iso(), "versions": P.running_versions(),
            "deployment": {}, "decisions": {"attention.swa_c4": {"bucket_kind": "rows", "buckets": rows}}},
           P.profile_path(GPU, tmp_path))
    out = probe_result(run_patched, PROBE, {}, env={
        "TRITON_INTERPRET": "1", "SGLANG_SM120_FLASHMLA_BACKEND": "torch", "DSV4_SM120_PROFILE_DIR": str(tmp_path),
        "DSV4_SM120_TEST_GPU_NAME": GPU}, timeout=900)
    # per-bucket routing: ours at T=2, SGLang's torch path at T=8; both right
    assert out["T2"]["ours"] == 1 and out["T2"]["torch"] == 0 and out["T2"]["err"] < 1e-2, out["T2"]
    assert out["T8"]["ours"] == 0 and out["T8"]["torch"] == 1 and out["T8"]["equals_stock"], out["T8"]
    assert out["heads"] == [8, 64]
    # the clean self-check: every layout ours serves (c4 up to 4 rows, the others by default), close to the stock
    shapes = [c[0] for c in out["clean"]["cases"]]
    assert [s.split()[0] for s in shapes] == ["swa", "swa_c4", "swa_c128"], shapes
    assert all(c[1] and c[2] < 2e-2 for c in out["clean"]["cases"]), out["clean"]
    assert out["clean"]["ours_calls"] == 3 and out["clean"]["disabled"] is None
    assert all(" T=2 " in c[0] for c in out["clean"]["cases"])           # the captured rows: 1 x 2 per request
    # the fault is live (without the self-check the server would answer 2x), and the self-check catches it
    assert 1.9 < out["fault_live_ratio"] < 2.1, out["fault_live_ratio"]
    first = out["faulty"]["cases"][0]
    assert not first[1] and first[2] > 0.5 and "relative error" in first[3], first
    assert out["faulty"]["disabled"].startswith("swa T=2 H=8"), out["faulty"]
    # ... and the patched SGLang's output for the same kind of call is the stock path's, bit for bit
    assert out["after"]["ours"] == 0 and out["after"]["equals_stock"] and out["after"]["err"] < 1e-2, out["after"]
    assert out["heads_after"] == 64                    # SGLang's own head count for its own path
    failed = [x for x in out["logs"] if "FAILED" in x]
    assert len(failed) == 3 and "attention kernel FAILED at swa T=2 H=8" in failed[0] and "relative error" in failed[0]
    assert any("every launch of our attention kernel failed; disabled" in x and "stock path serves instead" in x
               for x in out["logs"]), out["logs"]
    assert any(x.startswith("dsv4_sm120 decision attention.swa_c4: stock for every T") for x in out["logs"]) or any(
        x.startswith("dsv4_sm120 decision attention.swa_c4: stock for T<=4, torch for T>4") for x in out["logs"]), \
        out["logs"]
    # a first call that raises: SGLang's stock dispatcher answers it, bit for bit, and one line says why
    first = out["first_call"]
    assert first["ours"] == 0 and first["torch"] == 1 and first["equals_stock"] and first["err"] < 1e-2, first
    assert out["heads_before_raise"] == 8 and out["heads_after_raise"] == 64   # then SGLang's own head count
    raised = [x for x in out["raise_logs"] if "our attention kernel failed (serving)" in x]
    assert any("swa_c4 T=4 H=8" in x and "RuntimeError: planted test fault attention-raise-T=4" in x for x in raised)
    # the capture loop: the check (T=2, the smallest captured rows) passed; the size with 4 rows raised inside the
    # capture, was captured again on the stock path, and both sizes hold the stock path's output
    # (swa_c4 stepped aside at the first call already: the check runs the other two layouts)
    assert [c[0].split(" K=")[0] for c in out["capture_check"]] == ["swa T=2 H=8", "swa_c128 T=2 H=8"]
    assert all(c[1] for c in out["capture_check"]), out["capture_check"]
    assert out["captured"] == [[2, True], [1, True]], out["captured"]
    assert out["capture_calls"]["ours"] == 2, out["capture_calls"]     # the check's two launches, no capture
    assert any("decode: CUDA-graph capture of size 2 raised (RuntimeError: operation failed" in x
               and "capturing that size again, on the stock path" in x for x in out["raise_logs"]), out["raise_logs"]
    assert any("decode: CUDA-graph capture of size 2 again succeeded" in x for x in out["raise_logs"])
