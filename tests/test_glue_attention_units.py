"""dsv4_sm120.sglang_glue.attention's call paths and decisions in this process, against stand-ins that record what
they are given: SGLang's sm_120 module (FlashInfer decode / prefill, the torch path, the Triton path, the stock
dispatcher) and the machine profile. Expectations: which path answers each call and with which arguments (the
argument order of SGLang 0.5.23's functions, the 64-head padding FlashInfer's decode kernel needs, the real heads
where it takes them), our kernel's arguments (real heads and sink, the route's launch and QK), the planted faults
on the ranks named, the head count the model asks for, and the routes a profile gives."""

from __future__ import annotations

import logging
import os
import sys
import types

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover
    pytest.skip("CPU tests need TRITON_INTERPRET=1 (set before triton is imported)", allow_module_level=True)

import torch  # noqa: E402

from dsv4_sm120 import rank_agreement as RA  # noqa: E402
from dsv4_sm120.attention.config import Device  # noqa: E402
from dsv4_sm120.sglang_glue import attention as A  # noqa: E402
from dsv4_sm120.sglang_glue import selfcheck as S  # noqa: E402

ARGS = ("q", "k_cache", "indices", "topk_length", "attn_sink", "head_dim_v", "softmax_scale", "extra_k_cache",
        "extra_indices_in_kvcache", "extra_topk_length")
H200 = Device("NVIDIA H200", (9, 0), 132)


