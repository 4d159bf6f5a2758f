"""The gather floor of the attention benchmark (bench/attn_floor.py) under Triton's interpreter, its cases and rows in
bench/bench_attention.py (``spec_rows``), and its gather loads as compiled for sm_90 / sm_120.

The floor is a lower bound only if it reads every byte a decode call must read: its checksum is compared with torch's
sum of exactly those bytes (576-byte token rows, 8-byte scale rows, both caches, q), and single bytes of the caches
are changed to show which ones it reads and which it must not (past a row's length, -1 slots, page padding)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import attn_floor as F  # noqa: E402
import attn_inputs as AI  # noqa: E402
import bench_attention as BA  # noqa: E402
from attention_cases import Case, build  # noqa: E402
from conftest import gpu_compile_result  # noqa: E402
from dsv4_sm120.attention.cache import BYTES_PER_TOKEN, ROW_BYTES, raw_pages  # noqa: E402

FLOOR_CASES = {
    "main_only": Case(T=3, H=2, K=40, lengths="random", seed=1),
    "c4": Case(T=4, H=1, K=24, extra="c4", extra_K=50, lengths="random", seed=2),
    "c128_pages2": Case(T=5, H=3, K=20, extra="c128", extra_page=2, extra_pages=40, extra_K=70, seed=3),
    "odd_pages_head_slice": Case(T=2, H=4, main_page=3, main_pages=11, K=33, extra="c128", extra_page=5,
                                 extra_pages=7, extra_K=17, lengths="zero_some", head_slice=True, seed=4),
    "all_invalid_row": Case(T=3, H=1, K=16, extra="c4", extra_K=16, all_invalid_rows=(1,), seed=5),
}


def run_floor(kw, num_sms=4, waves=2.0):
    f = F.GatherFloor(kw["q"], num_sms=num_sms, waves=waves, **{k: v for k, v in kw.items() if k != "q"})
    f.out.fill_(float("nan"))
    out, cs = f()
    assert out.shape == kw["q"].shape and (out == 0).all(), "the floor writes every out element (zeros)"
    return F.checksum(cs), f


@pytest.mark.parametrize("num_sms", [1, 64])
@pytest.mark.parametrize("name", list(FLOOR_CASES))
def test_checksum_is_the_sum_of_the_bytes_a_call_reads(name, num_sms):
    """Every row's checksum equals torch's sum of its q words and the 146 words (576-byte row + 8-byte scale row) of
    each valid candidate of both lists, whether a row is one program (1 SM) or cut into many (64 SMs)."""
    kw = build(FLOOR_CASES[name])
    got, f = run_floor(kw, num_sms=num_sms)
    blocks = -(-f.K1 // 16) + -(-f.K2 // 16)
    assert f.S == (blocks if num_sms == 64 else 1 + (f.K2 > 0)), f.plan  # a program per block, or per list
    assert torch.equal(got, F.reference_checksum(**kw)), f.plan


def _slot_bytes(kw, cache_key, slot):
    """(raw page buffer, page, byte offset of the 576-byte row, byte offset of the 8-byte scale row) of ``slot``."""
    view = kw[cache_key]
    P = view.shape[1]
    page, off = slot // P, slot % P
    return raw_pages(view), page, off * ROW_BYTES, P * ROW_BYTES + off * 8


def test_checksum_follows_each_read_byte_and_ignores_the_others():
    """A byte changed in a candidate's row or scale row (main and extra caches, the scale row's pad byte, q) changes
    the floor's checksum exactly as torch's sum of the same bytes; a byte of a slot past the row's length, behind a
    -1 index, or in a page's padding does not change it."""
    kw = build(Case(T=3, H=2, K=24, extra="c128", extra_page=2, extra_pages=40, extra_K=30, lengths="random",
                    seed=11))
    lens = kw["topk_length"]
    t = int(torch.argmax(lens))
    assert int(lens[t]) > 2
    base, _ = run_floor(kw)
    assert torch.equal(base, F.reference_checksum(**kw))

    def changed(buf, page, at):
        buf[page, at] ^= 0x5A
        got, _ = run_floor(kw)
        want = F.reference_checksum(**kw)
        buf[page, at] ^= 0x5A
        return got, want

    # bytes it must read
    idx = kw["indices"][t, 0]
    slot = int(idx[(idx >= 0) & (torch.arange(idx.numel()) < lens[t])][0])
    buf, page, row, sc = _slot_bytes(kw, "k_cache", slot)
    eidx = kw["extra_indices_in_kvcache"][t, 0]
    eslot = int(eidx[(eidx >= 0) & (torch.arange(eidx.numel()) < kw["extra_topk_length"][t])][0])
    ebuf, epage, erow, esc = _slot_bytes(kw, "extra_k_cache", eslot)
    for what, (b, p, at) in {"main nope byte": (buf, page, row), "main rope byte": (buf, page, row + 575),
                             "main scale byte": (buf, page, sc + 3), "main scale pad": (buf, page, sc + 7),
                             "extra nope byte": (ebuf, epage, erow + 100), "extra scale byte": (ebuf, epage, esc)
                             }.items():
        got, want = changed(b, p, at)
        assert torch.equal(got, want) and not torch.equal(got, base), what
    q = kw["q"]
    q.view(torch.int16)[t, 0, 1, 300] ^= 0x1234
    got, _ = run_floor(kw)
    assert torch.equal(got, F.reference_checksum(**kw)) and got[t] != base[t], "q"
    q.view(torch.int16)[t, 0, 1, 300] ^= 0x1234

    # bytes it must not read
    used = {int(s) for r in range(3) for s in kw["indices"][r, 0, : int(lens[r])] if int(s) >= 0}
    P = kw["k_cache"].shape[1]
    unused = next(s for s in range(kw["k_cache"].shape[0] * P) if s not in used)
    buf, page, row, sc = _slot_bytes(kw, "k_cache", unused)
    pad_at = P * BYTES_PER_TOKEN  # first byte of the page padding
    for what, at in {"unused slot row": row + 7, "unused slot scale": sc + 2, "page padding": pad_at}.items():
        if at >= buf.shape[1]:
            continue
        got, want = changed(buf, page, at)
        assert torch.equal(got, base) and torch.equal(want, base), what


