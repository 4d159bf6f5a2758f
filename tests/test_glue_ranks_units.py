"""The glue's decisions that the ranks of a tensor-parallel group agree on, in this process: the capture loop's
agreement and second capture (:mod:`dsv4_sm120.sglang_glue.graphs`) and the PCIe-IPC all-reduce set-up
(:mod:`dsv4_sm120.sglang_glue.allreduce`), with a stand-in group whose other ranks answer what each test says
(the real multi-process runs: tests/test_rank_agreement_sglang.py, which `make mutate` cannot see). Expectations
are the exact one-line messages, which ranks capture again, and which communicator each rank keeps."""

from __future__ import annotations

import json
import logging
import sys
import types

import pytest

from dsv4_sm120 import rank_agreement as RA
from dsv4_sm120.sglang_glue import allreduce as G
from dsv4_sm120.sglang_glue import attention as A
from dsv4_sm120.sglang_glue import graphs as GR
from dsv4_sm120.sglang_glue import selfcheck as S
from glue_fixtures import AttnLayer, fresh_glue, toy_model  # noqa: E402

STOCK = "SGLang's stock dispatcher"


class Ranks:
    """This process is rank 0 of ``size``; ``others(topic, mine)`` gives the statuses of ranks 1.. for each
    agreement (JSON round trip, as the store does)."""

    def __init__(self, size, others=None, name="tp"):
        self.size, self.rank, self.name = size, 0, name
        self.others = others or (lambda topic, mine: [mine] * (size - 1))
        self.topics = []

    def agree(self, topic, status=None, timeout=None):
        self.topics.append(topic)
        mine = json.loads(json.dumps(status))
        return [mine] + [json.loads(json.dumps(s)) for s in self.others(topic, mine)]


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(A, "stock_name", lambda: STOCK)
    yield from fresh_glue(monkeypatch)


def _with_group(monkeypatch, group):
    monkeypatch.setattr(G, "tp_group", lambda: group)
    return group


def _state(attention=(), off=None, moe=None, why=""):
    return {"attention": [list(x) for x in attention], "attention_off": off, "moe": moe, "moe_why": why}


RUNNER = type("DecodeCudaGraphRunner", (), dict(model_runner=types.SimpleNamespace(device="cpu"), capture_bs=[1, 2]))()


def _bucket(T=2, layout="swa", H=8):
    return A.launch_bucket(T, layout, H, A.attention_route(T, layout), A._device_facts("cpu"))


# ---------------------------------------------------------------------------- graphs: the capture's agreement


def test_a_clean_capture_on_every_rank_is_agreed_once(fresh):
    grp = _with_group(fresh, Ranks(2))
    calls = []
    cap = GR.retrying(lambda size, *a, **k: calls.append((size, a, k)) or f"graph {size}")
    assert cap(8, "lora", 3, True, 2.5, chunk=4, name="x", none=None, obj=[1]) == "graph 8"
    assert calls == [(8, ("lora", 3, True, 2.5), {"chunk": 4, "name": "x", "none": None, "obj": [1]})]
    assert grp.topics == ["decode capture of size 8 ('lora', 3, chunk=4, name='x', none=None)"]
    assert GR._variant((), {}) == ""


def test_another_rank_raising_after_its_fallback_makes_every_rank_capture_again(fresh, caplog):
    b = _bucket()
    other = _state([["swa", 8, b, "self-check T=2: RuntimeError: bad"]])

    def others(topic, mine):
        if topic.endswith("again"):
            return [dict(mine, state=other)]
        return [{"error": "RuntimeError: capture invalidated", "stepped": True, "stop": False, "state": other}]

    grp = _with_group(fresh, Ranks(2, others))
    calls = []
    cap = GR.retrying(lambda size: calls.append(size) or f"graph {len(calls)}", RUNNER)
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120"):
        assert cap(4) == "graph 2"
    assert calls == [4, 4] and grp.topics == ["decode capture of size 4", "decode capture of size 4 again"]
    assert A.call_route(2, "swa", 8).backend == A.STOCK           # rank 1's fallback, taken here too
    assert A.fallback_count() == 0                                 # adopted, not this rank's own
    msgs = caplog.messages
    assert ("dsv4_sm120 decode: CUDA-graph capture of size 4 raised on rank 1 (RuntimeError: capture invalidated) "
            "after our kernel stepped aside there; agreed by all 2 ranks: every rank captures that size again, "
            "with the fallbacks of every rank") in msgs
    assert "dsv4_sm120 decode: CUDA-graph capture of size 4 again succeeded on all 2 ranks" in msgs
    assert any(m.startswith("dsv4_sm120 decode capture of size 4: our attention kernel failed on rank 1 "
                            "(self-check T=2: RuntimeError: bad) at launch ") and m.endswith(
                                f"rows 1,2 of swa H=8 run {STOCK} on every rank (agreed by all 2 ranks)")
               for m in msgs), msgs


