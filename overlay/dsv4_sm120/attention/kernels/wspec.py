"""Split kernel, warp-specialized body (``impl=wspec``, bf16 QK only; Gluon, GPU only): four producer warps gather
and decode the candidate blocks into a two-slot shared-memory ring while the consumer warps (the launch's
``num_warps``) run QK, the online softmax and PV on the block before; two mbarriers per slot hand it back and forth.
Only ``mma.sync``-class MMAs (Gluon's ``mma_v2``) and mbarriers: it runs on sm_120 as on Hopper.

Why: the register body is bound by the latency of its per-block chain (gather -> decode -> shared memory -> MMA ->
softmax -> PV) at two CTAs of four warps per SM. Here the gathers and the decode (~45% of that body's
instructions) run in other warps, concurrently with the MMAs.

Heads per program (``BLOCK_H``): every block is gathered and decoded once for all of them, so at 32 / 64 heads a
block is read once instead of two / four times (16-head programs each read it).

* 16: 4 consumer warps, each 8 of the 32 candidates' columns of QK and 16 of each 64-column PV tile. With
  ``maxnreg=128`` (Hopper) two CTAs of eight warps fit an SM; the producers give registers up (``PRODUCER_REGS`` 96)
  and the consumers take them. Ring and Q: 83 KB (one CTA per sm_120 SM).
* 32: 8 consumer warps as 2 x 4 (MMA rows x columns): the [32, 512] fp32 accumulator is 64 registers each; Q (32
  KB) and the ring (2 x 32 candidates, 64 KB) take 100388 B of sm_120's 99 KB per block; 12 warps at
  ``maxnreg=168`` fill the register file, consumers at 200, producers at 104.
* 64: 8 consumer warps as 4 x 2: the [64, 512] accumulator is 128 registers each (consumers at 208, producers 88);
  Q is 64 KB, so the ring holds two 16-candidate blocks (32 KB; producer loads of 8 bytes, a candidate's 64-byte
  tile row by one warp).

The Gluon bodies' spanning-split contract (``kernels/__init__``). Triton's CPU interpreter does not run
Gluon: the tests compile it for sm_90 and sm_120 and the H200 runs it. The e4m3 decode is
``common.E4M3_BF16_ASM``'s, on 32-bit words.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mbarrier, mma_v2

from .common import (E4M3_BF16_ASM, _online_softmax, _segment_bounds, _store_partial,
                     _store_softmax_state, _token_rows)

# one 32-bit word of four e4m3 bytes and its tile's UE8M0 scale as a bf16 pair ($3) -> two bf16 pairs (the four
# values, scaled, exact): common.E4M3_BF16_ASM's bit moves, each result then multiplied by the scale
E4M3X4_SCALED_ASM = gl.constexpr(
    E4M3_BF16_ASM.value.replace(".reg .b32 z, x, a, s, nz;", ".reg .b32 z, x, a, s, nz, v;")
    .replace("fma.rn.bf16x2 $0, a, s, nz;", "fma.rn.bf16x2 v, a, s, nz;\nmul.rn.bf16x2 $0, v, $3;")
    .replace("fma.rn.bf16x2 $1, a, s, nz;", "fma.rn.bf16x2 v, a, s, nz;\nmul.rn.bf16x2 $1, v, $3;"))
if E4M3X4_SCALED_ASM.value.count("mul.rn.bf16x2") != 2 or " nz, v;" not in E4M3X4_SCALED_ASM.value:
    # common's text changed: the scale would be lost, or its register undeclared
    raise RuntimeError("wspec: E4M3_BF16_ASM no longer has the register list and two fma lines this kernel extends")


@gluon.jit
def _block_idx(idx_row, n0, cend, BLOCK_N: gl.constexpr):
    # the candidates' slot ids at n0 .. (-1 past cend), in the layout _gather_rows takes them
    BL: gl.constexpr = gl.BlockedLayout([1, BLOCK_N // 8], [8, 4], [BLOCK_N // 8, 32 // BLOCK_N], [1, 0])
    cand = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, BL))
    return gl.load(idx_row + cand, mask=cand < cend, other=-1)


@gluon.jit
def _gather_rows(cache, idx, n0, end, P, PB64, PB2_64, BLOCK_N: gl.constexpr):
    # the raw block of the candidates n0 .. with slot ids idx (_block_idx): seven [BLOCK_N, 16]-word e4m3 tiles,
    # the [BLOCK_N] scale rows as two 32-bit words (UE8M0 bytes of tiles 0-3 and 4-6, little-endian: two loads and
    # two registers instead of seven of each), the [BLOCK_N, 32]-word rope (bf16 pairs), and which candidates exist
    # ([BLOCK_N] bool)
    BL: gl.constexpr = gl.BlockedLayout([1, BLOCK_N // 8], [8, 4], [BLOCK_N // 8, 32 // BLOCK_N], [1, 0])
    BR: gl.constexpr = gl.BlockedLayout([1, BLOCK_N // 4], [8, 4], [BLOCK_N // 8, 32 // BLOCK_N], [1, 0])
    lanes = gl.arange(0, 16, layout=gl.SliceLayout(0, BL))
    cand = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, BL))
    valid, row, sb, ro = _token_rows(idx, cand < end, P, PB64, PB2_64)
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
    s_lo = gl.load(words + sb // 4, mask=valid, other=0)
    s_hi = gl.load(words + sb // 4 + 1, mask=valid, other=0)
    lanes32 = gl.arange(0, 32, layout=gl.SliceLayout(0, BR))
    r0 = gl.expand_dims(gl.convert_layout(ro // 2, gl.SliceLayout(1, BR)), 1) + gl.expand_dims(lanes32, 0)
    rope = gl.load(words + r0, mask=gl.expand_dims(gl.convert_layout(valid, gl.SliceLayout(1, BR)), 1), other=0)
    return k0, k1, k2, k3, k4, k5, k6, s_lo, s_hi, rope, valid


@gluon.jit
def _gather(cache, idx_row, n0, cend, end, P, PB64, PB2_64, BLOCK_N: gl.constexpr):
    # the raw block at candidates n0 .. (_gather_rows of their _block_idx)
    return _gather_rows(cache, _block_idx(idx_row, n0, cend, BLOCK_N), n0, end, P, PB64, PB2_64, BLOCK_N)


@gluon.jit
def _dec(k32, sw, SHIFT: gl.constexpr):
    # a [BLOCK_N, 16]-word e4m3 tile and its [BLOCK_N] UE8M0 scales (byte SHIFT / 8 of the scale words ``sw``) -> its
    # 64 bf16 values as [BLOCK_N, 32] words
    sc = (sw >> SHIFT) & 0xFF
    sc2 = gl.expand_dims((sc << 7) | (sc << 23), 1)  # the scale 2^(byte - 127) as a bf16 pair
    lo, hi = gl.inline_asm_elementwise(E4M3X4_SCALED_ASM, "=r,=r,r,r", [k32, sc2], dtype=(gl.int32, gl.int32),
                                       is_pure=True, pack=1)
    return gl.join(lo, hi).reshape([k32.shape[0], 32])


@gluon.jit
def _store_block(slot_w, raw):
    # decode a raw block into a ring slot's word view [BLOCK_N, 256], tile by tile (a few registers at a time):
    # nope tile t -> word columns 32t .., rope -> 224 ..
    k0, k1, k2, k3, k4, k5, k6, s_lo, s_hi, rope, valid = raw
    slot_w.slice(0, 32, dim=1).store(_dec(k0, s_lo, 0))
    slot_w.slice(32, 32, dim=1).store(_dec(k1, s_lo, 8))
    slot_w.slice(64, 32, dim=1).store(_dec(k2, s_lo, 16))
    slot_w.slice(96, 32, dim=1).store(_dec(k3, s_lo, 24))
    slot_w.slice(128, 32, dim=1).store(_dec(k4, s_hi, 0))
    slot_w.slice(160, 32, dim=1).store(_dec(k5, s_hi, 8))
    slot_w.slice(192, 32, dim=1).store(_dec(k6, s_hi, 16))
    slot_w.slice(224, 32, dim=1).store(rope)


@gluon.jit
def _produce(i, ring_w, full, empty, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, t, start, chunk,
             HAS_LEN: gl.constexpr, BLOCK_N: gl.constexpr, SLOTS: gl.constexpr):
    # the producer's pass over [start, start + chunk) of one cache: block j goes to slot (i + j) % SLOTS once the
    # consumer has freed it; returns the running block count
    idx_row = idx_ptr + t.to(gl.int64) * idx_st
    cend, end = _segment_bounds(len_ptr, K, t, start, chunk, HAS_LEN)
    PB64 = PB.to(gl.int64)
    PB2_64 = PB2.to(gl.int64)
    raw = _gather(cache, idx_row, start, cend, end, P, PB64, PB2_64, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        nxt = _gather(cache, idx_row, n0 + BLOCK_N, cend, end, P, PB64, PB2_64, BLOCK_N)
        b = i % SLOTS
        mbarrier.wait(empty.index(b), ((i // SLOTS) & 1) ^ 1)
        _store_block(ring_w.index(b), raw)
        mbarrier.arrive(full.index(b))
        raw = nxt
        i += 1
    return i


@gluon.jit
def _consume(i, m_i, l_i, o0, o1, o2, o3, o4, o5, o6, o7, q_s, ring, full, empty, idx_ptr, idx_st, len_ptr, K,
             t, start, chunk, sm_scale_log2, HAS_LEN: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
             SLOTS: gl.constexpr, CWARPS: gl.constexpr):
    # the consumer's pass over the same blocks: QK over the eight 64-dim tiles, online softmax, PV into the eight
    # [BLOCK_H, 64] accumulator tiles; the slot goes back to the producer after PV
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[BLOCK_H // 16, CWARPS * 16 // BLOCK_H],
                                                  instr_shape=[16, 8])
    opA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    opB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    idx_row = idx_ptr + t.to(gl.int64) * idx_st
    cend, end = _segment_bounds(len_ptr, K, t, start, chunk, HAS_LEN)
    offs_c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    for n0 in range(start, end, BLOCK_N):
        cc = n0 + offs_c
        ic = gl.load(idx_row + cc, mask=cc < cend, other=-1)
        vc = (cc < end) & (ic >= 0)
        b = i % SLOTS
        mbarrier.wait(full.index(b), (i // SLOTS) & 1)
        kv = ring.index(b)
        s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, mma)
        for tt in gl.static_range(8):
            s = mma_v2(q_s.slice(tt * 64, 64, dim=1).load(opA),
                       kv.slice(tt * 64, 64, dim=1).permute([1, 0]).load(opB), s)
        p, alpha, m_i, l_i = _online_softmax(s, vc, m_i, l_i, sm_scale_log2)
        a2 = gl.expand_dims(alpha, 1)
        pa = gl.convert_layout(p.to(gl.bfloat16), opA)
        o0 = mma_v2(pa, kv.slice(0, 64, dim=1).load(opB), o0 * a2)
        o1 = mma_v2(pa, kv.slice(64, 64, dim=1).load(opB), o1 * a2)
        o2 = mma_v2(pa, kv.slice(128, 64, dim=1).load(opB), o2 * a2)
        o3 = mma_v2(pa, kv.slice(192, 64, dim=1).load(opB), o3 * a2)
        o4 = mma_v2(pa, kv.slice(256, 64, dim=1).load(opB), o4 * a2)
        o5 = mma_v2(pa, kv.slice(320, 64, dim=1).load(opB), o5 * a2)
        o6 = mma_v2(pa, kv.slice(384, 64, dim=1).load(opB), o6 * a2)
        o7 = mma_v2(pa, kv.slice(448, 64, dim=1).load(opB), o7 * a2)
        mbarrier.arrive(empty.index(b))
        i += 1
    return i, m_i, l_i, o0, o1, o2, o3, o4, o5, o6, o7


@gluon.jit
def _producer(ring_w, full, empty, t, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, start, chunk,
              cache2, idx2_ptr, idx2_st, len2_ptr, K2, P2, PB_2, PB2_2,
              HAS_LEN: gl.constexpr, HAS_LEN2: gl.constexpr, HAS_2: gl.constexpr, BLOCK_N: gl.constexpr,
              SLOTS: gl.constexpr):
    # the program's chunk [start, start + chunk) of main ++ extra: the main cache's part, then the extra cache's
    i = 0
    if start < K:
        i = _produce(i, ring_w, full, empty, cache, idx_ptr, idx_st, len_ptr, K, P, PB, PB2, t, start, chunk,
                     HAS_LEN, BLOCK_N, SLOTS)
    if HAS_2:
        if start + chunk > K:
            lo2 = gl.maximum(start - K, 0)
            i = _produce(i, ring_w, full, empty, cache2, idx2_ptr, idx2_st, len2_ptr, K2, P2, PB_2, PB2_2, t,
                         lo2, start + chunk - K - lo2, HAS_LEN2, BLOCK_N, SLOTS)


@gluon.jit
def _consumer(q_s, ring, full, empty, q_ptr, stride_qt, stride_qh, t, s, g,
              idx_ptr, idx_st, len_ptr, K, start, chunk, idx2_ptr, idx2_st, len2_ptr, K2,
              acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
              HAS_LEN: gl.constexpr, HAS_LEN2: gl.constexpr, HAS_2: gl.constexpr, BLOCK_H: gl.constexpr,
              BLOCK_N: gl.constexpr, SLOTS: gl.constexpr, CWARPS: gl.constexpr):
    # the program's chunk of main ++ extra (as _producer), then its partial to the workspace
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[BLOCK_H // 16, CWARPS * 16 // BLOCK_H],
                                                  instr_shape=[16, 8])
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [CWARPS, 1], [1, 0])
    t64 = t.to(gl.int64)
    # Q of the program's heads into shared memory, once
    hq = g * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, QL))
    dq = gl.arange(0, 512, layout=gl.SliceLayout(0, QL))
    q = gl.load(q_ptr + t64 * stride_qt + gl.expand_dims(hq.to(gl.int64) * stride_qh, 1) + gl.expand_dims(dq, 0),
                mask=gl.expand_dims(hq < H, 1), other=0.0)
    q_s.store(q)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, mma))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, mma))
    o0 = gl.zeros([BLOCK_H, 64], gl.float32, mma)
    o1 = gl.zeros([BLOCK_H, 64], gl.float32, mma)
    o2 = gl.zeros([BLOCK_H, 64], gl.float32, mma)
    o3 = gl.zeros([BLOCK_H, 64], gl.float32, mma)
    o4 = gl.zeros([BLOCK_H, 64], gl.float32, mma)
    o5 = gl.zeros([BLOCK_H, 64], gl.float32, mma)
    o6 = gl.zeros([BLOCK_H, 64], gl.float32, mma)
    o7 = gl.zeros([BLOCK_H, 64], gl.float32, mma)
    i = 0
    if start < K:
        i, m_i, l_i, o0, o1, o2, o3, o4, o5, o6, o7 = _consume(
            i, m_i, l_i, o0, o1, o2, o3, o4, o5, o6, o7, q_s, ring, full, empty, idx_ptr, idx_st, len_ptr, K,
            t, start, chunk, sm_scale_log2, HAS_LEN, BLOCK_H, BLOCK_N, SLOTS, CWARPS)
    if HAS_2:
        if start + chunk > K:
            lo2 = gl.maximum(start - K, 0)
            i, m_i, l_i, o0, o1, o2, o3, o4, o5, o6, o7 = _consume(
                i, m_i, l_i, o0, o1, o2, o3, o4, o5, o6, o7, q_s, ring, full, empty, idx2_ptr, idx2_st,
                len2_ptr, K2, t, lo2, start + chunk - K - lo2, sm_scale_log2, HAS_LEN2, BLOCK_H, BLOCK_N, SLOTS,
                CWARPS)
    # the partial: the eight [BLOCK_H, 64] tiles of each head (nope 0..447 then rope) and (m, l)
    h = g * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, mma))
    base = (t64 * S + s) * HP + h
    _store_partial(acc_ws, base, h < H, gl.arange(0, 64, layout=gl.SliceLayout(0, mma)), o0, o1, o2, o3, o4, o5,
                   o6, o7)
    _store_softmax_state(m_ws, l_ws, base, h < H, m_i, l_i)


@gluon.jit
def split_kernel_wspec(
    q_ptr, stride_qt, stride_qh,
    main_ptr, main_idx_ptr, main_idx_st, main_len_ptr, main_K, main_P, main_PB, main_PB2,
    extra_ptr, extra_idx_ptr, extra_idx_st, extra_len_ptr, extra_K, extra_P, extra_PB, extra_PB2,
    chunk, acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
    HAS_MAIN_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_EXTRA_LEN: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, PRODUCER_REGS: gl.constexpr, SLOTS: gl.constexpr = 2,
    CWARPS: gl.constexpr = 4,
):
    """The spanning-split contract (bf16 QK), with the warp-specialized body: ``CWARPS`` consumer warps
    (the launch's ``num_warps``) for ``BLOCK_H`` heads (16, 32 or 64; the MMA tiles' rows split over
    ``BLOCK_H / 16`` of them) and 4 producer warps gathering ``BLOCK_N``-candidate blocks (32 or 16) into a ring of
    ``SLOTS`` (1 or 2)."""
    gl.static_assert((BLOCK_H == 16) | (BLOCK_H == 32) | (BLOCK_H == 64),
                     "the warp-specialized body takes 16, 32 or 64 heads per program")
    gl.static_assert((BLOCK_N == 32) | (BLOCK_N == 16), "the warp-specialized body gathers 16 or 32 candidates a block")
    gl.static_assert(CWARPS * 16 >= BLOCK_H, "each consumer warp takes 16 or more heads' MMA rows")
    t = gl.program_id(0)
    s = gl.program_id(1)
    g = gl.program_id(2)
    main = main_ptr.to(gl.pointer_type(gl.uint8))
    extra = extra_ptr.to(gl.pointer_type(gl.uint8))
    # this program's candidates: chunk s of main ++ extra (spanning splits only)
    start = s * chunk
    KV2: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    KVW: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
    ring = gl.allocate_shared_memory(gl.bfloat16, [SLOTS, BLOCK_N, 512], KV2)
    ring_w = ring._reinterpret(gl.int32, [SLOTS, BLOCK_N, 256], KVW)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 512], KV2)
    full = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(SLOTS):
        mbarrier.init(full.index(j), count=1)
        mbarrier.init(empty.index(j), count=1)
    gl.warp_specialize([
        (_consumer, (q_s, ring, full, empty, q_ptr, stride_qt, stride_qh, t, s, g,
                     main_idx_ptr, main_idx_st, main_len_ptr, main_K, start, chunk, extra_idx_ptr, extra_idx_st, extra_len_ptr, extra_K,
                     acc_ws, m_ws, l_ws, H, S, HP, sm_scale_log2,
                     HAS_MAIN_LEN, HAS_EXTRA_LEN, HAS_EXTRA, BLOCK_H, BLOCK_N, SLOTS, CWARPS)),
        (_producer, (ring_w, full, empty, t, main, main_idx_ptr, main_idx_st, main_len_ptr, main_K, main_P, main_PB,
                     main_PB2, start, chunk,
                     extra, extra_idx_ptr, extra_idx_st, extra_len_ptr, extra_K, extra_P, extra_PB, extra_PB2,
                     HAS_MAIN_LEN, HAS_EXTRA_LEN, HAS_EXTRA, BLOCK_N, SLOTS)),
    ], [4], [PRODUCER_REGS])
