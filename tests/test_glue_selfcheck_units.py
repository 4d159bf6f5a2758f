"""dsv4_sm120.sglang_glue.selfcheck's parts, each against what its documentation promises (CPU, this process):

* the attention case is the documented call: the caches drawn from the case's seed in the real page layout (SWA
  256-token pages, c4 64, c128 2) with the real candidate counts, one invalid slot per row, per-row lengths, a sink,
  on the device asked for; the caches shared through ``pool``;
* the candidate counts (c128 from the context length), the rows compared (first two, last two, spread), the row
  text of the log lines, SGLang 0.5.23's capture batch sizes (written out from its
  ``generate_decode_cuda_graph_batch_sizes``), the runners of a server and their rows;
* the stock reference is SGLang's torch path where SGLang imports and the float64 reference where it does not;
* the MoE check's inputs (two tokens, top-k distinct experts, weights in [0, 1), the layer's own tensors) and its
  messages; the first-call check and its skip; the timing command's options, lines and exit code.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import types

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover
    pytest.skip("CPU tests need TRITON_INTERPRET=1 (set before triton is imported)", allow_module_level=True)

import torch  # noqa: E402

from dsv4_sm120.attention.cache import random_cache  # noqa: E402
from dsv4_sm120.attention.reference import rel_fro, sparse_mla_decode_ref  # noqa: E402
from dsv4_sm120.sglang_glue import attention as A  # noqa: E402
from dsv4_sm120.sglang_glue import selfcheck as S  # noqa: E402
from glue_fixtures import AttnLayer, fresh_glue, toy_model  # noqa: E402

PAGES = {"swa": 256, "swa_c4": 64, "swa_c128": 2}
SMALL = {"K1": 16, "swa_c4": 16, "swa_c128": 8}


@pytest.fixture
def fresh(monkeypatch):
    yield from fresh_glue(monkeypatch)


# ---------------------------------------------------------------------------- the attention case


def _documented_case(layout, T, H, seed, sz):
    """The case as the module documents it, drawn in order from one generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    K1 = sz["K1"]
    n_main = max(2, math.ceil(2 * K1 / 256))
    kw = {"k_cache": random_cache(n_main, 256, generator=g, mode="bytes").view}
    idx = torch.randint(0, n_main * 256, (T, K1), generator=g, dtype=torch.int32)
    idx[:, K1 - 1] = -1
    kw.update(indices=idx.view(T, 1, K1), topk_length=torch.full((T,), K1, dtype=torch.int32))
    if layout != "swa":
        page, K2 = PAGES[layout], sz[layout]
        pages = math.ceil(2 * K2 / page)
        kw["extra_k_cache"] = random_cache(pages, page, generator=g, mode="bytes").view
        e = torch.randint(0, pages * page, (T, K2), generator=g, dtype=torch.int32)
        kw["extra_indices_in_kvcache"] = e.view(T, 1, K2)
        kw["extra_topk_length"] = torch.tensor([K2 - 1 - t % 3 for t in range(T)], dtype=torch.int32)
    q = torch.randn(T, 1, H, 512, generator=g).to(torch.bfloat16)
    kw["attn_sink"] = torch.randn(H, generator=g)
    return q, kw, n_main


@pytest.mark.parametrize("layout,T,sz", [("swa", 3, SMALL), ("swa_c4", 5, SMALL), ("swa_c128", 4, SMALL),
                                         ("swa_c4", 2, {"K1": 300, "swa_c4": 40})])
def test_the_attention_case_is_the_documented_call(layout, T, sz):
    H, seed = 8, 11
    c = S.attention_case(layout, T, H, "cpu", seed=seed, sizes=sz)
    q, kw, n_main = _documented_case(layout, T, H, seed, sz)
    assert torch.equal(c["q"], q) and c["q"].dtype == torch.bfloat16
    assert set(c["kw"]) == set(kw) | {"head_dim_v", "softmax_scale"}
    for k, v in kw.items():
        got = c["kw"][k]
        assert got.dtype == v.dtype and got.shape == v.shape, k
        if k.endswith("k_cache"):                    # e4m3 bytes with NaN padding: compare the bytes
            got, v = got.view(torch.uint8), v.view(torch.uint8)
        assert torch.equal(got, v), k
    assert c["kw"]["head_dim_v"] == 512 and c["kw"]["softmax_scale"] == pytest.approx(1 / math.sqrt(512))
    assert c["K1"] == sz["K1"] and c["K2"] == (0 if layout == "swa" else sz[layout])
    assert c["kw"]["k_cache"].shape[:2] == (n_main, 256)
    assert (c["kw"]["indices"][:, 0, -1] == -1).all() and (c["kw"]["indices"][:, 0, :-1] >= 0).all()
    if layout != "swa":
        assert c["kw"]["extra_k_cache"].shape[1] == PAGES[layout]
    # the default seed is 0, the default sizes those of the device
    d = S.attention_case(layout, T, H, "cpu")
    q0, kw0, _ = _documented_case(layout, T, H, 0, SMALL)
    assert torch.equal(d["q"], q0) and torch.equal(d["kw"]["indices"], kw0["indices"])


