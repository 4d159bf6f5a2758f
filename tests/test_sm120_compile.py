"""Compile coverage for sm_120 (no GPU): every distinct launch the product can make on an sm_120 GPU, taken from
the launch tables and calibrate's launch variants (dsv4_sm120.dev.sm120_launches), compiles for sm_120 with
Triton's own ptxas, fits 99 KiB of shared memory per block and the CTAs per SM it needs, spills nothing, and on the
MoE fp4 path (and the fp8 QK bodies) has the native block-scaled MMA in its SASS
(dsv4_sm120.dev.sm120_compile). Results are cached by source hash in DSV4_SM120_CACHE, so only a changed kernel
or table entry compiles again."""
from __future__ import annotations

import pytest

from conftest import gpu_compile_result
from dsv4_sm120 import launch_tables as lt
from dsv4_sm120.dev import sm120_compile as SC
from dsv4_sm120.dev import sm120_launches as SL

_RUN = "import sys\nfrom dsv4_sm120.dev.sm120_compile import main\nsys.exit(main(['--json', {family!r}]))\n"


@pytest.mark.parametrize("family", SL.FAMILIES)
def test_every_sm120_launch_compiles_within_the_limits(family):
    """Each problem line names the table file[key] (and the variant) the launch comes from."""
    out = gpu_compile_result(_RUN.format(family=family), timeout=3600)
    s = out[family]
    assert s["launches"] > 0, s
    assert not s["problems"], f"{len(s['problems'])} sm_120 launch problem(s):\n" + "\n".join(s["problems"])


@pytest.fixture(scope="module")
def launches():
    return SL.enumerate_launches()


def _origins(ls):
    return " | ".join(o for la in ls for o in la.origins)


def test_enumeration_covers_every_table_key_variant_and_kernel(launches):
    """The enumeration reaches every key of every table an sm_120 GPU reads, every calibrate variant, both QK
    modes, both MoE paths and GEMMs with APRE on and off, and every kernel the two operations launch there (not
    Hopper's warpgroup-MMA body, which sm_120 refuses)."""
    from dsv4_sm120.calibrate.attention import VARIANTS

    att = launches["attention"]
    names = " | ".join(o for la in att for o in la.origins)
    for shape in [f"H={h},qk={q}" for h in (16, 32, 64) for q in ("bf16", "fp8")] + ["impl=reg"]:
        found = lt.lookup("attention", shape, 1, lt.DEFAULT_DEVICE, SL.CAPABILITY)
        for key in lt.read_table(found.path):
            assert f"{found.path.name}[{key}]" in names, (shape, key)
    assert "arch_sm_120" in names and "impl=reg,device_name=default.json" in names
    for v in VARIANTS:
        assert f"with {v} (qk=bf16)" in names, v
    assert {la.kernel for la in att} == {"attention.split_kernel_tiled", "attention.split_kernel_reg",
                                         "attention.split_kernel_flat", "attention.split_kernel_wspec",
                                         "attention.q_fp8_kernel"}
    # both QK modes on the Triton bodies; the Gluon body (bf16 only) takes no QK flag
    assert {la.constexprs["FP8_QK"] for la in att if "split" in la.kernel and "wspec" not in la.kernel} == {False, True}
    assert not any("FP8_QK" in la.constexprs for la in att if "wspec" in la.kernel)
    assert {la.kernel for la in launches["combine"]} == {"attention.combine_kernel"}
    for path in ("fp4", "bf16"):
        ls = launches[f"moe_{path}"]
        text = _origins(ls)
        for E, topk, tpath in SL._moe_shapes(path):
            assert tpath.name in text, tpath
        gemms = [la for la in ls if "_gemm" in la.kernel]
        assert {la.kernel for la in gemms} == {"moe._gemm1_kernel", "moe._gemm2_kernel"}
        assert {la.constexprs["APRE"] for la in gemms} == ({False, True} if path == "fp4" else {False})
        assert all(la.need.get("mma") == ("fp4" if path == "fp4" else None) for la in gemms)
        assert {"moe._align_kernel", "moe._reduce_kernel"} <= {la.kernel for la in ls}
    assert "moe._quant_rows_kernel" in {la.kernel for la in launches["moe_fp4"]}


