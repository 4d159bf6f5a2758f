"""Our paths step aside on error (dsv4_sm120.sglang_glue, CPU, Triton interpreter, without SGLang):

* attention at serve time: with ``DSV4_SM120_TEST_SELFCHECK_FAULT=attention-raise-T=4`` a decode call of 4 rows
  through ``sparse_attention`` raises inside our kernel; the call is answered by the stock dispatcher (a stand-in
  that computes the float64 reference and counts its calls), one error line names the exception, T, H, layout and
  launch, later calls of that launch go straight to stock, another layout keeps our kernel, and the head count the
  model asks for becomes SGLang's own for those rows;
* the unit that steps aside is the launch-table entry: with real device facts (H200) rows of another table entry
  keep our kernel;
* the self-check over capture rows: every row's launches are covered by a case run at the smallest row count that
  reaches them; a launch that fails (raising) takes only its layout's rows to stock, the others keep our kernel;
* the CUDA-graph capture retry (:mod:`dsv4_sm120.sglang_glue.graphs`) with a stand-in capture function;
* MoE: ``moe-raise`` (our MoE kernel raises on its first path) in ``prepare_layer`` switches to the other path; a
  serving call that raises does the same; both paths raising stops with one line.
"""

from __future__ import annotations

import logging
import os
import types

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover
    pytest.skip("CPU tests need TRITON_INTERPRET=1 (set before triton is imported)", allow_module_level=True)

import torch  # noqa: E402

from dsv4_sm120.attention.config import Device  # noqa: E402
from dsv4_sm120.attention.reference import rel_fro, sparse_mla_decode_ref  # noqa: E402
from dsv4_sm120.moe.reference import moe_reference, rel_err  # noqa: E402
from dsv4_sm120.sglang_glue import attention as A  # noqa: E402
from dsv4_sm120.sglang_glue import graphs as G  # noqa: E402
from dsv4_sm120.sglang_glue import moe as M  # noqa: E402
from dsv4_sm120.rank_agreement import StopServer  # noqa: E402
from dsv4_sm120.sglang_glue import selfcheck as S  # noqa: E402
from glue_fixtures import fresh_glue  # noqa: E402

DECODE = types.SimpleNamespace(is_decode=lambda: True)
H200 = Device("NVIDIA H200", (9, 0), 132)


@pytest.fixture
def fresh(monkeypatch):
    yield from fresh_glue(monkeypatch)


def _stock_recorder(monkeypatch):
    calls = []

    def stock(q, kw):
        calls.append(q.shape[0])
        args = {k: v for k, v in kw.items() if k != "head_dim_v"}
        return sparse_mla_decode_ref(q, **args)[0].to(torch.bfloat16)

    monkeypatch.setattr(A, "stock_dispatch", stock)
    return calls


def _ours_counter(monkeypatch):
    calls = []
    real = A.run_dsv4_kernel

    def ours(q, num_heads, kw, launch=None, qk=None):
        calls.append(q.shape[0])
        return real(q, num_heads, kw, launch, qk)

    monkeypatch.setattr(A, "run_dsv4_kernel", ours)
    return calls


def test_a_serving_call_that_raises_is_answered_by_stock_and_its_launch_steps_aside(fresh, caplog):
    fresh.setenv("DSV4_SM120_TEST_SELFCHECK_FAULT", "attention-raise-T=4")
    stock = _stock_recorder(fresh)
    ours = _ours_counter(fresh)
    assert A.kernel_num_heads(8, 64, 4) == 8                 # ours everywhere before the failure
    c = S.attention_case("swa_c4", 4, 8, "cpu", seed=3)
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        out = A.sparse_attention(DECODE, q=c["q"], num_heads=8, **c["kw"])
    ref = sparse_mla_decode_ref(c["q"], **{k: v for k, v in c["kw"].items() if k != "head_dim_v"})[0]
    assert ours == [4] and stock == [4] and rel_fro(out, ref) < 1e-2      # stock answered the call
    lines = [x for x in caplog.messages if "our attention kernel failed" in x]
    assert len(lines) == 1, caplog.messages
    assert "RuntimeError: planted test fault attention-raise-T=4" in lines[0]
    assert "at swa_c4 T=4 H=8 launch swa_c4 H=8 qk=bf16 interpreter" in lines[0] and "stock path" in lines[0]
    # later calls of that launch go to stock without trying ours; the head count is SGLang's own there
    A.sparse_attention(DECODE, q=c["q"], num_heads=8, **c["kw"])
    assert ours == [4] and stock == [4, 4]
    assert A.call_route(4, "swa_c4", 8).backend == A.STOCK and A.kernel_num_heads(8, 64, 4) is None
    assert len([x for x in caplog.messages if "our attention kernel failed" in x]) == 1   # logged once
    # another layout keeps our kernel (SWA only: no extra cache)
    c2 = S.attention_case("swa", 2, 8, "cpu", seed=4)
    out2 = A.sparse_attention(DECODE, q=c2["q"], num_heads=8, **c2["kw"])
    assert ours == [4, 2] and stock == [4, 4]
    ref2 = sparse_mla_decode_ref(c2["q"], **{k: v for k, v in c2["kw"].items() if k != "head_dim_v"})[0]
    assert rel_fro(out2, ref2) < 1e-2
    assert A.call_route(2, "swa", 8).backend == "dsv4" and A.fallback_count() == 1