def test_ranks_with_different_fallbacks_capture_again_though_none_raised(fresh, caplog):
    b = _bucket()
    other = _state([["swa", 8, b, "why"]], moe="bf16", why="self-check on rank 1")
    grp = _with_group(fresh, Ranks(2, lambda t, mine: [dict(mine, state=other)]))
    calls = []
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120"):
        assert GR.retrying(lambda size: calls.append(size) or "g", RUNNER)(2) == "g"
    assert calls == [2, 2] and len(grp.topics) == 2
    assert S.moe_fallback_path() == "bf16" and S.moe_fallback_count() == 0
    assert any("left the ranks with different fallbacks; agreed by all 2 ranks" in m for m in caplog.messages)
    assert any("our MoE kernel switched to its bf16 path on rank 1 (self-check on rank 1); every rank serves on its "
               "bf16 path (agreed by all 2 ranks)" in m for m in caplog.messages)


@pytest.mark.parametrize("status", [
    {"error": "RuntimeError: boom", "stepped": False, "stop": False},     # SGLang's own error
    {"error": "StopServer: stop", "stepped": True, "stop": True},        # a stop of ours
])
def test_a_capture_error_not_after_a_fallback_stops_every_rank(fresh, status):
    _with_group(fresh, Ranks(3, lambda t, mine: [mine, dict(status, state=_state())]))
    calls = []
    with pytest.raises(RA.StopServer) as e:
        GR.retrying(lambda size: calls.append(size) or "g")(16)
    assert calls == [16]
    assert str(e.value) == (f"dsv4_sm120 decode: CUDA-graph capture of size 16 raised on rank 2 ({status['error']}), "
                            "not after a fallback of ours; every rank stops (agreed by all 3 ranks)")


def test_a_second_capture_that_raises_anywhere_stops_every_rank(fresh):
    def others(topic, mine):
        return [{"error": "RuntimeError: again", "stepped": True, "stop": False, "state": _state()}]

    _with_group(fresh, Ranks(2, others))
    with pytest.raises(RA.StopServer) as e:
        GR.retrying(lambda size: "g", RUNNER)(1)
    assert str(e.value) == ("dsv4_sm120 decode: CUDA-graph capture of size 1 raised again on rank 1 (RuntimeError: "
                            "again) after every rank took the fallbacks; every rank stops (agreed by all 2 ranks)")


def test_one_rank_raises_sglangs_own_error_and_retries_after_its_own_fallback(fresh, caplog):
    err = ValueError("first line\nsecond line")

    def raises(size):
        raise err

    with pytest.raises(ValueError) as e:
        GR.retrying(raises)(8)
    assert e.value is err
    r = A.attention_route(2, "swa")
    tries = []

    def falls_back(size):
        tries.append(size)
        if len(tries) == 1:
            A.step_aside(2, "swa", 8, r, "cpu", "RuntimeError: x")
            raise RuntimeError("invalidated\nmore")
        return "graph"

    with caplog.at_level(logging.WARNING, logger="dsv4_sm120"):
        assert GR.retrying(falls_back, RUNNER)(8) == "graph"
    assert ("dsv4_sm120 decode: CUDA-graph capture of size 8 raised (RuntimeError: invalidated) after our kernel "
            "stepped aside during it; capturing that size again, on the stock path") in caplog.messages
    assert "dsv4_sm120 decode: CUDA-graph capture of size 8 again succeeded" in caplog.messages


