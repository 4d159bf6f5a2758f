"""The sm_120 compile coverage's checks in this process (tests/test_sm120_compile.py compiles in a child, where `make
mutate` cannot see the checks run): every enumerated launch against what its compiled kernel reported
(tests/data/sm120_compile_facts.json: shared memory, registers, stack and local memory, LDL/STL count, MMA opcodes,
setmaxnreg of Triton's own ptxas, recorded by launch), the summary a family run gives with those facts, the needs
each launch carries (CTAs per SM of the spanning register body from its table entry, the block-scaled MMA of every
fp8 QK body and MoE fp4 GEMM), the spill bounds against the recorded counts (tight), and each broken rule on its own.

When the tables or kernels change, the enumeration and the recording part: run the compile test
(``make test`` or ``scripts/run_tests.sh tests/test_sm120_compile.py``), then
``python tests/test_sm120_coverage_units.py --record`` writes the facts again from its cache."""

from __future__ import annotations

import copy
import json
import sys
import types
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if __name__ != "__main__":
    from dsv4_sm120 import launch_tables as lt
    from dsv4_sm120.dev import sass
    from dsv4_sm120.dev import sm120_compile as SC
    from dsv4_sm120.dev import sm120_launches as SL

FACTS_FILE = HERE / "data" / "sm120_compile_facts.json"
FIELDS = ("shared", "static_shared", "regs", "stack", "local", "local_ops", "mma", "setmaxnreg")
RERECORD = ("the enumeration and tests/data/sm120_compile_facts.json part (tables or kernels changed): compile them "
            "(scripts/run_tests.sh tests/test_sm120_compile.py), then python tests/test_sm120_coverage_units.py "
            "--record")


@pytest.fixture(scope="module")
def facts():
    return json.loads(FACTS_FILE.read_text())


@pytest.fixture(scope="module")
def launches():
    return SL.enumerate_launches()


def _facts_of(facts, la):
    r = facts[la.family].get(la.key)
    assert r is not None, f"{la.key}: {RERECORD}"
    return dict(r)


def test_every_launch_passes_with_what_its_kernel_reported(facts, launches):
    for fam, ls in launches.items():
        assert set(facts[fam]) == {la.key for la in ls}, f"{fam}: {RERECORD}"
        for la in ls:
            assert SC.problems(la, _facts_of(facts, la)) == [], la.key


def test_a_family_run_with_the_recorded_compiles(facts, launches, monkeypatch, tmp_path):
    monkeypatch.setattr(SC, "cache_file", lambda family: tmp_path / f"{family}.json")
    # Triton's source hash needs a compiled-mode kernel; a test module collected earlier in this process may have
    # set TRITON_INTERPRET (kernels decorated as interpreted, no ASTSource from them): stand the launch in for its
    # source and key by the launch itself, unique per family (the source and key are tested on their own below)
    monkeypatch.setattr(SC, "source", lambda la: la)
    monkeypatch.setattr(SC, "compile_key", lambda la, src: json.dumps([src.key, la.options], sort_keys=True))
    inspected = []

    def inspect(la, src):
        inspected.append(la.key)
        return _facts_of(facts, la)

    monkeypatch.setattr(SC, "inspect", inspect)
    for fam in ("attention", "moe_bf16"):
        inspected.clear()
        s = SC.check_family(fam)
        want = launches[fam]
        assert s["launches"] == len(want) == len(inspected) == s["compiled"], fam
        assert s["problems"] == [] and s["kernels"] == sorted({la.kernel for la in want})
        assert s["max_shared"] == max(f["shared"] for f in facts[fam].values())
        assert s["max_regs"] == max(f["regs"] or 0 for f in facts[fam].values())
        cached = json.loads((tmp_path / f"{fam}.json").read_text())
        assert len(cached) == len(want) and sorted(cached.values(), key=json.dumps) == sorted(
            (_facts_of(facts, la) for la in want), key=json.dumps)
        inspected.clear()
        again = SC.check_family(fam)
        assert again["compiled"] == 0 and inspected == [] and again["launches"] == len(want)
    # a launch the cache holds broken is reported from the cache, named by its table file and key
    fam = "moe_bf16"
    cached = json.loads((tmp_path / f"{fam}.json").read_text())
    key = next(iter(cached))
    cached[key] = dict(cached[key], local_ops=cached[key]["local_ops"] + 100)
    (tmp_path / f"{fam}.json").write_text(json.dumps(cached))
    s = SC.check_family(fam)
    assert s["compiled"] == 0 and len(s["problems"]) == 1 and "spills to local memory" in s["problems"][0]
    assert s["problems"][0].startswith("moe/")
    (tmp_path / f"{fam}.json").write_text("[not a dict]")
    assert SC.check_family(fam)["compiled"] == len(launches[fam])
    monkeypatch.setattr(SC, "inspect", lambda la, src: {"error": "CompilationError: x"})
    (tmp_path / f"{fam}.json").unlink()
    s = SC.check_family(fam)
    assert len(s["problems"]) == len(launches[fam]) and s["max_shared"] == 0 and s["max_regs"] == 0