@pytest.fixture
def fresh(monkeypatch):
    for k in ("DSV4_SM120_TEST_SELFCHECK_FAULT", "DSV4_SM120_SELFCHECK", "DSV4_SM120_ATTN_BACKEND",
              "DSV4_SM120_ATTN_CONFIG", "DSV4_SM120_ATTN_QK", "DSV4_SM120_TEST_FAULT_RANKS", "DSV4_SM120_ATTN_PREFILL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("DSV4_SM120_PROFILE_DIR", "")
    monkeypatch.setattr(A, "first_call_check", None)
    S.reset()
    A.reset()
    yield monkeypatch
    S.reset()
    A.reset()


class Stock:
    """SGLang 0.5.23's flash_mla_sm120 module as the glue calls it; each function records (name, args)."""
    SM120_DECODE_MAX_TOKENS = 16

    def __init__(self, supports=lambda H, T: H >= 32, backend="flashinfer"):
        self.calls, self._supports = [], supports
        if backend is not None:
            self._sm120_default_backend = backend

    def flashinfer_dsv4_decode_supports_num_heads(self, H, T):
        return self._supports(H, T)

    def _rec(self, name, args):
        self.calls.append((name, args))
        return (f"{name} out", "lse")

    def _flash_mla_flashinfer(self, *args):
        return self._rec("flashinfer", args)

    def _flash_mla_sm120_prefill(self, *args):
        return self._rec("prefill", args)

    def _sm120_sparse_decode_fwd(self, *args):
        return self._rec("torch", args)

    def flash_mla_with_kvcache_sm120(self, **kw):
        return self._rec("dispatcher", kw)


def _stock(monkeypatch, **kw):
    m = Stock(**kw)
    monkeypatch.setattr(A, "_stock", lambda: m)
    return m


def _call(T=2, H=8, heads=None, layout="swa", sink=True):
    """Inputs of a call: q with ``heads`` heads (padded beyond H when more), the keyword arguments SGLang passes."""
    heads = heads or H
    q = torch.randn(T, 1, heads, 512, generator=torch.Generator().manual_seed(T))
    kw = dict(k_cache="main", indices="idx", topk_length="len", head_dim_v=512, softmax_scale=0.5)
    if sink:
        kw["attn_sink"] = torch.arange(1, heads + 1, dtype=torch.float32)
    if layout != "swa":
        kw.update(extra_k_cache=types.SimpleNamespace(shape=(3, 64 if layout == "swa_c4" else 2, 1, 584)),
                  extra_indices_in_kvcache="eidx", extra_topk_length="elen")
    return q, kw


DECODE = types.SimpleNamespace(is_decode=lambda: True)
EXTEND = types.SimpleNamespace(is_decode=lambda: False, is_target_verify=lambda: False)


def test_the_stock_arguments_are_in_sglangs_order():
    q, kw = _call(layout="swa_c4")
    args = A._args(q, kw)
    assert args[0] is q and list(args[1:]) == [kw.get(n) for n in ARGS[1:]]
    q, kw = _call(sink=False)
    assert A._args(q, kw)[4] is None and A._args(q, kw)[7:] == (None, None, None)


def test_padding_to_the_stock_head_count():
    q, kw = _call(T=3, H=5)
    qp, kw2 = A._pad_heads(q, kw, 64)
    assert qp.shape == (3, 1, 64, 512) and qp.dtype == q.dtype
    assert torch.equal(qp[:, :, :5], q) and not qp[:, :, 5:].any()
    assert kw2["attn_sink"].tolist() == [1, 2, 3, 4, 5] + [0] * 59 and kw2["attn_sink"].dtype == torch.float32
    assert kw["attn_sink"].shape == (5,) and kw2 is not kw and kw2["k_cache"] == "main"
    q, kw = _call(T=1, H=4, sink=False)
    qp, kw2 = A._pad_heads(q, kw, 16)
    assert qp.shape[-2] == 16 and "attn_sink" not in kw2
    qm = torch.zeros(2, 1, 4, 512, device="meta", dtype=torch.bfloat16)
    qp, kw2 = A._pad_heads(qm, {"attn_sink": torch.ones(4, device="meta")}, 64)
    assert qp.device.type == "meta" and kw2["attn_sink"].device.type == "meta" and qp.dtype == torch.bfloat16


def test_the_stock_dispatcher_gets_64_heads_where_flashinfers_decode_needs_them(fresh):
    m = _stock(fresh)
    for T, H, padded in ((2, 8, True), (16, 8, True), (17, 8, False), (2, 32, False), (2, 31, True), (2, 64, False)):
        m.calls.clear()
        q, kw = _call(T=T, H=H)
        assert A.stock_dispatch(q, kw) == "dispatcher out"
        (name, got), = m.calls
        assert name == "dispatcher" and got["q"].shape[-2] == (64 if padded else H), (T, H)
        assert got["k_cache"] == "main" and got["softmax_scale"] == 0.5 and got["attn_sink"].shape[0] == got[
            "q"].shape[-2]
    m = _stock(fresh, supports=lambda H, T: False)         # 64 heads are the stock shape: never padded further
    A.stock_dispatch(*_call(T=2, H=64))
    assert m.calls[0][1]["q"].shape[-2] == 64
    for backend in ("triton", None):
        m = _stock(fresh, backend=backend)
        q, kw = _call(T=2, H=8)
        A.stock_dispatch(q, kw)
        assert m.calls[0][1]["q"].shape[-2] == (8 if backend == "triton" else 64)


def test_flashinfer_decode_and_prefill(fresh):
    m = _stock(fresh)
    q, kw = _call(T=4, H=8)
    assert A._flashinfer(m, q, kw) == "flashinfer out"
    name, args = m.calls[-1]
    assert args[0].shape[-2] == 64 and args[4].shape == (64,) and args[1:4] == ("main", "idx", "len")
    q, kw = _call(T=4, H=32)
    A._flashinfer(m, q, kw)
    assert m.calls[-1][1][0] is q
    q, kw = _call(T=4, H=64)
    m2 = Stock(supports=lambda H, T: False)
    A._flashinfer(m2, q, kw)
    assert m2.calls[-1][1][0] is q                                   # 64 heads: no padding even unsupported
    q, kw = _call(T=17, H=8)
    assert A._flashinfer(m, q, kw) == "prefill out" and m.calls[-1][1][0] is q
    q, kw = _call(T=16, H=8)
    assert A._flashinfer(m, q, kw) == "flashinfer out"


def test_the_stock_name(fresh):
    _stock(fresh, backend="triton")
    assert A.stock_name() == "SGLang's stock dispatcher flash_mla_with_kvcache_sm120 (triton)"
    _stock(fresh, backend=None)
    assert A.stock_name() == "SGLang's stock dispatcher flash_mla_with_kvcache_sm120 (flashinfer)"
    fresh.setattr(A, "_stock", lambda: (_ for _ in ()).throw(ImportError("no sglang")))
    assert A.stock_name() == "SGLang's stock dispatcher flash_mla_with_kvcache_sm120"


def _route(fresh, route):
    fresh.setattr(A, "call_route", lambda T, layout, H: route)


def test_each_backend_answers_the_call_it_is_routed(fresh):
    m = _stock(fresh)
    tri = []
    mod = types.ModuleType("sglang.kernels.ops.attention.flash_mla_sm120_triton")
    mod.flash_mla_sparse_decode_triton = lambda *a: tri.append(a) or ("triton out", None)
    fresh.setitem(sys.modules, mod.__name__, mod)
    q, kw = _call(T=2, H=8, heads=64)
    _route(fresh, A.Route("triton"))
    assert A.sparse_attention(DECODE, q=q, num_heads=8, **kw) == "triton out" and tri[0][0] is q
    assert [type(x).__name__ if isinstance(x, torch.Tensor) else x for x in tri[0][1:]] == [
        "main", "idx", "len", "Tensor", 512, 0.5, None, None, None]
    _route(fresh, A.Route("torch"))
    assert A.sparse_attention(DECODE, q=q, num_heads=8, **kw) == "torch out" and m.calls[-1][1][0] is q
    _route(fresh, A.Route(A.STOCK))
    assert A.sparse_attention(DECODE, q=q, num_heads=8, **kw) == "dispatcher out"
    # FlashInfer: the real heads when its decode kernel takes them (or the rows are prefill rows)
    _route(fresh, A.Route("flashinfer"))
    q, kw = _call(T=2, H=32, heads=64)
    A.sparse_attention(DECODE, q=q, num_heads=32, **kw)
    name, args = m.calls[-1]
    assert name == "flashinfer" and args[0].shape[-2] == 32 and args[4].tolist() == list(range(1, 33))
    assert args[0].is_contiguous() and torch.equal(args[0], q[:, :, :32])
    q, kw = _call(T=2, H=8, heads=64)                     # not taken at 8 heads: the padded 64 stay
    A.sparse_attention(DECODE, q=q, num_heads=8, **kw)
    assert m.calls[-1][1][0] is q and m.calls[-1][1][4].shape == (64,)
    q, kw = _call(T=20, H=8, heads=64)                    # prefill rows: the real heads
    A.sparse_attention(EXTEND, q=q, num_heads=8, **kw)
    assert m.calls[-1][0] == "prefill" and m.calls[-1][1][0].shape[-2] == 8 and m.calls[-1][1][4].shape == (8,)
    q, kw = _call(T=20, H=8, heads=64, sink=False)
    A.sparse_attention(EXTEND, q=q, num_heads=8, **kw)
    assert m.calls[-1][1][4] is None and m.calls[-1][1][0].shape[-2] == 8
    q, kw = _call(T=2, H=8)                               # no padded heads: as given
    A.sparse_attention(DECODE, q=q, num_heads=8, **kw)
    assert m.calls[-1][1][0].shape[-2] == 64              # then FlashInfer's own 64-head padding


def test_our_kernel_serves_decode_rows_and_prefill_rows_only_when_asked(fresh):
    m = _stock(fresh)
    ours = []
    fresh.setattr(A, "run_dsv4_kernel", lambda q, h, kw, launch=None, qk=None: ours.append((q, h, kw, launch, qk))
                  or "ours")
    _route(fresh, A.Route("dsv4", "BLOCK_N=32", "fp8"))
    q, kw = _call(T=3, H=8)
    del kw["softmax_scale"]
    checked = []
    fresh.setattr(A, "first_call_check", lambda q, h: checked.append((q.shape[0], h)))
    assert A.sparse_attention(DECODE, q=q, num_heads=8, **kw) == "ours"
    (gq, gh, gkw, launch, qk), = ours
    assert gq is q and gh == 8 and launch == "BLOCK_N=32" and qk == "fp8" and checked == [(3, 8)]
    assert gkw["softmax_scale"] == pytest.approx(512 ** -0.5) and gkw["k_cache"] == "main"
    q, kw = _call(T=3, H=8)
    A.sparse_attention(DECODE, q=q, num_heads=8, **kw)
    assert ours[-1][2]["softmax_scale"] == 0.5
    kw["softmax_scale"] = None
    A.sparse_attention(DECODE, q=q[..., :256], num_heads=8, **kw)
    assert ours[-1][2]["softmax_scale"] == pytest.approx(256 ** -0.5)
    n = len(ours)
    assert A.sparse_attention(EXTEND, q=q, num_heads=8, **kw) == "prefill out" or m.calls
    assert len(ours) == n and m.calls[-1][0] in ("flashinfer", "prefill")
    fresh.setenv("DSV4_SM120_ATTN_PREFILL", "dsv4")
    assert A.prefill_backend() == "dsv4"
    assert A.sparse_attention(EXTEND, q=q, num_heads=8, **kw) == "ours" and len(ours) == n + 1


def test_a_raising_kernel_is_answered_by_stock_and_steps_aside(fresh, caplog):
    m = _stock(fresh)
    route = A.Route("dsv4", None, None, "default")
    _route(fresh, route)
    steps = []
    fresh.setattr(A, "step_aside", lambda *a, **k: steps.append((a, k)))
    fresh.setattr(A, "run_dsv4_kernel", lambda *a, **k: (_ for _ in ()).throw(ValueError("bad\n" + "x" * 400)))
    q, kw = _call(T=5, H=8, layout="swa_c128")
    assert A.sparse_attention(DECODE, q=q, num_heads=8, **kw) == "dispatcher out"
    (a, k), = steps
    assert a == (5, "swa_c128", 8, route, q.device, "ValueError: " + ("bad\n" + "x" * 400)[:300]) and k == {}


def test_decode_like_forward_modes():
    def mode(**flags):
        return types.SimpleNamespace(**{k: (lambda v=v: v) for k, v in flags.items()})

    for attr in ("is_decode", "is_target_verify", "is_draft_extend_v2", "is_idle"):
        assert A.is_decode_like(mode(**{attr: True})) is True, attr
        assert A.is_decode_like(mode(**{attr: False})) is False, attr
    assert A.is_decode_like(mode(is_decode=False, is_idle=True)) is True
    assert A.is_decode_like(types.SimpleNamespace(is_decode=None)) is False
    assert A.is_decode_like(object()) is False


def test_our_kernel_gets_the_real_heads_and_the_routes_launch(fresh, monkeypatch):
    import dsv4_sm120.attention as pkg

    got = {}

    def decode(q, attn_sink=None, launch=None, qk_mode=None, **kw):
        got.update(q=q, sink=attn_sink, launch=launch, qk=qk_mode, kw=kw)
        return (torch.ones(q.shape[0], 1, q.shape[-2], 512), "lse")

    monkeypatch.setattr(pkg, "sparse_mla_decode", decode)
    q, kw = _call(T=3, H=8, heads=64)
    out = A.run_dsv4_kernel(q, 8, kw, "BLOCK_N=32", "fp8")
    assert out.shape == (3, 1, 8, 512) and torch.equal(out, torch.ones(3, 1, 8, 512))
    assert torch.equal(got["q"], q[..., :8, :]) and got["sink"].tolist() == list(range(1, 9))
    assert got["launch"] == "BLOCK_N=32" and got["qk"] == "fp8" and "attn_sink" not in got["kw"]
    assert kw["attn_sink"].shape == (64,) and got["kw"]["softmax_scale"] == 0.5
    q, kw = _call(T=2, H=8, sink=False)
    A.run_dsv4_kernel(q, 8, kw)
    assert got["sink"] is None and got["launch"] is None and got["qk"] is None
    monkeypatch.setenv("DSV4_SM120_TEST_SELFCHECK_FAULT", "attention")
    assert torch.equal(A.run_dsv4_kernel(q, 8, kw), torch.full((2, 1, 8, 512), 2.0))
    monkeypatch.setenv("DSV4_SM120_TEST_SELFCHECK_FAULT", "attention-raise-T=3")
    assert A.run_dsv4_kernel(q, 8, kw).shape[0] == 2
    with pytest.raises(RuntimeError) as e:
        A.run_dsv4_kernel(_call(T=3)[0], 8, kw)
    assert str(e.value) == "planted test fault attention-raise-T=3 (DSV4_SM120_TEST_SELFCHECK_FAULT) at T=3"
    monkeypatch.setenv("DSV4_SM120_TEST_SELFCHECK_FAULT", "attention-raise")
    with pytest.raises(RuntimeError, match="planted test fault attention-raise .* at T=2"):
        A.run_dsv4_kernel(q, 8, kw)


def test_planted_faults_only_on_the_ranks_named(fresh, monkeypatch):
    monkeypatch.setenv("DSV4_SM120_TEST_SELFCHECK_FAULT", " moe ")
    assert A.test_fault() == "moe"
    monkeypatch.setenv("DSV4_SM120_TEST_FAULT_RANKS", " 1 , 12")
    for rank, want in ((1, "moe"), (12, "moe"), (2, ""), (0, "")):
        monkeypatch.setattr(RA, "process_rank", lambda r=rank: r)
        assert A.test_fault() == want, rank
    monkeypatch.setenv("DSV4_SM120_TEST_FAULT_RANKS", "")
    assert A.test_fault() == "moe"
    monkeypatch.delenv("DSV4_SM120_TEST_SELFCHECK_FAULT")
    monkeypatch.setenv("DSV4_SM120_TEST_FAULT_RANKS", "2")
    monkeypatch.setattr(RA, "process_rank", lambda: 2)
    assert A.test_fault() == ""


def test_the_head_count_the_model_asks_for(fresh):
    for backend, n_local, n_heads, want in (("dsv4", 8, 64, 8), ("triton", 8, 64, 64), ("torch", 64, 128, 64),
                                            ("torch", 65, 128, 128), ("triton", 128, 256, 256),
                                            ("flashinfer", 8, 64, None)):
        fresh.setenv("DSV4_SM120_ATTN_BACKEND", backend)
        assert A.kernel_num_heads(n_local, n_heads, 4) == want, backend


class Profile:
    """The machine profile's lookup: ``{layout: {bucket: winner}}``; a call of T rows takes the first bucket >= T
    (the last beyond them)."""

    def __init__(self, table):
        self.table, self.asked = table, []

    def _rows(self, name):
        return sorted(self.table.get(name.split(".", 1)[1], {}).items())

    def bucket_winners(self, name):
        rows = self._rows(name)
        return (rows, "profile P.json") if rows else ([], "default")

    def decision(self, name, T, default):
        self.asked.append((name, T, default))
        rows = self._rows(name)
        if not rows:
            return default, "default"
        w = next((w for b, w in rows if b >= T), rows[-1][1])
        return (w, "profile P.json") if w else (default, "default")

    def default_reason(self, name):
        return f"default: no winner for {name}"

    def clear_cache(self):
        pass


def _profile(fresh, table):
    p = Profile(table)
    fresh.setattr(A, "_profile", lambda: p)
    A.reset()
    return p


def test_routes_from_the_profile_per_bucket(fresh):
    p = _profile(fresh, {"swa": {1: "flashinfer", 64: "dsv4:BLOCK_N=32", 256: "dsv4+fp8qk", 512: "flashmla"},
                         "swa_c4": {8: "flashinfer"}})
    assert A.attention_route(1, "swa") == A.Route("flashinfer", None, None, "profile P.json")
    assert p.asked[-1] == ("attention.swa", 1, "dsv4")
    assert A.attention_route(2, "swa") == A.Route("dsv4", "BLOCK_N=32", None, "profile P.json")
    assert A.attention_route(200, "swa") == A.Route("dsv4", None, "fp8", "profile P.json")
    assert A.attention_route(300, "swa").source == "default: profile winner 'flashmla' is not routable"
    assert A.attention_route(3, "swa_c128") == A.Route("dsv4", None, None, "default: no winner for attention.swa_c128")
    n = len(p.asked)
    A.attention_route(2, "swa")                          # cached
    assert len(p.asked) == n
    fresh.setenv("DSV4_SM120_ATTN_CONFIG", "BLOCK_N=16")  # the user's launch keys win; a changed setting decides anew
    fresh.setenv("DSV4_SM120_ATTN_QK", "bf16")
    assert A.attention_route(2, "swa").launch is None and A.attention_route(200, "swa").qk is None
    assert A.dsv4_serves_some_rows("swa") and not A.dsv4_serves_some_rows("swa_c4")
    assert A.dsv4_serves_some_rows() is True
    fresh.delenv("DSV4_SM120_ATTN_CONFIG")
    fresh.delenv("DSV4_SM120_ATTN_QK")
    assert A.our_launches("swa") == [("BLOCK_N=32", None), (None, "fp8"), (None, None)]
    assert A.our_launches("swa_c4") == [] and A.our_launches("swa_c128") == [(None, None)]
    fresh.setenv("DSV4_SM120_ATTN_BACKEND", "flashinfer")
    assert not A.dsv4_serves_some_rows() and A.our_launches("swa") == []
    _profile(fresh, {"swa": {4: "flashinfer", 16: "dsv4"}})
    fresh.delenv("DSV4_SM120_ATTN_BACKEND")
    assert A.dsv4_serves_some_rows("swa") and A.our_launches("swa") == [(None, None)]
    _profile(fresh, {"swa": {1: "flashinfer"}, "swa_c4": {1: "flashinfer"}, "swa_c128": {1: "triton"}})
    assert not A.dsv4_serves_some_rows()


def test_profile_winners_the_glue_can_route():
    assert A.parse_choice(" dsv4 ") == ("dsv4", None, None)
    assert A.parse_choice("dsv4:BLOCK_N=32+fp8qk") == ("dsv4", "BLOCK_N=32", "fp8")
    assert A.parse_choice("dsv4:BLOCK_N=32,bogus=1") is None
    assert A.parse_choice("flashinfer") == ("flashinfer", None, None)
    assert A.parse_choice("flashinfer+fp8qk") is None and A.parse_choice("triton:BLOCK_N=32") is None
    assert A.parse_choice("torch:") is None and A.parse_choice("flashmla") is None


def test_the_decision_lines(fresh, caplog):
    _profile(fresh, {"swa": {1: "flashinfer", 8: "flashinfer", 64: "dsv4", 256: "dsv4", 1024: "triton"},
                     "swa_c4": {16: "dsv4"}})
    assert A.describe_attention("swa") == ("flashinfer for T<=8, dsv4 for 8<T<=256, triton for T>256 "
                                           "(profile P.json)")
    assert A.describe_attention("swa_c4") == "dsv4 for every T (profile P.json)"
    assert A.describe_attention("swa_c128") == "dsv4 for every T (default: no winner for attention.swa_c128)"
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        A.log_decisions()
        A.log_decisions()
    assert caplog.messages == ["dsv4_sm120 decision attention.swa: flashinfer for T<=8, dsv4 for 8<T<=256, triton for "
                               "T>256 (profile P.json)",
                               "dsv4_sm120 decision attention.swa_c4: dsv4 for every T (profile P.json)",
                               "dsv4_sm120 decision attention.swa_c128: dsv4 for every T (default: no winner for "
                               "attention.swa_c128)"]
    caplog.clear()
    fresh.setattr(A, "describe_attention", lambda lay: (_ for _ in ()).throw(KeyError(lay)))
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        A.relog()
    assert caplog.messages[0] == "dsv4_sm120 decision attention.swa: could not describe (KeyError: 'swa')"
    assert [r.levelname for r in caplog.records] == ["WARNING"] * 3


def test_the_launch_bucket_is_the_table_entry_with_the_routes_launch(fresh):
    from dsv4_sm120.attention import config as C

    fresh.setenv("TRITON_INTERPRET", "0")
    r = A.Route("dsv4")
    for T in (1, 300, 4096):
        entry = C.table_entry(16, T, "bf16", H200)[1]
        assert A.launch_bucket(T, "swa_c4", 16, r, H200) == f"swa_c4 H=16 qk=bf16 {entry}"
    fp8 = A.Route("dsv4", None, "fp8")
    assert A.launch_bucket(1, "swa", 16, fp8, H200) == f"swa H=16 qk=fp8 {C.table_entry(16, 1, 'fp8', H200)[1]}"
    reg = A.Route("dsv4", "impl=reg")
    assert A.launch_bucket(1, "swa", 16, reg, H200) == (f"swa H=16 qk=bf16 {C.table_entry(16, 1, 'bf16', H200, 'reg')[1]}"
                                                        " launch=impl=reg")
    fresh.setenv("DSV4_SM120_ATTN_CONFIG", "impl=reg")
    assert A.launch_bucket(1, "swa", 16, r, H200) == f"swa H=16 qk=bf16 {C.table_entry(16, 1, 'bf16', H200, 'reg')[1]}"
    fresh.setenv("DSV4_SM120_ATTN_QK", "fp8")
    fresh.delenv("DSV4_SM120_ATTN_CONFIG")
    assert A.launch_bucket(1, "swa", 16, r, H200).startswith("swa H=16 qk=fp8 ")
    fresh.setenv("TRITON_INTERPRET", "1")
    assert A.launch_bucket(7, "swa", 8, r, H200) == "swa H=8 qk=fp8 interpreter"
    fresh.setattr(A, "launch_bucket", lambda *a: (_ for _ in ()).throw(ValueError("x")))
    assert A._bucket_or_rows(7, "swa", 8, r, H200) == "swa H=8 T=7 (no launch: ValueError)"


def test_stepping_aside_adopting_and_the_rows_of_a_launch(fresh, caplog):
    r = A.attention_route(2, "swa")
    with caplog.at_level(logging.ERROR, logger="dsv4_sm120"):
        b = A.step_aside(2, "swa", 8, r, "cpu", "RuntimeError: x")
        assert A.step_aside(3, "swa", 8, r, "cpu", "again") == b          # the same launch: once
    assert caplog.messages == [f"dsv4_sm120: our attention kernel failed (serving) at swa T=2 H=8 launch {b}: "
                               "RuntimeError: x; the rows of that launch step aside to SGLang's stock path for the rest "
                               "of this process"]
    assert A.stepped_aside() == {("swa", 8, b): "serving T=2: RuntimeError: x"} and A.fallback_count() == 1
    assert A.failed_launches() == [["swa", 8, b, "serving T=2: RuntimeError: x"]]
    assert A.rows_of_launch([1, 2, 5], "swa", 8, b, "cpu") == [1, 2, 5]
    assert A.rows_of_launch([1, 2], "swa", 16, b, "cpu") == [] and A.rows_of_launch([], "swa", 8, b, "cpu") == []
    fresh.setenv("DSV4_SM120_ATTN_BACKEND", "flashinfer")
    assert A.rows_of_launch([1, 2], "swa", 8, b, "cpu") == []
    fresh.delenv("DSV4_SM120_ATTN_BACKEND")
    new = A.adopt([["swa", 8, b, "other"], ["swa_c4", "16", "B", "w"]], "cpu", "rank 3")
    assert new == [["swa_c4", 16, "B", "w"]] and A.stepped_aside()[("swa_c4", 16, "B")] == "rank 3: w"
    assert A.fallback_count() == 1 and A.adopt([["swa_c4", 16, "B", "w"]], "cpu", "rank 3") == []
    A.reset()
    assert A.fallback_count() == 0 and A.stepped_aside() == {}
    assert A.adopt([["swa", 8, b, "w"]], "cpu", "rank 1") == [["swa", 8, b, "w"]]
    assert A.call_route(2, "swa", 8).backend == A.STOCK            # adopted with the device facts of "cpu"
    assert A.call_route(2, "swa", 8).source.endswith(f"; our kernel stepped aside for {b} (rank 1: w)")
    assert A.call_route(2, "swa", 16).backend == "dsv4"
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="dsv4_sm120"):
        A.step_aside(2, "swa_c4", 8, r, "cpu", "quiet", during="self-check", log=False)
    assert caplog.messages == [] and A.stepped_aside()[("swa_c4", 8, b.replace("swa", "swa_c4", 1))] == \
        "self-check T=2: quiet"


