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

# the compile children (gpu_compile_result) read the generated code with dsv4_sm120.dev.sass
from conftest import gpu_compile_result  # noqa: E402
from attention_cases import Case, build, lonely_rows  # noqa: E402
from dsv4_sm120.attention import DecodeInputError, launch, plan_span, plan_splits, sparse_mla_decode  # noqa: E402
from dsv4_sm120.attention import config, plan  # noqa: E402
from dsv4_sm120.attention.reference import quantize_q_mx, rel_fro, sparse_mla_decode_ref  # noqa: E402

OUT_TOL = {"bf16": 1e-2, "fp8": 2e-2}
LSE_TOL = 1e-3


def config_text(keys):
    """{"impl": "reg", "KCVT": 1} -> "impl=reg,KCVT=1" (DSV4_SM120_ATTN_CONFIG)."""
    return ",".join(f"{k}={v}" for k, v in keys.items())


def check(kw, mode):
    launch.poison_workspace()
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
                    s1, c1, s2, c2 = plan_splits(T, HG, K1, K2, bn, 132)
                    assert s1 >= 1 and c1 % bn == 0 and (s1 - 1) * c1 < K1 <= s1 * c1
                    if K2:
                        assert s2 >= 1 and c2 % bn == 0 and (s2 - 1) * c2 < K2 <= s2 * c2
                    else:
                        assert s2 == 0
    # more rows -> fewer splits per row
    assert plan_splits(1, 1, 128, 512, 32, 132)[0] >= plan_splits(64, 1, 128, 512, 32, 132)[0]
    # never more splits than candidate blocks (one per cache at least)
    for K1, K2 in ((128, 512), (128, 0), (64, 64), (7, 8192)):
        for waves in (1.0, 2.0, 64.0):
            s1, c1, s2, c2 = plan_splits(1, 1, K1, K2, 64, 132, waves)
            assert (s1 - 1) * c1 < K1 <= s1 * c1 and (not K2 or (s2 - 1) * c2 < K2 <= s2 * c2)
            assert s1 + s2 <= max(1 + (K2 > 0), -(-K1 // 64) + -(-K2 // 64))
    assert plan_splits(1, 1, 128, 512, 64, 132, 2.0) == (2, 64, 8, 64)


def _makespan(T, HG, S, chunk, bn, slots):
    # rounds of equal programs x one program's length in blocks (+1: its fixed cost), from the plan as returned
    return -(-(T * HG * S) // slots) * (chunk // bn + 1)


def test_span_plan_properties():
    """The spanning register body's plan: equal whole-block chunks covering main ++ extra exactly, never more
    splits than candidate blocks, never a longer makespan (rounds of programs x program length) than the two
    plans a rule of thumb would take (the most splits that fit one round; one split per row), and the H200 shapes
    this plan exists for (two CTAs per SM: 264 slots): one round while rows are few, a few chunks per row once
    rows pass the slots so the last round is not half empty (spec_rows variants, bench/results/attention.csv)."""
    for T in (1, 3, 16, 17, 64, 96, 128, 192, 300, 384, 1000):
        for HG in (1, 2, 4):
            for K1, K2 in ((128, 0), (128, 512), (100, 512), (128, 8192), (7, 0), (64, 64)):
                for bn in (16, 32, 64):
                    for waves in (0.25, 1.0, 2.0, 4.0):
                        S, c = plan_span(T, HG, K1, K2, bn, 132, waves)
                        nb = -(-(K1 + K2) // bn)
                        assert S >= 1 and c % bn == 0 and (S - 1) * c < K1 + K2 <= S * c, (T, K1, K2, bn, S, c)
                        assert S <= nb
                        slots = max(1, int(waves * 132))
                        one_round = max(1, min(nb, slots // (T * HG)))
                        for s_alt in {1, one_round}:
                            c_alt = -(-nb // s_alt) * bn
                            S_alt = -(-(K1 + K2) // c_alt)
                            assert (_makespan(T, HG, S, c, bn, slots)
                                    <= _makespan(T, HG, S_alt, c_alt, bn, slots)), (T, HG, K1, K2, bn, S)
    assert plan_span(1, 1, 128, 512, 32, 132, 2.0) == (20, 32)      # one block per program
    assert plan_span(6, 1, 128, 512, 32, 132, 2.0) == (20, 32)      # 120 programs, one round
    assert plan_span(16, 1, 128, 512, 32, 132, 2.0) == (10, 64)
    assert plan_span(64, 1, 128, 512, 32, 132, 2.0) == (4, 160)
    assert plan_span(128, 1, 128, 512, 32, 132, 2.0) == (2, 320)    # 256 programs of 10 blocks: one round
    assert plan_span(96, 1, 128, 512, 32, 132, 2.0) == (5, 128)     # 2 rounds of 4 blocks, not 1 of 10
    assert plan_span(192, 1, 128, 512, 32, 132, 2.0) == (4, 160)    # 3 rounds of 5 blocks, not 1 of 20
    assert plan_span(384, 1, 128, 512, 32, 132, 2.0) == (2, 320)    # 3 rounds of 10 blocks, not 2 of 20
    assert plan_span(768, 1, 128, 512, 32, 132, 2.0) == (1, 640)


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
    "tiled+kcvt": dict(impl="tiled", KCVT=1, PREFETCH=1),
    "tiled+kcvt+scale-prefetch": dict(impl="tiled", KCVT=1, PREFETCH=2),
    "tiled+scale-prefetch": dict(impl="tiled", PREFETCH=2, BLOCK_N=32),
    "tiled+bf16part": dict(impl="tiled", PART_BF16=1, BLOCK_S=16),
    "tiled+bf16part+2-per-step": dict(impl="tiled", PART_BF16=1, waves=8, BLOCK_S=2),
}


@pytest.mark.parametrize("impl", list(SPLIT_IMPLS))
def test_all_split_implementations(impl, monkeypatch):
    """Every split body (tiled, its prefetch variants, with fp32 or bf16 partials, the flat one) agrees with the
    float64 reference, on both QK paths (fp8: Q quantized before the tiled launch), selected through
    DSV4_SM120_ATTN_CONFIG."""
    monkeypatch.setenv("DSV4_SM120_ATTN_CONFIG", config_text(SPLIT_IMPLS[impl]))
    for mode in ("bf16", "fp8"):
        check(build(Case(T=2, H=8, K=24, extra="c4", extra_K=20, lengths="random", head_slice=True,
                         seed=50 + (mode == "fp8"))), mode)
    check(build(Case(T=3, H=12, K=40, extra="c4", extra_K=24, lengths="random", head_slice=True,
                     all_invalid_rows=(1,), seed=120)), "fp8")


@pytest.mark.parametrize("kcvt", [0, 1])
def test_scale_prefetch_respects_lengths_and_invalid_rows(kcvt, monkeypatch):
    """PREFETCH=2 reads the next block's tile scales one block early: rows whose length ends inside a block,
    zero-length rows, all-invalid rows, odd pages and several blocks per program still match float64 (scale
    bytes past a row's length are never read as if valid)."""
    monkeypatch.setenv("DSV4_SM120_ATTN_CONFIG", config_text(dict(impl="tiled", PREFETCH=2, KCVT=kcvt, waves=0.25)))
    check(build(Case(T=4, H=8, K=64, lengths="zero_some", extra="c4", extra_K=40, all_invalid_rows=(2,),
                     seed=95 + kcvt)), "bf16")
    check(build(Case(T=3, H=5, K=50, main_page=3, lengths="random", extra="c128", extra_page=2, extra_K=70,
                     seed=97 + kcvt)), "bf16")


@pytest.mark.parametrize("variant", [dict(impl="reg", waves=0.25, DEC_LATE=0, SPAN=0),
                                     dict(impl="reg", PART_BF16=1, BLOCK_N=32, KCVT=1, DEC_LATE=0, SPAN=0),
                                     dict(impl="reg", DEC_LATE=1, SPAN=0, waves=0.25, PART_BF16=0),
                                     dict(impl="reg", DEC_LATE=1, SPAN=0, BLOCK_N=32, KCVT=1, PART_BF16=1),
                                     # SPAN: splits that run from the main cache into the extra one (waves=3 cuts
                                     # these cases mid-block and across the boundary; 0.25: one program per row)
                                     dict(impl="reg", SPAN=1, DEC_LATE=1, waves=3),
                                     dict(impl="reg", SPAN=1, DEC_LATE=0, waves=3),
                                     dict(impl="reg", SPAN=1, DEC_LATE=1, BLOCK_N=32, num_warps=4, KCVT=1, PART_BF16=1,
                                          waves=0.25)])
def test_reg_split_body(variant, monkeypatch):
    """The register body (impl=reg: each K byte read and decoded once per block, the next block's tiles loaded
    while the current one computes, its indices two blocks ahead) against the float64 reference: several
    blocks per program with lengths ending inside a block and zero-length rows, an all-invalid row, a head
    slice; c128 on odd pages; main cache only with a -inf sink; its fp8 QK request is refused clearly."""
    monkeypatch.setenv("DSV4_SM120_ATTN_CONFIG", config_text(variant))
    check(build(Case(T=4, H=8, K=64, extra="c4", extra_K=40, lengths="zero_some", head_slice=True,
                     all_invalid_rows=(2,), seed=80)), "bf16")
    check(build(Case(T=3, H=8, K=24, extra="c4", extra_K=20, lengths="random", seed=84)), "bf16")
    check(build(Case(T=2, H=5, K=17, main_page=3, extra="c128", extra_page=2, extra_K=70, seed=81)), "bf16")
    check(build(Case(T=2, H=16, K=40, sink="-inf", seed=82)), "bf16")
    if variant.get("SPAN"):  # several 16-row head groups (H = 40: three programs per row and split)
        check(build(Case(T=2, H=40, K=40, extra="c4", extra_K=24, lengths="random", head_slice=True, seed=85)),
              "bf16")
    with pytest.raises(DecodeInputError, match="impl=reg"):
        sparse_mla_decode(**build(Case(T=1, H=4, K=16, seed=83)), qk_mode="fp8")


def _combine_inputs(T, H, S, HP, part_bf16, sink, gen):
    """Random partials in the split kernel's workspace layout (row (t*S + s)*HP + h): base-2 maxima
    spread over ~40 (so the weights span many binades), l >= 1 where a split saw a candidate, empty
    splits (m = -inf, l = 0, acc = 0), one row with no candidate at all, padded head rows poisoned."""
    n = T * S * HP
    m = torch.randn(n, generator=gen, dtype=torch.float64) * 10.0
    l = 1.0 + 5.0 * torch.rand(n, generator=gen, dtype=torch.float64)
    acc = torch.randn(n, 512, generator=gen, dtype=torch.float64) * l[:, None]
    empty = torch.rand(n, generator=gen) < 0.25
    rows = torch.arange(n)
    t_of, h_of = rows // (S * HP), rows % HP
    empty |= t_of == T - 1  # the last row has no candidate in any split
    m[empty], l[empty], acc[empty] = -math.inf, 0.0, 0.0
    pad = h_of >= H
    m[pad], l[pad], acc[pad] = math.nan, math.nan, math.nan
    acc_ws = acc.to(torch.bfloat16 if part_bf16 else torch.float32).reshape(-1)
    if sink == "finite":
        sk = torch.randn(H, generator=gen, dtype=torch.float64) * 3.0
        sk[0] = -math.inf  # a -inf sink on one head too
    elif sink == "-inf":
        sk = torch.full((H,), -math.inf, dtype=torch.float64)
    else:
        sk = None
    return acc_ws, m.float(), l.float(), sk


def _combine_ref(acc_ws, m_ws, l_ws, sink, T, H, S, HP):
    """float64: out = sum_s 2^(m_s - M) acc_s / (sum_s 2^(m_s - M) l_s + e^(sink - M ln2)); lse without
    the sink; rows without a candidate -> 0 / -inf."""
    acc = acc_ws.double().reshape(T, S, HP, 512)[:, :, :H]
    m = m_ws.double().reshape(T, S, HP)[:, :, :H]
    l = l_ws.double().reshape(T, S, HP)[:, :, :H]
    M = m.max(dim=1).values  # [T, H]
    Mz = torch.where(torch.isneginf(M), torch.zeros_like(M), M)
    w = torch.exp2(m - Mz[:, None])
    L = (w * l).sum(1)
    A = (w[..., None] * acc).sum(1)
    den = L if sink is None else L + torch.exp(sink[None, :] - Mz * math.log(2.0))
    lonely = L == 0
    out = torch.where(lonely[..., None], torch.zeros_like(A), A / torch.where(lonely, 1.0, den)[..., None])
    lse = torch.where(lonely, -math.inf, (Mz + torch.log2(torch.where(lonely, 1.0, L))) * math.log(2.0))
    return out, lse, lonely


COMBINE_CONFIGS = {
    "auto": {},
    "chunks-of-4": dict(BLOCK_S=4),  # S=10: 4+4+2, S=17: 4x4+1 (ragged last chunk)
    "chunks-of-3-d128": dict(BLOCK_S=3, BLOCK_D=128),
    "d256-chunks-of-2": dict(BLOCK_D=256, BLOCK_S=2),
    "chunks-of-7": dict(BLOCK_S=7),  # not a power of two; S=10: 7 + 3
    "one-split-per-step-2warps": dict(BLOCK_S=1, BLOCK_D=256, combine_warps=2),
}


@pytest.mark.parametrize("cfg_name", list(COMBINE_CONFIGS))
def test_combine_kernel_against_float64(cfg_name):
    """The combine alone, on partials it is handed directly: S in {1, 3, 10, 17} (one chunk, several,
    ragged last chunk), empty splits, a row with no candidate, sinks None / -inf / finite (with a -inf
    head), fp32 and bf16 partials; out and lse poisoned before each call; padded heads poisoned."""
    T, H, HP = 3, 6, 16
    gen = torch.Generator().manual_seed(7000 + list(COMBINE_CONFIGS).index(cfg_name))
    fixed = dict(dict(BLOCK_D=None, BLOCK_S=None, warps=None), **COMBINE_CONFIGS[cfg_name])
    if "combine_warps" in fixed:
        fixed["warps"] = fixed.pop("combine_warps")
    for S in (1, 3, 10, 17):
        bd, bs, w, mr = plan.combine_plan(T, H, S, 4, **fixed)
        L = config.Launch(dict(BLOCK_D=bd, BLOCK_S=bs, combine_warps=w, combine_maxnreg=mr), (S, 64, 0, 64), "test")
        combos = ((False, None), (True, "finite"), (False, "-inf"), (False, "finite"))
        for part_bf16, sink in combos if cfg_name == "auto" else combos[1::2]:
            acc_ws, m_ws, l_ws, sk = _combine_inputs(T, H, S, HP, part_bf16, sink, gen)
            out = torch.full((T, 1, H, 512), float("nan"), dtype=torch.bfloat16)
            lse = torch.full((T, H, 1), float("nan"))
            launch.launch_combine(L, acc_ws, m_ws, l_ws, None if sk is None else sk.float(), out, lse, H, HP, True)
            ro, rl, lonely = _combine_ref(acc_ws, m_ws, l_ws, sk, T, H, S, HP)
            o = out[:, 0].double()
            what = (cfg_name, S, part_bf16, sink)
            assert torch.isfinite(o).all() and not torch.isnan(lse).any(), what
            assert lonely[T - 1].all() and (o[lonely] == 0).all() and torch.isneginf(lse[..., 0][lonely]).all(), what
            # out: fp32 sums then one bf16 conversion: < 1 bf16 ulp (<= 2^-7 relative; Triton's interpreter
            # truncates instead of rounding, so a full ulp), plus fp32 error on cancelling sums; lse: fp32
            tol = 2.0 ** -7 * ro.abs() + 1e-5 * ro.abs().amax(dim=-1, keepdim=True)
            assert ((o - ro).abs() <= tol).all(), (what, (o - ro).abs().max())
            fin = ~lonely
            assert ((lse[..., 0][fin].double() - rl[fin]).abs() <= 1e-5 * rl[fin].abs().clamp(min=1.0)).all(), what


# (rows, heads, heads per program, blocks per row) -> which rows the plan cuts: some, all, none
@pytest.mark.parametrize("T,H,BH,NB,cut", [(7, 6, 16, 3, "some"), (5, 40, 32, 2, "some"), (3, 16, 16, 9, "all"),
                                           (9, 16, 16, 1, "none")])
def test_balanced_combine_merges_only_the_cut_rows(T, H, BH, NB, cut):
    """The combine of a balanced launch (plan.plan_balanced; here the CPU's 4 "SMs"): each row merges exactly as many
    partials as runs it spans (the slots past them poisoned with NaN), and a row inside one run, which its split
    program finished, is left alone (its out / lse poisoned and kept); against float64 on the rows it merges."""
    HG = -(-H // BH)
    HP = HG * BH
    C, nb, S = plan.plan_balanced(T, HG, NB * 64, 4)
    pieces = {}
    for c, r, j0, j1, s, n in plan.balanced_runs(T, HG, NB * 64, 4):
        pieces[r] = n
    assert nb == NB and sorted(pieces) == list(range(T * HG)) and max(pieces.values()) == S
    gen = torch.Generator().manual_seed(7100 + T * H)
    bd, bs, w, mr = plan.combine_plan(T, H, S, 4)
    L = config.Launch(dict(BLOCK_D=bd, BLOCK_S=bs, combine_warps=w, combine_maxnreg=mr, BLOCK_H=BH, balanced=1),
                      (S, NB * 64, 0, 64), "test")
    acc_ws, m_ws, l_ws, sk = _combine_inputs(T, H, S, HP, True, "finite", gen)
    n_of = torch.tensor([[pieces[t * HG + h // BH] for h in range(HP)] for t in range(T)])  # [T, HP]
    slot = torch.arange(S)[None, :, None]
    unused = (slot >= n_of[:, None, :]).reshape(-1)  # workspace rows (t*S + s)*HP + h past the row's pieces
    ref_m, ref_l, ref_acc = m_ws.clone(), l_ws.clone(), acc_ws.clone().view(-1, 512)
    ref_m[unused], ref_l[unused], ref_acc[unused] = -math.inf, 0.0, 0.0
    m_ws[unused], l_ws[unused] = math.nan, math.nan
    acc_ws.view(-1, 512)[unused] = math.nan
    out = torch.full((T, 1, H, 512), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((T, H, 1), float("nan"))
    launch.launch_combine(L, acc_ws, m_ws, l_ws, sk.float(), out, lse, H, HP, True)
    ro, rl, lonely = _combine_ref(ref_acc.reshape(-1), ref_m, ref_l, sk, T, H, S, HP)
    merged = n_of[:, :H] > 1
    assert {"some": merged.any() and (~merged).any(), "all": merged.all(), "none": not merged.any()}[cut], pieces
    o = out[:, 0].double()
    assert torch.isnan(o[~merged]).all() and torch.isnan(lse[..., 0][~merged]).all()
    om, rm = o[merged], ro[merged]
    assert torch.isfinite(om).all()
    tol = 2.0 ** -7 * rm.abs() + 1e-5 * rm.abs().amax(dim=-1, keepdim=True)
    assert ((om - rm).abs() <= tol).all(), (om - rm).abs().max()
    fin = merged & ~lonely
    assert ((lse[..., 0][fin].double() - rl[fin]).abs() <= 1e-5 * rl[fin].abs().clamp(min=1.0)).all()


def test_combine_launch_plan():
    """Shapes-only combine plan: >= 2 programs per SM where the problem allows (T=1, H=16: >= 32),
    4 fp32 per thread (one 16-byte vector per partial), <= 8 partials per step (16 on grids of at most
    2 programs per SM) in the fewest chunks, balanced; explicit knobs are kept, the others fitted."""
    for nsm in (132, 188):
        for T in (1, 2, 4, 16, 64, 128, 300):
            for H in (1, 8, 16, 64, 128):
                for S in (1, 2, 3, 8, 9, 10, 17, 40):
                    bd, bs, w, mr = plan.combine_plan(T, H, S, nsm)
                    progs = T * H * (512 // bd)
                    assert bd in (128, 256, 512) and w == bd // 128
                    assert progs >= min(2 * nsm, T * H * 4)
                    assert bd == 128 or progs < 4 * nsm or bd == 512
                    cap = 16 if progs <= 2 * nsm else 8
                    assert 1 <= bs <= cap and -(-S // bs) == -(-S // cap) and bs * (-(-S // bs) - 1) < S
                    assert mr == plan.combine_maxnreg(bs, 4)
    assert plan.combine_plan(1, 16, 10, 132)[:3] == (128, 10, 1)  # 64 programs, one chunk of 10
    assert plan.combine_plan(1, 16, 17, 132)[:3] == (128, 9, 1)  # 9 + 8
    assert plan.combine_plan(128, 16, 10, 132)[:3] == (512, 5, 4)  # 2048 programs, 5 + 5
    assert plan.combine_plan(128, 16, 3, 132, BLOCK_D=256, BLOCK_S=16)[:3] == (256, 16, 2)
    assert plan.combine_plan(128, 16, 17, 132, warps=1)[:3] == (512, 2, 1)  # 16 fp32 per thread
    # register cap: room for all BLOCK_S loads of a chunk (see the code-generation test), or none (0)
    assert plan.combine_plan(128, 16, 3, 132)[3] == plan.combine_maxnreg(3, 4) == 48
    assert plan.combine_plan(128, 16, 3, 132, maxnreg=0)[3] == 0
    assert plan.combine_maxnreg(16, 4) == 120 and plan.combine_maxnreg(1, 4) == 32
    # the same through the launch configuration: explicit combine keys are kept, the rest fitted around them
    dev = config.Device("NVIDIA H200", (9, 0), 132)
    got = config.resolve(16, 128, 128, 512, dev, overrides={"BLOCK_D": 256, "BLOCK_S": 16}).config
    assert (got["BLOCK_D"], got["BLOCK_S"], got["combine_warps"]) == (256, 16, 2)
    for bad, needle in (("BLOCK_D=96", "power of two"), ("BLOCK_D=1024", "<= 512"), ("BLOCK_S=0", ">= 1")):
        with pytest.raises(DecodeInputError, match=needle):
            config.parse_config(bad)


_COMBINE_COMPILE = r"""
import json, re
from dsv4_sm120.attention.kernels import combine_kernel as fn
from dsv4_sm120.attention.plan import combine_maxnreg
from dsv4_sm120.dev.sass import compile_inspect, kernel_source
out = {}
for cap in (90, 120):
    for bd, bs, w, bf16 in ((512, 3, 4, 0), (128, 10, 1, 0), (512, 6, 4, 1), (256, 5, 2, 0)):
        sig = {"acc_ws": "*bf16" if bf16 else "*fp32", "m_ws": "*fp32", "l_ws": "*fp32", "sink_ptr": "*fp32",
               "out_ptr": "*bf16", "lse_ptr": "*fp32", "H": "i32", "S": "i32", "HP": "i32"}
        # NB, W, C, BALANCED, BH: a classic launch leaves them at their defaults
        cst = dict(HAS_SINK=True, BLOCK_D=bd, BLOCK_S=bs, NB=1, W=1, C=1, BALANCED=False, BH=16)
        src = kernel_source(fn, sig, cst, divisible=[n for n, t in sig.items() if t.startswith("*")])
        name = f"sm{cap}_d{bd}_s{bs}_w{w}" + ("_bf16" if bf16 else "")
        opts = {"num_warps": w, "num_stages": 1, "maxnreg": combine_maxnreg(bs, bd // (32 * w))}
        try:
            k, sass, res = compile_inspect(src, cap, opts)
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        ptx = k.asm["ptx"]
        r = {"ld_v4": len(re.findall(r"ld\.global[^;]*\.v4", ptx)), "ld_v2": len(re.findall(r"ld\.global[^;]*\.v2", ptx)),
             "bar": ptx.count("bar.sync") + ptx.count("barrier.sync"), "shared": ptx.count(".shared")}
        if res:
            r.update(res, maxnreg=opts["maxnreg"])
        # vector loads of partials issued before the first FMA of the (first) chunk
        seq = re.findall(r"(LDG\.E\.(?:128|64)|FFMA)\b", sass)
        if seq:
            r["leading_loads"] = (seq + ["FFMA"]).index("FFMA")
        out[name] = r
print("RESULT" + json.dumps(out))
"""


def test_combine_code_generation_for_sm90_and_sm120():
    """Without a GPU: the combine compiles for sm_90 and sm_120 with one 16-byte vector load per
    partial and thread (8-byte for bf16 partials), no shared memory or barrier (the S reduction stays
    in each thread), and, where cuobjdump can read the cubin, no stack, <= 64 registers for the
    multi-warp plans, and all BLOCK_S loads of a chunk issued before its first FMA (the register cap
    of the plan lets ptxas keep them in flight)."""
    out = gpu_compile_result(_COMBINE_COMPILE)
    for name, v in out.items():
        assert "error" not in v, (name, v)
        bs = int(name.split("_s")[1].split("_")[0])
        assert (v["ld_v2"] if name.endswith("bf16") else v["ld_v4"]) == bs, (name, v)
        assert v["bar"] == 0 and v["shared"] == 0, (name, v)
        if "regs" in v:  # one-warp programs (small grids: registers do not limit them) may use more
            assert v["regs"] <= (64 if "_w1" not in name else 128) and v["stack"] == 0, (name, v)
        if "leading_loads" in v:
            assert v["leading_loads"] >= bs, (name, v)


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


_TILED_KCVT_COMPILE = r"""
import json, re
from dsv4_sm120.attention.kernels import split_kernel_tiled as fn
from dsv4_sm120.dev.sass import compile_inspect, split_kernel_source
out = {}
for cap in (90, 120):
    for kcvt in (0, 1):
        cst = dict(HAS_MAIN_LEN=False, HAS_EXTRA=True, HAS_EXTRA_LEN=False, BLOCK_H=16, BLOCK_N=64, FP8_QK=False,
                   INTERP=False, PREFETCH=True, KCVT=bool(kcvt), q8_ptr=None, qsc_ptr=None)
        src = split_kernel_source(fn, cst)
        name = f"sm{cap}_kcvt{kcvt}"
        opts = {"num_warps": 8, "num_stages": 2 if cap == 90 else 1, "maxnreg": 128}
        try:
            k, sass, res = compile_inspect(src, cap, opts)
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        out[name] = dict(res, f2f_bf16_f16=len(re.findall(r"F2F\.BF16\.F16", sass)),
                         f2fp_e4m3=len(re.findall(r"F2FP\.F16\.E4M3", sass)),
                         hfma2_or_hmul2=len(re.findall(r"\bH(?:FMA2|MUL2)\b", sass)), sass=len(sass),
                         mufu_i2f=len(re.findall(r"\b(?:MUFU\.EX2|I2F\S*)\b", sass)))
print("RESULT" + json.dumps(out))
"""


def test_tiled_kcvt_moves_fp8_conversion_off_the_conversion_pipe():
    """Without a GPU: with KCVT=1 the tiled split kernel compiles for sm_90 and sm_120 under the default
    register cap (128) and its SASS has no e4m3 -> f16 or f16 -> bf16 conversion instructions left (the
    default cast uses 2 per value pair plus one per value; bench/attn_sass_count.py counts them) and fewer
    int->float / exp2 instructions (the UE8M0 tile scales become fp32 exponent bits), while
    the KCVT=0 build still has them (the check sees what it claims to). The asm's bit-exactness is
    tests/test_ptx_decoders.py; its speed is a device measurement (docs/attention.md)."""
    out = gpu_compile_result(_TILED_KCVT_COMPILE, timeout=900)
    for cap in (90, 120):
        base, new = out[f"sm{cap}_kcvt0"], out[f"sm{cap}_kcvt1"]
        assert "error" not in base and "error" not in new, (base, new)
        if base["sass"] == 0:
            pytest.skip("cuobjdump gave no SASS here")
        assert base["f2f_bf16_f16"] + base["f2fp_e4m3"] >= 100, base
        assert new["f2f_bf16_f16"] == 0 and new["f2fp_e4m3"] == 0, new
        assert new["hfma2_or_hmul2"] >= 100, new
        assert new["mufu_i2f"] < base["mufu_i2f"], (base, new)  # UE8M0 scales as exponent bits
        if "stack" in new:
            assert new["stack"] <= base["stack"], (base, new)


_REG_COMPILE = r"""
import collections, json
from dsv4_sm120.attention.kernels import split_kernel_reg as fn
from dsv4_sm120.dev.sass import compile_inspect, hot_loop_ops, split_kernel_source
out = {}
for cap in (90, 120):
    # the default launch (32 candidates, 4 warps, decoded late, spanning splits) and the 8-warp 64-candidate one
    for bn, warps, late in ((32, 4, True), (64, 8, False)):
        cst = dict(HAS_MAIN_LEN=False, HAS_EXTRA=True, HAS_EXTRA_LEN=False, BLOCK_H=16, BLOCK_N=bn, FP8_QK=False,
                   INTERP=False, KCVT=True, DEC_LATE=late, SPAN=late)
        name = f"sm{cap}_bn{bn}"
        try:
            k, sass, res = compile_inspect(split_kernel_source(fn, cst), cap, {"num_warps": warps, "num_stages": 1})
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        ops = collections.Counter(f for _, f in hot_loop_ops(sass))
        out[name] = dict(res, shared=k.metadata.shared, sass=len(sass), loop=sum(ops.values()),
                         ldg128=ops.get("LDG.E.128", 0), ldg64=ops.get("LDG.E.64", 0), lds_u8=ops.get("LDS.U8", 0),
                         ldgsts=sum(n for o, n in ops.items() if o.startswith("LDGSTS")),
                         f2f=sum(n for o, n in ops.items() if o.startswith("F2F.")))
print("RESULT" + json.dumps(out))
"""


def test_reg_body_code_generation_for_sm90_and_sm120():
    """Without a GPU: the register body (the default for H <= 16 with bf16 QK, on sm_120 too, where it has never
    run) compiles for sm_90 and sm_120 at its default launch (32 candidates, 4 warps, one stage, no register cap,
    Q resident, DEC_LATE, SPAN; two CTAs per SM by registers and by sm_120's shared memory) and at the 8-warp
    64-candidate one, without spills and within sm_120's 99 KB of shared memory, and its loop gathers each K tile
    once with 16-byte loads per thread (7 nope tiles + 2 rope loads), with no cp.async staging, no byte-wise
    shared-memory reads and no conversion-pipe e4m3 decode."""
    out = gpu_compile_result(_REG_COMPILE, timeout=900)
    for cap in (90, 120):
        for bn in (32, 64):
            r = out[f"sm{cap}_bn{bn}"]
            assert "error" not in r, r
            if r["sass"] == 0:
                pytest.skip("cuobjdump gave no SASS here")
            assert r["shared"] <= 99 * 1024, r
            assert r.get("stack", 0) == 0, r
            assert (r["ldg128"], r["ldg64"]) == (9, 0), r
            if bn == 32:  # two CTAs per SM: registers (4 warps) and shared memory (sm_120's 100 KB per SM)
                assert r.get("regs", 0) <= 255 and 2 * (r["shared"] + 1024) <= 100 * 1024, r
            assert r["lds_u8"] == 0 and r["ldgsts"] == 0 and r["f2f"] == 0, r


def test_parse_config_accepts_the_documented_keys_and_refuses_typos():
    got = config.parse_config(" KCVT=1, maxnreg=0 ,impl=reg,waves=1.5,BLOCK_S=auto,BLOCK_N=32 ")
    assert got == {"e4m3_int_decode": 1, "maxnreg": 0, "impl": "reg", "waves": 1.5, "BLOCK_S": "auto", "BLOCK_N": 32}
    # old spellings are read as the descriptive names (attention.key_aliases), new ones as themselves
    assert config.parse_config("DEC_LATE=0,SPAN=1,e4m3_int_decode=0") == {"late_decode": 0, "spanning_splits": 1,
                                                                          "e4m3_int_decode": 0}
    assert config.parse_config("") == {}
    for bad, needle in [("BLOCKN=32", "unknown key 'BLOCKN'"), ("impl=fast", "impl must be one of"),
                        ("KCVT", "key=value"), ("BLOCK_N=48", "power of two"), ("num_warps=0", "power of two"),
                        ("waves=0", "out of range"), ("maxnreg=-1", "out of range"), ("PREFETCH=yes", "integer"),
                        ("waves=fast", "a number"), ("BLOCK_N=auto", "integer"),
                        ("PREFETCH=3", r"out of range \(0..2\)"), ("KCVT=2", "out of range"),
                        # knobs that no launch table, rule or calibration variant used are gone
                        ("QPRE=1", "unknown key 'QPRE'"), ("Q_RES=0", "unknown key"), ("min_blocks=2", "unknown key"),
                        ("BLOCK_HC=2", "unknown key"), ("QK_SWAP=1", "unknown key")]:
        with pytest.raises(DecodeInputError, match="DSV4_SM120_ATTN_CONFIG: .*" + needle):
            config.parse_config(bad, "DSV4_SM120_ATTN_CONFIG")


def test_env_config_selects_the_launch_and_refuses_bad_values(monkeypatch):
    """DSV4_SM120_ATTN_CONFIG reaches the launch (here: the register body, seen by its kernel being the one
    launched, with the float64 reference still matched); a typo is an error naming the variable, not a
    silent default; an fp8 request on a bf16-only body is refused."""
    from dsv4_sm120.attention import kernels

    launched = []
    real = kernels.SPLIT_KERNELS["reg"]

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setitem(kernels.SPLIT_KERNELS, "reg", Spy())
    monkeypatch.setenv("DSV4_SM120_ATTN_CONFIG", "impl=reg,KCVT=1")
    check(build(Case(T=2, H=8, K=24, extra="c4", extra_K=20, lengths="random", seed=90)), "bf16")
    assert launched, "DSV4_SM120_ATTN_CONFIG=impl=reg did not reach the launch"
    with pytest.raises(DecodeInputError, match="impl=reg has no fp8"):
        sparse_mla_decode(**build(Case(T=1, H=4, K=16, seed=91)), qk_mode="fp8")
    monkeypatch.setenv("DSV4_SM120_ATTN_CONFIG", "impl=reg,BLOKC_N=32")
    with pytest.raises(DecodeInputError, match="DSV4_SM120_ATTN_CONFIG: unknown key 'BLOKC_N'"):
        sparse_mla_decode(**build(Case(T=1, H=4, K=16, seed=92)), qk_mode="bf16")
    monkeypatch.delenv("DSV4_SM120_ATTN_CONFIG")
    launched.clear()
    check(build(Case(T=1, H=4, K=16, seed=93)), "bf16")
    assert not launched  # default launch again once the variable is gone


_FP8_COMPILE = r"""
import json
from dsv4_sm120.attention.kernels import q_fp8_kernel, split_kernel_tiled
from dsv4_sm120.dev.sass import compile_for, kernel_source, split_kernel_source
out = {}
for cap in (90, 120):
    fn = q_fp8_kernel
    sig = {"q_ptr": "*bf16", "stride_qt": "i32", "stride_qh": "i32", "q8_ptr": "*u8", "qsc_ptr": "*u8", "H": "i32",
           "HP": "i32"}
    src = kernel_source(fn, sig, dict(BLOCK_H=16, INTERP=False))
    try:
        k = compile_for(src, cap, {"num_warps": 4})
        out[f"sm{cap}_qfp8"] = {"ok": bool(k.asm.get("cubin"))}
    except Exception as e:
        out[f"sm{cap}_qfp8"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    fn = split_kernel_tiled
    cst = dict(HAS_MAIN_LEN=False, HAS_EXTRA=True, HAS_EXTRA_LEN=False, BLOCK_H=16, BLOCK_N=64, FP8_QK=True,
               INTERP=False, PREFETCH=False, KCVT=True)
    src = split_kernel_source(fn, cst)
    try:
        k = compile_for(src, cap, {"num_warps": 8, "num_stages": 1, "maxnreg": 128})
        ptx = k.asm["ptx"]
        out[f"sm{cap}_split"] = {"ok": bool(k.asm.get("cubin")), "block_scale_mma": "block_scale" in ptx,
                                 "smem": k.metadata.shared}
    except Exception as e:
        out[f"sm{cap}_split"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
print("RESULT" + json.dumps(out))
"""


def test_fp8_qk_with_q_prequantized_compiles_for_sm90_and_sm120():
    """Without a GPU: the fp8 QK path as launched by default (Q quantized by q_fp8_kernel, the tiled body
    loading it, KCVT on) compiles for sm_90 and sm_120; on sm_120 its QK is the native block-scaled MMA in
    the PTX and the launch fits sm_120's 99 KB of shared memory."""
    out = gpu_compile_result(_FP8_COMPILE, timeout=900)
    for name, v in out.items():
        assert "error" not in v and v["ok"], (name, v)
    assert out["sm120_split"]["block_scale_mma"], out["sm120_split"]
    assert out["sm120_split"]["smem"] <= 99 * 1024, out["sm120_split"]
