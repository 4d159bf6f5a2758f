"""dsv4_sm120.sglang_glue.moe and .fp8 in this process, with stand-in layers, dispatch outputs and config files:

* the runner choice (the stock choice passed through, the checkpoint's problems only for our runner, its lines);
* what our runner refuses of a layer (shapes that do not divide evenly included), the global scales it reads, what
  it sets on the dispatcher and logs, the self-check it runs on the layer's own weights;
* a serving call: the dispatcher it accepts, the top-k output it converts, the layer prepared on first use, the
  fallback to the other path and the one-line stop;
* the FP8 GEMM config lookup: the checkout the patches came from, the quantization block of the file name, one
  warning per bad file or directory.
"""

from __future__ import annotations

import json
import logging
import types

import pytest
import torch

from dsv4_sm120 import fp8_configs as fc
from dsv4_sm120.rank_agreement import StopServer
from dsv4_sm120.sglang_glue import fp8 as F
from dsv4_sm120.sglang_glue import moe as M
from dsv4_sm120.sglang_glue import selfcheck as S
from glue_fixtures import sglang_with_manifest  # noqa: E402

E4M3 = torch.float8_e4m3fn
NAME = "dsv4_triton_nvfp4"


@pytest.fixture
def fresh(monkeypatch):
    for k in ("DSV4_SM120_MOE_BACKEND", "DSV4_SM120_TEST_SELFCHECK_FAULT", "DSV4_SM120_FP8_CONFIG_DIR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("DSV4_SM120_MOE_PATH", "auto")
    monkeypatch.setenv("DSV4_SM120_PROFILE_DIR", "")
    monkeypatch.setattr(M, "_logged", set())
    monkeypatch.setattr(F, "_warned", set())
    S.reset()
    yield monkeypatch
    S.reset()


def test_the_runner_choice(fresh, caplog):
    fresh.setenv("DSV4_SM120_MOE_BACKEND", "stock")
    assert M.hybrid_nvfp4_moe_runner_backend(is_sm120=True, stock="their_choice") == "their_choice"
    assert M.hybrid_nvfp4_moe_runner_backend(is_sm120=False, stock="x") == "x"
    assert M.hybrid_nvfp4_moe_runner_backend(is_sm120=True, is_hip=True, stock="x") == "x"
    fresh.setenv("DSV4_SM120_MOE_BACKEND", NAME)
    fresh.setattr(M, "backend_available", lambda: True)
    cfg = types.SimpleNamespace(hidden_act="gelu")
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        assert M.hybrid_nvfp4_moe_runner_backend(is_sm120=True, hf_config=cfg) == NAME
    assert caplog.messages == [
        "dsv4_sm120: DSV4_SM120_MOE_BACKEND=dsv4_triton_nvfp4, but the experts' activation is 'gelu' (ours runs gated "
        "SiLU): the server will stop at the first MoE layer; unset it to serve with flashinfer_cutlass",
        "dsv4_sm120 decision moe.nvfp4: dsv4_triton_nvfp4 (env DSV4_SM120_MOE_BACKEND)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120"):
        assert M.hybrid_nvfp4_moe_runner_backend(is_sm120=True, moe_a2a_backend="deepep") == NAME
        assert M.hybrid_nvfp4_moe_runner_backend(is_sm120=True, nvfp4_meta={"group_size": 32}) == NAME
    assert "the MoE all-to-all backend is deepep (ours runs on the standard dispatcher)" in caplog.messages[0]
    assert "the checkpoint's NVFP4 group size is 32 (ours reads 16-element blocks)" in caplog.messages[1]
    caplog.clear()
    fresh.setattr(M, "backend_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120"):
        assert M.hybrid_nvfp4_moe_runner_backend(is_sm120=True, hf_config=cfg) == "flashinfer_cutlass"
    assert caplog.messages == ["DSV4_SM120_MOE_BACKEND=dsv4_triton_nvfp4 but that backend is not available; using "
                               "flashinfer_cutlass"]                  # no model problem for a runner not ours
    fresh.setenv("DSV4_SM120_MOE_BACKEND", "flashinfer_cutlass")
    seen = []
    fresh.setattr(M, "model_problem", lambda *a: seen.append(a) or "x")
    assert M.hybrid_nvfp4_moe_runner_backend(is_sm120=True, hf_config=cfg) == "flashinfer_cutlass" and seen == []


def test_the_profiles_runner_steps_aside_for_a_checkpoint_it_cannot_serve(fresh, caplog):
    import dsv4_sm120.moe_runner as MR

    fresh.setattr(MR, "nvfp4_profile_choice", lambda: (NAME, "profile P.json", ""))
    fresh.setattr(M, "backend_available", lambda: True)
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        got = M.hybrid_nvfp4_moe_runner_backend(is_sm120=True, hf_config=types.SimpleNamespace(hidden_act="relu"),
                                                nvfp4_meta={"group_size": 16}, moe_a2a_backend="none")
    assert got == "flashinfer_cutlass"
    assert caplog.messages == [
        "dsv4_sm120 decision moe.nvfp4: profile P.json picks dsv4_triton_nvfp4, but the experts' activation is "
        "'relu' (ours runs gated SiLU); flashinfer_cutlass serves instead",
        "dsv4_sm120 decision moe.nvfp4: flashinfer_cutlass (profile P.json; stepped aside: the experts' activation "
        "is 'relu' (ours runs gated SiLU))"]
    for act in ("SiLU", "swiglu", "SWIGLU", None):
        assert M.model_problem(types.SimpleNamespace(hidden_act=act)) is None, act
    assert M.model_problem(types.SimpleNamespace(), {"group_size": "16"}, None) is None
    assert M.model_problem(None, {"group_size": "x"}) is None            # unreadable: no problem here


def test_describe_and_backend_names(fresh, monkeypatch):
    fresh.setenv("DSV4_SM120_MOE_BACKEND", "stock")
    monkeypatch.setattr(M, "backend_available", lambda: "avail")
    assert M.describe(True) == {"hybrid_nvfp4_moe_runner_backend": M.STOCK_HYBRID_BACKEND,
                                "draft_mxfp4_expert_method": M.DRAFT_CUTLASS,
                                "triton_nvfp4_backend_available": "avail", "env": "stock"}
    assert M.describe(False)["draft_mxfp4_expert_method"] == M.DRAFT_TRTLLM
    assert M.is_backend(NAME) and M.is_backend(types.SimpleNamespace(value=NAME))
    assert not M.is_backend("flashinfer_cutlass") and not M.is_backend(types.SimpleNamespace(value="x"))
    assert not M.is_backend(types.SimpleNamespace(name=NAME))


def test_backend_available_asks_sglang(fresh, monkeypatch):
    import sys

    asked = []
    choices = types.ModuleType("sglang.srt.arg_groups.choices")
    utils = types.ModuleType("sglang.srt.layers.moe.utils")
    utils.resolve_moe_runner_backend = lambda name: asked.append(name)
    choices.MOE_RUNNER_BACKEND_CHOICES = ["auto", NAME]
    monkeypatch.setitem(sys.modules, choices.__name__, choices)
    monkeypatch.setitem(sys.modules, utils.__name__, utils)
    assert M.backend_available() is True and asked == [NAME]
    choices.MOE_RUNNER_BACKEND_CHOICES = ["auto"]
    assert M.backend_available() is False
    utils.resolve_moe_runner_backend = lambda name: (_ for _ in ()).throw(ValueError(name))
    choices.MOE_RUNNER_BACKEND_CHOICES = ["auto", NAME]
    assert M.backend_available() is False


def _layer(E=3, two_i=34, H=72, cfg=None, scale2_1d=True):
    """A loaded NVFP4 layer's tensors (gate+up rows, packed fp4 bytes, e4m3 block scales); I = two_i / 2."""
    t = types.SimpleNamespace
    lay = t(w13_weight=t(shape=(E, two_i, H // 2), data="w13", device=torch.device("cpu")),
            w13_weight_scale=torch.zeros(E, two_i, H // 16, dtype=E4M3),
            w2_weight=torch.zeros(E, H, two_i // 4, dtype=torch.uint8),
            w2_weight_scale=torch.zeros(E, H, two_i // 32, dtype=E4M3),
            w13_weight_scale_2=t(data=torch.arange(1, E + 1, dtype=torch.float64) if scale2_1d
                                 else torch.arange(2 * E, dtype=torch.float64).view(E, 2)),
            w2_weight_scale_2=t(data=torch.arange(E * 2, dtype=torch.float64).view(E, 2)))
    lay.w13_weight.shape = (E, two_i, H // 2)
    lay.moe_runner_config = cfg if cfg is not None else t(activation="silu", is_gated=True)
    return lay


def test_what_our_runner_refuses_of_a_layer(fresh):
    t = types.SimpleNamespace
    assert M.layer_problem(_layer()) is None                         # I = 17, H = 72: shapes with remainders
    assert M.layer_problem(_layer(cfg=t())) is None                  # SGLang's defaults: gated SiLU
    lay = _layer()
    del lay.moe_runner_config
    assert M.layer_problem(lay) is None
    assert M.layer_problem(_layer(cfg=t(activation="gelu"))) == "only gated SiLU (SwiGLU) experts are supported, got " \
        "'gelu'"
    assert M.layer_problem(_layer(cfg=t(activation="silu", is_gated=False))).startswith("only gated SiLU")
    assert M.layer_problem(_layer(cfg=t(apply_router_weight_on_input=True))) == \
        "apply_router_weight_on_input is not supported"
    lay = _layer()
    lay.w2_weight = torch.zeros(3, 72, 9, dtype=torch.uint8)
    assert M.layer_problem(lay) == "w2_weight has shape (3, 72, 9), expected (3, 72, 8)"
    lay = _layer()
    lay.w13_weight_scale = torch.zeros(3, 34, 5, dtype=E4M3)
    assert M.layer_problem(lay) == "w13_weight_scale has shape (3, 34, 5), expected (3, 34, 4)"
    lay = _layer()
    lay.w2_weight_scale = torch.zeros(3, 72, 1)
    assert M.layer_problem(lay) == "w2_weight_scale must be float8_e4m3fn"
    lay = _layer()
    lay.w13_weight_scale = lay.w13_weight_scale.float()
    assert M.layer_problem(lay) == "w13_weight_scale must be float8_e4m3fn"


def test_prepare_layer_keeps_the_tensors_and_checks_once(fresh, caplog):
    checked = []
    fresh.setattr(S, "check_moe", lambda layer, fn, device: checked.append((layer, fn, device)))
    ran = []
    fresh.setattr(M, "run_experts", lambda layer, x, tw, ids: ran.append((layer, x, tw, ids)) or "out")
    lay = _layer()
    lay.dispatcher = types.SimpleNamespace(set_quant_config=lambda cfg: setattr(lay, "quant_config", cfg))
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        M.prepare_layer(lay)
    assert lay.quant_config == {"input_global_scale": None}
    assert caplog.messages == ["dsv4_triton_nvfp4: MoE layer with 3 local experts, H=72, I=17"]
    assert lay._dsv4_w13_scale_2.tolist() == [[1, 1], [2, 2], [3, 3]] and lay._dsv4_w13_scale_2.dtype == torch.float32
    assert lay._dsv4_w13_scale_2.is_contiguous() and lay._dsv4_w2_scale_2.tolist() == [0, 1, 2, 3, 4, 5]
    assert lay._dsv4_w2_scale_2.dtype == torch.float32
    (layer, fn, device), = checked
    assert layer is lay and device == torch.device("cpu") and fn("x", "tw", "ids") == "out"
    assert ran == [(lay, "x", "tw", "ids")]
    two = _layer(scale2_1d=False)
    two.dispatcher = types.SimpleNamespace()                   # no set_quant_config: left alone
    M.prepare_layer(two)
    assert two._dsv4_w13_scale_2.tolist() == [[0, 1], [2, 3], [4, 5]]
    bad = _layer(cfg=types.SimpleNamespace(activation="relu"))
    with pytest.raises(StopServer) as e:
        M.prepare_layer(bad)
    assert str(e.value) == ("dsv4_triton_nvfp4: only gated SiLU (SwiGLU) experts are supported, got 'relu'; restart "
                            "with DSV4_SM120_MOE_BACKEND=flashinfer_cutlass (and without --moe-runner-backend "
                            "dsv4_triton_nvfp4)")


def test_the_runner_reads_the_layers_tensors_and_plants_faults(fresh, monkeypatch):
    import dsv4_sm120.moe as pkg

    got = {}
    monkeypatch.setattr(pkg, "nvfp4_fused_moe", lambda *a, **k: got.update(a=a, k=k) or torch.ones(2, 4))
    lay = _layer(cfg=types.SimpleNamespace(swiglu_limit=7.0))
    lay.w13_weight_scale, lay.w2_weight, lay.w2_weight_scale = (types.SimpleNamespace(data=n) for n in
                                                                ("s13", "w2", "s2"))
    lay._dsv4_w13_scale_2, lay._dsv4_w2_scale_2 = "g13", "g2"
    assert torch.equal(M.run_experts(lay, "x", "tw", "ids"), torch.ones(2, 4))
    assert got == {"a": ("x", "w13", "s13", "g13", "w2", "s2", "g2", "tw", "ids"), "k": {"swiglu_limit": 7.0}}
    lay.moe_runner_config = types.SimpleNamespace()
    M.run_experts(lay, "x", "tw", "ids")
    assert got["k"] == {"swiglu_limit": None}
    monkeypatch.setenv("DSV4_SM120_TEST_SELFCHECK_FAULT", "moe")
    assert torch.equal(M.run_experts(lay, "x", "tw", "ids"), torch.full((2, 4), 2.0))
    monkeypatch.setenv("DSV4_SM120_TEST_SELFCHECK_FAULT", "moe-raise")
    with pytest.raises(RuntimeError) as e:
        M.run_experts(lay, "x", "tw", "ids")
    assert str(e.value) == "planted test fault moe-raise (DSV4_SM120_TEST_SELFCHECK_FAULT) on the first path"
    S._switch_moe_path("bf16")
    assert torch.equal(M.run_experts(lay, "x", "tw", "ids"), torch.ones(2, 4))     # the other path: no fault


def _dispatch(x, topk=None, scale=None, **extra):
    topk = topk or types.SimpleNamespace(topk_weights="tw", topk_ids="ids")
    return types.SimpleNamespace(hidden_states=x, hidden_states_scale=scale, topk_output=topk, **extra)


def test_a_serving_call(fresh):
    ran = []
    fresh.setattr(M, "run_experts", lambda layer, x, tw, ids: ran.append((tw, ids)) or "out")
    prepared = []
    fresh.setattr(M, "prepare_layer", lambda layer: prepared.append(layer) or setattr(layer, "_dsv4_w13_scale_2", 1))
    lay = _layer()
    x = torch.zeros(3, 72)
    assert M.apply(lay, _dispatch(x)) == "out" and ran == [("tw", "ids")] and prepared == [lay]
    assert M.apply(lay, _dispatch(x)) == "out" and prepared == [lay]          # prepared once
    std = types.SimpleNamespace(topk_weights="w2", topk_ids="i2")
    M.apply(lay, _dispatch(x, topk=types.SimpleNamespace(to_standard=lambda: std)))
    assert ran[-1] == ("w2", "i2")
    M.apply(lay, _dispatch(x, topk=types.SimpleNamespace(topk_weights="w3", topk_ids="i3", to_standard=lambda: std)))
    assert ran[-1] == ("w3", "i3")
    for bad in (types.SimpleNamespace(hidden_states=x), _dispatch(x, scale=torch.ones(1))):
        with pytest.raises(StopServer) as e:
            M.apply(lay, bad)
        assert str(e.value) == ("dsv4_triton_nvfp4 runs on the standard (no all-to-all) MoE dispatcher with bf16 "
                                "hidden states; got SimpleNamespace; restart with DSV4_SM120_MOE_BACKEND="
                                "flashinfer_cutlass (and without --moe-runner-backend dsv4_triton_nvfp4)")


def test_a_serving_call_that_raises_takes_the_other_path_then_stops(fresh):
    calls = []

    def run(layer, x, tw, ids):
        calls.append(S.moe_fallback_path())
        if len(calls) in (1, 3, 4):
            raise RuntimeError("x" * 400)
        return "answer"

    fresh.setattr(M, "run_experts", run)
    steps = []
    real = S.moe_step_aside
    fresh.setattr(S, "moe_step_aside", lambda shape, why, device: steps.append((shape, why, device)) or real(
        shape, why, device))
    lay = _layer()
    lay._dsv4_w13_scale_2 = 1
    x = torch.zeros(5, 72)
    assert M.apply(lay, _dispatch(x)) == "answer" and calls == [None, S.moe_fallback_path()]
    assert steps == [("M=5 E=3 H=72 I=17", "RuntimeError: " + "x" * 300, x.device)]
    other = S.moe_fallback_path()
    with pytest.raises(StopServer) as e:
        M.apply(lay, _dispatch(x))
    assert str(e.value) == (f"dsv4_sm120: our MoE kernel fails on this GPU at M=5 E=3 H=72 I=17 on its {other} path "
                            f"too (RuntimeError: {'x' * 300}); restart with DSV4_SM120_MOE_BACKEND=flashinfer_cutlass")


# ---------------------------------------------------------------------------- the FP8 GEMM configs

GOOD = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1, "num_warps": 4,
        "num_stages": 3}


def test_the_configs_of_the_checkout_the_patches_came_from(fresh, tmp_path):
    repo, root = sglang_with_manifest(tmp_path)
    name = fc.config_file_name(1024, 4096, "Fake GPU", block_k=64)
    (repo / "configs" / "fp8" / name).write_text(json.dumps({"1": GOOD}))
    assert F.project_config_path(name, root) == str(repo / "configs" / "fp8" / name)
    # the quantization block of the file name bounds BLOCK_SIZE_K: 128 passes a block of 128, not of 64
    (repo / "configs" / "fp8" / name).write_text(json.dumps({"1": dict(GOOD, BLOCK_SIZE_K=128)}))
    assert F.project_config_path(name, root) is None
    name128 = fc.config_file_name(1024, 4096, "Fake GPU")
    (repo / "configs" / "fp8" / name128).write_text(json.dumps({"1": dict(GOOD, BLOCK_SIZE_K=128)}))
    assert F.project_config_path(name128, root) == str(repo / "configs" / "fp8" / name128)
    other = "some_other_name.json"                    # not SGLang's pattern: the block of 128
    (repo / "configs" / "fp8" / other).write_text(json.dumps({"1": dict(GOOD, BLOCK_SIZE_K=128)}))
    assert F.project_config_path(other, root) == str(repo / "configs" / "fp8" / other)


def test_one_warning_per_bad_file_and_directory(fresh, tmp_path, caplog):
    fresh.setenv("DSV4_SM120_FP8_CONFIG_DIR", str(tmp_path / "nope"))
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120"):
        assert F.project_config_dir() is None and F.project_config_dir() is None
        fresh.setenv("DSV4_SM120_FP8_CONFIG_DIR", str(tmp_path / "nope2"))
        assert F.project_config_dir() is None
    assert caplog.messages == [f"DSV4_SM120_FP8_CONFIG_DIR={tmp_path / 'nope'} is not a directory; using SGLang's own "
                               "FP8 GEMM configs",
                               f"DSV4_SM120_FP8_CONFIG_DIR={tmp_path / 'nope2'} is not a directory; using SGLang's own "
                               "FP8 GEMM configs"]
    caplog.clear()
    fresh.setenv("DSV4_SM120_FP8_CONFIG_DIR", str(tmp_path))
    assert F.project_config_dir() == tmp_path
    bad1, bad2 = (fc.config_file_name(n, 4096, "Fake GPU") for n in (1, 2))
    (tmp_path / bad1).write_text("{not json")
    (tmp_path / bad2).write_text(json.dumps({"1": dict(GOOD, BLOCK_SIZE_K=256)}))
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120"):
        for _ in range(2):
            assert F.project_config_path(bad1) is None and F.project_config_path(bad2) is None
    assert len(caplog.messages) == 2
    assert caplog.messages[0].startswith(f"ignoring invalid FP8 GEMM config {tmp_path / bad1} (Expecting property name")
    assert caplog.messages[1] == (f"ignoring invalid FP8 GEMM config {tmp_path / bad2} (M=1: BLOCK_SIZE_K=256 must "
                                  "divide the quantization block 128); using SGLang's own")
    caplog.clear()
    fresh.setattr(F, "_project_config_path", lambda name, root: (_ for _ in ()).throw(KeyError("k")))
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120"):
        assert F.project_config_path("a") is None and F.project_config_path("b") is None
    assert caplog.messages == ["dsv4_sm120: FP8 GEMM config lookup failed (KeyError: 'k'); using SGLang's own configs"]
    seen = []
    fresh.setattr(F, "_project_config_path", lambda name, root: seen.append((name, root)) or "p")
    assert F.project_config_path("n", "root") == "p" and seen == [("n", "root")]


def test_the_decision_is_logged_once(fresh, caplog):
    fresh.setenv("DSV4_SM120_MOE_BACKEND", "flashinfer_cutlass")
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        M.hybrid_nvfp4_moe_runner_backend(is_sm120=True)
        M.hybrid_nvfp4_moe_runner_backend(is_sm120=True)
    assert caplog.messages == ["dsv4_sm120 decision moe.nvfp4: flashinfer_cutlass (env DSV4_SM120_MOE_BACKEND)"]


def test_a_dispatch_output_without_a_scale_field_and_both_paths_failing(fresh):
    fresh.setattr(M, "run_experts", lambda layer, x, tw, ids: "out")
    lay = _layer()
    lay._dsv4_w13_scale_2 = 1
    x = torch.zeros(2, 72)
    d = types.SimpleNamespace(hidden_states=x, topk_output=types.SimpleNamespace(topk_weights=1, topk_ids=2))
    assert M.apply(lay, d) == "out"                                   # no hidden_states_scale attribute at all

    def always(layer, x, tw, ids):
        raise ValueError("y" * 400)

    fresh.setattr(M, "run_experts", always)
    with pytest.raises(StopServer) as e:
        M.apply(lay, d)
    other = S.moe_fallback_path()
    assert str(e.value) == (f"dsv4_sm120: our MoE kernel fails on this GPU at M=2 E=3 H=72 I=17 on its {other} path "
                            f"too (ValueError: {'y' * 300}); restart with DSV4_SM120_MOE_BACKEND=flashinfer_cutlass")
