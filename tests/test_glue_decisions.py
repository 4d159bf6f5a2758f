"""How the SGLang glue decides from the machine profile (dsv4_sm120.sglang_glue.attention, .moe, and
dsv4_sm120.fp8_configs): precedence explicit setting > profile > default, per-bucket attention routing by rows and
layout, the one log line per decision, the head count the model asks for, server-wide choices (MoE runner, FP8
backend) from the profile's votes, and what a self-check disable does to the routes.

The profile is written to a temporary DSV4_SM120_PROFILE_DIR for a GPU name given through
DSV4_SM120_TEST_GPU_NAME, with this environment's versions (so it matches) or others (so it does not)."""

from __future__ import annotations

import logging
import random
import types

import pytest

from dsv4_sm120 import fp8_configs as FC
from dsv4_sm120 import machine_profile as P
from dsv4_sm120.sglang_glue import attention as A
from dsv4_sm120.sglang_glue import moe as M

GPU = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
ENVS = ("DSV4_SM120_ATTN_BACKEND", "DSV4_SM120_ATTN_CONFIG", "DSV4_SM120_ATTN_QK", "DSV4_SM120_MOE_BACKEND",
        "DSV4_SM120_FP8_GEMM_BACKEND")


@pytest.fixture(scope="module")
def versions():
    return P.running_versions()


def decision(winners: dict, kind="rows", overall=None):
    """A profile decision entry: {bucket: winner}; every named winner passed the gate, one loser did too."""
    rng = random.Random(len(winners))
    rows = {}
    for b, w in winners.items():
        cands = {"loser": {"status": "ok", "us": 1e6, "err": 1e-3, "tol": 2e-2}}
        if w is not None:
            cands[w] = {"status": "ok", "us": round(rng.uniform(1, 50), 2), "err": 1e-3, "tol": 2e-2}
        rows[str(b)] = {"winner": w, "candidates": cands}
    d = {"bucket_kind": kind, "default": "x", "buckets": rows}
    if overall:
        d["overall"] = overall
    return d


def write(tmp_path, decisions, versions, gpu=GPU):
    prof = {"schema": P.SCHEMA, "gpu": gpu, "created_at": P.now_iso(), "versions": dict(versions),
            "deployment": {"tp": 4}, "decisions": decisions}
    return P.save(prof, P.profile_path(gpu, tmp_path))


@pytest.fixture
def env(tmp_path, monkeypatch):
    for k in ENVS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("DSV4_SM120_PROFILE_DIR", str(tmp_path))
    monkeypatch.setenv("DSV4_SM120_TEST_GPU_NAME", GPU)
    A.reset()
    yield monkeypatch
    A.reset()


def kv(extra_page=None):
    """The keyword arguments layout_of reads: an extra cache of [pages, page, 1, 584] or none."""
    if extra_page is None:
        return None
    return types.SimpleNamespace(shape=(3, extra_page, 1, 584))


def test_layouts_from_the_extra_cache():
    assert A.layout_of(kv()) == "swa"
    assert A.layout_of(kv(64)) == "swa_c4"
    assert A.layout_of(kv(2)) == "swa_c128"


def test_profile_routes_each_bucket(tmp_path, env, versions):
    path = write(tmp_path, {
        "attention.swa_c4": decision({4: "dsv4:impl=tiled", 16: "triton", 64: "flashinfer"}),
        "attention.swa": decision({8: "torch", 64: "dsv4+fp8qk"}),
        "attention.swa_c128": decision({16: "flashmla", 64: None}),
    }, versions)
    r = A.attention_route
    assert r(1, "swa_c4")[:3] == ("dsv4", "impl=tiled", None)
    assert r(4, "swa_c4").backend == "dsv4" and r(5, "swa_c4").backend == "triton"
    assert r(16, "swa_c4").backend == "triton" and r(17, "swa_c4").backend == "flashinfer"
    assert r(5000, "swa_c4").backend == "flashinfer"            # beyond the buckets: the largest
    assert r(3, "swa").backend == "torch" and r(9, "swa")[:3] == ("dsv4", None, "fp8")
    assert r(2, "swa_c4").source == f"profile {path}"
    # a winner the glue cannot route (a reference point) and a bucket without a winner keep the default
    assert r(2, "swa_c128").backend == "dsv4" and "not routable" in r(2, "swa_c128").source
    assert r(40, "swa_c128") == ("dsv4", None, None, f"default: profile {path} has no winner for attention.swa_c128 "
                                                     "here")
    # the log line: ranges per bucket, and why
    assert A.describe_attention("swa_c4") == (f"dsv4:impl=tiled for T<=4, triton for 4<T<=16, flashinfer for T>16 "
                                              f"(profile {path})")
    assert A.describe_attention("swa").startswith("torch for T<=8, dsv4+fp8qk for T>8 (profile ")
    # the user's own launch keys and QK mode win over the profile's
    env.setenv("DSV4_SM120_ATTN_CONFIG", "KCVT=0")
    env.setenv("DSV4_SM120_ATTN_QK", "bf16")
    A.reset()
    assert r(1, "swa_c4")[:3] == ("dsv4", None, None) and r(9, "swa")[:3] == ("dsv4", None, None)


