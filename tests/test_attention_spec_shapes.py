"""Our kernel at speculative decoding's shapes (CPU, Triton interpreter), through the public
``dsv4_sm120.attention.sparse_mla_decode`` against the float64 reference:

* DSpark draft: SWA only, top-k 192 (= 6 blocks of 32, ceil64(128 + 5)), one length shared by the 5 rows
  of a block (context + 5, at most 133, odd values included), q a 16-head slice of DSpark's 64-head
  padded tensor whose rows 16-63 are NaN, the sink's padded entries NaN too; T = B x 5 up to past 64 rows;
* verify rows (B x 6, B x 4) with per-row causal lengths and a c4 / c128 extra cache, T > 64;
* 64 real heads (TP1) at top-k 192.

Candidates past a row's length point at NaN-poisoned slots, so reading them shows; the register body
(the sm_120 default for 16 heads) runs too, selected through ``DSV4_SM120_ATTN_CONFIG``.
Tolerances as tests/test_attention.py: out 1e-2 relative (bf16 QK), 2e-2 (fp8 QK vs MX-quantized Q).
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from dsv4_sm120.attention import launch, sparse_mla_decode  # noqa: E402
from dsv4_sm120.attention.cache import cache_view, random_cache  # noqa: E402
from dsv4_sm120.attention.reference import quantize_q_mx, rel_fro, sparse_mla_decode_ref  # noqa: E402

OUT_TOL = {"bf16": 1e-2, "fp8": 2e-2}
LSE_TOL = 1e-3
REG_BODY = "impl=reg,BLOCK_N=32,num_warps=4,DEC_LATE=1,SPAN=1,waves=3"


def _indices(g, T, K, lengths, good, n):
    """[T,1,K] int32: each row's first ``lengths[t]`` candidates are good slots (a few -1), the rest
    poisoned slots (a kernel that ignores the length reads NaN)."""
    idx = torch.randint(good, n, (T, 1, K), generator=g, dtype=torch.int32)
    for t, L in enumerate(lengths):
        idx[t, 0, :L] = torch.randint(0, good, (L,), generator=g, dtype=torch.int32)
        holes = torch.rand(L, generator=g) < 0.05
        idx[t, 0, :L][holes] = -1
    return idx


def spec_inputs(seed, lengths, K, H=16, pad_to=None, extra=None, extra_lengths=None, extra_K=512):
    """Kwargs of ``sparse_mla_decode`` for rows with the given SWA lengths (256-token pages) and an optional
    extra cache (``"c4"``: 64-token pages, ``"c128"``: 2-token pages)."""
    g = torch.Generator().manual_seed(seed)
    T = len(lengths)
    swa = random_cache(3, 256, generator=g, poison_slots=torch.arange(640, 768))
    kw = dict(k_cache=cache_view(swa.raw, 256), indices=_indices(g, T, K, lengths, 640, 768),
              topk_length=torch.tensor(lengths, dtype=torch.int32), head_dim_v=512, softmax_scale=512 ** -0.5)
    if extra is not None:
        page, pages = (64, 10) if extra == "c4" else (2, 200)
        n = page * pages
        ec = random_cache(pages, page, generator=g, poison_slots=torch.arange(n - n // 8, n))
        kw.update(extra_k_cache=cache_view(ec.raw, page),
                  extra_indices_in_kvcache=_indices(g, T, extra_K, extra_lengths, n - n // 8, n),
                  extra_topk_length=torch.tensor(extra_lengths, dtype=torch.int32))
    Hq = pad_to or H
    full = torch.randn(T, 1, Hq, 512, generator=g).to(torch.bfloat16)
    sink = torch.randn(Hq, generator=g) * 2
    if pad_to:  # DSpark's padded rows are uninitialised: NaN here, in q and in the sink
        full[:, :, H:] = float("nan")
        sink[H:] = float("nan")
    kw["q"] = full[:, :, :H]          # the glue hands over the real heads as a view
    kw["attn_sink"] = sink            # the kernel reads the first H entries only
    return kw


def check(kw, mode="bf16"):
    launch.poison_workspace()
    out, lse = sparse_mla_decode(**kw, qk_mode=mode)
    T, _, H, _ = kw["q"].shape
    assert out.shape == (T, 1, H, 512) and lse.shape == (T, H, 1)
    rkw = dict(kw, attn_sink=kw["attn_sink"][:H])
    if mode == "fp8":
        rkw["q"] = quantize_q_mx(kw["q"])
    ro, rl = sparse_mla_decode_ref(**rkw)
    assert torch.isfinite(ro).all(), "the reference read a poisoned slot: bad test inputs"
    assert torch.isfinite(out.float()).all(), "NaN in out: a padded head, a poisoned slot or the workspace leaked"
    err = rel_fro(out, ro)
    assert err < OUT_TOL[mode], f"{mode}: out rel err {err}"
    lonely = torch.isneginf(rl)  # rows without a valid candidate (holes, zero lengths): zeros, -inf lse
    assert (out[lonely[:, :, 0].any(1)] == 0).all() and torch.isneginf(lse[lonely]).all()
    dl = (lse.double() - rl)[~lonely].abs().max().item()
    assert dl < LSE_TOL * max(1.0, rl[~lonely].abs().max().item()), f"{mode}: lse err {dl}"
    return out


def dspark_lengths(rng, contexts, block=5):
    return [min(c, 128) + block for c in contexts for _ in range(block)]


@pytest.mark.parametrize("body", ["interpreter", "reg"])
def test_dspark_draft_topk192_padded_heads(body, monkeypatch):
    """2 requests, contexts 0 and >= 128 (lengths 5 and 133 of 192), 64 padded heads of which 16 real."""
    if body == "reg":
        monkeypatch.setenv("DSV4_SM120_ATTN_CONFIG", REG_BODY)
    seed = random.randrange(1 << 30)
    lengths = dspark_lengths(random.Random(seed), [0, 300])
    assert lengths == [5] * 5 + [133] * 5
    kw = spec_inputs(seed, lengths, K=192, pad_to=64)
    out = check(kw)
    # rows of one block share their candidates and length but not their queries
    assert not torch.equal(out[5], out[6])


def test_dspark_draft_beyond_64_rows_odd_lengths():
    """B = 14 blocks of 5 (T = 70 > 64, the stock prefill cut-over), per-block lengths including odd and
    full-window ones; fp8 QK too."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    contexts = [128, 2, 61] + [rng.randint(0, 9) for _ in range(11)]
    lengths = dspark_lengths(rng, contexts)
    assert len(lengths) == 70 and 133 in lengths and 66 in lengths
    kw = spec_inputs(seed, lengths, K=192, pad_to=64)
    check(kw, "bf16")
    check(kw, "fp8")


