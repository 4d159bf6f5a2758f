"""The SGLang glue's serve-time safety decisions, pinned against independent expectations (CPU, in this process,
host-side or with small Triton-interpreter cases; `make mutate` finds what these tests leave loose):

* the self-check's tolerance per route: an output off by a small factor (x1.015 / x1.03 / x1.06), a NaN or an
  inf against the documented bounds (2e-2 relative Frobenius error for bf16 QK, 5e-2 for block-scaled QK, whether
  the route or ``DSV4_SM120_ATTN_QK`` asks for it), not against ``tolerances`` itself;
* which rows a failing launch takes with it (hand-derived launches of a small device table), and the kernel
  disabled only when every launch failed;
* the MoE path switch: to the other path (never the same), on Triton's own exception types as well as
  ``RuntimeError``; the tolerance 0.3 of the NVFP4 gate;
* the capture loop's agreement (:mod:`.graphs`) and the all-reduce set-up (:mod:`.allreduce`) with a stand-in
  group whose other ranks answer what the test says.
"""

from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover
    pytest.skip("CPU tests need TRITON_INTERPRET=1 (set before triton is imported)", allow_module_level=True)

import torch  # noqa: E402

from dsv4_sm120.rank_agreement import StopServer  # noqa: E402
from dsv4_sm120.sglang_glue import attention as A  # noqa: E402
from dsv4_sm120.sglang_glue import selfcheck as S  # noqa: E402
from glue_fixtures import fresh_glue  # noqa: E402

# the documented bounds (docs/attention.md, the self-check's module doc): independent of dsv4_sm120.tolerances
BF16_TOL, FP8QK_TOL, MOE_NVFP4_TOL = 2e-2, 5e-2, 0.3
SIZES = {"K1": 16, "swa_c4": 16, "swa_c128": 8}


@pytest.fixture
def fresh(monkeypatch):
    yield from fresh_glue(monkeypatch, also_unset=("DSV4_SM120_TEST_FAULT_RANKS",))


def _case(layout="swa", T=2, H=8, qk=None, launch=None):
    return {"layout": layout, "H": H, "T": T, "route": A.Route("dsv4", launch, qk), "rows": [T], "other_rows": [],
            "new": [("k", layout, T)]}


def _ours_scaled(monkeypatch, factor=1.0, poison=None):
    """Our kernel replaced by the stock reference of the same call times ``factor`` (float32, so the relative
    error is |factor - 1| up to rounding), with ``poison`` (nan / inf) written into one element of row 0."""
    def ours(q, num_heads, kw, launch=None, qk=None):
        out = S.stock_reference(q, kw).float() * factor
        if poison is not None:
            out[0, 0, 0, 5] = poison
        return out

    monkeypatch.setattr(A, "run_dsv4_kernel", ours)


@pytest.mark.parametrize("qk,env_qk,tol", [(None, None, BF16_TOL), ("fp8", None, FP8QK_TOL),
                                           (None, "fp8", FP8QK_TOL), (None, "bf16", BF16_TOL)])
def test_the_self_check_tolerance_of_each_route(fresh, qk, env_qk, tol):
    if env_qk:
        fresh.setenv("DSV4_SM120_ATTN_QK", env_qk)
    for scale, ok in ((0.6, True), (1.3, False), (-1.3, False)):
        _ours_scaled(fresh, 1 + scale * tol)
        res = S._check_one(_case(qk=qk), torch.device("cpu"), seed=1, sizes=SIZES)
        assert res["ok"] is ok and abs(res["err"] - abs(scale) * tol) < 2e-3, (scale, res)
        assert res["tol"] == pytest.approx(tol)
        assert (res["error"] is None) is ok
        if not ok:
            assert res["error"] == f"relative error {res['err']:.3g} > tolerance {tol:g}"
    assert (" qk=fp8" in res["shape"]) is (tol == FP8QK_TOL)
    assert res["shape"] == f"swa T=2 H=8 K=16 launch=default" + (" qk=fp8" if tol == FP8QK_TOL else "")


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_nan_or_inf_in_our_output_fails_the_self_check(fresh, poison):
    _ours_scaled(fresh, 1.0, poison)
    res = S._check_one(_case(), torch.device("cpu"), seed=1, sizes=SIZES)
    assert not res["ok"] and res["error"].startswith("relative error ") and res["error"].endswith("> tolerance 0.02")


