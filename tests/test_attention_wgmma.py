"""The Hopper warpgroup-MMA split body (impl=wgmma, a Gluon kernel) on a CPU box: Triton's interpreter does not run
Gluon, so its numerics are proven on the H200 (tests/gpu/test_attention_gpu.py: the wgmma variants, and the whole file
with DSV4_SM120_TEST_ATTN_CONFIG=impl=wgmma; bench/results/attention.csv) and here it is compiled for sm_90 with the
launch options attention.launch gives it (its refusals where it cannot run: tests/test_attention_wspec.py,
test_attention_config.py)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import gpu_compile_result  # noqa: E402

_WGMMA_COMPILE = r"""
import json, re
from dsv4_sm120.attention import config
from dsv4_sm120.attention.keys import producer_regs
from dsv4_sm120.attention.kernels import SPLIT_KERNELS
from dsv4_sm120.dev.sass import compile_inspect, split_kernel_source
# the launch attention.launch makes on an H200
L = config.resolve(64, 384, 128, 512, config.Device("NVIDIA H200", (9, 0), 132), overrides={"impl": "wgmma"})
c = L.config
base = dict(HAS_MAIN_LEN=True, HAS_EXTRA=True, HAS_EXTRA_LEN=True, BLOCK_H=c["BLOCK_H"], BLOCK_N=c["BLOCK_N"],
            PRODUCER_REGS=producer_regs("wgmma", c["maxnreg"]))
opts = {"num_warps": c["num_warps"], "num_stages": c["num_stages"], "maxnreg": c["maxnreg"]}


def build(cst):
    try:
        k, sass, res = compile_inspect(split_kernel_source(SPLIT_KERNELS["wgmma"], cst), 90, opts)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    ptx = k.asm["ptx"]
    return dict(res, shared=k.metadata.shared, sass=len(sass), producer=cst["PRODUCER_REGS"], maxnreg=c["maxnreg"],
                threads=int(re.search(r"\.reqntid (\d+)", ptx).group(1)),
                setmaxnreg=re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx),
                mbarrier_waits=len(re.findall(r"mbarrier\.try_wait", ptx)),
                wgmma=sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)\.f32\.bf16\.bf16", ptx))),
                proxy_fences=len(re.findall(r"fence\.proxy\.async", ptx)),
                hgmma=len(re.findall(r"\bHGMMA\.64x\d+x16\.F32\.BF16\b", sass)),
                ldg128=len(re.findall(r"\bLDG\.E\.128\b", sass)), stg128=len(re.findall(r"\bSTG\.E\.128\b", sass)),
                stl=len(re.findall(r"\bSTL(\.\d+)?\b", sass)))


# as launched: partials for the combine (no output pointers), or one split per row writing out / lse itself
# (16 heads: the output stored from the accumulator layout, not staged)
out = {"sm90": build(dict(base, out_ptr=None, lse_ptr=None, sink_ptr=None)),
       "sm90_final": build(dict(base, FINAL=True, HAS_SINK=True)),
       "sm90_final_unstaged": build(dict(base, FINAL=True, HAS_SINK=True, STAGE_OUT=False))}
print("RESULT" + json.dumps(out))
"""


def test_the_warpgroup_mma_body_compiles_for_hopper():
    """impl=wgmma compiles for sm_90 as launched: 384 threads (8 consumer + 4 producer warps) at a cap of 168
    registers, which fills the register file once (one CTA per SM); the producers run at their 152 registers and the
    consumers take the rest (176); Q and the two-slot ring in 201 KB of the 227 KB a block may have; the QK (N = 32 per
    warpgroup) and PV (N = 256) warpgroup MMAs; proxy fences between the generic-proxy stores and the MMAs' reads;
    16-byte gathers; a bounded stack (a few spilled words). The builds: partials for the combine, one split per row
    writing out / lse itself, both staging their rows through shared memory (16-byte stores), and the unstaged
    output of 16 heads."""
    builds = gpu_compile_result(_WGMMA_COMPILE, timeout=900)
    for name, r in builds.items():
        _check_hopper_build(r)
        if r["sass"]:
            # staged: 64 x 512 bf16 over 256 consumer threads = 16 vector stores each; unstaged: none
            assert (r["stg128"] >= 16) == (name != "sm90_final_unstaged"), (name, r)


def _check_hopper_build(r):
    assert "error" not in r, r
    assert r["threads"] == 384 and r["maxnreg"] * 384 <= 65536, r
    assert r["shared"] <= 227 * 1024, r
    assert r["wgmma"] == ["m64n256k16", "m64n32k16"], r
    assert r["mbarrier_waits"] >= 2 and r["proxy_fences"] >= 2, r
    counts = {int(n) for _, n in r["setmaxnreg"]}
    consumers = (r["maxnreg"] * 384 - r["producer"] * 128) // 256 // 8 * 8
    assert r["producer"] in counts and consumers == 176 and consumers in counts, r
    if r["sass"] == 0:
        pytest.skip("cuobjdump gave no SASS here")
    assert r["regs"] == r["maxnreg"] and r["hgmma"] >= 36 and r["ldg128"] >= 14, r
    assert r.get("stack", 0) <= 128, r


_WGMMA_T_COMPILE = r"""
import json, re
from dsv4_sm120.attention import config
from dsv4_sm120.attention.keys import producer_regs
from dsv4_sm120.attention.kernels import SPLIT_KERNELS
from dsv4_sm120.dev.sass import compile_inspect, split_kernel_source
dev = config.Device("NVIDIA H200", (9, 0), 132)