def test_plan_spreads_rows_over_programs():
    """The floor's split plan: at least one program per list and row, many programs per row when rows are few,
    chunks of whole blocks; q / out shares cover the row."""
    kw = build(Case(T=2, H=16, K=128, extra="c4", extra_K=512, seed=7))
    f = F.GatherFloor(kw["q"], num_sms=132, waves=8, **{k: v for k, v in kw.items() if k != "q"})
    assert f.s1 >= 1 and f.S - f.s1 >= 1 and f.S == (128 + 512) // 16
    assert f.c1 % 16 == 0 and f.c2 % 16 == 0 and f.QCH * f.S >= f.QW
    f = F.GatherFloor(kw["q"], num_sms=1, waves=1, **{k: v for k, v in kw.items() if k != "q"})
    assert f.S == 2


def test_make_layer_spec_rows_share_their_request_pages():
    """The spec_rows inputs (attn_inputs.make_layer, rows_per_req=6): rows of a request use its own pages only;
    SWA windows shift by one per row; c4 lists are each row's own top-512 of the request's entries; c128 lists are
    all of the request's entries, the same for every row of the request, -1 padded to ceil64."""
    assert AI.c128_topk(16384) == (128, 128) and AI.c128_topk(65536) == (512, 512)
    assert AI.c128_topk(131072) == (1024, 1024) and AI.c128_topk(1000) == (8, 64)
    g = torch.Generator().manual_seed(0)
    B, per = 12, 6
    for layout in ("swa128", "swa128+c4", "swa128+c128"):
        kw, _ = AI.make_layer(torch, layout, B, 1000 if layout.endswith("c128") else 4096, g, "cpu", per)
        idx = kw["indices"][:, 0].long()
        assert idx.shape == (B, 128) and (idx >= 0).all()
        assert (idx // 512 == (torch.arange(B) // per)[:, None]).all()       # the request's own two pages
        assert (idx[1:per] - idx[: per - 1] == 1).all()                          # one more token per row
        assert idx.max() < kw["k_cache"].shape[0] * 256
        if layout == "swa128":
            assert "extra_k_cache" not in kw
            continue
        e = kw["extra_indices_in_kvcache"][:, 0].long()
        n = kw["extra_topk_length"]
        if layout.endswith("c4"):
            assert e.shape == (B, 512) and (n == 512).all()
            assert (e // 1024 == (torch.arange(B) // per)[:, None]).all()
            assert not torch.equal(e[0].sort().values, e[1].sort().values)      # own top-k per row
            assert all(len(set(r.tolist())) == 512 for r in e)
        else:
            assert e.shape == (B, 64) and (n == 8).all() and (e[:, 8:] == -1).all()
            assert kw["extra_k_cache"].shape[1] == 2
            for r in range(B):
                assert sorted(e[r, :8].tolist()) == list(range(8 * (r // per), 8 * (r // per) + 8))
        assert e.max() < kw["extra_k_cache"].shape[0] * kw["extra_k_cache"].shape[1]
        q = torch.randn(B, 1, 8, 512, generator=g).to(torch.bfloat16)
        got, _ = run_floor(dict(kw, q=q))
        assert torch.equal(got, F.reference_checksum(q, **kw)), layout


def test_dry_run_lists_the_spec_rows_cases(tmp_path):
    """``--dry-run --cases spec_rows``: 6 x 1..64 request rows at H = 8/16/32/64 for SWA only, + c4, + c128 (the
    context's entries) and c128 at 64k / 128k, each with ours, the baselines and the gather floor; --impls without
    floor and the launch sweeps list no floor row. Nothing is written."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    res = tmp_path / "r.csv"

    def rows(*args):
        r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_attention.py"), "--dry-run", "--results",
                            str(res), *args], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        return [ln.split(",") for ln in r.stdout.splitlines() if ln.startswith("attention,")]

    got = rows("--cases", "spec_rows")
    cases = {r[1] for r in got}
    assert len(cases) == 20 and cases == set(BA.GROUPS["spec_rows"])
    for h in (8, 16, 32, 64):
        for suffix, layout, ctx in (("swa", "swa128", 16384), ("c4", "swa128+c4", 16384),
                                    ("c128", "swa128+c128", 16384), ("c128_64k", "swa128+c128", 65536),
                                    ("c128_128k", "swa128+c128", 131072)):
            mine = [r for r in got if r[1] == f"spec_h{h}_{suffix}"]
            assert {(r[4], r[5], r[7]) for r in mine} == {(layout, str(h), str(ctx))}
            for impl in ("ours-bf16", "flashmla", "gather-floor"):
                assert sorted(int(r[6]) for r in mine if r[3] == impl) == [6, 12, 24, 48, 96, 192, 384], impl
    assert not any(r[3] == "gather-floor" for r in rows("--cases", "spec_h16_c4", "--impls", "ours,flashmla"))
    assert not any(r[3] == "gather-floor" for r in rows("--cases", "launch_h16"))
    assert not res.exists()


def test_floor_share_table():
    """The closing table of a run: per case and shape, each impl's floor_share note at each B."""
    from dsv4_sm120.dev import bench_results as R

    def row(impl, B, notes):
        return R.make_row("attention", case="spec_h16_c4", impl=impl, layout="swa128+c4", heads=16, batch=B,
                          context=16384, date="2026-12-01T00:00:00+00:00", notes=notes, us=10.0)

    rows = [row("gather-floor", 6, "layers=4"), row("ours-bf16", 6, "layers=4; floor_share=0.730"),
            row("flashmla", 6, "layers=4; spread_us=0.1; floor_share=0.571"), row("ours-bf16", 96, "floor_share=0.559")]
    text = BA.floor_share_table(rows)
    assert "spec_h16_c4 (swa128+c4, H=16, context 16384):" in text
    assert "| ours-bf16 | 0.730 | 0.559 |" in text and "| flashmla | 0.571 | - |" in text
    assert "gather-floor |" not in text
    assert BA.floor_share_table(rows[:1]) == ""


_FLOOR_COMPILE = r"""
import json, sys
sys.path.insert(0, "bench")
import attn_floor as F
from dsv4_sm120.dev.sass import compile_inspect, hot_loop_ops, kernel_source
fn = F.gather_floor_kernel
cst = dict(HAS_EXTRA=True, BLOCK_N=16, BLOCK_Q=F.Q_BLOCK)
sig = {n: ("*i64" if n == "cs_ptr" else "*i32" if n.endswith("_ptr") else "i32") for n in fn.arg_names if n not in cst}
# the launch's 16-divisible arguments: pointers, q / out row words and shares, page words, chunks, pages of 256 / 64
div = [n for n in sig if n.endswith("_ptr") or n in ("QW", "QCH", "PBW1", "PBW2", "P1", "c1", "c2")]
out = {}
for cap in (90, 120):
    try:
        k, sass, res = compile_inspect(kernel_source(fn, sig, cst, div), cap, {"num_warps": 4})
        ops = [o[1] for o in hot_loop_ops(sass)]
        out[f"sm{cap}"] = dict(res, ldg128=ops.count("LDG.E.128"), ldg64=ops.count("LDG.E.64"),
                               shared=sum(o.startswith(("STS", "LDS", "BAR")) for o in ops))
    except Exception as e:
        out[f"sm{cap}"] = {"error": f"{type(e).__name__}: {e}"[:400]}
print("RESULT" + json.dumps(out))
"""


def test_gather_loads_compile_to_vector_loads_for_sm90_and_sm120():
    """Compiled for sm_90 and sm_120 (no GPU), the floor's gather loop reads each block's 576-byte rows with 16-byte
    loads (4 per thread for the first 512 bytes of 16 tokens over 128 threads) and the 8-byte scale rows with 8-byte
    loads, without shared memory or spills: a gather at full width, as the decode kernel's."""
    out = gpu_compile_result(_FLOOR_COMPILE)
    for name, v in out.items():
        assert "error" not in v, (name, v)
        assert v["ldg128"] >= 4 and v["ldg64"] >= 1 and v["shared"] == 0, (name, v)
        if "stack" in v:
            assert v["stack"] == 0, (name, v)