def test_the_case_is_built_on_the_device_asked_for_and_shares_its_caches():
    c = S.attention_case("swa_c128", 3, 8, torch.device("meta"), sizes=SMALL)
    tensors = [c["q"]] + [v for v in c["kw"].values() if isinstance(v, torch.Tensor)]
    assert len(tensors) == 8 and all(t.device.type == "meta" for t in tensors)
    pool = {}
    a = S.attention_case("swa_c4", 2, 8, "cpu", seed=1, sizes=SMALL, pool=pool)
    b = S.attention_case("swa_c4", 6, 8, "cpu", seed=2, sizes=SMALL, pool=pool)
    assert a["kw"]["k_cache"] is b["kw"]["k_cache"] and a["kw"]["extra_k_cache"] is b["kw"]["extra_k_cache"]
    assert set(pool) == {(2, 256, "cpu"), (1, 64, "cpu")}
    assert b["kw"]["indices"].shape == (6, 1, 16)
    m = S.attention_case("swa_c4", 2, 8, torch.device("meta"), seed=1, sizes=SMALL, pool=pool)
    assert m["kw"]["k_cache"].device.type == "meta" and len(pool) == 4


def test_candidate_counts_of_the_device_and_the_context(monkeypatch):
    assert [S.c128_topk(n) for n in (1, 8192, 8193, 1 << 20, "65536")] == [64, 64, 128, 8192, 512]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cuda = torch.device("cuda", 0)
    assert S._sizes(cuda) == {"K1": 128, "swa_c4": 512, "swa_c128": 64}
    assert S._sizes(cuda, 100_000) == {"K1": 128, "swa_c4": 512, "swa_c128": 832}
    assert S._sizes(torch.device("cpu"), 100_000) == SMALL and S._sizes("cpu") == SMALL
    for v, interp in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv("TRITON_INTERPRET", v)
        assert S._interpreting() is interp
        assert S._sizes(cuda) == (SMALL if interp else {"K1": 128, "swa_c4": 512, "swa_c128": 64})
    monkeypatch.delenv("TRITON_INTERPRET")
    assert S._interpreting() is False and S._sizes(cuda)["K1"] == 128


def test_the_rows_compared_and_their_text():
    assert S.sample_rows(1) == [0] and S.sample_rows(8) == list(range(8))
    assert S.sample_rows(9) == [0, 1, 3, 4, 5, 6, 7, 8]
    assert S.sample_rows(20) == [0, 1, 5, 8, 11, 14, 18, 19]
    assert S.sample_rows(1000) == [0, 1, 201, 400, 599, 798, 998, 999]
    assert S.SAMPLE_ROWS == 8 and S.ROWS == 2
    assert S._rows_text([3, 1, 2]) == "1,2,3"
    assert S._rows_text(range(1, 13)) == "1,2,3,4,5,6,7,8,9,10,11,12"
    assert S._rows_text(range(20, 0, -1)) == "1,2,3,4,5,6,...,20 (20 counts)"
    kw = {"indices": torch.arange(4), "topk_length": torch.arange(4) * 2, "extra_indices_in_kvcache": None,
          "extra_topk_length": torch.arange(4) + 10, "k_cache": "cache", "attn_sink": torch.ones(3)}
    out = S._row_slice(kw, torch.tensor([3, 0]))
    assert out["indices"].tolist() == [3, 0] and out["topk_length"].tolist() == [6, 0]
    assert out["extra_topk_length"].tolist() == [13, 10] and out["extra_indices_in_kvcache"] is None
    assert out["k_cache"] == "cache" and out["attn_sink"] is kw["attn_sink"] and kw["indices"].shape == (4,)