def test_the_attempt_reports_error_text_fallback_and_stop():
    before = A.fallback_count()
    assert GR._attempt(lambda s: s * 2, 3, (), {}) == (6, None, {"error": None, "stepped": False, "stop": False})
    res, err, st = GR._attempt(lambda s: (_ for _ in ()).throw(RuntimeError("")), 1, (), {})
    assert res is None and isinstance(err, RuntimeError) and st == {"error": "RuntimeError", "stepped": False,
                                                                    "stop": False}
    _, _, st = GR._attempt(lambda s: (_ for _ in ()).throw(RA.StopServer("x" * 400 + "\ny")), 1, (), {})
    assert st["error"] == "StopServer: " + "x" * 300 and st["stop"] is True
    assert A.fallback_count() == before


def test_runner_labels_and_capture_rows():
    ns = types.SimpleNamespace

    def runner(cls, **kw):
        return type(cls, (), kw)()

    assert GR.runner_label(None) == "decode"
    assert GR.runner_label(runner("PrefillCudaGraphRunner")) == "prefill"
    assert GR.runner_label(runner("EAGLEDraftExtendCudaGraphRunner")) == "draft-extend"
    assert GR.runner_label(runner("EAGLEDraftCudaGraphRunner")) == "draft"
    assert GR.runner_label(runner("DecodeCudaGraphRunner", model_runner=ns(is_draft_worker=True))) == "draft"
    assert GR.runner_label(runner("DecodeCudaGraphRunner", model_runner=ns(is_draft_worker=1))) == "decode"
    assert GR.runner_label(runner("DecodeCudaGraphRunner", capture_forward_mode=ns(name="TARGET_VERIFY"))) == \
        "target-verify"
    assert GR.runner_label(runner("DecodeCudaGraphRunner", capture_forward_mode=ns(name="DECODE"))) == "decode"
    assert GR.capture_rows(ns(capture_bs=[2, 1], captured_req_width=None, capture_num_tokens=[0, 3])) == [1, 2, 3]
    assert GR.capture_rows(ns()) == []
    assert GR.capture_rows(ns(capture_bs=[1, 2], captured_req_width=3)) == [3, 6]


_Layer, _model = AttnLayer, toy_model


def test_before_capture_checks_the_captured_rows_then_takes_the_union(fresh):
    seen = []
    fresh.setattr(S, "run_for_runner", lambda mr, rows=None, label="": seen.append((rows, label)) or [])
    b = _bucket(4)
    grp = _with_group(fresh, Ranks(2, lambda t, mine: [_state([["swa", 8, b, "rank 1 failed"]])]))
    mr = types.SimpleNamespace(model=_model(_Layer(8, 0)), device="cpu")
    runner = type("DecodeCudaGraphRunner", (), dict(model_runner=mr, capture_bs=[1, 2], captured_req_width=2))()
    GR.before_capture(runner)
    assert seen == [([2, 4], "decode")] and grp.topics == ["decode self-check before capture"]
    assert A.call_route(4, "swa", 8).backend == A.STOCK
    # prefill: checked only when our kernel serves prefill rows
    seen.clear()
    pre = type("PrefillCudaGraphRunner", (), dict(model_runner=mr, capture_num_tokens=[64]))()
    GR.before_capture(pre)
    assert seen == []
    fresh.setenv("DSV4_SM120_ATTN_PREFILL", "dsv4")
    GR.before_capture(pre)
    assert seen == [([64], "prefill")]
    # no attention layer: nothing checked, the ranks still agree
    seen.clear()
    n = len(grp.topics)
    GR.before_capture(type("DecodeCudaGraphRunner", (), dict(model_runner=types.SimpleNamespace(model=_model()),
                                                           capture_bs=[1]))())
    assert seen == [] and len(grp.topics) == n + 1


def test_a_self_check_that_cannot_run_never_stops_the_capture(fresh, caplog):
    def broken(*a, **k):
        raise KeyError("heads")

    fresh.setattr(S, "run_for_runner", broken)
    _with_group(fresh, Ranks(1))
    mr = types.SimpleNamespace(model=_model(_Layer(8, 4)), device="cpu")
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120"):
        GR.before_capture(type("DecodeCudaGraphRunner", (), dict(model_runner=mr, capture_bs=[1]))())
    assert ("dsv4_sm120 self-check before CUDA-graph capture (decode) could not run (KeyError: 'heads'); our kernels "
            "fall back per call if they fail") in caplog.messages