def test_the_needs_each_launch_carries(launches):
    """The spanning register body needs its table entry's ``waves`` CTAs per SM (one when a variant turns spanning
    off or sets one wave); every fp8 QK split body and every MoE fp4 GEMM needs its native block-scaled MMA; nothing
    else claims either."""
    entry = lt.read_table(lt.lookup("attention", "impl=reg", 1, lt.DEFAULT_DEVICE, SL.CAPABILITY).path)[1]
    assert entry["impl"] == "reg" and entry["spanning_splits"] and int(entry["waves"]) > 1
    reg = [la for la in launches["attention"] if la.kernel == "attention.split_kernel_reg"]
    for la in launches["attention"]:
        split = la.kernel.startswith("attention.split_kernel_")
        assert la.need.get("mma") == ("fp8" if split and la.constexprs.get("FP8_QK") else None), la.key
        if la not in reg:
            assert la.need.get("ctas", 1) == 1, la.key
    one = [la for la in reg if all("spanning_splits=0" in o or "waves=1" in o for o in la.origins)]
    table = [la for la in reg if any(o.endswith("[1] (qk=bf16)") for o in la.origins)]
    assert one and table
    assert all(la.need["ctas"] == 1 for la in one)
    assert all(la.need["ctas"] == int(entry["waves"]) for la in table)
    for path in ("fp4", "bf16"):
        for la in launches[f"moe_{path}"]:
            gemm = "_gemm" in la.kernel
            assert la.need.get("mma") == ("fp4" if gemm and path == "fp4" else None), la.key
            assert la.need.get("ctas", 1) == 1


def test_every_fp8_table_key_has_an_fp8_launch(launches):
    fp8 = [la for la in launches["attention"] if la.constexprs.get("FP8_QK")]
    names = " | ".join(o for la in fp8 for o in la.origins)
    for h in (16, 32, 64):
        found = lt.lookup("attention", f"H={h},qk=fp8", 1, lt.DEFAULT_DEVICE, SL.CAPABILITY)
        for key in lt.read_table(found.path):
            assert f"{found.path.name}[{key}] (qk=fp8)" in names, (h, key)
    quant = [la for la in launches["attention"] if la.kernel == "attention.q_fp8_kernel"]
    assert quant and all(la.options == {"num_warps": 4} for la in quant)


def test_the_spill_bounds_are_close_to_the_recorded_counts(facts, launches):
    for rule in SL.ACCEPTED_SPILLS:
        fam = "attention" if rule["kernel"].startswith("attention.") else None
        ls = [la for f, ls in launches.items() for la in ls if la.kernel == rule["kernel"] and (fam is None or f == fam)]
        hit = [la for la in ls if all(dict(la.constexprs, **la.options).get(k) == v for k, v in rule["match"].items())]
        assert hit, rule["kernel"]
        counts = [facts[la.family][la.key]["local_ops"] for la in hit]
        assert all(la.need["spills"] == rule["max_ldl_stl"] for la in hit)
        assert max(counts) <= rule["max_ldl_stl"] < max(counts) * 1.25 + 2, (rule["kernel"], counts)
    others = [la for ls in launches.values() for la in ls if not SL.accepted_spills(la)]
    assert all("spills" not in la.need for la in others)
    assert all(facts[la.family][la.key]["local_ops"] == 0 for la in others)


def test_each_spill_rule_on_its_own(facts, launches):
    la = next(la for la in launches["moe_fp4"] if la.need.get("spills"))
    r = _facts_of(facts, la)
    bound = la.need["spills"]
    assert SC.problems(la, dict(r, local_ops=bound)) == []
    got = SC.problems(la, dict(r, local_ops=bound + 1))
    assert len(got) == 1 and got[0].endswith(f"spills to local memory ({bound + 1} LDL/STL in its SASS, {bound} "
                                             f"accepted (sm120_launches.ACCEPTED_SPILLS); stack frame {r['stack']} B, "
                                             f"{r['regs']} registers per thread)")
    got = SC.problems(la, dict(r, local=64, local_ops=0))             # local memory alone is a spill
    assert len(got) == 1 and "spills to local memory (0 LDL/STL" in got[0]
    plain = next(la for la in launches["moe_fp4"] if not la.need.get("spills") and la.kernel == "moe._reduce_kernel")
    rp = _facts_of(facts, plain)
    got = SC.problems(plain, dict(rp, local_ops=1))
    assert len(got) == 1 and f"(1 LDL/STL in its SASS; stack frame {rp['stack']} B" in got[0]