@pytest.mark.parametrize("layout", ["swa", "swa_c4", "swa_c128"])
def test_the_stock_reference_is_sglangs_path_or_the_float64_one(layout, monkeypatch):
    c = S.attention_case(layout, 3, 8, "cpu", seed=5, sizes=SMALL)
    ref = sparse_mla_decode_ref(c["q"], **{k: v for k, v in c["kw"].items() if k != "head_dim_v"})[0]
    stock = S.stock_reference(c["q"], c["kw"])
    assert stock.shape == ref.shape and rel_fro(stock, ref) < 1e-2
    monkeypatch.setitem(sys.modules, "sglang.kernels.ops.attention.flash_mla_sm120", None)   # SGLang absent
    own = S.stock_reference(c["q"], c["kw"])
    assert own.dtype == ref.dtype and torch.equal(own, ref)


def test_capture_batch_sizes_are_sglangs():
    """SGLang 0.5.23 ``generate_decode_cuda_graph_batch_sizes`` (srt/arg_groups/cuda_graph_hook.py), written out."""
    assert S.default_capture_bs(16, False) == [1, 2, 4, 8, 12, 16]
    assert S.default_capture_bs(10, False) == [1, 2, 4, 8, 10]
    assert S.default_capture_bs(300, False) == [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + [272, 288, 300]
    assert S.default_capture_bs(600, False)[-7:] == [464, 480, 496, 512, 544, 576, 600]
    assert S.default_capture_bs(1, False) == [1] and S.default_capture_bs(3, True) == [1, 2, 3]
    assert S.default_capture_bs(100, True) == (list(range(1, 9)) + list(range(10, 33, 2)) + [40, 44, 48, 52, 56,
                                               60, 64, 72, 80, 88, 96, 100])
    assert S.default_capture_bs(300, True)[-5:] == [248, 256, 272, 288, 300]
    assert S.default_capture_bs(9, True) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert S.runner_rows([2, 1, 2], 1) == [("decode", [1, 2], None)]
    assert S.runner_rows([1], 0) == [("decode", [1], None)]
    assert S.runner_rows([3], 2) == [("target-verify", [6], None), ("draft decode", [3], ["swa"]),
                                     ("draft extend", [6], ["swa"])]


# ---------------------------------------------------------------------------- the runner's model


_Attn = AttnLayer


def _model(*layers):
    return toy_model(*layers, other=True)          # with a module that has heads but no compress_ratio


def test_the_heads_layouts_device_and_context_of_a_runner(monkeypatch):
    m = _model(_Attn(16, 0), _Attn(16, 4), _Attn(8, 128))
    assert S.model_heads(m) == [8, 16] and S.model_heads(None) == []
    assert S.model_layouts(m) == ["swa", "swa_c4", "swa_c128"]
    assert S.model_layouts(_model(_Attn(16, 0))) == ["swa"]
    assert S.model_layouts(_model(_Attn(16, 128), _Attn(16, 4))) == ["swa_c4", "swa_c128"]
    assert S.model_layouts(_model(_Attn(16, 0), _Attn(16, 8))) == ["swa", "swa_c4", "swa_c128"]
    assert S.model_layouts(_model()) == ["swa", "swa_c4", "swa_c128"] == S.model_layouts(None)
    ns = types.SimpleNamespace
    assert S._runner_device(ns(device="cuda", gpu_id=3)) == torch.device("cuda", 3)
    assert S._runner_device(ns(device="cuda", gpu_id="2")) == torch.device("cuda", 2)
    assert S._runner_device(ns(device="cuda")) == torch.device("cuda")
    assert S._runner_device(ns(device="cpu", gpu_id=3)) == torch.device("cpu")
    assert S._runner_device(ns(gpu_id=1)) == torch.device("cuda", 1)
    assert S._runner_device(None) == torch.device("cuda")
    assert S._context_len(ns(model_config=ns(context_len=4096), server_args=ns(context_length=8))) == 4096
    assert S._context_len(ns(model_config=ns(context_len=0), server_args=ns(context_length=8192))) == 8192
    assert S._context_len(ns(model_config=ns(context_length=2048))) == 2048
    assert S._context_len(ns(model_config=ns(context_len=-1), server_args=ns(context_len="9"))) is None
    assert S._context_len(ns()) is None


def test_run_for_runner_passes_the_model_and_rows(fresh, caplog):
    seen = []
    fresh.setattr(S, "run", lambda heads, device, rows=None, context_len=None, label="", layouts=None:
                  seen.append((heads, device, rows, context_len, label, layouts)) or ["cases"])
    ns = types.SimpleNamespace
    mr = ns(model=_model(_Attn(8, 0), _Attn(8, 4)), device="cpu", model_config=ns(context_len=70000))
    assert S.run_for_runner(mr, rows=[1, 2], label="decode") == ["cases"]
    assert S.run_for_runner(mr) == ["cases"]
    assert seen == [([8], torch.device("cpu"), [1, 2], 70000, "decode", ["swa", "swa_c4"]),
                    ([8], torch.device("cpu"), None, 70000, "", None)]
    assert S.run_for_runner(None) == []
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120"):
        assert S.run_for_runner(ns(model=_model(), device="cpu"), rows=[1]) == []
        assert S.run_for_runner(ns(model=None, device="cpu"), rows=[1]) == []
    assert caplog.messages == ["dsv4_sm120 self-check: not run (no attention layer with n_local_heads found in the "
                               "model); our kernels serve unchecked"]          # once per process
    fresh.setenv("DSV4_SM120_SELFCHECK", "0")
    assert S.run_for_runner(mr, rows=[1]) == [] and len(seen) == 2


def test_the_first_call_check_and_its_skip_inside_a_capture(fresh, caplog):
    seen = []
    fresh.setattr(S, "run", lambda heads, device, **k: seen.append((heads, device)) or [])
    S.first_call(torch.zeros(1, 1, 8, 512), 8)                       # not on a GPU: nothing
    cuda_q = types.SimpleNamespace(device=torch.device("cuda", 1))
    fresh.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120"):
        S.first_call(cuda_q, 8)
        S.first_call(cuda_q, 8)
    assert seen == [] and caplog.messages == [
        "dsv4_sm120 self-check: not run (the first attention call is inside CUDA-graph capture); our kernels serve "
        "unchecked"]
    fresh.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    S.first_call(cuda_q, 16)
    assert seen == [([16], torch.device("cuda", 1))]
    S._state["attention"] = []                                        # done: once per process
    S.first_call(cuda_q, 16)
    assert len(seen) == 1 and S.done()
    S.reset()
    assert not S.done() and S._state["skipped_logged"] is False
    caplog.clear()
    fresh.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120"):
        S.first_call(cuda_q, 8)
    assert len(caplog.messages) == 1                                   # reset: the skip is logged again


def test_reset_forgets_the_moe_fallback(fresh):
    S._switch_moe_path("bf16", "w" * 300)
    S._state["skipped_logged"] = True
    assert S.moe_fallback_path() == "bf16" and S.moe_fallback_count() == 1 and S._state["moe_fallback_why"] == "w" * 200
    assert os.environ["DSV4_SM120_MOE_PATH"] == "bf16"
    S._switch_moe_path("fp4")
    assert S.moe_fallback_count() == 2 and S._state["moe_fallback_why"] == ""
    S.reset()
    assert S.moe_fallback_path() is None and S.moe_fallback_count() == 0 and not S.moe_fallback_active()
    assert not any(k in S._state for k in ("moe_fallback", "moe_fallbacks", "moe_fallback_why"))
    assert S.results() == {"attention": None, "moe": None} and S._state["checked"] == {}
    S._state["moe_fallback"] = ""
    assert S.moe_fallback_path() is None


def test_adopting_another_ranks_moe_path(fresh):
    assert S.adopt_moe_path("bf16", "rank 1: " + "x" * 300) is True
    assert S.moe_fallback_path() == "bf16" and os.environ["DSV4_SM120_MOE_PATH"] == "bf16"
    assert S._state["moe_fallback_why"] == ("rank 1: " + "x" * 300)[:200] and S.moe_fallback_count() == 0
    assert S.adopt_moe_path("fp4", "rank 2") is False and S.moe_fallback_path() == "bf16"


# ---------------------------------------------------------------------------- the MoE check's inputs and lines


def _layer(E=6, two_i=64, h2=32, top_k=None, swiglu_limit=None):
    lay = types.SimpleNamespace(
        w13_weight=types.SimpleNamespace(shape=(E, two_i, h2), data="w13", device=torch.device("cpu")),
        w13_weight_scale=types.SimpleNamespace(data="s13"), w2_weight=types.SimpleNamespace(data="w2"),
        w2_weight_scale=types.SimpleNamespace(data="s2"), _dsv4_w13_scale_2="g13", _dsv4_w2_scale_2="g2")
    lay.moe_runner_config = types.SimpleNamespace(top_k=top_k, swiglu_limit=swiglu_limit)
    return lay


@pytest.mark.parametrize("E,top_k,k", [(6, None, 2), (6, 8, 6), (6, 3, 3), (6, 0, 2), (1, None, 1)])
def test_the_moe_check_runs_two_tokens_on_distinct_experts(monkeypatch, E, top_k, k):
    import dsv4_sm120.moe.reference as R

    got = {}

    def reference(x, w13, s13, g13, w2, s2, g2, tw, ids, swiglu_limit=None):
        got["ref"] = (w13, s13, g13, w2, s2, g2, swiglu_limit)
        return x.double()[:, :4] * 0 + 1

    monkeypatch.setattr(R, "moe_reference", reference)

    def run(x, tw, ids):
        got["x"], got["tw"], got["ids"] = x, tw, ids
        return torch.full((2, 4), 1.5)

    lay = _layer(E=E, top_k=top_k, swiglu_limit=7.0)
    err = S._moe_err(lay, run, torch.device("cpu"))
    assert err == pytest.approx(0.5)
    g = torch.Generator().manual_seed(7)
    assert torch.equal(got["x"], torch.randn(2, 64, generator=g).to(torch.bfloat16))
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(2)]).to(torch.int32)
    assert got["ids"].dtype == torch.int32 and torch.equal(got["ids"], ids)
    assert all(len(set(r.tolist())) == k for r in got["ids"]) and got["ids"].shape == (2, k)
    assert got["tw"].dtype == torch.float32 and torch.equal(got["tw"], torch.rand(2, k, generator=g))
    assert got["ref"] == ("w13", "s13", "g13", "w2", "s2", "g2", 7.0)
    monkeypatch.setattr(R, "rel_err", lambda out, ref: 0.0)
    meta = S._moe_err(lay, lambda x, tw, ids: got.update(dev=(x.device, tw.device, ids.device)) or
                      torch.full((2, 4), 1.0), torch.device("meta"))
    assert got["dev"] == (torch.device("meta"),) * 3 and meta == 0.0