def test_explicit_env_wins_and_default_without_a_matching_profile(tmp_path, env, versions, caplog):
    write(tmp_path, {"attention.swa_c4": decision({4: "triton", 64: "flashinfer"})}, versions)
    env.setenv("DSV4_SM120_ATTN_BACKEND", "torch")
    assert {A.attention_route(t, lay) for t in (1, 7, 300) for lay in A.LAYOUTS} == {
        ("torch", None, None, "env DSV4_SM120_ATTN_BACKEND")}
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        A.log_decisions()
        A.log_decisions()                                       # once per process
    lines = [x for x in caplog.messages if x.startswith("dsv4_sm120 decision attention.")]
    assert len(lines) == 3 and all("torch for every T (env DSV4_SM120_ATTN_BACKEND)" in x for x in lines), lines
    # other versions: the profile does not apply, the default runs and the log says why
    env.delenv("DSV4_SM120_ATTN_BACKEND")
    write(tmp_path, {"attention.swa_c4": decision({4: "triton", 64: "flashinfer"})}, dict(versions, triton="0.0.1"))
    A.reset()
    assert A.attention_route(2, "swa_c4").backend == "dsv4"
    assert A.describe_attention("swa_c4") == ("dsv4 for every T (default: no matching profile for this GPU; "
                                              "make calibrate picks by measurement)")
    # another GPU: no file for it
    env.setenv("DSV4_SM120_TEST_GPU_NAME", "NVIDIA H200")
    A.reset()
    assert A.attention_route(2, "swa_c4").source.startswith("default")


def test_head_count_follows_the_routes_of_the_three_layouts(tmp_path, env, versions):
    write(tmp_path, {"attention.swa_c4": decision({4: "dsv4", 16: "torch", 64: "flashinfer"})}, versions)
    heads = [A.kernel_num_heads(16, 64, t) for t in (1, 4, 5, 16, 17, 100)]
    # all ours -> real heads; any padded stock path -> 64; ours + FlashInfer -> SGLang decides
    assert heads == [16, 16, 64, 64, None, None]
    assert A.kernel_num_heads(128, 128, 8) == 128              # more than 64 heads: all of them


def test_self_check_disable_sends_our_routes_to_stock(tmp_path, env, versions):
    write(tmp_path, {"attention.swa_c4": decision({4: "dsv4", 64: "triton"})}, versions)
    assert A.attention_route(2, "swa").backend == "dsv4"
    assert A.dsv4_serves_some_rows() and A.our_launches("swa_c4") == [(None, None)]
    A.disable("attention", "swa_c4 T=2 H=16: relative error 1 > tolerance 0.02")
    r = A.attention_route(2, "swa")
    assert r.backend == A.STOCK and "disabled by the self-check" in r.source and "relative error 1" in r.source
    assert A.attention_route(8, "swa_c4").backend == "triton"   # not ours: unchanged
    assert A.kernel_num_heads(16, 64, 2) is None               # the stock dispatcher: SGLang's own head count


def test_server_wide_choice_from_bucket_votes(tmp_path, env, versions):
    write(tmp_path, {
        "moe.nvfp4": decision({1: "dsv4_triton_nvfp4", 4: "dsv4_triton_nvfp4", 16: "flashinfer_cutlass",
                               64: "dsv4_triton_nvfp4"}, kind="tokens"),
        "moe.mxfp4": decision({1: "marlin", 4: "flashinfer_mxfp4"}, kind="tokens"),
        "fp8_gemm": decision({1: "triton", 4: "triton", 16: "default"}, kind="tokens",
                             overall={"recommended_backend": "default", "reason": "cutlass wins at M>=16"}),
    }, versions)
    choice, source, detail = P.overall("moe.nvfp4", gpu=GPU)
    assert choice == "dsv4_triton_nvfp4" and source.startswith("profile ")
    assert detail == "dsv4_triton_nvfp4 won M=1,4,64; flashinfer_cutlass won M=16"
    assert P.overall("moe.mxfp4", gpu=GPU)[0] == "flashinfer_mxfp4"    # a tie keeps the default
    assert P.overall("fp8_gemm", gpu=GPU)[:2] == ("default", source)   # the recorded overall recommendation wins
    assert P.overall("moe.nvfp4", gpu="NVIDIA H200") == ("flashinfer_cutlass", "default", "")