def test_each_resource_rule_on_its_own(facts, launches):
    fp8 = next(la for la in launches["attention"] if la.need.get("mma") == "fp8")
    r = _facts_of(facts, fp8)
    assert any(op.startswith("QMMA.SF") for op in r["mma"])
    got = SC.problems(fp8, dict(r, mma=[op for op in r["mma"] if not op.startswith("QMMA")]))
    assert len(got) == 1 and "has no the native block-scaled FP8 MMA (QMMA.SF ... E4M3) in its SASS" in got[0]
    got = SC.problems(fp8, dict(r, mma=["QMMA.SF.16832.F32.E5M2.E5M2.E8"]))
    assert len(got) == 1
    got = SC.problems(fp8, dict(r, mma=[]))
    assert got[0].endswith("(MMA opcodes: none)")
    fp4 = next(la for la in launches["moe_fp4"] if la.need.get("mma") == "fp4")
    r4 = _facts_of(facts, fp4)
    assert SC.problems(fp4, dict(r4, mma=["OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X"])) == []
    assert len(SC.problems(fp4, dict(r4, mma=["HMMA.16816.F32.BF16", "QMMA.SF.16832.F32.E4M3.E4M3.E8"]))) == 1
    # shared memory: the block limit and the CTAs per SM a launch needs
    assert SC.problems(fp4, dict(r4, shared=SC.SMEM_PER_BLOCK)) == []
    got = SC.problems(fp4, dict(r4, shared=SC.SMEM_PER_BLOCK + 1))
    assert len(got) == 2 and got[0].endswith(f"asks for {SC.SMEM_PER_BLOCK + 1} B of shared memory per block; sm_120 "
                                             "allows 101376")
    assert " fits 0 CTA(s) per SM (shared 0, " in got[1] and got[1].endswith("the launch needs 1")
    la = copy.deepcopy(fp4)
    la.need["ctas"] = 2
    half = (SC.SMEM_PER_SM // 2) - 1024
    assert SC.problems(la, dict(r4, shared=half, static_shared=0, regs=32)) == []
    got = SC.problems(la, dict(r4, shared=half + 1, static_shared=0, regs=32))
    w = la.options["num_warps"]                     # 32 registers x 32 threads: 1024 per warp, 64 warps per SM
    assert len(got) == 1 and f" fits 1 CTA(s) per SM (shared 1, threads {1536 // (32 * w)}, registers {64 // w}; " \
        in got[0]
    assert got[0].endswith(f"{half + 1} B shared, 32 registers per thread), the launch needs 2")
    # the origin: the table file and key, and how many more places ask for the same launch
    la.origins = ["moe/a.json[8]", "moe/b.json[16]", "moe/c.json[1]"]
    assert SC.problems(la, dict(r4, shared=SC.SMEM_PER_BLOCK + 1))[0].startswith(
        f"moe/a.json[8] (and 2 more): {la.kernel} [num_stages={la.options['num_stages']}, num_warps="
        f"{la.options['num_warps']}]")


def test_occupancy_by_shared_memory_registers_and_threads():
    base = {"shared": 0, "static_shared": 0, "regs": None}
    assert SC.ctas_per_sm(base, 4) == {"shared": 100, "threads": 12, "all": 12}
    assert SC.ctas_per_sm(dict(base, static_shared=4096), 4)["shared"] == 25       # more than the reserved 1 KiB
    assert SC.ctas_per_sm(dict(base, shared=48 * 1024), 8) == {"shared": 2, "threads": 6, "all": 2}
    assert SC.ctas_per_sm(dict(base, regs=255), 8) == {"shared": 100, "threads": 6, "registers": 1, "all": 1}
    assert SC.ctas_per_sm(dict(base, regs=129), 4)["registers"] == 3               # 129 x 32 -> 4352 per warp
    assert SC.ctas_per_sm(dict(base, regs=128), 4)["registers"] == 4
    assert SC.ctas_per_sm(dict(base, shared=0, regs=16), 1)["all"] == 32 == SC.CTAS_PER_SM
    assert (SC.SMEM_PER_BLOCK, SC.SMEM_PER_SM, SC.SMEM_RESERVED, SC.REGS_PER_SM, SC.THREADS_PER_SM) == (
        99 * 1024, 100 * 1024, 1024, 65536, 1536)


def test_the_command_line(monkeypatch, capsys):
    monkeypatch.setattr(SC, "toolchain_problem", lambda: "no ptxas in the Triton wheel (/x)")
    assert SC.main(["attention"]) == 2
    assert capsys.readouterr().err == "sm120_compile: no ptxas in the Triton wheel (/x)\n"
    assert SC.main(["--json"]) == 0
    assert capsys.readouterr().out == 'RESULT{"toolchain": {"error": "no ptxas in the Triton wheel (/x)"}}\n'
    with pytest.raises(SystemExit):
        SC.main(["attention", "bogus", "other"])
    assert "unknown families bogus, other; known: attention, combine, moe_fp4, moe_bf16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        SC.main(["bogus"])
    assert "unknown family bogus; known:" in capsys.readouterr().err
    monkeypatch.setattr(SC, "toolchain_problem", lambda: "")
    summary = {"launches": 3, "compiled": 1, "seconds": 0.5, "problems": ["p1", "p2"], "max_shared": 10,
               "max_regs": 20}
    ran = []
    monkeypatch.setattr(SC, "check_family", lambda f: ran.append(f) or dict(summary, problems=list(summary["problems"])
                                                                            if f == "moe_bf16" else []))
    assert SC.main(["moe_bf16", "combine"]) == 1 and ran == ["moe_bf16", "combine"]
    assert capsys.readouterr().out == ("p1\np2\nmoe_bf16: 3 launches (1 compiled, the rest cached), 2 problem(s), "
                                       "0.5 s; max shared 10 B, max registers 20\ncombine: 3 launches (1 compiled, "
                                       "the rest cached), 0 problem(s), 0.5 s; max shared 10 B, max registers 20\n")
    ran.clear()
    assert SC.main(["combine"]) == 0
    assert SC.main([]) == 1 and ran[1:] == list(SL.FAMILIES)
    capsys.readouterr()
    assert SC.main(["--json", "combine"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("RESULT{") and json.loads(out[len("RESULT"):]) == {"combine": dict(summary, problems=[])}


def test_a_launch_asked_for_twice_keeps_every_origin_and_the_stricter_need():
    def la(origin, **need):
        return SL.Launch("attention", "attention.split_kernel_reg", {"B": 1, "A": True}, {"num_warps": 4},
                         {"acc_ws": "*fp32"}, dict(need), [origin])

    assert la("o").key == "attention.split_kernel_reg,A=True,B=1,num_warps=4,acc_ws:*fp32"
    s = SL._Set()
    first = la("t.json[1]", ctas=1)
    s.add(first)
    s.add(la("t.json[1]", ctas=4))                   # the same origin again: nothing changes
    assert first.need == {"ctas": 1} and first.origins == ["t.json[1]"]
    s.add(la("t.json[2]", ctas=1, mma="fp8"))
    assert first.origins == ["t.json[1]", "t.json[2]"] and first.need == {"ctas": 1, "mma": "fp8"}
    s.add(la("u.json[8]", ctas=2))                   # asks for more: named first, its need wins
    assert first.origins == ["u.json[8]", "t.json[1]", "t.json[2]"] and first.need["ctas"] == 2
    s.add(la("v.json[1]"))
    assert first.origins[-1] == "v.json[1]" and first.need["ctas"] == 2 and list(s.by_key) == [first.key]
    s.add(la("t.json[2]", ctas=5))                   # an origin met before (not the first): nothing changes
    assert first.origins == ["u.json[8]", "t.json[1]", "t.json[2]", "v.json[1]"] and first.need["ctas"] == 2
    s.add(la("w.json[3]", ctas=1))                   # asks for less than the 2 already needed: named last
    assert first.origins[-1] == "w.json[3]" and first.need["ctas"] == 2
    s = SL._Set()
    bare = la("c.json[1]")                           # no CTA need: one CTA per SM
    s.add(bare)
    s.add(la("d.json[4]", ctas=2))
    assert bare.need == {"ctas": 2} and bare.origins == ["d.json[4]", "c.json[1]"]
    s = SL._Set()
    strict = la("x.json[1]", ctas=3)
    s.add(strict)
    s.add(la("y.json[2]", ctas=2))                   # more than one CTA, less than the 3 needed: the 3 stay
    assert strict.need == {"ctas": 3} and strict.origins == ["x.json[1]", "y.json[2]"]


def test_rows_per_key_and_powers_of_two():
    # ceil(T * hg / nsm) is each key: the smallest T of each (hg 1: T itself; hg 4 on 188 SMs)
    assert SL._rows_for_keys([1, 2, 5], 1, 188) == [1, 189, 753]
    for hg, nsm in ((1, 188), (4, 188), (2, 84), (3, 170)):
        for key in (1, 2, 7, 64):
            T = SL._rows_for_keys([key], hg, nsm)[0]
            assert -(-T * hg // nsm) == key and (T == 1 or -(-(T - 1) * hg // nsm) < key), (hg, nsm, key)
    # whole numbers: ceil(57 * 3 / 170) = 2 and ceil(56 * 3 / 170) = 1, so 57 is key 2's first T (not 170 / 3 + 1)
    got = SL._rows_for_keys([1, 2, 3], 3, 170)
    assert got == [1, 57, 114] and all(type(t) is int for t in got)
    assert [SL._pow2(n) for n in (0, 1, 2, 3, 4, 5, 1000, 1024)] == [1, 1, 2, 4, 4, 8, 1024, 1024]


def test_the_rules_match_by_kernel_constexprs_and_options(monkeypatch):
    def la(kernel, warps=8, **cst):
        return SL.Launch("x", kernel, cst, {"num_warps": warps}, {})

    assert SL.accepted_spills(la("attention.split_kernel_tiled", BLOCK_H=32)) == 40
    assert SL.accepted_spills(la("attention.split_kernel_tiled", BLOCK_H=16)) == 0
    assert SL.accepted_spills(la("attention.split_kernel_flat", BLOCK_H=32)) == 74
    assert SL.accepted_spills(la("moe._gemm1_kernel", BM=64, PATH_FP4=True, APRE=False)) == 81
    assert SL.accepted_spills(la("moe._gemm1_kernel", BM=64, PATH_FP4=True, APRE=True)) == 0
    assert SL.accepted_spills(la("moe._gemm2_kernel", BM=64, BN=128, PATH_FP4=False)) == 24
    assert SL.resource_bounds(la("attention.split_kernel_wspec", BLOCK_H=64)) == {
        "max_shared": 100388, "max_regs": 168, "partition_regs": (208, 88)}
    assert SL.resource_bounds(la("attention.split_kernel_tiled", BLOCK_H=32)) == {}
    # a rule may name a launch option (num_warps) as well as a constexpr
    monkeypatch.setattr(SL, "RESOURCE_BOUNDS", ({"kernel": "k", "match": {"BLOCK_H": 16, "num_warps": 8},
                                                 "max_shared": 1, "max_regs": 2, "partition_regs": (3, 4)},))
    monkeypatch.setattr(SL, "ACCEPTED_SPILLS", ({"kernel": "k", "match": {"num_warps": 8}, "max_ldl_stl": 7},))
    eight, four = la("k", BLOCK_H=16), la("k", warps=4, BLOCK_H=16)
    assert SL.resource_bounds(eight) == {"max_shared": 1, "max_regs": 2, "partition_regs": (3, 4)}
    assert SL.resource_bounds(four) == {}
    assert SL.accepted_spills(eight) == 7 and SL.accepted_spills(four) == 0
    with pytest.raises(ValueError) as e:
        SL.enumerate_launches(["attention", "bogus", "alsobad"])
    assert str(e.value) == ("unknown launch families ['alsobad', 'bogus']; known: attention, combine, moe_fp4, "
                            "moe_bf16")
    assert list(SL.enumerate_launches(["moe_bf16"])) == ["moe_bf16"]


def record() -> None:
    """tests/data/sm120_compile_facts.json from the compile cache (DSV4_SM120_CACHE/sm120-compile/)."""
    import triton

    from dsv4_sm120.dev import sm120_compile as SC
    from dsv4_sm120.dev import sm120_launches as SL

    out = {"_": f"what Triton {triton.__version__} (ptxas of its wheel) reports of each sm_120 launch of "
                "dsv4_sm120.dev.sm120_launches, by Launch.key; recorded from the sm120_compile cache by "
                "tests/test_sm120_coverage_units.py --record"}
    for fam, ls in SL.enumerate_launches().items():
        cache = json.loads(SC.cache_file(fam).read_text())
        out[fam] = {la.key: {k: cache[SC.compile_key(la, SC.source(la))].get(k) for k in FIELDS} for la in ls}
    FACTS_FILE.write_text(json.dumps(out, indent=0, sort_keys=True) + "\n")
    print(f"wrote {FACTS_FILE}")


# ---------------------------------------------------------------------------- sm120_compile's own steps
# What it reads of a compile (a stand-in compiler answers a known kernel, SASS and resource line), where the
# toolchain and cache live, the family run's bookkeeping (launches met twice, the cache file's layout, a read-only
# cache, the clock), each problem line word for word, and the command's help.

SASS = """
        /*0010*/  LDL.64 R2, [R1+0x8] ;
        /*0020*/  STL [R1], R4 ;
        /*0030*/  LDL R5, [R1+0x4] ;
        /*0040*/  LDLX R6 ;
        /*0050*/  OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X R8, R12, R16, R8 ;
        /*0060*/  HMMA.16816.F32.BF16 R20, R24, R28, R20 ;
        /*0070*/  OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X R8, R12, R16, R8 ;
"""
PTX = ("setmaxnreg.dec.sync.aligned.u32 24;\n setmaxnreg.inc.sync.aligned.u32   240;\n"
       "setmaxnreg.dec.sync.aligned.u32 24;\n")


def _launch(origins=("attention/t.json[4]",), **need):
    return SL.Launch("attention", "attention.split_kernel_reg", {"BLOCK_N": 32}, {"num_warps": 4, "num_stages": 1},
                     {}, dict(need), list(origins))


def test_what_is_read_of_a_compile(monkeypatch):
    seen = []

    def fake(src, cap, options):
        seen.append((src, cap, options))
        k = types.SimpleNamespace(metadata=types.SimpleNamespace(shared="4096"), asm={"ptx": PTX})
        return k, SASS, {"regs": 96, "stack": 16, "static_shared": 1024, "local": 8}

    monkeypatch.setattr(sass, "compile_inspect", fake)
    la = _launch()
    r = SC.inspect(la, "SRC")
    assert seen == [("SRC", 120, {"num_warps": 4, "num_stages": 1})] and seen[0][2] is not la.options
    assert r == {"shared": 4096, "static_shared": 1024, "regs": 96, "stack": 16, "local": 8, "local_ops": 3,
                 "sass_lines": 8, "mma": ["HMMA.16816.F32.BF16", "OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X"],
                 "setmaxnreg": [24, 240]}
    # a compile that reports no resources: registers unknown, no stack or local memory; no PTX: no setmaxnreg
    monkeypatch.setattr(sass, "compile_inspect", lambda src, cap, options: (
        types.SimpleNamespace(metadata=types.SimpleNamespace(shared=0), asm={}), "", {}))
    assert SC.inspect(la, "SRC") == {"shared": 0, "static_shared": 0, "regs": None, "stack": 0, "local": 0,
                                     "local_ops": 0, "sass_lines": 0, "mma": [], "setmaxnreg": []}

    def broken(src, cap, options):
        raise RuntimeError("ptxas error:\n   too   many\tresources " + "y" * 500)

    monkeypatch.setattr(sass, "compile_inspect", broken)
    err = SC.inspect(la, "SRC")["error"]
    want = "ptxas error: too many resources " + "y" * 500
    assert err == "RuntimeError: " + want[:400]


def test_the_toolchain_and_the_cache_file(monkeypatch, tmp_path):
    import triton

    assert SC.toolchain_problem() == ""                   # the test environment's Triton has its ptxas
    monkeypatch.setattr(triton, "__file__", str(tmp_path / "triton" / "__init__.py"))
    ptxas = tmp_path / "triton" / "backends" / "nvidia" / "bin" / "ptxas"
    assert SC.toolchain_problem() == f"no ptxas in the Triton wheel ({ptxas})"
    ptxas.parent.mkdir(parents=True)
    ptxas.write_text("")
    assert SC.toolchain_problem() == ""
    monkeypatch.setattr(SC, "cache_dir", lambda: tmp_path / "c")
    assert SC.cache_file("moe_fp4") == tmp_path / "c" / "sm120-compile" / "moe_fp4.json"


def _family(monkeypatch, tmp_path, launches, results):
    monkeypatch.setattr(SC, "cache_file", lambda family: tmp_path / f"{family}.json")
    monkeypatch.setattr(SL, "enumerate_launches", lambda fams: {fams[0]: launches})
    monkeypatch.setattr(SC, "source", lambda la: f"src:{la.origins[0]}")
    monkeypatch.setattr(SC, "compile_key", lambda la, src: "key:" + la.kernel)
    got = []

    def inspect(la, src):
        got.append(src)
        return results[len(got) - 1]

    monkeypatch.setattr(SC, "inspect", inspect)
    return got


def test_a_family_run_compiles_a_launch_met_twice_once(monkeypatch, tmp_path):
    r = {"shared": 1000, "static_shared": 0, "regs": None, "stack": 0, "local": 0, "local_ops": 0, "mma": []}
    got = _family(monkeypatch, tmp_path, [_launch(["a"]), _launch(["b"])], [r])
    clock = iter([10.0, 12.36])
    monkeypatch.setattr(SC.time, "monotonic", lambda: next(clock))
    s = SC.check_family("attention")
    assert got == ["src:a"] and s["compiled"] == 1 and s["launches"] == 2 and s["seconds"] == 2.4
    assert s["max_regs"] == 0 and s["max_shared"] == 1000 and s["problems"] == []
    text = (tmp_path / "attention.json").read_text()     # one key per line, sorted: diffs of the cache stay small
    assert text.rstrip("\n") == json.dumps({"key:attention.split_kernel_reg": r}, indent=0, sort_keys=True)
    assert text.splitlines()[:3] == ["{", '"key:attention.split_kernel_reg": {', '"local": 0,']


def test_a_read_only_cache_still_checks_and_says_so(monkeypatch, tmp_path, capsys):
    from dsv4_sm120 import fileio

    r = {"shared": 10, "static_shared": 0, "regs": 40, "stack": 0, "local": 0, "local_ops": 0, "mma": []}
    _family(monkeypatch, tmp_path, [_launch(["a"])], [r])

    def ro(path, data, **kw):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(fileio, "atomic_write_json", ro)
    s = SC.check_family("attention")
    assert s["compiled"] == 1 and s["max_regs"] == 40
    io = capsys.readouterr()
    assert io.err == f"sm120_compile: cannot write {tmp_path / 'attention.json'}: Permission denied\n" and io.out == ""


GOOD = {"shared": 50176, "static_shared": 1024, "regs": 128, "stack": 0, "local": 0, "local_ops": 0, "mma": []}
HEAD = "attention/t.json[4]: attention.split_kernel_reg [num_stages=1, num_warps=4]"


def test_each_problem_line_word_for_word():
    assert SC.problems(_launch(["x", "y", "z"]), dict(GOOD, shared=99 * 1024 + 1))[0].startswith(
        "x (and 2 more): attention.split_kernel_reg [")
    assert SC.problems(_launch(["x", "y"]), dict(GOOD, shared=99 * 1024 + 1))[0].startswith("x (and 1 more): ")
    assert SC.problems(_launch(), dict(GOOD, shared=99 * 1024 + 1))[0] == (
        f"{HEAD} asks for 101377 B of shared memory per block; sm_120 allows 101376")
    assert SC.problems(_launch(max_shared=50000), GOOD) == [
        f"{HEAD} asks for 50176 B of shared memory per block, over the 50000 B it is pinned to "
        "(sm120_launches.RESOURCE_BOUNDS)"]
    assert SC.problems(_launch(max_regs=120), GOOD) == [
        f"{HEAD} takes 128 registers per thread, over the 120 it is pinned to (sm120_launches.RESOURCE_BOUNDS)"]
    assert SC.problems(_launch(max_regs=0), dict(GOOD, regs=None)) == []        # registers unknown: no claim
    assert SC.problems(_launch(partition_regs=[24, 240]), GOOD) == [           # no setmaxnreg recorded at all
        f"{HEAD} gives its warp-specialized partitions None registers (setmaxnreg), not the [24, 240] it is pinned "
        "to (sm120_launches.RESOURCE_BOUNDS)"]
    assert SC.problems(_launch(partition_regs=[24, 240]), dict(GOOD, setmaxnreg=[24, 232])) == [
        f"{HEAD} gives its warp-specialized partitions [24, 232] registers (setmaxnreg), not the [24, 240] it is "
        "pinned to (sm120_launches.RESOURCE_BOUNDS)"]
    assert SC.problems(_launch(mma="fp8"), dict(GOOD, mma=["HMMA.16816.F32.BF16", "IMMA.8816.S32"])) == [
        f"{HEAD} has no the native block-scaled FP8 MMA (QMMA.SF ... E4M3) in its SASS (MMA opcodes: "
        "HMMA.16816.F32.BF16, IMMA.8816.S32)"]


def test_the_command_help(capsys):
    with pytest.raises(SystemExit) as e:
        SC.main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: python -m dsv4_sm120.dev.sm120_compile [-h] [--json] [families ...]")
    assert " ".join(SC.__doc__.split("\n")[0].split()) in out        # the module doc's first line, only that
    assert " ".join(SC.__doc__.split("\n")[1].split()) not in out
    assert "default: all (attention, combine, moe_fp4, moe_bf16)" in out
    assert "--json print the summary as RESULT<json>" in out


def test_the_cache_key_ignores_the_order_options_were_written_in():
    src = types.SimpleNamespace(hash=lambda: "h1")
    a = SL.Launch("attention", "attention.split_kernel_reg", {}, {"num_warps": 4, "num_stages": 1}, {}, {}, ["a"])
    b = SL.Launch("attention", "attention.split_kernel_reg", {}, {"num_stages": 1, "num_warps": 4}, {}, {}, ["b"])
    c = SL.Launch("attention", "attention.split_kernel_reg", {}, {"num_stages": 2, "num_warps": 4}, {}, {}, ["c"])
    assert SC.compile_key(a, src) == SC.compile_key(b, src) != SC.compile_key(c, src)
    assert SC.compile_key(a, types.SimpleNamespace(hash=lambda: "h2")) != SC.compile_key(a, src)
    assert len(SC.compile_key(a, src)) == 64



# ---- the attention enumeration's parts, against the numbers they stand for


def test_the_attention_shapes_are_the_models_at_the_longest_context():
    """DeepSeek-V4-Flash: a 128-token sliding window, c4 top-k 512, c128 candidates at a 1 Mi-token context:
    ceil64(2 * ceil(2**20 / 256)) = 8192."""
    assert SL._attention_shapes() == (("swa", 128, 0), ("c4", 128, 512), ("c128", 128, 8192))


def test_the_attention_device_is_an_sm120_part_without_a_table_of_its_own():
    for nsm in (84, 188):
        d = SL._attention_device(nsm)
        assert (d.name, d.capability, d.num_sms) == ("default", (12, 0), nsm)


def test_every_way_the_product_asks_for_a_split_launch_on_sm120():
    """The defaults in both QK modes, each body sm_120 runs by name (wgmma / wgmma_t are Hopper's; reg and wspec
    take bf16 QK only), then calibrate's variants (bf16 QK)."""
    from dsv4_sm120.calibrate.attention import VARIANTS

    got = SL._attention_requests()
    head = [("bf16", {}, ""), ("fp8", {}, ""),
            ("bf16", {"impl": "tiled"}, "impl=tiled"), ("fp8", {"impl": "tiled"}, "impl=tiled"),
            ("bf16", {"impl": "flat"}, "impl=flat"), ("fp8", {"impl": "flat"}, "impl=flat"),
            ("bf16", {"impl": "reg"}, "impl=reg"), ("bf16", {"impl": "wspec"}, "impl=wspec")]
    assert got[:len(head)] == head
    tail = got[len(head):]
    assert [label for _, _, label in tail] == list(VARIANTS) and {qk for qk, _, _ in tail} == {"bf16"}
    by_label = {label: ov for _, ov, label in tail}
    assert by_label["impl=wspec,BLOCK_H=32"] == {"impl": "wspec", "BLOCK_H": 32}
    assert by_label["BLOCK_N=64,num_warps=8,waves=1"] == {"BLOCK_N": 64, "num_warps": 8, "waves": 1}
    assert by_label["spanning_splits=0"] == {"spanning_splits": 0}


REG = {"impl": "reg", "BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "maxnreg": 0, "waves": 3,
       "e4m3_int_decode": 1, "late_decode": 1, "spanning_splits": 1, "PART_BF16": 0}


def test_a_register_body_launch_as_attention_launch_makes_it():
    (la,) = SL._split_launch(dict(REG), "bf16", True, "o")
    assert (la.family, la.kernel, la.origins) == ("attention", "attention.split_kernel_reg", ["o"])
    assert la.constexprs == {"HAS_MAIN_LEN": True, "HAS_EXTRA": True, "HAS_EXTRA_LEN": True, "BLOCK_H": 16,
                             "BLOCK_N": 32, "FP8_QK": False, "INTERP": False, "KCVT": True, "DEC_LATE": True,
                             "SPAN": True}
    assert la.options == {"num_warps": 4, "num_stages": 1} and la.sig == {"acc_ws": "*fp32"}
    assert la.need == {"ctas": 3}                        # the spanning plan counts on `waves` CTAs per SM
    (la,) = SL._split_launch(dict(REG, spanning_splits=0, late_decode=0, e4m3_int_decode=0, PART_BF16=1, waves=0,
                                  maxnreg=168), "bf16", False, "o")
    assert {k: la.constexprs[k] for k in ("HAS_EXTRA", "HAS_EXTRA_LEN", "KCVT", "DEC_LATE", "SPAN")} == \
        {"HAS_EXTRA": False, "HAS_EXTRA_LEN": False, "KCVT": False, "DEC_LATE": False, "SPAN": False}
    assert la.need == {"ctas": 1} and la.sig == {"acc_ws": "*bf16"}
    assert la.options == {"num_warps": 4, "num_stages": 1, "maxnreg": 168}
    (la,) = SL._split_launch(dict(REG, waves=0), "bf16", False, "o")
    assert la.need == {"ctas": 1}                        # at least one


def test_tiled_flat_and_wspec_launches_as_attention_launch_makes_them():
    tiled = {"impl": "tiled", "BLOCK_H": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "maxnreg": 0,
             "waves": 2, "PREFETCH": 1, "e4m3_int_decode": 1, "PART_BF16": 1}
    split, quant = SL._split_launch(dict(tiled), "fp8", False, "t")
    assert split.kernel == "attention.split_kernel_tiled" and split.need == {"ctas": 1, "mma": "fp8"}
    assert split.constexprs == {"HAS_MAIN_LEN": True, "HAS_EXTRA": False, "HAS_EXTRA_LEN": False, "BLOCK_H": 32,
                                "BLOCK_N": 32, "FP8_QK": True, "INTERP": False, "PREFETCH": 1, "KCVT": True}
    assert split.sig == {"acc_ws": "*bf16"} and split.options == {"num_warps": 8, "num_stages": 2}
    assert (quant.kernel, quant.constexprs, quant.options, quant.sig, quant.need, quant.origins) == \
        ("attention.q_fp8_kernel", {"BLOCK_H": 32, "INTERP": False}, {"num_warps": 4}, {}, {}, ["t"])
    (split,) = SL._split_launch(dict(tiled, PREFETCH=0), "bf16", True, "t")   # bf16: no Q quantization launch
    assert split.need == {"ctas": 1} and split.constexprs["FP8_QK"] is False and split.constexprs["PREFETCH"] == 0
    assert split.constexprs["q8_ptr"] is None and split.constexprs["qsc_ptr"] is None
    flat = {"impl": "flat", "BLOCK_H": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "maxnreg": 0, "waves": 2,
            "PART_BF16": 1}
    (la,) = SL._split_launch(dict(flat), "fp8", True, "f")   # one launch; the flat partial is fp32
    assert la.kernel == "attention.split_kernel_flat" and la.sig == {"acc_ws": "*fp32"}
    assert la.need == {"ctas": 1, "mma": "fp8"} and "KCVT" not in la.constexprs and "q8_ptr" not in la.constexprs
    wspec = {"impl": "wspec", "BLOCK_H": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "maxnreg": 168,
             "waves": 1, "spanning_splits": 1, "PART_BF16": 1}
    (la,) = SL._split_launch(dict(wspec), "bf16", True, "w")
    # the Gluon body's whole constexpr set: spanning splits, bf16 QK and no interpreter are its contract, not flags
    assert la.constexprs == {"HAS_MAIN_LEN": True, "HAS_EXTRA": True, "HAS_EXTRA_LEN": True, "BLOCK_H": 32,
                             "BLOCK_N": 32, "PRODUCER_REGS": 104, "CWARPS": 8}
    assert la.need == {"ctas": 1} and la.options == {"num_warps": 8, "num_stages": 1, "maxnreg": 168}
    (la,) = SL._split_launch(dict(wspec, BLOCK_H=16, maxnreg=128, num_warps=4), "bf16", True, "w")
    assert la.constexprs["PRODUCER_REGS"] == 96 and la.constexprs["CWARPS"] == 4

if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: PYTHONPATH=overlay python tests/test_sm120_coverage_units.py --record")
    record()
