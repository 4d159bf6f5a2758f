"""MoE route for hybrid FP8+NVFP4 DeepSeek-V4 checkpoints on sm_120 (dsv4_sm120.sglang_glue.moe + patch 0003).

Unit tests of the choice functions, then SGLang 0.5.23 itself (patched scratch copy, in
a subprocess, platform forced to sm_120 / sm_100) resolving server arguments against a
directory written by the converter and building the MoE quant methods the loader would
build. The same checks with the overlay switched off (DSV4_SM120_DISABLE=1) give
the stock, sm_100-only answers, so these tests fail without the patch.
"""

from __future__ import annotations

import logging
import textwrap

import pytest
from conftest import probe_result

from dsv4_sm120.settings import SettingsError
from dsv4_sm120.sglang_glue import moe as R


# ----------------------------------------------------------------------------
# the choice functions
# ----------------------------------------------------------------------------


def test_backend_choice(monkeypatch):
    monkeypatch.delenv(R.ENV_BACKEND, raising=False)
    monkeypatch.setattr(R, "backend_available", lambda: False)
    assert R.hybrid_nvfp4_moe_runner_backend(is_sm120=True) == "flashinfer_cutlass"
    assert R.hybrid_nvfp4_moe_runner_backend(is_sm120=False) == "flashinfer_trtllm_routed"
    assert R.hybrid_nvfp4_moe_runner_backend(is_sm120=False, stock="x") == "x"
    assert R.hybrid_nvfp4_moe_runner_backend(is_sm120=True, is_hip=True, stock="x") == "x"
    # the one switch for the overlay's Triton runner
    monkeypatch.setattr(R, "backend_available", lambda: True)
    # the overlay's Triton runner is opt-in (not measured on sm_120 yet): auto stays on CUTLASS
    assert R.hybrid_nvfp4_moe_runner_backend(is_sm120=True) == "flashinfer_cutlass"
    assert R.hybrid_nvfp4_moe_runner_backend(is_sm120=False) == "flashinfer_trtllm_routed"
    monkeypatch.setenv(R.ENV_BACKEND, "dsv4_triton_nvfp4")
    assert R.hybrid_nvfp4_moe_runner_backend(is_sm120=True) == "dsv4_triton_nvfp4"
    assert R.hybrid_nvfp4_moe_runner_backend(is_sm120=False) == "flashinfer_trtllm_routed"
    monkeypatch.setenv(R.ENV_BACKEND, "flashinfer_cutlass")
    assert R.hybrid_nvfp4_moe_runner_backend(is_sm120=True) == "flashinfer_cutlass"


def test_backend_env(monkeypatch, caplog):
    monkeypatch.setattr(R, "backend_available", lambda: False)
    monkeypatch.setenv(R.ENV_BACKEND, "stock")
    assert R.hybrid_nvfp4_moe_runner_backend(is_sm120=True) == "flashinfer_trtllm_routed"
    monkeypatch.setenv(R.ENV_BACKEND, "dsv4_triton_nvfp4")  # asked for, not available
    with caplog.at_level(logging.WARNING):
        assert R.hybrid_nvfp4_moe_runner_backend(is_sm120=True) == "flashinfer_cutlass"
    assert "not available" in caplog.text
    monkeypatch.setenv(R.ENV_BACKEND, "bogus")  # a typo is an error naming the variable and the valid values
    with pytest.raises(SettingsError, match=r"DSV4_SM120_MOE_BACKEND='bogus'.*auto, flashinfer_cutlass, "
                                            r"dsv4_triton_nvfp4, stock"):
        R.hybrid_nvfp4_moe_runner_backend(is_sm120=True)
    assert R.hybrid_nvfp4_moe_runner_backend(is_sm120=False) == "flashinfer_trtllm_routed"  # not read off sm_120


def test_draft_method_choice():
    assert R.draft_mxfp4_expert_method(is_sm120=True) == R.DRAFT_CUTLASS
    assert R.draft_mxfp4_expert_method(is_sm120=False) == R.DRAFT_TRTLLM
    assert R.draft_mxfp4_expert_method(is_sm120=True, is_hip=True) == R.DRAFT_TRTLLM
    d = R.describe(is_sm120=True)
    assert d["hybrid_nvfp4_moe_runner_backend"] in ("flashinfer_cutlass", "dsv4_triton_nvfp4")


