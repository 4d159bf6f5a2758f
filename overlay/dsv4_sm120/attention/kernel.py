"""Tensor-core sparse MLA decode for DeepSeek-V4 (FP8 V4 paged KV cache), written in Triton.

Two kernels:

1. ``_dsv4_split_kernel``: grid ``(T, S, HG)``. Program ``(t, s, g)`` takes the heads
   ``g*BLOCK_H ..`` of row ``t`` (padded up to ``BLOCK_H >= 16`` with masks: the heads are the
   M dimension of the tensor-core MMA) and the ``s``-th chunk of that row's candidates, where the
   chunks of the main cache come first and those of the extra (c4 / c128) cache after. It gathers
   the candidate tokens straight from their pages (any page size; ``stride(0)`` = page bytes),
   dequantizes the FP8 nope part with the UE8M0 tile scales, keeps rope in bf16, and runs an
   online softmax (base 2). It writes the un-normalized partial ``acc`` and its ``(m, l)``.
   QK runs either as bf16 ``tl.dot`` (nope dequantized to bf16, exact) or, for sm_120, as
   ``tl.dot_scaled`` e4m3 x e4m3 with UE8M0 scales (Q quantized per 32 values, once per row and head by
   ``_q_fp8_kernel`` before the tiled launch, K used as stored) plus a bf16 dot for rope. PV is always
   a bf16 dot (the V scales run along the candidate axis, which block-scaled MMA cannot express).
2. ``_dsv4_combine_kernel``: grid ``(T, cdiv(H, BLOCK_HC), 512 / BLOCK_D)``: merges the ``S``
   partials (online, ``BLOCK_S`` per unrolled step, the reduction inside each thread) and the
   sink, writes bf16 ``out`` and the natural-log ``lse`` without the sink; rows with no valid
   candidate get zeros and ``lse = -inf`` (as SGLang's torch reference).

No host synchronization, no data-dependent shapes: the split plan depends only on the shapes and
the SM count, the workspace is a grow-only per-device buffer, so the call can be captured in a
CUDA graph.
"""

from __future__ import annotations

import os
from typing import Dict, Tuple

import torch
import triton
import triton.language as tl

from . import launch_config

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# e4m3 -> bf16 on the integer pipes (KCVT=1). Triton's cast is one packed e4m3x2 -> f16x2 conversion
# plus one f16 -> bf16 conversion per value, all on the conversion pipe (16 results per SM per clock on
# sm_90; 336 per thread per 64-candidate block in the tiled body, the largest single cost of its loop).
# Here: a byte ``s eeee mmm`` moved to bf16 bits 15 (sign) and 10..4 (eeee mmm) is a bf16 equal to its
# e4m3 value times 2^-120 (eeee = 0 lands on the bf16 subnormals, also exact); one bf16x2 multiply by
# 2^120 gives the value, exactly, for all 254 finite codes (0x7F / 0xFF, e4m3 NaN, give +-480: the KV
# cache never holds them). Four values per 32-bit input: 2 PRMT, 2 SHF, 6 LOP3, 2 HFMA2.
_E4M3_BF16_ASM = tl.constexpr("""
{
.reg .b32 z, x, a, b, s, nz;
mov.b32 z, 0;
mov.b32 s, 0x7B807B80;
mov.b32 nz, 0x80008000;
prmt.b32 x, $2, z, 0x1404;
shr.b32 a, x, 4;
and.b32 a, a, 0x07F007F0;
and.b32 b, x, 0x80008000;
or.b32 a, a, b;
fma.rn.bf16x2 $0, a, s, nz;
prmt.b32 x, $2, z, 0x3424;
shr.b32 a, x, 4;
and.b32 a, a, 0x07F007F0;
and.b32 b, x, 0x80008000;
or.b32 a, a, b;
fma.rn.bf16x2 $1, a, s, nz;
}
""")


@triton.jit
def _e4m3_bf16(k8, KCVT: tl.constexpr):
    """uint8 tensor of e4m3 codes -> bfloat16 values (exact). KCVT: integer-pipe bit moves (inline PTX;
    needs >= 4 consecutive values per thread) instead of Triton's conversion-pipe cast."""
    if KCVT:
        return tl.inline_asm_elementwise(_E4M3_BF16_ASM, "=r,=r,r", [k8], dtype=tl.bfloat16, is_pure=True,
                                         pack=4)
    return k8.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)


@triton.jit
def _round_to_e4m3_grid(x):
    # Triton's CPU interpreter converts fp32 -> e4m3 without carrying a mantissa round-up into the
    # exponent (126.0 -> 64.0); round onto the e4m3 grid first so its conversion is exact there.
    ax = tl.abs(x)
    e = tl.floor(tl.log2(tl.maximum(ax, 2.0 ** -6)))
    ulp = tl.exp2(e - 3.0)
    r = x / ulp
    fl = tl.floor(r)
    frac = r - fl
    odd = (fl - 2.0 * tl.floor(fl * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)  # round half to even, as the hardware does
    return tl.where(up, fl + 1.0, fl) * ulp


@triton.jit
def _dsv4_split_kernel(
    q_ptr,
    stride_qt,
    stride_qh,
    main_ptr,
    main_idx_ptr,
    main_idx_st,
    main_len_ptr,
    main_K,
    main_P,
    main_PB,
    main_PB2,
    main_nsplit,
    main_chunk,
    extra_ptr,
    extra_idx_ptr,
    extra_idx_st,
    extra_len_ptr,
    extra_K,
    extra_P,
    extra_PB,
    extra_PB2,
    extra_chunk,
    acc_ws,
    m_ws,
    l_ws,
    H,
    S,
    HP,
    sm_scale_log2,
    HAS_MAIN_LEN: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    HAS_EXTRA_LEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8_QK: tl.constexpr,
    INTERP: tl.constexpr,
    QK_SWAP: tl.constexpr,
    Q_RELOAD: tl.constexpr,
    DEQ_BF16: tl.constexpr,
):
    t = tl.program_id(0)
    s = tl.program_id(1)
    g = tl.program_id(2)
    t64 = t.to(tl.int64)

    # ---- which cache and which candidate range this program owns
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
        # per-32 UE8M0 quantization of q_nope to e4m3
        qf = tl.reshape(q_nope.to(tl.float32), [BLOCK_H, 16, 32])
        amax = tl.max(tl.abs(qf), axis=2)
        qexp = tl.ceil(tl.log2(tl.maximum(amax, 1e-30) / 448.0))
        qexp = tl.minimum(tl.maximum(qexp, -126.0), 127.0)
        qs = qf * tl.exp2(-qexp)[:, :, None]
        if INTERP:
            qs = _round_to_e4m3_grid(qs)
        q8 = qs.to(tl.float8e4nv)
        q8 = tl.reshape(q8, [BLOCK_H, 512])
        q_sc = (qexp + 127.0).to(tl.uint8)
    if INTERP:
        q_nope_op = q_nope.to(tl.float32)
        q_rope_op = q_rope.to(tl.float32)
    else:
        q_nope_op = q_nope
        q_rope_op = q_rope

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, 512], tl.float32)
    acc_r = tl.zeros([BLOCK_H, 64], tl.float32)

    offs_n = tl.arange(0, BLOCK_N)
    tiles = tl.arange(0, 8)
    lanes = tl.arange(0, 64)
    for n0 in range(start, end, BLOCK_N):
        cand = n0 + offs_n
        inb = cand < end
        idx = tl.load(idx_row + cand, mask=inb, other=-1)
        valid = inb & (idx >= 0)
        idx64 = tl.maximum(idx, 0).to(tl.int64)
        page = idx64 // P
        off = idx64 - page * P
        row = page * PB + off * 576
        # nope: [BLOCK_N, 8, 64] bytes, tile 7 masked (it is the rope region)
        nope_ptr = cache + row[:, None, None] + (tiles[None, :, None] * 64 + lanes[None, None, :])
        nmask = valid[:, None, None] & (tiles[None, :, None] < 7)
        nope_b = tl.load(nope_ptr, mask=nmask, other=0)
        sc_ptr = cache + (page * PB + P * 576 + off * 8)[:, None] + tiles[None, :]
        sc_b = tl.load(sc_ptr, mask=valid[:, None] & (tiles[None, :] < 7), other=127)
        scale = tl.exp2(sc_b.to(tl.float32) - 127.0)
        if DEQ_BF16 and not INTERP:  # (the interpreter mis-converts fp8 -> bf16)
            # power-of-two scales: the bf16 product is exact (no fp32 tile in registers)
            nope_h = nope_b.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16) * scale.to(tl.bfloat16)[:, :, None]
            kv = tl.reshape(nope_h, [BLOCK_N, 512])
        else:
            nope_f = nope_b.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]
            kv = tl.reshape(nope_f, [BLOCK_N, 512]).to(tl.bfloat16)
        rope = tl.load(
            cache_bf16 + (page * PB2 + off * 288 + 224)[:, None] + offs_r[None, :],
            mask=valid[:, None],
            other=0.0,
        )
        if INTERP:
            kv_op = kv.to(tl.float32)
            rope_op = rope.to(tl.float32)
        else:
            kv_op = kv
            rope_op = rope
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
            if Q_RELOAD:
                # re-read q (L1-resident) each block so its MMA operand is not pinned in registers
                qn = tl.load(q_row + offs_d[None, :], mask=hmask[:, None] & (offs_d[None, :] < 448), other=0.0)
                if INTERP:
                    qn = qn.to(tl.float32)
            else:
                qn = q_nope_op
            if QK_SWAP:
                qk = tl.trans(tl.dot(kv_op, tl.trans(qn)))
            else:
                qk = tl.dot(qn, tl.trans(kv_op))
        if QK_SWAP:
            qk = qk + tl.trans(tl.dot(rope_op, tl.trans(q_rope_op)))
        else:
            qk = qk + tl.dot(q_rope_op, tl.trans(rope_op))
        qk = qk * sm_scale_log2
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if INTERP:
            p_op = p.to(tl.bfloat16).to(tl.float32)
        else:
            p_op = p.to(tl.bfloat16)
        acc = acc * alpha[:, None] + tl.dot(p_op, kv_op)
        acc_r = acc_r * alpha[:, None] + tl.dot(p_op, rope_op)
        m_i = m_new

    # ---- partial results: [T, S, HP, 512] / [T, S, HP]
    base = (t64 * S + s) * HP + offs_h
    tl.store(acc_ws + base[:, None] * 512 + offs_d[None, :], acc, mask=hmask[:, None] & (offs_d[None, :] < 448))
    tl.store(acc_ws + base[:, None] * 512 + 448 + offs_r[None, :], acc_r, mask=hmask[:, None])
    tl.store(m_ws + base, m_i, mask=hmask)
    tl.store(l_ws + base, l_i, mask=hmask)


