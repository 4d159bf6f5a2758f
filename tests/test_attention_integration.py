"""Integration of patches/0002-sm120-sparse-mla-decode.patch with the pinned SGLang (CPU, Triton
interpreter), in a subprocess on the `patched_sglang_site` copy with the whole series applied:

* the patched DSv4 backend routes its sm_120 branch through dsv4_sm120.sglang_glue.attention and
  the patched model asks it for the head count;
* MqaAttentionBase._kernel_num_heads under a forced sm_120 platform: real per-rank heads for every
  row count with our backend, the stock 64-head padding with DSV4_SM120_ATTN_BACKEND=triton;
* the route, reached through SGLang's own hook (import_glue), for decode / target-verify with
  T > 64 / draft-extend / prefill rows, matches SGLang's torch path `_sm120_sparse_decode_fwd`;
  the `triton` switch runs SGLang's upstream fallback and matches too.
"""

from __future__ import annotations

import json
import textwrap

SCRIPT = textwrap.dedent(
    r'''
    import json, math, os, sys, types
    import torch
    sys.path.insert(0, "tests")
    res = {}
    import sglang, inspect
    from sglang.srt.dsv4_sm120_hook import import_glue
    route = import_glue("attention")
    res["route_loaded"] = route is not None
    import sglang.srt.layers.attention.deepseek_v4_backend as be
    src = inspect.getsource(be)
    res["backend_routes"] = 'import_glue("attention")' in src and "_dsv4_route.sparse_attention(" in src
    from sglang.srt.runtime_context import override_platform
    import sglang.srt.models.deepseek_v4 as mdl
    fake = types.SimpleNamespace(n_local_heads=16, n_heads=64, attn_tp_size=4)
    heads = {}
    with override_platform(is_sm120=True):
        for b in ("dsv4", "triton"):
            os.environ["DSV4_SM120_ATTN_BACKEND"] = b
            heads[b] = [mdl.MqaAttentionBase._kernel_num_heads(fake, t) for t in (1, 17, 64, 65, 300)]
    os.environ.pop("DSV4_SM120_ATTN_BACKEND")
    res["heads"] = heads

    from sglang.kernels.ops.attention.flash_mla_sm120 import _sm120_sparse_decode_fwd
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from dsv4_sm120.attention.reference import rel_fro
    from attention_cases import Case, build
    # the interpreter has no benchmarker: give the upstream kernel's autotuner a single config
    from sglang.kernels.ops.attention import flash_mla_sm120_triton as up
    up._tiled_sparse_decode_kernel.configs = up._tiled_sparse_decode_kernel.configs[:1]
    errs = {}
    cases = {
        "decode": (ForwardMode.DECODE, Case(T=3, H=16, main_page=256, main_pages=2, K=32, extra="c4", extra_K=32,
                                             lengths="random", all_invalid_rows=(1,), seed=31), {}),
        "verify_T65": (ForwardMode.TARGET_VERIFY, Case(T=65, H=8, K=16, extra="c128", extra_page=2, extra_pages=20,
                                                       extra_K=16, sink="-inf", seed=32), {}),
        "draft_extend": (ForwardMode.DRAFT_EXTEND_V2, Case(T=2, H=8, K=16, seed=33), {}),
        "prefill_ours": (ForwardMode.EXTEND, Case(T=5, H=8, K=16, extra="c4", extra_K=16, seed=34),
                         {"DSV4_SM120_ATTN_PREFILL": "dsv4"}),
        # the register body (the sm_120 default for H <= 16 at small and large batches) through the same entry
        "decode_reg_body": (ForwardMode.DECODE, Case(T=4, H=16, K=40, extra="c4", extra_K=48, lengths="zero_some",
                                                     all_invalid_rows=(2,), seed=36),
                            {"DSV4_SM120_ATTN_CONFIG": "impl=reg,SPAN=0,DEC_LATE=0,waves=0.25"}),
        # the register body's default launch (spanning splits cut across the main / extra boundary, next block
        # decoded late, 4 warps), H = 24: two 16-row head groups of a verify batch
        "verify_reg_span": (ForwardMode.TARGET_VERIFY, Case(T=3, H=24, K=40, extra="c4", extra_K=48, lengths="random",
                                                            head_slice=True, seed=37),
                            {"DSV4_SM120_ATTN_CONFIG": "impl=reg,BLOCK_N=32,num_warps=4,DEC_LATE=1,SPAN=1,waves=3"}),
        "triton_switch": (ForwardMode.DECODE, Case(T=2, H=8, K=16, extra="c4", extra_K=16, lengths="random", seed=35),
                          {"DSV4_SM120_ATTN_BACKEND": "triton"}),
    }
    for name, (mode, case, env) in cases.items():
        os.environ.update(env)
        kw = build(case)
        q = kw.pop("q")
        sink = kw.get("attn_sink")
        # what the backend hands over: q padded to 64 heads for triton, real heads otherwise
        nh = q.shape[2]
        if env.get("DSV4_SM120_ATTN_BACKEND") == "triton":
            qp = torch.zeros(q.shape[0], 1, 64, 512, dtype=q.dtype)
            qp[:, :, :nh] = q
            sp = torch.zeros(64)
            if sink is not None:
                sp[:nh] = sink
            kw["attn_sink"] = sp
            qin = qp
        else:
            qin = q
        out = route.sparse_attention(mode, q=qin, num_heads=nh, **kw)[:, :, :nh]
        ref = _sm120_sparse_decode_fwd(q, kw["k_cache"], kw["indices"], kw.get("topk_length"), sink, 512,
                                       kw["softmax_scale"], kw.get("extra_k_cache"),
                                       kw.get("extra_indices_in_kvcache"), kw.get("extra_topk_length"))[0]
        errs[name] = [list(out.shape), rel_fro(out, ref), bool(torch.isfinite(out.float()).all())]
        for k in env:
            os.environ.pop(k)
    res["errs"] = errs
    print("RESULT " + json.dumps(res))
    '''
)


def test_patched_sglang_routes_sm120_attention(run_patched):
    p = run_patched(SCRIPT, env={"TRITON_INTERPRET": "1", "SGLANG_SM120_FLASHMLA_BACKEND": "flashinfer"}, timeout=600)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, f"subprocess failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    res = json.loads(line[-1][len("RESULT "):])
    assert res["route_loaded"]
    assert res["backend_routes"]
    assert res["heads"]["dsv4"] == [16, 16, 16, 16, 16]
    assert res["heads"]["triton"] == [64, 64, 64, 64, 64]
    for name, (shape, err, finite) in res["errs"].items():
        assert finite, name
        assert err < 1e-2, (name, err)
    assert res["errs"]["verify_T65"][0] == [65, 1, 8, 512]
    assert res["errs"]["decode_reg_body"][0] == [4, 1, 16, 512]
    assert res["errs"]["verify_reg_span"][0] == [3, 1, 24, 512]