def test_the_unit_that_steps_aside_is_the_launch_table_entry(fresh):
    fresh.setenv("TRITON_INTERPRET", "0")            # host-side launch resolution only: nothing runs
    r = A.attention_route(1, "swa_c4")
    b1, big = (A.launch_bucket(t, "swa_c4", 16, r, H200) for t in (1, 2048))
    assert b1 != big and "NVIDIA_H200" in b1, (b1, big)
    A.step_aside(1, "swa_c4", 16, r, H200, "RuntimeError: out of resources")
    assert A.call_route(1, "swa_c4", 16).backend == A.STOCK
    assert A.call_route(2048, "swa_c4", 16).backend == "dsv4"        # another table entry keeps ours
    assert A.call_route(1, "swa_c4", 8).backend == "dsv4"            # other heads: another launch
    assert A.call_route(1, "swa", 16).backend == "dsv4"              # other layout
    same = [t for t in range(1, 2049, 7) if A.launch_bucket(t, "swa_c4", 16, r, H200) == b1]
    assert 1 < len(same) < 293
    assert all(A.call_route(t, "swa_c4", 16).backend == (A.STOCK if t in same else "dsv4") for t in range(1, 2049, 7))


def test_the_self_check_plan_covers_every_launch_of_the_capture_rows(fresh):
    fresh.setenv("TRITON_INTERPRET", "0")
    sizes = {"K1": 128, "swa_c4": 512, "swa_c128": 1024}
    bs = S.default_capture_bs(64, True)
    rows = sorted({b * 4 for b in bs})
    cases = S.plan_attention([16], rows, H200, sizes)
    covered = {k for c in cases for k in c["keys"]}
    for lay in A.LAYOUTS:
        mine = [c for c in cases if c["layout"] == lay]
        for T in rows:
            keys = S.call_launches(lay, T, 16, sizes["K1"], sizes.get(lay, 0), A.attention_route(T, lay), H200)
            assert set(keys) <= covered, (lay, T)
            first = [c for c in cases if set(c["new"]) & set(keys)]   # the cases that ran its launches first
            assert first and all(c["T"] <= T or c["layout"] != lay for c in first)
            # a failing case takes this row with it (its own layout's rows, or another layout's that share its
            # combine kernel)
            assert all(T in c["rows"] if c["layout"] == lay else [lay, T] in map(list, c["other_rows"])
                       for c in first), (lay, T)
        assert len(mine) > 1                                       # more than one launch per layout here
        assert len({c["T"] for c in mine}) == len(mine)


def test_a_failing_launch_in_the_self_check_takes_only_its_rows_to_stock(fresh, caplog):
    real = A.run_dsv4_kernel

    def ours(q, num_heads, kw, launch=None, qk=None):
        if A.layout_of(kw.get("extra_k_cache")) == "swa_c128":
            raise RuntimeError("out of resources: shared memory")
        return real(q, num_heads, kw, launch, qk)

    fresh.setattr(A, "run_dsv4_kernel", ours)
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        cases = S.run([8], torch.device("cpu"), rows=[1, 2, 4])
    by = {c["layout"]: c for c in cases}
    assert set(by) == set(A.LAYOUTS) and by["swa"]["ok"] and by["swa_c4"]["ok"], cases
    assert not by["swa_c128"]["ok"] and "RuntimeError: out of resources" in by["swa_c128"]["error"]
    assert by["swa_c128"]["rows"] == [1, 2, 4]
    assert A.disabled("attention") is None                    # per launch, not the whole kernel
    for T in (1, 2, 4):
        assert A.call_route(T, "swa_c128", 8).backend == A.STOCK
        assert A.call_route(T, "swa", 8).backend == "dsv4" and A.call_route(T, "swa_c4", 8).backend == "dsv4"
    failed = [x for x in caplog.messages if "FAILED" in x]
    assert len(failed) == 1 and "swa_c128 T=1 H=8" in failed[0] and "rows 1,2,4 of swa_c128" in failed[0]
    # launches checked once per process: a second runner's rows reaching the same launches run nothing new
    n = len(cases)
    assert len(S.run([8], torch.device("cpu"), rows=[2, 8])) == n