@triton.jit
def _token_rows(idx, inb, P, PB64, PB2_64):
    """Page addressing of a block of candidates: (valid, byte offset of each token's 576-byte row,
    byte offset of its 8 UE8M0 scales, bf16-element offset of its rope part). 32-bit division (slot
    ids fit in int32), 64-bit byte offsets after."""
    valid = inb & (idx >= 0)
    idx32 = tl.maximum(idx, 0)
    page32 = idx32 // P
    off = (idx32 - page32 * P).to(tl.int64)
    page = page32.to(tl.int64)
    return valid, page * PB64 + off * 576, page * PB64 + P * 576 + off * 8, page * PB2_64 + off * 288 + 224


@triton.jit
def _k_tile(cache, row, valid, t: tl.constexpr, lanes):
    # raw e4m3 bytes of nope tile t of BLOCK_N tokens: [BLOCK_N, 64] uint8
    return tl.load(cache + row[:, None] + t * 64 + lanes[None, :], mask=valid[:, None], other=0)


@triton.jit
def _k_tile_again(cache, row, valid, t: tl.constexpr, lanes):
    # the same bytes re-read for PV (an L1 hit): a different cache modifier keeps the compiler from
    # merging it with the QK read, so the seven tiles are not all live across the softmax
    return tl.load(cache + row[:, None] + t * 64 + lanes[None, :], mask=valid[:, None], other=0,
                   cache_modifier=".ca")


@triton.jit
def _k_scale(cache, sbase, valid, t: tl.constexpr):
    # UE8M0 byte of nope tile t: [BLOCK_N] uint8 (127 = 1.0 for masked tokens)
    return tl.load(cache + sbase + t, mask=valid, other=127)