def test_the_union_of_the_ranks_fallbacks(fresh, caplog):
    b2, b4 = _bucket(2), _bucket(4, "swa_c4")
    states = [_state([["swa", 8, b2, "mine"]]), _state([["swa", 8, b2, "theirs"], ["swa_c4", 8, b4, "c4"]]),
              _state([["swa", 8, b2, "also"]], off="swa T=2 H=8: broken")]
    with caplog.at_level(logging.ERROR, logger="dsv4_sm120"):
        lines = GR.adopt_union(states, "decode self-check", "cpu", [2, 4])
    assert lines == [
        f"our attention kernel failed on rank 1 (c4) at launch {b4}; rows 2,4 of swa_c4 H=8 run {STOCK} on every rank",
        f"every launch of our attention kernel failed its self-check on rank 2 (swa T=2 H=8: broken); our kernel is "
        f"disabled on every rank and {STOCK} serves every row"]
    assert A.stepped_aside()[("swa", 8, b2)] == "rank 0: mine"
    assert A.stepped_aside()[("swa_c4", 8, b4)] == "rank 1: c4"
    assert A.disabled("attention") == "rank 2: swa T=2 H=8: broken"
    assert [m for m in caplog.messages if "agreed by all 3 ranks" in m] == [
        f"dsv4_sm120 decode self-check: {x} (agreed by all 3 ranks)" for x in lines]
    # every rank had it: nothing to say
    A.reset()
    assert GR.adopt_union([_state([["swa", 8, b2, "a"]])] * 2, "x", "cpu") == []
    assert GR.adopt_union([_state(moe="fp4", why="w")] * 2, "x", "cpu") == [] and S.moe_fallback_path() == "fp4"
    assert GR.adopt_union([_state(off="o")] * 2, "x", "cpu") == [] and A.disabled("attention") == "rank 0: o"


def test_which_states_differ():
    assert not GR.ranks_differ([_state(), _state()])
    assert not GR.ranks_differ([_state([["swa", 8, "b", "x"]]), _state([["swa", "8", "b", "y"]])])   # why differs
    assert GR.ranks_differ([_state([["swa", 8, "b", "x"]]), _state()])
    assert GR.ranks_differ([_state(off="a"), _state()])
    assert not GR.ranks_differ([_state(off="a"), _state(off="b")])
    assert GR.ranks_differ([_state(moe="bf16"), _state(moe="fp4")])
    assert not GR.ranks_differ([_state(moe="", why="x"), {"attention": None}])


def test_the_ranks_state_of_this_process(fresh):
    assert GR.ranks_state() == _state()
    r = A.attention_route(2, "swa")
    b = A.step_aside(2, "swa", 8, r, "cpu", "E" * 300, log=False)
    S.adopt_moe_path("bf16", "rank 3: x")
    st = GR.ranks_state()
    assert st == {"attention": [["swa", 8, b, ("serving T=2: " + "E" * 300)[:200]]], "attention_off": None,
                  "moe": "bf16", "moe_why": "rank 3: x"}
    assert GR.fallbacks() == 1


# ---------------------------------------------------------------------------- allreduce: the set-up's agreement


def test_who_and_the_error_text():
    assert G.who([(2, "x")]) == "rank 2 (x)"
    assert G.who(iter([(1, "a"), (3, "b")])) == "ranks 1 (a), 3 (b)"
    assert G._text(RuntimeError("a\nb")) == "RuntimeError: a" and G._text(OSError()) == "OSError"
    assert G._text(ValueError("v" * 400)) == "ValueError: " + "v" * 300


def test_the_group_of_a_coordinator(monkeypatch):
    got = []
    monkeypatch.setattr(RA, "group_of", lambda pg, name=None, rank=None, size=None: got.append((pg, name, rank, size))
                        or "group")
    ns = types.SimpleNamespace
    assert G.of_coordinator(None) is RA.SINGLE
    assert G.of_coordinator(ns(world_size=1, cpu_group="pg", rank_in_group=0)) is RA.SINGLE
    assert G.of_coordinator(ns(world_size=None, cpu_group="pg", rank_in_group=0)) is RA.SINGLE
    assert G.of_coordinator(ns(world_size=4, cpu_group=None, rank_in_group=0)) is RA.SINGLE
    assert G.of_coordinator(ns(world_size="4", cpu_group="pg", rank_in_group="2", unique_name="tp:0")) == "group"
    assert G.of_coordinator(ns(world_size=2, cpu_group="pg2", rank_in_group=1)) == "group"
    assert got == [("pg", "tp:0", 2, 4), ("pg2", "tp", 1, 2)]