def test_the_moe_check_lines_on_one_rank(fresh, caplog):
    import dsv4_sm120.moe.fused_moe as F

    fresh.setattr(F, "default_path", lambda device: "fp4")
    fresh.setattr(S, "_moe_err", lambda layer, run_fn, device: run_fn())
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        res = S.check_moe(_layer(), lambda: 0.125, torch.device("cpu"))
    assert res == {"kernel": "moe", "shape": "M=2 E=6 H=64 I=32", "tol": 0.3, "path": "fp4", "err": 0.125,
                   "ok": True, "error": None, "fallback": None}
    assert len(caplog.messages) == 1 and caplog.messages[0].startswith(
        "dsv4_sm120 self-check: MoE ok (M=2 E=6 H=64 I=32, path fp4, error 0.12) in ")
    assert caplog.messages[0].endswith(" s")
    S.reset()
    caplog.clear()
    errs = iter([0.5, 0.25])
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        res = S.check_moe(_layer(), lambda: next(errs), torch.device("cpu"))
    assert res["fallback"] == "bf16" and res["fallback_err"] == 0.25 and res["fallback_error"] is None
    assert res["error"] == "relative error 0.5 > tolerance 0.3"
    assert caplog.messages == [
        "dsv4_sm120 self-check: our MoE kernel (path fp4) FAILED at M=2 E=6 H=64 I=32: relative error 0.5 > tolerance "
        "0.3; trying its bf16 path",
        "dsv4_sm120 self-check: our MoE kernel serves on its bf16 path in this process (error 0.25)"]
    S.reset()

    def fails():
        raise RuntimeError("illegal instruction\n" + "x" * 400)

    with pytest.raises(Exception) as e:
        S.check_moe(_layer(), fails, torch.device("cpu"))
    assert str(e.value) == ("dsv4_sm120 self-check: our MoE kernel fails at M=2 E=6 H=64 I=32 (path fp4: "
                            "RuntimeError: illegal instruction\n" + "x" * (300 - len("illegal instruction\n")) +
                            "; path bf16: RuntimeError: illegal instruction\n" + "x" * (300 - 20) +
                            "); restart with DSV4_SM120_MOE_BACKEND=flashinfer_cutlass")
    assert S.results()["moe"]["fallback_error"].startswith("RuntimeError: illegal instruction")
    S.reset()
    fresh.setenv("DSV4_SM120_SELFCHECK", "0")
    assert S.check_moe(_layer(), fails, torch.device("cpu")) is None


