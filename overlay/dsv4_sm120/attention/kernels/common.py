"""Device helpers shared by the split bodies. They are ``@triton.jit`` functions, inlined where called: a body
built from them compiles to the same LLVM IR and PTX instructions as one with the steps written out (ptxas,
which sees the inlined scopes in the line info, may order a few instructions differently).

* the online softmax (base 2): ``_softmax_init`` (the state before the first block), ``_online_softmax`` (one
  candidate block's update), ``_acc_tiles_init`` (the eight ``[BLOCK_H, 64]`` accumulator tiles of the tiled
  and register bodies), ``_store_softmax_state`` / ``_store_partial`` (the partial result in the workspace);
* ``_mma_operand``: a ``tl.dot`` operand, upcast to fp32 under the interpreter (P as the PV A operand is
  ``_mma_operand(p.to(tl.bfloat16), INTERP)``);
* the fp8 QK path's MX quantization of Q, ``_q_mx_quantize``, and its pre-launch kernel ``q_fp8_kernel``;
* the KV cache: a program's candidate range in one cache (``_segment_bounds``), page addressing of a candidate
  block (``_token_rows``), the seven e4m3 nope tiles and their
  UE8M0 scales (``_k_tile`` / ``_k_tiles``, ``_k_scale`` / ``_k_scales``, ``_k_tile_again``), the e4m3 -> bf16
  decode (``_e4m3_bf16``) and the scale value (``_ue8m0``)."""

from __future__ import annotations

import triton
import triton.language as tl

# e4m3 -> bf16 on the integer pipes (KCVT=1). Triton's cast is one packed e4m3x2 -> f16x2 conversion
# plus one f16 -> bf16 conversion per value, all on the conversion pipe (16 results per SM per clock on
# sm_90; 336 per thread per 64-candidate block in the tiled body).
# Here: a byte ``s eeee mmm`` moved to bf16 bits 15 (sign) and 10..4 (eeee mmm) is a bf16 equal to its
# e4m3 value times 2^-120 (eeee = 0 lands on the bf16 subnormals, also exact); one bf16x2 multiply by
# 2^120 gives the value, exactly, for all 254 finite codes (0x7F / 0xFF, e4m3 NaN, give +-480: the KV
# cache never holds them). The move, for two bytes at once: one PRMT puts each byte in the low byte of its
# 16-bit half and its sign, replicated (PRMT's sign mode), in the high byte; shifted left by 4, a half holds
# the byte's low 7 bits at 10..4 and the sign at 15, and one AND keeps just those. Four values per 32-bit
# input: 2 PRMT, 2 shifts, 2 LOP3, 2 HFMA2 (the shifts often go to the FMA pipe as IMAD.SHL).
E4M3_BF16_ASM = tl.constexpr("""
{
.reg .b32 z, x, a, s, nz;
mov.b32 z, 0;
mov.b32 s, 0x7B807B80;
mov.b32 nz, 0x80008000;
prmt.b32 x, $2, z, 0x9180;
shl.b32 a, x, 4;
and.b32 a, a, 0x87F087F0;
fma.rn.bf16x2 $0, a, s, nz;
prmt.b32 x, $2, z, 0xB3A2;
shl.b32 a, x, 4;
and.b32 a, a, 0x87F087F0;
fma.rn.bf16x2 $1, a, s, nz;
}
""")