@pytest.mark.parametrize("K,lengths", [(192, [133, 1, 0, 191, 192, 97]), (128, [1, 128, 0, 127, 64, 33])])
def test_topk_edges(K, lengths):
    """Lengths at 0, 1, the 32-block edges and the full top-k, with rows of zero length (zeros out, -inf lse
    are checked in tests/test_attention.py; here only rows with candidates)."""
    seed = random.randrange(1 << 30)
    kw = spec_inputs(seed, lengths, K=K)
    launch.poison_workspace()
    out, lse = sparse_mla_decode(**kw)
    zero = torch.tensor(lengths) == 0
    assert (out[zero] == 0).all() and torch.isneginf(lse[zero]).all()
    keep = ~zero
    ro, rl = sparse_mla_decode_ref(**dict(kw, attn_sink=kw["attn_sink"][:16]))
    assert rel_fro(out[keep], ro[keep]) < OUT_TOL["bf16"]
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("extra,rows,B", [("c4", 6, 11), ("c128", 4, 17)])
def test_verify_rows_beyond_64_with_extra_cache(extra, rows, B):
    """DSpark verify (B x 6) with a c4 layer's top-k 512, EAGLE verify (B x 4) with a c128 layer; causal SWA
    lengths per row (each verify row sees the earlier draft rows), T > 64."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prefixes = [300] + [rng.randint(0, 10) for _ in range(B - 1)]
    lengths = [min(p + 1 + i, 128) for p in prefixes for i in range(rows)]
    if extra == "c4":
        ex_len = [min((p + 1 + i) // 4, 512) for p in prefixes for i in range(rows)]
        ex_K = 512
    else:
        ex_len = [max((p + 1 + i) // 128, 1) for p in prefixes for i in range(rows)]
        ex_K = 64
    kw = spec_inputs(seed, lengths, K=128, extra=extra, extra_lengths=ex_len, extra_K=ex_K)
    assert kw["q"].shape[0] == B * rows > 64
    check(kw)


def test_sixty_four_real_heads_topk192(monkeypatch):
    """TP1: 64 real heads (four 16-row head groups) at the DSpark draft shape."""
    seed = random.randrange(1 << 30)
    kw = spec_inputs(seed, dspark_lengths(random.Random(seed), [7, 60]), K=192, H=64)
    check(kw)
