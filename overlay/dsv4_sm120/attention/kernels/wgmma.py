"""Split kernel, Hopper warpgroup-MMA body (``impl=wgmma``, bf16 QK only; Gluon, sm_90 only): 64 heads per
program, so a candidate block is gathered and decoded once for up to 64 heads instead of once per 16.

Four producer warps gather a 64-candidate block in two 32-candidate halves (the next half's loads in flight while
the current one is decoded, as in ``wspec``), decode e4m3 with the tile scale folded in and store bf16 into a
two-slot ring of ``[64, 512]`` tiles in the wgmma operand layout (128-byte swizzle). Two consumer warpgroups (the
launch's 8 warps) run ``S = Q K^T`` with Q ``[64, 512]`` in shared memory (each warpgroup 32 of the 64 candidates),
the online softmax, and ``O += P V`` (each warpgroup 256 of the 512 output columns, P from registers), the block's
slot going back to the producers after PV. One CTA of 12 warps per SM: Q and the ring take 192 KB; the producers
run at ``PRODUCER_REGS`` and the consumers take the rest of the launch's ``maxnreg`` x 384 registers. A program
that holds all of its row's candidates (one split, ``FINAL``) writes the row's output and lse itself; the output
or partial goes through Q's tile, free by then, for whole-sector stores (``STAGE_OUT``).

Why: the mma.sync bodies run 16 heads per program, so 32 and 64 heads gather, decode and stage every block two
and four times, and their consumers re-read Q from shared memory per warp; a warpgroup MMA reads each operand
tile once per warpgroup. The Gluon bodies' spanning-split contract (``kernels/__init__``).
sm_120 has no warpgroup MMA: the launch refuses this body there, and Triton's CPU interpreter does not run Gluon.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

from .common import _online_softmax, _segment_bounds, _store_softmax_state
from .wspec import _block_idx, _dec, _gather_rows

HALF = gl.constexpr(32)  # candidates per producer gather
# a barrier over the calling partition's warps: gl.thread_barrier in Triton 3.6, gl.barrier from 3.7 on
_partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _bf16_tile(words):
    # [HALF, 32] int32 words (bf16 pairs, low half first) -> [HALF, 64] bf16
    lo = (words & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
    hi = (words >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return gl.join(lo, hi).reshape([words.shape[0], 64])


@gluon.jit
def _cat(a, b):
    # [R, C] and [R, C] -> [R, 2C], side by side
    return gl.join(a, gl.convert_layout(b, a.type.layout)).permute([0, 2, 1]).reshape([a.shape[0], 2 * a.shape[1]])


@gluon.jit
def _store_half(slot, flags, raw, h: gl.constexpr):
    # decode a raw half block into rows [HALF * h, HALF * (h + 1)) of a ring slot [64, 512] in one store (Triton's
    # barrier pass fences consecutive stores into one buffer with a barrier each), and its candidates' validity
    # into ``flags`` [HALF] (the slot's half h)
    k0, k1, k2, k3, k4, k5, k6, s_lo, s_hi, rope, valid = raw
    lo = _cat(_cat(_bf16_tile(_dec(k0, s_lo, 0)), _bf16_tile(_dec(k1, s_lo, 8))),
              _cat(_bf16_tile(_dec(k2, s_lo, 16)), _bf16_tile(_dec(k3, s_lo, 24))))
    hi = _cat(_cat(_bf16_tile(_dec(k4, s_hi, 0)), _bf16_tile(_dec(k5, s_hi, 8))),
              _cat(_bf16_tile(_dec(k6, s_hi, 16)), _bf16_tile(rope)))
    slot.slice(HALF * h, HALF, dim=0).store(_cat(lo, hi))
    flags.store(valid.to(gl.int32))


@gluon.jit
def _produce(i, ring, flags, full, empty, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, t, start, chunk,
             HAS_LEN: gl.constexpr, SLOTS: gl.constexpr):
    # the producer's pass over [start, start + chunk) of one cache: 64-candidate block j goes to slot (i + j) % SLOTS
    # once the consumers have freed it; returns the running block count
    idx_row = idx_ptr + t.to(gl.int64) * idx_st
    cend, end = _segment_bounds(len_ptr, K, t, start, chunk, HAS_LEN)
    PB64 = PB.to(gl.int64)
    PB2_64 = PB2.to(gl.int64)
    # slot ids are loaded a block ahead of the gathers that use them (one memory latency off each gather)
    first = _gather_rows(cache, _block_idx(idx_row, start, cend, HALF), start, end, P, PB64, PB2_64, HALF)
    ib = _block_idx(idx_row, start + HALF, cend, HALF)
    ia = _block_idx(idx_row, start + 2 * HALF, cend, HALF)
    for n0 in range(start, end, 2 * HALF):
        second = _gather_rows(cache, ib, n0 + HALF, end, P, PB64, PB2_64, HALF)
        ib = _block_idx(idx_row, n0 + 3 * HALF, cend, HALF)
        ia_next = _block_idx(idx_row, n0 + 4 * HALF, cend, HALF)
        b = i % SLOTS
        mbarrier.wait(empty.index(b), ((i // SLOTS) & 1) ^ 1)
        _store_half(ring.index(b), flags.index(2 * b), first, 0)
        first = _gather_rows(cache, ia, n0 + 2 * HALF, end, P, PB64, PB2_64, HALF)
        ia = ia_next
        _store_half(ring.index(b), flags.index(2 * b + 1), second, 1)
        # the stores (generic proxy) before the consumers' warpgroup MMAs read them (async proxy), from every
        # producer warp before the one arrival
        fence_async_shared()
        _partition_barrier()
        mbarrier.arrive(full.index(b))
        i += 1
    return i


@gluon.jit
def _producer(ring, flags, full, empty, t, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk,
              cache2, idx2_ptr, idx2_st, len2_ptr, K2, P2, PB_2, PB2_2,
              HAS_LEN: gl.constexpr, HAS_LEN2: gl.constexpr, HAS_2: gl.constexpr, SLOTS: gl.constexpr):
    # the program's chunk [start, start + chunk) of main ++ extra: the main cache's part, then the extra cache's
    i = 0
    if start < K:
        i = _produce(i, ring, flags, full, empty, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, t, start, chunk,
                     HAS_LEN, SLOTS)
    if HAS_2:
        if start + chunk > K:
            lo2 = gl.maximum(start - K, 0)
            i = _produce(i, ring, flags, full, empty, cache2, idx2_ptr, idx2_st, len2_ptr, K2, P2, PB_2, PB2_2, t,
                         lo2, start + chunk - K - lo2, HAS_LEN2, SLOTS)


@gluon.jit
def _stage_q(q_s, q_ptr, row_off, stride_qh, h0, H, QL: gl.constexpr):
    # Q of the heads h0 .. h0 + rows of q_s into shared memory q_s ([rows, 512] bf16), once (heads >= H: zeros); the
    # consumer partition's warps, then a fence for the MMAs' (async proxy) reads
    hq = h0 + gl.arange(0, q_s.shape[0], layout=gl.SliceLayout(1, QL))
    dq = gl.arange(0, 512, layout=gl.SliceLayout(0, QL))
    q = gl.load(q_ptr + row_off + gl.expand_dims(hq.to(gl.int64) * stride_qh, 1) + gl.expand_dims(dq, 0),
                mask=gl.expand_dims(hq < H, 1), other=0.0)
    q_s.store(q)
    fence_async_shared()
    _partition_barrier()


@gluon.jit
def _block_count(t, len_ptr, K, start, chunk, len2_ptr, K2, HAS_LEN: gl.constexpr, HAS_LEN2: gl.constexpr,
                 HAS_2: gl.constexpr):
    # the 64-candidate blocks the producers fill for the program's chunk [start, start + chunk) of main ++ extra
    nb = 0
    if start < K:
        _, end = _segment_bounds(len_ptr, K, t, start, chunk, HAS_LEN)
        nb = gl.cdiv(gl.maximum(end - start, 0), 2 * HALF)
    if HAS_2:
        if start + chunk > K:
            lo2 = gl.maximum(start - K, 0)
            _, end2 = _segment_bounds(len2_ptr, K2, t, lo2, start + chunk - K - lo2, HAS_LEN2)
            nb += gl.cdiv(gl.maximum(end2 - lo2, 0), 2 * HALF)
    return nb


@gluon.jit
def _stage_rows(stage, x, dst_ptr, row0, nrows, STAGE: gl.constexpr):
    # x [64, 512] (the accumulator layout) -> dst_ptr[(row0 + r) * 512 + c] for r < nrows, in dst's type. STAGE:
    # through shared memory ``stage`` (a free [64, 512] bf16 tile; bf16 only), read back as 16-byte vectors along
    # the rows, so a warp's store covers whole 32-byte sectors (the accumulator layout holds two adjacent columns
    # per thread: 4-byte stores, half-sector pieces)
    if STAGE:
        QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
        stage.store(x.to(gl.bfloat16))
        _partition_barrier()
        r = gl.arange(0, 64, layout=gl.SliceLayout(1, QL))
        c = gl.arange(0, 512, layout=gl.SliceLayout(0, QL))
        gl.store(dst_ptr + gl.expand_dims((row0 + r).to(gl.int64) * 512, 1) + gl.expand_dims(c, 0), stage.load(QL),
                 mask=gl.expand_dims(r < nrows, 1))
    else:
        OL: gl.constexpr = x.type.layout
        r = gl.arange(0, 64, layout=gl.SliceLayout(1, OL))
        c = gl.arange(0, 512, layout=gl.SliceLayout(0, OL))
        gl.store(dst_ptr + gl.expand_dims((row0 + r).to(gl.int64) * 512, 1) + gl.expand_dims(c, 0),
                 x.to(dst_ptr.dtype.element_ty), mask=gl.expand_dims(r < nrows, 1))


@gluon.jit
def _final_scale(lse_ptr, sink_ptr, t64, H, hs, m_i, l_i, HAS_SINK: gl.constexpr):
    # one split's share of the combine for heads hs: stores lse[t, h] = ln(2^m l) (without the sink) and returns the
    # factor 1 / (l + 2^(sink * log2(e) - m)) for the output, as combine_kernel computes them: 0 and -inf where the
    # row has no valid candidate
    m_ref = gl.where(m_i == float("-inf"), 0.0, m_i)
    lonely = l_i == 0.0
    denom = l_i
    if HAS_SINK:
        denom += gl.exp2(gl.load(sink_ptr + hs, mask=hs < H, other=0.0) * 1.4426950408889634 - m_ref)
    lse = gl.where(lonely, float("-inf"), (m_ref + gl.log2(gl.where(lonely, 1.0, l_i))) * 0.6931471805599453)
    gl.store(lse_ptr + t64 * H + hs, lse, mask=hs < H)
    return gl.where(lonely, 0.0, 1.0 / gl.where(lonely, 1.0, denom))


@gluon.jit
def _store_output(stage, out_ptr, lse_ptr, sink_ptr, t64, H, g, hs, o, m_i, l_i, HAS_SINK: gl.constexpr,
                  STAGE_OUT: gl.constexpr):
    # out[t, h] = O / (l + 2^(sink * log2(e) - m)) in bf16 and lse[t, h] (_final_scale)
    inv = _final_scale(lse_ptr, sink_ptr, t64, H, hs, m_i, l_i, HAS_SINK)
    o = o * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, o.type.layout)), 1)
    _stage_rows(stage, o, out_ptr, t64 * H + g * 64, H - g * 64, STAGE_OUT)


@gluon.jit
def _consumer(q_s, ring, flags, full, empty, q_ptr, stride_qt, stride_qh, t, s, g, len_ptr, K, start, chunk,
              len2_ptr, K2, acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2, out_ptr, lse_ptr, sink_ptr,
              HAS_LEN: gl.constexpr, HAS_LEN2: gl.constexpr, HAS_2: gl.constexpr, SLOTS: gl.constexpr,
              FINAL: gl.constexpr, HAS_SINK: gl.constexpr, STAGE_OUT: gl.constexpr):
    # the blocks the producers fill for this program (as many as _producer's passes make), each: S = Q K^T, online
    # softmax, O = alpha O + P V, the slot back to the producers; then the partial to the workspace, or (FINAL) the
    # row's output and lse
    SL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    OL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    PA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=OL, k_width=2)
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
    FL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    t64 = t.to(gl.int64)
    _stage_q(q_s, q_ptr, t64 * stride_qt, stride_qh, g * 64, H, QL)
    nb = _block_count(t, len_ptr, K, start, chunk, len2_ptr, K2, HAS_LEN, HAS_LEN2, HAS_2)
    m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, SL))
    l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, SL))
    o = gl.zeros([64, 512], gl.float32, OL)
    for i in range(nb):
        b = i % SLOTS
        mbarrier.wait(full.index(b), (i // SLOTS) & 1)
        kv = ring.index(b)
        sc = warpgroup_mma(q_s, kv.permute([1, 0]), gl.zeros([64, 2 * HALF], gl.float32, SL))
        vc = flags._reinterpret(gl.int32, [SLOTS, 2 * HALF], FL).index(b).load(gl.SliceLayout(0, SL)) != 0
        p, alpha, m_i, l_i = _online_softmax(sc, vc, m_i, l_i, sm_scale_log2)
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, OL)), 1)
        o = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), PA), kv, o)
        # both warpgroups are done with the slot before the one arrival
        _partition_barrier()
        mbarrier.arrive(empty.index(b))
    hs = g * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, SL))
    # Q's tile is free now (every MMA that read it is done: the barrier after the last block) and stages the rows
    if FINAL:
        # the program holds all of its row's candidates: the combine's arithmetic for one split, here
        _store_output(q_s, out_ptr, lse_ptr, sink_ptr, t64, H, g, hs, o, m_i, l_i, HAS_SINK, STAGE_OUT)
    else:
        # the partial: 512 values per head (nope 0..447 then rope) and (m, l)
        _stage_rows(q_s, o, acc_ws, (t64 * S + s) * HP + g * 64, H - g * 64,
                    STAGE_OUT and acc_ws.dtype.element_ty == gl.bfloat16)
        _store_softmax_state(m_ws, l_ws, (t64 * S + s) * HP + hs, hs < H, m_i, l_i)


@gluon.jit
def split_kernel_wgmma(
    q_ptr, stride_qt, stride_qh,
    main_ptr, main_idx_ptr, main_idx_st, main_len_ptr, main_K, main_P, main_PB, main_PB2,
    extra_ptr, extra_idx_ptr, extra_idx_st, extra_len_ptr, extra_K, extra_P, extra_PB, extra_PB2,
    chunk, acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
    HAS_MAIN_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_EXTRA_LEN: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, PRODUCER_REGS: gl.constexpr, SLOTS: gl.constexpr = 2,
    out_ptr=None, lse_ptr=None, sink_ptr=None, FINAL: gl.constexpr = False, HAS_SINK: gl.constexpr = False,
    STAGE_OUT: gl.constexpr = True,
):
    """The spanning-split contract (bf16 QK, ``BLOCK_H`` 64, ``BLOCK_N`` 64), with the
    warpgroup-MMA body: 8 consumer warps (the launch's ``num_warps``) and 4 producer warps. ``FINAL`` (one split
    per row, ``S`` = 1): the program writes the row's ``out`` [T, 1, H, 512] bf16 and ``lse`` [T, H, 1] itself, with
    the sink ``sink_ptr`` (``HAS_SINK``), and the combine is not launched. ``STAGE_OUT``: the output (and a bf16
    partial) leave through Q's shared-memory tile as 16-byte row vectors instead of the accumulator layout's 4-byte
    pieces (the launch sets it where most of the 64 head rows are real: H > 16)."""
    gl.static_assert(BLOCK_H == 64, "the warpgroup-MMA body takes 64 heads per program")
    gl.static_assert(BLOCK_N == 2 * HALF, "the warpgroup-MMA body consumes 64-candidate blocks")
    t = gl.program_id(0)
    s = gl.program_id(1)
    g = gl.program_id(2)
    main = main_ptr.to(gl.pointer_type(gl.uint8))
    extra = extra_ptr.to(gl.pointer_type(gl.uint8))
    start = s * chunk
    NV: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    ring = gl.allocate_shared_memory(gl.bfloat16, [SLOTS, 2 * HALF, 512], NV)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [64, 512], NV)
    # each slot's candidate validity, by half (producer) and as one row per slot (consumers: a reinterpretation)
    flags = gl.allocate_shared_memory(gl.int32, [2 * SLOTS, HALF], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    full = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(SLOTS):
        mbarrier.init(full.index(j), count=1)
        mbarrier.init(empty.index(j), count=1)
    gl.warp_specialize([
        (_consumer, (q_s, ring, flags, full, empty, q_ptr, stride_qt, stride_qh, t, s, g, main_len_ptr, main_K,
                     start, chunk, extra_len_ptr, extra_K, acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
                     out_ptr, lse_ptr, sink_ptr, HAS_MAIN_LEN, HAS_EXTRA_LEN, HAS_EXTRA, SLOTS, FINAL, HAS_SINK,
                     STAGE_OUT)),
        (_producer, (ring, flags, full, empty, t, main, main_idx_ptr, main_idx_st, main_len_ptr, main_K, main_P, main_PB,
                     main_PB2, start, chunk,
                     extra, extra_idx_ptr, extra_idx_st, extra_len_ptr, extra_K, extra_P, extra_PB, extra_PB2,
                     HAS_MAIN_LEN, HAS_EXTRA_LEN, HAS_EXTRA, SLOTS)),
    ], [4], [PRODUCER_REGS])
