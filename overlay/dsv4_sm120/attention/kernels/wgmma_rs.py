"""Split kernel, Hopper warpgroup-MMA body without producer warps (``impl=wgmma_t`` under a scratch switch; Gluon,
sm_90 only): the candidates as M and 16 heads as N, as ``wgmma_t``, but one warpgroup gathers, decodes and runs
both products itself, QK with the decoded block as a register operand.

Each thread gathers the 16 bytes of each 64-dim tile that its rows of the warpgroup MMA's A operand need (rows
``16 w + l // 4`` and ``+ 8``, dims ``16 (l % 4) ..``), decodes them with the tile scale in registers and issues
``S^T += K Q^T`` for the tile straight from them (the MMA's k order permuted: A column ``8 j + 2 q + e`` is dim
``16 q + 2 j + e`` of the tile; Q is staged once in shared memory in the same order). The decoded block is also
stored, in the natural order, into one ``[64, 512]`` shared tile for ``O^T += V^T P^T`` (A: that tile read
transposed, B: P). The next block's raw tiles are loaded as this block's are decoded (one block ahead); its slot
ids one further. Two CTAs of one warpgroup per SM: one's gathers and decode overlap the other's MMAs.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from .common import _segment_bounds, _store_softmax_state, _token_rows
from .wgmma import _bf16_tile, _final_scale, _partition_barrier
from .wspec import E4M3X4_SCALED_ASM

BN = gl.constexpr(64)
import os as _os
QK_INFLIGHT = gl.constexpr(int(_os.environ.get("RS_QK_INFLIGHT", "0")))


# [64, 16] words of a nope tile: thread (w, l) holds rows 16 w + l // 4 (+ 8) and words 4 (l % 4) .. + 3
LW = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]],
                                             lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                             warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 16]))
# [64, 32] words of the bf16 rope: thread (w, l) holds rows 16 w + l // 4 (+ 8) and words 8 (l % 4) .. + 7
LR = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
                                             lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                             warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 32]))


@gluon.jit
def _slot_ids(idx_row, n0, cend):
    cand = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, LW))
    return gl.load(idx_row + cand, mask=cand < cend, other=-1)


@gluon.jit
def _rows(idx, n0, end, P, PB64, PB2_64):
    cand = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, LW))
    return _token_rows(idx, cand < end, P, PB64, PB2_64)


@gluon.jit
def _tile(words, row, valid, T: gl.constexpr):
    lanes = gl.arange(0, 16, layout=gl.SliceLayout(0, LW))
    return gl.load(words + gl.expand_dims(row // 4 + 16 * T, 1) + gl.expand_dims(lanes, 0),
                   mask=gl.expand_dims(valid, 1), other=0)


@gluon.jit
def _rope(words, ro, valid):
    RR: gl.constexpr = gl.SliceLayout(1, LR)
    lanes = gl.arange(0, 32, layout=gl.SliceLayout(0, LR))
    return gl.load(words + gl.expand_dims(gl.convert_layout(ro // 2, RR), 1) + gl.expand_dims(lanes, 0),
                   mask=gl.expand_dims(gl.convert_layout(valid, RR), 1), other=0)


@gluon.jit
def _dec_tile(k32, sw, SHIFT: gl.constexpr, AOP: gl.constexpr):
    # a nope tile's words -> its [64, 64] bf16 values as the MMA's A operand, columns in the permuted k order
    sc = (sw >> SHIFT) & 0xFF
    sc2 = gl.expand_dims((sc << 7) | (sc << 23), 1)
    lo, hi = gl.inline_asm_elementwise(E4M3X4_SCALED_ASM, "=r,=r,r,r", [k32, sc2], dtype=(gl.int32, gl.int32),
                                       is_pure=True, pack=1)
    # [64, 16 (word 4 q + sub), 2 (h)] -> pair 4 (2 sub + h) + q
    a = gl.join(lo, hi).reshape([64, 4, 4, 2]).permute([0, 2, 3, 1]).reshape([64, 32])
    return gl.convert_layout(_bf16_tile(a), AOP)


@gluon.jit
def _dec_rope(words, AOP: gl.constexpr):
    a = words.reshape([64, 4, 8]).permute([0, 2, 1]).reshape([64, 32])   # pair 4 i + q (natural pair 8 q + i)
    return gl.convert_layout(_bf16_tile(a), AOP)


@gluon.jit
def _dims(c):
    # the dim that column c of the permuted order holds
    cc = c % 64
    return c - cc + 16 * ((cc % 8) // 2) + 2 * (cc // 8) + cc % 2


@gluon.jit
def _store_heads_perm(stage, ot, dst_ptr, row0, nrows):
    # wgmma_t's _store_heads for ot [512, BH] whose rows are dims in the permuted order
    BH: gl.constexpr = ot.shape[1]
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    r = gl.arange(0, BH, layout=gl.SliceLayout(1, QL))
    c = gl.arange(0, 512, layout=gl.SliceLayout(0, QL))
    ptr = dst_ptr + gl.expand_dims((row0 + r).to(gl.int64) * 512, 1) + gl.expand_dims(_dims(c), 0)
    if dst_ptr.dtype.element_ty == gl.bfloat16:
        stage.store(gl.permute(ot.to(gl.bfloat16), [1, 0]))
        _partition_barrier()
        gl.store(ptr, stage.load(QL), mask=gl.expand_dims(r < nrows, 1))
    else:
        gl.store(ptr, gl.convert_layout(gl.permute(ot, [1, 0]), QL).to(dst_ptr.dtype.element_ty),
                 mask=gl.expand_dims(r < nrows, 1))


@gluon.jit
def _stage_q_perm(q_s, q_ptr, row_off, stride_qh, h0, H):
    # Q [BH, 512] in the A operand's k order: column 64 t + 8 j + 2 q + e holds dim 64 t + 16 q + 2 j + e
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    hq = h0 + gl.arange(0, q_s.shape[0], layout=gl.SliceLayout(1, QL))
    c = gl.arange(0, 512, layout=gl.SliceLayout(0, QL))
    q = gl.load(q_ptr + row_off + gl.expand_dims(hq.to(gl.int64) * stride_qh, 1) + gl.expand_dims(_dims(c), 0),
                mask=gl.expand_dims(hq < H, 1), other=0.0)
    q_s.store(q)
    fence_async_shared()
    _partition_barrier()


@gluon.jit
def _qk_tile(st, a, kv, q_s, T: gl.constexpr, prev):
    # tile T: its values into the V tile (permuted columns, as Q's), S^T += A_T Q_T^T issued; returns (st, a) once
    # tile T - 1's MMA is done (its register operand ``prev`` free)
    kv.slice(64 * T, 64, dim=1).store(a)
    st = warpgroup_mma(a, q_s.slice(64 * T, 64, dim=1).permute([1, 0]), st, is_async=True)
    if QK_INFLIGHT == 0:
        st, a = warpgroup_mma_wait(0, deps=[st, a])
    else:
        st, prev = warpgroup_mma_wait(1, deps=[st, prev])
    return st, a


@gluon.jit
def _run_cache(ot, m_i, l_p, q_s, kv, p_s, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, t, start, chunk,
               sm_scale_log2, HAS_LEN: gl.constexpr, BH: gl.constexpr):
    AL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16])
    AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=AL, k_width=2)
    idx_row = idx_ptr + t.to(gl.int64) * idx_st
    cend, end = _segment_bounds(len_ptr, K, t, start, chunk, HAS_LEN)
    PB64 = PB.to(gl.int64)
    PB2_64 = PB2.to(gl.int64)
    words = cache.to(gl.pointer_type(gl.int32))
    valid, row, sb, ro = _rows(_slot_ids(idx_row, start, cend), start, end, P, PB64, PB2_64)
    k0 = _tile(words, row, valid, 0)
    k1 = _tile(words, row, valid, 1)
    k2 = _tile(words, row, valid, 2)
    k3 = _tile(words, row, valid, 3)
    k4 = _tile(words, row, valid, 4)
    k5 = _tile(words, row, valid, 5)
    k6 = _tile(words, row, valid, 6)
    s_lo = gl.load(words + sb // 4, mask=valid, other=0)
    s_hi = gl.load(words + sb // 4 + 1, mask=valid, other=0)
    rope = _rope(words, ro, valid)
    nid = _slot_ids(idx_row, start + BN, cend)
    for n0 in range(start, end, BN):
        vc = gl.convert_layout(valid, gl.SliceLayout(1, AL))
        nvalid, nrow, nsb, nro = _rows(nid, n0 + BN, end, P, PB64, PB2_64)
        nid = _slot_ids(idx_row, n0 + 2 * BN, cend)
        # the previous block's PV has read the V tile and P
        ot = warpgroup_mma_wait(0, deps=[ot])
        st = gl.zeros([BN, BH], gl.float32, AL)
        a = _dec_tile(k0, s_lo, 0, AOP)
        k0 = _tile(words, nrow, nvalid, 0)
        kv.slice(0, 64, dim=1).store(a)
        st = warpgroup_mma(a, q_s.slice(0, 64, dim=1).permute([1, 0]), st, is_async=True)
        if QK_INFLIGHT == 0:
            st, a = warpgroup_mma_wait(0, deps=[st, a])
        pa = a
        a = _dec_tile(k1, s_lo, 8, AOP)
        k1 = _tile(words, nrow, nvalid, 1)
        st, pa = _qk_tile(st, a, kv, q_s, 1, pa)
        a = _dec_tile(k2, s_lo, 16, AOP)
        k2 = _tile(words, nrow, nvalid, 2)
        st, pa = _qk_tile(st, a, kv, q_s, 2, pa)
        a = _dec_tile(k3, s_lo, 24, AOP)
        k3 = _tile(words, nrow, nvalid, 3)
        s_lo = gl.load(words + nsb // 4, mask=nvalid, other=0)
        st, pa = _qk_tile(st, a, kv, q_s, 3, pa)
        a = _dec_tile(k4, s_hi, 0, AOP)
        k4 = _tile(words, nrow, nvalid, 4)
        st, pa = _qk_tile(st, a, kv, q_s, 4, pa)
        a = _dec_tile(k5, s_hi, 8, AOP)
        k5 = _tile(words, nrow, nvalid, 5)
        st, pa = _qk_tile(st, a, kv, q_s, 5, pa)
        a = _dec_tile(k6, s_hi, 16, AOP)
        k6 = _tile(words, nrow, nvalid, 6)
        s_hi = gl.load(words + nsb // 4 + 1, mask=nvalid, other=0)
        st, pa = _qk_tile(st, a, kv, q_s, 6, pa)
        a = _dec_rope(rope, AOP)
        rope = _rope(words, nro, nvalid)
        st, pa = _qk_tile(st, a, kv, q_s, 7, pa)
        st, pa = warpgroup_mma_wait(0, deps=[st, pa])
        valid = nvalid
        x = gl.where(gl.expand_dims(vc, 1), st * sm_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(x, axis=0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.expand_dims(gl.exp2(m_i - m_use), 0)
        p = gl.exp2(x - gl.expand_dims(m_use, 0))
        l_p = l_p * alpha + p
        m_i = m_new
        p_s.store(gl.permute(p.to(gl.bfloat16), [1, 0]))
        fence_async_shared()
        _partition_barrier()
        ot = warpgroup_mma(kv.permute([1, 0]), p_s.permute([1, 0]), ot * alpha, is_async=True)
        # PV stays in flight into the next block's gathers and decode
        ot = warpgroup_mma_wait(1, deps=[ot])
    ot = warpgroup_mma_wait(0, deps=[ot])
    return ot, m_i, l_p


@gluon.jit
def split_kernel_wgmma_rs(
    q_ptr, stride_qt, stride_qh,
    main_ptr, main_idx_ptr, main_idx_st, main_len_ptr, main_K, main_P, main_PB, main_PB2, main_nsplit, main_chunk,
    extra_ptr, extra_idx_ptr, extra_idx_st, extra_len_ptr, extra_K, extra_P, extra_PB, extra_PB2, extra_chunk,
    acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
    HAS_MAIN_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_EXTRA_LEN: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, FP8_QK: gl.constexpr, INTERP: gl.constexpr,
    SPAN: gl.constexpr = False, PRODUCER_REGS: gl.constexpr = None, SLOTS: gl.constexpr = 2,
    out_ptr=None, lse_ptr=None, sink_ptr=None, FINAL: gl.constexpr = False, HAS_SINK: gl.constexpr = False,
    NB=1, W=1, C=1, BALANCED: gl.constexpr = False,
):
    """``split_kernel_wgmma_t``'s contract and classic plan (16 heads per program), one warpgroup doing
    everything."""
    gl.static_assert(BLOCK_H == 16, "the register-operand body takes 16 heads per program")
    gl.static_assert(BLOCK_N == 64, "the register-operand body consumes 64-candidate blocks")
    gl.static_assert(SPAN, "the register-operand body takes spanning splits")
    gl.static_assert(not BALANCED, "the register-operand body runs the classic plan")
    BH: gl.constexpr = BLOCK_H
    AL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16])
    t = gl.program_id(0)
    s = gl.program_id(1)
    g = gl.program_id(2)
    main = main_ptr.to(gl.pointer_type(gl.uint8))
    extra = extra_ptr.to(gl.pointer_type(gl.uint8))
    start = s * main_chunk
    chunk = main_chunk
    NV: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    kv = gl.allocate_shared_memory(gl.bfloat16, [BN, 512], NV)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [BH, 512], NV)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [BH, BN], NV)
    t64 = t.to(gl.int64)
    _stage_q_perm(q_s, q_ptr, t64 * stride_qt, stride_qh, g * BH, H)
    m_i = gl.full([BH], float("-inf"), gl.float32, gl.SliceLayout(0, AL))
    l_p = gl.zeros([BN, BH], gl.float32, AL)
    ot = gl.zeros([512, BH], gl.float32, AL)
    if start < main_K:
        ot, m_i, l_p = _run_cache(ot, m_i, l_p, q_s, kv, p_s, main, main_idx_ptr, main_idx_st, main_len_ptr, main_K,
                                  main_P, main_PB, main_PB2, t, start, chunk, sm_scale_log2, HAS_MAIN_LEN, BH)
    if HAS_EXTRA:
        if start + chunk > main_K:
            lo2 = gl.maximum(start - main_K, 0)
            ot, m_i, l_p = _run_cache(ot, m_i, l_p, q_s, kv, p_s, extra, extra_idx_ptr, extra_idx_st, extra_len_ptr,
                                      extra_K, extra_P, extra_PB, extra_PB2, t, lo2, start + chunk - main_K - lo2,
                                      sm_scale_log2, HAS_EXTRA_LEN, BH)
    l_i = gl.sum(l_p, axis=0)
    hs = g * BH + gl.arange(0, BH, layout=gl.SliceLayout(0, AL))
    # every warp is past its last MMA (which read Q's tile) before the tile stages the output
    _partition_barrier()
    if FINAL:
        inv = _final_scale(lse_ptr, sink_ptr, t64, H, hs, m_i, l_i, HAS_SINK)
        _store_heads_perm(q_s, ot * gl.expand_dims(inv, 0), out_ptr, t64 * H + g * BH, H - g * BH)
    else:
        _store_heads_perm(q_s, ot, acc_ws, (t64 * S + s) * HP + g * BH, H - g * BH)
        _store_softmax_state(m_ws, l_ws, (t64 * S + s) * HP + hs, hs < H, m_i, l_i)