def test_the_row_count_each_stock_call_is_decided_by(fresh):
    m = _stock(fresh, supports=lambda H, T: H >= 32 and T <= 4)
    q, kw = _call(T=8, H=32)
    A.stock_dispatch(q, kw)
    assert m.calls[-1][1]["q"].shape[-2] == 64              # 8 rows: not taken at 32 heads
    A._flashinfer(m, q, kw)
    assert m.calls[-1][1][0].shape[-2] == 64
    q, kw = _call(T=4, H=32)
    A.stock_dispatch(q, kw)
    assert m.calls[-1][1]["q"].shape[-2] == 32
    routes = []
    fresh.setattr(A, "call_route", lambda T, layout, H: routes.append((T, layout, H)) or A.Route("flashinfer"))
    q, kw = _call(T=8, H=32, heads=64)
    A.sparse_attention(DECODE, q=q, num_heads=32, **kw)
    assert routes == [(8, "swa", 32)] and m.calls[-1][1][0] is q     # 8 rows: FlashInfer takes 64, not 32
    q, kw = _call(T=16, H=8, heads=64)
    m16 = _stock(fresh, supports=lambda H, T: False)
    A.sparse_attention(DECODE, q=q, num_heads=8, **kw)
    assert m16.calls[-1][1][0] is q                                   # the last decode row count keeps the padding
    q, kw = _call(T=2, H=5)
    kw["attn_sink"] = kw["attn_sink"].to(torch.bfloat16)
    assert A._pad_heads(q, kw, 64)[1]["attn_sink"].dtype == torch.bfloat16