def test_moe_runner_from_the_profile(tmp_path, env, versions, caplog):
    env.setattr(M, "backend_available", lambda: True)
    write(tmp_path, {"moe.nvfp4": decision({1: "dsv4_triton_nvfp4", 8: "dsv4_triton_nvfp4",
                                             64: "flashinfer_cutlass"}, kind="tokens")}, versions)
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        assert M.hybrid_nvfp4_moe_runner_backend(is_sm120=True) == "dsv4_triton_nvfp4"
    assert any(x.startswith("dsv4_sm120 decision moe.nvfp4: dsv4_triton_nvfp4 (profile ") for x in caplog.messages)
    assert M.hybrid_nvfp4_moe_runner_backend(is_sm120=False) == "flashinfer_trtllm_routed"
    env.setenv("DSV4_SM120_MOE_BACKEND", "flashinfer_cutlass")      # explicit wins
    assert M.hybrid_nvfp4_moe_runner_backend(is_sm120=True) == "flashinfer_cutlass"
    env.setenv("DSV4_SM120_MOE_BACKEND", "auto")
    env.setattr(M, "backend_available", lambda: False)             # the profile's runner missing: CUTLASS
    assert M.hybrid_nvfp4_moe_runner_backend(is_sm120=True) == "flashinfer_cutlass"
    env.setattr(M, "backend_available", lambda: True)
    write(tmp_path, {"moe.nvfp4": decision({1: "dsv4_triton_nvfp4"}, kind="tokens")}, dict(versions, torch="1.0"))
    P.clear_cache()
    assert M.hybrid_nvfp4_moe_runner_backend(is_sm120=True) == "flashinfer_cutlass"


def test_fp8_backend_consults_the_profile_first(tmp_path, env, versions):
    fp8_dir = tmp_path / "fp8"
    fp8_dir.mkdir()
    (fp8_dir / (FC.summary_file_stem(GPU) + ".json")).write_text(
        '{"decision": {"recommended_backend": "default", "reason": "summary says cutlass"}, "shapes": {}}')
    assert FC.recommended_fp8_gemm_backend(GPU, fp8_dir) == (None, "summary says cutlass")   # no profile yet
    path = write(tmp_path, {"fp8_gemm": decision({1: "triton", 16: "triton", 64: "default"}, kind="tokens")},
                 versions)
    P.clear_cache()
    backend, why = FC.recommended_fp8_gemm_backend(GPU, fp8_dir)
    assert backend == "triton" and why.startswith(f"profile {path}") and "triton won M=1,16" in why
    env.setenv("DSV4_SM120_FP8_GEMM_BACKEND", "default")             # explicit wins
    assert FC.recommended_fp8_gemm_backend(GPU, fp8_dir)[0] is None
    env.delenv("DSV4_SM120_FP8_GEMM_BACKEND")
    write(tmp_path, {"attention.swa": decision({1: "dsv4"})}, versions)   # a profile without fp8_gemm
    P.clear_cache()
    assert FC.recommended_fp8_gemm_backend(GPU, fp8_dir) == (None, "summary says cutlass")


def test_profile_status_command(tmp_path, env, versions, capsys):
    write(tmp_path, {"attention.swa": decision({1: "dsv4"})}, dict(versions, sglang="0.4.0"))
    assert P.main(["status", "--gpu", GPU, "--gpu", "NVIDIA H200", "--dir", str(tmp_path), "--json"]) == 0
    import json

    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["usable"] for r in rows] == [False, False]
    assert any("sglang 0.4.0 in profile" in x for x in rows[0]["reasons"]), rows[0]
    assert "no profile" in rows[1]["reasons"][0]


# ---- a profile that does not validate never stops the server (stock decisions, one line)


def _write_raw(tmp_path, decisions, versions):
    """A profile written by hand (P.save would refuse it)."""
    import json

    prof = {"schema": P.SCHEMA, "gpu": GPU, "created_at": P.now_iso(), "versions": dict(versions),
            "deployment": {}, "decisions": decisions}
    path = P.profile_path(GPU, tmp_path)
    path.write_text(json.dumps(prof))
    return path


