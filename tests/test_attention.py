"""CPU tests of dsv4_sm120.attention.sparse_mla_decode under Triton's interpreter (tiny shapes).

Tolerances (out: relative Frobenius vs float64; lse: absolute, natural log):
* bf16 path: the kernel is exact up to fp32 accumulation except for two bf16 roundings: P before
  the PV tensor-core dot (as FlashMLA) and the output. Output rounding alone gives ~1.5e-3 on these
  inputs; P rounding adds ~2^-9 relative per weight, which cancellation in a softmax-weighted
  average of N(0,1) vectors amplifies to ~3-5e-3. Bound: 1e-2. lse only sees fp32: 1e-3.
* fp8 path (sm_120): compared against the float64 reference fed the same MX-quantized Q
  (``quantize_q_mx``), so the same bounds apply, plus slack for fp32-vs-f64 quantization ties: 2e-2.
  Against the unquantized reference the fp8 path is looser (~5-10% on out); that is measured, not
  asserted, and recorded in docs/attention.md.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from test_attention_cases import Case, build, lonely_rows  # noqa: E402
from dsv4_sm120.attention import DecodeInputError, sparse_mla_decode  # noqa: E402
from dsv4_sm120.attention import kernel as K  # noqa: E402
from dsv4_sm120.attention.reference import quantize_q_mx, rel_fro, sparse_mla_decode_ref  # noqa: E402

OUT_TOL = {"bf16": 1e-2, "fp8": 2e-2}
LSE_TOL = 1e-3


def poison_workspace():
    for buf in K._WORKSPACE.values():
        buf.fill_(float("nan"))


def check(kw, mode):
    poison_workspace()
    out, lse = sparse_mla_decode(**kw, qk_mode=mode)
    T, _, H, _ = kw["q"].shape
    assert out.shape == (T, 1, H, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (T, H, 1) and lse.dtype == torch.float32
    rkw = dict(kw)
    if mode == "fp8":
        rkw["q"] = quantize_q_mx(kw["q"])
    ro, rl = sparse_mla_decode_ref(**rkw)
    lonely = lonely_rows(kw)
    assert torch.isfinite(out.float()).all(), "NaN/inf in out"
    if lonely.any():
        assert (out[lonely] == 0).all()
        assert torch.isneginf(lse[lonely]).all()
    keep = ~lonely
    if keep.any():
        err = rel_fro(out[keep], ro[keep])
        assert err < OUT_TOL[mode], f"{mode}: out rel err {err}"
        dl = (lse[keep].double() - rl[keep]).abs().max().item()
        assert dl < LSE_TOL * max(1.0, rl[keep].abs().max().item()), f"{mode}: lse err {dl}"
    return out, lse


CASES = [
    Case(T=1, H=1, K=16, sink=None),
    Case(T=3, H=8, K=32, extra="c4", extra_K=32, lengths="random", head_slice=True),
    Case(T=2, H=20, K=24, extra="c128", extra_page=2, extra_pages=40, extra_K=40, lengths="zero_some", sink="-inf"),
    Case(T=3, H=16, main_page=256, main_pages=2, K=48, extra="c4", lengths="random", all_invalid_rows=(1,)),
    Case(T=2, H=4, main_page=3, main_pages=11, K=20, extra="c128", extra_page=5, extra_pages=7, extra_K=17),
    Case(T=2, H=8, main_page=1, main_pages=40, K=16, cache_mode="bytes", sink=None),
]


@pytest.mark.parametrize("mode", ["bf16", "fp8"])
@pytest.mark.parametrize("ci", range(len(CASES)))
def test_matches_float64_reference(ci, mode):
    case = CASES[ci]
    case.seed = 1000 * ci + (7 if mode == "fp8" else 3)
    check(build(case), mode)


def test_all_rows_invalid_gives_zeros_and_neg_inf_lse():
    kw = build(Case(T=3, H=8, K=16, extra="c4", extra_K=16, all_invalid_rows=(0, 1, 2), seed=11))
    out, lse = sparse_mla_decode(**kw, qk_mode="bf16")
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_zero_lengths_hide_poisoned_candidates():
    # every row's length is 0 or short; candidates past it are NaN tokens
    kw = build(Case(T=4, H=8, K=32, lengths="zero_some", extra="c4", seed=12))
    out, lse = check(kw, "bf16")
    assert torch.isfinite(out.float()).all()


def test_sink_semantics():
    """A huge sink drives out to ~0 without changing lse; -inf sink equals no sink."""
    kw = build(Case(T=2, H=8, K=16, sink=None, seed=13))
    o0, l0 = sparse_mla_decode(**kw, qk_mode="bf16")
    o1, l1 = sparse_mla_decode(**kw, attn_sink=torch.full((8,), -math.inf), qk_mode="bf16")
    assert torch.equal(o0, o1) and torch.equal(l0, l1)
    o2, l2 = sparse_mla_decode(**kw, attn_sink=torch.full((8,), 80.0), qk_mode="bf16")
    assert torch.equal(l0, l2)
    assert o2.float().abs().max() < 1e-20 + o0.float().abs().max() * 1e-20


def test_default_scale_and_head_slice_equivalence():
    kw = build(Case(T=2, H=8, K=16, head_slice=True, seed=14))
    kw.pop("softmax_scale")
    o1, l1 = sparse_mla_decode(**kw, qk_mode="bf16")
    kw["q"] = kw["q"].contiguous()
    o2, l2 = sparse_mla_decode(**kw, qk_mode="bf16")
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_split_plan_properties():
    for T in (1, 3, 17, 64, 300):
        for HG in (1, 2):
            for K1, K2 in ((128, 0), (128, 512), (128, 8192), (64, 64), (7, 0)):
                for bn in (16, 32, 64):
                    s1, c1, s2, c2 = K.plan_splits(T, HG, K1, K2, bn, 132)
                    assert s1 >= 1 and c1 % bn == 0 and (s1 - 1) * c1 < K1 <= s1 * c1
                    if K2:
                        assert s2 >= 1 and c2 % bn == 0 and (s2 - 1) * c2 < K2 <= s2 * c2
                    else:
                        assert s2 == 0
    # more rows -> fewer splits per row
    assert K.plan_splits(1, 1, 128, 512, 32, 132)[0] >= K.plan_splits(64, 1, 128, 512, 32, 132)[0]
    # min_blocks: at least that many blocks per program where the candidates allow it
    for mb in (1, 2, 3, 4):
        for K1, K2 in ((128, 512), (128, 0), (64, 64), (7, 8192)):
            s1, c1, s2, c2 = K.plan_splits(1, 1, K1, K2, 64, 132, 2.0, mb)
            assert (s1 - 1) * c1 < K1 <= s1 * c1 and (not K2 or (s2 - 1) * c2 < K2 <= s2 * c2)
            nb = -(-K1 // 64) + -(-K2 // 64)
            assert s1 + s2 <= max(1 + (K2 > 0), -(-nb // mb))
    assert K.plan_splits(1, 1, 128, 512, 64, 132, 2.0, 2) == (1, 128, 4, 128)


@pytest.mark.parametrize(
    "bad,msg",
    [
        (dict(q=torch.zeros(2, 1, 4, 256, dtype=torch.bfloat16)), "q must be"),
        (dict(q=torch.zeros(2, 1, 4, 512)), "bfloat16"),
        (dict(head_dim_v=448), "head_dim_v"),
        (dict(indices=torch.zeros(3, 1, 8, dtype=torch.int32)), "indices"),
        (dict(indices=torch.zeros(2, 1, 8)), "int32"),
        (dict(k_cache=torch.zeros(2, 64, 1, 576, dtype=torch.uint8)), "584"),
        (dict(topk_length=torch.zeros(5, dtype=torch.int32)), "topk_length"),
        (dict(attn_sink=torch.zeros(2)), "attn_sink"),
    ],
)
def test_bad_input_is_a_clear_error(bad, msg):
    kw = build(Case(T=2, H=4, K=8, seed=15))
    kw.update(bad)
    with pytest.raises(DecodeInputError, match=msg):
        sparse_mla_decode(**kw)


def test_bad_qk_mode():
    kw = build(Case(T=1, H=4, K=8, seed=16))
    with pytest.raises(DecodeInputError, match="qk_mode"):
        sparse_mla_decode(**kw, qk_mode="int4")


def _sglang_torch_ref():
    try:
        from sglang.kernels.ops.attention.flash_mla_sm120 import _sm120_sparse_decode_fwd
    except Exception as e:  # pragma: no cover - needs the dev venv's sglang
        pytest.skip(f"sglang 0.5.23 not importable here: {e}")
    return _sm120_sparse_decode_fwd


@pytest.mark.parametrize(
    "case",
    [
        Case(T=3, H=16, main_page=256, main_pages=2, K=32, extra="c4", extra_K=32, lengths="random",
             all_invalid_rows=(2,), seed=21),
        Case(T=2, H=8, K=24, extra="c128", extra_page=2, extra_pages=30, extra_K=24, sink="-inf",
             head_slice=True, seed=22),
    ],
)
def test_matches_sglang_torch_path(case):
    """Same answer as SGLang's in-tree torch oracle, lse convention included ([T,H,1], -inf rows)."""
    fwd = _sglang_torch_ref()
    kw = build(case)
    out, lse = sparse_mla_decode(**kw, qk_mode="bf16")
    so, sl = fwd(
        kw["q"], kw["k_cache"], kw["indices"], kw.get("topk_length"), kw.get("attn_sink"), 512,
        kw["softmax_scale"], kw.get("extra_k_cache"), kw.get("extra_indices_in_kvcache"),
        kw.get("extra_topk_length"),
    )
    assert so.shape == out.shape and sl.shape == lse.shape
    assert rel_fro(out, so) < 1e-2
    fin = torch.isfinite(sl)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin] - sl[fin]).abs().max() < 1e-3
    assert torch.equal(torch.isneginf(sl), torch.isneginf(lse))