def test_the_tp_group_is_sglangs_or_single(monkeypatch):
    mod = types.ModuleType("sglang.srt.runtime_context")
    coord = types.SimpleNamespace(world_size=2, cpu_group="pg", rank_in_group=1, unique_name="tp")
    mod.get_parallel = lambda: types.SimpleNamespace(tp_group=coord)
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", mod)
    monkeypatch.setattr(G, "of_coordinator", lambda c: ("of", c))
    assert G.tp_group() == ("of", coord)
    mod.get_parallel = lambda: (_ for _ in ()).throw(AssertionError("not initialized"))
    assert G.tp_group() is RA.SINGLE


def _coord_group(monkeypatch, group):
    monkeypatch.setattr(G, "of_coordinator", lambda c: group)
    return group


def test_the_setup_is_agreed(monkeypatch, caplog):
    on = types.SimpleNamespace(disabled=False)
    grp = _coord_group(monkeypatch, Ranks(2, name="tp:0"))
    assert G.agree_setup("c", on, None) is on                      # on everywhere
    assert grp.topics == ["PCIe-IPC all-reduce set-up of group tp:0"]
    _coord_group(monkeypatch, Ranks(3, lambda t, mine: [None, "RuntimeError: no P2P"], name="tp:0"))
    with caplog.at_level(logging.ERROR, logger="dsv4_sm120"):
        assert G.agree_setup("c", on, None) is None
    assert caplog.messages == ["dsv4_sm120: FlashInfer PCIe-IPC all-reduce set-up failed on rank 2 (RuntimeError: no "
                               "P2P); agreed by all 3 ranks: every rank of group tp:0 all-reduces with NCCL"]
    caplog.clear()
    mine = []
    _coord_group(monkeypatch, Ranks(2, lambda t, m: mine.append(m) or [m], name="g"))
    with caplog.at_level(logging.ERROR, logger="dsv4_sm120"):
        assert G.agree_setup("c", None, RuntimeError("cannot open\nIPC")) is None
        assert G.agree_setup("c", types.SimpleNamespace(disabled=True), None) is None
        assert G.agree_setup("c", None, None) is None
        assert G.agree_setup("c", types.SimpleNamespace(), None) is None
    assert mine == ["RuntimeError: cannot open"] + ["off on this rank (FlashInfer without pcie_ipc_comm, or not a "
                                                    "CUDA device)"] * 3
    assert caplog.messages == []                                   # off on every rank: nothing to say


class _Workspace:
    def __init__(self, fail_build=False, fail_tune=False):
        if fail_build:
            raise RuntimeError("cudaIpcOpenMemHandle failed\ndetails")
        self.fail_tune = fail_tune

    def tune(self, n):
        if self.fail_tune:
            raise ValueError("no config")
        return n


def _comm(cpu_group="cpu"):
    return types.SimpleNamespace(_workspace=None, _workspace_cls=_Workspace, disabled=False, _cpu_group=cpu_group)


def _stock(build=False, tune=False, swallow=True, ok=True):
    """SGLang's _ensure_workspace as it behaves: builds with the class it finds, tunes, logs and swallows errors."""
    def stock(comm, inp):
        try:
            ws = comm._workspace_cls(fail_build=build, fail_tune=tune)
            comm._workspace = ws
            ws.tune(inp)
        except Exception:
            if not swallow:
                raise
            return comm._workspace is not None and ok
        return ok
    return stock