def build(H, cst, acc="*bf16"):
    # the launch attention.launch makes on an H200 for H heads
    c = config.resolve(H, 384, 128, 512, dev, overrides={"impl": "wgmma_t"}).config
    base = dict(HAS_MAIN_LEN=True, HAS_EXTRA=True, HAS_EXTRA_LEN=True, BLOCK_H=c["BLOCK_H"], BLOCK_N=c["BLOCK_N"],
                PRODUCER_REGS=producer_regs("wgmma_t", c["maxnreg"]))
    opts = {"num_warps": c["num_warps"], "num_stages": c["num_stages"], "maxnreg": c["maxnreg"]}
    try:
        k, sass, res = compile_inspect(split_kernel_source(SPLIT_KERNELS["wgmma_t"], dict(base, **cst), acc), 90, opts)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    ptx = k.asm["ptx"]
    return dict(res, shared=k.metadata.shared, sass=len(sass), producer=base["PRODUCER_REGS"], maxnreg=c["maxnreg"],
                block_h=c["BLOCK_H"], threads=int(re.search(r"\.reqntid (\d+)", ptx).group(1)),
                setmaxnreg=re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx),
                wgmma=sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)\.f32\.bf16\.bf16", ptx))),
                proxy_fences=len(re.findall(r"fence\.proxy\.async", ptx)),
                hgmma=len(re.findall(r"\bHGMMA\.64x\d+x16\.F32\.BF16\b", sass)),
                ldg128=len(re.findall(r"\bLDG\.E\.128\b", sass)), stg128=len(re.findall(r"\bSTG\.E\.128\b", sass)))


part = dict(out_ptr=None, lse_ptr=None, sink_ptr=None)
out = {"h16_part": build(16, part), "h16_part_fp32": build(16, part, "*fp32"),
       "h16_final": build(16, dict(FINAL=True, HAS_SINK=True)), "h32_final": build(32, dict(FINAL=True, HAS_SINK=True)),
       "h8_part": build(8, part),
       "h16_balanced": build(16, dict(FINAL=False, HAS_SINK=True, BALANCED=True))}
print("RESULT" + json.dumps(out))
"""


def test_the_candidates_as_m_body_compiles_for_hopper():
    """impl=wgmma_t compiles for sm_90 as launched: 384 threads (4 consumer warps + two partitions of 4 producer
    warps) at a cap of 168 registers (one CTA per SM); each producer partition at its 144 and the consumer warpgroup
    at the rest (216); the heads as the MMA's N (m64n16k16 for 8 and 16 heads, m64n32k16 for 32), 32 k-steps of QK
    and 8 x 4 of PV per block; proxy fences between the generic-proxy stores (decoded K, P) and the MMAs' reads;
    16-byte gathers and 16-byte output stores; no spills; the ring, Q and P within the 227 KB a block may have."""
    builds = gpu_compile_result(_WGMMA_T_COMPILE, timeout=900)
    for name, r in builds.items():
        assert "error" not in r, (name, r)
        assert r["block_h"] == (32 if name.startswith("h32") else 16), (name, r)
        assert r["threads"] == 384 and r["maxnreg"] * 384 <= 65536 and r["shared"] <= 227 * 1024, (name, r)
        assert r["wgmma"] == [f"m64n{r['block_h']}k16"], (name, r)
        assert r["proxy_fences"] >= 3, (name, r)
        counts = {int(n) for _, n in r["setmaxnreg"]}
        consumers = (r["maxnreg"] * 384 - 2 * r["producer"] * 128) // 128 // 8 * 8
        assert r["producer"] in counts and consumers == 216 and consumers in counts, (name, r)
        if r["sass"] == 0:
            pytest.skip("cuobjdump gave no SASS here")
        # the balanced launch keeps a few per-piece scalars (its run and row) on the stack under Triton 3.8 (its
        # producer loops reload them: 1-8 local loads per ~480 instructions, sm_90); none under 3.6
        assert r["regs"] == r["maxnreg"] and r.get("stack", 0) <= (64 if "balanced" in name else 0), (name, r)
        assert r["hgmma"] >= 64 and r["ldg128"] >= 14, (name, r)
        # 16 or 32 heads x 512 bf16 over 128 consumer threads in 16-byte vectors
        assert r["stg128"] >= r["block_h"] // 2, (name, r)
