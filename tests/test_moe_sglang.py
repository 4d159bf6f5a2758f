"""Patch 0005 in the patched pinned SGLang: the ``dsv4_triton_nvfp4`` MoE runner.

One subprocess (PYTHONPATH=<patched site>:overlay, TRITON_INTERPRET=1) checks:
* server-argument resolution for a converted DeepSeek-V4 hybrid NVFP4 checkpoint
  on a (forced) sm_120 platform: ``flashinfer_cutlass`` by default, ``dsv4_triton_nvfp4`` by env or flag;
  ``flashinfer_cutlass`` with the env switch or the explicit flag; the new name
  is a valid ``--moe-runner-backend`` choice; off sm_120 the stock choice stays;
* ``ModelOptNvFp4FusedMoEMethod`` with that backend: ``create_moe_runner`` builds
  no FlashInfer runner, ``process_weights_after_loading`` keeps the loaded NVFP4
  tensors untouched, ``apply`` returns the routed-experts output, which matches
  the float64 reference (dropped ids included); the fp4 path (sm_120's) through the same ``apply``
  matches the activation-quantized reference, with activations quantized once per row or in every program;
and, as a control, that with the overlay disabled the name is rejected; with
``DSV4_SM120_TEST_SELFCHECK_FAULT=moe-raise`` (our kernel raises on its first path) SGLang's
``process_weights_after_loading`` reaches the self-check, which switches to the other path, and ``apply`` answers right.
"""

from __future__ import annotations

import textwrap

import pytest
from conftest import probe_result

