"""Device helpers shared by the split bodies: the e4m3 -> bf16 decode, page addressing of a candidate block, the
K tile / scale loads, the fp8 QK path's Q quantization (and its pre-launch kernel), the partial store."""

from __future__ import annotations

import triton
import triton.language as tl

# e4m3 -> bf16 on the integer pipes (KCVT=1). Triton's cast is one packed e4m3x2 -> f16x2 conversion
# plus one f16 -> bf16 conversion per value, all on the conversion pipe (16 results per SM per clock on
# sm_90; 336 per thread per 64-candidate block in the tiled body).
# Here: a byte ``s eeee mmm`` moved to bf16 bits 15 (sign) and 10..4 (eeee mmm) is a bf16 equal to its
# e4m3 value times 2^-120 (eeee = 0 lands on the bf16 subnormals, also exact); one bf16x2 multiply by
# 2^120 gives the value, exactly, for all 254 finite codes (0x7F / 0xFF, e4m3 NaN, give +-480: the KV
# cache never holds them). Four values per 32-bit input: 2 PRMT, 2 SHF, 6 LOP3, 2 HFMA2.
E4M3_BF16_ASM = tl.constexpr("""
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
        q8, q_sc = _q_fp8_tile(qt, BLOCK_H, INTERP)
        tl.store(q8_ptr + o_row * 448 + tile * 64 + lanes[None, :], q8.to(tl.uint8, bitcast=True),
                 mask=hmask[:, None])
        tl.store(qsc_ptr + o_row * 14 + tile * 2 + tl.arange(0, 2)[None, :], q_sc, mask=hmask[:, None])



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