def test_the_rows_of_a_launch_follow_their_layouts_route(fresh):
    _profile(fresh, {"swa_c4": {64: "flashinfer"}})
    b = A.launch_bucket(2, "swa_c4", 8, A.Route("dsv4"), A._device_facts("cpu"))
    assert A.rows_of_launch([1, 2], "swa_c4", 8, b, "cpu") == []      # flashinfer serves them: no launch of ours
    assert A.rows_of_launch([1, 2], "swa", 8, b.replace("swa_c4", "swa", 1), "cpu") == [1, 2]


def test_reset_forgets_the_device_of_the_fallbacks(fresh):
    A.step_aside(2, "swa", 8, A.attention_route(2, "swa"), H200, "x", log=False)
    assert A.STATE.fail_device == H200 and A.STATE.fail_count == 1
    A.reset()
    assert (A.STATE.fail_device, A.STATE.fail_count, A.STATE.failed, A.STATE.buckets) == (None, 0, {}, {})


def test_launch_buckets_and_call_routes_are_cached(fresh, monkeypatch):
    from dsv4_sm120.attention import config as C

    fresh.setenv("TRITON_INTERPRET", "0")
    calls = []
    real = C.table_entry
    monkeypatch.setattr(C, "table_entry", lambda *a, **k: calls.append(a) or real(*a, **k))
    r = A.Route("dsv4")
    b = A.launch_bucket(4, "swa", 16, r, H200)
    assert A.launch_bucket(4, "swa", 16, r, H200) == b and len(calls) == 1
    A.step_aside(4, "swa", 16, r, H200, "x", log=False)
    n = len(calls)
    looked = []
    real_bor = A._bucket_or_rows
    monkeypatch.setattr(A, "_bucket_or_rows", lambda *a: looked.append(a) or real_bor(*a))
    assert A.call_route(4, "swa", 16).backend == A.STOCK == A.call_route(4, "swa", 16).backend
    assert len(looked) == 1 and len(calls) == n


