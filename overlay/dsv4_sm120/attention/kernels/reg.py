"""Split kernel, register body (``impl=reg``, bf16 QK only): each K byte read and decoded once per block, the
next block gathered into registers while the current one computes. The default of bf16 QK on sm_120 at every
size, and on Hopper GPUs without a table of their own up to 4 grid rows per SM."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    _acc_tiles_init,
    _e4m3_bf16,
    _k_scales,
    _k_tiles,
    _mma_operand,
    _online_softmax,
    _segment_bounds,
    _softmax_init,
    _store_partial,
    _store_softmax_state,
    _token_rows,
)


@triton.jit
def _raw_block(cache, row, valid, sbase, rope_off, lanes):
    # one candidate block as stored: the seven e4m3 nope tiles, their UE8M0 scales, then the bf16 rope tile
    k0, k1, k2, k3, k4, k5, k6 = _k_tiles(cache, row, valid, lanes)
    c0, c1, c2, c3, c4, c5, c6 = _k_scales(cache, sbase, valid)
    rope = tl.load(cache.to(tl.pointer_type(tl.bfloat16)) + rope_off[:, None] + lanes[None, :], mask=valid[:, None],
                   other=0.0)
    return k0, k1, k2, k3, k4, k5, k6, c0, c1, c2, c3, c4, c5, c6, rope


@triton.jit
def _kdec(k8, ksc, INTERP: tl.constexpr, KCVT: tl.constexpr):
    # [BLOCK_N, 64] e4m3 bytes and their [BLOCK_N] UE8M0 tile scales -> the scaled values as bf16 (exact:
    # a power-of-two scale only moves the exponent; bf16 has fp32's range), fp32 under the interpreter
    if INTERP:
        return k8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * tl.exp2(ksc.to(tl.float32) - 127.0)[:, None]
    scb = (ksc.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)  # 2^(byte - 127) as bf16
    return _e4m3_bf16(k8, KCVT) * scb[:, None]


@triton.jit
def _kdec_block(k0, k1, k2, k3, k4, k5, k6, c0, c1, c2, c3, c4, c5, c6, rope, INTERP: tl.constexpr,
                KCVT: tl.constexpr):
    # a raw block (_raw_block) -> its seven decoded nope tiles and the rope tile (fp32 under the interpreter)
    kr = _mma_operand(rope, INTERP)
    return (_kdec(k0, c0, INTERP, KCVT), _kdec(k1, c1, INTERP, KCVT), _kdec(k2, c2, INTERP, KCVT),
            _kdec(k3, c3, INTERP, KCVT), _kdec(k4, c4, INTERP, KCVT), _kdec(k5, c5, INTERP, KCVT),
            _kdec(k6, c6, INTERP, KCVT), kr)


@triton.jit
def _reg_body(
    q_ptr, stride_qt, stride_qh, t, s, g,
    cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk,
    acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
    HAS_LEN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    INTERP: tl.constexpr, KCVT: tl.constexpr, DEC_LATE: tl.constexpr = False,
    SPAN: tl.constexpr = False, cache2=None, idx2_ptr=None, idx2_st=0, len2_ptr=None, K2=0, P2=1, PB_2=0, PB2_2=0,
    HAS_LEN2: tl.constexpr = False, HAS_2: tl.constexpr = False,
):
    # Register body (impl=reg, bf16 QK): every K byte is read from memory once and decoded once per block.
    # The next block's raw tiles (7 e4m3 tiles, rope, scales) are loaded into registers while the current
    # block computes (its indices two blocks ahead, so the gathers never wait on an index load), the current
    # tiles are decoded with their scale folded in (exact) and serve as K^T for QK and as V for PV, so P is
    # one bf16 A operand for all eight PV products. No cp.async staging (a pipelined body stages each tile twice,
    # for QK and for the PV re-read, and reads the PV copy back one byte per instruction).
    # SPAN: the program owns candidates [start, start + chunk) of the concatenated list main ++ extra (cache2),
    # so one split may run through the end of the main cache into the extra one (even work per program).
    t64 = t.to(tl.int64)
    offs_h = g * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    lanes = tl.arange(0, 64)
    q_row = q_ptr + t64 * stride_qt + offs_h[:, None].to(tl.int64) * stride_qh
    q_rope = _mma_operand(tl.load(q_row + 448 + lanes[None, :], mask=hmask[:, None], other=0.0), INTERP)
    # Q read once: Triton keeps loop-invariant dot operands in shared memory (one store before the loop,
    # ldmatrix per block) instead of a global re-read + store + barrier per tile and block
    q0 = _q_tile(q_row, hmask, 0, lanes, INTERP)
    q1 = _q_tile(q_row, hmask, 1, lanes, INTERP)
    q2 = _q_tile(q_row, hmask, 2, lanes, INTERP)
    q3 = _q_tile(q_row, hmask, 3, lanes, INTERP)
    q4 = _q_tile(q_row, hmask, 4, lanes, INTERP)
    q5 = _q_tile(q_row, hmask, 5, lanes, INTERP)
    q6 = _q_tile(q_row, hmask, 6, lanes, INTERP)
    m_i, l_i = _softmax_init(BLOCK_H)
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc_r = _acc_tiles_init(BLOCK_H)
    if SPAN:
        # the main cache's part of [start, start + chunk), then the extra cache's; a part that is empty is
        # skipped (its prologue would still cost a masked block)
        if start < K:
            m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc_r = _reg_segment(
                q_rope, q0, q1, q2, q3, q4, q5, q6, m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5,
                acc6, acc_r, t, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk,
                sm_scale_log2, HAS_LEN, BLOCK_N, INTERP, KCVT, DEC_LATE)
        if HAS_2:
            if start + chunk > K:
                lo2 = tl.maximum(start - K, 0)
                m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc_r = _reg_segment(
                    q_rope, q0, q1, q2, q3, q4, q5, q6, m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5,
                    acc6, acc_r, t, cache2, idx2_ptr, idx2_st, len2_ptr, K2, P2, PB_2, PB2_2, lo2,
                    start + chunk - K - lo2, sm_scale_log2, HAS_LEN2, BLOCK_N, INTERP, KCVT, DEC_LATE)
    else:
        m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc_r = _reg_segment(
            q_rope, q0, q1, q2, q3, q4, q5, q6, m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6,
            acc_r, t, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk,
            sm_scale_log2, HAS_LEN, BLOCK_N, INTERP, KCVT, DEC_LATE)

    base = (t64 * S + s) * HP + offs_h
    _store_partial(acc_ws, base, hmask, lanes, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc_r)
    _store_softmax_state(m_ws, l_ws, base, hmask, m_i, l_i)


@triton.jit
def _reg_segment(
    q_rope, q0, q1, q2, q3, q4, q5, q6, m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc_r,
    t, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk, sm_scale_log2,
    HAS_LEN: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr, KCVT: tl.constexpr,
    DEC_LATE: tl.constexpr,
):
    # the register body's candidate loop over [start, start + chunk) of one cache (chunk <= 0: nothing), carrying
    # the online-softmax state (m_i, l_i, the eight accumulator tiles) in and out
    lanes = tl.arange(0, 64)
    idx_row = idx_ptr + t.to(tl.int64) * idx_st
    cend, end = _segment_bounds(len_ptr, K, t, start, chunk, HAS_LEN)
    PB64 = PB.to(tl.int64)
    PB2_64 = PB2.to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    # block 0's tiles and block 1's indices before the loop
    cand = start + offs_n
    idx = tl.load(idx_row + cand, mask=cand < cend, other=-1)
    valid, row, sb, ro = _token_rows(idx, cand < end, P, PB64, PB2_64)
    k0, k1, k2, k3, k4, k5, k6, c0, c1, c2, c3, c4, c5, c6, rope = _raw_block(cache, row, valid, sb, ro, lanes)
    if DEC_LATE:
        # DEC_LATE: the loop carries the decoded bf16 block (the next one is decoded at the end of an
        # iteration, after its gathers had the whole block's math to land), not the raw e4m3 bytes
        kb0, kb1, kb2, kb3, kb4, kb5, kb6, kr = _kdec_block(k0, k1, k2, k3, k4, k5, k6, c0, c1, c2, c3, c4, c5, c6,
                                                            rope, INTERP, KCVT)
    cand = start + BLOCK_N + offs_n
    idx_n = tl.load(idx_row + cand, mask=cand < cend, other=-1)
    for n0 in range(start, end, BLOCK_N):
        # issue block n+1's gathers (indices loaded one iteration ago) and block n+2's indices
        cand = n0 + BLOCK_N + offs_n
        vn, rn, sbn, ron = _token_rows(idx_n, cand < end, P, PB64, PB2_64)
        cand = n0 + 2 * BLOCK_N + offs_n
        idx_n = tl.load(idx_row + cand, mask=cand < cend, other=-1)
        nxt = _raw_block(cache, rn, vn, sbn, ron, lanes)
        # block n
        if not DEC_LATE:
            kb0, kb1, kb2, kb3, kb4, kb5, kb6, kr = _kdec_block(k0, k1, k2, k3, k4, k5, k6, c0, c1, c2, c3, c4, c5,
                                                                c6, rope, INTERP, KCVT)
        qk = tl.dot(q_rope, tl.trans(kr))
        qk = tl.dot(q0, tl.trans(kb0), qk)
        qk = tl.dot(q1, tl.trans(kb1), qk)
        qk = tl.dot(q2, tl.trans(kb2), qk)
        qk = tl.dot(q3, tl.trans(kb3), qk)
        qk = tl.dot(q4, tl.trans(kb4), qk)
        qk = tl.dot(q5, tl.trans(kb5), qk)
        qk = tl.dot(q6, tl.trans(kb6), qk)
        p, alpha, m_i, l_i = _online_softmax(qk, valid, m_i, l_i, sm_scale_log2)
        a2 = alpha[:, None]
        pb = _mma_operand(p.to(tl.bfloat16), INTERP)
        acc_r = tl.dot(pb, kr, acc_r * a2)
        acc0 = tl.dot(pb, kb0, acc0 * a2)
        acc1 = tl.dot(pb, kb1, acc1 * a2)
        acc2 = tl.dot(pb, kb2, acc2 * a2)
        acc3 = tl.dot(pb, kb3, acc3 * a2)
        acc4 = tl.dot(pb, kb4, acc4 * a2)
        acc5 = tl.dot(pb, kb5, acc5 * a2)
        acc6 = tl.dot(pb, kb6, acc6 * a2)
        valid = vn
        if DEC_LATE:
            n0_, n1_, n2_, n3_, n4_, n5_, n6_, d0_, d1_, d2_, d3_, d4_, d5_, d6_, nr_ = nxt
            kb0, kb1, kb2, kb3, kb4, kb5, kb6, kr = _kdec_block(n0_, n1_, n2_, n3_, n4_, n5_, n6_, d0_, d1_, d2_,
                                                                d3_, d4_, d5_, d6_, nr_, INTERP, KCVT)
        else:
            k0, k1, k2, k3, k4, k5, k6, c0, c1, c2, c3, c4, c5, c6, rope = nxt

    return m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc_r


@triton.jit
def _q_tile(q_row, hmask, t: tl.constexpr, lanes, INTERP: tl.constexpr):
    # q tile t [BLOCK_H, 64] bf16 (fp32 under the interpreter)
    return _mma_operand(tl.load(q_row + t * 64 + lanes[None, :], mask=hmask[:, None], other=0.0), INTERP)


@triton.jit
def split_kernel_reg(
    q_ptr, stride_qt, stride_qh,
    main_ptr, main_idx_ptr, main_idx_st, main_len_ptr, main_K, main_P, main_PB, main_PB2, main_nsplit, main_chunk,
    extra_ptr, extra_idx_ptr, extra_idx_st, extra_len_ptr, extra_K, extra_P, extra_PB, extra_PB2, extra_chunk,
    acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
    HAS_MAIN_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_EXTRA_LEN: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FP8_QK: tl.constexpr, INTERP: tl.constexpr,
    KCVT: tl.constexpr = False, DEC_LATE: tl.constexpr = False, SPAN: tl.constexpr = False,
):
    """Same contract as ``split_kernel_tiled`` (bf16 QK only), with the register body (``_reg_body``). SPAN: the
    splits cut the concatenated candidate list main ++ extra into ``main_chunk``-sized pieces (``main_nsplit``
    and ``extra_chunk`` unused), so a program may own the end of the main cache and the start of the extra."""
    t = tl.program_id(0)
    s = tl.program_id(1)
    g = tl.program_id(2)
    if SPAN:
        _reg_body(q_ptr, stride_qt, stride_qh, t, s, g,
                  main_ptr.to(tl.pointer_type(tl.uint8)), main_idx_ptr, main_idx_st, main_len_ptr, main_K,
                  main_P, main_PB, main_PB2, s * main_chunk, main_chunk,
                  acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
                  HAS_MAIN_LEN, BLOCK_H, BLOCK_N, INTERP, KCVT, DEC_LATE,
                  True, extra_ptr.to(tl.pointer_type(tl.uint8)), extra_idx_ptr, extra_idx_st, extra_len_ptr,
                  extra_K, extra_P, extra_PB, extra_PB2, HAS_EXTRA_LEN, HAS_EXTRA)
        return
    is_extra = False
    if HAS_EXTRA:
        is_extra = s >= main_nsplit
    if is_extra:
        _reg_body(q_ptr, stride_qt, stride_qh, t, s, g,
                  extra_ptr.to(tl.pointer_type(tl.uint8)), extra_idx_ptr, extra_idx_st, extra_len_ptr, extra_K,
                  extra_P, extra_PB, extra_PB2, (s - main_nsplit) * extra_chunk, extra_chunk,
                  acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
                  HAS_EXTRA_LEN, BLOCK_H, BLOCK_N, INTERP, KCVT, DEC_LATE)
    else:
        _reg_body(q_ptr, stride_qt, stride_qh, t, s, g,
                  main_ptr.to(tl.pointer_type(tl.uint8)), main_idx_ptr, main_idx_st, main_len_ptr, main_K,
                  main_P, main_PB, main_PB2, s * main_chunk, main_chunk,
                  acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
                  HAS_MAIN_LEN, BLOCK_H, BLOCK_N, INTERP, KCVT, DEC_LATE)