@triton.jit
def _e4m3_bf16(k8, KCVT: tl.constexpr):
    """uint8 tensor of e4m3 codes -> bfloat16 values (exact). KCVT: integer-pipe bit moves (inline PTX;
    needs >= 4 consecutive values per thread) instead of Triton's conversion-pipe cast."""
    if KCVT:
        return tl.inline_asm_elementwise(E4M3_BF16_ASM, "=r,=r,r", [k8], dtype=tl.bfloat16, is_pure=True,
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
def _segment_bounds(len_ptr, K, t, start, chunk, HAS_LEN: tl.constexpr):
    """A program's candidates ``[start, start + chunk)`` of one cache: ``(cend, end)``, the chunk's end within the
    cache's ``K`` candidates and that end cut at row ``t``'s length ``len_ptr[t]`` (``HAS_LEN``)."""
    cend = tl.minimum(start + chunk, K)
    end = cend
    if HAS_LEN:
        end = tl.minimum(end, tl.load(len_ptr + t))
    return cend, end


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
def _k_tiles(cache, row, valid, lanes):
    """The seven nope tiles of a candidate block (``_k_tile`` 0..6), raw e4m3 bytes ``[BLOCK_N, 64]`` each, loads
    issued in tile order."""
    return (_k_tile(cache, row, valid, 0, lanes), _k_tile(cache, row, valid, 1, lanes),
            _k_tile(cache, row, valid, 2, lanes), _k_tile(cache, row, valid, 3, lanes),
            _k_tile(cache, row, valid, 4, lanes), _k_tile(cache, row, valid, 5, lanes),
            _k_tile(cache, row, valid, 6, lanes))


@triton.jit
def _k_scales(cache, sbase, valid):
    """The UE8M0 scale bytes of the seven nope tiles of a candidate block (``_k_scale`` 0..6), ``[BLOCK_N]``
    uint8 each, loads issued in tile order."""
    return (_k_scale(cache, sbase, valid, 0), _k_scale(cache, sbase, valid, 1), _k_scale(cache, sbase, valid, 2),
            _k_scale(cache, sbase, valid, 3), _k_scale(cache, sbase, valid, 4), _k_scale(cache, sbase, valid, 5),
            _k_scale(cache, sbase, valid, 6))


@triton.jit
def _ue8m0(ksc, KCVT: tl.constexpr):
    # UE8M0 byte -> 2^(byte - 127) as fp32. KCVT: the byte shifted into the fp32 exponent field (one integer
    # op; byte 0, 2^-127, becomes 0 and 255 becomes +inf instead of NaN: neither is a real KV tile scale);
    # else int -> float, subtract, MUFU exp2 (conversion and special-function pipes).
    if KCVT:
        return (ksc.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return tl.exp2(ksc.to(tl.float32) - 127.0)


@triton.jit
def _q_mx_quantize(q, BLOCK_H: tl.constexpr, GROUPS: tl.constexpr, INTERP: tl.constexpr):
    """The fp8 QK path's MX quantization of Q (``reference.quantize_q_mx``): ``q`` ``[BLOCK_H, GROUPS * 32]``
    (bf16 or fp32) -> (e4m3 values ``[BLOCK_H, GROUPS * 32]``, UE8M0 scale bytes ``[BLOCK_H, GROUPS]`` uint8,
    one per 32 consecutive values). A group's scale is ``2^ceil(log2(amax / 448))`` clamped to
    ``2^-126 .. 2^127``; the values divided by it round to nearest even (under the interpreter onto the e4m3
    grid first, see ``_round_to_e4m3_grid``). All-zero groups (masked heads, padding) get scale ``2^-126``."""
    qf = tl.reshape(q.to(tl.float32), [BLOCK_H, GROUPS, 32])
    amax = tl.max(tl.abs(qf), axis=2)
    qexp = tl.ceil(tl.log2(tl.maximum(amax, 1e-30) / 448.0))
    qexp = tl.minimum(tl.maximum(qexp, -126.0), 127.0)
    qs = qf * tl.exp2(-qexp)[:, :, None]
    if INTERP:
        qs = _round_to_e4m3_grid(qs)
    return tl.reshape(qs.to(tl.float8e4nv), [BLOCK_H, GROUPS * 32]), (qexp + 127.0).to(tl.uint8)


@triton.jit
def q_fp8_kernel(q_ptr, stride_qt, stride_qh, q8_ptr, qsc_ptr, H, HP,
                  BLOCK_H: tl.constexpr, INTERP: tl.constexpr):
    """The fp8 QK path's Q quantization, once per (row, head) before the tiled launch: ``q8 [T, HP, 448]`` e4m3
    bytes and ``qsc [T, HP, 14]`` UE8M0 (one per 32 dims), the MX quantization of ``reference.quantize_q_mx``."""
    t64 = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    lanes = tl.arange(0, 64)
    q_row = q_ptr + t64 * stride_qt + offs_h[:, None].to(tl.int64) * stride_qh
    o_row = (t64 * HP + offs_h)[:, None]
    for tile in tl.static_range(7):
        qt = tl.load(q_row + tile * 64 + lanes[None, :], mask=hmask[:, None], other=0.0)
        q8, q_sc = _q_mx_quantize(qt, BLOCK_H, 2, INTERP)
        tl.store(q8_ptr + o_row * 448 + tile * 64 + lanes[None, :], q8.to(tl.uint8, bitcast=True),
                 mask=hmask[:, None])
        tl.store(qsc_ptr + o_row * 14 + tile * 2 + tl.arange(0, 2)[None, :], q_sc, mask=hmask[:, None])


@triton.jit
def _mma_operand(x, INTERP: tl.constexpr):
    """``x`` as a ``tl.dot`` operand: unchanged, or upcast to fp32 under the interpreter (its bf16 dot is wrong)."""
    if INTERP:
        return x.to(tl.float32)
    return x


@triton.jit
def _softmax_init(BLOCK_H: tl.constexpr):
    """Online-softmax state before the first candidate block: running max ``m_i = -inf`` and running sum
    ``l_i = 0``, ``[BLOCK_H]`` fp32 each."""
    return tl.full([BLOCK_H], float("-inf"), tl.float32), tl.zeros([BLOCK_H], tl.float32)


@triton.jit
def _acc_tiles_init(BLOCK_H: tl.constexpr):
    """The eight zero ``[BLOCK_H, 64]`` fp32 accumulator tiles of the tiled and register bodies: nope tiles 0..6,
    then rope."""
    return (tl.zeros([BLOCK_H, 64], tl.float32), tl.zeros([BLOCK_H, 64], tl.float32),
            tl.zeros([BLOCK_H, 64], tl.float32), tl.zeros([BLOCK_H, 64], tl.float32),
            tl.zeros([BLOCK_H, 64], tl.float32), tl.zeros([BLOCK_H, 64], tl.float32),
            tl.zeros([BLOCK_H, 64], tl.float32), tl.zeros([BLOCK_H, 64], tl.float32))


@triton.jit
def _online_softmax(qk, valid, m_i, l_i, sm_scale_log2):
    """One candidate block's online-softmax update, base 2.

    ``qk`` ``[BLOCK_H, BLOCK_N]`` fp32: the block's raw scores ``q . k``; ``valid`` ``[BLOCK_N]``: the candidates
    that exist (the others get weight 0); ``m_i`` / ``l_i`` ``[BLOCK_H]``: the running max of the base-2 logits
    and the running sum of their weights (``_softmax_init`` before the first block); ``sm_scale_log2``: the
    softmax scale times log2(e).

    Returns ``(p, alpha, m_new, l_new)``: ``p`` ``[BLOCK_H, BLOCK_N]`` fp32, the block's weights
    ``2^(qk * sm_scale_log2 - m_ref)``; ``alpha`` ``[BLOCK_H]`` = ``2^(m_i - m_ref)``, the factor every running
    accumulator is multiplied by before the block's ``p @ V`` is added; ``m_new`` / ``l_new``, the next state.
    ``m_ref`` is ``m_new``, or 0 while a row has seen no valid candidate (``p``, ``alpha`` and ``l_new`` are then
    0, never NaN). The caller keeps ``m_new`` and ``l_new`` as its ``m_i`` / ``l_i``."""
    qk = qk * sm_scale_log2
    qk = tl.where(valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@triton.jit
def _store_softmax_state(m_ws, l_ws, base, hmask, m_i, l_i):
    """The final ``(m, l)`` of the heads ``hmask`` to workspace rows ``base`` ``[BLOCK_H]``."""
    tl.store(m_ws + base, m_i, mask=hmask)
    tl.store(l_ws + base, l_i, mask=hmask)


@triton.jit
def _store_partial(acc_ws, base, hmask, lanes, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc_r):
    """The eight accumulator tiles (``_acc_tiles_init`` order) to workspace rows ``base`` ``[BLOCK_H]``, 512
    values a row."""
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
