"""The all-reduce decision's rule (dsv4_sm120.machine_profile.allreduce_choice) against hand-made and random timing tables:
ties, a method that fails verification at one size, a method missing, nothing usable; the chosen pair checked
against a brute force over every (IPC bound, NCCL method) pair written here; the profile fields round-trip through
the machine-profile loader and bad values are refused."""

from __future__ import annotations

import copy
import itertools
import random

import pytest

from dsv4_sm120 import machine_profile as P
from dsv4_sm120.machine_profile.allreduce_choice import (IPC, MethodError, choose, fastest, ipc_numel, parse_method,
                                                   parse_methods, validate_entry)

H = 4096


def ok(us):
    return {"status": "ok", "us": us, "err": 0.0, "timing": "graph"}


def table(cols, rows=(1, 2, 4, 8, 16, 64)):
    """{rows: {method: outcome}} from {method: [us or status text per size]}."""
    out = {}
    for i, r in enumerate(rows):
        out[r] = {}
        for m, vals in cols.items():
            v = vals[i]
            if v is None:
                continue
            out[r][m] = ok(v) if isinstance(v, (int, float)) else {"status": v, "reason": f"{v} here"}
    return out


def test_method_names():
    assert parse_method("nccl") == {"kind": "nccl", "proto": None, "algo": None}
    assert parse_method("nccl_LL128") == {"kind": "nccl", "proto": "LL128", "algo": None}
    assert parse_method("nccl_Simple_Tree") == {"kind": "nccl", "proto": "Simple", "algo": "Tree"}
    assert parse_method("nccl__Ring") == {"kind": "nccl", "proto": None, "algo": "Ring"}
    assert parse_method(IPC)["kind"] == IPC
    for bad in ("nccl_ll", "nccl_LL_Bogus", "nccl_", "nccl_LL_Ring_x", "ipc", "NCCL_LL", ""):
        with pytest.raises(MethodError):
            parse_method(bad)
    assert parse_methods(" nccl_LL, pcie_ipc,nccl_LL ") == ["nccl_LL", "pcie_ipc"]
    with pytest.raises(MethodError):
        parse_methods(" , ")


def test_ipc_small_nccl_ll_mid_simple_large():
    t = table({IPC: [4, 4.2, 5, 7, 13, 40],
               "nccl_LL": [8, 8.1, 9, 10, 12, 30],
               "nccl_Simple": [20, 20, 21, 22, 24, 25],
               "nccl": [9, 9, 10, 11, 12.2, 26]})
    c = choose(t, H)
    # one NCCL method serves 16 and 64 (and whatever IPC leaves). By hand, the cost above IPC's sizes:
    # IPC to 8 + nccl: 12.2/12 + 26/25 = 2.0567; IPC to 8 + LL: 1 + 30/25 = 2.2; IPC to 16 + Simple: 13/12 + 1 =
    # 2.0833; IPC to 16 + nccl: 13/12 + 26/25 = 2.1233; IPC to 4 costs 10/7 more at 8 rows
    assert c["status"] == "ok" and c["ipc_max_rows"] == 8 and c["nccl"] == "nccl", c
    assert c["ipc_max_numel"] == 8 * H and c["nccl_proto"] is None and c["nccl_algo"] is None
    assert c["per_size"] == {"1": IPC, "2": IPC, "4": IPC, "8": IPC, "16": "nccl", "64": "nccl"}
    assert c["ranges"] == [{"from_rows": 1, "to_rows": 8, "method": IPC},
                           {"from_rows": 16, "to_rows": None, "method": "nccl"}]
    assert c["cost"] == pytest.approx(4 + 12.2 / 12 + 26 / 25, abs=1e-4)
    # without IPC the whole range: nccl 9/8+9/8.1+10/9+11/10+13/12+26/25 vs LL 1+1+1+1+12/12... computed here
    costs = {m: sum(t[r][m]["us"] / min(o["us"] for n, o in t[r].items() if n != IPC) for r in t)
             for m in ("nccl", "nccl_LL", "nccl_Simple")}
    assert c["nccl_only"]["nccl"] == min(costs, key=costs.get) == "nccl_LL"
    assert c["nccl_only"]["nccl_proto"] == "LL"
    assert [fastest(t[r]) for r in sorted(t)] == [IPC, IPC, IPC, IPC, "nccl_LL", "nccl_Simple"]


def test_ties_go_to_nccl_and_to_the_protocol_that_forces_least():
    same = [5, 6, 7, 8, 9, 10]
    c = choose(table({IPC: same, "nccl_LL": same, "nccl": same, "nccl_Simple_Ring": same}), H)
    assert c["ipc_max_rows"] == 0 and c["ipc_max_numel"] == 0 and c["nccl"] == "nccl", c
    assert c["cost"] == 6 and "never cheaper" in c["reason"]
    c = choose(table({"nccl_LL128": same, "nccl_LL": same, "nccl_Simple": same}), H)
    assert c["nccl"] == "nccl_Simple" and c["nccl_only"]["nccl"] == "nccl_Simple"
    c = choose(table({"nccl_LL_Ring": same, "nccl_LL": same}), H)
    assert c["nccl"] == "nccl_LL" and c["nccl_algo"] is None
    # IPC faster by a hair at the first size only: it wins there
    c = choose(table({IPC: [4.999, 6, 7, 8, 9, 10], "nccl_LL": same}), H)
    assert c["ipc_max_rows"] == 1 and c["ipc_max_numel"] == H


