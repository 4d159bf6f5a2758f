"""The attention self-check's bookkeeping in this process (dsv4_sm120.sglang_glue.selfcheck): the launches a call
of T rows runs (against the launch resolver, dsv4_sm120.attention.launch.row_chunks, on H200 facts), the cases
planned over capture rows, one case checked (its arguments, its result, the boundary of its tolerance), and one
run of the check (its seeds, the rows that step aside and how, what is remembered, the disable, the log lines),
with stand-ins for the case's parts where the test is about the bookkeeping."""

from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover
    pytest.skip("CPU tests need TRITON_INTERPRET=1 (set before triton is imported)", allow_module_level=True)

import torch  # noqa: E402

from dsv4_sm120.attention import config as C  # noqa: E402
from dsv4_sm120.attention import launch as L  # noqa: E402
from dsv4_sm120.attention.config import Device  # noqa: E402
from dsv4_sm120.sglang_glue import attention as A  # noqa: E402
from dsv4_sm120.sglang_glue import selfcheck as S  # noqa: E402
from glue_fixtures import fresh_glue  # noqa: E402

H200 = Device("NVIDIA H200", (9, 0), 132)


@pytest.fixture
def fresh(monkeypatch):
    yield from fresh_glue(monkeypatch, also_unset=("DSV4_SM120_ATTN_WS_MB",), moe_path=None)


