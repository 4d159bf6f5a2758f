"""Split kernel, tiled body (``impl=tiled``): the nope dims in seven 64-wide e4m3 tiles, both QK paths (the fp8
one with Q quantized before the launch). The default of the fp8 QK path and of bf16 grids past the register
body's bound."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    _acc_tiles_init,
    _e4m3_bf16,
    _k_scales,
    _k_tile_again,
    _k_tiles,
    _mma_operand,
    _online_softmax,
    _softmax_init,
    _store_partial,
    _store_softmax_state,
    _token_rows,
    _ue8m0,
)


@triton.jit
def _qk_tile(q_row, hmask, k8, ksc, t: tl.constexpr, lanes, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
             FP8_QK: tl.constexpr, INTERP: tl.constexpr, KCVT: tl.constexpr = False, q8_row=None, qsc_row=None):
    # q_h . k_n over nope tile t, K scale included: [BLOCK_H, BLOCK_N] fp32
    # volatile: keep the compiler from hoisting the seven q tiles out of the candidate loop, where
    # they would pin 16x512 bf16 per warp (128 registers per thread) for the whole loop
    if FP8_QK:
        # Q quantized before the launch (q_fp8_kernel): load the e4m3 tile and its scales
        q8 = tl.load(q8_row + t * 64 + lanes[None, :], mask=hmask[:, None], other=0, volatile=True)
        q8 = q8.to(tl.float8e4nv, bitcast=True)
        q_sc = tl.load(qsc_row + t * 2 + tl.arange(0, 2)[None, :], mask=hmask[:, None], other=127, volatile=True)
        k_sc = tl.broadcast_to(ksc[:, None], [BLOCK_N, 2])
        return tl.dot_scaled(q8, q_sc, "e4m3", tl.trans(k8.to(tl.float8e4nv, bitcast=True)), k_sc, "e4m3")
    qt = tl.load(q_row + t * 64 + lanes[None, :], mask=hmask[:, None], other=0.0, volatile=True)
    if INTERP:
        kt = k8.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        qk = tl.dot(qt.to(tl.float32), tl.trans(kt))
    else:
        kt = _e4m3_bf16(k8, KCVT)
        qk = tl.dot(qt, tl.trans(kt))
    return qk * _ue8m0(ksc, KCVT)[None, :]


@triton.jit
def _pv_tile(acc, p, k8, ksc, INTERP: tl.constexpr, KCVT: tl.constexpr = False):
    # acc_t += (p * scale_t) @ e4m3 values of tile t; the power-of-two tile scale rides on p
    pv = (p * _ue8m0(ksc, KCVT)[None, :]).to(tl.bfloat16)
    if INTERP:
        return acc + tl.dot(pv.to(tl.float32), k8.to(tl.float8e4nv, bitcast=True).to(tl.float32))
    return acc + tl.dot(pv, _e4m3_bf16(k8, KCVT))


@triton.jit
def _qk_add_nope(qk, q_row, hmask, k0, k1, k2, k3, k4, k5, k6, c0, c1, c2, c3, c4, c5, c6, lanes,
                 BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FP8_QK: tl.constexpr, INTERP: tl.constexpr,
                 KCVT: tl.constexpr, q8_row, qsc_row):
    # qk + the seven nope tiles' _qk_tile products, added in tile order (k*: e4m3 tiles, c*: their UE8M0 scales)
    qk += _qk_tile(q_row, hmask, k0, c0, 0, lanes, BLOCK_H, BLOCK_N, FP8_QK, INTERP, KCVT, q8_row, qsc_row)
    qk += _qk_tile(q_row, hmask, k1, c1, 1, lanes, BLOCK_H, BLOCK_N, FP8_QK, INTERP, KCVT, q8_row, qsc_row)
    qk += _qk_tile(q_row, hmask, k2, c2, 2, lanes, BLOCK_H, BLOCK_N, FP8_QK, INTERP, KCVT, q8_row, qsc_row)
    qk += _qk_tile(q_row, hmask, k3, c3, 3, lanes, BLOCK_H, BLOCK_N, FP8_QK, INTERP, KCVT, q8_row, qsc_row)
    qk += _qk_tile(q_row, hmask, k4, c4, 4, lanes, BLOCK_H, BLOCK_N, FP8_QK, INTERP, KCVT, q8_row, qsc_row)
    qk += _qk_tile(q_row, hmask, k5, c5, 5, lanes, BLOCK_H, BLOCK_N, FP8_QK, INTERP, KCVT, q8_row, qsc_row)
    qk += _qk_tile(q_row, hmask, k6, c6, 6, lanes, BLOCK_H, BLOCK_N, FP8_QK, INTERP, KCVT, q8_row, qsc_row)
    return qk


@triton.jit
def _tiled_body(
    q_ptr, stride_qt, stride_qh, t, s, g,
    cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk,
    acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
    HAS_LEN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FP8_QK: tl.constexpr,
    INTERP: tl.constexpr, PREFETCH: tl.constexpr, KCVT: tl.constexpr = False, q8_ptr=None, qsc_ptr=None,
):
    # One (row, split, head-group) of one cache. Called once per cache from the kernel so each
    # call site keeps the argument alignment facts (16-byte aligned pages and rows) that let the
    # gathers use 16-byte vector loads.
    t64 = t.to(tl.int64)
    idx_row = idx_ptr + t64 * idx_st
    cend = tl.minimum(start + chunk, K)
    end = cend
    if HAS_LEN:
        end = tl.minimum(end, tl.load(len_ptr + t))
    cache_bf16 = cache.to(tl.pointer_type(tl.bfloat16))
    PB64 = PB.to(tl.int64)
    PB2_64 = PB2.to(tl.int64)

    offs_h = g * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    lanes = tl.arange(0, 64)
    q_row = q_ptr + t64 * stride_qt + offs_h[:, None].to(tl.int64) * stride_qh
    q8_row = q8_ptr
    qsc_row = qsc_ptr
    if FP8_QK:
        q8_row = q8_ptr + (t64 * HP + offs_h)[:, None] * 448
        qsc_row = qsc_ptr + (t64 * HP + offs_h)[:, None] * 14
    q_rope = _mma_operand(tl.load(q_row + 448 + lanes[None, :], mask=hmask[:, None], other=0.0), INTERP)

    m_i, l_i = _softmax_init(BLOCK_H)
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc_r = _acc_tiles_init(BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    if PREFETCH:
        # the first block's indices are read without waiting for the row length, and each block
        # reads the next block's indices before its own gathers: one dependent round trip less
        idx_next = tl.load(idx_row + start + offs_n, mask=start + offs_n < cend, other=-1)
    if PREFETCH == 2:
        # PREFETCH=2: the next block's UE8M0 scale bytes too (byte loads cannot be staged by cp.async,
        # so read in the block itself they wait a full memory round trip)
        vf, _r, sbf, _o = _token_rows(idx_next, start + offs_n < end, P, PB64, PB2_64)
        n0s, n1s, n2s, n3s, n4s, n5s, n6s = _k_scales(cache, sbf, vf)
    for n0 in range(start, end, BLOCK_N):
        cand = n0 + offs_n
        inb = cand < end
        if PREFETCH:
            idx = tl.where(inb, idx_next, -1)
            nxt = cand + BLOCK_N
            idx_next = tl.load(idx_row + nxt, mask=nxt < cend, other=-1)
        else:
            idx = tl.load(idx_row + cand, mask=inb, other=-1)
        valid, row, sbase, rope_off = _token_rows(idx, inb, P, PB64, PB2_64)
        if PREFETCH == 2:
            c0, c1, c2, c3, c4, c5, c6 = n0s, n1s, n2s, n3s, n4s, n5s, n6s
            vn, _rn, sbn, _on = _token_rows(idx_next, nxt < end, P, PB64, PB2_64)
            n0s, n1s, n2s, n3s, n4s, n5s, n6s = _k_scales(cache, sbn, vn)
        rope = tl.load(cache_bf16 + rope_off[:, None] + lanes[None, :], mask=valid[:, None], other=0.0)
        rope = _mma_operand(rope, INTERP)
        k0, k1, k2, k3, k4, k5, k6 = _k_tiles(cache, row, valid, lanes)
        if PREFETCH != 2:
            c0, c1, c2, c3, c4, c5, c6 = _k_scales(cache, sbase, valid)
        qk = tl.dot(q_rope, tl.trans(rope))
        qk = _qk_add_nope(qk, q_row, hmask, k0, k1, k2, k3, k4, k5, k6, c0, c1, c2, c3, c4, c5, c6, lanes,
                          BLOCK_H, BLOCK_N, FP8_QK, INTERP, KCVT, q8_row, qsc_row)
        p, alpha, m_i, l_i = _online_softmax(qk, valid, m_i, l_i, sm_scale_log2)
        a2 = alpha[:, None]
        acc_r = acc_r * a2 + tl.dot(_mma_operand(p.to(tl.bfloat16), INTERP), rope)
        acc0 = _pv_tile(acc0 * a2, p, _k_tile_again(cache, row, valid, 0, lanes), c0, INTERP, KCVT)
        acc1 = _pv_tile(acc1 * a2, p, _k_tile_again(cache, row, valid, 1, lanes), c1, INTERP, KCVT)
        acc2 = _pv_tile(acc2 * a2, p, _k_tile_again(cache, row, valid, 2, lanes), c2, INTERP, KCVT)
        acc3 = _pv_tile(acc3 * a2, p, _k_tile_again(cache, row, valid, 3, lanes), c3, INTERP, KCVT)
        acc4 = _pv_tile(acc4 * a2, p, _k_tile_again(cache, row, valid, 4, lanes), c4, INTERP, KCVT)
        acc5 = _pv_tile(acc5 * a2, p, _k_tile_again(cache, row, valid, 5, lanes), c5, INTERP, KCVT)
        acc6 = _pv_tile(acc6 * a2, p, _k_tile_again(cache, row, valid, 6, lanes), c6, INTERP, KCVT)

    base = (t64 * S + s) * HP + offs_h
    _store_partial(acc_ws, base, hmask, lanes, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc_r)
    _store_softmax_state(m_ws, l_ws, base, hmask, m_i, l_i)


@triton.jit
def split_kernel_tiled(
    q_ptr, stride_qt, stride_qh,
    main_ptr, main_idx_ptr, main_idx_st, main_len_ptr, main_K, main_P, main_PB, main_PB2, main_nsplit, main_chunk,
    extra_ptr, extra_idx_ptr, extra_idx_st, extra_len_ptr, extra_K, extra_P, extra_PB, extra_PB2, extra_chunk,
    acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
    HAS_MAIN_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_EXTRA_LEN: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FP8_QK: tl.constexpr, INTERP: tl.constexpr,
    PREFETCH: tl.constexpr = False, KCVT: tl.constexpr = False, q8_ptr=None, qsc_ptr=None,
):
    """Same contract as ``split_kernel_flat``, but the nope part is processed in its seven 64-wide tiles: K/V
    tiles stay e4m3 bytes, converted straight to MMA operands, the UE8M0 scale is applied to the [heads,
    candidates] products (QK) and to P (PV), and seven [BLOCK_H, 64] accumulators replace the [BLOCK_H, 512]
    one. ``FP8_QK``: ``q8_ptr`` / ``qsc_ptr`` hold Q quantized by ``q_fp8_kernel``."""
    t = tl.program_id(0)
    s = tl.program_id(1)
    g = tl.program_id(2)
    is_extra = False
    if HAS_EXTRA:
        is_extra = s >= main_nsplit
    if is_extra:
        _tiled_body(q_ptr, stride_qt, stride_qh, t, s, g,
                    extra_ptr.to(tl.pointer_type(tl.uint8)), extra_idx_ptr, extra_idx_st, extra_len_ptr, extra_K,
                    extra_P, extra_PB, extra_PB2, (s - main_nsplit) * extra_chunk, extra_chunk,
                    acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
                    HAS_EXTRA_LEN, BLOCK_H, BLOCK_N, FP8_QK, INTERP, PREFETCH, KCVT, q8_ptr, qsc_ptr)
    else:
        _tiled_body(q_ptr, stride_qt, stride_qh, t, s, g,
                    main_ptr.to(tl.pointer_type(tl.uint8)), main_idx_ptr, main_idx_st, main_len_ptr, main_K,
                    main_P, main_PB, main_PB2, s * main_chunk, main_chunk,
                    acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
                    HAS_MAIN_LEN, BLOCK_H, BLOCK_N, FP8_QK, INTERP, PREFETCH, KCVT, q8_ptr, qsc_ptr)