class _Ranks:
    def __init__(self, size, answers):
        self.size, self.name, self.answers, self.topics = size, "tp", answers, []

    def agree(self, topic, status=None, timeout=None):
        self.topics.append(topic)
        return [status] + list(self.answers.pop(0))


def test_the_moe_check_agreed_by_the_ranks(fresh, caplog):
    import dsv4_sm120.moe.fused_moe as F
    from dsv4_sm120.sglang_glue import allreduce as G

    fresh.setattr(F, "default_path", lambda device: "bf16")
    fresh.setattr(S, "_moe_err", lambda layer, run_fn, device: 0.01)
    grp = _Ranks(3, [[None, "RuntimeError: x"], [None, None]])
    fresh.setattr(G, "tp_group", lambda: grp)
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        res = S.check_moe(_layer(), None, torch.device("cpu"))
    assert grp.topics == ["MoE self-check, path bf16", "MoE self-check, path fp4"]
    assert res["ok"] and res["fallback"] == "fp4" and S.moe_fallback_path() == "fp4"
    assert S._state["moe_fallback_why"] == "self-check on rank 2 (RuntimeError: x)"
    assert caplog.messages == [
        "dsv4_sm120 self-check: our MoE kernel (path bf16) failed at M=2 E=6 H=64 I=32 on rank 2 (RuntimeError: x); "
        "agreed by all 3 ranks: every rank tries its fp4 path",
        "dsv4_sm120 self-check: our MoE kernel serves on its fp4 path in this process (error 0.01) (agreed by all 3 "
        "ranks)"]
    S.reset()
    caplog.clear()
    grp = _Ranks(2, [[None]])
    fresh.setattr(G, "tp_group", lambda: grp)
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        S.check_moe(_layer(), None, torch.device("cpu"))
    assert caplog.messages[0].endswith(" s (agreed by all 2 ranks)")
    S.reset()
    grp = _Ranks(2, [["E1"], ["E2"]])
    fresh.setattr(G, "tp_group", lambda: grp)
    with pytest.raises(Exception) as e:
        S.check_moe(_layer(), None, torch.device("cpu"))
    assert str(e.value) == ("dsv4_sm120 self-check: our MoE kernel fails at M=2 E=6 H=64 I=32 (path bf16: rank 1 "
                            "(E1); path fp4: rank 1 (E2)), every rank stops (agreed by all 2 ranks); restart with "
                            "DSV4_SM120_MOE_BACKEND=flashinfer_cutlass")