def test_the_routes_launch_keys_go_over_the_settings(fresh):
    from dsv4_sm120.attention import config as C
    from dsv4_sm120.attention import launch as L

    assert not hasattr(L, "CONFIG_OVERRIDE")     # launch variants travel as launch=, never a module global
    fresh.setenv("TRITON_INTERPRET", "0")
    fresh.setenv("DSV4_SM120_ATTN_CONFIG", "impl=tiled")
    assert A.launch_bucket(1, "swa", 16, A.Route("dsv4", "impl=reg"), H200) == \
        f"swa H=16 qk=bf16 {C.table_entry(16, 1, 'bf16', H200, 'reg')[1]} launch=impl=reg"


def test_a_route_not_ours_is_never_stepped_aside(fresh):
    _profile(fresh, {"swa": {4: "flashinfer", 64: "dsv4"}, "swa_c4": {64: "dsv4+fp8qk"}})
    r = A.attention_route(64, "swa")
    A.step_aside(64, "swa", 8, r, "cpu", "x", log=False)      # under the interpreter one bucket holds every row
    assert A.call_route(2, "swa", 8).backend == "flashinfer" and A.call_route(64, "swa", 8).backend == A.STOCK
    b = A.launch_bucket(2, "swa_c4", 8, A.attention_route(2, "swa_c4"), A._device_facts("cpu"))
    assert "qk=fp8" in b and A.rows_of_launch([2, 8], "swa_c4", 8, b, "cpu") == [2, 8]