def _launch(warps=4, **need):
    return SL.Launch("attention", "attention.split_kernel_reg", {"BLOCK_N": 32}, {"num_warps": warps, "num_stages": 1},
                     {}, need, ["attention/H=16,qk=bf16,device_name=arch_sm_120.json[4] (qk=bf16)"])


GOOD = {"shared": 50176, "static_shared": 1024, "regs": 236, "stack": 0, "local": 0, "local_ops": 0,
        "mma": ["HMMA.16816.F32.BF16"]}


@pytest.mark.parametrize("warps,bad,needle", [
    (4, {"shared": 99 * 1024 + 16}, "shared memory per block"),
    (4, {"local_ops": 12, "stack": 48}, "spills to local memory"),
    (4, {"shared": 52 * 1024}, "fits 1 CTA(s) per SM"),  # two CTAs + 1 KiB reserved each exceed 100 KiB
    (8, {"regs": 200}, "fits 1 CTA(s) per SM"),          # 200 registers x 256 threads: one CTA by registers
    (4, {"error": "CompilationError: out of resources"}, "does not compile for sm_120"),
])
def test_a_broken_launch_is_named_by_its_table_file_and_key(warps, bad, needle):
    base = dict(GOOD, regs=128)   # two CTAs of 4 or 8 warps by registers
    assert SC.problems(_launch(warps, ctas=2), base) == []
    assert SC.problems(_launch(warps, ctas=2), dict(base, stack=16)) == []   # a frame nothing loads or stores
    got = SC.problems(_launch(warps, ctas=2), dict(base, **bad))
    assert got and any(needle in g for g in got), got
    assert all(g.startswith("attention/H=16,qk=bf16,device_name=arch_sm_120.json[4]") for g in got), got


def test_the_fp4_path_without_the_block_scaled_mma_is_a_problem():
    la = _launch(mma="fp4")
    assert SC.problems(la, dict(GOOD, mma=["OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X"])) == []
    got = SC.problems(la, dict(GOOD, mma=["HMMA.16816.F32.BF16"]))
    assert len(got) == 1 and "block-scaled FP4 MMA" in got[0] and "HMMA.16816.F32.BF16" in got[0], got


def test_occupancy_follows_the_sm120_limits():
    assert SC.ctas_per_sm(GOOD, 4) == {"shared": 2, "threads": 12, "registers": 2, "all": 2}
    assert SC.ctas_per_sm(dict(GOOD, shared=0, regs=32), 1)["all"] == SC.CTAS_PER_SM


def test_the_wide_warp_specialized_launches_are_pinned_to_their_measured_resources():
    """wspec at 32 / 64 heads per program: shared memory, registers and the partitions' setmaxnreg values as measured
    (RESOURCE_BOUNDS); one byte, one register or another register split past them is a problem."""
    for bh, split in ((32, [104, 200]), (64, [88, 208])):
        la = SL.Launch("attention", "attention.split_kernel_wspec", {"BLOCK_H": bh, "BLOCK_N": 32 if bh == 32 else 16},
                       {"num_warps": 8, "num_stages": 1, "maxnreg": 168}, {}, {"ctas": 1},
                       [f"attention/H={bh},qk=bf16,device_name=arch_sm_120.json[1] (qk=bf16)"])
        la.need.update(SL.resource_bounds(la))
        good = dict(GOOD, shared=100388, regs=168, setmaxnreg=sorted(split + [24, 240]))
        assert SC.problems(la, good) == [], SC.problems(la, good)
        for bad, needle in (({"shared": 100389}, "pinned to"), ({"regs": 176}, "registers per thread"),
                            ({"setmaxnreg": [24, 96, 208, 240]}, "setmaxnreg")):
            got = SC.problems(la, dict(good, **bad))
            assert any(needle in g for g in got), (bh, bad, got)
    # the 16-head launch has no pin beyond the SM's limits
    assert SL.resource_bounds(SL.Launch("attention", "attention.split_kernel_wspec", {"BLOCK_H": 16}, {}, {})) == {}
