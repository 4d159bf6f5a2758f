"""The MMA floor of the attention benchmark (bench/attn_mma_floor.py): the blocks it charges a call, the check that
catches a dropped MMA, its rows in bench/bench_attention.py, and its loop as compiled for sm_90 (no GPU here)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# before Triton is imported: the other test files of this process run Triton's interpreter (the floor kernel here
# is only compiled, in a child without it)
os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import attn_mma_floor as M  # noqa: E402
from conftest import gpu_compile_result  # noqa: E402


def _count(heads, rows_main, rows_extra):
    # independent count: a loop over the rows' candidates in 64-candidate steps, per head group of the body
    n = 0
    for ln in rows_main + rows_extra:
        j = 0
        while j < ln:
            n += 1
            j += 64
    groups = 0
    h = 0
    while h < heads:
        groups += 1
        h += 16 if heads <= 16 else 32
    return n * groups


@pytest.mark.parametrize("seed", range(4))
def test_call_blocks_counts_each_rows_blocks_per_head_group(seed):
    rnd = random.Random(seed)
    T, K, K2 = rnd.randint(1, 9), rnd.choice([64, 100, 128, 192]), rnd.choice([0, 50, 512, 1024])
    ln = [rnd.randint(0, K) for _ in range(T)]
    ln2 = [rnd.randint(0, K2) for _ in range(T)]
    kw = dict(indices=torch.zeros(T, 1, K, dtype=torch.int32), topk_length=torch.tensor(ln, dtype=torch.int32))
    if K2:
        kw.update(extra_indices_in_kvcache=torch.zeros(T, 1, K2, dtype=torch.int32),
                  extra_topk_length=torch.tensor(ln2, dtype=torch.int32))
    for heads in (1, 8, 16, 24, 32, 64, 128):
        assert M.call_blocks(heads, **kw) == _count(heads, ln, ln2 if K2 else []), heads
    # no lengths: every list runs to its width
    assert M.call_blocks(16, indices=torch.zeros(T, 1, K)) == _count(16, [K] * T, [])


def _expected_sums(f):
    # float64 products by an explicit loop over the candidates (not the check's matmul)
    a, q, p = f.a.double(), f.q.double(), f.p.double()
    qk = sum((a[j][None, :] * q).sum() for j in range(a.shape[0]))            # sum of A Q^T
    pv = sum((a[j][:, None] * p[:, j][None, :]).sum() for j in range(a.shape[0]))  # sum of A^T P^T
    out = torch.zeros(f.C, 2, dtype=torch.float64)
    for c in range(f.C):
        n = (c + 1) * f.W // f.C - c * f.W // f.C
        out[c] = torch.stack([qk, pv]) * n
    return out


@pytest.mark.parametrize("heads,blocks,sms", [(16, 10, 4), (32, 7, 132), (8, 133, 132)])
def test_check_accepts_every_mma_and_catches_a_dropped_one(heads, blocks, sms):
    f = M.MmaFloor(heads, blocks, num_sms=sms, device="cpu", seed=blocks)
    assert f.N == (16 if heads <= 16 else 32) and f.C == min(sms, blocks)
    want = _expected_sums(f)
    f.sums.copy_(want.float())
    f.check()
    per_block = want[0] / ((f.W // f.C) or 1)
    for c, j in ((0, 0), (f.C - 1, 1)):
        f.sums.copy_(want.float())
        f.sums[c, j] -= float(per_block[j])     # one block's QK (or PV) missing in program c
        with pytest.raises(RuntimeError, match=f"program {c}: {'QK' if j == 0 else 'PV'}"):
            f.check()
    f.sums.copy_(want.float())
    f.sums[f.C // 2, 0] = float("nan")
    with pytest.raises(RuntimeError):
        f.check()


def test_dry_run_lists_the_mma_floor_only_when_asked(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)

    def impls(*args):
        r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_attention.py"), "--dry-run", "--results",
                            str(tmp_path / "r.csv"), "--cases", "spec_h16_c4", "--batches", "96", *args],
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        return [ln.split(",")[3] for ln in r.stdout.splitlines() if ln.startswith("attention,")]

    assert "mma-floor" not in impls()
    got = impls("--impls", "ours,floor,mma")
    assert got == ["ours-bf16", "gather-floor", "mma-floor"], got
    # above 32 heads the 64-head body runs: no MMA floor row
    assert impls("--impls", "ours,mma", "--cases", "spec_h64_c4") == ["ours-bf16"]
    assert not (tmp_path / "r.csv").exists()


_COMPILE = r"""
import json, sys
sys.path.insert(0, "bench")
import attn_mma_floor as M
from dsv4_sm120.dev.sass import compile_inspect, hot_loop_ops, kernel_source
sig = {"a_ptr": "*bf16", "q_ptr": "*bf16", "p_ptr": "*bf16", "sums_ptr": "*fp32", "W": "i32"}
out = {}
for N in (16, 32):
    try:
        k, sass, res = compile_inspect(kernel_source(M.mma_floor_kernel, sig, {"N": N}, list(sig)[:4]), 90,
                                       {"num_warps": 4})
        ops = [o[1] for o in hot_loop_ops(sass)]
        out[f"n{N}"] = dict(res, shared=k.metadata.shared, ptx_shapes=sorted(set(
            __import__("re").findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", k.asm["ptx"]))),
            loop_mma=sum(o.startswith("HGMMA") for o in ops),
            loop_mem=sum(o.startswith(("LDG", "STG", "LDS", "STS", "LDL", "STL")) for o in ops))
    except Exception as e:
        out[f"n{N}"] = {"error": f"{type(e).__name__}: {e}"[-400:]}
print("RESULT" + json.dumps(out))
"""


def test_loop_is_the_bodys_64_mmas_per_block_and_nothing_else():
    """Compiled for sm_90: per block 64 warpgroup MMAs of the body's shape (m64n16k16 / m64n32k16: 32 for QK and
    32 for PV), no memory instruction in the loop, no spills, the tiles within one SM's shared memory."""
    out = gpu_compile_result(_COMPILE)
    for name, v in out.items():
        assert "error" not in v, (name, v)
        n = int(name[1:])
        assert v["ptx_shapes"] == [f"m64n{n}k16"], (name, v)
        assert v["loop_mma"] in (0, 64) and v["loop_mem"] == 0, (name, v)   # 0: cuobjdump gave no SASS here
        assert v.get("stack", 0) == 0 and v["shared"] <= 227 * 1024, (name, v)


def test_run_ends_with_the_mma_share_table():
    """The closing tables of a run: ours' mma_share notes per case and B, beside the gather floor's shares."""
    import bench_attention as BA
    from dsv4_sm120.dev import bench_results as R

    def row(impl, B, notes):
        return R.make_row("attention", case="spec_h16_c4", impl=impl, layout="swa128+c4", heads=16, batch=B,
                          context=16384, date="2026-12-01T00:00:00+00:00", notes=notes, us=10.0)

    rows = [row("mma-floor", 6, "layers=4; sums=ok"), row("ours-bf16", 6, "floor_share=0.500; mma_share=0.312"),
            row("ours-bf16", 96, "floor_share=0.400")]
    text = BA.floor_share_table(rows, "mma_share", "MMA floor share:")
    assert text.splitlines()[1] == "MMA floor share:"
    assert "| ours-bf16 | 0.312 |" in text and "B=96" not in text and "mma-floor |" not in text
    assert "| ours-bf16 | 0.500 | 0.400 |" in BA.floor_share_table(rows)
    assert BA.floor_share_table(rows[:1], "mma_share", "x") == ""