def test_a_case_that_cannot_be_built_fails_its_launch_not_the_server(fresh):
    def no_memory(*a, **k):
        raise RuntimeError("CUDA out of memory while building the case")

    fresh.setattr(S, "attention_case", no_memory)
    cases = S.run([8], torch.device("cpu"), rows=[2])          # raised out of the check before
    assert cases and all(not c["ok"] and "RuntimeError: CUDA out of memory" in c["error"] for c in cases), cases
    assert cases[0]["shape"].startswith("swa T=2 H=8 K=? launch=default")
    assert A.disabled("attention") is not None                 # every launch failed: the stock path serves


def test_raising_fault_in_every_call_fails_every_launch_and_disables_the_kernel(fresh):
    fresh.setenv("DSV4_SM120_TEST_SELFCHECK_FAULT", "attention-raise")
    cases = S.run([8], torch.device("cpu"), rows=[1, 2])
    assert len(cases) == 3 and not any(c["ok"] for c in cases)
    assert all("planted test fault attention-raise" in c["error"] for c in cases)
    assert A.disabled("attention") is not None
    assert {A.attention_route(t, lay).backend for t in (1, 2, 64) for lay in A.LAYOUTS} == {A.STOCK}


def test_capture_rows_of_a_runner():
    r = types.SimpleNamespace(capture_bs=[1, 2, 4], captured_req_width=4, capture_num_tokens=None)
    assert G.capture_rows(r) == [4, 8, 16]
    r = types.SimpleNamespace(capture_bs=[3, 1], captured_req_width=1, capture_num_tokens=[2, 5])
    assert G.capture_rows(r) == [1, 2, 3, 5]
    assert S.runner_rows([1, 2], 4) == [("target-verify", [4, 8], None), ("draft decode", [1, 2], ["swa"]),
                                         ("draft extend", [4, 8], ["swa"])]
    assert S.default_capture_bs(16, False) == [1, 2, 4, 8, 12, 16]
    assert S.default_capture_bs(20, True)[-4:] == [14, 16, 18, 20]


def test_a_capture_that_raises_after_a_fallback_is_captured_again(fresh):
    r = A.attention_route(2, "swa")
    tries = []

    def capture_falls_back(bs, forward):
        tries.append(bs)
        if len(tries) == 1:          # our kernel stepped aside inside this capture, which then fails
            A.step_aside(bs, "swa", 8, r, "cpu", "RuntimeError: illegal instruction")
            raise RuntimeError("operation failed due to a previous error during capture")
        return "graph"

    assert G.retrying(capture_falls_back)(8, None) == "graph" and tries == [8, 8]

    def capture_fails(bs, forward):  # no fallback during the capture: its error is SGLang's
        tries.append(bs)
        raise RuntimeError("capture failed")

    tries.clear()
    with pytest.raises(RuntimeError, match="capture failed"):
        G.retrying(capture_fails)(4, None)
    assert tries == [4]

    def capture_fails_twice(bs, forward):
        tries.append(bs)
        A.step_aside(bs, "swa_c4", 8, r, "cpu", "RuntimeError: x")
        raise RuntimeError(f"failed {len(tries)}")

    tries.clear()
    with pytest.raises(RuntimeError, match="failed 2"):
        G.retrying(capture_fails_twice)(2, None)
    assert tries == [2, 2]


# ---- MoE

E, H, I, K = 6, 64, 32, 2


def layer(seed):
    from dsv4_sm120.moe.testing import make_layer

    return make_layer(E, H, I, K, seed)


def _dispatch(x, tw, ids):
    return types.SimpleNamespace(hidden_states=x, hidden_states_scale=None,
                                 topk_output=types.SimpleNamespace(topk_weights=tw, topk_ids=ids))


def test_moe_raise_in_prepare_layer_switches_to_the_other_path(fresh, caplog):
    from dsv4_sm120.moe.testing import random_routing

    fresh.setenv("DSV4_SM120_TEST_SELFCHECK_FAULT", "moe-raise")
    lay, W = layer(5)
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        M.prepare_layer(lay)
    res = S.results()["moe"]
    assert not res["ok"] and "RuntimeError: planted test fault moe-raise" in res["error"], res
    other = "bf16" if res["path"] == "fp4" else "fp4"
    assert res["fallback"] == other and res["fallback_error"] is None
    assert os.environ["DSV4_SM120_MOE_PATH"] == other
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    tw, ids = random_routing(3, E, K, 11)
    ref = moe_reference(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=1.5)
    assert rel_err(M.apply(lay, _dispatch(x, tw, ids)), ref) < S.MOE_TOL


