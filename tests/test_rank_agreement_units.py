"""dsv4_sm120.rank_agreement in this process (the multi-process behaviour: tests/test_rank_agreement.py): the ranks
of a group are Group objects over one torch ``HashStore`` (the store type torch.distributed hands the real groups),
each rank in a thread, so `make mutate` sees every line run. Expectations are written out: the key layout, the
JSON each rank posts, the exact one-line messages, the size limit, the timeout and its setting, the store's own
errors, and the group of a torch.distributed world."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch.distributed as dist

from dsv4_sm120 import rank_agreement as RA


def _ranks(n, name="g", store=None):
    store = store if store is not None else dist.HashStore()
    return store, [RA.Group(store, r, n, name) for r in range(n)]


def _together(groups, calls, timeout=None):
    """Each group's ``agree(*calls[rank])`` in its own thread; returns {rank: result or exception}."""
    out = {}

    def one(g, args):
        try:
            out[g.rank] = g.agree(*args, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - returned for the test to check
            out[g.rank] = e

    ts = [threading.Thread(target=one, args=(g, calls[g.rank])) for g in groups]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert not any(t.is_alive() for t in ts)
    return out


def test_every_rank_posts_its_key_and_reads_every_rank_in_order():
    store, gs = _ranks(3, "tp")
    out = _together(gs, {r: ("first", {"r": r, "v": [r] * r}) for r in range(3)})
    want = [{"r": 0, "v": []}, {"r": 1, "v": [1]}, {"r": 2, "v": [2, 2]}]
    assert out == {0: want, 1: want, 2: want}
    for r in range(3):     # the key layout and the JSON of the module doc
        raw = store.get(f"dsv4_sm120/agree/tp/0/{r}").decode()
        assert raw == json.dumps({"status": want[r], "topic": "first"}, sort_keys=True)
    out = _together(gs, {r: ("second", r * 10) for r in range(3)})
    assert out == {r: [0, 10, 20] for r in range(3)}
    assert store.check(["dsv4_sm120/agree/tp/1/0", "dsv4_sm120/agree/tp/1/2"])
    assert [g.step for g in gs] == [2, 2, 2] and repr(gs[1]) == "Group('tp', rank 1 of 3, step 2)"


def test_a_status_of_the_size_limit_passes_one_byte_more_does_not():
    frame = len(json.dumps({"topic": "t", "status": ""}, sort_keys=True))
    fits = "x" * (RA.MAX_STATUS_BYTES - frame)
    assert RA.SINGLE.agree("t", fits) == [fits]
    with pytest.raises(ValueError) as e:
        RA.SINGLE.agree("t", fits + "y")
    assert str(e.value) == f"agreement 't': status of {RA.MAX_STATUS_BYTES + 1} bytes (at most 16384)"
    assert RA.MAX_STATUS_BYTES == 16384
    g = RA.Group(None, 0, 1, "one")
    assert g.agree("t", (1, 2)) == [[1, 2]] and g.step == 1        # through JSON, as the other ranks see it
    with pytest.raises(ValueError, match="rank -1 is not in a group of 2"):
        RA.Group(None, -1, 2)
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2"):
        RA.Group(None, 2, 2)
    assert RA.Group(None, 1, 2).name == "group"


def test_a_missing_rank_times_out_naming_it_within_the_limit(monkeypatch):
    store, gs = _ranks(3, "tp")
    t0 = time.monotonic()
    with pytest.raises(RA.RankTimeout) as e:
        gs[0].agree("capture of size 8", None, timeout=0.3)
    waited = time.monotonic() - t0
    assert 0.3 <= waited < 1.5, waited
    assert e.value.missing == [1, 2]
    assert str(e.value) == ("dsv4_sm120: ranks 1, 2 of group tp (3 ranks) did not reach agreement 'capture of size "
                            "8' (step 0) within 0.3 s (DSV4_SM120_RANK_AGREE_TIMEOUT_S); the server stops instead "
                            "of hanging")
    # the setting is the default limit
    monkeypatch.setenv("DSV4_SM120_RANK_AGREE_TIMEOUT_S", "0.2")
    assert RA.timeout_s() == 0.2
    store, gs = _ranks(3, "tp")
    store.set("dsv4_sm120/agree/tp/0/1", json.dumps({"topic": "x", "status": None}))
    t0 = time.monotonic()
    with pytest.raises(RA.RankTimeout) as e:
        gs[0].agree("x")
    assert 0.2 <= time.monotonic() - t0 < 1.0
    assert e.value.missing == [2] and str(e.value).startswith("dsv4_sm120: rank 2 of group tp (3 ranks) did not ")
    assert "within 0.2 s" in str(e.value) and "(step 0)" in str(e.value)
    store, gs = _ranks(2, "w")
    with pytest.raises(RA.RankTimeout, match=r"^dsv4_sm120: rank 1 of group w \(2 ranks\)"):
        gs[0].agree("y", timeout=0.05)


def test_ranks_that_arrive_late_but_in_time_agree():
    store, gs = _ranks(2, "tp")
    res = {}

    def late():
        time.sleep(0.3)
        res[1] = gs[1].agree("t", "b", timeout=5)

    t = threading.Thread(target=late)
    t.start()
    res[0] = gs[0].agree("t", "a", timeout=5)
    t.join(10)
    assert res == {0: ["a", "b"], 1: ["a", "b"]}


def test_a_mispaired_agreement_names_the_odd_ranks_the_same_line_everywhere():
    _, gs = _ranks(3, "tp")
    out = _together(gs, {0: ("a", 0), 1: ("b", 1), 2: ("a", 2)})
    lines = {str(e) for e in out.values()}
    assert all(isinstance(e, RA.RanksDisagree) for e in out.values())
    assert lines == {"dsv4_sm120: the ranks of group tp met at step 0 at different agreements: rank 1 at 'b'; "
                     "ranks 0, 2 at 'a'; the server stops instead of pairing them"}
    assert out[2].topics == {0: "a", 1: "b", 2: "a"}
    # a tie: rank 0's topic is the common one
    _, gs = _ranks(4, "tp")
    out = _together(gs, {0: ("b", 0), 1: ("a", 1), 2: ("a", 2), 3: ("b", 3)})
    assert {str(e) for e in out.values()} == {
        "dsv4_sm120: the ranks of group tp met at step 0 at different agreements: rank 1 at 'a'; rank 2 at 'a'; "
        "ranks 0, 3 at 'b'; the server stops instead of pairing them"}
    _, gs = _ranks(3, "tp")
    out = _together(gs, {0: ("z", 0), 1: ("a", 1), 2: ("a", 2)})
    assert "rank 0 at 'z'; ranks 1, 2 at 'a'" in str(out[1])


class _Broken:
    def __init__(self, fail_on, inner=None):
        self.fail_on, self.inner = fail_on, inner or dist.HashStore()

    def __getattr__(self, name):
        if name == self.fail_on:
            def fail(*a, **k):
                raise ConnectionResetError("Connection reset by peer\nsecond line")
            return fail
        return getattr(self.inner, name)


@pytest.mark.parametrize("op,what", [("set", "posting"), ("check", "waiting at"), ("multi_get", "reading")])
def test_the_store_gone_stops_with_one_line(op, what):
    inner = dist.HashStore()
    inner.set("dsv4_sm120/agree/g/0/1", json.dumps({"topic": "t", "status": None}))
    g = RA.Group(_Broken(op, inner), 0, 2, "g")
    with pytest.raises(RA.StopServer) as e:
        g.agree("t", timeout=2)
    assert str(e.value) == (f"dsv4_sm120: rank 0 of group g cannot reach the rendezvous store while {what} agreement "
                            "'t' (ConnectionResetError: Connection reset by peer); the process hosting it (rank 0) "
                            "has probably exited; the server stops")
    assert not isinstance(e.value, (RA.RankTimeout, RA.RanksDisagree))


def test_the_store_gone_with_an_empty_error_message():
    g = RA.Group(_Broken("set"), 1, 2, "g")
    e = g._store_down("posting agreement 't'", OSError())
    assert str(e) == ("dsv4_sm120: rank 1 of group g cannot reach the rendezvous store while posting agreement 't' "
                      "(OSError: ); the process hosting it (rank 0) has probably exited; the server stops")


@pytest.fixture
def world():
    """A torch.distributed world of one rank in this process (gloo, an in-memory store), destroyed after."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    RA.forget()
    try:
        yield dist.group.WORLD
    finally:
        RA.forget()
        dist.destroy_process_group()


def test_the_group_of_a_torch_world(world):
    assert RA.group_of() is RA.SINGLE                       # a world of one: no store, no cost
    assert RA.process_rank() == 0
    g = RA.group_of(rank=1, size=2)                         # as SGLang's coordinators give rank and size
    assert (g.name, g.rank, g.size, g.step) == ("world", 1, 2, 0)
    assert RA.group_of(rank=1, size=2) is g                 # one object per group: it counts the steps
    assert RA.group_of(world, name="tp", rank=0, size=3) is not g
    h = RA.group_of(world, name="tp", rank=0, size=3)
    assert (h.name, h.rank, h.size) == ("tp", 0, 3)
    other = RA.group_of(world, name="x", rank=2, size=3)
    assert other is h                                       # same group and size: the cached one
    peer = RA.Group(g.store, 0, 2, "world")                 # rank 0 of the same store
    out = {}
    t = threading.Thread(target=lambda: out.setdefault(0, peer.agree("t", "zero", timeout=5)))
    t.start()
    out[1] = RA.agree("t", "one", group=g, timeout=5)
    t.join(10)
    assert out == {0: ["zero", "one"], 1: ["zero", "one"]}
    assert RA.agree("solo", 5) == [5]                       # the default group: the world of one
    RA.forget()
    assert RA.group_of(rank=1, size=2) is not g


def test_without_a_world_every_group_is_single_and_rank_zero():
    assert not dist.is_initialized()
    assert RA.group_of() is RA.SINGLE and RA.group_of(size=4, rank=2) is RA.SINGLE
    assert RA.process_rank() == 0
    assert RA.agree("t", {"a": 1}) == [{"a": 1}]
    assert RA.agree("t", 3, group=RA.Group(None, 0, 1, "mine")) == [3]


# ---- edges: the message's cut, stores answering str, the clock at the limit, the poll back-off, other groups ----

def test_the_store_error_is_cut_to_200_characters_of_its_first_line():
    g = RA.Group(None, 0, 2, "g")
    e = g._store_down("posting agreement 't'", OSError("a" * 199 + "bc" + "d" * 50 + "\nsecond"))
    assert ("(OSError: " + "a" * 199 + "b); the process") in str(e)


class _StrStore:
    """A store whose reads answer ``str`` (the module accepts str as well as bytes) and counts its checks."""

    def __init__(self):
        self.inner, self.checks = dist.HashStore(), []

    def set(self, k, v):
        self.inner.set(k, v)

    def check(self, keys):
        self.checks.append(list(keys))
        return self.inner.check(keys)

    def multi_get(self, keys):
        return [v.decode() for v in self.inner.multi_get(keys)]


def test_a_store_that_answers_str_and_one_check_per_poll_while_in_time():
    s = _StrStore()
    gs = [RA.Group(s, r, 2, "s") for r in range(2)]
    res = {}

    def late():
        time.sleep(0.2)
        res[1] = gs[1].agree("t", 1, timeout=5)

    t = threading.Thread(target=late)
    t.start()
    res[0] = gs[0].agree("t", 0, timeout=5)
    t.join(10)
    assert res == {0: [0, 1], 1: [0, 1]}
    # while in time, rank 0 polls with the whole key list only (a check per key only once late)
    assert s.checks and all(len(k) == 2 for k in s.checks), s.checks


class _Clock:
    def __init__(self):
        self.now, self.sleeps = 100.0, []

    def monotonic(self):
        return self.now

    def sleep(self, s):
        self.sleeps.append(s)
        if len(self.sleeps) > 50:
            raise AssertionError("still polling")
        self.now += s


def test_a_limit_of_zero_seconds_checks_once_and_names_the_missing(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(RA.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(RA.time, "sleep", clock.sleep)
    _, gs = _ranks(2, "z")
    with pytest.raises(RA.RankTimeout) as e:       # the clock does not move: 0 s elapsed is already the limit
        gs[0].agree("t", timeout=0)
    assert e.value.missing == [1] and clock.sleeps == []


def test_the_poll_interval_doubles_up_to_its_cap(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(RA.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(RA.time, "sleep", clock.sleep)
    _, gs = _ranks(2, "p")
    with pytest.raises(RA.RankTimeout):
        gs[0].agree("t", timeout=0.1)
    first, cap = RA._POLL_FIRST_S, RA._POLL_MAX_S
    want, d = [], first
    while sum(want) < 0.1:
        want.append(d)
        d = min(d * 2, cap)
    assert clock.sleeps == pytest.approx(want)
    assert want[:3] == pytest.approx([0.0005, 0.001, 0.002]) and max(want) == 0.02


def test_everyone_arriving_just_as_the_limit_passes_is_agreement_not_a_timeout(monkeypatch):
    """The group check fails, the limit passes, then each key is there (the last rank posted in between)."""
    inner = dist.HashStore()

    class Racy:
        first = True

        def set(self, k, v):
            inner.set(k, v)

        def check(self, keys):
            if len(keys) > 1 and Racy.first:
                Racy.first = False
                inner.set("dsv4_sm120/agree/r/0/1", json.dumps({"topic": "t", "status": "late"}))
                return False
            return inner.check(keys)

        def multi_get(self, keys):
            return inner.multi_get(keys)

    assert RA.Group(Racy(), 0, 2, "r").agree("t", "early", timeout=0) == ["early", "late"]


def test_the_module_agree_passes_its_timeout(monkeypatch):
    monkeypatch.setenv("DSV4_SM120_RANK_AGREE_TIMEOUT_S", "3")
    _, gs = _ranks(2, "m")
    t0 = time.monotonic()
    with pytest.raises(RA.RankTimeout, match=r"within 0\.05 s"):
        RA.agree("t", 1, group=gs[0], timeout=0.05)
    assert time.monotonic() - t0 < 2


def test_the_group_of_a_subgroup_uses_its_own_name_rank_size_and_store(world, monkeypatch):
    from torch.distributed import distributed_c10d as c10d

    sub = dist.new_group([0])
    # torch answers for the subgroup otherwise than for the world (in a one-rank world both are rank 0 of 1)
    real_size, real_rank = dist.get_world_size, dist.get_rank
    monkeypatch.setattr(dist, "get_world_size", lambda pg=None: 3 if pg is sub else real_size(pg))
    monkeypatch.setattr(dist, "get_rank", lambda pg=None: 2 if pg is sub else real_rank(pg))
    g = RA.group_of(sub)
    assert (g.name, g.rank, g.size) == (c10d._get_process_group_name(sub), 2, 3)
    assert g.name != "world" and g.store is c10d._world.pg_map[sub][1]
    assert g._pg is sub                               # the cache holds the group: its id is not reused meanwhile
    assert RA.group_of(sub) is g and RA.group_of() is RA.SINGLE


def test_process_rank_is_torchs_rank_only_in_a_started_world(monkeypatch):
    monkeypatch.setattr(dist, "get_rank", lambda *a: 3)
    assert not dist.is_initialized()
    assert RA.process_rank() == 0                     # torch would answer, but no world is started
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    assert RA.process_rank() == 3

    def gone(*a):
        raise RuntimeError("the default process group has been destroyed")

    monkeypatch.setattr(dist, "get_rank", gone)
    assert RA.process_rank() == 0