def test_the_decision_line_names_each_source_once(fresh):
    _profile(fresh, {"swa": {4: "flashinfer", 64: "dsv4"}})
    A.disable("attention", "broken")
    assert A.describe_attention("swa") == ("flashinfer for T<=4, stock for T>4 (profile P.json; our kernel disabled "
                                           "by the self-check: broken)")


def test_more_heads_than_the_stock_shape_are_never_padded(fresh):
    m = _stock(fresh, supports=lambda H, T: False)
    A.stock_dispatch(*_call(T=2, H=128))
    assert m.calls[-1][1]["q"].shape[-2] == 128


def test_the_glue_state_is_changed_under_its_lock(monkeypatch):
    """Several threads of one server process (the scheduler, a capture) may disable our kernel while another reads
    the routes: a fresh state's changes wait while its lock is held elsewhere, and go through once it is free."""
    import threading

    st = A.GlueState()
    monkeypatch.setattr(A, "STATE", st)
    assert st.lock.acquire(timeout=1)
    done = threading.Event()
    t = threading.Thread(target=lambda: (A.disable("attention", "held"), done.set()), daemon=True)
    t.start()
    try:
        assert not done.wait(0.3) and A.disabled("attention") is None   # waits for the lock
    finally:
        st.lock.release()
    t.join(5)
    assert done.is_set() and A.disabled("attention") == "held" and st.routes == {}