@pytest.fixture
def profile_log():
    """The profile module's log at INFO (its status command quiets it for the rest of a process)."""
    log = logging.getLogger(P.__name__)
    level = log.level
    log.setLevel(logging.NOTSET)
    yield
    log.setLevel(level)


@pytest.mark.parametrize("mutate, what", [
    (lambda d: d["buckets"].update({"01": d["buckets"].pop("1")}), "bucket '01' is not a positive integer"),
    (lambda d: d["buckets"]["4"].update(winner=["triton"]), "winner ['triton'] is not a name"),
    (lambda d: d.update(overall=["triton"]), "overall must be an object"),
])
def test_an_invalid_profile_is_ignored_with_one_line(tmp_path, env, versions, caplog, profile_log, mutate,
                                                     what):
    d = decision({1: "dsv4", 4: "triton", 16: "triton"})
    mutate(d)
    path = _write_raw(tmp_path, {"attention.swa_c4": d, "moe.nvfp4": d}, versions)
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        routes = {A.attention_route(t, "swa_c4") for t in (1, 2, 4, 8)}      # no KeyError / TypeError here
        assert M.hybrid_nvfp4_moe_runner_backend(is_sm120=True) == "flashinfer_cutlass"
        A.log_decisions()
    assert {(r.backend, r.source.split(":")[0]) for r in routes} == {("dsv4", "default")}, routes
    lines = [x for x in caplog.messages if x.startswith("dsv4_sm120 profile:")]
    assert len(lines) == 1 and str(path) in lines[0] and what in lines[0], lines
    assert lines[0].endswith("ignored: stock decisions"), lines


def test_a_profile_dir_that_cannot_be_expanded_means_no_profile(env):
    env.setenv("DSV4_SM120_PROFILE_DIR", "~nosuchuser_dsv4/profiles")
    assert settings_problems({"DSV4_SM120_PROFILE_DIR": "~nosuchuser_dsv4/profiles"})
    assert A.attention_route(2, "swa").backend == "dsv4"                   # no RuntimeError from pathlib
    assert P.active_profile(GPU)[0] is None


def settings_problems(env):
    from dsv4_sm120 import settings

    return settings.validate(env)


# ---- the MoE runner the profile chose steps aside where the checkpoint does not fit it


def test_model_problem_reads_the_checkpoint_config():
    v4 = types.SimpleNamespace(hidden_act="silu")
    assert M.model_problem(v4, {"group_size": 16}) is None
    assert "NVFP4 group size is 32" in M.model_problem(v4, {"group_size": 32})
    assert "activation is 'gelu'" in M.model_problem(types.SimpleNamespace(hidden_act="gelu"), {"group_size": 16})
    assert M.model_problem(None, None) is None and M.model_problem(object(), {"group_size": "x"}) is None
    assert "all-to-all backend is deepep" in M.model_problem(v4, {"group_size": 16}, "deepep")
    assert M.model_problem(v4, {"group_size": 16}, "none") is None


def test_the_profile_choice_of_our_moe_steps_aside_for_a_checkpoint_it_cannot_serve(tmp_path, env, versions,
                                                                                    caplog):
    env.setattr(M, "backend_available", lambda: True)
    write(tmp_path, {"moe.nvfp4": decision({1: "dsv4_triton_nvfp4", 8: "dsv4_triton_nvfp4"}, kind="tokens")},
          versions)
    v4 = types.SimpleNamespace(hidden_act="silu")
    assert M.hybrid_nvfp4_moe_runner_backend(is_sm120=True, hf_config=v4, nvfp4_meta={"group_size": 16}) == \
        "dsv4_triton_nvfp4"
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        got = M.hybrid_nvfp4_moe_runner_backend(is_sm120=True, hf_config=v4, nvfp4_meta={"group_size": 32})
    assert got == "flashinfer_cutlass"
    lines = [x for x in caplog.messages if "picks dsv4_triton_nvfp4, but" in x]
    assert len(lines) == 1 and "NVFP4 group size is 32" in lines[0] and "flashinfer_cutlass serves instead" in lines[0]
    env.setenv("DSV4_SM120_MOE_BACKEND", "dsv4_triton_nvfp4")       # the user's explicit choice is kept, warned
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        got = M.hybrid_nvfp4_moe_runner_backend(is_sm120=True, hf_config=v4, nvfp4_meta={"group_size": 32})
    assert got == "dsv4_triton_nvfp4"
    assert any("will stop at the first MoE layer" in x for x in caplog.messages)