def test_a_method_failing_verification_at_one_size():
    # IPC is the fastest everywhere but wrong at 8 rows: it may serve 1..4 only
    t = table({IPC: [1, 1, 1, "rejected", 1, 1], "nccl_LL": [5] * 6, "nccl_Simple": [6] * 6})
    c = choose(t, H)
    assert c["ipc_max_rows"] == 4 and c["nccl"] == "nccl_LL", c
    assert c["per_size"]["8"] == "nccl_LL" and c["per_size"]["16"] == "nccl_LL"
    # LL is the fastest NCCL protocol except that one size wrong: never the NCCL method (it serves what IPC leaves)
    t = table({"nccl_LL": [1, 1, 1, 1, "rejected", 1], "nccl_Simple": [9] * 6})
    c = choose(t, H)
    assert c["nccl"] == "nccl_Simple" and c["nccl_only"]["nccl"] == "nccl_Simple"
    # IPC failed at the first size (e.g. not admitted): never used, whatever it does above
    c = choose(table({IPC: ["unavailable", 1, 1, 1, 1, 1], "nccl_LL": [5] * 6}), H)
    assert c["ipc_max_rows"] == 0 and "unavailable" in c["reason"]


def test_a_method_missing():
    c = choose(table({"nccl_LL": [5] * 6, "nccl": [6] * 6}), H)
    assert c["ipc_max_numel"] == 0 and "not measured" in c["reason"] and c["nccl"] == "nccl_LL"
    # a method absent at one size (no outcome at all) cannot serve that size
    t = table({IPC: [1, 1, 1, 1, 1, 1], "nccl_LL": [1, 1, None, 1, 1, 1], "nccl_Simple": [9] * 6})
    c = choose(t, H)
    assert c["nccl"] == "nccl_Simple" and c["ipc_max_rows"] == 64
    assert c["ranges"][-1] == {"from_rows": None, "to_rows": None, "method": "nccl_Simple",
                               "note": "beyond the measured sizes"}
    assert choose(table({IPC: [1] * 6, "nccl_LL": ["failed"] * 6}), H)["status"] == "none"
    none = choose(table({IPC: [1] * 6, "nccl_LL": [1, 1, "rejected", 1, 1, 1]}), H)
    assert none["status"] == "none" and "nccl_LL at rows 4" in none["reason"]
    assert choose({}, H)["status"] == "none"


def test_workspace_bound_is_rounded_up_to_whole_packs():
    assert ipc_numel(3, 4095) == 12288 and 12288 % 8 == 0 and 12288 >= 3 * 4095
    assert ipc_numel(64, 4096) == 262144 and ipc_numel(0, 4096) == 0
    c = choose(table({IPC: [1, 1, 1, 9, 9, 9], "nccl_LL": [5] * 6}), 4095)
    assert c["ipc_max_rows"] == 4 and c["ipc_max_numel"] == 16384 and c["ipc_max_numel"] >= 4 * 4095


def _brute(t):
    """Every admissible (bound, fallback) pair with its cost, written independently of the module."""
    sizes = sorted(t)
    good = lambda m, r: t[r].get(m, {}).get("status") == "ok"   # noqa: E731
    best = {r: min(o["us"] for o in t[r].values() if o.get("status") == "ok") for r in sizes}
    fall = [m for m in {m for r in sizes for m in t[r]} if m != IPC and all(good(m, r) for r in sizes)]
    bounds = [0] + [r for i, r in enumerate(sizes) if all(good(IPC, q) for q in sizes[:i + 1])]
    return {(b, m): sum((t[r][IPC]["us"] if r <= b else t[r][m]["us"]) / best[r] for r in sizes)
            for b, m in itertools.product(bounds, fall)}


def test_random_tables_choice_is_a_cheapest_admissible_pair():
    rng = random.Random(46)
    methods = [IPC, "nccl", "nccl_LL", "nccl_LL128", "nccl_Simple"]
    for _ in range(300):
        rows = sorted(rng.sample([1, 2, 4, 8, 16, 32, 64, 128], rng.randint(1, 6)))
        cols = {}
        for m in methods:
            cols[m] = [rng.choice([rng.choice([1, 2, 3]), rng.uniform(1, 50), "rejected", "failed", "unavailable"])
                       if rng.random() < 0.15 else rng.choice([2.0, rng.uniform(1, 50)]) for _ in rows]
        t = table(cols, rows)
        pairs = _brute(t)
        c = choose(t, H)
        if not pairs:
            assert c["status"] == "none"
            continue
        low = min(pairs.values())
        assert c["status"] == "ok" and (c["ipc_max_rows"], c["nccl"]) in pairs
        assert pairs[(c["ipc_max_rows"], c["nccl"])] == pytest.approx(low, rel=1e-9)
        # among the cheapest, the smallest IPC bound
        assert c["ipc_max_rows"] == min(b for (b, m), v in pairs.items() if abs(v - low) <= 1e-9 * max(1, low))
        only = {m: v for (b, m), v in pairs.items() if b == 0}
        assert only[c["nccl_only"]["nccl"]] == pytest.approx(min(only.values()), rel=1e-9)


