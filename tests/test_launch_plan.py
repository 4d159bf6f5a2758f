"""The launch plan of a call (dsv4_sm120.attention.launch_plan): the QK-mode rule, the merge of the settings, a
profile's launch and the call's launch= keys with where each came from, the table entry and the row chunks under the
workspace cap. Expectations are written out (truth tables) or computed from config.resolve and the workspace layout
(514 / 258 four-byte words per row, split and padded head), not from the plan itself."""

from __future__ import annotations

import pytest

from dsv4_sm120.attention import config as C
from dsv4_sm120.attention import launch_plan as LP
from dsv4_sm120.attention.keys import DecodeInputError

H200 = C.Device("NVIDIA H200", (9, 0), 132)
PRO6000 = C.Device("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0), 188)


@pytest.mark.parametrize("call,setting,profile,want", [
    (None, None, None, ("bf16", "default")),
    (None, None, "fp8", ("fp8", "profile")),
    (None, "bf16", "fp8", ("bf16", "setting")),
    (None, "auto", "fp8", ("bf16", "setting")),      # a set setting wins even when it says auto
    (None, "fp8", None, ("fp8", "setting")),
    ("bf16", "fp8", "fp8", ("bf16", "qk_mode=")),
    ("fp8", "bf16", None, ("fp8", "qk_mode=")),
    ("auto", None, "fp8", ("bf16", "qk_mode=")),
    (None, "  ", "fp8", ("fp8", "profile")),          # blank: unset
])
def test_the_qk_rule(call, setting, profile, want):
    env = {} if setting is None else {"DSV4_SM120_ATTN_QK": setting}
    assert LP.settle_qk(call, profile, env) == want
    assert LP.qk_mode(call, env) == LP.settle_qk(call, None, env)[0]


def test_bad_qk_modes_are_refused_naming_the_mode():
    with pytest.raises(DecodeInputError, match="qk_mode must be one of auto, bf16, fp8, got 'int8'"):
        LP.settle_qk("int8")
    with pytest.raises(DecodeInputError, match="DSV4_SM120_ATTN_QK"):
        LP.settle_qk(None, None, {"DSV4_SM120_ATTN_QK": "int8"})


def test_the_launch_keys_and_where_each_came_from():
    assert LP.launch_keys(env={}) == ({}, {})
    assert LP.launch_keys(None, "impl=reg", {}) == ({"impl": "reg"}, {"impl": "profile"})
    env = {"DSV4_SM120_ATTN_CONFIG": "impl=tiled,BLOCK_N=32"}
    # the setting replaces the profile's keys whole; the call's keys go over it
    assert LP.launch_keys(None, "impl=reg,late_decode=1", env) == ({"impl": "tiled", "BLOCK_N": 32},
                                                                    {"impl": "setting", "BLOCK_N": "setting"})
    keys, src = LP.launch_keys("impl=reg", "late_decode=1", env)
    assert keys == {"impl": "reg", "BLOCK_N": 32} and src == {"impl": "launch=", "BLOCK_N": "setting"}
    assert LP.launch_keys({"impl": "reg", "waves": 2.0}, None, {}) == ({"impl": "reg", "waves": 2.0},
                                                                      {"impl": "launch=", "waves": "launch="})
    with pytest.raises(DecodeInputError, match="launch: unknown key 'bogus'"):
        LP.launch_keys("bogus=1", None, {})
    with pytest.raises(DecodeInputError, match="DSV4_SM120_ATTN_CONFIG"):
        LP.launch_keys(None, None, {"DSV4_SM120_ATTN_CONFIG": "impl=nope"})


def test_a_profile_winner_in_force_under_the_settings():
    assert LP.profile_in_force("impl=reg", "fp8", {}) == ("impl=reg", "fp8")
    assert LP.profile_in_force("impl=reg", "fp8", {"DSV4_SM120_ATTN_CONFIG": "impl=tiled"}) == (None, "fp8")
    assert LP.profile_in_force("impl=reg", "fp8", {"DSV4_SM120_ATTN_QK": "bf16"}) == ("impl=reg", None)
    assert LP.profile_in_force(None, None, {"DSV4_SM120_ATTN_QK": "bf16"}) == (None, None)


def _words(launch, rows, H):
    bh = launch.config["BLOCK_H"]
    hp = -(-H // bh) * bh
    per = 258 if launch.config.get("PART_BF16", 0) and launch.config["impl"] != "flat" else 514
    return rows * (launch.plan[0] + launch.plan[2]) * hp * per


@pytest.mark.parametrize("dev", [H200, PRO6000])
def test_one_launch_when_the_workspace_fits(dev):
    p = LP.plan_call(16, 24, dev, 128, 512, env={}, interpret=False)
    want = C.resolve(16, 24, 128, 512, dev, qk="bf16", overrides={}, call_rows=24)
    (chunk,) = p.chunks
    assert (chunk.t0, chunk.t1, chunk.launch) == (0, 24, want)
    assert p.entry == C.table_entry(16, 24, "bf16", dev)[1] and p.qk_from == "default"


def test_rows_are_halved_until_the_workspace_fits():
    T, H, K1, K2 = 1001, 16, 128, 512
    one = C.resolve(H, T, K1, K2, H200, qk="bf16", overrides={}, call_rows=T)
    cap = _words(one, T, H) // 5                       # the call's rows do not fit one launch
    p = LP.plan_call(H, T, H200, K1, K2, env={}, interpret=False, cap_words=cap)
    TC = T
    while TC > 1 and _words(C.resolve(H, TC, K1, K2, H200, qk="bf16", overrides={}, call_rows=T), TC, H) > cap:
        TC = (TC + 1) // 2
    assert 1 < TC < T and T % TC                        # several launches, the last one shorter
    assert [(c.t0, c.t1) for c in p.chunks] == [(t, min(T, t + TC)) for t in range(0, T, TC)]
    for c in p.chunks:
        assert c.launch == C.resolve(H, c.t1 - c.t0, K1, K2, H200, qk="bf16", overrides={}, call_rows=T)
        assert _words(c.launch, c.t1 - c.t0, H) <= cap
    env = {"DSV4_SM120_ATTN_WS_MB": str(cap * 4 / (1 << 20))}
    assert LP.plan_call(H, T, H200, K1, K2, env=env, interpret=False).chunks == p.chunks


def test_the_call_keys_reach_the_chunks_with_their_sources():
    env = {"DSV4_SM120_ATTN_CONFIG": "BLOCK_N=32", "DSV4_SM120_ATTN_QK": "fp8"}
    p = LP.plan_call(16, 8, H200, 128, 0, launch="impl=tiled", env=env, interpret=False)
    assert (p.qk, p.qk_from) == ("fp8", "setting")
    (c,) = p.chunks
    assert c.launch == C.resolve(16, 8, 128, 0, H200, qk="fp8", overrides={"impl": "tiled", "BLOCK_N": 32},
                                 call_rows=8)
    src = c.sources()
    assert src["impl"] == "launch=" and src["BLOCK_N"] == "setting" and src["BLOCK_D"] == "combine plan"
    assert src["num_warps"] == f"table {c.launch.source}" and c.launch.source.endswith("]")
    assert p.entry == C.table_entry(16, 8, "fp8", H200, "tiled")[1]


def test_the_interpreter_plan():
    p = LP.plan_call(8, 3, C.Device("cpu", None, 4), 16, 8, env={}, interpret=True)
    assert p.entry == "interpreter"
    (c,) = p.chunks
    assert c.launch.source == "interpreter" and c.sources()["BLOCK_N"] == "interpreter"
    assert c.launch.config["impl"] == "tiled" and c.launch.config["BLOCK_N"] == 16


def test_the_entry_alone_needs_no_candidates_and_bad_input_fails_at_once():
    p = LP.plan_call(16, 4, H200, env={}, interpret=False)
    assert p.entry == C.table_entry(16, 4, "bf16", H200)[1]
    with pytest.raises(DecodeInputError, match="candidate counts"):
        p.chunks
    with pytest.raises(DecodeInputError, match="qk_mode"):
        LP.plan_call(16, 4, H200, qk="fp16")
    with pytest.raises(DecodeInputError, match="has no fp8 QK path"):
        LP.plan_call(16, 4, H200, 128, 0, qk="fp8", launch="impl=reg", env={}, interpret=False).chunks
