"""The sm_120 launch enumeration's own rules (dsv4_sm120.dev.sm120_launches), each against an expectation written
here (the rules, the launch set and the row counts are tested beside their older checks in
test_sm120_coverage_units.py): the requests follow the architecture list of the bodies, the long
context's c128 candidates, the origin each launch names (what a problem line shows), one family asked for alone
gives the launches it gives among all, every MoE table key is reached, and the decode batches the combine covers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dsv4_sm120 import launch_tables as lt
from dsv4_sm120.attention import keys as K
from dsv4_sm120.calibrate.attention import VARIANTS
from dsv4_sm120.dev import sm120_launches as SL

FACTS = json.loads((Path(__file__).resolve().parent / "data" / "sm120_compile_facts.json").read_text())


def test_the_requests_follow_the_bodies_architecture_list(monkeypatch):
    """A body listed for sm_120 only is asked for; one listed for other architectures is skipped and the bodies
    after it are still asked for."""
    monkeypatch.setitem(K.IMPL_ARCHS, "flat", (12,))
    monkeypatch.setitem(K.IMPL_ARCHS, "tiled", (9, 10))
    got = SL._attention_requests()
    by_name = got[2:len(got) - len(VARIANTS)]   # after the two defaults, before calibrate's variants
    assert by_name == [("bf16", {"impl": "flat"}, "impl=flat"), ("fp8", {"impl": "flat"}, "impl=flat"),
                       ("bf16", {"impl": "reg"}, "impl=reg"), ("bf16", {"impl": "wspec"}, "impl=wspec")]


@pytest.mark.parametrize("context,c128", [(1 << 20, 8192), (131072, 1024), (16385, 192), (256, 64), (1, 64)])
def test_the_c128_candidates_of_the_long_context(monkeypatch, context, c128):
    """ceil(context / 256) pairs of compressed blocks, rounded up to whole 64-candidate blocks: 16385 tokens are
    65 x 256-token spans -> 130 -> 192."""
    monkeypatch.setattr(SL, "LONG_CONTEXT", context)
    shapes = dict((name, (k1, k2)) for name, k1, k2 in SL._attention_shapes())
    assert shapes["c128"][1] == c128 and type(shapes["c128"][1]) is int
    assert shapes["swa"][1] == 0 and shapes["c4"][1] > 0


def test_the_hopper_warpgroup_bodies_get_their_producer_registers():
    cfg = {"impl": "wgmma", "BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "maxnreg": 168,
           "waves": 1, "spanning_splits": 1, "PART_BF16": 1}
    (la,) = SL._split_launch(cfg, "bf16", False, "w")
    assert la.constexprs["PRODUCER_REGS"] == 152 and "CWARPS" not in la.constexprs
    (la,) = SL._split_launch(dict(cfg, impl="wgmma_t", BLOCK_H=16, num_warps=4), "bf16", False, "w")
    assert la.constexprs["PRODUCER_REGS"] == 144 and "CWARPS" not in la.constexprs


ATT_ORIGIN = re.compile(r"attention/(H=(16|32|64),qk=(bf16|fp8)|impl=reg),device_name=(arch_sm_120|default)\.json"
                        r"\[\d+\]( \([^()]+\))?( with [^ ]+)? \(qk=(bf16|fp8)\)")   # (a note the resolve adds)
COMBINE_ORIGIN = re.compile(ATT_ORIGIN.pattern + r", combine of T=(?P<T>\d+) H=(\d+) on (84|170|188) SMs")
MOE_ORIGIN = re.compile(r"moe/E=\d+,topk=\d+,path=(fp4|bf16),device_name=default\.json\[\d+\]( \(APRE=[01]\))?")


def test_the_whole_enumeration_origins_moe_keys_and_combine_batches():
    """One enumeration (mutation testing records a module-scoped fixture for its first test only), three checks."""
    launches = SL.enumerate_launches()
    _each_origin_names_its_table_entry_request_and_mode(launches)
    _every_moe_table_key_is_reached(launches)
    _the_combine_covers_every_decode_batch_and_the_table_rows(launches)


def _each_origin_names_its_table_entry_request_and_mode(launches):
    for la in launches["attention"]:
        for o in la.origins:
            assert ATT_ORIGIN.fullmatch(o), o
    for la in launches["combine"]:
        for o in la.origins:
            assert COMBINE_ORIGIN.fullmatch(o), o
    for path in ("fp4", "bf16"):
        for la in launches[f"moe_{path}"]:
            gemm = "_gemm" in la.kernel or "_quant_rows" in la.kernel
            for o in la.origins:
                m = MOE_ORIGIN.fullmatch(o)
                assert m and m.group(1) == path, o
                # fp4 GEMMs (and their quantizers) say whether the activation was pre-quantized; nothing else does
                assert bool(m.group(2)) == (gemm and path == "fp4"), o


@pytest.mark.parametrize("family", ["attention", "combine"])
def test_a_family_asked_for_alone_gives_its_recorded_launches(family):
    got = SL.enumerate_launches([family])
    assert list(got) == [family]
    assert {la.key for la in got[family]} == set(FACTS[family])
    # every entry of every table an sm_120 GPU reads is named, without the combine's extra batches too
    names = " | ".join(o for la in got[family] for o in la.origins)
    for shape in [f"H={h},qk={q}" for h in (16, 32, 64) for q in ("bf16", "fp8")] + ["impl=reg"]:
        found = lt.lookup("attention", shape, 1, lt.DEFAULT_DEVICE, SL.CAPABILITY)
        for key in lt.read_table(found.path):
            assert f"{found.path.name}[{key}]" in names, (shape, key)


def _every_moe_table_key_is_reached(launches):
    for path in ("fp4", "bf16"):
        text = " | ".join(o for la in launches[f"moe_{path}"] for o in la.origins)
        for _, _, tpath in SL._moe_shapes(path):
            for key in lt.read_table(tpath):
                assert f"{tpath.name}[{key}]" in text, (tpath.name, key)


def _the_combine_covers_every_decode_batch_and_the_table_rows(launches):
    """T = 1..64 and the powers of two 128..4096 (decode and verify batches), plus the first row of each table key
    at each SM count; nothing else, and no T = 0."""
    seen = {int(COMBINE_ORIGIN.fullmatch(o).group("T")) for la in launches["combine"] for o in la.origins}
    batches = set(range(1, 65)) | {128, 256, 512, 1024, 2048, 4096}
    table_rows = set()
    for shape in [f"H={h},qk={q}" for h in (16, 32, 64) for q in ("bf16", "fp8")] + ["impl=reg"]:
        keys = lt.read_table(lt.lookup("attention", shape, 1, lt.DEFAULT_DEVICE, SL.CAPABILITY).path)
        for nsm in SL.SM120_SMS:
            for hg in (1, 2, 4):
                table_rows |= set(SL._rows_for_keys(keys, hg, nsm))
    assert batches <= seen and seen <= batches | table_rows and min(seen) == 1
    assert 65 not in seen and 8192 not in seen


def test_the_combine_launch_as_launch_combine_makes_it():
    cfg = {"impl": "reg", "PART_BF16": 1, "BLOCK_D": 128, "BLOCK_S": 8, "combine_warps": 2, "combine_maxnreg": 64}
    la = SL._combine_launch(cfg, "o")
    assert (la.family, la.kernel, la.origins, la.need) == ("combine", "attention.combine_kernel", ["o"], {})
    assert la.constexprs == {"HAS_SINK": True, "BLOCK_D": 128, "BLOCK_S": 8, "BALANCED": False, "BH": 16, "NB": 1,
                             "W": 1, "C": 1}
    assert la.options == {"num_warps": 2, "num_stages": 1, "maxnreg": 64} and la.sig == {"acc_ws": "*bf16"}
    # no register cap: no maxnreg option (not maxnreg=0); the flat body (no PART_BF16 key) and PART_BF16=0: fp32
    la = SL._combine_launch(dict(cfg, combine_maxnreg=0, PART_BF16=0), "o")
    assert la.options == {"num_warps": 2, "num_stages": 1} and la.sig == {"acc_ws": "*fp32"}
    flat = {k: v for k, v in cfg.items() if k != "PART_BF16"}
    assert SL._combine_launch(dict(flat, impl="flat"), "o").sig == {"acc_ws": "*fp32"}
    assert SL._combine_launch(dict(cfg, impl="flat"), "o").sig == {"acc_ws": "*fp32"}   # flat's partial is fp32


@pytest.mark.parametrize("H,ov,qk,table", [
    (64, {}, "bf16", "H=64,qk=bf16,device_name=arch_sm_120.json"),
    (40, {}, "bf16", "H=64,qk=bf16,device_name=arch_sm_120.json"),           # 3 groups of 16 heads (2.5 rounded up)
    (33, {}, "bf16", "H=64,qk=bf16,device_name=arch_sm_120.json"),           # 3 groups
    (8, {}, "fp8", "H=16,qk=fp8,device_name=arch_sm_120.json"),            # 8 heads: the 16-head class
    (32, {"impl": "tiled"}, "bf16", "H=32,qk=fp8,device_name=arch_sm_120.json"),
    (16, {"impl": "flat"}, "bf16", "H=16,qk=fp8,device_name=arch_sm_120.json"),
    (64, {"impl": "reg"}, "bf16", "impl=reg,device_name=default.json"),
    (32, {"impl": "wspec", "BLOCK_H": 32}, "bf16", "impl=reg,device_name=default.json"),
    (32, {"BLOCK_N": 16}, "bf16", "H=32,qk=bf16,device_name=arch_sm_120.json"),
])
def test_the_table_and_rows_each_request_reads(H, ov, qk, table):
    """The table by hand; its rows: the first T of each key, found by walking T upward (``ceil(T * groups / nsm)``
    with 16-head groups), and the batches 1..64, 128..4096 only for the combine."""
    from dsv4_sm120.attention import config as C

    path = SL._attention_table(H, ov, qk)
    assert path.name == table and path.parent.name == C.KERNEL
    keys, groups = set(lt.read_table(path)), -(-H // 16)
    for nsm in (84, 188):
        first, T = {}, 1
        while len(first) < len(keys) and T < 100000:
            k = -(-T * groups // nsm)
            if k in keys:
                first.setdefault(k, T)
            T += 1
        rows = SL._attention_rows(H, ov, qk, nsm, False)
        assert rows == sorted(first.values()) and all(type(t) is int for t in rows)
        with_batches = SL._attention_rows(H, ov, qk, nsm, True)
        assert with_batches == sorted(set(first.values()) | set(range(1, 65)) | {128, 256, 512, 1024, 2048, 4096})


def test_an_sm120_moe_table_is_read_where_one_exists(tmp_path, monkeypatch, request):
    """An arch_sm_120 MoE table beside the default ones: the enumeration names it and launches its entries (here: the
    default table of one shape with 2 warps in every entry)."""
    import shutil

    shutil.copytree(lt.TABLE_DIR, tmp_path / "tables")
    moe = tmp_path / "tables" / "moe"
    default = json.loads((moe / "E=256,topk=8,path=fp4,device_name=default.json").read_text())
    mine = {k: (dict(v, warps1=2, warps2=2) if isinstance(v, dict) else v) for k, v in default.items()}
    (moe / "E=256,topk=8,path=fp4,device_name=arch_sm_120.json").write_text(json.dumps(mine))
    from dsv4_sm120.moe import config as MoC

    monkeypatch.setattr(lt, "TABLE_DIR", tmp_path / "tables")
    MoC._choose.cache_clear()   # memoized by shape, not by table directory: cleared before and after
    request.addfinalizer(MoC._choose.cache_clear)
    paths = {(E, topk): p.name for E, topk, p in SL._moe_shapes("fp4")}
    assert paths[(256, 8)] == "E=256,topk=8,path=fp4,device_name=arch_sm_120.json"
    assert paths[(256, 6)] == "E=256,topk=6,path=fp4,device_name=default.json"
    s = SL._Set()
    SL._moe("fp4", s)
    arch = [la for la in s.by_key.values() if "_gemm" in la.kernel
            and any("device_name=arch_sm_120.json" in o for o in la.origins)]
    assert arch and all(la.options["num_warps"] == 2 for la in arch)


def test_a_calibrate_variant_that_does_not_parse_is_named(monkeypatch):
    import dsv4_sm120.calibrate.attention as CA
    from dsv4_sm120.attention.config import DecodeInputError

    monkeypatch.setattr(CA, "VARIANTS", ("BLOCK_N=zz",))
    with pytest.raises(DecodeInputError) as e:
        SL._attention_requests()
    assert str(e.value) == "calibrate variant: BLOCK_N needs an integer, got 'zz'"
