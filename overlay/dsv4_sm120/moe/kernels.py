"""Triton kernels of the NVFP4 fused MoE (JIT only; host planning in :mod:`dsv4_sm120.moe.fused_moe`).

Three or four launches per call, all with grids that depend only on tensor
shapes (no host synchronisation, CUDA-graph safe):

1. ``_align_kernel`` (one program; skipped with in-kernel grouping, where each
   GEMM program finds its (expert, row tile) itself: ``_slot_expert`` /
   ``_expert_pairs``): groups the ``P = M*k`` (token, slot) pairs
   by expert, pads every expert's group to a multiple of ``BM`` rows and writes
   ``sorted_pair[slot]`` (``P`` = padding) and ``block_expert[b]`` (``-1`` =
   unused block). Ids outside ``[0, E)`` (``-1`` = dropped) are skipped.
2. ``_gemm1_kernel``: per (row block, N block) ``h = SwiGLU(x W13^T)`` with the
   DeepSeek-V4 clamp, stored as bf16 rows in sorted (padded) order; only rows
   of real pairs are written, and no later kernel reads the others.
3. ``_gemm2_kernel``: ``y = h W2^T`` times the pair's top-k weight, stored per
   pair in fp32.
4. ``_reduce_kernel``: per token, the sum over its valid slots -> bf16.

K ordering: a packed byte holds elements ``2j`` (low nibble) and ``2j+1`` (high
nibble). The upcast path never interleaves nibbles: it splits every K tile into
its even and odd elements and runs two dots (``x_even W_lo^T + x_odd W_hi^T``),
which is the same sum in another order. The FP4 path packs quantized
activations the same way, so bytes line up with the weights' K packing and
``tl.dot_scaled`` takes both operands K-packed.

Paths (``PATH_FP4`` constexpr):
* ``False`` (upcast; H200 and anything without FP4 MMA): weights are decoded
  in registers to bf16 (exact: e2m1 * e4m3 fits bf16) and hit bf16 MMA.
* ``True`` (sm_120 / sm_100): activations are quantized to NVFP4 on the fly
  with a per-row dynamic global scale ``gs = amax_row / (6 * 448)``, block
  scale ``e4m3(amax_16 / (6 gs))``, codes ``RNE_e2m1(a / (scale * gs))``, the
  same recipe as :func:`dsv4_sm120.nvfp4.quantize_nvfp4` with a per-row
  ``scale_2``; then ``tl.dot_scaled(e2m1, e4m3 scales, group 16)`` when
  ``NATIVE`` else an exact in-kernel emulation of that product (used under the
  CPU interpreter, whose dot_scaled reads every scale as E8M0).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e2m1_f32(nib):
    """4-bit e2m1 codes (int32, 0..15) -> float32 / 16384 (exact).

    The code ``s e1 e0 m`` placed at fp16 bits 15 and 11..9 is an fp16 whose
    value is the e2m1 value times 2^-14 (code 1 lands on the fp16 subnormal
    2^-15). The caller folds 16384 into the scale.
    """
    bits = ((nib & 8) << 12) | ((nib & 7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_code(v):
    """float32 -> e2m1 code (int32), round to nearest even, saturating at 6."""
    a = tl.abs(v)
    c = (a > 0.25).to(tl.int32)
    c += (a >= 0.75).to(tl.int32)
    c += (a > 1.25).to(tl.int32)
    c += (a >= 1.75).to(tl.int32)
    c += (a > 2.5).to(tl.int32)
    c += (a >= 3.5).to(tl.int32)
    c += (a > 5.0).to(tl.int32)
    return tl.where((v < 0) & (c > 0), c | 8, c)


@triton.jit
def _round_e4m3(v):
    """Non-negative float32 (<= 448) -> nearest-even E4M3 value, as float32.

    Done arithmetically (add/subtract a magic number at the E4M3 quantum of
    the value's binade) so the result is exact; the Triton CPU interpreter's
    own fp32 -> fp8e4nv cast gets binade carries wrong (126.1 -> 64).
    """
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    e = tl.maximum(e, -6)
    magic = ((e - 3 + 23 + 127 + 1) << 23).to(tl.float32, bitcast=True) * 0.75  # 1.5 * 2^(e-3+23)
    r = (v + magic) - magic
    return tl.minimum(r, 448.0)


@triton.jit
def _to_bf16(x, INTERP: tl.constexpr):
    """float32 -> bfloat16, round to nearest even (the CPU interpreter's own cast
    truncates, so round the bits explicitly there)."""
    if INTERP:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _bcast8(s, R: tl.constexpr, G: tl.constexpr):
    """[R, G] -> [R, G*8]: every column repeated 8 times (one 16-block = 8 bytes)."""
    return tl.reshape(tl.broadcast_to(s[:, :, None], (R, G, 8)), (R, G * 8))


@triton.jit
def _bcast8_rows(s, G: tl.constexpr, C: tl.constexpr):
    """[G, C] -> [G*8, C]: every row repeated 8 times."""
    return tl.reshape(tl.broadcast_to(s[:, None, :], (G, 8, C)), (G * 8, C))


@triton.jit
def _quant_tile(a_even, a_odd, gs, BM: tl.constexpr, BK: tl.constexpr):
    """Quantize a [BM, BK] activation tile given as its even / odd K halves
    (float32 [BM, BK/2] each) with per-row global scale ``gs`` [BM].

    Returns (packed uint8 [BM, BK/2] K-packed like the weights, block scales
    float8e4nv [BM, BK/16]).
    """
    G: tl.constexpr = BK // 16
    am_e = tl.max(tl.reshape(tl.abs(a_even), (BM, G, 8)), axis=2)
    am_o = tl.max(tl.reshape(tl.abs(a_odd), (BM, G, 8)), axis=2)
    bam = tl.maximum(am_e, am_o)
    bsf = _round_e4m3(tl.minimum(bam / (6.0 * gs[:, None]), 448.0))
    bs8 = bsf.to(tl.float8e4nv)  # exact
    denom = _bcast8(bsf * gs[:, None], BM, G)
    safe = tl.where(denom > 0, denom, 1.0)
    ce = tl.where(denom > 0, _e2m1_code(a_even / safe), 0)
    co = tl.where(denom > 0, _e2m1_code(a_odd / safe), 0)
    packed = (ce | (co << 4)).to(tl.uint8)
    return packed, bs8


@triton.jit
def _row_gs(a_ptrs_row, row_mask, K, BM: tl.constexpr, BK: tl.constexpr):
    """Per-row dynamic NVFP4 global scale amax/(6*448) (1.0 for an all-zero row)."""
    kk = tl.arange(0, BK)
    amax = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptrs_row + (k0 + kk)[None, :], mask=row_mask[:, None], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(a.to(tl.float32)), axis=1))
    return tl.where(amax > 0, amax / 2688.0, 1.0)


@triton.jit
def _fp4_pair_dot(acc, a_even, a_odd, gs, wq, ws_ptrs,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  NATIVE: tl.constexpr):
    """acc[BM, BN] += dequant(quant(a)) @ dequant(w) without the global scales.

    ``wq`` uint8 [BK/2, BN] (K-packed weights, transposed view), ``ws_ptrs``
    pointers [BN, BK/16] to its E4M3 block scales. The result still has to be
    multiplied by the activation row scale and the weight global scale.
    """
    aq, as8 = _quant_tile(a_even, a_odd, gs, BM, BK)
    return _fp4_pre_dot(acc, aq, as8, wq, ws_ptrs, BM, BN, BK, NATIVE)


# DEQ 3: shift decode. A code ``s e1 e0 m`` placed at bf16 bits 15 and 8..6 is a bf16 equal to the e2m1
# value times 2^-126 (code 1 lands on the bf16 subnormal 2^-127); one bf16x2 multiply by the block scale
# times 2^119 (e4m3 <= 448 < 2^9, so no overflow) gives value * scale * 2^-7, exact; the caller multiplies
# the fp32 accumulator by 2^7. ~11 instructions per 4 values (a byte-permute table lookup of the bf16 bits needs ~22).
def _shift_decode_asm() -> str:
    # the PTX: prmt spreads two bytes of the packed codes ($4: bytes 0, 1, then 2, 3) into v's two 16-bit halves; per
    # byte the low code (shifts 6 / 12) and the high code (shifts 2 / 8) get their e1 e0 m bits to 8..6 and their
    # sign to bit 15, times that byte pair's scales ($5, then $6): outputs $0 / $2, then $1 / $3
    lines = ["{", ".reg .b32 v, a, b, t, z, nz;", "mov.b32 z, 0;", "mov.b32 nz, 0x80008000;"]
    for select, outs, scale in (("0x4140", ("$0", "$2"), "$5"), ("0x4342", ("$1", "$3"), "$6")):
        lines.append(f"prmt.b32 v, $4, z, {select};")
        for (lo, hi), out in zip(((6, 12), (2, 8)), outs):
            lines += [f"shl.b32 a, v, {lo};", f"shl.b32 b, v, {hi};", "and.b32 a, a, 0x01C001C0;",
                      "and.b32 b, b, 0x80008000;", "or.b32 t, a, b;", f"fma.rn.bf16x2 {out}, t, {scale}, nz;"]
    return "\n" + "\n".join(lines + ["}"]) + "\n"


_E2M1_BF16_SHIFT_ASM = tl.constexpr(_shift_decode_asm())


@triton.jit
def _dequant_w(wq, ws_ptrs, BN: tl.constexpr, BK: tl.constexpr, DEQ: tl.constexpr):
    """K-packed weight bytes [BK/2, BN] + pointers [BK/16, BN] to their E4M3
    scales -> (even-k values, odd-k values), exact.

    DEQ 0: float32 math, weight * block scale (portable: the interpreter, non-NVIDIA builds) -> float32.
    DEQ 3: inline-PTX shift decode (see _E2M1_BF16_SHIFT_ASM), weight * block scale * 2^-7 -> bfloat16;
           the caller multiplies the accumulator by 2^7.
    """
    G: tl.constexpr = BK // 16
    if DEQ == 3:
        sb = _bcast8_rows((tl.load(ws_ptrs).to(tl.float32) * 6.64613997892458e+35).to(tl.bfloat16), G, BN)  # * 2^119
        w_lo, w_hi = tl.inline_asm_elementwise(
            _E2M1_BF16_SHIFT_ASM, "=r,=r,=r,=r,r,r,r", [wq, sb],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        wsb = _bcast8_rows(tl.load(ws_ptrs).to(tl.float32) * 16384.0, G, BN)
        wqi = wq.to(tl.int32)
        w_lo = _e2m1_f32(wqi & 15) * wsb
        w_hi = _e2m1_f32(wqi >> 4) * wsb
    return w_lo, w_hi


@triton.jit
def _upcast_pair_dot(acc, a_even, a_odd, wq, ws_ptrs,
                     BN: tl.constexpr, BK: tl.constexpr, INTERP: tl.constexpr, DEQ: tl.constexpr):
    """acc += [a_even | a_odd] @ dequant(w) (bf16 MMA, fp32 accumulate),
    without the weight global scale. ``a_*`` bf16 [BM, BK/2]."""
    w_lo, w_hi = _dequant_w(wq, ws_ptrs, BN, BK, DEQ)
    if INTERP:
        # the CPU interpreter mis-computes bf16 dots: stay in fp32 there
        acc += tl.dot(a_even.to(tl.float32), w_lo.to(tl.float32), input_precision="ieee")
        acc += tl.dot(a_odd.to(tl.float32), w_hi.to(tl.float32), input_precision="ieee")
    else:
        acc += tl.dot(a_even, w_lo.to(tl.bfloat16))
        acc += tl.dot(a_odd, w_hi.to(tl.bfloat16))
    return acc


@triton.jit
def _load_a_pairs(a_ptrs_row, row_mask, BM: tl.constexpr, BK: tl.constexpr):
    """Activation tile [BM, BK] at ``a_ptrs_row`` (pointers [BM, 1]) as its even-k and odd-k halves
    [BM, BK/2]: one contiguous load (16-byte vectors, cp.async-pipelined), split in registers. Two
    stride-2 loads would be 2-byte scalar loads outside the pipeline."""
    kk = tl.arange(0, BK)
    a = tl.load(a_ptrs_row + kk[None, :], mask=row_mask[:, None], other=0.0)
    return tl.split(tl.reshape(a, (BM, BK // 2, 2)))


@triton.jit
def _quant_rows_kernel(a_ptr, q_ptr, s_ptr, gs_ptr, R, K, stride_a, sel_ptr, SEL_HI,
                       BR: tl.constexpr, BK: tl.constexpr, HAS_SEL: tl.constexpr):
    """APRE: NVFP4-quantize rows ``a[r, :K]`` (bf16) once, for every GEMM program that reads them:
    ``q [R, K/2]`` u8 (K-packed, low nibble = even k), ``s [R, K/16]`` e4m3 block scales, ``gs [R]`` fp32
    per-row global scale. Same functions (``_row_gs``, ``_quant_tile``) as the in-loop quantization of
    the fp4 path, so the GEMMs see bit-identical operands. HAS_SEL: only rows ``r`` with
    ``0 <= sel[r] < SEL_HI`` are read and written, the rows of h that GEMM 1 wrote (aligned order:
    ``sel`` = sorted pairs, ``SEL_HI`` = P, padding slots hold P; in-kernel grouping: ``sel`` = the
    routing ids, ``SEL_HI`` = E, dropped pairs have ids outside [0, E)). The other rows were never
    written: quantizing them would read uninitialised memory."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < R
    if HAS_SEL:
        sel = tl.load(sel_ptr + rows, mask=rmask, other=-1)
        rmask &= (sel >= 0) & (sel < SEL_HI)
    r64 = tl.where(rmask, rows, 0).to(tl.int64)
    a_row = a_ptr + r64[:, None] * stride_a
    # program (row block, K chunk): each reads its rows whole for the global scale (cheap next to the
    # quantization math) and quantizes one BK chunk, so small M still spreads over K / BK programs
    gs = _row_gs(a_row, rmask, K, BR, BK)
    jj = tl.arange(0, BK // 2)
    gg = tl.arange(0, BK // 16)
    k0 = tl.program_id(1) * BK
    a_even, a_odd = _load_a_pairs(a_row + k0, rmask, BR, BK)
    packed, bs8 = _quant_tile(a_even.to(tl.float32), a_odd.to(tl.float32), gs, BR, BK)
    tl.store(q_ptr + r64[:, None] * (K // 2) + (k0 // 2 + jj)[None, :], packed, mask=rmask[:, None])
    tl.store(s_ptr + r64[:, None] * (K // 16) + (k0 // 16 + gg)[None, :], bs8, mask=rmask[:, None])
    tl.store(gs_ptr + r64, gs, mask=rmask & (tl.program_id(1) == 0))


@triton.jit
def _fp4_pre_dot(acc, aq, as8, wq, ws_ptrs, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 NATIVE: tl.constexpr):
    """acc[BM, BN] += dequant(aq) @ dequant(w) for an already quantized activation tile (``aq`` u8 [BM, BK/2],
    ``as8`` e4m3 [BM, BK/16]: from _quant_tile in the loop, or from _quant_rows_kernel with APRE), without the
    global scales."""
    G: tl.constexpr = BK // 16
    if NATIVE:
        ws = tl.load(ws_ptrs)
        acc = tl.dot_scaled(aq, as8, "e2m1", wq, ws, "e2m1", acc)
    else:
        # exact emulation (interpreter / no FP4 MMA): decode both operands (the e4m3 block scales are exact
        # in fp32)
        aqi = aq.to(tl.int32)
        asb = _bcast8(as8.to(tl.float32) * 16384.0, BM, G)
        a_lo = _e2m1_f32(aqi & 15) * asb
        a_hi = _e2m1_f32(aqi >> 4) * asb
        wsf = tl.trans(tl.load(ws_ptrs).to(tl.float32))  # [G, BN]
        wsb = _bcast8_rows(wsf * 16384.0, G, BN)
        wqi = wq.to(tl.int32)
        w_lo = _e2m1_f32(wqi & 15) * wsb
        w_hi = _e2m1_f32(wqi >> 4) * wsb
        acc += tl.dot(a_lo, w_lo, input_precision="ieee")
        acc += tl.dot(a_hi, w_hi, input_precision="ieee")
    return acc


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, P, E, MAX_SLOTS, MAX_BLOCKS,
                  BM: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                  FILL: tl.constexpr, BCHUNK: tl.constexpr):
    e_idx = tl.arange(0, E_PAD)
    e_ok = e_idx < E
    # pass 1: tokens per expert
    cnt = tl.zeros([E_PAD], dtype=tl.int32)
    for c in range(0, P, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
        oh = ((ids[:, None] == e_idx[None, :]) & e_ok[None, :]).to(tl.int32)
        cnt += tl.sum(oh, axis=0)
    padded = (cnt + BM - 1) // BM * BM
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    # padding slots point past the last pair
    for s in range(0, MAX_SLOTS, FILL):
        so = s + tl.arange(0, FILL)
        tl.store(sorted_ptr + so, tl.zeros([FILL], dtype=tl.int32) + P, mask=so < MAX_SLOTS)
    # row block -> expert (-1: past the used blocks)
    for b in range(0, MAX_BLOCKS, BCHUNK):
        bo = b + tl.arange(0, BCHUNK)
        pos = bo * BM
        inside = (pos[:, None] >= start[None, :]) & (pos[:, None] < end[None, :])
        eb = tl.sum(tl.where(inside, e_idx[None, :] + 1, 0), axis=1) - 1
        tl.store(block_expert_ptr + bo, eb, mask=bo < MAX_BLOCKS)
    tl.debug_barrier()
    # pass 2: scatter pair indices to their slots (stable within an expert)
    running = start
    for c in range(0, P, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
        oh = ((ids[:, None] == e_idx[None, :]) & e_ok[None, :]).to(tl.int32)
        incl = tl.cumsum(oh, axis=0)
        rank = tl.sum(oh * incl, axis=1) - 1
        base = tl.sum(oh * running[None, :], axis=1)
        valid = tl.sum(oh, axis=1) > 0
        tl.store(sorted_ptr + base + rank, offs, mask=valid & (offs < P))
        running += tl.sum(oh, axis=0)


@triton.jit
def _slot_expert(ids_ptr, slot, P, E, BM: tl.constexpr, P_PAD: tl.constexpr, E_PAD: tl.constexpr):
    """In-kernel grouping (no align launch): program ``slot`` owns one row tile
    of one expert. Row tiles are numbered expert by expert (increasing expert
    id, ``ceil(count / BM)`` tiles each); returns (expert, first rank of the
    tile), expert -1 for slots past the last tile. Grid: ``min(E, P) +
    cdiv(P, BM)`` slots always suffice."""
    offs_p = tl.arange(0, P_PAD)
    ids = tl.load(ids_ptr + offs_p, mask=offs_p < P, other=-1)
    ok = (ids >= 0) & (ids < E)
    hist = tl.histogram(tl.where(ok, ids, 0), E_PAD, mask=ok)
    tiles = (hist + BM - 1) // BM
    incl = tl.cumsum(tiles, axis=0)
    excl = incl - tiles
    eidx = tl.arange(0, E_PAD)
    hit = (tiles > 0) & (excl <= slot) & (slot < incl)
    e = tl.sum(tl.where(hit, eidx + 1, 0), axis=0) - 1
    r0 = tl.sum(tl.where(hit, (slot - excl) * BM, 0), axis=0)
    return e, r0


@triton.jit
def _expert_pairs(ids_ptr, P, E, e, r0, BM: tl.constexpr, P_PAD: tl.constexpr, PC: tl.constexpr = 64):
    """Pairs routed to expert ``e`` with ranks ``r0 .. r0+BM-1`` (stable order)
    as (pair index [BM], valid [BM]). Walks the routing (L2) in chunks of PC
    pairs so the [BM, PC] selection stays small in registers."""
    rr = r0 + tl.arange(0, BM)
    pair = tl.zeros([BM], dtype=tl.int32)
    nsel = tl.zeros([BM], dtype=tl.int32)
    base = 0
    for c0 in range(0, P, PC):
        offs = c0 + tl.arange(0, PC)
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
        mine = ((ids >= 0) & (ids < E) & (ids == e)).to(tl.int32)
        rank = base + tl.cumsum(mine, axis=0) - 1
        sel = (mine[None, :] > 0) & (rank[None, :] == rr[:, None])
        pair += tl.sum(tl.where(sel, offs[None, :], 0), axis=1)
        nsel += tl.sum(sel.to(tl.int32), axis=1)
        base += tl.sum(mine, axis=0)
    return pair, nsel > 0


@triton.jit
def _block_expert(sorted_ptr, block_expert_ptr, pid_m, P, E, BM: tl.constexpr, P_PAD: tl.constexpr,
                  E_PAD: tl.constexpr, GROUPED: tl.constexpr):
    """``(e, r0)``: the expert of row block ``pid_m`` (-1: none) and, GROUPED, the slot's first row within that
    expert's pairs (``_slot_expert``; else 0)."""
    if GROUPED:
        e, r0 = _slot_expert(sorted_ptr, pid_m, P, E, BM, P_PAD, E_PAD)
    else:
        e = tl.load(block_expert_ptr + pid_m)
        r0 = 0
    return e, r0


@triton.jit
def _block_pairs(sorted_ptr, pid_m, e, r0, P, E, BM: tl.constexpr, P_PAD: tl.constexpr, GROUPED: tl.constexpr):
    """``(pair, rvalid, hrow)`` of a row block with an expert: its pair indices, which rows hold one, and the h rows
    they use (GROUPED: found in-kernel from the routing ids, h rows = pair indices; else the align kernel's padded
    sorted order, h rows in that order)."""
    if GROUPED:
        pair, rvalid = _expert_pairs(sorted_ptr, P, E, e, r0, BM, P_PAD)
        hrow = pair
    else:
        hrow = pid_m * BM + tl.arange(0, BM)
        pair = tl.load(sorted_ptr + hrow)
        rvalid = pair < P
    return pair, rvalid, hrow


@triton.jit
def _w_scale_ptrs(ws_ptr, e64, stride_se, stride_sn, offs_n, gg, PATH_FP4: tl.constexpr):
    """Pointers to expert ``e64``'s weight scales of the columns ``offs_n`` and the 16-groups ``gg`` of a K step:
    ``[BN, BK/16]`` on the fp4 path (what dot_scaled wants for rhs), else ``[BK/16, BN]``."""
    if PATH_FP4:
        p = ws_ptr + e64 * stride_se + offs_n[:, None].to(tl.int64) * stride_sn + gg[None, :]
    else:
        p = ws_ptr + e64 * stride_se + offs_n[None, :].to(tl.int64) * stride_sn + gg[:, None]
    return p


@triton.jit
def _gemm1_body(x_ptr, w_ptr, ws_ptr, wg_ptr, h_ptr, e64, pair, rvalid, hrow, pid_n,
                TOPK, H, I, stride_xm, stride_we, stride_wn, stride_se, stride_sn, swiglu_limit,
                HAS_LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, PATH_FP4: tl.constexpr, NATIVE: tl.constexpr,
                INTERP: tl.constexpr, DEQ: tl.constexpr,
                APRE: tl.constexpr = False, xq_ptr=None, xs_ptr=None, xgs_ptr=None):
    tok = tl.where(rvalid, pair // TOPK, 0).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < I
    offs_n = tl.where(nmask, offs_n, 0)
    jj = tl.arange(0, BK // 2)
    gg = tl.arange(0, BK // 16)
    a_row = x_ptr + tok[:, None] * stride_xm
    # weights as [BK/2, BN] (K-packed bytes along dim 0)
    wg_p = w_ptr + e64 * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + jj[:, None]
    wu_p = wg_p + I * stride_wn
    sg_p = _w_scale_ptrs(ws_ptr, e64, stride_se, stride_sn, offs_n, gg, PATH_FP4)
    if PATH_FP4:
        if APRE:
            gs = tl.load(xgs_ptr + tok, mask=rvalid, other=1.0)
            aq_row = xq_ptr + tok[:, None] * (H // 2) + jj[None, :]
            as_row = xs_ptr + tok[:, None] * (H // 16) + gg[None, :]
        else:
            gs = _row_gs(a_row, rvalid, H, BM, BK)
    su_p = sg_p + I * stride_sn
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, H, BK):
        wqg = tl.load(wg_p + k0 // 2)
        wqu = tl.load(wu_p + k0 // 2)
        if PATH_FP4 and APRE:
            aq = tl.load(aq_row + k0 // 2, mask=rvalid[:, None], other=0)
            as8 = tl.load(as_row + k0 // 16, mask=rvalid[:, None], other=0.0)
            acc_g = _fp4_pre_dot(acc_g, aq, as8, wqg, sg_p + k0 // 16, BM, BN, BK, NATIVE)
            acc_u = _fp4_pre_dot(acc_u, aq, as8, wqu, su_p + k0 // 16, BM, BN, BK, NATIVE)
        elif PATH_FP4:
            a_even, a_odd = _load_a_pairs(a_row + k0, rvalid, BM, BK)
            ae = a_even.to(tl.float32)
            ao = a_odd.to(tl.float32)
            acc_g = _fp4_pair_dot(acc_g, ae, ao, gs, wqg, sg_p + k0 // 16, BM, BN, BK, NATIVE)
            acc_u = _fp4_pair_dot(acc_u, ae, ao, gs, wqu, su_p + k0 // 16, BM, BN, BK, NATIVE)
        else:
            a_even, a_odd = _load_a_pairs(a_row + k0, rvalid, BM, BK)
            acc_g = _upcast_pair_dot(acc_g, a_even, a_odd, wqg, sg_p + k0 // 16, BN, BK, INTERP, DEQ)
            acc_u = _upcast_pair_dot(acc_u, a_even, a_odd, wqu, su_p + k0 // 16, BN, BK, INTERP, DEQ)
    g_scale = tl.load(wg_ptr + e64 * 2)
    u_scale = tl.load(wg_ptr + e64 * 2 + 1)
    if not PATH_FP4 and DEQ == 3:
        g_scale = g_scale * 128.0  # the shift decode leaves weights times 2^-7
        u_scale = u_scale * 128.0
    g = acc_g * g_scale
    u = acc_u * u_scale
    if PATH_FP4:
        g = g * gs[:, None]
        u = u * gs[:, None]
    if HAS_LIMIT:
        g = tl.minimum(g, swiglu_limit)
        u = tl.minimum(tl.maximum(u, -swiglu_limit), swiglu_limit)
    h = g / (1.0 + tl.exp(-g)) * u
    h_p = h_ptr + hrow[:, None].to(tl.int64) * I + offs_n[None, :]
    tl.store(h_p, _to_bf16(h, INTERP), mask=rvalid[:, None] & nmask[None, :])


@triton.jit
def _gemm1_kernel(x_ptr, w_ptr, ws_ptr, wg_ptr, sorted_ptr, block_expert_ptr, h_ptr,
                  P, TOPK, H, I,
                  stride_xm, stride_we, stride_wn, stride_se, stride_sn,
                  swiglu_limit,
                  HAS_LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, PATH_FP4: tl.constexpr, NATIVE: tl.constexpr,
                  INTERP: tl.constexpr, DEQ: tl.constexpr = 0,
                  GROUPED: tl.constexpr = False, E=0, P_PAD: tl.constexpr = 16, E_PAD: tl.constexpr = 16,
                  APRE: tl.constexpr = False, xq_ptr=None, xs_ptr=None, xgs_ptr=None):
    """GROUPED=False: row block ``pid_m`` of the align kernel's padded sorted
    order (h rows in that order). GROUPED=True: ``pid_m`` is an expert slot,
    the pairs are found in-kernel from ``sorted_ptr`` = the routing ids, and h
    rows are pair indices."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, r0 = _block_expert(sorted_ptr, block_expert_ptr, pid_m, P, E, BM, P_PAD, E_PAD, GROUPED)
    if e >= 0:
        pair, rvalid, hrow = _block_pairs(sorted_ptr, pid_m, e, r0, P, E, BM, P_PAD, GROUPED)
        _gemm1_body(x_ptr, w_ptr, ws_ptr, wg_ptr, h_ptr, e.to(tl.int64), pair, rvalid, hrow, pid_n,
                    TOPK, H, I, stride_xm, stride_we, stride_wn, stride_se, stride_sn, swiglu_limit,
                    HAS_LIMIT, BM, BN, BK, PATH_FP4, NATIVE, INTERP, DEQ,
                    APRE, xq_ptr, xs_ptr, xgs_ptr)


@triton.jit
def _gemm2_body(h_ptr, w_ptr, ws_ptr, wg_ptr, tw_ptr, y_ptr, e64, pair, rvalid, hrow, pid_n,
                H, I, stride_we, stride_wn, stride_se, stride_sn,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                PATH_FP4: tl.constexpr, NATIVE: tl.constexpr, INTERP: tl.constexpr,
                DEQ: tl.constexpr,
                APRE: tl.constexpr = False, hq_ptr=None, hs_ptr=None, hgs_ptr=None):
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < H
    offs_n = tl.where(nmask, offs_n, 0)
    jj = tl.arange(0, BK // 2)
    gg = tl.arange(0, BK // 16)
    a_row = h_ptr + hrow[:, None].to(tl.int64) * I
    w_p = w_ptr + e64 * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + jj[:, None]
    s_p = _w_scale_ptrs(ws_ptr, e64, stride_se, stride_sn, offs_n, gg, PATH_FP4)
    if PATH_FP4:
        if APRE:
            h64 = tl.where(rvalid, hrow, 0).to(tl.int64)
            gs = tl.load(hgs_ptr + h64, mask=rvalid, other=1.0)
            aq_row = hq_ptr + h64[:, None] * (I // 2) + jj[None, :]
            as_row = hs_ptr + h64[:, None] * (I // 16) + gg[None, :]
        else:
            gs = _row_gs(a_row, rvalid, I, BM, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, I, BK):
        wq = tl.load(w_p + k0 // 2)
        if PATH_FP4 and APRE:
            aq = tl.load(aq_row + k0 // 2, mask=rvalid[:, None], other=0)
            as8 = tl.load(as_row + k0 // 16, mask=rvalid[:, None], other=0.0)
            acc = _fp4_pre_dot(acc, aq, as8, wq, s_p + k0 // 16, BM, BN, BK, NATIVE)
        elif PATH_FP4:
            a_even, a_odd = _load_a_pairs(a_row + k0, rvalid, BM, BK)
            acc = _fp4_pair_dot(acc, a_even.to(tl.float32), a_odd.to(tl.float32), gs, wq,
                                s_p + k0 // 16, BM, BN, BK, NATIVE)
        else:
            a_even, a_odd = _load_a_pairs(a_row + k0, rvalid, BM, BK)
            acc = _upcast_pair_dot(acc, a_even, a_odd, wq, s_p + k0 // 16, BN, BK, INTERP, DEQ)
    scale = tl.load(wg_ptr + e64)
    if not PATH_FP4 and DEQ == 3:
        scale = scale * 128.0  # the shift decode leaves weights times 2^-7
    tw = tl.load(tw_ptr + tl.where(rvalid, pair, 0), mask=rvalid, other=0.0)
    if PATH_FP4:
        y = acc * (scale * gs * tw)[:, None]
    else:
        y = acc * (scale * tw)[:, None]
    y_p = y_ptr + tl.where(rvalid, pair, 0).to(tl.int64)[:, None] * H + offs_n[None, :]
    tl.store(y_p, y, mask=rvalid[:, None] & nmask[None, :])


@triton.jit
def _gemm2_kernel(h_ptr, w_ptr, ws_ptr, wg_ptr, sorted_ptr, block_expert_ptr, tw_ptr, y_ptr,
                  P, H, I,
                  stride_we, stride_wn, stride_se, stride_sn,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  PATH_FP4: tl.constexpr, NATIVE: tl.constexpr, INTERP: tl.constexpr,
                  DEQ: tl.constexpr = 0,
                  GROUPED: tl.constexpr = False, E=0, P_PAD: tl.constexpr = 16, E_PAD: tl.constexpr = 16,
                  APRE: tl.constexpr = False, hq_ptr=None, hs_ptr=None, hgs_ptr=None):
    """See :func:`_gemm1_kernel` for GROUPED (h rows are then pair indices)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, r0 = _block_expert(sorted_ptr, block_expert_ptr, pid_m, P, E, BM, P_PAD, E_PAD, GROUPED)
    if e >= 0:
        pair, rvalid, hrow = _block_pairs(sorted_ptr, pid_m, e, r0, P, E, BM, P_PAD, GROUPED)
        _gemm2_body(h_ptr, w_ptr, ws_ptr, wg_ptr, tw_ptr, y_ptr, e.to(tl.int64), pair, rvalid, hrow,
                    pid_n, H, I, stride_we, stride_wn, stride_se, stride_sn,
                    BM, BN, BK, PATH_FP4, NATIVE, INTERP, DEQ,
                    APRE, hq_ptr, hs_ptr, hgs_ptr)


@triton.jit
def _reduce_kernel(y_ptr, ids_ptr, out_ptr, H, E, TOPK: tl.constexpr, BLOCK: tl.constexpr,
                   INTERP: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(TOPK):
        eid = tl.load(ids_ptr + t * TOPK + j)
        ok = (eid >= 0) & (eid < E)
        v = tl.load(y_ptr + (t * TOPK + j) * H + offs, mask=m & ok, other=0.0)
        acc += v
    tl.store(out_ptr + t * H + offs, _to_bf16(acc, INTERP), mask=m)