# ----------------------------------------------------------------------------
# the patched SGLang
# ----------------------------------------------------------------------------

PROBE = textwrap.dedent(r"""
    import json, logging, os, sys
    from unittest import mock
    logging.disable(logging.WARNING)
    job = json.loads(sys.argv[1])
    import sglang
    from sglang.srt.runtime_context import override_platform, publish
    from sglang.srt.server_args import prepare_server_args
    PLAT = {
        "sm120": dict(is_sm120=True, is_sm100=False, is_sm100_or_sm110=False, is_sm90=False, is_blackwell=True),
        "sm100": dict(is_sm120=False, is_sm100=True, is_sm100_or_sm110=True, is_sm90=False, is_blackwell=True),
    }
    out = {"sglang": sglang.__file__}
    from dsv4_sm120.sglang_glue import moe as glue_moe
    out["triton_available"] = glue_moe.backend_available()

    def resolve(argv, plat):
        with override_platform(is_cuda=True, is_hip=False, has_flashinfer=True, **PLAT[plat]):
            a = prepare_server_args(argv)
            a.resolve_once()
            return a

    for name, argv, plat, env in job.get("resolve", []):
        try:
            with mock.patch.dict(os.environ, env):
                d = resolve(argv, plat).resolved_dict()
            out[name] = {"moe": d["moe_runner_backend"], "quant": d["quantization"],
                         "spec": d["speculative_algorithm"]}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}

    # The MoE quant methods the loader would build (publish is per process: last wins).
    for name, argv, plat, prefixes in job.get("methods", []):
        try:
            with override_platform(is_cuda=True, is_hip=False, has_flashinfer=True, **PLAT[plat]):
                a = resolve(argv, plat)
                publish(a, role="scheduler")
                from sglang.srt.layers.moe.utils import initialize_moe_config
                initialize_moe_config()
                from sglang.srt.configs.load_config import LoadConfig
                from sglang.srt.configs.model_config import ModelConfig
                from sglang.srt.model_loader import loader
                # FlashInfer's import check asks torch for CUDA; this box has none.
                import sglang.srt.layers.quantization.mxfp4_flashinfer_cutlass_moe as cm
                import sglang.srt.layers.quantization.mxfp4_flashinfer_trtllm_moe as tm
                cm.is_flashinfer_available = lambda: True
                if hasattr(tm, "is_flashinfer_available"):
                    tm.is_flashinfer_available = lambda: True
                qc = loader._get_quantization_config(ModelConfig.from_server_args(a), LoadConfig())
                from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
                layer = FusedMoE.__new__(FusedMoE)
                res = {"quant_config": type(qc).__name__, "moe": a.resolved_dict()["moe_runner_backend"]}
                for p in prefixes:
                    try:
                        m = qc.get_quant_method(layer, p)
                        res[p] = type(m).__module__ + "." + type(m).__name__
                    except Exception as e:
                        res[p] = f"error {type(e).__name__}: {e}"
                out[name] = res
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    print("RESULT" + json.dumps(out))
""")


def _probe(run_patched, job, env=None):
    return probe_result(run_patched, PROBE, job, env=env, timeout=400)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from test_convert_nvfp4 import make_synthetic_checkpoint

    from dsv4_sm120 import convert_nvfp4 as C

    base = tmp_path_factory.mktemp("route")
    src = make_synthetic_checkpoint(base / "mxfp4", seed=11)
    C.convert(src, base / "nvfp4", progress=False, quiet=True)
    return str(src), str(base / "nvfp4")


MAIN = "model.layers.0.mlp.experts"
DRAFT = "model.decoder.mlp.experts"
SPEC = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4"]


