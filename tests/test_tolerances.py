"""dsv4_sm120.tolerances: each bound sits between what a correct result of its route shows and what a faulty one
shows, both measured here on float64 models of the routes (not on the bounds' own numbers): bf16 attention admits
its bf16 rounding and rejects a 5% fault; block-scaled QK admits the e4m3 loss of Q (which the bf16 bound would
not) and rejects a 10% fault; the MXFP4 runners' bound admits FP8 activations; the launch sweep's fp8 gate admits
every committed fp8 row and rejects garbage; the MoE table has a bound for every format a checkpoint can declare.
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "overlay"))
from dsv4_sm120 import model_config, tolerances as T  # noqa: E402
from dsv4_sm120.attention.reference import quantize_q_mx, rel_fro  # noqa: E402


@pytest.fixture(scope="module")
def attention_case():
    """One decode step of dense attention at the DSv4 head size (512: 448 nope + 64 rope), bf16-exact inputs, the
    float64 result, and the results of the bf16-QK and block-scaled-QK routes: fp32 scores, P rounded to bf16
    before the PV product, fp32 accumulation, a bf16 output (docs/attention.md, Accuracy)."""
    g = torch.Generator().manual_seed(1234)
    heads, keys, dim = 16, 512, 512
    q = torch.randn(1, heads, dim, generator=g).to(torch.bfloat16).double()
    k = torch.randn(keys, dim, generator=g).to(torch.bfloat16).double()
    v = torch.randn(keys, dim, generator=g).to(torch.bfloat16).double()
    scale = 1 / math.sqrt(dim)

    def route(qq):
        p = torch.softmax((qq.float() @ k.float().T) * scale, -1).to(torch.bfloat16).float()
        return (p @ v.float()).to(torch.bfloat16)

    ref = torch.softmax((q @ k.T) * scale, -1) @ v
    return ref, route(q), route(quantize_q_mx(q))


def test_bf16_bound_admits_bf16_rounding_and_rejects_a_small_fault(attention_case):
    ref, bf16, _ = attention_case
    err = rel_fro(bf16, ref)
    assert 5e-4 < err < T.ATTN_BF16, err
    for bound in (T.ATTN_BF16, T.BF16_RESULT, T.LAUNCH_SWEEP["ours-bf16"], T.LAUNCH_SWEEP["nvfp4-bf16"]):
        assert err <= bound
        assert rel_fro(bf16.double() * 1.05, ref) > bound          # a 5% fault: a wrong scale, a lost term
        assert not rel_fro(bf16.double() * float("nan"), ref) <= bound


def test_fp8qk_bound_admits_the_quantization_of_q_and_rejects_a_fault(attention_case):
    ref, bf16, fp8 = attention_case
    err = rel_fro(fp8, ref)
    # the e4m3 loss is what the wider bound is for: the bf16 bound would refuse a correct fp8 route
    assert T.ATTN_BF16 < err < T.ATTN_FP8QK, err
    assert err > 3 * rel_fro(bf16, ref)
    assert rel_fro(fp8.double() * 1.1, ref) > T.ATTN_FP8QK
    assert T.ATTN_FP8QK > T.ATTN_BF16


def _e4m3_rows(a: torch.Tensor) -> torch.Tensor:
    s = a.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 448
    return (a / s).float().to(torch.float8_e4m3fn).double() * s


def test_mxfp4_runner_bound_admits_fp8_activations():
    """An expert MLP (gate/up, SwiGLU, down) with its activations quantized to e4m3 per row, as the MXFP4 runners
    on sm_120 feed it, against float64: admitted; a 10% fault is not."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 256, generator=g, dtype=torch.float64)
    w13 = torch.randn(256, 1024, generator=g, dtype=torch.float64) / 16
    w2 = torch.randn(512, 256, generator=g, dtype=torch.float64) / 22

    def mlp(a, quant):
        a = _e4m3_rows(a) if quant else a
        h = a @ w13
        act = torch.nn.functional.silu(h[:, :512]) * h[:, 512:]
        return (_e4m3_rows(act) if quant else act) @ w2

    ref = mlp(x, False)
    err = float((mlp(x, True) - ref).norm() / ref.norm())
    assert 1e-2 < err < T.MOE["mxfp4"], err
    assert float((mlp(x, True) * 1.1 - ref).norm() / ref.norm()) > T.MOE["mxfp4"]
    assert T.MOE["mxfp4"] < T.MOE["nvfp4"] < 1.0


@pytest.mark.parametrize("algo", ["NVFP4", "nvfp4", None])
def test_every_declared_moe_format_has_a_bound(algo):
    qc = {"moe_quant_algo": algo} if algo else {}
    assert model_config.moe_format_of({"quantization_config": qc}) in T.MOE
    assert set(T.MOE) == {"nvfp4", "mxfp4"}


def committed_rows(impl):
    with open(REPO / "bench" / "results" / "attention.csv") as f:
        return [float(r["rel_err"]) for r in csv.DictReader(f) if r["impl"] == impl and r["rel_err"]]


def test_launch_sweep_fp8_gate_admits_every_committed_row_and_rejects_garbage(attention_case):
    errs = committed_rows("ours-fp8")
    assert errs and max(errs) <= T.LAUNCH_SWEEP["ours-fp8"]
    ref = attention_case[0]
    garbage = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    garbage *= ref.norm() / garbage.norm()                        # the right size, unrelated values: ~sqrt(2)
    assert rel_fro(garbage, ref) > T.LAUNCH_SWEEP["ours-fp8"]
    assert rel_fro(-ref, ref) > T.LAUNCH_SWEEP["ours-fp8"]        # a sign error


def test_launch_sweep_relative_gate_rejects_a_faulty_candidate(attention_case):
    """Candidates share the quantized inputs, so a correct one's error is the smallest's to a fraction of a percent
    (the committed rows); a candidate with a 5% fault on top of the same loss is out."""
    ref, _, fp8 = attention_case
    best = rel_fro(fp8, ref)
    faulty = rel_fro(fp8.double() * 1.05, ref)
    assert faulty > best * (1 + T.LAUNCH_SWEEP_REL["ours-fp8"])
    assert set(T.LAUNCH_SWEEP_REL) <= set(T.LAUNCH_SWEEP)