SPLIT_IMPLS = {
    "flat": dict(impl="flat"),
    "tiled": dict(impl="tiled"),
    "tiled+prefetch": dict(impl="tiled", PREFETCH=1),
    "pipe": dict(impl="pipe", NUM_STAGES=2),
    "pipe+bf16part": dict(impl="pipe", NUM_STAGES=3, PART_BF16=1, BLOCK_S=16),
    "pipe+pvreload": dict(impl="pipe", NUM_STAGES=2, PV_RELOAD=1, BLOCK_N=32),
    "tiled+bf16part+minblocks": dict(impl="tiled", PART_BF16=1, min_blocks=2, BLOCK_S=2),
}


@pytest.mark.parametrize("impl", list(SPLIT_IMPLS))
def test_all_split_implementations(impl):
    """Every split body (tiled, its index-prefetch variant, the software-pipelined one with fp32 or
    bf16 partials, the flat one) agrees with the float64 reference, on both QK paths."""
    K.CONFIG_OVERRIDE.clear()
    K.CONFIG_OVERRIDE.update(SPLIT_IMPLS[impl])
    try:
        for mode in ("bf16", "fp8"):
            check(build(Case(T=2, H=8, K=24, extra="c4", extra_K=20, lengths="random", head_slice=True,
                             seed=50 + (mode == "fp8"))), mode)
    finally:
        K.CONFIG_OVERRIDE.clear()


