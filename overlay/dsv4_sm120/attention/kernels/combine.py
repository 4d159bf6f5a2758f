"""Combine kernel: merges the ``S`` partials of each (row, head) and the sink into ``out`` and ``lse``."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def combine_kernel(
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
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BALANCED: tl.constexpr = False,
    NB=1,
    W=1,
    C=1,
    BH: tl.constexpr = 16,
):
    # grid (T, H, 512 // BLOCK_D): program (t, h, db) owns columns db*BLOCK_D.. of head h of row t. m / l of a
    # split are scalars (a per-head vector would get a layout of its own and a shared-memory conversion, with
    # barriers, at every step), and the S partials are merged online: a runtime loop over chunks of
    # BLOCK_S splits; per chunk, the BLOCK_S loads ([BLOCK_D] slices of partial rows, 4 fp32 per
    # thread at the default plan) are all issued first, then one rescale to the chunk's max and an
    # element-wise FMA per split: the S reduction stays inside each thread and a chunk costs one
    # memory round trip. A ragged last chunk is masked (masked loads issue no memory traffic).
    # BALANCED (a balanced split launch, plan.plan_balanced): row (t, head group h // BH) has as many partials as
    # runs it spans (plan.balanced_cut), S is the most of any row; a row of one piece was written by its split
    # program and is left alone.
    t = tl.program_id(0)
    h = tl.program_id(1)
    db = tl.program_id(2)
    if BALANCED:
        r = t.to(tl.int64) * (HP // BH) + h // BH
        n_parts = (((r + 1) * NB * C - 1) // W - ((r * NB + 1) * C - 1) // W + 1).to(tl.int32)
        if n_parts > 1:
            _merge(acc_ws, m_ws, l_ws, sink_ptr, out_ptr, lse_ptr, H, S, HP, t, h, db, n_parts, HAS_SINK, BLOCK_D,
                   BLOCK_S)
    else:
        _merge(acc_ws, m_ws, l_ws, sink_ptr, out_ptr, lse_ptr, H, S, HP, t, h, db, S, HAS_SINK, BLOCK_D, BLOCK_S)


@triton.jit
def _merge(acc_ws, m_ws, l_ws, sink_ptr, out_ptr, lse_ptr, H, S, HP, t, h, db, n_parts, HAS_SINK: tl.constexpr,
           BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    # the n_parts partials of (t, h), columns db*BLOCK_D.., into out and lse (workspace rows (t*S + s)*HP + h)
    offs_d = db * BLOCK_D + tl.arange(0, BLOCK_D)
    row0 = t.to(tl.int64) * S * HP + h  # workspace row of (t, split 0, h)
    m_run = tl.full([], float("-inf"), tl.float32)  # running max over the splits so far (base 2)
    l_run = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, n_parts, BLOCK_S):
        # all loads of the chunk first: ptxas does not hoist a split's loads above the previous
        # split's math, so interleaving them would cost one round trip per split
        ms = ()
        ls = ()
        parts = ()
        for i in tl.static_range(BLOCK_S):
            ok = s0 + i < n_parts
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
