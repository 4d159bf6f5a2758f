"""dsv4_sm120.rank_agreement: every rank gets every rank's status, bounded in time, never mis-paired.

* in this process: one rank (no torch.distributed, or a group of one) agrees with itself at no cost; a status
  that is not short is a bug of the caller; the settings of the agreement are validated;
* 4 ranks of a CPU gloo world, each a forked process (tests/rank_harness.py; every rank killed at the end
  whatever happens): three rounds give every rank the same statuses in rank order; a rank that never answers
  makes every other rank stop within the setting's limit with one line naming it; a rank that arrives at another
  agreement than the others makes every rank stop, naming it and both topics (the same line on every rank); when
  the rank hosting the rendezvous store has gone, the others stop with a line that says so instead of waiting.
The same agreements through the patched SGLang's groups, with faults in the glue's paths:
tests/test_rank_agreement_sglang.py."""

from __future__ import annotations

import json
import os

import pytest

from conftest import OVERLAY, REPO

from dsv4_sm120 import rank_agreement as RA
from dsv4_sm120 import settings


def test_one_rank_agrees_with_itself():
    assert RA.group_of() is RA.SINGLE                    # no torch.distributed world in this process
    assert RA.agree("anything", {"a": [1, 2]}) == [{"a": [1, 2]}]
    assert RA.SINGLE.agree("x", None) == [None]
    with pytest.raises(ValueError, match="status of"):
        RA.SINGLE.agree("big", "x" * (RA.MAX_STATUS_BYTES + 1))
    with pytest.raises(ValueError):
        RA.Group(None, rank=4, size=4)
    assert issubclass(RA.RankTimeout, RuntimeError) and issubclass(RA.RanksDisagree, RA.StopServer)
    assert not issubclass(RA.StopServer, SystemExit)     # SGLang's scheduler catches Exception, not SystemExit


def test_the_agreement_settings_are_validated():
    assert settings.get("DSV4_SM120_RANK_AGREE_TIMEOUT_S", {}) == 600.0
    for bad in ("0", "-1", "soon"):
        assert settings.validate({"DSV4_SM120_RANK_AGREE_TIMEOUT_S": bad}), bad
    for ok in ("", "2", "0,3", " 1 , 2 "):
        assert settings.validate({"DSV4_SM120_TEST_FAULT_RANKS": ok}) == [], ok
    for bad in ("rank1", "1;2", "-1"):
        assert settings.validate({"DSV4_SM120_TEST_FAULT_RANKS": bad}), bad


def _harness(python_child, specs, timeout=120):
    code = ("import json, sys; sys.path.insert(0, 'tests'); import rank_harness as H; "
            "print('RESULT' + json.dumps(H.run(json.loads(sys.argv[1]))))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_SM120_")}
    env["PYTHONPATH"] = str(OVERLAY)
    r = python_child(code, args=[json.dumps(specs)], env=env, cwd=REPO, timeout=timeout)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert lines, r.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT"):])


@pytest.fixture(scope="module")
def plain(python_child):
    return _harness(python_child, [
        {"name": "rounds", "fn": "rank_scenarios:agree_rounds", "ranks": 4},
        {"name": "missing", "fn": "rank_scenarios:agree_one_missing", "ranks": 4, "args": {"missing": 3},
         "env": {"DSV4_SM120_RANK_AGREE_TIMEOUT_S": "1.5"}, "wait_for": [0, 1, 2], "deadline": 15},
        {"name": "mispaired", "fn": "rank_scenarios:agree_mispaired", "ranks": 4, "args": {"odd": 1}},
        {"name": "store_gone", "fn": "rank_scenarios:agree_store_host_exits", "ranks": 2, "wait_for": [1],
         "deadline": 15},
    ])


def test_every_rank_gets_every_status_in_rank_order(plain):
    out = plain["rounds"]
    assert out["unfinished"] == [] and all(r["error"] is None for r in out["ranks"]), out
    want = [[{"rank": r, "value": r * r + i} for r in range(4)] for i in range(3)]
    for r in out["ranks"]:
        res = r["result"]
        assert res["statuses"] == want and res["same"], res
        assert res["group"] == ["world", r["rank"], 4, 3]


def test_a_rank_that_never_answers_stops_the_others_in_time_naming_it(plain):
    out = plain["missing"]
    assert out["unfinished"] == [3], out                         # the silent rank, killed by the harness
    for r in out["ranks"][:3]:
        res = r["result"]
        assert res["stop"] and res["missing"] == [3], res
        assert 1.4 < res["waited"] < 6, res                       # the setting's 1.5 s, not a hang
        assert res["error"] == ("dsv4_sm120: rank 3 of group world (4 ranks) did not reach agreement 'second' "
                                "(step 1) within 1.5 s (DSV4_SM120_RANK_AGREE_TIMEOUT_S); the server stops instead "
                                "of hanging"), res


def test_a_mispaired_agreement_is_named_never_paired(plain):
    out = plain["mispaired"]
    assert out["unfinished"] == [], out
    lines = {r["result"]["error"] for r in out["ranks"]}
    assert lines == {"dsv4_sm120: the ranks of group world met at step 1 at different agreements: rank 1 at "
                     "'capture of size 8 again'; ranks 0, 2, 3 at 'capture of size 4'; the server stops instead of "
                     "pairing them"}, lines
    assert all(r["result"]["topics"]["1"] == "capture of size 8 again" for r in out["ranks"])


def test_the_store_host_gone_stops_the_others_with_one_line(plain):
    r = plain["store_gone"]["ranks"][1]["result"]
    assert r["error"] and "cannot reach the rendezvous store" in r["error"] and "rank 0" in r["error"], r
    assert "\n" not in r["error"] and r["waited"] < 10, r
