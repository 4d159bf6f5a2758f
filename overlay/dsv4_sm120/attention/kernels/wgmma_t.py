"""Split kernel, Hopper warpgroup-MMA body with the candidates as M (``impl=wgmma_t``, bf16 QK only; Gluon, sm_90
only): ``BLOCK_H`` (16 or 32) heads per program as the MMA's N, so no row of the MMA is padding.

The 64-head body (``wgmma.py``) puts the heads on the warpgroup MMA's M, which is 64: with 16 heads three quarters
of its QK and PV work and of its Q reads are padding. Here both products are transposed: ``S^T = K Q^T`` (A: the
block's ``[64, 512]`` ring slot, B: Q ``[BLOCK_H, 512]``) and ``O^T += V^T P^T`` (A: the same slot read
transposed, ``[512, 64]``; B: ``P`` ``[BLOCK_H, 64]`` in bf16, written to shared memory per block). The softmax
runs over M (the candidates, spread over the warpgroup's four warps): one cross-warp max per block; the running
sums stay per thread and are added up once at the end.

Two producer partitions of four warps each gather and decode one 32-candidate half of every 64-candidate block
(each with the next block's half in flight while it decodes this one's: twice the bytes in flight of one
partition doing both halves), into a two-slot ring in the wgmma operand layout (``_store_half`` of ``wgmma.py``);
the slot is full when both have arrived. One consumer warpgroup (the launch's 4 warps) runs the products and the
softmax; it writes the row's output and lse itself where it holds all of the row's candidates (``FINAL``), or its
partial. One CTA of 12 warps per SM (the ring, Q and P take ~150 KB); the producers run at ``PRODUCER_REGS`` and
the consumers take the rest of ``maxnreg`` x 384. The Gluon bodies' spanning-split contract. sm_120 has no
warpgroup MMA: the launch refuses this body there, and Triton's CPU interpreter does not run Gluon.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

from .common import _segment_bounds, _store_softmax_state
from .wgmma import HALF, _block_count, _final_scale, _partition_barrier, _stage_q, _store_half
from .wspec import _block_idx, _gather_rows


@gluon.jit
def _produce_half(i, ring, flags, full, empty, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, t, start, chunk,
                  HAS_LEN: gl.constexpr, SLOTS: gl.constexpr, h: gl.constexpr):
    # half h of every 64-candidate block of [start, start + chunk) of one cache: block j's half goes to slot
    # (i + j) % SLOTS once the consumers have freed it, the next block's half gathered while this one is decoded;
    # returns the running block count
    idx_row = idx_ptr + t.to(gl.int64) * idx_st
    cend, end = _segment_bounds(len_ptr, K, t, start, chunk, HAS_LEN)
    PB64 = PB.to(gl.int64)
    PB2_64 = PB2.to(gl.int64)
    cur = _gather_rows(cache, _block_idx(idx_row, start + h * HALF, cend, HALF), start + h * HALF, end, P, PB64,
                       PB2_64, HALF)
    nid = _block_idx(idx_row, start + (2 + h) * HALF, cend, HALF)
    for n0 in range(start, end, 2 * HALF):
        nxt = _gather_rows(cache, nid, n0 + (2 + h) * HALF, end, P, PB64, PB2_64, HALF)
        nid = _block_idx(idx_row, n0 + (4 + h) * HALF, cend, HALF)
        b = i % SLOTS
        mbarrier.wait(empty.index(b), ((i // SLOTS) & 1) ^ 1)
        _store_half(ring.index(b), flags.index(2 * b + h), cur, h)
        # the stores (generic proxy) before the consumers' warpgroup MMAs read them (async proxy), from every warp
        # of this partition before its one arrival
        fence_async_shared()
        _partition_barrier()
        mbarrier.arrive(full.index(b))
        cur = nxt
        i += 1
    return i


@gluon.jit
def _produce_chunk(i, ring, flags, full, empty, t, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk,
                   cache2, idx2_ptr, idx2_st, len2_ptr, K2, P2, PB_2, PB2_2,
                   HAS_LEN: gl.constexpr, HAS_LEN2: gl.constexpr, HAS_2: gl.constexpr, SLOTS: gl.constexpr,
                   h: gl.constexpr):
    # half h of the chunk [start, start + chunk) of row t's main ++ extra: the main cache's part, then the extra's;
    # returns the running block count
    if start < K:
        i = _produce_half(i, ring, flags, full, empty, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, t, start,
                          chunk, HAS_LEN, SLOTS, h)
    if HAS_2:
        if start + chunk > K:
            lo2 = gl.maximum(start - K, 0)
            i = _produce_half(i, ring, flags, full, empty, cache2, idx2_ptr, idx2_st, len2_ptr, K2, P2, PB_2, PB2_2,
                              t, lo2, start + chunk - K - lo2, HAS_LEN2, SLOTS, h)
    return i


@gluon.jit
def _balanced_run(NB, W, C):
    # this program's run of a balanced launch (plan.plan_balanced): blocks [u0, u1) of the rows laid end to end,
    # rows r0 .. r1 - 1 (32-bit: the launch keeps (W + NB) x C below 2^31)
    c = gl.program_id(0)
    u0 = c * W // C
    u1 = (c + 1) * W // C
    return c, u0, u1, u0 // NB, (u1 - 1) // NB + 1


@gluon.jit
def _balanced_piece(c, u0, u1, r, NB, W, C):
    # row r's piece of the run [u0, u1): its candidates [start, start + chunk), its index s among the row's pieces
    # and whether it is the row's only one (plan.balanced_cut: the programs holding the row's first and last block)
    j0 = gl.maximum(u0 - r * NB, 0)
    j1 = gl.minimum(u1 - r * NB, NB)
    first = ((r * NB + 1) * C - 1) // W
    last = ((r + 1) * NB * C - 1) // W
    return j0 * (2 * HALF), (j1 - j0) * (2 * HALF), c - first, first == last


@gluon.jit
def _producer(ring, flags, full, empty, t, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk,
              cache2, idx2_ptr, idx2_st, len2_ptr, K2, P2, PB_2, PB2_2, NB, W, C, HG,
              HAS_LEN: gl.constexpr, HAS_LEN2: gl.constexpr, HAS_2: gl.constexpr, SLOTS: gl.constexpr,
              BALANCED: gl.constexpr, h: gl.constexpr):
    # half h of the program's chunk of main ++ extra, or (BALANCED) of every piece of its run, the ring's block
    # count carried from one piece to the next
    if BALANCED:
        c, u0, u1, r0, r1 = _balanced_run(NB, W, C)
        i = 0
        for r in range(r0, r1):
            start_r, chunk_r, _, _ = _balanced_piece(c, u0, u1, r, NB, W, C)
            i = _produce_chunk(i, ring, flags, full, empty, r // HG, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2,
                               start_r, chunk_r, cache2, idx2_ptr, idx2_st, len2_ptr, K2, P2, PB_2, PB2_2,
                               HAS_LEN, HAS_LEN2, HAS_2, SLOTS, h)
    else:
        i = 0
        _produce_chunk(i, ring, flags, full, empty, t, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk,
                       cache2, idx2_ptr, idx2_st, len2_ptr, K2, P2, PB_2, PB2_2, HAS_LEN, HAS_LEN2, HAS_2, SLOTS, h)


# one entry point per half: a warp_specialize partition's arguments are runtime values (Triton 3.6), and the half
# must be a constexpr
@gluon.jit
def _producer_lo(ring, flags, full, empty, t, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk,
                 cache2, idx2_ptr, idx2_st, len2_ptr, K2, P2, PB_2, PB2_2, NB, W, C, HG,
                 HAS_LEN: gl.constexpr, HAS_LEN2: gl.constexpr, HAS_2: gl.constexpr, SLOTS: gl.constexpr,
                 BALANCED: gl.constexpr):
    _producer(ring, flags, full, empty, t, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk,
              cache2, idx2_ptr, idx2_st, len2_ptr, K2, P2, PB_2, PB2_2, NB, W, C, HG, HAS_LEN, HAS_LEN2, HAS_2, SLOTS,
              BALANCED, 0)


@gluon.jit
def _producer_hi(ring, flags, full, empty, t, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk,
                 cache2, idx2_ptr, idx2_st, len2_ptr, K2, P2, PB_2, PB2_2, NB, W, C, HG,
                 HAS_LEN: gl.constexpr, HAS_LEN2: gl.constexpr, HAS_2: gl.constexpr, SLOTS: gl.constexpr,
                 BALANCED: gl.constexpr):
    _producer(ring, flags, full, empty, t, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk,
              cache2, idx2_ptr, idx2_st, len2_ptr, K2, P2, PB_2, PB2_2, NB, W, C, HG, HAS_LEN, HAS_LEN2, HAS_2, SLOTS,
              BALANCED, 1)


@gluon.jit
def _store_heads(stage, ot, dst_ptr, row0, nrows):
    # ot [512, BH] fp32 (the accumulator layout: dims x heads) -> dst_ptr[(row0 + h) * 512 + d] for h < nrows, in
    # dst's type; bf16 through shared memory ``stage`` (a free [BH, 512] bf16 tile), read back as 16-byte vectors
    # along the 512 dims (the accumulator layout holds 8 consecutive dims per 8 lanes: 16-byte pieces)
    BH: gl.constexpr = ot.shape[1]
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    r = gl.arange(0, BH, layout=gl.SliceLayout(1, QL))
    c = gl.arange(0, 512, layout=gl.SliceLayout(0, QL))
    ptr = dst_ptr + gl.expand_dims((row0 + r).to(gl.int64) * 512, 1) + gl.expand_dims(c, 0)
    if dst_ptr.dtype.element_ty == gl.bfloat16:
        stage.store(gl.permute(ot.to(gl.bfloat16), [1, 0]))
        _partition_barrier()
        gl.store(ptr, stage.load(QL), mask=gl.expand_dims(r < nrows, 1))
    else:
        gl.store(ptr, gl.convert_layout(gl.permute(ot, [1, 0]), QL).to(dst_ptr.dtype.element_ty),
                 mask=gl.expand_dims(r < nrows, 1))


@gluon.jit
def _consume_chunk(i, q_s, p_s, ring, flags, full, empty, q_ptr, stride_qt, stride_qh, t, s, g, len_ptr, K, start,
                   chunk, len2_ptr, K2, acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2, out_ptr, lse_ptr, sink_ptr, final,
                   HAS_LEN: gl.constexpr, HAS_LEN2: gl.constexpr, HAS_2: gl.constexpr, SLOTS: gl.constexpr,
                   HAS_SINK: gl.constexpr, BH: gl.constexpr):
    # the blocks the producers fill for the chunk [start, start + chunk) of row t, heads g*BH.., each: S^T = K Q^T,
    # the online softmax over the candidates (M), O^T = alpha O^T + V^T P^T, the slot back to the producers; then
    # the partial s, or (final: a constexpr, or a runtime flag in a balanced launch) the output. ``i``: the ring's
    # running block count, returned advanced
    AL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16])
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    FL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    t64 = t.to(gl.int64)
    _stage_q(q_s, q_ptr, t64 * stride_qt, stride_qh, g * BH, H, QL)
    nb = _block_count(t, len_ptr, K, start, chunk, len2_ptr, K2, HAS_LEN, HAS_LEN2, HAS_2)
    m_i = gl.full([BH], float("-inf"), gl.float32, gl.SliceLayout(0, AL))
    # the running sums per thread and candidate lane ([64, BH]), added up over the candidates at the end
    l_p = gl.zeros([2 * HALF, BH], gl.float32, AL)
    ot = gl.zeros([512, BH], gl.float32, AL)
    for _ in range(nb):
        b = i % SLOTS
        mbarrier.wait(full.index(b), (i // SLOTS) & 1)
        kv = ring.index(b)
        st = warpgroup_mma(kv, q_s.permute([1, 0]), gl.zeros([2 * HALF, BH], gl.float32, AL))
        vc = flags._reinterpret(gl.int32, [SLOTS, 2 * HALF], FL).index(b).load(gl.SliceLayout(1, AL)) != 0
        x = gl.where(gl.expand_dims(vc, 1), st * sm_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(x, axis=0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.expand_dims(gl.exp2(m_i - m_use), 0)
        p = gl.exp2(x - gl.expand_dims(m_use, 0))
        l_p = l_p * alpha + p
        m_i = m_new
        # P [BH, 64] bf16 as PV's B operand (K-major, read transposed); two buffers, so a warp writing the next
        # block's P never races the MMA of this one
        pb = p_s.index(i % 2)
        pb.store(gl.permute(p.to(gl.bfloat16), [1, 0]))
        fence_async_shared()
        _partition_barrier()
        ot = warpgroup_mma(kv.permute([1, 0]), pb.permute([1, 0]), ot * alpha)
        # the warpgroup is done with the slot before the one arrival
        _partition_barrier()
        mbarrier.arrive(empty.index(b))
        i += 1
    l_i = gl.sum(l_p, axis=0)
    hs = g * BH + gl.arange(0, BH, layout=gl.SliceLayout(0, AL))
    # Q's tile is free now (the MMAs that read it are done: the barrier after the last block) and stages the rows
    if final:
        # the program holds all of its row's candidates: the combine's arithmetic for one split, here
        inv = _final_scale(lse_ptr, sink_ptr, t64, H, hs, m_i, l_i, HAS_SINK)
        _store_heads(q_s, ot * gl.expand_dims(inv, 0), out_ptr, t64 * H + g * BH, H - g * BH)
    else:
        # the partial: 512 values per head (nope 0..447 then rope) and (m, l)
        _store_heads(q_s, ot, acc_ws, (t64 * S + s) * HP + g * BH, H - g * BH)
        _store_softmax_state(m_ws, l_ws, (t64 * S + s) * HP + hs, hs < H, m_i, l_i)
    return i


@gluon.jit
def _consumer(q_s, p_s, ring, flags, full, empty, q_ptr, stride_qt, stride_qh, t, s, g, len_ptr, K, start, chunk,
              len2_ptr, K2, acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2, out_ptr, lse_ptr, sink_ptr, NB, W, C, HG,
              HAS_LEN: gl.constexpr, HAS_LEN2: gl.constexpr, HAS_2: gl.constexpr, SLOTS: gl.constexpr,
              FINAL: gl.constexpr, HAS_SINK: gl.constexpr, BH: gl.constexpr, BALANCED: gl.constexpr):
    # the program's chunk, or (BALANCED) every piece of its run in order, as the producers fill them
    if BALANCED:
        c, u0, u1, r0, r1 = _balanced_run(NB, W, C)
        i = 0
        for r in range(r0, r1):
            start_r, chunk_r, s_r, final = _balanced_piece(c, u0, u1, r, NB, W, C)
            i = _consume_chunk(i, q_s, p_s, ring, flags, full, empty, q_ptr, stride_qt, stride_qh, r // HG, s_r,
                               r % HG, len_ptr, K, start_r, chunk_r, len2_ptr, K2, acc_ws, m_ws, l_ws, H, S, HP,
                               sm_scale_log2, out_ptr, lse_ptr, sink_ptr, final, HAS_LEN, HAS_LEN2, HAS_2, SLOTS,
                               HAS_SINK, BH)
            # every warp has read the stored rows back out of Q's tile before the next piece stages its Q there
            _partition_barrier()
    else:
        i = 0
        _consume_chunk(i, q_s, p_s, ring, flags, full, empty, q_ptr, stride_qt, stride_qh, t, s, g, len_ptr, K, start,
                       chunk, len2_ptr, K2, acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2, out_ptr, lse_ptr, sink_ptr,
                       FINAL, HAS_LEN, HAS_LEN2, HAS_2, SLOTS, HAS_SINK, BH)


@gluon.jit
def split_kernel_wgmma_t(
    q_ptr, stride_qt, stride_qh,
    main_ptr, main_idx_ptr, main_idx_st, main_len_ptr, main_K, main_P, main_PB, main_PB2,
    extra_ptr, extra_idx_ptr, extra_idx_st, extra_len_ptr, extra_K, extra_P, extra_PB, extra_PB2,
    chunk, acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
    HAS_MAIN_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_EXTRA_LEN: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, PRODUCER_REGS: gl.constexpr, SLOTS: gl.constexpr = 2,
    out_ptr=None, lse_ptr=None, sink_ptr=None, FINAL: gl.constexpr = False, HAS_SINK: gl.constexpr = False,
    NB=1, W=1, C=1, BALANCED: gl.constexpr = False,
):
    """The spanning-split contract (bf16 QK, ``BLOCK_H`` 16 or 32, ``BLOCK_N`` 64),
    with the candidates-as-M warpgroup-MMA body: 4 consumer warps (the launch's ``num_warps``) and two partitions
    of 4 producer warps. ``FINAL`` (one split per row, ``S`` = 1): the program writes the row's ``out``
    [T, 1, H, 512] bf16 and ``lse`` [T, H, 1] itself, with the sink ``sink_ptr`` (``HAS_SINK``), and the combine is
    not launched.

    ``BALANCED`` (grid ``(C,)``, ``plan.plan_balanced``): the ``T x HG`` grid rows of ``NB`` 64-candidate blocks
    laid end to end, ``W`` blocks, cut into ``C`` runs; program ``c`` walks its run piece by piece (a piece = the
    run's blocks of one grid row), the producers running ahead into the next piece. A piece that is its row's
    only one writes ``out`` / ``lse`` (``out_ptr`` etc. given), the others their partial ``s`` (the piece's index
    in its row, ``S`` = the most pieces of a row) for the combine."""
    gl.static_assert(BLOCK_H == 16 or BLOCK_H == 32, "the candidates-as-M body takes 16 or 32 heads per program")
    gl.static_assert(BLOCK_N == 2 * HALF, "the candidates-as-M body consumes 64-candidate blocks")
    t = gl.program_id(0)
    s = gl.program_id(1)
    g = gl.program_id(2)
    HG = HP // BLOCK_H
    main = main_ptr.to(gl.pointer_type(gl.uint8))
    extra = extra_ptr.to(gl.pointer_type(gl.uint8))
    start = s * chunk
    NV: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    ring = gl.allocate_shared_memory(gl.bfloat16, [SLOTS, 2 * HALF, 512], NV)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 512], NV)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_H, 2 * HALF], NV)
    # each slot's candidate validity, by half (producers) and as one row per slot (consumers: a reinterpretation)
    flags = gl.allocate_shared_memory(gl.int32, [2 * SLOTS, HALF], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    full = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(SLOTS):
        mbarrier.init(full.index(j), count=2)   # one arrival per producer partition (half)
        mbarrier.init(empty.index(j), count=1)
    prod = (ring, flags, full, empty, t, main, main_idx_ptr, main_idx_st, main_len_ptr, main_K, main_P, main_PB,
            main_PB2, start, chunk, extra, extra_idx_ptr, extra_idx_st, extra_len_ptr, extra_K, extra_P, extra_PB,
            extra_PB2, NB, W, C, HG, HAS_MAIN_LEN, HAS_EXTRA_LEN, HAS_EXTRA, SLOTS, BALANCED)
    gl.warp_specialize([
        (_consumer, (q_s, p_s, ring, flags, full, empty, q_ptr, stride_qt, stride_qh, t, s, g, main_len_ptr, main_K,
                     start, chunk, extra_len_ptr, extra_K, acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
                     out_ptr, lse_ptr, sink_ptr, NB, W, C, HG, HAS_MAIN_LEN, HAS_EXTRA_LEN, HAS_EXTRA, SLOTS, FINAL,
                     HAS_SINK, BLOCK_H, BALANCED)),
        (_producer_lo, prod),
        (_producer_hi, prod),
    ], [4, 4], [PRODUCER_REGS, PRODUCER_REGS])
