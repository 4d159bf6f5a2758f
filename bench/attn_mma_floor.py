"""MMA floor of the sparse MLA decode on Hopper: the warpgroup MMAs that the candidates-as-M body (``impl=wgmma_t``)
issues for a decode call, and nothing else (``bench/bench_attention.py`` times it as the ``mma-floor`` impl next to
the gather floor; docs/attention.md, "How to benchmark").

Per 64-candidate block and group of ``N`` heads the body runs ``S^T = K Q^T`` (A: the block ``[64, 512]`` bf16 in
shared memory, 128-byte swizzle; B: Q ``[N, 512]``: 32 ``m64nNk16``) and ``O^T += V^T P^T`` (A: the same tile
read transposed; B: P ``[N, 64]``: 32 more). This kernel issues exactly those, both A and B from shared memory
as the body has them, on fixed tiles loaded once per program: no gathers, no decode, no softmax, no handoffs. The
call's blocks are its rows' 64-candidate blocks (``ceil(length / 64)`` of the main list plus those of the extra
list, per row, as the body's block count) times its head groups (``N`` = 16 up to 16 heads, else 32, as the
body's ``BLOCK_H``); one program per SM walks an equal run of them (``W // C`` or ``W // C + 1``), QK and PV of a
block issued back to back and waited for together.

Nothing is dropped: each program stores the sums of its QK results and of its final PV accumulator, which
:func:`check` compares with ``n x`` the same products in float64 (``n`` = the program's blocks; every tile entry
is positive, so no cancellation hides a missing MMA).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from attn_floor import _lengths  # the gather floor's per-row lengths (the list's width where none are given)
from dsv4_sm120.attention.config import wgmma_t_block_h

_barrier = getattr(gl, "barrier", None) or gl.thread_barrier   # the CTA barrier's name differs by Triton version
BLOCK = gl.constexpr(64)    # candidates per block (the body's BLOCK_N)
D = gl.constexpr(512)       # K = V width


@gluon.jit
def mma_floor_kernel(a_ptr, q_ptr, p_ptr, sums_ptr, W, N: gl.constexpr):
    """Grid ``(C,)``: program ``c`` runs blocks ``[c W / C, (c + 1) W / C)``, each QK and PV of one 64-candidate
    block at ``N`` heads; ``sums[c] = (sum of its QK results, sum of its PV accumulator)``."""
    AL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
    NV: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    c = gl.program_id(0)
    C = gl.num_programs(0)
    u0 = c * W // C
    u1 = (c + 1) * W // C
    kv = gl.allocate_shared_memory(gl.bfloat16, [BLOCK, D], NV)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [N, D], NV)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [N, BLOCK], NV)
    ra = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, LD))
    rq = gl.arange(0, N, layout=gl.SliceLayout(1, LD))
    cd = gl.arange(0, D, layout=gl.SliceLayout(0, LD))
    LP: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rp = gl.arange(0, N, layout=gl.SliceLayout(1, LP))
    cp = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, LP))
    kv.store(gl.load(a_ptr + gl.expand_dims(ra, 1) * D + gl.expand_dims(cd, 0)))
    q_s.store(gl.load(q_ptr + gl.expand_dims(rq, 1) * D + gl.expand_dims(cd, 0)))
    p_s.store(gl.load(p_ptr + gl.expand_dims(rp, 1) * BLOCK + gl.expand_dims(cp, 0)))
    fence_async_shared()
    _barrier()
    st_sum = gl.zeros([BLOCK, N], gl.float32, AL)
    ot = gl.zeros([D, N], gl.float32, AL)
    for _ in range(u0, u1):
        st = warpgroup_mma(kv, q_s.permute([1, 0]), gl.zeros([BLOCK, N], gl.float32, AL), is_async=True)
        ot = warpgroup_mma(kv.permute([1, 0]), p_s.permute([1, 0]), ot, is_async=True)
        st, ot = warpgroup_mma_wait(0, deps=[st, ot])
        st_sum += st
    gl.store(sums_ptr + 2 * c, gl.sum(gl.sum(st_sum, axis=1), axis=0))
    gl.store(sums_ptr + 2 * c + 1, gl.sum(gl.sum(ot, axis=1), axis=0))


def head_block(heads: int) -> int:
    """The body's heads per program (its MMA N), as its launch picks them (``config.wgmma_t_block_h``)."""
    return wgmma_t_block_h(heads)


def call_blocks(heads: int, indices, topk_length=None, extra_indices_in_kvcache=None, extra_topk_length=None,
                **_ignored) -> int:
    """The blocks the body runs for a call: per row ``ceil(len / 64)`` of the main list plus of the extra list
    (``len``: the row's length, the list's width without one), summed over rows, times the head groups."""
    def blocks(length, idx):   # per row, the list's length (its width without one) cut at the width, in blocks
        n = _lengths(length, idx).to(torch.int64).clamp(0, idx.shape[-1]).cpu()
        return (n + int(BLOCK) - 1) // int(BLOCK)

    n = blocks(topk_length, indices)
    if extra_indices_in_kvcache is not None:
        n = n + blocks(extra_topk_length, extra_indices_in_kvcache)
    return int(n.sum()) * -(-heads // head_block(heads))


class MmaFloor:
    """The floor's launch for one call's shape: ``()`` runs it (one kernel launch, CUDA-graph capturable) and
    returns the per-program sums ``[C, 2]`` fp32; :meth:`check` verifies them."""

    def __init__(self, heads: int, blocks: int, *, num_sms: int, device, seed: int = 0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.N = head_block(heads)
        self.W = blocks
        self.C = max(1, min(num_sms, blocks))
        # positive entries: the sums cannot cancel, so a missing MMA shows
        self.a = (torch.rand(int(BLOCK), int(D), generator=g) * 0.5 + 0.25).to(torch.bfloat16).to(device)
        self.q = (torch.rand(self.N, int(D), generator=g) * 0.5 + 0.25).to(torch.bfloat16).to(device)
        self.p = torch.rand(self.N, int(BLOCK), generator=g).to(torch.bfloat16).to(device)
        self.sums = torch.empty(self.C, 2, dtype=torch.float32, device=device)
        self.plan = f"N={self.N},blocks={self.W},programs={self.C}"

    def __call__(self):
        mma_floor_kernel[(self.C,)](self.a, self.q, self.p, self.sums, self.W, N=self.N, num_warps=4)
        return self.sums

    def check(self, rtol: float = 1e-3) -> None:
        """Raise unless every program's sums are its block count times the two products (float64)."""
        a, q, p = self.a.double().cpu(), self.q.double().cpu(), self.p.double().cpu()
        per_block = torch.tensor([(a @ q.T).sum().item(), (a.T @ p.T).sum().item()], dtype=torch.float64)
        c = torch.arange(self.C, dtype=torch.int64)
        n = ((c + 1) * self.W // self.C - c * self.W // self.C).double()
        want = n[:, None] * per_block[None, :]
        got = self.sums.double().cpu()
        bad = (~((got - want).abs() <= rtol * want.abs())).nonzero()   # NaN fails too
        if len(bad):
            i, j = bad[0].tolist()
            raise RuntimeError(f"MMA floor program {i}: {'QK' if j == 0 else 'PV'} sum {got[i, j].item():.6g}, "
                               f"expected {want[i, j].item():.6g} ({int(n[i])} blocks)")
