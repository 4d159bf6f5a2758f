"""The patched pinned SGLang serving from a machine profile, and the startup self-check with fault injection (CPU,
Triton interpreter, one subprocess on the `patched_sglang_site` copy).

* Bucket routing: a profile saying ``dsv4`` (ours) for c4-layout calls up to 4 rows and ``torch`` above; calls at
  T=2 and T=8 through the glue SGLang imports reach the intended implementation (calls counted by wrapping our
  kernel's entry point and SGLang's torch path in the probe), both equal SGLang's torch path; the patched model's
  ``_kernel_num_heads`` gives the real heads at T=2 and the stock 64-head padding at T=8.
* The hook before CUDA-graph capture: the patched backend's ``init_cuda_graph_state`` runs the self-check with the
  model's per-rank heads; it passes on the clean kernel (every layout ours runs, error small).
* Fault injection: ``DSV4_SM120_TEST_SELFCHECK_FAULT=attention`` makes our kernel wrong (shown: its output is
  2x SGLang's); the same hook's self-check catches it, logs kernel, shape and error, disables our kernel, and the
  patched SGLang's attention output for a decode call then equals the stock dispatcher's, bit for bit, with no
  call into our kernel.
"""

from __future__ import annotations

import textwrap

from conftest import probe_result

from dsv4_sm120.calibrate import profile as P

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

    # the hook before graph capture, as the patched backend runs it
    class Attn(torch.nn.Module):
        n_local_heads, compress_ratio = 8, 4
    model = torch.nn.Sequential(Attn(), Attn())
    runner = types.SimpleNamespace(model=model, device="cpu")
    def capture_state():
        backend = be.DeepseekV4AttnBackend.__new__(be.DeepseekV4AttnBackend)
        backend.model_runner = runner
        with override_platform(is_sm120=True):
            try:
                be.DeepseekV4AttnBackend.init_cuda_graph_state(backend, 1, 1)
            except Exception:
                pass   # the stock body needs a real backend; the hook ran first
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
    live = route.ours(q, 8, kw)
    out["fault_live_ratio"] = float(live.float().norm() / orig_torch(
        q, kw["k_cache"], kw["indices"], kw.get("topk_length"), kw.get("attn_sink"), 512, kw["softmax_scale"],
        kw.get("extra_k_cache"), kw.get("extra_indices_in_kvcache"), kw.get("extra_topk_length"))[0].float().norm())
    faulty = capture_state()
    out["faulty"] = {"cases": [[c["shape"], c["ok"], c["err"], c["error"]] for c in faulty],
                     "disabled": decisions.disabled("attention")}
    out["after"] = call(2, 1)
    out["heads_after"] = heads(2)
    out["logs"] = [x for x in logs if x.startswith("dsv4_sm120")]
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
    # the fault is live (without the self-check the server would answer 2x), and the self-check catches it
    assert 1.9 < out["fault_live_ratio"] < 2.1, out["fault_live_ratio"]
    first = out["faulty"]["cases"][0]
    assert not first[1] and first[2] > 0.5 and "relative error" in first[3], first
    assert out["faulty"]["disabled"].startswith("swa T=2 H=8"), out["faulty"]
    # ... and the patched SGLang's output for the same kind of call is the stock path's, bit for bit
    assert out["after"]["ours"] == 0 and out["after"]["equals_stock"] and out["after"]["err"] < 1e-2, out["after"]
    assert out["heads_after"] == 64                    # SGLang's own head count for its own path
    failed = [x for x in out["logs"] if "FAILED" in x]
    assert len(failed) == 1 and "attention kernel FAILED at swa T=2 H=8" in failed[0] and "relative error" in failed[0]
    assert "stock path serves instead" in failed[0]
    assert any(x.startswith("dsv4_sm120 decision attention.swa_c4: stock for every T") for x in out["logs"]) or any(
        x.startswith("dsv4_sm120 decision attention.swa_c4: stock for T<=4, torch for T>4") for x in out["logs"]), \
        out["logs"]