# ----------------------------------------------------------------------------- profile fields

def server(choice_table=None):
    t = choice_table or table({IPC: [4, 4, 5, 7, 11, 40], "nccl_LL": [8, 8, 9, 10, 12, 30],
                               "nccl_Simple": [20, 20, 21, 22, 24, 25], "nccl_LL128": ["rejected"] * 6})
    c = choose(t, H)
    return {"gpus": [4, 5, 6, 7], "tp": 4, "hidden": H, "dtype": "bf16", "status": "ok", "methods": {},
            "sizes": {str(r): {"numel": r * H, "bytes": 2 * r * H, "winner": fastest(t[r]),
                               "chosen": c.get("per_size", {}).get(str(r)), "candidates": t[r]} for r in t},
            "choice": c}


def profile(entry):
    return {"schema": P.SCHEMA, "gpu": "NVIDIA RTX PRO 6000 Blackwell Server Edition", "created_at": P.now_iso(),
            "versions": {k: "1" for k in P.VERSION_FIELDS}, "decisions": {"allreduce": entry}}


def test_profile_round_trip(tmp_path):
    entry = {"bucket_kind": "rows", "default": "nccl", "servers": {"decode": server(), "prefill": {
        "gpus": [0, 1, 2, 3], "tp": 4, "hidden": H, "status": "unavailable", "reason": "GPUs not on this box",
        "sizes": {}, "choice": None}}}
    path = P.save(profile(entry), tmp_path / "p.json")
    back = P.load(path)
    assert back["decisions"]["allreduce"] == entry
    c = back["decisions"]["allreduce"]["servers"]["decode"]["choice"]
    assert (c["ipc_max_numel"], c["nccl"]) == (16 * H, "nccl_Simple")   # IPC fastest up to 16 rows, Simple at 64
    # the bucket lookups of other decisions see no buckets here, and do not break on it
    assert P.winner(back, "allreduce", 4) is None


@pytest.mark.parametrize("mutate,needle", [
    (lambda e: e["servers"]["decode"]["choice"].update(ipc_max_numel=4 * H + 4), "multiple of 8"),
    (lambda e: e["servers"]["decode"]["sizes"]["1"]["candidates"].pop("pcie_ipc"), "pcie_ipc serves up to"),
    (lambda e: e["servers"]["decode"]["sizes"]["2"]["candidates"]["pcie_ipc"].update(status="rejected"),
     "pcie_ipc serves up to"),
    (lambda e: e["servers"]["decode"]["choice"].update(nccl="nccl_LL128", nccl_proto="LL128"),
     "nccl_LL128 did not pass"),
    (lambda e: e["servers"]["decode"]["choice"].update(nccl_proto="LL"), "do not match"),
    (lambda e: e["servers"]["decode"]["choice"].update(nccl="pcie_ipc"), "not an NCCL method"),
    (lambda e: e["servers"]["decode"]["choice"].update(nccl="nccl_Fast"), "unknown all-reduce method"),
    (lambda e: e["servers"]["decode"]["choice"]["nccl_only"].update(nccl="nccl_LL128"), "nccl_only"),
    (lambda e: e["servers"]["decode"].update(tp="4"), "tp must be a positive integer"),
    (lambda e: e["servers"]["decode"]["sizes"]["1"]["candidates"]["nccl_LL"].pop("us"), "without a positive time"),
    (lambda e: e["servers"]["decode"]["sizes"].update({"0": {"candidates": {}}}), "not a positive row count"),
    (lambda e: e["servers"].update(router=e["servers"]["decode"]), "expected one of prefill, decode"),
    (lambda e: e.pop("servers"), "no servers object"),
])
def test_bad_values_are_refused(tmp_path, mutate, needle):
    entry = {"bucket_kind": "rows", "servers": {"decode": server()}}
    assert validate_entry(entry) is None
    bad = copy.deepcopy(entry)
    mutate(bad)
    why = validate_entry(bad)
    assert why and needle in why, why
    with pytest.raises(P.ProfileError, match="decision 'allreduce'"):
        P.save(profile(bad), tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()


def test_a_server_without_a_choice_is_valid():
    s = server(table({IPC: [1] * 6, "nccl_LL": ["failed"] * 6}))
    assert s["choice"]["status"] == "none" and validate_entry({"servers": {"prefill": s}}) is None
