"""Split kernel, dim-split body (``impl=dimsplit``, bf16 QK only; Gluon, GPU only): the 512 head dims are split
over the four warps, so each warp keeps its quarter of Q in registers for the whole program and reads only its
quarter of each decoded K block from shared memory, for QK and again as V for PV.

Why: with 16 heads the MMA's M is a single 16-row tile, so a body whose warps split the candidates (``reg``)
makes every warp read all of Q from shared memory again for each block (as many shared-memory reads as K's own),
and the softmax needs cross-warp maxima and sums. Here warp ``w`` owns dims ``128w .. 128w + 127`` (nope 0-383
for warps 0-2; nope 384-447 and rope for warp 3):

* QK: a batched MMA ``[4, 16, 128] x [4, 128, BLOCK_N]`` (batch = warp): each warp's partial scores over its
  dims; the four partials meet in shared memory and every warp sums all four (one barrier), so each warp holds
  the block's full ``[16, BLOCK_N]`` scores and runs the softmax itself (no cross-warp reduction);
* PV: ``[4, 16, BLOCK_N] x [4, BLOCK_N, 128]``: P (the same in every warp) times the warp's V quarter into its
  ``[16, 128]`` accumulator, in four 32-dim chunks;
* decode: the whole CTA gathers a block's seven e4m3 tiles, UE8M0 scales and rope into registers one block ahead,
  decodes them (``E4M3_BF16_ASM``, scale folded in, exact) and stores the bf16 block to shared memory.

Three barriers per block (block ready, partial scores ready, block consumed). Written in Gluon (Triton's explicit
layout dialect): Triton's own layout choice cannot keep a per-warp slice of Q in registers. Triton's CPU
interpreter does not run Gluon: this body is a GPU launch only (``config`` refuses it under the interpreter)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .common import E4M3_BF16_ASM

# Triton 3.6 spells the CTA barrier thread_barrier, later versions barrier
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

CH = gl.constexpr(32)  # dims per MMA chunk (each warp's 128 dims in four; operands loaded chunk by chunk)


@gluon.jit
def _token_rows(idx, inb, P, PB64, PB2_64):
    # page addressing of a candidate block (as common._token_rows): valid, nope row byte offset, scale byte
    # offset, rope bf16 offset
    valid = inb & (idx >= 0)
    idx32 = gl.maximum(idx, 0)
    page32 = idx32 // P
    off = (idx32 - page32 * P).to(gl.int64)
    page = page32.to(gl.int64)
    return valid, page * PB64 + off * 576, page * PB64 + P * 576 + off * 8, page * PB2_64 + off * 288 + 224


# one 32-bit word of four e4m3 bytes and its tile's UE8M0 scale as a bf16 pair -> two bf16 pairs (the four values,
# scaled, exact): E4M3_BF16_ASM's bit moves, then one more bf16x2 multiply by the scale
E4M3X4_SCALED_ASM = gl.constexpr("""
{
.reg .b32 z, x, a, b, s, nz, v;
mov.b32 z, 0;
mov.b32 s, 0x7B807B80;
mov.b32 nz, 0x80008000;
prmt.b32 x, $2, z, 0x1404;
shr.b32 a, x, 4;
and.b32 a, a, 0x07F007F0;
and.b32 b, x, 0x80008000;
or.b32 a, a, b;
fma.rn.bf16x2 v, a, s, nz;
mul.rn.bf16x2 $0, v, $3;
prmt.b32 x, $2, z, 0x3424;
shr.b32 a, x, 4;
and.b32 a, a, 0x07F007F0;
and.b32 b, x, 0x80008000;
or.b32 a, a, b;
fma.rn.bf16x2 v, a, s, nz;
mul.rn.bf16x2 $1, v, $3;
}
""")


@gluon.jit
def _gather(cache, row, valid, sb, ro, lanes):
    # the raw block as 32-bit words: seven [BLOCK_N, 16] e4m3 tiles, their [BLOCK_N] UE8M0 bytes, the
    # [BLOCK_N, 32] rope (bf16 pairs)
    words = cache.to(gl.pointer_type(gl.int32))
    r2 = gl.expand_dims(row // 4, 1) + gl.expand_dims(lanes, 0)
    v2 = gl.expand_dims(valid, 1)
    k0 = gl.load(words + r2, mask=v2, other=0)
    k1 = gl.load(words + r2 + 16, mask=v2, other=0)
    k2 = gl.load(words + r2 + 32, mask=v2, other=0)
    k3 = gl.load(words + r2 + 48, mask=v2, other=0)
    k4 = gl.load(words + r2 + 64, mask=v2, other=0)
    k5 = gl.load(words + r2 + 80, mask=v2, other=0)
    k6 = gl.load(words + r2 + 96, mask=v2, other=0)
    c0 = gl.load(cache + sb, mask=valid, other=127)
    c1 = gl.load(cache + sb + 1, mask=valid, other=127)
    c2 = gl.load(cache + sb + 2, mask=valid, other=127)
    c3 = gl.load(cache + sb + 3, mask=valid, other=127)
    c4 = gl.load(cache + sb + 4, mask=valid, other=127)
    c5 = gl.load(cache + sb + 5, mask=valid, other=127)
    c6 = gl.load(cache + sb + 6, mask=valid, other=127)
    # rope: [BLOCK_N, 32] words (8 per thread), in the layout of a decoded tile
    BR: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    lanes32 = gl.arange(0, 32, layout=gl.SliceLayout(0, BR))
    r0 = gl.expand_dims(gl.convert_layout(ro // 2, gl.SliceLayout(1, BR)), 1) + gl.expand_dims(lanes32, 0)
    rope = gl.load(words + r0, mask=gl.expand_dims(gl.convert_layout(valid, gl.SliceLayout(1, BR)), 1), other=0)
    return k0, k1, k2, k3, k4, k5, k6, c0, c1, c2, c3, c4, c5, c6, rope


@gluon.jit
def _cat(a, b):
    # [R, C] and [R, C] -> [R, 2C], side by side
    return gl.join(a, gl.convert_layout(b, a.type.layout)).permute([0, 2, 1]).reshape([a.shape[0], 2 * a.shape[1]])


@gluon.jit
def _dec(k32, ksc):
    # a [BLOCK_N, 16]-word e4m3 tile with its [BLOCK_N] UE8M0 scales -> its 64 bf16 values as [BLOCK_N, 32] words
    # (word 2j: bytes 4j, 4j + 1; word 2j + 1: bytes 4j + 2, 4j + 3)
    sc = ksc.to(gl.int32)
    sc2 = gl.expand_dims((sc << 7) | (sc << 23), 1)  # the scale 2^(byte - 127) as a bf16 pair
    lo, hi = gl.inline_asm_elementwise(E4M3X4_SCALED_ASM, "=r,=r,r,r", [k32, sc2], dtype=(gl.int32, gl.int32),
                                       is_pure=True, pack=1)
    return gl.join(lo, hi).reshape([k32.shape[0], 32])


@gluon.jit
def _stage(kvw3, raw):
    # decode a raw block into the shared buffer's [4, BLOCK_N, 64]-word view in one store (separate stores into
    # one buffer would each be fenced by a barrier): quarter w = nope tiles 2w, 2w + 1; quarter 3 = tile 6, rope
    k0, k1, k2, k3, k4, k5, k6, c0, c1, c2, c3, c4, c5, c6, rope = raw
    q0 = _cat(_dec(k0, c0), _dec(k1, c1))
    q1 = _cat(_dec(k2, c2), _dec(k3, c3))
    q2 = _cat(_dec(k4, c4), _dec(k5, c5))
    q3 = _cat(_dec(k6, c6), rope)
    blk = gl.join(gl.join(q0, q1), gl.join(q2, q3)).permute([3, 2, 0, 1]).reshape([4, k0.shape[0], 64])
    kvw3.store(blk)


@gluon.jit
def _segment(q0, q1, q2, q3, m_i, l_i, o0, o1, o2, o3, kv, kvw3, sbuf, sb3,
             t, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk, sm_scale_log2,
             HAS_LEN: gl.constexpr, BLOCK_N: gl.constexpr):
    # the candidate loop over [start, start + chunk) of one cache, carrying the softmax state and the four
    # [4, 16, 32] accumulator chunks in and out
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8])
    opA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    opB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    LS: gl.constexpr = gl.SliceLayout(0, mma)                       # [16, BLOCK_N], the same in every warp
    LC: gl.constexpr = gl.SliceLayout(0, LS)                        # [BLOCK_N] candidates of LS
    gl.static_assert(BLOCK_N == 32, "the dim-split body gathers 32-candidate blocks")
    BL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])  # [32, 16] words: 16 bytes per thread
    LN: gl.constexpr = gl.SliceLayout(1, BL)
    LL: gl.constexpr = gl.SliceLayout(0, BL)
    lanes = gl.arange(0, 16, layout=LL)
    offs_n = gl.arange(0, BLOCK_N, layout=LN)
    offs_c = gl.arange(0, BLOCK_N, layout=LC)
    idx_row = idx_ptr + t.to(gl.int64) * idx_st
    cend = gl.minimum(start + chunk, K)
    end = cend
    if HAS_LEN:
        end = gl.minimum(end, gl.load(len_ptr + t))
    PB64 = PB.to(gl.int64)
    PB2_64 = PB2.to(gl.int64)
    # block 0 staged before the loop; block 1's tiles in registers
    cand = start + offs_n
    idx = gl.load(idx_row + cand, mask=cand < cend, other=-1)
    valid, row, sb, ro = _token_rows(idx, cand < end, P, PB64, PB2_64)
    _barrier()  # the previous segment's last block is consumed
    _stage(kvw3, _gather(cache, row, valid, sb, ro, lanes))
    cand = start + BLOCK_N + offs_n
    idx = gl.load(idx_row + cand, mask=cand < cend, other=-1)
    valid, row, sb, ro = _token_rows(idx, cand < end, P, PB64, PB2_64)
    nxt = _gather(cache, row, valid, sb, ro, lanes)
    _barrier()
    for n0 in range(start, end, BLOCK_N):
        # the scores' validity, in the softmax's layout
        cc = n0 + offs_c
        ic = gl.load(idx_row + cc, mask=cc < cend, other=-1)
        vc = (cc < end) & (ic >= 0)
        # QK: each warp over its 128 dims, in four 32-dim chunks
        kt = kv.permute([0, 2, 1])
        s = gl.zeros([4, 16, BLOCK_N], gl.float32, mma)
        s = mma_v2(q0, kt.slice(0, CH, dim=1).load(opB), s)
        s = mma_v2(q1, kt.slice(CH, CH, dim=1).load(opB), s)
        s = mma_v2(q2, kt.slice(2 * CH, CH, dim=1).load(opB), s)
        s = mma_v2(q3, kt.slice(3 * CH, CH, dim=1).load(opB), s)
        sb3.store(s)
        _barrier()
        # every warp reads all four partials (in the layout that holds them whole in each warp)
        qk = (sbuf.slice(0, 16, dim=0).load(LS) + sbuf.slice(16, 16, dim=0).load(LS)) + \
            (sbuf.slice(32, 16, dim=0).load(LS) + sbuf.slice(48, 16, dim=0).load(LS))
        # online softmax, base 2 (as common._online_softmax), every warp the same
        qk = qk * sm_scale_log2
        qk = gl.where(gl.expand_dims(vc, 0), qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(qk - gl.expand_dims(m_use, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        a3 = gl.expand_dims(gl.expand_dims(alpha, 1), 0)
        p3 = gl.convert_layout(gl.expand_dims(p.to(gl.bfloat16), 0).broadcast_to([4, 16, BLOCK_N]), opA)
        # PV: the warp's V quarter, four 32-dim chunks
        o0 = mma_v2(p3, kv.slice(0, CH, dim=2).load(opB), o0 * a3)
        o1 = mma_v2(p3, kv.slice(CH, CH, dim=2).load(opB), o1 * a3)
        o2 = mma_v2(p3, kv.slice(2 * CH, CH, dim=2).load(opB), o2 * a3)
        o3 = mma_v2(p3, kv.slice(3 * CH, CH, dim=2).load(opB), o3 * a3)
        # next block: its gathers landed during this one; the one after is issued now
        cand = n0 + 2 * BLOCK_N + offs_n
        idx = gl.load(idx_row + cand, mask=cand < cend, other=-1)
        valid, row, sb, ro = _token_rows(idx, cand < end, P, PB64, PB2_64)
        raw = nxt
        nxt = _gather(cache, row, valid, sb, ro, lanes)
        _barrier()  # every warp is done with this block's K and scores
        _stage(kvw3, raw)
        _barrier()
    return m_i, l_i, o0, o1, o2, o3


@gluon.jit
def _q_chunk(q_ptr, t64, stride_qt, stride_qh, g, H, c: gl.constexpr, BLOCK_H: gl.constexpr):
    # Q chunk c as the QK MMA's A operand [4, 16, 32]: warp w's dims 128w + 32c .. + 31 of heads g*16 ..
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8])
    opA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, opA)))
    h = g * BLOCK_H + gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, opA)))
    d = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, opA)))
    w3 = gl.expand_dims(gl.expand_dims(w, 1), 2)
    h3 = gl.expand_dims(gl.expand_dims(h, 0), 2)
    d3 = gl.expand_dims(gl.expand_dims(d, 0), 1)
    offs = t64 * stride_qt + h3.to(gl.int64) * stride_qh + w3 * 128 + c * 32 + d3
    return gl.load(q_ptr + offs, mask=(h3 < H) & (w3 >= 0) & (d3 >= 0), other=0.0)


@gluon.jit
def _dimsplit_body(q_ptr, stride_qt, stride_qh, t, s, g,
                   cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk,
                   acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
                   HAS_LEN: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                   SPAN: gl.constexpr = False, cache2=None, idx2_ptr=None, idx2_st=0, len2_ptr=None, K2=0, P2=1,
                   PB_2=0, PB2_2=0, HAS_LEN2: gl.constexpr = False, HAS_2: gl.constexpr = False):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8])
    LS: gl.constexpr = gl.SliceLayout(0, mma)
    LH: gl.constexpr = gl.SliceLayout(1, LS)
    # the decoded block: [4 * BLOCK_N, 128] bf16 (quarter w in rows w * BLOCK_N ..), 16-byte chunks swizzled by
    # row; viewed as [4, BLOCK_N, 128] by the MMA loads and as [4, BLOCK_N, 64] words by the decode's store (the
    # same bytes and swizzle: BLOCK_N is a multiple of the 8-row swizzle period)
    kv2 = gl.allocate_shared_memory(gl.bfloat16, [4 * BLOCK_N, 128],
                                    gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))
    kv = kv2._reinterpret(gl.bfloat16, [4, BLOCK_N, 128],
                          gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[2, 1, 0]))
    kvw3 = kv2._reinterpret(gl.int32, [4, BLOCK_N, 64],
                            gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[2, 1, 0]))
    # the four warps' partial scores: [4 * 16, BLOCK_N] fp32, written as [4, 16, BLOCK_N]
    sbuf = gl.allocate_shared_memory(gl.float32, [64, BLOCK_N],
                                     gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
    sb3 = sbuf._reinterpret(gl.float32, [4, 16, BLOCK_N],
                            gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0]))
    t64 = t.to(gl.int64)
    q0 = _q_chunk(q_ptr, t64, stride_qt, stride_qh, g, H, 0, BLOCK_H)
    q1 = _q_chunk(q_ptr, t64, stride_qt, stride_qh, g, H, 1, BLOCK_H)
    q2 = _q_chunk(q_ptr, t64, stride_qt, stride_qh, g, H, 2, BLOCK_H)
    q3 = _q_chunk(q_ptr, t64, stride_qt, stride_qh, g, H, 3, BLOCK_H)
    m_i = gl.full([16], float("-inf"), gl.float32, LH)
    l_i = gl.zeros([16], gl.float32, LH)
    o0 = gl.zeros([4, 16, CH], gl.float32, mma)
    o1 = gl.zeros([4, 16, CH], gl.float32, mma)
    o2 = gl.zeros([4, 16, CH], gl.float32, mma)
    o3 = gl.zeros([4, 16, CH], gl.float32, mma)
    if SPAN:
        if start < K:
            m_i, l_i, o0, o1, o2, o3 = _segment(q0, q1, q2, q3, m_i, l_i, o0, o1, o2, o3, kv, kvw3, sbuf, sb3, t, cache,
                                                idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk,
                                                sm_scale_log2, HAS_LEN, BLOCK_N)
        if HAS_2:
            if start + chunk > K:
                lo2 = gl.maximum(start - K, 0)
                m_i, l_i, o0, o1, o2, o3 = _segment(q0, q1, q2, q3, m_i, l_i, o0, o1, o2, o3, kv, kvw3, sbuf, sb3, t,
                                                    cache2, idx2_ptr, idx2_st, len2_ptr, K2, P2, PB_2, PB2_2,
                                                    lo2, start + chunk - K - lo2, sm_scale_log2, HAS_LEN2,
                                                    BLOCK_N)
    else:
        m_i, l_i, o0, o1, o2, o3 = _segment(q0, q1, q2, q3, m_i, l_i, o0, o1, o2, o3, kv, kvw3, sbuf, sb3, t, cache,
                                            idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk, sm_scale_log2,
                                            HAS_LEN, BLOCK_N)
    # the partial: warp w's dims 128w + 32c + j of each head, and (m, l) per head
    w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, mma)))
    h = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, mma)))
    d = gl.arange(0, CH, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma)))
    w3 = gl.expand_dims(gl.expand_dims(w, 1), 2)
    hh = g * BLOCK_H + h
    h3 = gl.expand_dims(gl.expand_dims(hh, 0), 2)
    d3 = gl.expand_dims(gl.expand_dims(d, 0), 1)
    base3 = (t64 * S + s) * HP + h3
    optr = acc_ws + base3 * 512 + w3 * 128 + d3
    om = (h3 < H) & (w3 >= 0) & (d3 >= 0)
    gl.store(optr, o0.to(acc_ws.dtype.element_ty), mask=om)
    gl.store(optr + CH, o1.to(acc_ws.dtype.element_ty), mask=om)
    gl.store(optr + 2 * CH, o2.to(acc_ws.dtype.element_ty), mask=om)
    gl.store(optr + 3 * CH, o3.to(acc_ws.dtype.element_ty), mask=om)
    hs = g * BLOCK_H + gl.arange(0, 16, layout=LH)
    base = (t64 * S + s) * HP + hs
    gl.store(m_ws + base, m_i, mask=hs < H)
    gl.store(l_ws + base, l_i, mask=hs < H)


@gluon.jit
def split_kernel_dimsplit(
    q_ptr, stride_qt, stride_qh,
    main_ptr, main_idx_ptr, main_idx_st, main_len_ptr, main_K, main_P, main_PB, main_PB2, main_nsplit, main_chunk,
    extra_ptr, extra_idx_ptr, extra_idx_st, extra_len_ptr, extra_K, extra_P, extra_PB, extra_PB2, extra_chunk,
    acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
    HAS_MAIN_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_EXTRA_LEN: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, FP8_QK: gl.constexpr, INTERP: gl.constexpr,
    SPAN: gl.constexpr = False,
):
    """Same contract as ``split_kernel_reg`` (bf16 QK, ``BLOCK_H`` 16, 4 warps), with the dim-split body."""
    t = gl.program_id(0)
    s = gl.program_id(1)
    g = gl.program_id(2)
    if SPAN:
        _dimsplit_body(q_ptr, stride_qt, stride_qh, t, s, g,
                       main_ptr.to(gl.pointer_type(gl.uint8)), main_idx_ptr, main_idx_st, main_len_ptr, main_K,
                       main_P, main_PB, main_PB2, s * main_chunk, main_chunk,
                       acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2, HAS_MAIN_LEN, BLOCK_H, BLOCK_N,
                       True, extra_ptr.to(gl.pointer_type(gl.uint8)), extra_idx_ptr, extra_idx_st, extra_len_ptr,
                       extra_K, extra_P, extra_PB, extra_PB2, HAS_EXTRA_LEN, HAS_EXTRA)
        return
    is_extra = False
    if HAS_EXTRA:
        is_extra = s >= main_nsplit
    if is_extra:
        _dimsplit_body(q_ptr, stride_qt, stride_qh, t, s, g,
                       extra_ptr.to(gl.pointer_type(gl.uint8)), extra_idx_ptr, extra_idx_st, extra_len_ptr,
                       extra_K, extra_P, extra_PB, extra_PB2, (s - main_nsplit) * extra_chunk, extra_chunk,
                       acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2, HAS_EXTRA_LEN, BLOCK_H, BLOCK_N)
    else:
        _dimsplit_body(q_ptr, stride_qt, stride_qh, t, s, g,
                       main_ptr.to(gl.pointer_type(gl.uint8)), main_idx_ptr, main_idx_st, main_len_ptr, main_K,
                       main_P, main_PB, main_PB2, s * main_chunk, main_chunk,
                       acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2, HAS_MAIN_LEN, BLOCK_H, BLOCK_N)
