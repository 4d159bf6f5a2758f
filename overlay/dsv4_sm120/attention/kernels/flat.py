"""Split kernel, flat body (``impl=flat``): 512-wide dequantized tiles. The Hopper default for H > 16 on
large grids (64-row head blocks)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    _mma_operand,
    _online_softmax,
    _q_mx_quantize,
    _softmax_init,
    _store_softmax_state,
)


@triton.jit
def _flat_range(s, t, t64, main_ptr, main_idx_ptr, main_idx_st, main_len_ptr, main_K, main_P, main_PB, main_PB2,
                main_nsplit, main_chunk, extra_ptr, extra_idx_ptr, extra_idx_st, extra_len_ptr, extra_K, extra_P,
                extra_PB, extra_PB2, extra_chunk, HAS_MAIN_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr,
                HAS_EXTRA_LEN: tl.constexpr):
    # which cache and which candidate range split s of row t (t64: t as int64) owns: (cache bytes, index row,
    # page size, page bytes (int64), page bf16 elements (int64), start, end); main cache chunks first, then the
    # extra cache's
    cache = main_ptr.to(tl.pointer_type(tl.uint8))
    idx_row = main_idx_ptr + t64 * main_idx_st
    P = main_P
    PB = main_PB.to(tl.int64)
    PB2 = main_PB2.to(tl.int64)
    start = s * main_chunk
    end = tl.minimum(start + main_chunk, main_K)
    if HAS_MAIN_LEN:
        end = tl.minimum(end, tl.load(main_len_ptr + t))
    if HAS_EXTRA:
        if s >= main_nsplit:
            cache = extra_ptr.to(tl.pointer_type(tl.uint8))
            idx_row = extra_idx_ptr + t64 * extra_idx_st
            P = extra_P
            PB = extra_PB.to(tl.int64)
            PB2 = extra_PB2.to(tl.int64)
            start = (s - main_nsplit) * extra_chunk
            end = tl.minimum(start + extra_chunk, extra_K)
            if HAS_EXTRA_LEN:
                end = tl.minimum(end, tl.load(extra_len_ptr + t))
    return cache, idx_row, P, PB, PB2, start, end


@triton.jit
def _flat_kv(cache, cache_bf16, idx, inb, P, PB, PB2, tiles, lanes, offs_r, BLOCK_N: tl.constexpr,
             INTERP: tl.constexpr):
    # one candidate block: (valid, page, offset in page, raw nope bytes [BLOCK_N, 8, 64] (tile 7, the rope
    # region, masked), the nope part dequantized to bf16 [BLOCK_N, 512] and the rope part [BLOCK_N, 64] as MMA
    # operands (_mma_operand))
    valid = inb & (idx >= 0)
    idx64 = tl.maximum(idx, 0).to(tl.int64)
    page = idx64 // P
    off = idx64 - page * P
    row = page * PB + off * 576
    nope_ptr = cache + row[:, None, None] + (tiles[None, :, None] * 64 + lanes[None, None, :])
    nmask = valid[:, None, None] & (tiles[None, :, None] < 7)
    nope_b = tl.load(nope_ptr, mask=nmask, other=0)
    sc_ptr = cache + (page * PB + P * 576 + off * 8)[:, None] + tiles[None, :]
    sc_b = tl.load(sc_ptr, mask=valid[:, None] & (tiles[None, :] < 7), other=127)
    scale = tl.exp2(sc_b.to(tl.float32) - 127.0)
    nope_f = nope_b.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]
    kv = tl.reshape(nope_f, [BLOCK_N, 512]).to(tl.bfloat16)
    rope = tl.load(
        cache_bf16 + (page * PB2 + off * 288 + 224)[:, None] + offs_r[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    return valid, page, off, nope_b, _mma_operand(kv, INTERP), _mma_operand(rope, INTERP)


@triton.jit
def split_kernel_flat(
    q_ptr, stride_qt, stride_qh,
    main_ptr, main_idx_ptr, main_idx_st, main_len_ptr, main_K, main_P, main_PB, main_PB2, main_nsplit, main_chunk,
    extra_ptr, extra_idx_ptr, extra_idx_st, extra_len_ptr, extra_K, extra_P, extra_PB, extra_PB2, extra_chunk,
    acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
    HAS_MAIN_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_EXTRA_LEN: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FP8_QK: tl.constexpr, INTERP: tl.constexpr,
):
    """Split kernel, flat body: grid ``(T, S, HG)``; program ``(t, s, g)`` takes the heads ``g*BLOCK_H ..`` of
    row ``t`` (padded to ``BLOCK_H`` with masks: the heads are the M dimension of the MMA) and the ``s``-th
    chunk of that row's candidates (main cache chunks first, then the extra cache's). Each block dequantizes a
    ``[BLOCK_N, 512]`` bf16 tile (exact: power-of-two scales) and runs 512-wide dots; the un-normalized partial
    ``acc`` and its ``(m, l)`` (online softmax, base 2) go to the workspace row ``(t*S + s)*HP + h``."""
    t = tl.program_id(0)
    s = tl.program_id(1)
    g = tl.program_id(2)
    t64 = t.to(tl.int64)
    cache, idx_row, P, PB, PB2, start, end = _flat_range(
        s, t, t64, main_ptr, main_idx_ptr, main_idx_st, main_len_ptr, main_K, main_P, main_PB, main_PB2, main_nsplit,
        main_chunk, extra_ptr, extra_idx_ptr, extra_idx_st, extra_len_ptr, extra_K, extra_P, extra_PB, extra_PB2,
        extra_chunk, HAS_MAIN_LEN, HAS_EXTRA, HAS_EXTRA_LEN)
    cache_bf16 = cache.to(tl.pointer_type(tl.bfloat16))

    # ---- Q tile: heads on M, padded with masks
    offs_h = g * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    offs_d = tl.arange(0, 512)
    offs_r = tl.arange(0, 64)
    q_row = q_ptr + t64 * stride_qt + offs_h[:, None].to(tl.int64) * stride_qh
    q_nope = tl.load(q_row + offs_d[None, :], mask=hmask[:, None] & (offs_d[None, :] < 448), other=0.0)
    q_rope = tl.load(q_row + 448 + offs_r[None, :], mask=hmask[:, None], other=0.0)
    if FP8_QK:
        # per-32 UE8M0 quantization of q_nope to e4m3 (groups 14, 15 are the zero padding)
        q8, q_sc = _q_mx_quantize(q_nope, BLOCK_H, 16, INTERP)
    q_nope_op = _mma_operand(q_nope, INTERP)
    q_rope_op = _mma_operand(q_rope, INTERP)

    m_i, l_i = _softmax_init(BLOCK_H)
    acc = tl.zeros([BLOCK_H, 512], tl.float32)
    acc_r = tl.zeros([BLOCK_H, 64], tl.float32)

    offs_n = tl.arange(0, BLOCK_N)
    tiles = tl.arange(0, 8)
    lanes = tl.arange(0, 64)
    for n0 in range(start, end, BLOCK_N):
        cand = n0 + offs_n
        inb = cand < end
        idx = tl.load(idx_row + cand, mask=inb, other=-1)
        valid, page, off, nope_b, kv_op, rope_op = _flat_kv(cache, cache_bf16, idx, inb, P, PB, PB2, tiles, lanes,
                                                            offs_r, BLOCK_N, INTERP)
        if FP8_QK:
            k8 = tl.reshape(nope_b, [BLOCK_N, 512]).to(tl.float8e4nv, bitcast=True)
            g32 = tl.arange(0, 16)
            ks = tl.load(
                cache + (page * PB + P * 576 + off * 8)[:, None] + (g32 // 2)[None, :],
                mask=valid[:, None] & (g32[None, :] < 14),
                other=127,
            )
            qk = tl.dot_scaled(q8, q_sc, "e4m3", tl.trans(k8), ks, "e4m3")
        else:
            qk = tl.dot(q_nope_op, tl.trans(kv_op))
        qk = qk + tl.dot(q_rope_op, tl.trans(rope_op))
        p, alpha, m_i, l_i = _online_softmax(qk, valid, m_i, l_i, sm_scale_log2)
        p_op = _mma_operand(p.to(tl.bfloat16), INTERP)
        acc = acc * alpha[:, None] + tl.dot(p_op, kv_op)
        acc_r = acc_r * alpha[:, None] + tl.dot(p_op, rope_op)

    # ---- partial results: [T, S, HP, 512] / [T, S, HP]
    base = (t64 * S + s) * HP + offs_h
    tl.store(acc_ws + base[:, None] * 512 + offs_d[None, :], acc, mask=hmask[:, None] & (offs_d[None, :] < 448))
    tl.store(acc_ws + base[:, None] * 512 + 448 + offs_r[None, :], acc_r, mask=hmask[:, None])
    _store_softmax_state(m_ws, l_ws, base, hmask, m_i, l_i)