def test_the_workspace_build_and_tune_are_agreed(monkeypatch, caplog):
    grp = Ranks(2, name="tp")
    monkeypatch.setattr(G, "_group_of", lambda comm: grp)
    c = _comm()
    assert G.ensure_workspace(c, 7, lambda inp: _stock()(c, inp)) is True
    assert c._workspace_cls is _Workspace and not c.disabled and grp.topics == ["PCIe-IPC all-reduce workspace"]
    ws = c._workspace
    assert G.ensure_workspace(c, 7, None) is True and len(grp.topics) == 1      # built: no new agreement
    # another rank's build failed: this rank's workspace leaves SGLang's collective destroy
    grp.others = lambda t, m: [{"build": "RuntimeError: x", "tune": None}]
    c = _comm()
    with caplog.at_level(logging.ERROR, logger="dsv4_sm120"):
        assert G.ensure_workspace(c, 7, lambda inp: _stock()(c, inp)) is False
    assert c.disabled and c._build_failed and c._workspace is None and isinstance(c._dsv4_unshared_workspace,
                                                                                     _Workspace)
    assert caplog.messages == ["dsv4_sm120: FlashInfer PCIe-IPC all-reduce workspace build failed on rank 1 "
                               "(RuntimeError: x); agreed by all 2 ranks: every rank of group tp all-reduces with NCCL"]
    assert G.ensure_workspace(c, 7, None) is False                             # decided once
    # only a tune failed somewhere: the workspace stays (no destroy problem), NCCL serves
    grp.others = lambda t, m: [{"build": None, "tune": "ValueError: no config"}]
    c = _comm()
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="dsv4_sm120"):
        assert G.ensure_workspace(c, 7, lambda inp: _stock()(c, inp)) is False
    assert c.disabled and c._build_failed and isinstance(c._workspace, _Workspace)
    assert not hasattr(c, "_dsv4_unshared_workspace")
    assert "workspace tune failed on rank 1 (ValueError: no config)" in caplog.messages[0]


def test_this_ranks_build_and_tune_outcomes_are_what_it_tells_the_others(monkeypatch):
    told = []
    grp = Ranks(2, lambda t, m: told.append(m) or [{"build": None, "tune": None}], name="tp")
    monkeypatch.setattr(G, "_group_of", lambda comm: grp)
    c = _comm()
    assert G.ensure_workspace(c, 1, lambda inp: _stock(build=True)(c, inp)) is False
    c = _comm()
    assert G.ensure_workspace(c, 1, lambda inp: _stock(tune=True)(c, inp)) is False
    c = _comm()
    assert G.ensure_workspace(c, 1, lambda inp: _stock(build=True, swallow=False)(c, inp)) is False
    c = _comm()
    assert G.ensure_workspace(c, 1, lambda inp: _stock(ok=False)(c, inp)) is False
    assert told == [{"build": "RuntimeError: cudaIpcOpenMemHandle failed", "tune": None},
                    {"build": None, "tune": "ValueError: no config"},
                    {"build": "RuntimeError: cudaIpcOpenMemHandle failed", "tune": None},
                    {"build": "not built (SGLang's log says why)", "tune": None}]


def test_a_workspace_class_with_slots_still_builds():
    class Slotted:
        __slots__ = ("n",)

        def __init__(self):
            self.n = 1

        def tune(self):
            raise ValueError("t")

    errors = {}
    ws = G._recording(Slotted, errors)()
    with pytest.raises(ValueError):
        ws.tune()
    assert errors == {}                                            # not recorded, and no AttributeError
    errors = {}
    plain = G._recording(_Workspace, errors)(fail_tune=True)
    with pytest.raises(ValueError):
        plain.tune(1)
    assert errors == {"tune": "ValueError: no config"}
    assert G._recording(_Workspace, errors)().tune(5) == 5


def test_the_group_of_a_communicator(monkeypatch):
    assert G._group_of(types.SimpleNamespace(_cpu_group=None)) is RA.SINGLE
    assert G._group_of(types.SimpleNamespace()) is RA.SINGLE
    tp = types.SimpleNamespace(_pg="cpu")
    monkeypatch.setattr(G, "tp_group", lambda: tp)
    monkeypatch.setattr(RA, "group_of", lambda pg: ("own", pg))
    assert G._group_of(types.SimpleNamespace(_cpu_group="cpu")) is tp
    assert G._group_of(types.SimpleNamespace(_cpu_group="other")) == ("own", "other")


def test_the_recording_class_passes_every_argument_through():
    got = {}

    class Ws:
        def __init__(self, a, b, c=0):
            got["init"] = (a, b, c)

        def tune(self, n, mode="x"):
            got["tune"] = (n, mode)
            return n

    errors = {}
    ws = G._recording(Ws, errors)(1, 2, c=3)
    assert got["init"] == (1, 2, 3) and ws.tune(5, mode="y") == 5 and got["tune"] == (5, "y") and errors == {}

    class NoTune:
        def __init__(self, *a):
            pass

    assert isinstance(G._recording(NoTune, errors)(1), NoTune) and errors == {}