def test_patched_sglang_routes_hybrid_nvfp4_on_sm120(run_patched, patched_sglang_site, ckpts):
    src, dst = ckpts
    m = ["--model-path", dst]
    job = {
        "resolve": [
            ["sm120_cpu", m + ["--device", "cpu"], "sm120", {}],
            ["sm120_cuda", m + ["--device", "cuda"], "sm120", {}],
            ["sm120_tp4", m + ["--device", "cuda", "--tp", "4"], "sm120", {}],
            ["sm120_mtp", m + ["--device", "cuda"] + SPEC, "sm120", {}],
            ["sm100", m + ["--device", "cuda"], "sm100", {}],
            ["sm120_explicit", m + ["--device", "cuda", "--moe-runner-backend", "flashinfer_trtllm_routed"],
             "sm120", {}],
            ["sm120_env_stock", m + ["--device", "cuda"], "sm120", {R.ENV_BACKEND: "stock"}],
            ["sm120_env_cutlass", m + ["--device", "cuda"], "sm120", {R.ENV_BACKEND: "flashinfer_cutlass"}],
            ["src_sm120", ["--model-path", src, "--device", "cuda"], "sm120", {}],
        ],
        "methods": [
            ["hybrid_sm120", m + ["--device", "cuda"], "sm120", [MAIN, DRAFT]],
            ["hybrid_sm120_cutlass", m + ["--device", "cuda", "--moe-runner-backend", "flashinfer_cutlass"],
             "sm120", [MAIN, DRAFT]],
            # oracle: what stock SGLang builds for MXFP4 experts on sm_120 (released checkpoint)
            ["mxfp4_sm120", ["--model-path", src, "--device", "cuda"], "sm120", [MAIN]],
        ],
    }
    out = _probe(run_patched, job)
    assert out["sglang"].startswith(str(patched_sglang_site))
    # sm_120 default: FlashInfer's CUTLASS NVFP4 MoE (runs on sm_120); the overlay's Triton runner is opt-in
    want = "flashinfer_cutlass"
    for k in ("sm120_cpu", "sm120_cuda", "sm120_tp4", "sm120_mtp"):
        assert out[k].get("moe") == want, (k, out[k])
        assert out[k]["quant"] is None  # --quantization left for SGLang to detect
    assert out["sm120_env_cutlass"]["moe"] == "flashinfer_cutlass"
    assert out["sm120_mtp"]["spec"] == "EAGLE"
    assert out["sm100"]["moe"] == "flashinfer_trtllm_routed"  # stock choice kept off sm_120
    assert out["sm120_explicit"]["moe"] == "flashinfer_trtllm_routed"  # explicit flag wins
    assert out["sm120_env_stock"]["moe"] == "flashinfer_trtllm_routed"
    assert out["src_sm120"]["moe"] == "flashinfer_mxfp4"  # released checkpoint: unchanged

    h = out["hybrid_sm120"]
    assert h.get("quant_config") == "HybridFp8NvFp4Config", h
    assert h["moe"] == want
    assert h[MAIN].endswith(".ModelOptNvFp4FusedMoEMethod"), h
    hc = out["hybrid_sm120_cutlass"]
    assert hc["moe"] == "flashinfer_cutlass" and hc[MAIN].endswith(".ModelOptNvFp4FusedMoEMethod"), hc
    assert hc[DRAFT] == h[DRAFT], hc
    stock_mxfp4_sm120 = out["mxfp4_sm120"]
    assert stock_mxfp4_sm120.get(MAIN, "").endswith(".Mxfp4FlashinferCutlassMoEMethod"), stock_mxfp4_sm120
    # MTP draft experts (MXFP4 in this format) get the class stock SGLang runs MXFP4 with on sm_120
    assert h[DRAFT] == stock_mxfp4_sm120[MAIN], h
    assert "Trtllm" not in h[DRAFT]


def test_overlay_off_gives_stock_sm100_only_choices(run_patched, ckpts):
    """Without the overlay the patched SGLang behaves like stock 0.5.23: the sm_100-only
    runner and draft method (what the tests above would see without patch 0003)."""
    _, dst = ckpts
    m = ["--model-path", dst, "--device", "cuda"]
    out = _probe(run_patched, {"resolve": [["sm120", m, "sm120", {}]],
                               "methods": [["hybrid_sm120", m, "sm120", [MAIN, DRAFT]]]},
                 env={"DSV4_SM120_DISABLE": "1"})
    assert out["sm120"]["moe"] == "flashinfer_trtllm_routed"
    h = out["hybrid_sm120"]
    assert h["moe"] == "flashinfer_trtllm_routed"
    assert h[DRAFT].endswith(".Mxfp4FlashinferTrtllmMoEMethod") or "Trtllm" in h[DRAFT], h