def test_a_serving_failure_is_logged_with_both_paths(fresh, caplog):
    import dsv4_sm120.moe.fused_moe as F

    fresh.setattr(F, "default_path", lambda device: "fp4")
    with caplog.at_level(logging.ERROR, logger="dsv4_sm120"):
        S.moe_step_aside("M=4 E=6", "RuntimeError: x", torch.device("cpu"))
    assert caplog.messages == ["dsv4_sm120: our MoE kernel (path fp4) failed while serving at M=4 E=6: RuntimeError: "
                               "x; this process serves on its bf16 path from now on"]


# ---------------------------------------------------------------------------- the timing command


def test_the_timing_commands_options(fresh, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    with pytest.raises(SystemExit) as e:
        S.main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for phrase in (
            "usage: python -m dsv4_sm120.sglang_glue.selfcheck",
            "Run the startup self-check of our attention kernel (every launch the CUDA-graph capture rows reach) for "
            "given heads, capture sizes and draft tokens, without SGLang (float64 reference), and print what it ran "
            "and its seconds. Run it twice: the second run is the warm-Triton-cache cost of a server start.",
            "--time print the seconds per case and in total (the default)",
            "--heads HEADS per-rank query heads, comma-separated (64 / TP; default 16)",
            "--max-bs MAX_BS --cuda-graph-max-bs-decode (default 16, the serve scripts' MAX_RUNNING)",
            "--capture-bs CAPTURE_BS the capture batch sizes, comma-separated (default: SGLang's schedule up to "
            "--max-bs)",
            "--draft-tokens DRAFT_TOKENS MTP draft tokens per request (0: no speculation; SGLang's default with MTP "
            "is 4)",
            "--context-len CONTEXT_LEN context length (sets the c128 candidates; default: 64 candidates)",
            "--device DEVICE"):
        assert phrase in out, phrase


def _fake_run(seen, fail=()):
    def run(heads, device, rows=None, context_len=None, label="", layouts=None):
        seen.append(dict(heads=heads, device=device, rows=rows, context_len=context_len, label=label, layouts=layouts))
        cases = S._state["attention"] or []
        for i, T in enumerate(rows[:2]):
            ok = (label, T) not in fail
            cases.append({"ok": ok, "shape": f"swa T={T} H={heads[0]}", "rows": [T], "err": 0.0123 if ok else None,
                          "seconds": 0.5, "error": None if ok else "RuntimeError: x"})
        S._state["attention"] = cases
        return cases
    return run


def test_the_timing_command_on_a_gpu_with_its_defaults(fresh, capsys, monkeypatch):
    seen = []
    fresh.setattr(S, "run", _fake_run(seen))
    fresh.setattr(A, "log_decisions", lambda: None)
    sync = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: f"GPU {d}")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: sync.append(d))
    assert S.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    dev = torch.device("cuda", 3)
    assert seen == [dict(heads=[16], device=dev, rows=[1, 2, 4, 8, 12, 16], context_len=None, label="decode",
                         layouts=None)]
    assert sync == [dev]
    assert out[0] == "device GPU cuda:3; heads [16]; capture batch sizes [1, 2, 4, 8, 12, 16]; draft tokens 0; context -"
    assert out[1].startswith("decode: rows 1,2,4,8,12,16: 2 launches in ") and out[1].endswith(" s")
    assert out[2] == "  ok   swa T=1 H=16" + " " * 46 + " rows 1" + " " * 28 + "err 0.012    0.500 s"
    assert out[-1].startswith("self-check total: 2 launches, 0 failed, ")
    seen.clear()
    S.reset()
    assert S.main(["--device", "cuda:1", "--max-bs", "3", "--draft-tokens", "2", "--context-len", "9000",
                   "--heads", "8, 16,"]) == 0
    out = capsys.readouterr().out
    assert [s["rows"] for s in seen] == [[2, 4, 6], [1, 2, 3], [2, 4, 6]]
    assert [s["label"] for s in seen] == ["target-verify", "draft decode", "draft extend"]
    assert [s["layouts"] for s in seen] == [None, ["swa"], ["swa"]]
    assert {str(s["device"]) for s in seen} == {"cuda:1"} and {s["context_len"] for s in seen} == {9000}
    assert seen[0]["heads"] == [8, 16]
    assert "capture batch sizes [1, 2, 3]; draft tokens 2; context 9000" in out
    assert "draft decode: rows 1,2,3: 2 launches in " in out