def test_a_coordinator_without_its_fields_is_one_rank(monkeypatch):
    monkeypatch.setattr(RA, "group_of", lambda *a, **k: "group")
    ns = types.SimpleNamespace
    assert G.of_coordinator(ns(cpu_group="pg", rank_in_group=0)) is RA.SINGLE            # no world_size: one rank
    assert G.of_coordinator(ns(world_size=2, rank_in_group=0)) is RA.SINGLE              # no cpu_group
    seen = []
    monkeypatch.setattr(G, "of_coordinator", lambda c: seen.append(c) or Ranks(1))
    G.agree_setup("the coordinator", None, None)
    assert seen == ["the coordinator"]


def test_the_workspace_agreement_runs_once_and_in_the_communicators_group(monkeypatch):
    tp = Ranks(2, lambda t, m: [{"build": "RuntimeError: peer", "tune": None}], name="tp")
    tp._pg = "cpu"
    monkeypatch.setattr(G, "tp_group", lambda: tp)
    c = _comm("cpu")
    inputs = []
    assert G.ensure_workspace(c, "inp", lambda inp: inputs.append(inp) or _stock()(c, inp)) is False
    assert inputs == ["inp"] and tp.topics == ["PCIe-IPC all-reduce workspace"]     # the TP group's agreement
    n = len(tp.topics)
    assert G.ensure_workspace(c, "inp", lambda inp: inputs.append(inp)) is False
    assert inputs == ["inp"] and len(tp.topics) == n                                 # decided: no stock, no agreement
    # SGLang's own code raising before any build: this rank reports that error
    told = []
    grp = Ranks(2, lambda t, m: told.append(m) or [{"build": None, "tune": None}])
    monkeypatch.setattr(G, "_group_of", lambda comm: grp)
    c = _comm()
    assert G.ensure_workspace(c, 1, lambda inp: (_ for _ in ()).throw(KeyError("ws"))) is False
    assert told == [{"build": "KeyError: 'ws'", "tune": None}] and c._workspace_cls is _Workspace


def test_the_group_of_a_communicator_without_a_tp_group(monkeypatch):
    monkeypatch.setattr(G, "tp_group", lambda: RA.SINGLE)                 # the single group has no process group
    monkeypatch.setattr(RA, "group_of", lambda pg: ("own", pg))
    assert G._group_of(types.SimpleNamespace(_cpu_group="cpu")) == ("own", "cpu")


def test_a_second_capture_that_leaves_the_ranks_apart_takes_the_union_again(fresh, caplog):
    b = _bucket()

    def others(topic, mine):
        if topic.endswith("again"):      # rank 1 stepped aside during the second capture
            return [dict(mine, state=_state([["swa", 8, b, "second"]]))]
        return [{"error": "RuntimeError: x", "stepped": True, "stop": False, "state": _state()}]

    _with_group(fresh, Ranks(2, others))
    prefill = type("PrefillCudaGraphRunner", (), dict(model_runner=types.SimpleNamespace(device="cpu"),
                                                      capture_num_tokens=[2, 4]))()
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120"):
        assert GR.retrying(lambda size: "g", prefill)(4) == "g"
    assert A.call_route(2, "swa", 8).backend == A.STOCK
    assert (f"dsv4_sm120 prefill capture of size 4 again: our attention kernel failed on rank 1 (second) at launch "
            f"{b}; rows 2,4 of swa H=8 run {STOCK} on every rank (agreed by all 2 ranks)") in caplog.messages
    assert "dsv4_sm120 prefill: CUDA-graph capture of size 4 again succeeded on all 2 ranks" in caplog.messages


def test_one_rank_whose_second_capture_raises_stops_without_naming_other_ranks(fresh):
    r = A.attention_route(2, "swa")

    def raises(size):
        A.step_aside(2, "swa", 8, r, "cpu", "x")
        raise RuntimeError("again")

    with pytest.raises(RA.StopServer) as e:
        GR.retrying(raises, RUNNER)(8)
    assert str(e.value) == ("dsv4_sm120 decode: CUDA-graph capture of size 8 raised again on rank 0 (RuntimeError: "
                            "again) after every rank took the fallbacks; every rank stops")