@triton.jit
def _ue8m0(ksc, KCVT: tl.constexpr):
    # UE8M0 byte -> 2^(byte - 127) as fp32. KCVT: the byte shifted into the fp32 exponent field (one integer
    # op; byte 0, 2^-127, becomes 0 and 255 becomes +inf instead of NaN: neither is a real KV tile scale);
    # else int -> float, subtract, MUFU exp2 (conversion and special-function pipes).
    if KCVT:
        return (ksc.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return tl.exp2(ksc.to(tl.float32) - 127.0)


@triton.jit
def _q_fp8_tile(qt, BLOCK_H: tl.constexpr, INTERP: tl.constexpr):
    # a [BLOCK_H, 64] q tile -> (e4m3 values, UE8M0 scale per 32 values [BLOCK_H, 2]): the MX quantization
    # of the fp8 QK path (reference.quantize_q_mx)
    qf = tl.reshape(qt.to(tl.float32), [BLOCK_H, 2, 32])
    amax = tl.max(tl.abs(qf), axis=2)
    qexp = tl.ceil(tl.log2(tl.maximum(amax, 1e-30) / 448.0))
    qexp = tl.minimum(tl.maximum(qexp, -126.0), 127.0)
    qs = qf * tl.exp2(-qexp)[:, :, None]
    if INTERP:
        qs = _round_to_e4m3_grid(qs)
    return tl.reshape(qs.to(tl.float8e4nv), [BLOCK_H, 64]), (qexp + 127.0).to(tl.uint8)


@triton.jit
def _q_fp8_kernel(q_ptr, stride_qt, stride_qh, q8_ptr, qsc_ptr, H, HP,
                  BLOCK_H: tl.constexpr, INTERP: tl.constexpr):
    """QPRE: the fp8 QK path's Q quantization done once per (row, head) instead of once per candidate block:
    ``q8 [T, HP, 448]`` e4m3 bytes and ``qsc [T, HP, 14]`` UE8M0 (one per 32 dims), same function
    (``_q_fp8_tile``) as the in-loop form, so the split kernel sees identical operands."""
    t64 = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    lanes = tl.arange(0, 64)
    q_row = q_ptr + t64 * stride_qt + offs_h[:, None].to(tl.int64) * stride_qh
    o_row = (t64 * HP + offs_h)[:, None]
    for tile in tl.static_range(7):
        qt = tl.load(q_row + tile * 64 + lanes[None, :], mask=hmask[:, None], other=0.0)
        q8, q_sc = _q_fp8_tile(qt, BLOCK_H, INTERP)
        tl.store(q8_ptr + o_row * 448 + tile * 64 + lanes[None, :], q8.to(tl.uint8, bitcast=True),
                 mask=hmask[:, None])
        tl.store(qsc_ptr + o_row * 14 + tile * 2 + tl.arange(0, 2)[None, :], q_sc, mask=hmask[:, None])


@triton.jit
def _qk_tile(q_row, hmask, k8, ksc, t: tl.constexpr, lanes, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
             FP8_QK: tl.constexpr, INTERP: tl.constexpr, KCVT: tl.constexpr = False, QPRE: tl.constexpr = False,
             q8_row=None, qsc_row=None):
    # q_h . k_n over nope tile t, K scale included: [BLOCK_H, BLOCK_N] fp32
    # volatile: keep the compiler from hoisting the seven q tiles out of the candidate loop, where
    # they would pin 16x512 bf16 per warp (128 registers per thread) for the whole loop
    if FP8_QK and QPRE:
        # Q quantized before the launch (_q_fp8_kernel): load the e4m3 tile and its scales
        q8 = tl.load(q8_row + t * 64 + lanes[None, :], mask=hmask[:, None], other=0, volatile=True)
        q8 = q8.to(tl.float8e4nv, bitcast=True)
        q_sc = tl.load(qsc_row + t * 2 + tl.arange(0, 2)[None, :], mask=hmask[:, None], other=127, volatile=True)
        k_sc = tl.broadcast_to(ksc[:, None], [BLOCK_N, 2])
        return tl.dot_scaled(q8, q_sc, "e4m3", tl.trans(k8.to(tl.float8e4nv, bitcast=True)), k_sc, "e4m3")
    qt = tl.load(q_row + t * 64 + lanes[None, :], mask=hmask[:, None], other=0.0, volatile=True)
    if FP8_QK:
        q8, q_sc = _q_fp8_tile(qt, BLOCK_H, INTERP)
        k_sc = tl.broadcast_to(ksc[:, None], [BLOCK_N, 2])
        return tl.dot_scaled(q8, q_sc, "e4m3", tl.trans(k8.to(tl.float8e4nv, bitcast=True)), k_sc, "e4m3")
    else:
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
def _tiled_body(
    q_ptr, stride_qt, stride_qh, t, s, g,
    cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk,
    acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
    HAS_LEN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FP8_QK: tl.constexpr,
    INTERP: tl.constexpr, PREFETCH: tl.constexpr, KCVT: tl.constexpr = False, QPRE: tl.constexpr = False,
    q8_ptr=None, qsc_ptr=None,
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
    if QPRE:
        q8_row = q8_ptr + (t64 * HP + offs_h)[:, None] * 448
        qsc_row = qsc_ptr + (t64 * HP + offs_h)[:, None] * 14
    q_rope = tl.load(q_row + 448 + lanes[None, :], mask=hmask[:, None], other=0.0)
    if INTERP:
        q_rope = q_rope.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc1 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc2 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc3 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc4 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc5 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc6 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc_r = tl.zeros([BLOCK_H, 64], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    if PREFETCH:
        # the first block's indices are read without waiting for the row length, and each block
        # reads the next block's indices before its own gathers: one dependent round trip less
        idx_next = tl.load(idx_row + start + offs_n, mask=start + offs_n < cend, other=-1)
    if PREFETCH == 2:
        # PREFETCH=2: the next block's UE8M0 scale bytes too (byte loads cannot be staged by cp.async,
        # so read in the block itself they wait a full memory round trip)
        vf, _r, sbf, _o = _token_rows(idx_next, start + offs_n < end, P, PB64, PB2_64)
        n0s = _k_scale(cache, sbf, vf, 0)
        n1s = _k_scale(cache, sbf, vf, 1)
        n2s = _k_scale(cache, sbf, vf, 2)
        n3s = _k_scale(cache, sbf, vf, 3)
        n4s = _k_scale(cache, sbf, vf, 4)
        n5s = _k_scale(cache, sbf, vf, 5)
        n6s = _k_scale(cache, sbf, vf, 6)
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
            n0s = _k_scale(cache, sbn, vn, 0)
            n1s = _k_scale(cache, sbn, vn, 1)
            n2s = _k_scale(cache, sbn, vn, 2)
            n3s = _k_scale(cache, sbn, vn, 3)
            n4s = _k_scale(cache, sbn, vn, 4)
            n5s = _k_scale(cache, sbn, vn, 5)
            n6s = _k_scale(cache, sbn, vn, 6)
        rope = tl.load(cache_bf16 + rope_off[:, None] + lanes[None, :],
                       mask=valid[:, None], other=0.0)
        if INTERP:
            rope = rope.to(tl.float32)
        k0 = _k_tile(cache, row, valid, 0, lanes)
        k1 = _k_tile(cache, row, valid, 1, lanes)
        k2 = _k_tile(cache, row, valid, 2, lanes)
        k3 = _k_tile(cache, row, valid, 3, lanes)
        k4 = _k_tile(cache, row, valid, 4, lanes)
        k5 = _k_tile(cache, row, valid, 5, lanes)
        k6 = _k_tile(cache, row, valid, 6, lanes)
        if PREFETCH != 2:
            c0 = _k_scale(cache, sbase, valid, 0)
            c1 = _k_scale(cache, sbase, valid, 1)
            c2 = _k_scale(cache, sbase, valid, 2)
            c3 = _k_scale(cache, sbase, valid, 3)
            c4 = _k_scale(cache, sbase, valid, 4)
            c5 = _k_scale(cache, sbase, valid, 5)
            c6 = _k_scale(cache, sbase, valid, 6)
        qk = tl.dot(q_rope, tl.trans(rope))
        qk += _qk_tile(q_row, hmask, k0, c0, 0, lanes, BLOCK_H, BLOCK_N, FP8_QK, INTERP, KCVT, QPRE,
                       q8_row, qsc_row)
        qk += _qk_tile(q_row, hmask, k1, c1, 1, lanes, BLOCK_H, BLOCK_N, FP8_QK, INTERP, KCVT, QPRE,
                       q8_row, qsc_row)
        qk += _qk_tile(q_row, hmask, k2, c2, 2, lanes, BLOCK_H, BLOCK_N, FP8_QK, INTERP, KCVT, QPRE,
                       q8_row, qsc_row)
        qk += _qk_tile(q_row, hmask, k3, c3, 3, lanes, BLOCK_H, BLOCK_N, FP8_QK, INTERP, KCVT, QPRE,
                       q8_row, qsc_row)
        qk += _qk_tile(q_row, hmask, k4, c4, 4, lanes, BLOCK_H, BLOCK_N, FP8_QK, INTERP, KCVT, QPRE,
                       q8_row, qsc_row)
        qk += _qk_tile(q_row, hmask, k5, c5, 5, lanes, BLOCK_H, BLOCK_N, FP8_QK, INTERP, KCVT, QPRE,
                       q8_row, qsc_row)
        qk += _qk_tile(q_row, hmask, k6, c6, 6, lanes, BLOCK_H, BLOCK_N, FP8_QK, INTERP, KCVT, QPRE,
                       q8_row, qsc_row)
        qk = qk * sm_scale_log2
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        a2 = alpha[:, None]
        if INTERP:
            acc_r = acc_r * a2 + tl.dot(p.to(tl.bfloat16).to(tl.float32), rope)
        else:
            acc_r = acc_r * a2 + tl.dot(p.to(tl.bfloat16), rope)
        acc0 = _pv_tile(acc0 * a2, p, _k_tile_again(cache, row, valid, 0, lanes), c0, INTERP, KCVT)
        acc1 = _pv_tile(acc1 * a2, p, _k_tile_again(cache, row, valid, 1, lanes), c1, INTERP, KCVT)
        acc2 = _pv_tile(acc2 * a2, p, _k_tile_again(cache, row, valid, 2, lanes), c2, INTERP, KCVT)
        acc3 = _pv_tile(acc3 * a2, p, _k_tile_again(cache, row, valid, 3, lanes), c3, INTERP, KCVT)
        acc4 = _pv_tile(acc4 * a2, p, _k_tile_again(cache, row, valid, 4, lanes), c4, INTERP, KCVT)
        acc5 = _pv_tile(acc5 * a2, p, _k_tile_again(cache, row, valid, 5, lanes), c5, INTERP, KCVT)
        acc6 = _pv_tile(acc6 * a2, p, _k_tile_again(cache, row, valid, 6, lanes), c6, INTERP, KCVT)
        m_i = m_new

    base = (t64 * S + s) * HP + offs_h
    _store_partial(acc_ws, base, hmask, lanes, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc_r)
    tl.store(m_ws + base, m_i, mask=hmask)
    tl.store(l_ws + base, l_i, mask=hmask)


@triton.jit
def _store_partial(acc_ws, base, hmask, lanes, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc_r):
    optr = acc_ws + base[:, None] * 512 + lanes[None, :]
    hm = hmask[:, None]
    # the stores cast to the workspace's type: fp32, or bf16 with PART_BF16 (un-normalized partial,
    # fp32 range, 2^-9 relative: below the output's own bf16 rounding after the weighted merge)
    tl.store(optr, acc0, mask=hm)
    tl.store(optr + 64, acc1, mask=hm)
    tl.store(optr + 128, acc2, mask=hm)
    tl.store(optr + 192, acc3, mask=hm)
    tl.store(optr + 256, acc4, mask=hm)
    tl.store(optr + 320, acc5, mask=hm)
    tl.store(optr + 384, acc6, mask=hm)
    tl.store(optr + 448, acc_r, mask=hm)


@triton.jit
def _raw_block(cache, row, valid, sbase, rope_off, lanes):
    # one candidate block as stored: the seven e4m3 nope tiles, their UE8M0 scales, then the bf16 rope tile
    k0 = _k_tile(cache, row, valid, 0, lanes)
    k1 = _k_tile(cache, row, valid, 1, lanes)
    k2 = _k_tile(cache, row, valid, 2, lanes)
    k3 = _k_tile(cache, row, valid, 3, lanes)
    k4 = _k_tile(cache, row, valid, 4, lanes)
    k5 = _k_tile(cache, row, valid, 5, lanes)
    k6 = _k_tile(cache, row, valid, 6, lanes)
    c0 = _k_scale(cache, sbase, valid, 0)
    c1 = _k_scale(cache, sbase, valid, 1)
    c2 = _k_scale(cache, sbase, valid, 2)
    c3 = _k_scale(cache, sbase, valid, 3)
    c4 = _k_scale(cache, sbase, valid, 4)
    c5 = _k_scale(cache, sbase, valid, 5)
    c6 = _k_scale(cache, sbase, valid, 6)
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
    kr = rope
    if INTERP:
        kr = rope.to(tl.float32)
    return (_kdec(k0, c0, INTERP, KCVT), _kdec(k1, c1, INTERP, KCVT), _kdec(k2, c2, INTERP, KCVT),
            _kdec(k3, c3, INTERP, KCVT), _kdec(k4, c4, INTERP, KCVT), _kdec(k5, c5, INTERP, KCVT),
            _kdec(k6, c6, INTERP, KCVT), kr)


@triton.jit
def _reg_body(
    q_ptr, stride_qt, stride_qh, t, s, g,
    cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk,
    acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
    HAS_LEN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    INTERP: tl.constexpr, KCVT: tl.constexpr, Q_RES: tl.constexpr = False, DEC_LATE: tl.constexpr = False,
    SPAN: tl.constexpr = False, cache2=None, idx2_ptr=None, idx2_st=0, len2_ptr=None, K2=0, P2=1, PB_2=0, PB2_2=0,
    HAS_LEN2: tl.constexpr = False, HAS_2: tl.constexpr = False,
):
    # Register body (impl=reg, bf16 QK): every K byte is read from memory once and decoded once per block.
    # The next block's raw tiles (7 e4m3 tiles, rope, scales) are loaded into registers while the current
    # block computes (its indices two blocks ahead, so the gathers never wait on an index load), the current
    # tiles are decoded with their scale folded in (exact) and serve as K^T for QK and as V for PV, so P is
    # one bf16 A operand for all eight PV products. No cp.async staging: on the H200 the pipelined tiled body
    # staged each tile twice (QK and the PV re-read) and read the PV copy back one byte per instruction
    # (ncu, call 15: 112 LDS.U8 per thread and block; 21% of the stall samples on the LSU queue).
    # SPAN: the program owns candidates [start, start + chunk) of the concatenated list main ++ extra (cache2),
    # so one split may run through the end of the main cache into the extra one (even work per program).
    t64 = t.to(tl.int64)
    offs_h = g * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    lanes = tl.arange(0, 64)
    q_row = q_ptr + t64 * stride_qt + offs_h[:, None].to(tl.int64) * stride_qh
    q_rope = tl.load(q_row + 448 + lanes[None, :], mask=hmask[:, None], other=0.0)
    if INTERP:
        q_rope = q_rope.to(tl.float32)
    if Q_RES:
        # Q read once: Triton keeps loop-invariant dot operands in shared memory (one store before the loop,
        # ldmatrix per block) instead of a global re-read + store + barrier per tile and block
        q0 = _q_tile(q_row, hmask, 0, lanes, INTERP, False)
        q1 = _q_tile(q_row, hmask, 1, lanes, INTERP, False)
        q2 = _q_tile(q_row, hmask, 2, lanes, INTERP, False)
        q3 = _q_tile(q_row, hmask, 3, lanes, INTERP, False)
        q4 = _q_tile(q_row, hmask, 4, lanes, INTERP, False)
        q5 = _q_tile(q_row, hmask, 5, lanes, INTERP, False)
        q6 = _q_tile(q_row, hmask, 6, lanes, INTERP, False)
    else:
        q0, q1, q2, q3, q4, q5, q6 = q_rope, q_rope, q_rope, q_rope, q_rope, q_rope, q_rope  # unused
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc1 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc2 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc3 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc4 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc5 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc6 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc_r = tl.zeros([BLOCK_H, 64], tl.float32)
    if SPAN:
        # the main cache's part of [start, start + chunk), then the extra cache's; a part that is empty is
        # skipped (its prologue would still cost a masked block: ~1 us per program at B = 1, H200 call 22)
        if start < K:
            m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc_r = _reg_segment(
                q_row, hmask, q_rope, q0, q1, q2, q3, q4, q5, q6, m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5,
                acc6, acc_r, t, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk,
                sm_scale_log2, HAS_LEN, BLOCK_N, INTERP, KCVT, Q_RES, DEC_LATE)
        if HAS_2:
            if start + chunk > K:
                lo2 = tl.maximum(start - K, 0)
                m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc_r = _reg_segment(
                    q_row, hmask, q_rope, q0, q1, q2, q3, q4, q5, q6, m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5,
                    acc6, acc_r, t, cache2, idx2_ptr, idx2_st, len2_ptr, K2, P2, PB_2, PB2_2, lo2,
                    start + chunk - K - lo2, sm_scale_log2, HAS_LEN2, BLOCK_N, INTERP, KCVT, Q_RES, DEC_LATE)
    else:
        m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc_r = _reg_segment(
            q_row, hmask, q_rope, q0, q1, q2, q3, q4, q5, q6, m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6,
            acc_r, t, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk,
            sm_scale_log2, HAS_LEN, BLOCK_N, INTERP, KCVT, Q_RES, DEC_LATE)

    base = (t64 * S + s) * HP + offs_h
    _store_partial(acc_ws, base, hmask, lanes, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc_r)
    tl.store(m_ws + base, m_i, mask=hmask)
    tl.store(l_ws + base, l_i, mask=hmask)


@triton.jit
def _reg_segment(
    q_row, hmask, q_rope, q0, q1, q2, q3, q4, q5, q6, m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc_r,
    t, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk, sm_scale_log2,
    HAS_LEN: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr, KCVT: tl.constexpr, Q_RES: tl.constexpr,
    DEC_LATE: tl.constexpr,
):
    # the register body's candidate loop over [start, start + chunk) of one cache (chunk <= 0: nothing), carrying
    # the online-softmax state (m_i, l_i, the eight accumulator tiles) in and out
    lanes = tl.arange(0, 64)
    idx_row = idx_ptr + t.to(tl.int64) * idx_st
    cend = tl.minimum(start + chunk, K)
    end = cend
    if HAS_LEN:
        end = tl.minimum(end, tl.load(len_ptr + t))
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
        if Q_RES:
            qk = tl.dot(q0, tl.trans(kb0), qk)
            qk = tl.dot(q1, tl.trans(kb1), qk)
            qk = tl.dot(q2, tl.trans(kb2), qk)
            qk = tl.dot(q3, tl.trans(kb3), qk)
            qk = tl.dot(q4, tl.trans(kb4), qk)
            qk = tl.dot(q5, tl.trans(kb5), qk)
            qk = tl.dot(q6, tl.trans(kb6), qk)
        else:
            # each tile read where it is used (volatile: not hoisted), as measured in calls 16-17
            qk = tl.dot(_q_tile(q_row, hmask, 0, lanes, INTERP, True), tl.trans(kb0), qk)
            qk = tl.dot(_q_tile(q_row, hmask, 1, lanes, INTERP, True), tl.trans(kb1), qk)
            qk = tl.dot(_q_tile(q_row, hmask, 2, lanes, INTERP, True), tl.trans(kb2), qk)
            qk = tl.dot(_q_tile(q_row, hmask, 3, lanes, INTERP, True), tl.trans(kb3), qk)
            qk = tl.dot(_q_tile(q_row, hmask, 4, lanes, INTERP, True), tl.trans(kb4), qk)
            qk = tl.dot(_q_tile(q_row, hmask, 5, lanes, INTERP, True), tl.trans(kb5), qk)
            qk = tl.dot(_q_tile(q_row, hmask, 6, lanes, INTERP, True), tl.trans(kb6), qk)
        qk = qk * sm_scale_log2
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        a2 = alpha[:, None]
        pb = p.to(tl.bfloat16)
        if INTERP:
            pb = pb.to(tl.float32)
        acc_r = tl.dot(pb, kr, acc_r * a2)
        acc0 = tl.dot(pb, kb0, acc0 * a2)
        acc1 = tl.dot(pb, kb1, acc1 * a2)
        acc2 = tl.dot(pb, kb2, acc2 * a2)
        acc3 = tl.dot(pb, kb3, acc3 * a2)
        acc4 = tl.dot(pb, kb4, acc4 * a2)
        acc5 = tl.dot(pb, kb5, acc5 * a2)
        acc6 = tl.dot(pb, kb6, acc6 * a2)
        m_i = m_new
        valid = vn
        if DEC_LATE:
            n0_, n1_, n2_, n3_, n4_, n5_, n6_, d0_, d1_, d2_, d3_, d4_, d5_, d6_, nr_ = nxt
            kb0, kb1, kb2, kb3, kb4, kb5, kb6, kr = _kdec_block(n0_, n1_, n2_, n3_, n4_, n5_, n6_, d0_, d1_, d2_,
                                                                d3_, d4_, d5_, d6_, nr_, INTERP, KCVT)
        else:
            k0, k1, k2, k3, k4, k5, k6, c0, c1, c2, c3, c4, c5, c6, rope = nxt

    return m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc_r


@triton.jit
def _q_tile(q_row, hmask, t: tl.constexpr, lanes, INTERP: tl.constexpr, VOLATILE: tl.constexpr):
    # q tile t [BLOCK_H, 64] bf16; VOLATILE: re-read every block (not hoisted out of the candidate loop)
    qt = tl.load(q_row + t * 64 + lanes[None, :], mask=hmask[:, None], other=0.0, volatile=VOLATILE)
    if INTERP:
        qt = qt.to(tl.float32)
    return qt


@triton.jit
def _dsv4_split_kernel_reg(
    q_ptr, stride_qt, stride_qh,
    main_ptr, main_idx_ptr, main_idx_st, main_len_ptr, main_K, main_P, main_PB, main_PB2, main_nsplit, main_chunk,
    extra_ptr, extra_idx_ptr, extra_idx_st, extra_len_ptr, extra_K, extra_P, extra_PB, extra_PB2, extra_chunk,
    acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
    HAS_MAIN_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_EXTRA_LEN: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FP8_QK: tl.constexpr, INTERP: tl.constexpr,
    KCVT: tl.constexpr = False, Q_RES: tl.constexpr = False, DEC_LATE: tl.constexpr = False,
    SPAN: tl.constexpr = False,
):
    """Same contract as _dsv4_split_kernel_tiled (bf16 QK only), with the register body (_reg_body). SPAN: the
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
                  HAS_MAIN_LEN, BLOCK_H, BLOCK_N, INTERP, KCVT, Q_RES, DEC_LATE,
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
                  HAS_EXTRA_LEN, BLOCK_H, BLOCK_N, INTERP, KCVT, Q_RES, DEC_LATE)
    else:
        _reg_body(q_ptr, stride_qt, stride_qh, t, s, g,
                  main_ptr.to(tl.pointer_type(tl.uint8)), main_idx_ptr, main_idx_st, main_len_ptr, main_K,
                  main_P, main_PB, main_PB2, s * main_chunk, main_chunk,
                  acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
                  HAS_MAIN_LEN, BLOCK_H, BLOCK_N, INTERP, KCVT, Q_RES, DEC_LATE)


@triton.jit
def _dsv4_split_kernel_tiled(
    q_ptr, stride_qt, stride_qh,
    main_ptr, main_idx_ptr, main_idx_st, main_len_ptr, main_K, main_P, main_PB, main_PB2, main_nsplit, main_chunk,
    extra_ptr, extra_idx_ptr, extra_idx_st, extra_len_ptr, extra_K, extra_P, extra_PB, extra_PB2, extra_chunk,
    acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
    HAS_MAIN_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_EXTRA_LEN: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FP8_QK: tl.constexpr, INTERP: tl.constexpr,
    PREFETCH: tl.constexpr = False, KCVT: tl.constexpr = False, QPRE: tl.constexpr = False, q8_ptr=None,
    qsc_ptr=None,
):
    """Same contract as _dsv4_split_kernel, but the nope part is processed in its seven 64-wide
    tiles: K/V tiles stay e4m3 bytes, converted straight to MMA operands, the UE8M0 scale is
    applied to the [heads, candidates] products (QK) and to P (PV), and seven [BLOCK_H, 64]
    accumulators replace the [BLOCK_H, 512] one."""
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
                    HAS_EXTRA_LEN, BLOCK_H, BLOCK_N, FP8_QK, INTERP, PREFETCH, KCVT, QPRE, q8_ptr, qsc_ptr)
    else:
        _tiled_body(q_ptr, stride_qt, stride_qh, t, s, g,
                    main_ptr.to(tl.pointer_type(tl.uint8)), main_idx_ptr, main_idx_st, main_len_ptr, main_K,
                    main_P, main_PB, main_PB2, s * main_chunk, main_chunk,
                    acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
                    HAS_MAIN_LEN, BLOCK_H, BLOCK_N, FP8_QK, INTERP, PREFETCH, KCVT, QPRE, q8_ptr, qsc_ptr)


@triton.jit
def _dsv4_combine_kernel(
    acc_ws,
    m_ws,
    l_ws,
    sink_ptr,
    out_ptr,
    lse_ptr,
    H,
    S,
    HP,
    HAS_SINK: tl.constexpr,
    BLOCK_HC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # grid (T, cdiv(H, BLOCK_HC), 512 // BLOCK_D): program (t, hb, db) owns columns db*BLOCK_D.. of
    # the heads hb*BLOCK_HC.. of row t, one head after the other. Per head, m / l of a split are
    # scalars (a per-head vector would get a layout of its own and a shared-memory conversion, with
    # barriers, at every step), and the S partials are merged online: a runtime loop over chunks of
    # BLOCK_S splits; per chunk, the BLOCK_S loads ([BLOCK_D] slices of partial rows, 4 fp32 per
    # thread at the default plan) are all issued first, then one rescale to the chunk's max and an
    # element-wise FMA per split: the S reduction stays inside each thread and a chunk costs one
    # memory round trip. A ragged last chunk is masked (masked loads issue no memory traffic).
    t = tl.program_id(0)
    hb = tl.program_id(1)
    db = tl.program_id(2)
    offs_d = db * BLOCK_D + tl.arange(0, BLOCK_D)
    h0 = hb * BLOCK_HC
    for hh in range(0, tl.minimum(BLOCK_HC, H - h0)):
        h = h0 + hh
        row0 = t.to(tl.int64) * S * HP + h  # workspace row of (t, split 0, h)
        m_run = tl.full([], float("-inf"), tl.float32)  # running max over the splits so far (base 2)
        l_run = tl.zeros([], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s0 in range(0, S, BLOCK_S):
            # all loads of the chunk first: ptxas does not hoist a split's loads above the previous
            # split's math, so interleaving them would cost one round trip per split
            ms = ()
            ls = ()
            parts = ()
            for i in tl.static_range(BLOCK_S):
                ok = s0 + i < S
                r = row0 + (s0 + i) * HP
                ms = ms + (tl.load(m_ws + r, mask=ok, other=float("-inf")),)
                ls = ls + (tl.load(l_ws + r, mask=ok, other=0.0),)
                parts = parts + (tl.load(acc_ws + r * 512 + offs_d, mask=ok, other=0.0),)
            m_cur = m_run
            for i in tl.static_range(BLOCK_S):
                m_cur = tl.maximum(m_cur, ms[i])
            m_use = tl.where(m_cur == float("-inf"), 0.0, m_cur)  # no candidate yet: any finite value
            alpha = tl.exp2(m_run - m_use)  # 0 while m_run is -inf (acc and l_run are 0 then)
            acc = acc * alpha
            l_run = l_run * alpha
            for i in tl.static_range(BLOCK_S):
                w = tl.exp2(ms[i] - m_use)
                l_run += ls[i] * w
                acc += parts[i].to(tl.float32) * w
            m_run = m_cur
        m_ref = tl.where(m_run == float("-inf"), 0.0, m_run)  # acc and l_run are scaled by 2^-m_ref
        denom = l_run
        if HAS_SINK:
            denom += tl.exp2(tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634 - m_ref)
        lonely = l_run == 0.0
        out = tl.where(lonely, 0.0, acc / tl.where(lonely, 1.0, denom))
        orow = t.to(tl.int64) * H + h
        tl.store(out_ptr + orow * 512 + offs_d, out.to(tl.bfloat16))
        if db == 0:
            lse = tl.where(lonely, float("-inf"), (m_ref + tl.log2(tl.where(lonely, 1.0, l_run))) * 0.6931471805599453)
            tl.store(lse_ptr + orow, lse)


# --------------------------------------------------------------------------------------------
# host side


class DecodeInputError(ValueError):
    """Bad arguments to ``sparse_mla_decode`` (shape, dtype, layout)."""


_BYTES_PER_TOKEN = 584
_SM_COUNT: Dict[int, int] = {}
_WORKSPACE: Dict[Tuple[str, int], torch.Tensor] = {}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


def _is_sm120(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] == 12


def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    """fp32 workspace for the partial results.

    Eager calls reuse one grow-only buffer per device. Under CUDA-graph capture the workspace is a
    fresh allocation from the graph's memory pool instead: a graph must never point into the shared
    eager buffer, which a later, larger eager call may replace (and free)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.empty(numel, dtype=torch.float32, device=device)
    key = (str(device), 0)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        _WORKSPACE.pop(key, None)
        with torch.inference_mode(False):
            buf = torch.empty(max(numel, 1 << 16), dtype=torch.float32, device=device)
        _WORKSPACE[key] = buf
    return buf


def _cache_params(k_cache: torch.Tensor, name: str):
    if k_cache.ndim == 3:
        k_cache = k_cache.unsqueeze(2)
    if k_cache.ndim != 4 or k_cache.shape[2] != 1 or k_cache.shape[3] != _BYTES_PER_TOKEN:
        raise DecodeInputError(
            f"{name} must be the DeepSeek-V4 page view [num_pages, page_size, 1, 584], got {tuple(k_cache.shape)}"
        )
    if k_cache.element_size() != 1:
        raise DecodeInputError(f"{name} must have a 1-byte dtype (float8_e4m3fn/uint8), got {k_cache.dtype}")
    P = k_cache.shape[1]
    PB = k_cache.stride(0)
    if P < 1 or PB < P * _BYTES_PER_TOKEN or PB % 2 != 0 or k_cache.stride(1) != _BYTES_PER_TOKEN:
        raise DecodeInputError(
            f"{name}: page stride {PB} / token stride {k_cache.stride(1)} do not fit page size {P} in the V4 layout"
        )
    return k_cache.view(torch.uint8), P, PB


def _indices(ind: torch.Tensor, T: int, name: str) -> torch.Tensor:
    if ind.ndim == 2:
        ind = ind.unsqueeze(1)
    if ind.ndim != 3 or ind.shape[0] != T or ind.shape[1] != 1:
        raise DecodeInputError(f"{name} must be [T, 1, K] with T={T}, got {tuple(ind.shape)}")
    if ind.dtype not in (torch.int32, torch.int64):
        raise DecodeInputError(f"{name} must be int32/int64, got {ind.dtype}")
    if ind.dtype != torch.int32:
        ind = ind.to(torch.int32)
    if ind.stride(2) != 1:
        ind = ind.contiguous()
    return ind


def _lengths(x, T: int, name: str):
    if x is None:
        return None
    if x.numel() != T:
        raise DecodeInputError(f"{name} must have T={T} entries, got shape {tuple(x.shape)}")
    x = x.reshape(T)
    if x.dtype != torch.int32:
        x = x.to(torch.int32)
    return x.contiguous()


def _pow2_at_least(n: int, lo: int) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


def plan_splits(T: int, HG: int, K1: int, K2: int, block_n: int, num_sms: int, waves: float = 2.0,
                min_blocks: int = 1):
    """Split plan: (s_main, chunk_main, s_extra, chunk_extra). Depends only on shapes and SM count.

    Aim at ``waves * num_sms`` programs in total, never below one split per cache that has
    candidates, never more splits than candidate blocks / ``min_blocks`` (fewer partials to merge,
    several blocks per program for the pipelined body); the splits go to main / extra in proportion
    to their candidate blocks."""
    nb1 = max(1, triton.cdiv(K1, block_n))
    nb2 = triton.cdiv(K2, block_n) if K2 > 0 else 0
    want = max(1, triton.cdiv(int(waves * num_sms), max(1, T * HG)))
    want = min(max(want, 1 + (1 if nb2 else 0)), max(1 + (1 if nb2 else 0), triton.cdiv(nb1 + nb2, max(1, min_blocks))))
    if nb2:
        s1 = min(max(1, round(want * nb1 / (nb1 + nb2))), want - 1)
        s2 = want - s1
    else:
        s1, s2 = want, 0
    c1 = triton.cdiv(nb1, s1) * block_n
    s1 = max(1, triton.cdiv(K1, c1))
    if nb2:
        c2 = triton.cdiv(nb2, s2) * block_n
        s2 = triton.cdiv(K2, c2)
    else:
        c2 = block_n
    return s1, c1, s2, c2


def plan_span(T: int, HG: int, K1: int, K2: int, block_n: int, num_sms: int, waves: float = 2.0,
              min_blocks: int = 1):
    """Split plan of the spanning register body (SPAN=1): (splits, chunk) over the concatenated candidate list
    (main ++ extra, K1 + K2 candidates). ``waves * num_sms`` is the number of programs the GPU runs at once (2
    per SM for a body that fits twice), and the splits per row are as many as fill those slots in one round
    (floor, not ceil: a second, partial round costs a whole program's time), never more than one per
    ``min_blocks`` candidate blocks; the chunk is a whole number of blocks, so every program but the last of a
    row owns the same work. Depends only on shapes and the SM count."""
    nb = max(1, triton.cdiv(K1 + K2, block_n))
    want = max(1, int(waves * num_sms) // max(1, T * HG))
    want = max(1, min(want, triton.cdiv(nb, max(1, min_blocks))))
    chunk = triton.cdiv(nb, want) * block_n
    return max(1, triton.cdiv(K1 + K2, chunk)), chunk


def _plan(cfg, T: int, HG: int, K1: int, K2: int, nsm: int):
    """(s_main, chunk_main, s_extra, chunk_extra) of a launch; the spanning register body's splits all count as
    main splits (its kernel reads ``main_chunk`` only)."""
    bn, waves, mb = int(cfg["BLOCK_N"]), float(cfg["waves"]), int(cfg.get("min_blocks", 1))
    if cfg["impl"] == "reg" and int(cfg.get("SPAN", 0)):
        S, chunk = plan_span(T, HG, K1, K2, bn, nsm, waves, mb)
        return S, chunk, 0, bn
    return plan_splits(T, HG, K1, K2, bn, nsm, waves, mb)


def _is_hopper(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


def _default_config(H: int, device: torch.device, fp8: bool, T: int = 1, num_sms: int = 132, K1: int = 0,
                    K2: int = 0, impl=None):
    """Launch configuration from the shapes (``T`` rows, ``K1`` / ``K2`` candidates per row of the main / extra
    cache) and the architecture. Chosen from the H200 sweeps recorded in bench/results/attention_h200* (sm_120
    has the same 64K registers per SM but ~100 KB of shared memory and no wgmma: it keeps the tiled body with
    one stage where that body is used; its own sweep is `make bench-attention` there). ``"auto"`` entries are
    resolved per launch from the split plan (``_resolve_auto``). ``impl``: a body the user asked for
    (``DSV4_SM120_ATTN_CONFIG`` / ``CONFIG_OVERRIDE``); another body than the register body then gets its own
    defaults, not the register body's launch."""
    if _interpreting():
        return dict(impl="tiled", BLOCK_H=16, BLOCK_N=16, num_warps=4, num_stages=1, waves=1.0, QK_SWAP=0, Q_RELOAD=0,
                    DEQ_BF16=0, BLOCK_D="auto", BLOCK_S="auto", BLOCK_HC="auto", combine_warps="auto",
                    combine_maxnreg="auto", maxnreg=0)
    # sm_120: ptxas (triton 3.8) spills ~5.8 KB per thread for 64-row head blocks, none for 32
    bh = min(32 if _is_sm120(device) else 64, _pow2_at_least(H, 16))
    # KCVT=1: e4m3 -> bf16 on the integer pipes (H200 call 14, H=16 SWA128+c4: 10.7 / 15.9 / 29.4 / 43.2 /
    # 71.5 us at B = 1/16/32/64/128 against 11.3 / 17.0 / 30.4 / 45.7 / 75.8 with the conversion-pipe cast)
    cfg = dict(impl="tiled", BLOCK_H=bh, BLOCK_N=32, num_warps=8, num_stages=1, waves=2.0, QK_SWAP=0,
               Q_RELOAD=0, DEQ_BF16=0, BLOCK_D="auto", BLOCK_S="auto", BLOCK_HC="auto", combine_warps="auto",
               combine_maxnreg="auto", maxnreg=0, KCVT=1)
    # 16-row head blocks, 64 candidates per block, 8 warps, registers capped at 128 (2 CTAs per SM):
    # the best H=16 configuration of the H200 sweeps at B <= 16 and within ~10% of the best elsewhere
    # bf16 partial accumulators (half the partial traffic): H200 call 6, H=16 SWA128+c4, B=16/64/128:
    # 17.1/51.3/80.5 vs 18.0/52.4/82.5 us, error 8.9e-4 vs 8.4e-4 (output rounding dominates)
    # maxnreg "auto": 128 (2 CTAs per SM by registers) with one stage; no cap once two stages' ~160 KB of
    # shared memory allow one CTA per SM anyway (H200 call 15, B=64/128: 41.3/67.4 vs 42.4/69.7 us), or for
    # the register body (a 128 cap spills it)
    small = dict(BLOCK_H=16, BLOCK_N=64, maxnreg="auto", PART_BF16=1)
    if bh == 16:
        cfg.update(small)
    rows = T * triton.cdiv(H, 16)
    if _is_hopper(device):
        # H200 call 4: kernel-level pipelining (num_stages=2) of the tiled body wins once a program
        # owns >= 2 candidate blocks (B=64: 65.0 vs 69.0 us, B=128: 106.3 vs 115.9) and loses at one
        # block (B=16: 28.6 vs 25.3) -> "auto" (per launch). For H > 16, 16-row head groups win while
        # the grid is small (H=64, B=1: 19.3 vs 25.3 us; B=16: 59.0 vs 71.5) and the flat body with
        # 64-row head blocks (wgmma) once it is large (B=128: 234.6 vs 292.6).
        cfg["num_stages"] = "auto"
        if H <= 16:
            # split count by grid rows (H200 call 6, H=16 SWA128+c4 with bf16 partials): more splits while
            # the grid is small (B=64: 46.6 us at 4 waves vs 51.3 at 2), fewer once it is large (B=128:
            # 78.9 at 1 wave vs 82.5 at 2, 89.7 at 4); B <= 16 is capped by the candidate blocks anyway
            # (relative to the SM count: 4 waves up to 3/4 of the SMs in grid rows, 1 from 95%, i.e. 99 and
            # 126 rows on the H200's 132 SMs)
            cfg["waves"] = 4.0 if 4 * rows <= 3 * num_sms else (1.0 if 20 * rows >= 19 * num_sms else 2.0)
            # next block's indices read early (H200 call 8: B=64 45.5 vs 46.3 us, B=128 75.8 vs 77.7;
            # B=16 16.9 vs 16.8, noise), so only where programs own several blocks: from a third of the SMs;
            # and its tile-scale bytes too (PREFETCH=2, call 14 with KCVT=1: B=64 42.2 vs 43.2, B=128 69.2
            # vs 71.5)
            cfg["PREFETCH"] = 2 if 3 * rows >= num_sms else 0
        if bh > 16:
            if rows <= 2 * num_sms:
                cfg.update(small)
            else:
                cfg.update(impl="flat", num_stages=1)
    # the register body (bf16 QK), chosen last, and only when no other body was asked for (``impl``), so an
    # ``impl=tiled`` request gets the tiled settings above; asked for by name it gets its launch at any shape.
    # sm_120 takes it too (no spills there: 234 registers, 49 KB of shared memory, so two CTAs fit
    # its 64K registers and 100 KB per SM; test_reg_body_code_generation_for_sm90_and_sm120), unmeasured on that
    # hardware. 32-candidate blocks on 4 warps (two CTAs per SM, waves=2 = the program slots), the next block
    # decoded at the end of an iteration (DEC_LATE), Q resident (Q_RES), and spanning splits (SPAN: equal chunks
    # of main ++ extra, as many per row as fill the slots in one round). H200 call 22, H=16 SWA128+c4, B = 1 / 4 /
    # 16 / 64 / 128: 8.5 / 8.9 / 12.7 / 25.4 / 42.5 us (before empty-segment skipping, ~1 us at B = 1 / 4)
    # against the previous defaults' 7.9 / 8.0 / 15.9 / 34.0 / 51.1 and FlashMLA's 12.3 / 12.8 / 17.5 / 44.3 /
    # 45.8; single-512 7.2 / 7.6 / 9.9 / 22.1 / 36.6 against 7.6 / 7.7 / 12.8 / 34.9 / 45.1
    # For H > 16 the same launch in 16-row head groups (each group a row of the plan): H200 calls 24-25, SWA128+c4,
    # H = 32 at B = 1 / 16 / 64 / 128: 8.0 / 16.4 / 40.8 / 72.4 us vs 10.9 / 25.0 / 70.9 / 138.6; H = 64 at B = 1 /
    # 4 / 16 / 64 / 128: 8.0 / 11.9 / 22.6 / 69.8 / 137.6 vs 10.8 / 14.6 / 43.2 / 135.3 / 148.6; H = 128 at B = 1 /
    # 16 / 64: 10.0 / 38.3 / 134.1 vs 11.1 / 75.0 / 145.8, but B = 128 (1024 group rows) 267.6 vs the flat body's
    # 263.6, so the flat body keeps grids of more than 4 group rows per SM
    native = (_is_hopper(device) or _is_sm120(device)) and rows <= 4 * num_sms
    if not fp8 and (impl == "reg" or (impl is None and native)):
        cfg.update(impl="reg", BLOCK_H=16, BLOCK_N=32, num_warps=4, waves=2.0, Q_RES=1, DEC_LATE=1, SPAN=1,
                   PART_BF16=1, maxnreg="auto")
    return cfg


_COMBINE_KEYS = ("BLOCK_HC", "BLOCK_D", "BLOCK_S", "combine_warps", "combine_maxnreg")


def _combine_maxnreg(block_s: int, per_thread: int) -> int:
    """Register cap for the combine. ptxas aims multi-warp programs at ~32 registers (full occupancy)
    and then issues only the first 1-3 loads of a chunk before the math; a cap is also the target it
    schedules to, so this one lets all ``block_s`` loads be in flight. Fitted on the CPU box
    (triton 3.8 and 3.6, sm_90 and sm_120, 4 fp32 per thread): 24 + (per_thread + 2) registers per
    split, a multiple of 8, 32..255; checked (all loads before the first FMA, no spill) for BLOCK_S = 2,
    3, 4, 5, 6, 8, 9, 10, 12, 14, 16 with 1, 2 and 4 warps."""
    return min(255, max(32, 8 * triton.cdiv(24 + block_s * (per_thread + 2), 8)))


def _combine_block_s(S: int, per_thread: int = 4, max_words: int = 32) -> int:
    """Partials merged per unrolled step of the combine: as many as fit in flight (each is one
    ``per_thread``-element load per thread; <= ``max_words`` loaded words per thread, at most 16), spread
    evenly over the chunks so the last chunk is as full as the others."""
    cap = max(1, min(16, max_words // max(1, per_thread)))
    return triton.cdiv(S, triton.cdiv(max(S, 1), cap))


def _combine_plan(T: int, H: int, S: int, num_sms: int, waves: float = 2.0, BLOCK_HC=None, BLOCK_D=None,
                  warps=None, BLOCK_S=None):
    """Combine launch ``(BLOCK_HC, BLOCK_D, BLOCK_S, warps)`` from the shapes and the SM count only;
    arguments given (not None) are kept and the others chosen around them.

    One head per program (``BLOCK_HC`` > 1: heads looped inside a program). Columns: the whole 512-wide
    row, halved while the grid ``T x cdiv(H, BLOCK_HC) x 512/BLOCK_D`` has fewer than ``waves`` programs
    per SM, down to 128 (T=1, H=16: 64 programs). Warps: 4 fp32 per thread (one 16-byte vector per
    partial). ``BLOCK_S``: up to 8 partials in flight per thread (32 words, ~32-48 registers), up to 16
    (one round trip for S <= 16, ~70-125 registers) when the grid is that small anyway (registers do
    not limit its occupancy; it is latency-bound)."""
    bhc = int(BLOCK_HC) if BLOCK_HC is not None else 1
    target = waves * max(1, num_sms)
    if BLOCK_D is not None:
        bd = int(BLOCK_D)
    else:
        bd = 512
        while bd > 128 and T * triton.cdiv(H, bhc) * (512 // bd) < target:
            bd //= 2
    w = int(warps) if warps is not None else max(1, min(8, bd // 128))
    small = T * triton.cdiv(H, bhc) * (512 // bd) <= target
    bs = int(BLOCK_S) if BLOCK_S is not None else _combine_block_s(S, max(1, bd // (32 * w)), 64 if small else 32)
    return bhc, bd, bs, w


def _resolve_auto(cfg, s1: int, c1: int, s2: int, c2: int, *, T=None, H=None, num_sms=None):
    """Resolve the "auto" entries of a launch configuration from the split plan (shapes only).

    The combine's entries need ``T``, ``H`` and ``num_sms``; without them they stay "auto" (the combine
    launch resolves them)."""
    cfg = dict(cfg)
    if cfg.get("num_stages") == "auto":
        bn = int(cfg["BLOCK_N"])
        blocks = max(c1 // bn, (c2 // bn) if s2 else 0)
        cfg["num_stages"] = 2 if cfg["impl"] == "tiled" and blocks >= 2 else 1
    if cfg.get("maxnreg") == "auto":
        cfg["maxnreg"] = 0 if int(cfg["num_stages"]) >= 2 or cfg["impl"] == "reg" else 128
    if T is not None and H is not None and num_sms is not None:
        cfg = _resolve_combine(cfg, T, H, s1 + s2, num_sms)
    return cfg


def _resolve_combine(cfg, T: int, H: int, S: int, num_sms: int):
    """Fill the combine's "auto" (or missing) keys; explicit values (``CONFIG_OVERRIDE``, bench
    ``--variants``) are kept and the rest chosen around them. ``combine_waves`` (default 2): target
    programs per SM of the combine grid; ``combine_maxnreg=0``: no register cap."""
    if all(cfg.get(k, "auto") != "auto" for k in _COMBINE_KEYS):
        return cfg
    fixed = {k: (None if cfg.get(k, "auto") == "auto" else cfg[k]) for k in _COMBINE_KEYS}
    bhc, bd, bs, w = _combine_plan(T, H, S, num_sms, float(cfg.get("combine_waves", 2.0)), fixed["BLOCK_HC"],
                                   fixed["BLOCK_D"], fixed["combine_warps"], fixed["BLOCK_S"])
    mr = fixed["combine_maxnreg"]
    mr = _combine_maxnreg(bs, max(1, bd // (32 * w))) if mr is None else int(mr)
    return dict(cfg, BLOCK_HC=bhc, BLOCK_D=bd, BLOCK_S=bs, combine_warps=w, combine_maxnreg=mr)


def _launch_combine(cfg, acc_ws, m_ws, l_ws, attn_sink, out, lse, T: int, H: int, S: int, HP: int, num_sms: int):
    """Merge the ``S`` partials of each (row, head) (workspace rows ``(t*S + s)*HP + h``; ``acc_ws`` fp32
    or bf16, 512 values a row) with the sink into ``out`` [T, 1, H, 512] bf16 and ``lse`` [T, H, 1]."""
    cfg = _resolve_combine(cfg, T, H, S, num_sms)
    BHC, BD, BS = int(cfg["BLOCK_HC"]), int(cfg["BLOCK_D"]), int(cfg["BLOCK_S"])
    if BHC < 1 or BD < 1 or BD & (BD - 1) or BD > 512 or BS < 1:
        raise DecodeInputError(f"combine: BLOCK_D must be a power of two <= 512, BLOCK_HC and BLOCK_S >= 1; "
                               f"got BLOCK_D={BD}, BLOCK_HC={BHC}, BLOCK_S={BS}")
    extra = {}
    if int(cfg["combine_maxnreg"]) and not _interpreting():
        extra["maxnreg"] = int(cfg["combine_maxnreg"])
    _dsv4_combine_kernel[(T, triton.cdiv(H, BHC), 512 // BD)](
        acc_ws, m_ws, l_ws, attn_sink if attn_sink is not None else m_ws, out, lse, H, S, HP,
        HAS_SINK=attn_sink is not None, BLOCK_HC=BHC, BLOCK_D=BD, BLOCK_S=BS,
        num_warps=int(cfg["combine_warps"]), **extra,
    )


def _ws_words(cfg) -> int:
    # 4-byte workspace words per (row, split, head): acc (fp32 or bf16) + m + l
    return 258 if cfg["impl"] in ("tiled", "reg") and cfg.get("PART_BF16", 0) else 514


# Overrides for benchmarking variants (keys of _default_config); empty in production.
CONFIG_OVERRIDE: Dict[str, object] = {}

IMPLS = launch_config.IMPLS
_ENV_CONFIG_CACHE: Dict[str, Dict[str, object]] = {}


def parse_config(text: str, source: str = "config") -> Dict[str, object]:
    """``launch_config.parse_config`` raising ``DecodeInputError``."""
    return launch_config.parse_config(text, source, error=DecodeInputError)


def _env_config() -> Dict[str, object]:
    text = os.environ.get("DSV4_SM120_ATTN_CONFIG", "")
    if text not in _ENV_CONFIG_CACHE:
        _ENV_CONFIG_CACHE[text] = parse_config(text, "DSV4_SM120_ATTN_CONFIG")
    return _ENV_CONFIG_CACHE[text]


def _qk_mode(device: torch.device, qk_mode) -> bool:
    mode = qk_mode or os.environ.get("DSV4_SM120_ATTN_QK", "auto")
    if mode not in ("auto", "bf16", "fp8"):
        raise DecodeInputError(f"qk_mode / DSV4_SM120_ATTN_QK must be auto, bf16 or fp8, got {mode!r}")
    if mode == "auto":
        # bf16 everywhere until an sm_120 run shows the fp8 path ahead: decode reads ~584 B per candidate for
        # ~2*512*H FLOP of QK (~28 FLOP/B at H=16), far below any tensor-core ridge, so block-scaled QK is not
        # expected to pay, and quantizing Q costs 2-3% accuracy. `make bench-attention` times both on sm_120.
        return False
    return mode == "fp8"


def _launch(cfg, nsm, q, main_u8, idx1, len1, K1, P1, PB1, extra_u8, idx2, len2, K2, P2, PB2, has_extra,
            attn_sink, softmax_scale, fp8, out, lse, H, HG, HP):
    T = q.shape[0]
    BH, BN = int(cfg["BLOCK_H"]), int(cfg["BLOCK_N"])
    s1, c1, s2, c2 = _plan(cfg, T, HG, K1, K2, nsm)
    S = s1 + s2
    nrow = T * S * HP
    cfg = _resolve_auto(cfg, s1, c1, s2, c2, T=T, H=H, num_sms=nsm)
    part_bf16 = cfg["impl"] in ("tiled", "reg") and bool(cfg.get("PART_BF16", 0))
    ws = _workspace(q.device, nrow * _ws_words(cfg))
    if part_bf16:
        acc_ws = ws[: nrow * 256].view(torch.bfloat16)
        m_ws = ws[nrow * 256 : nrow * 257]
        l_ws = ws[nrow * 257 : nrow * 258]
    else:
        acc_ws = ws[: nrow * 512]
        m_ws = ws[nrow * 512 : nrow * 513]
        l_ws = ws[nrow * 513 : nrow * 514]
    interp = _interpreting()
    common = (
        q, q.stride(0), q.stride(2),
        main_u8, idx1, idx1.stride(0), len1 if len1 is not None else idx1, K1, P1, PB1, PB1 // 2, s1, c1,
        extra_u8, idx2, idx2.stride(0), len2 if len2 is not None else idx2, K2, P2, PB2, PB2 // 2, c2,
        acc_ws, m_ws, l_ws, H, S, HP, float(softmax_scale) * LOG2E,
    )
    flags = dict(
        HAS_MAIN_LEN=len1 is not None, HAS_EXTRA=has_extra and K2 > 0, HAS_EXTRA_LEN=len2 is not None,
        BLOCK_H=BH, BLOCK_N=BN, FP8_QK=fp8, INTERP=interp,
        num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]),
    )
    if cfg.get("maxnreg"):
        flags["maxnreg"] = int(cfg["maxnreg"])
    if cfg["impl"] == "tiled":
        qpre = {}
        if fp8 and int(cfg.get("QPRE", 1)):
            # the fp8 path's Q quantization once per (row, head), not once per candidate block
            q8 = torch.empty((T * HP * 448,), dtype=torch.uint8, device=q.device)
            qsc = torch.empty((T * HP * 14,), dtype=torch.uint8, device=q.device)
            _q_fp8_kernel[(T, HG)](q, q.stride(0), q.stride(2), q8, qsc, H, HP, BLOCK_H=BH, INTERP=interp,
                                   num_warps=4)
            qpre = dict(QPRE=True, q8_ptr=q8, qsc_ptr=qsc)
        _dsv4_split_kernel_tiled[(T, S, HG)](*common, PREFETCH=int(cfg.get("PREFETCH", 0)),
                                             KCVT=bool(cfg.get("KCVT", 0)), **qpre, **flags)
    elif cfg["impl"] == "reg":
        if fp8:
            raise DecodeInputError("impl=reg has no fp8 QK path (use qk_mode='bf16')")
        _dsv4_split_kernel_reg[(T, S, HG)](*common, KCVT=bool(cfg.get("KCVT", 0)), Q_RES=bool(cfg.get("Q_RES", 0)),
                                           DEC_LATE=bool(cfg.get("DEC_LATE", 0)), SPAN=bool(cfg.get("SPAN", 0)),
                                           **flags)
    else:
        _dsv4_split_kernel[(T, S, HG)](
            *common, QK_SWAP=bool(cfg["QK_SWAP"]), Q_RELOAD=bool(cfg["Q_RELOAD"]), DEQ_BF16=bool(cfg["DEQ_BF16"]),
            **flags)
    _launch_combine(cfg, acc_ws, m_ws, l_ws, attn_sink, out, lse, T, H, S, HP, nsm)


def sparse_mla_decode(
    q,
    k_cache,
    indices,
    topk_length=None,
    attn_sink=None,
    head_dim_v=512,
    softmax_scale=None,
    extra_k_cache=None,
    extra_indices_in_kvcache=None,
    extra_topk_length=None,
    *,
    qk_mode=None,
):
    """Sparse MLA decode over DeepSeek-V4 FP8 paged caches; see the package docstring."""
    if not isinstance(q, torch.Tensor) or q.ndim != 4 or q.shape[1] != 1 or q.shape[3] != 512:
        raise DecodeInputError(f"q must be [T, 1, H, 512], got {getattr(q, 'shape', type(q))}")
    if q.dtype != torch.bfloat16:
        raise DecodeInputError(f"q must be bfloat16, got {q.dtype}")
    if head_dim_v != 512:
        raise DecodeInputError(f"head_dim_v must be 512 for DeepSeek-V4, got {head_dim_v}")
    T, _, H, D = q.shape
    if H < 1:
        raise DecodeInputError("q has no heads")
    if q.stride(3) != 1:
        q = q.contiguous()
    device = q.device
    main_u8, P1, PB1 = _cache_params(k_cache, "k_cache")
    idx1 = _indices(indices, T, "indices")
    len1 = _lengths(topk_length, T, "topk_length")
    has_extra = extra_k_cache is not None and extra_indices_in_kvcache is not None
    if has_extra:
        extra_u8, P2, PB2 = _cache_params(extra_k_cache, "extra_k_cache")
        idx2 = _indices(extra_indices_in_kvcache, T, "extra_indices_in_kvcache")
        len2 = _lengths(extra_topk_length, T, "extra_topk_length")
        K2 = idx2.shape[2]
    else:
        extra_u8, P2, PB2, idx2, len2, K2 = main_u8, P1, PB1, idx1, None, 0
    K1 = idx1.shape[2]
    if attn_sink is not None:
        if attn_sink.numel() < H:
            raise DecodeInputError(f"attn_sink must have at least H={H} entries, got {attn_sink.numel()}")
        attn_sink = attn_sink.reshape(-1)
        if attn_sink.dtype != torch.float32:
            attn_sink = attn_sink.float()
        if attn_sink.stride(0) != 1:
            attn_sink = attn_sink.contiguous()
    if softmax_scale is None:
        softmax_scale = D ** (-0.5)

    out = torch.empty((T, 1, H, 512), dtype=torch.bfloat16, device=device)
    lse = torch.empty((T, H, 1), dtype=torch.float32, device=device)
    if T == 0:
        return out, lse

    fp8 = _qk_mode(device, qk_mode)
    nsm = _num_sms(device)
    user = dict(_env_config())
    user.update(CONFIG_OVERRIDE)
    cfg = dict(_default_config(H, device, fp8, T, nsm, K1, K2 if has_extra else 0, impl=user.get("impl")))
    cfg.update(user)
    if fp8 and cfg["impl"] in launch_config.BF16_ONLY_IMPLS:
        raise DecodeInputError(f"impl={cfg['impl']} has no fp8 QK path (use qk_mode='bf16')")
    BH = int(cfg["BLOCK_H"])
    HG = triton.cdiv(H, BH)
    HP = HG * BH
    # rows per launch: bounded so the fp32 workspace stays under DSV4_SM120_ATTN_WS_MB (default 256);
    # only huge T (prefill through this kernel) is cut, decode/verify batches run in one launch
    cap = int(float(os.environ.get("DSV4_SM120_ATTN_WS_MB", "256")) * (1 << 20) / 4)
    TC = T
    while TC > 1:
        s1, _, s2, _ = _plan(cfg, TC, HG, K1, K2, nsm)
        if TC * (s1 + s2) * HP * _ws_words(cfg) <= cap:
            break
        TC = (TC + 1) // 2
    for t0 in range(0, T, TC):
        t1 = min(T, t0 + TC)
        sl = slice(t0, t1)
        _launch(
            cfg, nsm, q[sl], main_u8, idx1[sl], None if len1 is None else len1[sl], K1, P1, PB1,
            extra_u8, idx2[sl], None if len2 is None else len2[sl], K2, P2, PB2, has_extra,
            attn_sink, softmax_scale, fp8, out[sl], lse[sl], H, HG, HP,
        )
    return out, lse