def test_the_timing_command_reports_a_failure(fresh, capsys):
    seen = []
    fresh.setattr(S, "run", _fake_run(seen, fail={("decode", 2)}))
    fresh.setattr(A, "log_decisions", lambda: None)
    assert S.main(["--device", "cpu", "--capture-bs", "2,1", "--draft-tokens", "1"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "device cpu; heads [16]; capture batch sizes [2, 1]; draft tokens 1; context -"
    assert seen[0]["rows"] == [1, 2] and seen[0]["device"] == torch.device("cpu")
    assert out[3] == "  FAIL swa T=2 H=16" + " " * 46 + " rows 2" + " " * 28 + "err None     0.500 s  RuntimeError: x"
    assert out[-1].startswith("self-check total: 2 launches, 1 failed, ")


def test_the_runner_parts_a_stand_in_may_lack(fresh):
    ns = types.SimpleNamespace
    assert S._context_len(ns(model_config=ns(context_len=0, context_length=0))) is None
    assert S._context_len(ns(model_config=ns(context_len=1))) == 1
    assert S.run_for_runner(ns(device="cpu"), rows=[1]) == []         # no model attribute: nothing to check
    seen = {}
    fresh.setattr(S, "_moe_err", lambda layer, run_fn, device: seen.setdefault("device", device) and 0.0)
    fresh.setattr(__import__("dsv4_sm120.moe.fused_moe", fromlist=["x"]), "default_path", lambda d: "fp4")
    S.check_moe(_layer(), None, torch.device("meta"))
    assert seen["device"] == torch.device("meta")


def test_the_moe_inputs_of_a_layer_without_a_runner_config(monkeypatch):
    import dsv4_sm120.moe.reference as R

    got = {}
    monkeypatch.setattr(R, "moe_reference", lambda *a, swiglu_limit="unset": got.update(limit=swiglu_limit) or
                        torch.ones(2, 4, dtype=torch.float64))
    lay = _layer()
    del lay.moe_runner_config
    S._moe_err(lay, lambda x, tw, ids: got.update(k=ids.shape[1]) or torch.ones(2, 4), torch.device("cpu"))
    assert got == {"k": 2, "limit": None}
    lay.moe_runner_config = types.SimpleNamespace()
    S._moe_err(lay, lambda x, tw, ids: got.update(k=ids.shape[1]) or torch.ones(2, 4), torch.device("cpu"))
    assert got == {"k": 2, "limit": None}


def test_the_timing_commands_schedule_and_seconds(fresh, capsys):
    seen = []
    fresh.setattr(S, "run", _fake_run(seen))
    fresh.setattr(A, "log_decisions", lambda: None)
    for draft, rows in ((1, [1, 2, 4, 8, 10]), (2, [2, 4, 6, 8, 10, 12, 14, 16, 20])):
        seen.clear()
        S.reset()
        S.main(["--device", "cpu", "--max-bs", "10", "--draft-tokens", str(draft)])
        assert seen[0]["rows"] == rows, draft
    out = capsys.readouterr().out
    secs = [float(x.split(" launches in ")[1].split(" s")[0]) for x in out.splitlines() if " launches in " in x]
    total = [float(x.split(", ")[-1].split(" s")[0]) for x in out.splitlines() if x.startswith("self-check total")]
    assert secs and all(0 <= s < 60 for s in secs + total), out
    S.reset()
    fresh.setattr(S, "run", lambda *a, **k: S._state.update(attention=[
        {"ok": True, "shape": "s", "rows": [1], "err": 1.5e-05, "seconds": 0.0, "error": None}]) or
        S._state["attention"])
    S.main(["--device", "cpu", "--capture-bs", "1"])
    assert "err 1.5e-05 " in capsys.readouterr().out


def test_the_case_sizes_come_from_its_device(fresh):
    seen = []
    fresh.setattr(S, "_sizes", lambda device, context_len=None: seen.append(device) or SMALL)
    S.attention_case("swa", 1, 8, "cpu")
    assert seen == [torch.device("cpu")]


def test_the_stock_reference_reads_the_lengths_and_the_sink():
    c = S.attention_case("swa_c4", 3, 8, "cpu", seed=9, sizes=SMALL)
    kw = dict(c["kw"], topk_length=torch.tensor([4, 9, 16], dtype=torch.int32))
    lse = sparse_mla_decode_ref(c["q"], **kw)[1]                  # [T, H, 1]: a sink of that size halves the output
    kw["attn_sink"] = lse.mean(dim=0).reshape(-1).float()
    ref = sparse_mla_decode_ref(c["q"], **kw)[0]
    assert rel_fro(S.stock_reference(c["q"], kw), ref) < 1e-2
    for k in ("topk_length", "attn_sink"):           # each matters here: dropping it moves the result
        other = sparse_mla_decode_ref(c["q"], **dict(kw, **{k: None}))[0]
        assert rel_fro(other, ref) > 5e-2, k


def test_a_row_slice_takes_every_per_row_tensor():
    kw = {"indices": torch.arange(4), "topk_length": None, "extra_indices_in_kvcache": torch.arange(4) * 10,
          "extra_topk_length": None}
    out = S._row_slice(kw, torch.tensor([2]))
    assert out["extra_indices_in_kvcache"].tolist() == [20] and out["indices"].tolist() == [2]
    assert S._rows_text(range(1, 14)) == "1,2,3,4,5,6,...,13 (13 counts)"


def test_the_moe_tolerance_bound_is_inclusive_and_the_lines_time_it(fresh, caplog):
    import dsv4_sm120.moe.fused_moe as F

    fresh.setattr(F, "default_path", lambda device: "fp4")
    fresh.setattr(S, "_moe_err", lambda layer, run_fn, device: 0.3)
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        assert S.check_moe(_layer(), None, torch.device("cpu"))["ok"] is True
    assert float(caplog.messages[0].split(") in ")[1].split(" s")[0]) < 60


def test_two_ranks_log_the_agreed_switch(fresh, caplog):
    import dsv4_sm120.moe.fused_moe as F
    from dsv4_sm120.sglang_glue import allreduce as G

    fresh.setattr(F, "default_path", lambda device: "fp4")
    fresh.setattr(S, "_moe_err", lambda layer, run_fn, device: 0.01)
    fresh.setattr(G, "tp_group", lambda: _Ranks(2, [["RuntimeError: y"], [None]]))
    with caplog.at_level(logging.ERROR, logger="dsv4_sm120"):
        S.check_moe(_layer(), None, torch.device("cpu"))
    assert caplog.messages == ["dsv4_sm120 self-check: our MoE kernel (path fp4) failed at M=2 E=6 H=64 I=32 on rank 1 "
                               "(RuntimeError: y); agreed by all 2 ranks: every rank tries its bf16 path"]