def test_rows_split_across_launches_when_workspace_is_capped(monkeypatch):
    """Huge T (prefill through this kernel) is cut into row chunks so the workspace stays bounded;
    the answer does not change."""
    kw = build(Case(T=7, H=8, K=24, extra="c4", extra_K=20, lengths="random", all_invalid_rows=(5,), seed=60))
    o1, l1 = sparse_mla_decode(**kw, qk_mode="bf16")
    monkeypatch.setenv("DSV4_SM120_ATTN_WS_MB", "0.05")  # ~13k floats: at most a couple of rows per launch
    o2, l2 = check(kw, "bf16")
    assert rel_fro(o2, o1) < 1e-2
    fin = torch.isfinite(l1)
    assert torch.equal(fin, torch.isfinite(l2)) and (l1[fin] - l2[fin]).abs().max() < 1e-4


def test_launch_configuration_rules(monkeypatch):
    """Shape/architecture rules of the default launch configuration (H200 call 4): on Hopper the
    tiled body is pipelined (num_stages=2) only when a program owns >= 2 candidate blocks, the
    combine merges 16 partials per step when there are more than 8, and H > 16 uses 16-row head
    groups on small grids and the flat body on large ones; sm_120 keeps one stage and <= 32 rows."""
    dev = torch.device("cpu")
    monkeypatch.setattr(K, "_interpreting", lambda: False)
    monkeypatch.setattr(K, "_is_sm120", lambda d: False)
    monkeypatch.setattr(K, "_is_hopper", lambda d: True)

    def resolved(H, T, nsm=132):
        cfg = K._default_config(H, dev, False, T, nsm)
        hg = -(-H // cfg["BLOCK_H"])
        plan = K.plan_splits(T, hg, 128, 512, cfg["BLOCK_N"], nsm, cfg["waves"])
        return K._resolve_auto(cfg, *plan), plan

    for T, bs, st in ((1, 16, 1), (4, 16, 1), (16, 16, 1), (64, 8, 2), (128, 8, 2)):
        cfg, plan = resolved(16, T)
        assert (cfg["impl"], cfg["BLOCK_H"], cfg["BLOCK_N"], cfg["maxnreg"]) == ("tiled", 16, 64, 128)
        assert (cfg["BLOCK_S"], cfg["num_stages"]) == (bs, st), (T, plan, cfg)
        assert cfg["BLOCK_S"] >= min(16, plan[0] + plan[2])
    assert resolved(64, 1)[0]["BLOCK_H"] == 16 and resolved(64, 16)[0]["impl"] == "tiled"
    big = resolved(64, 128)[0]
    assert (big["impl"], big["BLOCK_H"], big["num_stages"]) == ("flat", 64, 1)
    # never more than one stage for the flat body or a one-block program
    assert K._resolve_auto(dict(big, num_stages="auto"), 1, 64, 1, 64)["num_stages"] == 1
    # sm_120: no kernel-level pipelining (shared memory), head blocks <= 32
    monkeypatch.setattr(K, "_is_hopper", lambda d: False)
    monkeypatch.setattr(K, "_is_sm120", lambda d: True)
    for H, T in ((16, 128), (64, 1), (128, 300)):
        cfg, _ = resolved(H, T)
        assert cfg["num_stages"] == 1 and cfg["BLOCK_H"] <= 32 and cfg["impl"] == "tiled"
    # explicit overrides win over "auto"
    assert K._resolve_auto(dict(cfg, BLOCK_S=4, num_stages=3), 1, 64, 9, 64)["BLOCK_S"] == 4