def test_moe_serving_call_that_raises_switches_path_and_both_failing_stops(fresh, caplog):
    from dsv4_sm120.moe.testing import random_routing

    fresh.setenv("DSV4_SM120_SELFCHECK", "0")                 # no check: the serving call meets the fault
    fresh.setenv("DSV4_SM120_TEST_SELFCHECK_FAULT", "moe-raise")
    lay, W = layer(6)
    M.prepare_layer(lay)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    tw, ids = random_routing(3, E, K, 12)
    ref = moe_reference(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=1.5)
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        y = M.apply(lay, _dispatch(x, tw, ids))
    assert rel_err(y, ref) < S.MOE_TOL and S.moe_fallback_count() == 1
    lines = [x for x in caplog.messages if "failed while serving" in x]
    assert len(lines) == 1 and "RuntimeError: planted test fault moe-raise" in lines[0] and f"M=3 E={E}" in lines[0]
    import dsv4_sm120.moe as moe_pkg

    def broken(*a, **k):
        raise RuntimeError("illegal instruction")

    fresh.setattr(moe_pkg, "nvfp4_fused_moe", broken)
    with pytest.raises(StopServer) as e:
        M.apply(lay, _dispatch(x, tw, ids))
    msg = str(e.value)
    assert "RuntimeError: illegal instruction" in msg and "DSV4_SM120_MOE_BACKEND=flashinfer_cutlass" in msg
    assert "\n" not in msg


def test_a_layer_our_runner_cannot_serve_stops_with_one_line(fresh):
    lay, _ = layer(7)
    lay.w2_weight_scale.data = lay.w2_weight_scale.data.float()
    with pytest.raises(StopServer) as e:                       # a ValueError with a traceback before
        M.prepare_layer(lay)
    msg = str(e.value)
    assert msg.startswith("dsv4_triton_nvfp4: w2_weight_scale must be float8_e4m3fn; restart with "
                          "DSV4_SM120_MOE_BACKEND=flashinfer_cutlass") and "\n" not in msg, msg


def test_a_serving_call_failing_on_both_paths_leaves_the_forward_only_as_the_stop(fresh):
    from dsv4_sm120.moe.testing import random_routing

    fresh.setenv("DSV4_SM120_SELFCHECK", "0")
    lay, _ = layer(8)
    M.prepare_layer(lay)
    import dsv4_sm120.moe as moe_pkg

    def broken(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    fresh.setattr(moe_pkg, "nvfp4_fused_moe", broken)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    tw, ids = random_routing(3, E, K, 12)
    with pytest.raises(StopServer) as e:                       # the raw CUDA error of the retry before
        M.apply(lay, _dispatch(x, tw, ids))
    msg = str(e.value)
    assert "on its " in msg and "path too (RuntimeError: CUDA error: an illegal memory access" in msg, msg
    assert msg.endswith("restart with DSV4_SM120_MOE_BACKEND=flashinfer_cutlass") and "\n" not in msg


def test_fault_setting_values_are_validated():
    from dsv4_sm120 import settings

    for ok in ("", "attention", "attention-raise", "attention-raise-T=12", "moe", "moe-raise"):
        assert settings.validate({"DSV4_SM120_TEST_SELFCHECK_FAULT": ok}) == [], ok
    for bad in ("attention-raise-T=0", "attention-raise-T=x", "moe-prepare", "raise"):
        assert settings.validate({"DSV4_SM120_TEST_SELFCHECK_FAULT": bad}), bad


def test_the_timing_command_runs_the_check_and_prints_its_seconds(fresh, capsys):
    assert S.main(["--time", "--device", "cpu", "--heads", "8", "--capture-bs", "1,2", "--draft-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "capture batch sizes [1, 2]; draft tokens 2" in out
    assert "target-verify: rows 2,4: 3 launches in" in out and "draft decode: rows 1,2:" in out
    assert out.count("  ok   ") == 3 and "self-check total: 3 launches, 0 failed," in out
    fresh.setenv("DSV4_SM120_TEST_SELFCHECK_FAULT", "attention-raise")
    S.reset()
    A.reset()
    assert S.main(["--device", "cpu", "--heads", "8", "--capture-bs", "1"]) == 1
    assert "FAIL" in capsys.readouterr().out