def test_a_small_fault_of_the_real_kernel_steps_its_rows_aside(fresh, caplog):
    """Our real kernel (interpreter) off by 5%: every launch fails the bf16 gate, the kernel is disabled; the same
    kernel unscaled passes."""
    real = A.run_dsv4_kernel
    fresh.setattr(A, "run_dsv4_kernel", lambda q, h, kw, launch=None, qk=None: real(q, h, kw, launch, qk) * 1.05)
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        cases = S.run([8], torch.device("cpu"), rows=[2], layouts=["swa"])
    assert len(cases) == 1 and not cases[0]["ok"] and 0.04 < cases[0]["err"] < 0.06, cases
    assert A.call_route(2, "swa", 8).backend == A.STOCK and A.disabled("attention") is not None
    S.reset()
    A.reset()
    fresh.setattr(A, "run_dsv4_kernel", real)
    cases = S.run([8], torch.device("cpu"), rows=[2], layouts=["swa"])
    assert cases[0]["ok"] and cases[0]["err"] < 1e-2 and A.call_route(2, "swa", 8).backend == "dsv4"


# ---------------------------------------------------------------------------- MoE: the path switch

E, HID, INTER, TOPK = 6, 64, 32, 2


def _moe_layer(seed=3):
    from dsv4_sm120.moe.testing import make_layer
    from dsv4_sm120.sglang_glue.moe import _global_scales_13

    lay, _ = make_layer(E, HID, INTER, TOPK, seed)
    lay._dsv4_w13_scale_2 = _global_scales_13(lay)
    lay._dsv4_w2_scale_2 = lay.w2_weight_scale_2.data.float().reshape(-1).contiguous()
    return lay


def _reference_runner(lay, fail_on=(), factor=2.0, exc=None):
    """A stand-in for our runner: the float64 reference of the layer (exact), times ``factor`` or raising ``exc`` on
    the paths in ``fail_on`` (the path in force: DSV4_SM120_MOE_PATH); records the paths it ran on."""
    from dsv4_sm120 import settings
    from dsv4_sm120.moe.reference import moe_reference

    paths = []

    def run(x, tw, ids):
        path = settings.get("DSV4_SM120_MOE_PATH")
        paths.append(path)
        ref = moe_reference(x, lay.w13_weight.data, lay.w13_weight_scale.data, lay._dsv4_w13_scale_2,
                            lay.w2_weight.data, lay.w2_weight_scale.data, lay._dsv4_w2_scale_2, tw, ids,
                            swiglu_limit=getattr(lay.moe_runner_config, "swiglu_limit", None))
        if path in fail_on:
            if exc is not None:
                raise exc
            return ref * factor
        return ref

    return run, paths


def _first_path(monkeypatch, first):
    import dsv4_sm120.moe.fused_moe as F

    monkeypatch.setattr(F, "default_path", lambda device: first)


@pytest.mark.parametrize("first,other", [("fp4", "bf16"), ("bf16", "fp4")])
def test_the_moe_check_switches_to_the_other_path_never_the_same(fresh, first, other):
    _first_path(fresh, first)
    lay = _moe_layer()
    run, paths = _reference_runner(lay, fail_on=("auto", first))
    res = S.check_moe(lay, run, torch.device("cpu"))
    assert paths == ["auto", other] and res["path"] == first and res["fallback"] == other
    assert not res["ok"] and res["fallback_error"] is None and res["fallback_err"] < 1e-6
    assert S.moe_fallback_path() == other and S.moe_fallback_count() == 1 and S.moe_fallback_active()
    assert os.environ["DSV4_SM120_MOE_PATH"] == other
    assert S._state["moe_fallback_why"] == "self-check on rank 0 (relative error 1 > tolerance 0.3)"
    assert S.check_moe(lay, run, torch.device("cpu")) is res and len(paths) == 2       # once per process


