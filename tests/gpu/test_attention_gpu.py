"""GPU tests of dsv4_sm120.attention.sparse_mla_decode: the issue's full matrix, covered factor by
factor (every value of every factor appears, with the others rotated), both QK paths, plus CUDA-graph
capture/replay with changing indices, and the draft / verify shapes of speculative decoding (docs/speculative.md)
for 1..64 requests. Tolerances as in tests/test_attention.py (the fp8 path is
checked against the float64 reference fed the same MX-quantized Q)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "overlay"))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from attention_cases import Case, build, lonely_rows  # noqa: E402

OUT_TOL = {"bf16": 1e-2, "fp8": 2e-2}
LSE_TOL = 1e-3
ROW_KEYS = ("indices", "topk_length", "extra_indices_in_kvcache", "extra_topk_length")


def _env_config():
    """DSV4_SM120_TEST_ATTN_CONFIG='impl=tiled,KCVT=0' runs every test of this file with that launch
    configuration (validated as DSV4_SM120_ATTN_CONFIG is), to check a benchmark variant before using it."""
    from dsv4_sm120 import settings
    from dsv4_sm120.attention import config

    return config.parse_config(settings.raw("DSV4_SM120_TEST_ATTN_CONFIG") or "", "DSV4_SM120_TEST_ATTN_CONFIG")


def _set_launch(monkeypatch, keys):
    monkeypatch.setenv("DSV4_SM120_ATTN_CONFIG", ",".join(f"{k}={v}" for k, v in keys.items()))


@pytest.fixture(autouse=True)
def _config_override(monkeypatch):
    _set_launch(monkeypatch, _env_config())


def matrix():
    Hs = [1, 8, 16, 32, 64, 128]
    Ts = [1, 3, 17, 64, 65, 300]
    extras = [None, "c4", "c128"]
    lens = [None, "random", "zero_some"]
    sinks = [None, "finite", "-inf"]
    c128_K = [64, 512, 2048, 8192]
    cases = []
    i = 0
    for H in Hs:
        for T in Ts:
            extra = extras[i % 3]
            ek = 512 if extra == "c4" else c128_K[(i // 3) % 4]
            c = Case(
                T=T, H=H, main_page=[256, 64][(i // 2) % 2], main_pages=4, K=128,
                extra=extra, extra_page=64 if extra == "c4" else 2,
                extra_pages=(ek // 64 + 4) if extra == "c4" else (ek // 2 + 64), extra_K=ek,
                lengths=lens[(i // 9) % 3], sink=sinks[(i // 3) % 3], head_slice=(i % 4 == 1),
                neg_frac=[0.0, 0.1, 0.5][(i // 7) % 3], all_invalid_rows=(0,) if i % 5 == 2 else (),
                seed=100 + i,
            )
            cases.append(pytest.param(c, id=f"H{H}-T{T}-p{c.main_page}-{extra}{ek if extra else ''}-{c.lengths}-{c.sink}"))
            i += 1
    return cases


def check(kw, mode, max_rows=8, ref_kw=None):
    from dsv4_sm120.attention import launch, sparse_mla_decode
    from dsv4_sm120.attention.reference import quantize_q_mx, rel_fro, sparse_mla_decode_ref

    launch.poison_workspace()
    out, lse = sparse_mla_decode(**kw, qk_mode=mode)
    if out.is_cuda:
        torch.cuda.synchronize()
    T, _, H, _ = kw["q"].shape
    assert out.shape == (T, 1, H, 512) and lse.shape == (T, H, 1)
    assert torch.isfinite(out.float()).all()
    lonely = lonely_rows(kw)
    if lonely.any():
        assert (out[lonely.to(out.device)] == 0).all() and torch.isneginf(lse[lonely.to(out.device)]).all()
    rows = torch.nonzero(~lonely).flatten()
    if rows.numel() == 0:
        return
    rows = rows[torch.linspace(0, rows.numel() - 1, min(max_rows, rows.numel())).round().long()].unique()
    sub = {k: (v[rows.to(v.device)] if k in ROW_KEYS else v) for k, v in dict(kw, **(ref_kw or {})).items() if k != "q"}
    q = kw["q"][rows.to(kw["q"].device)]
    ro, rl = sparse_mla_decode_ref(q=quantize_q_mx(q) if mode == "fp8" else q, **sub)
    err = rel_fro(out[rows.to(out.device)], ro)
    assert err < OUT_TOL[mode], f"out rel err {err}"
    dl = (lse[rows.to(out.device)].double().cpu() - rl).abs().max().item()
    assert dl < LSE_TOL * max(1.0, rl.abs().max().item()), f"lse err {dl}"


@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_odd_pages_and_bytes_cache(mode):
    for i, (mp, ep) in enumerate([(1, 2), (3, 5), (7, 64), (255, 3)]):
        c = Case(T=9, H=16, main_page=mp, main_pages=max(2, 300 // mp), K=64, extra="c128", extra_page=ep,
                 extra_pages=max(2, 200 // ep), extra_K=100, lengths="random", cache_mode="bytes" if i % 2 else "normal",
                 seed=700 + i)
        check(build(c, device="cuda"), mode)


@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_cuda_graph_replay_with_changing_indices(mode):
    from dsv4_sm120.attention import sparse_mla_decode

    case = Case(T=16, H=16, main_page=256, main_pages=4, K=128, extra="c4", extra_pages=40, extra_K=512,
                lengths="random", seed=900)
    kw = build(case, device="cuda")
    n_main = kw["k_cache"].shape[0] * kw["k_cache"].shape[1]
    n_extra = kw["extra_k_cache"].shape[0] * kw["extra_k_cache"].shape[1]
    good_main, good_extra = n_main - n_main // 8, n_extra - n_extra // 8
    sparse_mla_decode(**kw, qk_mode=mode)  # compile + warm
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sparse_mla_decode(**kw, qk_mode=mode)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_g, lse_g = sparse_mla_decode(**kw, qk_mode=mode)
    gen = torch.Generator(device="cuda").manual_seed(5)
    for step in range(4):
        kw["indices"].copy_(torch.randint(0, good_main, kw["indices"].shape, device="cuda", generator=gen, dtype=torch.int32))
        kw["extra_indices_in_kvcache"].copy_(
            torch.randint(-1, good_extra, kw["extra_indices_in_kvcache"].shape, device="cuda", generator=gen, dtype=torch.int32))
        kw["topk_length"].copy_(torch.randint(0, 129, (16,), device="cuda", generator=gen, dtype=torch.int32))
        kw["extra_topk_length"].copy_(torch.randint(0, 513, (16,), device="cuda", generator=gen, dtype=torch.int32))
        kw["q"].copy_(torch.randn(kw["q"].shape, device="cuda", generator=gen).to(torch.bfloat16))
        g.replay()
        torch.cuda.synchronize()
        out_e, lse_e = sparse_mla_decode(**kw, qk_mode=mode)
        torch.cuda.synchronize()
        assert torch.equal(out_g, out_e), f"step {step}"
        assert torch.equal(lse_g.isneginf(), lse_e.isneginf())
        fin = torch.isfinite(lse_e)
        assert torch.equal(lse_g[fin], lse_e[fin])
    check(kw, mode)


@pytest.mark.parametrize(
    "variant",
    [dict(impl="flat"), dict(impl="tiled", PREFETCH=1), dict(impl="tiled"), dict(impl="tiled", KCVT=0, PREFETCH=2),
     dict(impl="reg", BLOCK_N=32, DEC_LATE=0, SPAN=0), dict(impl="reg", BLOCK_N=64, DEC_LATE=0, SPAN=0, PART_BF16=0),
     dict(impl="reg", BLOCK_N=64, DEC_LATE=1, SPAN=0),
     dict(impl="reg", BLOCK_N=32, num_warps=4, DEC_LATE=1, SPAN=0, waves=2),
     # spanning splits: waves=0.5 cuts the first case's rows across the main / extra boundary
     dict(impl="reg", BLOCK_N=64, DEC_LATE=1, SPAN=1, waves=0.5),
     dict(impl="reg", BLOCK_N=32, num_warps=4, DEC_LATE=1, SPAN=1, waves=2),
     # the Hopper warpgroup-MMA body (64 heads per program: here 16 of them masked); waves=8 cuts rows across the
     # main / extra boundary; waves=0.01 leaves one split per row, whose program writes out / lse itself
     dict(impl="wgmma"), dict(impl="wgmma", waves=8, PART_BF16=0), dict(impl="wgmma", waves=0.01),
     # its candidates-as-M sibling (16 heads as N), and 32 as N with half of them masked
     dict(impl="wgmma_t"), dict(impl="wgmma_t", waves=8, PART_BF16=0), dict(impl="wgmma_t", waves=0.01),
     dict(impl="wgmma_t", BLOCK_H=32, waves=8),
     # its balanced launch (one program per SM walking an equal run of blocks across rows; plan.plan_balanced)
     dict(impl="wgmma_t", balanced=1), dict(impl="wgmma_t", balanced=1, PART_BF16=0),
     # the warp-specialized body at 16, 32 and 64 heads per program (here 16 real heads: the rest masked); waves=8
     # cuts rows across the main / extra boundary
     dict(impl="wspec"), dict(impl="wspec", BLOCK_H=32), dict(impl="wspec", BLOCK_H=32, waves=8, PART_BF16=0),
     dict(impl="wspec", BLOCK_H=64), dict(impl="wspec", BLOCK_H=64, waves=8, PART_BF16=0)],
    ids=["flat", "prefetch", "tiled", "tiled-kcvt0", "reg32", "reg64-fp32part", "reg64-declate",
         "reg32-4warps-declate", "reg64-span", "reg32-4warps-span", "wgmma", "wgmma-split-fp32part",
         "wgmma-one-split-writes-out", "wgmma_t", "wgmma_t-split-fp32part", "wgmma_t-one-split-writes-out",
         "wgmma_t-32-heads-split", "wgmma_t-balanced", "wgmma_t-balanced-fp32part", "wspec", "wspec32",
         "wspec32-split-fp32part", "wspec64", "wspec64-split-fp32part"])
@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_variants(mode, variant, monkeypatch):
    from dsv4_sm120.attention.config import BF16_ONLY_IMPLS

    if mode == "fp8" and variant.get("impl") in BF16_ONLY_IMPLS:
        pytest.skip(f"impl={variant['impl']} has no fp8 QK path (refused: tests/test_attention.py)")
    if variant.get("impl") in ("wgmma", "wgmma_t") and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip(f"impl={variant['impl']} runs on Hopper only (refused elsewhere: tests/test_attention_config.py)")
    _set_launch(monkeypatch, dict(_env_config(), **variant))
    check(build(Case(T=17, H=16, main_page=256, K=128, extra="c4", extra_pages=12, extra_K=512,
                     lengths="random", all_invalid_rows=(3,), seed=950), device="cuda"), mode)
    check(build(Case(T=5, H=16, main_page=3, main_pages=100, K=64, extra="c128", extra_page=2, extra_pages=300,
                     extra_K=300, lengths="random", all_invalid_rows=(0,), seed=951), device="cuda"), mode)
    if variant.get("balanced"):
        # enough rows that some lie inside one program's run (written by it) and others are cut (merged)
        check(build(Case(T=301, H=16, main_page=64, main_pages=40, K=128, lengths="random", all_invalid_rows=(7,),
                         seed=952), device="cuda"), mode)
        # 24 and 32 heads: two 16-head groups per row (the balanced launch's BLOCK_H), the second half masked at 24
        for H, T in ((32, 40), (24, 61)):
            check(build(Case(T=T, H=H, main_page=256, K=128, extra="c4", extra_pages=12, extra_K=512,
                             lengths="random", all_invalid_rows=(3,), seed=953 + H), device="cuda"), mode)


def wide_cases():
    """The warp-specialized body with 32 / 64 heads per program: head counts below, at and above a program's (masked
    rows, several programs a row), the three layouts, page sizes, lengths, sinks, head slices, rows without a valid
    candidate; ``waves`` 8 cuts rows into several splits across the main / extra boundary."""
    out = []
    shapes = [(8, 5, None), (24, 17, "c4"), (32, 3, "c128"), (32, 64, "c4"), (40, 9, None), (64, 33, "c4"),
              (64, 6, "c128"), (96, 7, "c4"), (128, 4, "c128")]
    for bh in (32, 64):
        for i, (H, T, extra) in enumerate(shapes):
            c = Case(T=T, H=H, main_page=[256, 64, 3][i % 3], main_pages=[4, 8, 200][i % 3], K=128, extra=extra,
                     extra_page=64 if extra == "c4" else 2, extra_pages=12 if extra == "c4" else 400,
                     extra_K=512 if extra == "c4" else 700, lengths=[None, "random", "zero_some"][i % 3],
                     sink=[None, "finite", "-inf"][(i + 1) % 3], head_slice=i % 2 == 1, all_invalid_rows=(T // 2,),
                     seed=1100 + 20 * bh + i)
            waves = 8 if i % 2 else 1
            out.append(pytest.param(bh, waves, c, id=f"wspec{bh}-H{H}-T{T}-{extra}-waves{waves}"))
    return out


@pytest.mark.parametrize("block_h,waves,case", wide_cases())
def test_wspec_wide_programs(block_h, waves, case, monkeypatch):
    _set_launch(monkeypatch, dict(impl="wspec", BLOCK_H=block_h, waves=waves))
    check(build(case, device="cuda"), "bf16", max_rows=12)


@pytest.mark.parametrize("mode", ["bf16", "fp8"])
@pytest.mark.parametrize("case", matrix())
def test_matrix(case, mode):
    check(build(case, device="cuda"), mode)


# speculative decoding: rows per request, SWA candidates, extra cache, its candidates (docs/speculative.md)
SPEC = {"dspark_draft": (5, 192, None, 0), "dspark_verify": (6, 128, "c4", 512),
        "eagle_verify": (4, 128, "c4", 512), "eagle_draft": (1, 128, None, 0)}
SPEC_B = (1, 2, 4, 8, 16, 32, 64)


def spec_inputs(kind, B, seed):
    """The call's shapes on the GPU: DSpark draft blocks share their request's 192 candidates (window then
    block, context + 5 valid, at most 133), q a 16-head view of a 64-head tensor whose padded rows (and
    sink entries) are NaN; verify / draft rows get causal lengths. Candidates past a length are poisoned."""
    n, K, extra, eK = SPEC[kind]
    T = B * n
    case = Case(T=T, H=16, main_page=256, main_pages=4, K=K, extra=extra, extra_page=64, extra_pages=12,
                extra_K=eK or 32, neg_frac=0.02, seed=seed)
    kw = build(case, device="cuda")
    g = torch.Generator().manual_seed(seed)
    n_main = kw["k_cache"].shape[0] * kw["k_cache"].shape[1]
    good = n_main - n_main // 8
    prefix = torch.randint(0, 160, (B,), generator=g)
    prefix[0] = 400
    if kind == "dspark_draft":
        lengths = (prefix.clamp(max=128) + 5).repeat_interleave(n)
        first = (torch.arange(T) // n) * n
        kw["indices"] = kw["indices"][first.cuda()].contiguous()
    else:
        lengths = (prefix.repeat_interleave(n) + 1 + torch.arange(T) % n).clamp(max=K)
    idx = kw["indices"]
    past = torch.arange(K)[None, :] >= lengths[:, None]
    idx[:, 0][past.cuda()] = torch.randint(good, n_main, (int(past.sum()),), generator=g, dtype=torch.int32).cuda()
    kw["topk_length"] = lengths.to(torch.int32).cuda()
    ref_kw = None
    if kind == "dspark_draft":
        full = torch.randn(T, 1, 64, 512, generator=g).to(torch.bfloat16)
        full[:, :, 16:] = float("nan")
        sink = torch.randn(64, generator=g) * 2
        sink[16:] = float("nan")
        kw["q"] = full.cuda()[:, :, :16]
        kw["attn_sink"] = sink.cuda()
        ref_kw = {"attn_sink": kw["attn_sink"][:16]}
    if extra is not None:  # c4: the indexer's top-k, up to 512 of the position's compressed tokens
        el = ((prefix.repeat_interleave(n) + 1 + torch.arange(T) % n) // 4).clamp(max=eK)
        kw["extra_topk_length"] = el.to(torch.int32).cuda()
    return kw, ref_kw


@pytest.mark.parametrize("mode", ["bf16", "fp8"])
@pytest.mark.parametrize("B", SPEC_B)
@pytest.mark.parametrize("kind", list(SPEC))
def test_speculative_shapes(kind, B, mode):
    kw, ref_kw = spec_inputs(kind, B, seed=1300 + 10 * B + list(SPEC).index(kind))
    assert kw["q"].shape[0] == B * SPEC[kind][0]
    check(kw, mode, max_rows=12, ref_kw=ref_kw)