PRO6000 = Device("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0), 188)


def _expected(layout, T, H, K1, K2, qk, ov, mb=None, dev=H200):
    """The launches of a call as the resolver plans them: (split, combine) keys per row chunk."""
    from dsv4_sm120 import settings

    cap = int(float(mb if mb is not None else settings.get("DSV4_SM120_ATTN_WS_MB")) * 1048576 / 4)
    out = []
    for _, _, la in L.row_chunks(H, T, K1, K2, dev, qk, ov, False, cap):
        S_ = la.plan[0] + la.plan[2]
        split = tuple(sorted((k, v) for k, v in la.config.items() if k not in C.COMBINE_KEYS))
        comb = tuple(sorted((k, v) for k, v in la.config.items() if k in C.COMBINE_KEYS))
        out += [("split", layout, H, qk, split, S_ == 1, S_ % 16 == 0), ("combine", H % 16 == 0, comb, S_ == 1,
                                                                          S_ % 16 == 0)]
    return tuple(dict.fromkeys(out))


def test_the_launches_of_a_call_are_the_resolvers(fresh):
    fresh.setenv("TRITON_INTERPRET", "0")
    seen = set()
    for layout, K1, K2 in (("swa", 128, 0), ("swa_c4", 128, 512), ("swa_c128", 128, 16384)):
        for H in (8, 16):
            for T in (1, 2, 8, 64, 300, 2048):
                got = S.call_launches(layout, T, H, K1, K2, A.Route("dsv4"), H200)
                assert got == _expected(layout, T, H, K1, K2, "bf16", {}), (layout, H, T)
                seen |= {k[-2:] for k in got}
    assert {(True, False), (False, True)} <= seen          # one split and split counts of 16 both occur
    # a split over both caches (the c4 pool's own splits): on sm_120 with the tiled body
    for T in (1, 8, 64):
        got = S.call_launches("swa_c4", T, 16, 128, 512, A.Route("dsv4", "impl=tiled"), PRO6000)
        assert got == _expected("swa_c4", T, 16, 128, 512, "bf16", {"impl": "tiled"}, dev=PRO6000), T
    # the route's launch keys and QK mode, the user's keys, the workspace cap
    got = S.call_launches("swa_c4", 4, 16, 128, 512, A.Route("dsv4", "BLOCK_N=32", "fp8"), H200)
    assert got == _expected("swa_c4", 4, 16, 128, 512, "fp8", {"BLOCK_N": 32})
    assert got[0][3] == "fp8" and ("BLOCK_N", 32) in got[0][4]
    fresh.setenv("DSV4_SM120_ATTN_CONFIG", "BLOCK_N=16")
    fresh.setenv("DSV4_SM120_ATTN_QK", "fp8")
    got = S.call_launches("swa", 4, 16, 128, 0, A.Route("dsv4"), H200)
    assert got == _expected("swa", 4, 16, 128, 0, "fp8", {"BLOCK_N": 16}) and ("BLOCK_N", 16) in got[0][4]
    fresh.delenv("DSV4_SM120_ATTN_CONFIG")
    fresh.delenv("DSV4_SM120_ATTN_QK")
    fresh.setenv("DSV4_SM120_ATTN_WS_MB", "1")
    got = S.call_launches("swa_c4", 2048, 16, 128, 512, A.Route("dsv4"), H200)
    assert got == _expected("swa_c4", 2048, 16, 128, 512, "bf16", {}, mb=1)
    assert got != _expected("swa_c4", 2048, 16, 128, 512, "bf16", {}, mb=4096)   # the cap chunks the rows here


def _profile(fresh, table):
    class P:
        def bucket_winners(self, name):
            rows = sorted(table.get(name.split(".", 1)[1], {}).items())
            return (rows, "profile P") if rows else ([], "default")

        def decision(self, name, T, default):
            rows = sorted(table.get(name.split(".", 1)[1], {}).items())
            w = next((w for b, w in rows if b >= T), rows[-1][1]) if rows else None
            return (w, "profile P") if w else (default, "default")

        def default_reason(self, name):
            return "default"

        def clear_cache(self):
            pass

    fresh.setattr(A, "_profile", lambda: P())
    A.reset()


def test_the_plan_skips_rows_our_kernel_does_not_serve_and_keeps_going(fresh):
    fresh.setenv("TRITON_INTERPRET", "0")
    _profile(fresh, {"swa": {1: "flashinfer", 4096: "dsv4"}, "swa_c4": {4096: "flashinfer"}})
    sizes = {"K1": 128, "swa_c4": 512, "swa_c128": 1024}
    cases = S.plan_attention([16, 0], [0, -3, 1, 64], H200, sizes)
    assert {(c["layout"], c["T"]) for c in cases} >= {("swa", 64), ("swa_c128", 1)}
    assert not any(c["layout"] == "swa_c4" for c in cases) and not any(c["T"] <= 0 for c in cases)
    assert not any((c["layout"], c["T"]) == ("swa", 1) for c in cases)
    assert {c["H"] for c in cases} == {16}
    only = S.plan_attention([16], [64], H200, sizes, layouts=["swa_c128"])
    assert {c["layout"] for c in only} == {"swa_c128"}


def test_a_row_count_without_a_launch_is_its_own_case(fresh):
    def no_launch(layout, T, H, K1, K2, route, device):
        raise ValueError("no table")

    fresh.setattr(S, "call_launches", no_launch)
    cases = S.plan_attention([8], [2, 4], "cpu", {"K1": 16, "swa_c4": 16, "swa_c128": 8}, layouts=["swa"])
    assert [c["new"] for c in cases] == [[("swa", 8, "error", 2, "ValueError")], [("swa", 8, "error", 4, "ValueError")]]
    assert [c["rows"] for c in cases] == [[2], [4]]


# ---------------------------------------------------------------------------- one case


def _stand_ins(fresh, out_value=51.0, ref_value=50.0, raise_=None):
    got = {}

    def case(layout, T, H, device, seed, sizes, pool):
        got["case"] = (layout, T, H, device, seed, sizes, pool)
        return {"q": torch.zeros(T, 1, H, 4), "kw": {"indices": torch.zeros(T, 1, 2)}, "K1": 16,
                "K2": 16 if layout != "swa" else 0}

    def ours(q, H, kw, launch, qk):
        got["ours"] = (q.shape, H, launch, qk)
        if raise_ is not None:
            raise raise_
        return torch.full((q.shape[0], 1, H, 4), out_value)

    def ref(q, kw):
        got["pick"] = kw["indices"].shape[0]
        return torch.full((q.shape[0], 1, q.shape[2], 4), ref_value)

    fresh.setattr(S, "attention_case", case)
    fresh.setattr(A, "run_dsv4_kernel", ours)
    fresh.setattr(S, "stock_reference", ref)
    return got


def test_one_case_passes_its_arguments_and_reports_its_result(fresh):
    got = _stand_ins(fresh)
    case = {"layout": "swa_c4", "H": 1, "T": 1, "route": A.Route("dsv4", "BLOCK_N=32", "fp8"), "rows": [1, 3],
            "other_rows": [("swa", 1)], "new": ["a", "b", "c"]}
    pool = {}
    res = S._check_one(case, "dev", seed=7, sizes={"K1": 16}, pool=pool)
    assert got["case"] == ("swa_c4", 1, 1, "dev", 7, {"K1": 16}, pool) and got["case"][6] is pool
    assert got["ours"] == (torch.Size([1, 1, 1, 4]), 1, "BLOCK_N=32", "fp8")
    seconds = res.pop("seconds")
    assert 0 <= seconds < 5
    # 1 / 50 is the fp8 tolerance's neighbour: exactly at 2e-2, within 5e-2
    assert res == {"kernel": "attention", "layout": "swa_c4", "H": 1, "T": 1, "rows": [1, 3], "other_rows": [("swa", 1)], "launches": 3, "tol": 5e-2, "err": 0.02, "ok": True, "error": None,
                   "shape": "swa_c4 T=1 H=1 K=16+16 launch=BLOCK_N=32 qk=fp8"}
    del case["other_rows"]
    case["route"] = A.Route("dsv4")
    res = S._check_one(case, "dev", seed=7, sizes={"K1": 16})
    assert res["ok"] is True and res["err"] == 0.02 == res["tol"]          # at the bound: passes
    assert res["other_rows"] == [] and got["case"][6] is None and got["ours"][2:] == (None, None)
    assert res["shape"] == "swa_c4 T=1 H=1 K=16+16 launch=default"
    _stand_ins(fresh, out_value=51.01)
    assert S._check_one(dict(case, layout="swa"), "dev", seed=7, sizes={})["ok"] is False


def test_one_case_compares_the_sampled_rows(fresh):
    got = _stand_ins(fresh)
    case = {"layout": "swa", "H": 2, "T": 20, "route": A.Route("dsv4"), "rows": [20], "new": ["a"]}
    res = S._check_one(case, "cpu", seed=1, sizes={})
    assert got["pick"] == 8 and res["shape"] == "swa T=20 H=2 K=16 launch=default"


def test_a_case_that_raises_reports_the_error(fresh):
    _stand_ins(fresh, raise_=RuntimeError("z" * 400))
    res = S._check_one({"layout": "swa", "H": 1, "T": 1, "route": A.Route("dsv4"), "rows": [1], "new": []}, "cpu",
                       seed=1, sizes={})
    assert res["ok"] is False and res["err"] is None and res["error"] == "RuntimeError: " + "z" * 300


def test_an_unknown_qk_setting_is_not_block_scaled(fresh):
    fresh.setenv("DSV4_SM120_ATTN_QK", "bogus")
    assert S._qk_is_fp8(None) is False and S._qk_is_fp8("fp8") is True and S._qk_is_fp8("nope") is False


# ---------------------------------------------------------------------------- one run


def _plan(cases):
    return lambda heads, rows, device, sizes, skip=None, layouts=None: [dict(c) for c in cases if not any(
        k in (skip or {}) for k in c["new"])]


def _case(layout, T, H, new, rows=None, other_rows=()):
    return {"layout": layout, "T": T, "H": H, "route": A.Route("dsv4"), "keys": tuple(new), "new": list(new),
            "rows": list(rows or [T]), "other_rows": list(other_rows)}


def _results(outcomes):
    calls = []

    def check(case, device, seed, sizes, pool=None):
        calls.append(dict(case=case, device=device, seed=seed, sizes=sizes, pool=pool))
        err = outcomes.get((case["layout"], case["T"]))
        ok = err is None
        return {"kernel": "attention", "layout": case["layout"], "H": case["H"], "T": case["T"],
                "rows": list(case["rows"]), "other_rows": list(case["other_rows"]), "launches": len(case["new"]),
                "tol": 0.02, "err": 0.0123 if ok else 1.0, "ok": ok, "error": None if ok else err,
                "shape": f"{case['layout']} T={case['T']} H={case['H']}", "seconds": 0.1}
    return check, calls


def test_a_run_checks_each_case_with_its_seed_and_steps_failed_rows_aside(fresh, caplog):
    cases = [_case("swa", 1, 16, ["s1"]), _case("swa", 4, 16, ["s4"], rows=[4, 8]),
             _case("swa_c4", 2, 16, ["c2"], other_rows=[("swa_c128", 2)])]
    fresh.setattr(S, "plan_attention", _plan(cases))
    check, calls = _results({("swa", 4): "relative error 1 > tolerance 0.02", ("swa_c4", 2): "RuntimeError: x"})
    fresh.setattr(S, "_check_one", check)
    steps = []
    fresh.setattr(A, "step_aside", lambda *a, **k: steps.append((a, k)))
    relogs = []
    fresh.setattr(A, "relog", lambda: relogs.append(1))
    fresh.setenv("TRITON_INTERPRET", "0")
    dev = torch.device("cuda", 0)
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        out = S.run([16], dev, rows=[1, 4, 2], context_len=100_000, label="decode")
    assert [c["seed"] for c in calls] == [16000, 16001, 16012]                 # 1000 H + 10 layout + case
    assert all(c["device"] == dev for c in calls)
    assert all(c["sizes"] == {"K1": 128, "swa_c4": 512, "swa_c128": 832} for c in calls)
    assert calls[0]["pool"] == {} and all(c["pool"] is calls[0]["pool"] for c in calls)
    assert [c["ok"] for c in out] == [True, False, False]
    assert S._state["checked"] == {"s1": None, "s4": "swa T=4 H=16: relative error 1 > tolerance 0.02",
                                   "c2": "swa_c4 T=2 H=16: RuntimeError: x"}
    assert [(a[:3], a[4:], k) for a, k in steps] == [
        (a, (dev, "relative error 1 > tolerance 0.02"), {"during": "self-check", "log": False})
        for a in [(4, "swa", 16), (8, "swa", 16)]] + [
        (a, (dev, "RuntimeError: x"), {"during": "self-check", "log": False})
        for a in [(2, "swa_c4", 16), (2, "swa_c128", 16)]]
    assert [a[3] for a, _ in steps] == [A.attention_route(4, "swa"), A.attention_route(8, "swa"),
                                        A.attention_route(2, "swa_c4"), A.attention_route(2, "swa_c128")]
    assert A.disabled("attention") is None and relogs == [1]
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [
        "dsv4_sm120 self-check: our attention kernel FAILED at swa T=4 H=16: relative error 1 > tolerance 0.02; rows "
        "4,8 of swa H=16 step aside to SGLang's stock path (their launch), the other rows keep our kernel",
        "dsv4_sm120 self-check: our attention kernel FAILED at swa_c4 T=2 H=16: RuntimeError: x; rows 2 of swa_c4 "
        "H=16 step aside to SGLang's stock path (their launch), the other rows keep our kernel"]
    info = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert len(info) == 1 and info[0].startswith("dsv4_sm120 self-check (decode): attention 3 launches over rows "
                                                 "1,2,4: 1 ok (max error 0.012), 2 failed, in ")
    assert float(info[0].split(" in ")[-1].split(" s")[0]) < 5
    # a second runner: checked launches are not run again; force runs everything again
    calls.clear()
    assert len(S.run([16], dev, rows=[1, 4])) == 3 and calls == []
    S.run([16], dev, rows=[1, 4], force=True)
    assert len(calls) == 3 and len(S.results()["attention"]) == 3


def test_a_run_where_every_launch_fails_disables_the_kernel(fresh, caplog):
    fresh.setattr(S, "plan_attention", _plan([_case("swa", 2, 8, ["a"]), _case("swa_c4", 2, 8, ["b"])]))
    check, _ = _results({("swa", 2): "E1", ("swa_c4", 2): "E2"})
    fresh.setattr(S, "_check_one", check)
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        S.run([8], "cpu", rows=[2])
    assert A.disabled("attention") == "swa T=2 H=8: E1"
    assert ("dsv4_sm120 self-check: every launch of our attention kernel failed; disabled in this process, SGLang's "
            "stock path serves instead") in caplog.messages
    assert any(m.startswith("dsv4_sm120 self-check: attention 2 launches over rows 2: 0 ok (max error -), 2 failed")
               for m in caplog.messages)
    # enabled again (a reset of the routes only): nothing new to check, every case failed: disabled again
    A.reset()
    S.run([8], "cpu", rows=[2])
    assert A.disabled("attention") == "self-check failed"


def test_a_run_with_nothing_to_check(fresh, caplog):
    planned = []
    fresh.setattr(S, "plan_attention", lambda *a, **k: planned.append(a) or [])
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        assert S.run([], "cpu", rows=[2]) == [] and planned == []
        assert S.run([8], "cpu", rows=[2]) == [] and len(planned) == 1
    assert caplog.messages == ["dsv4_sm120 self-check: our attention kernel does not serve here; nothing to check"] * 2
    S._state["attention"] = [{"ok": True}]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        S.run([8], "cpu", rows=[2])
    assert caplog.messages == []                                           # cases from before: no such line


def test_the_launches_under_the_interpreter_and_near_the_workspace_cap(fresh):
    from dsv4_sm120 import settings

    fresh.setenv("TRITON_INTERPRET", "1")
    want = []
    for _, _, la in L.row_chunks(8, 4, 16, 16, H200, "bf16", {}, True,
                                 int(settings.get("DSV4_SM120_ATTN_WS_MB") * 1048576 / 4)):
        S_ = la.plan[0] + la.plan[2]
        want.append(("split", "swa_c4", 8, "bf16", tuple(sorted((k, v) for k, v in la.config.items()
                                                                  if k not in C.COMBINE_KEYS)), S_ == 1, S_ % 16 == 0))
    assert S.call_launches("swa_c4", 4, 8, 16, 16, A.Route("dsv4"), H200)[0] == want[0]
    fresh.setenv("TRITON_INTERPRET", "0")
    # a cap where 4/5 of it chunks the rows differently: the exact cap counts
    for mb in range(1, 400):
        full, less = (_expected("swa_c4", 2048, 16, 128, 512, "bf16", {}, mb=mb * f) for f in (1, 0.8))
        if full != less:
            break
    else:
        pytest.fail("no workspace size chunks differently at 4/5 of it")
    fresh.setenv("DSV4_SM120_ATTN_WS_MB", str(mb))
    assert S.call_launches("swa_c4", 2048, 16, 128, 512, A.Route("dsv4"), H200) == full


def test_a_split_count_of_16_over_both_caches(fresh):
    fresh.setenv("TRITON_INTERPRET", "0")
    r = A.Route("dsv4", "spanning_splits=0")
    got = S.call_launches("swa_c4", 24, 16, 128, 4096, r, PRO6000)
    assert got == _expected("swa_c4", 24, 16, 128, 4096, "bf16", {"spanning_splits": 0}, dev=PRO6000)
    assert got[0][-1] is True                            # 1 main + 15 extra splits


def test_a_failed_launch_steps_aside_by_its_layouts_route(fresh):
    _profile(fresh, {"swa": {64: "dsv4+fp8qk"}})
    fresh.setattr(S, "plan_attention", _plan([_case("swa", 4, 16, ["s4"])]))
    check, _ = _results({("swa", 4): "E"})
    fresh.setattr(S, "_check_one", check)
    steps = []
    fresh.setattr(A, "step_aside", lambda *a, **k: steps.append(a))
    before = A.attention_route(4, "swa")
    S.run([16], "cpu", rows=[4])
    assert steps[0][3] == before and before.qk == "fp8" and before.backend == "dsv4"


def test_an_earlier_disable_keeps_its_reason(fresh, caplog):
    A.disable("attention", "earlier")
    fresh.setattr(S, "plan_attention", _plan([_case("swa", 2, 8, ["a"])]))
    check, _ = _results({("swa", 2): "E1"})
    fresh.setattr(S, "_check_one", check)
    with caplog.at_level(logging.ERROR, logger="dsv4_sm120"):
        S.run([8], "cpu", rows=[2])
    assert A.disabled("attention") == "earlier"
    assert not any("every launch of our attention kernel failed" in m for m in caplog.messages)