PROBE = textwrap.dedent(r"""
    import json, logging, os, sys
    from unittest import mock
    logging.disable(logging.WARNING)
    job = json.loads(sys.argv[1])
    out = {}
    from sglang.srt.runtime_context import override_platform, publish
    from sglang.srt.server_args import prepare_server_args
    SM120 = dict(is_sm120=True, is_sm100=False, is_sm100_or_sm110=False, is_sm90=False, is_blackwell=True)
    SM100 = dict(is_sm120=False, is_sm100=True, is_sm100_or_sm110=True, is_sm90=False, is_blackwell=True)

    def resolve(argv, plat):
        with override_platform(is_cuda=True, is_hip=False, has_flashinfer=True, **plat):
            a = prepare_server_args(argv)
            a.resolve_once()
            return a

    m = ["--model-path", job["ckpt"], "--device", "cuda"]
    cases = {
        "default": (m, SM120, {}),
        "env_cutlass": (m, SM120, {"DSV4_SM120_MOE_BACKEND": "flashinfer_cutlass"}),
        "env_triton": (m, SM120, {"DSV4_SM120_MOE_BACKEND": "dsv4_triton_nvfp4"}),
        "flag_cutlass": (m + ["--moe-runner-backend", "flashinfer_cutlass"], SM120, {}),
        "flag_triton": (m + ["--moe-runner-backend", "dsv4_triton_nvfp4"], SM120, {}),
        "sm100": (m, SM100, {}),
    }
    for name, (argv, plat, env) in cases.items():
        try:
            with mock.patch.dict(os.environ, env):
                out[name] = resolve(argv, plat).resolved_dict()["moe_runner_backend"]
        except BaseException as e:
            out[name] = f"error {type(e).__name__}: {e}"
    if not job.get("layer"):
        print("RESULT" + json.dumps(out)); sys.exit(0)

    # --- the quant method with the overlay backend, on a tiny layer ---
    import torch
    from sglang.srt.layers.moe.utils import initialize_moe_config, get_moe_runner_backend
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import loader
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptNvFp4FusedMoEMethod
    from dsv4_sm120.moe.testing import make_experts, random_routing
    from dsv4_sm120.moe.reference import moe_reference, rel_err

    with override_platform(is_cuda=True, is_hip=False, has_flashinfer=True, **SM120):
        a = resolve(m + ["--moe-runner-backend", "dsv4_triton_nvfp4"], SM120)
        publish(a, role="scheduler")
        initialize_moe_config()
        out["global_backend"] = get_moe_runner_backend().value
        qc = loader._get_quantization_config(ModelConfig.from_server_args(a), LoadConfig())
        method = ModelOptNvFp4FusedMoEMethod(getattr(qc, "nvfp4_config", qc))
    E, H, I, k, M = 8, 64, 32, 6, 5
    W = make_experts(E, H, I, 21)

    class Layer(torch.nn.Module):
        pass

    layer = Layer()
    for name, key in (("w13_weight", "w13"), ("w13_weight_scale", "w13_scale"), ("w13_weight_scale_2", "w13_scale_2"),
                      ("w2_weight", "w2"), ("w2_weight_scale", "w2_scale"), ("w2_weight_scale_2", "w2_scale_2")):
        layer.register_parameter(name, torch.nn.Parameter(W[key].clone(), requires_grad=False))
    layer._mega_moe_nvfp4 = False
    cfg = MoeRunnerConfig(num_experts=E, num_local_experts=E, hidden_size=H, intermediate_size_per_partition=I,
                          top_k=k, params_dtype=torch.bfloat16, activation="silu", is_gated=True,
                          swiglu_limit=1.5)
    layer.moe_runner_config = cfg
    method.create_moe_runner(layer, cfg)
    out["runner_is_none"] = method.runner is None
    out["layer_backend"] = method.get_moe_runner_backend(layer).value
    before = {n: p.data.clone() for n, p in layer.named_parameters()}
    from dsv4_sm120.sglang_glue import selfcheck
    method.process_weights_after_loading(layer)
    check = selfcheck.results()["moe"] or {}
    out["moe_check"] = {k: check.get(k) for k in ("ok", "path", "error", "fallback", "fallback_error")}
    out["moe_path_after_check"] = os.environ.get("DSV4_SM120_MOE_PATH")
    out["weights_untouched"] = all(torch.equal(before[n], p.data) for n, p in layer.named_parameters())
    out["up_proj_first"] = bool(method.load_up_proj_weight_first)
    x = (torch.randn((M, H)) * 2).to(torch.bfloat16)
    tw, ids = random_routing(M, E, k, 22, kind="dropped")
    d = StandardDispatchOutput(hidden_states=x, hidden_states_scale=None,
                               topk_output=StandardTopKOutput(tw, ids, torch.zeros((M, E))))
    res = method.apply(layer, d)
    y = res.hidden_states
    ref = moe_reference(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=1.5)
    out["combine_type"] = type(res).__name__
    out["shape"] = list(y.shape)
    out["err"] = rel_err(y, ref)
    out["err_no_clamp"] = rel_err(y, moe_reference(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=None))
    if job.get("stop_after_apply"):
        out["err_actquant"] = rel_err(y, moe_reference(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=1.5,
                                                       act_quant=True))
        print("RESULT" + json.dumps(out)); sys.exit(0)
    # the sm_120 default path (fp4, activations quantized once per row) through the same SGLang entry point,
    # and the in-every-program form (DSV4_SM120_MOE_APRE=0): same bits, and the act-quant reference matched
    os.environ["DSV4_SM120_MOE_PATH"] = "fp4"
    y4 = method.apply(layer, d).hidden_states
    os.environ["DSV4_SM120_MOE_APRE"] = "0"
    y4_inloop = method.apply(layer, d).hidden_states
    refq = moe_reference(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=1.5, act_quant=True)
    out["fp4_err_vs_actquant"] = rel_err(y4, refq)
    out["fp4_apre_equals_inloop"] = bool(torch.equal(y4, y4_inloop))
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def hybrid_ckpt(tmp_path_factory):
    from test_convert_nvfp4 import make_synthetic_checkpoint

    from dsv4_sm120 import convert_nvfp4 as C

    base = tmp_path_factory.mktemp("moe5")
    src = make_synthetic_checkpoint(base / "mxfp4", seed=5)
    C.convert(src, base / "nvfp4", progress=False, quiet=True)
    return str(base / "nvfp4")


def _probe(run_patched, job, env=None):
    return probe_result(run_patched, PROBE, job, env=env, timeout=500)


def test_patched_sglang_runs_routed_experts_through_overlay(run_patched, hybrid_ckpt):
    out = _probe(run_patched, {"ckpt": hybrid_ckpt, "layer": True}, env={"TRITON_INTERPRET": "1"})
    assert out["default"] == "flashinfer_cutlass"  # ours is opt-in until measured on sm_120
    assert out["env_triton"] == "dsv4_triton_nvfp4"
    assert out["env_cutlass"] == "flashinfer_cutlass"
    assert out["flag_cutlass"] == "flashinfer_cutlass"
    assert out["flag_triton"] == "dsv4_triton_nvfp4"
    assert out["sm100"] == "flashinfer_trtllm_routed"
    assert out["global_backend"] == "dsv4_triton_nvfp4"
    assert out["layer_backend"] == "dsv4_triton_nvfp4"
    assert out["runner_is_none"] is True
    assert out["weights_untouched"] is True
    assert out["up_proj_first"] is False  # loader keeps [gate, up], as the kernel reads it
    assert out["combine_type"] == "StandardCombineInput"
    assert out["shape"] == [5, 64]
    assert out["err"] < 1.5e-2
    assert out["err_no_clamp"] > 5e-2  # the clamp really was applied
    assert out["fp4_err_vs_actquant"] < 3e-2
    assert out["fp4_apre_equals_inloop"] is True


def test_overlay_disabled_rejects_the_backend_name(run_patched, hybrid_ckpt):
    out = _probe(run_patched, {"ckpt": hybrid_ckpt}, env={"DSV4_SM120_DISABLE": "1"})
    assert out["default"] == "flashinfer_trtllm_routed"  # stock SGLang choice without the overlay
    assert out["flag_cutlass"] == "flashinfer_cutlass"
    assert out["flag_triton"].startswith("error"), out["flag_triton"]


def test_moe_that_raises_in_prepare_layer_serves_on_its_other_path(run_patched, hybrid_ckpt):
    # DSV4_SM120_TEST_SELFCHECK_FAULT=moe-raise: our MoE kernel raises on its first path; SGLang's
    # process_weights_after_loading -> prepare_layer -> the self-check catches it, switches to the other path, and
    # the method's apply then answers right
    out = _probe(run_patched, {"ckpt": hybrid_ckpt, "layer": True, "stop_after_apply": True},
                 env={"TRITON_INTERPRET": "1", "DSV4_SM120_TEST_SELFCHECK_FAULT": "moe-raise"})
    chk = out["moe_check"]
    assert chk["ok"] is False and "RuntimeError: planted test fault moe-raise" in chk["error"], chk
    other = "bf16" if chk["path"] == "fp4" else "fp4"
    assert chk["fallback"] == other and chk["fallback_error"] is None, chk
    assert out["moe_path_after_check"] == other
    assert out["combine_type"] == "StandardCombineInput"
    # the other path's own accuracy: bf16 matches the reference, fp4 the activation-quantized reference
    assert (out["err"] if other == "bf16" else out["err_actquant"]) < 3e-2, out