@pytest.mark.parametrize("first,other", [("fp4", "bf16"), ("bf16", "fp4")])
def test_a_serving_failure_switches_to_the_other_path_then_stops(fresh, first, other):
    _first_path(fresh, first)
    S.moe_step_aside("M=3", "OutOfResources: shared memory", torch.device("cpu"))
    assert S.moe_fallback_path() == other and os.environ["DSV4_SM120_MOE_PATH"] == other
    assert S.moe_fallback_count() == 1
    assert S._state["moe_fallback_why"] == "serving at M=3: OutOfResources: shared memory"
    with pytest.raises(StopServer) as e:
        S.moe_step_aside("M=5", "CompilationError: x", torch.device("cpu"))
    assert str(e.value) == (f"dsv4_sm120: our MoE kernel fails on this GPU at M=5 on its {other} path too "
                            "(CompilationError: x); restart with DSV4_SM120_MOE_BACKEND=flashinfer_cutlass")
    assert S.moe_fallback_count() == 1


def _triton_errors():
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    return [OutOfResources(101376, 101376 - 1024, "shared memory"), CompilationError(None, None, "bad tile"),
            RuntimeError("CUDA error: an illegal instruction was encountered")]


@pytest.mark.parametrize("i", range(3))
def test_tritons_own_errors_take_the_fallback_like_a_runtime_error(fresh, i):
    """Triton raises OutOfResources / CompilationError (TritonError, not RuntimeError): the MoE check and a serving
    attention call step aside on them as on a RuntimeError."""
    exc = _triton_errors()[i]
    assert isinstance(exc, RuntimeError) is (i == 2)
    _first_path(fresh, "fp4")
    lay = _moe_layer()
    run, paths = _reference_runner(lay, fail_on=("auto", "fp4"), exc=exc)
    res = S.check_moe(lay, run, torch.device("cpu"))
    assert res["error"].startswith(type(exc).__name__ + ":") and res["fallback"] == "bf16"
    assert res["fallback_error"] is None and paths == ["auto", "bf16"]
    # attention: the self-check and a serving call
    fresh.setattr(A, "run_dsv4_kernel", lambda *a, **k: (_ for _ in ()).throw(exc))
    res = S._check_one(_case(), torch.device("cpu"), seed=1, sizes=SIZES)
    assert not res["ok"] and res["error"].startswith(type(exc).__name__ + ":")
    stock = []
    fresh.setattr(A, "stock_dispatch", lambda q, kw: stock.append(q.shape[0]) or "stock answer")
    c = S.attention_case("swa", 3, 8, "cpu", seed=2, sizes=SIZES)
    decode = type("Mode", (), {"is_decode": lambda self: True})()
    assert A.sparse_attention(decode, q=c["q"], num_heads=8, **c["kw"]) == "stock answer" and stock == [3]
    assert A.call_route(3, "swa", 8).backend == A.STOCK and A.fallback_count() == 1


def test_the_moe_tolerance_is_the_nvfp4_gate(fresh):
    _first_path(fresh, "fp4")
    for factor, ok in ((1 + 0.8 * MOE_NVFP4_TOL, True), (1 + 1.2 * MOE_NVFP4_TOL, False)):
        S.reset()
        lay = _moe_layer()
        run, paths = _reference_runner(lay, fail_on=("auto",), factor=factor)
        res = S.check_moe(lay, run, torch.device("cpu"))
        assert res["ok"] is ok and res["err"] == pytest.approx(factor - 1, rel=1e-6), res
        assert res["tol"] == MOE_NVFP4_TOL and paths == (["auto"] if ok else ["auto", "bf16"])
    S.reset()
    fresh.setenv("DSV4_SM120_MOE_PATH", "auto")
    run, _ = _reference_runner(_moe_layer(), fail_on=("auto",), factor=float("nan"))
    res = S.check_moe(_moe_layer(), run, torch.device("cpu"))
    assert not res["ok"] and res["error"] == "relative error inf > tolerance 0.3"