def test_the_device_of_a_runner_and_its_fallbacks(fresh):
    import torch

    ns = types.SimpleNamespace
    assert GR._device(ns(model_runner=ns(device="cuda", gpu_id=3))) == torch.device("cuda", 3)
    assert GR._device(ns()) == torch.device("cuda")
    assert GR._device(ns(model_runner=ns(device="no such device"))) == "cpu"
    A.step_aside(2, "swa", 8, A.attention_route(2, "swa"), "cpu", "x", log=False)
    S._switch_moe_path("bf16")
    assert GR.fallbacks() == 2


def test_before_capture_on_a_runner_without_a_model(fresh, caplog):
    seen = []
    fresh.setattr(S, "run_for_runner", lambda mr, rows=None, label="": seen.append((mr, rows, label)) or [])
    _with_group(fresh, Ranks(1))
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120"):
        GR.before_capture(type("DecodeCudaGraphRunner", (), {})())
        GR.before_capture(type("DecodeCudaGraphRunner", (), dict(model_runner=types.SimpleNamespace()))())
    assert caplog.messages == [] and seen == []
    mr = types.SimpleNamespace(model=_model(_Layer(8, 0)), device="cpu")
    GR.before_capture(type("X", (), dict(model_runner=mr, capture_bs=[3]))())
    assert seen == [(mr, [3], "decode")]


def test_before_capture_logs_the_union_with_its_rows(fresh, caplog):
    fresh.setattr(S, "run_for_runner", lambda mr, rows=None, label="": [])
    b = _bucket(4)
    _with_group(fresh, Ranks(2, lambda t, mine: [_state([["swa", 8, b, "w"]])]))
    mr = types.SimpleNamespace(model=_model(_Layer(8, 0)), device="cpu")
    with caplog.at_level(logging.ERROR, logger="dsv4_sm120"):
        GR.before_capture(type("DecodeCudaGraphRunner", (), dict(model_runner=mr, capture_bs=[1, 3]))())
    assert caplog.messages == [f"dsv4_sm120 decode self-check: our attention kernel failed on rank 1 (w) at launch {b}; "
                               f"rows 1,3 of swa H=8 run {STOCK} on every rank (agreed by all 2 ranks)"]


def test_the_union_says_what_changed(fresh, caplog):
    relogs = []
    fresh.setattr(A, "relog", lambda: relogs.append(1))
    b = _bucket()
    GR.adopt_union([_state(), _state()], "x", "cpu")
    assert relogs == []
    GR.adopt_union([_state([["swa", 8, b, "a"]]), _state([["swa", 8, "other bucket", "b"]])], "x", "cpu")
    assert relogs == [1]                              # both launches new here: the decisions are logged again
    GR.adopt_union([_state([["swa", 8, b, "a"]]), _state([["swa", 8, "a new bucket", "c"]])], "x", "cpu")
    assert relogs == [1, 1]                           # the first (in order) new, the second known
    GR.adopt_union([_state([["swa", 8, b, "a"]])], "x", "cpu")
    assert relogs == [1, 1]
    A.disable("attention", "mine")
    GR.adopt_union([_state(off="theirs")], "x", "cpu")
    assert A.disabled("attention") == "mine" and relogs == [1, 1]
    A.reset()
    GR.adopt_union([_state(off="theirs")], "x", "cpu")
    assert relogs == [1, 1, 1]
    with caplog.at_level(logging.ERROR, logger="dsv4_sm120"):
        lines = GR.adopt_union([_state(), _state([["swa_c4", 8, "B", "w"]], moe="bf16")], "x", "cpu")
    assert lines[0] == (f"our attention kernel failed on rank 1 (w) at launch B; rows of that launch of swa_c4 H=8 "
                        f"run {STOCK} on every rank")
    assert lines[1] == "our MoE kernel switched to its bf16 path on rank 1 (); every rank serves on its bf16 path"
    assert S._state["moe_fallback_why"] == "rank 1: "
    assert GR._rows_text([]) == "-" and GR._rows_text([2, 1]) == "1,2"
    assert GR._who([(3, "w" * 300)]) == f"rank 3 ({'w' * 200})"


def test_a_disabled_kernel_is_part_of_the_ranks_state(fresh):
    A.disable("attention", "every launch failed")
    assert GR.ranks_state()["attention_off"] == "every launch failed"
