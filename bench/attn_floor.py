"""Gather floor of the sparse MLA decode: a read-only Triton kernel that moves exactly the bytes a decode call must
move, through the same gather pattern, and computes nothing else (``bench/bench_attention.py`` times it next to
ours and FlashMLA as the ``gather-floor`` impl; docs/attention.md, "How to benchmark").

Per query row it reads, once:

* for each valid candidate of the main list and of the extra list (``j < length`` and index >= 0): the token's
  576-byte row at ``page * page_bytes + off * 576`` and its 8-byte scale row at ``page * page_bytes + P * 576 +
  off * 8`` of its paged cache (the ``[N, P, 1, 584]`` views with their own page strides), i.e. 584 bytes;
* the candidate indices it walks (4 bytes each, up to the row's length) and its lengths (not in the checksum: the
  gather addresses depend on them);
* its q row (``H x 512`` bf16), and it writes its ``out`` row (``H x 512`` bf16, zeros).

Every loaded 32-bit word is added (wrapping) into a per-program checksum written to ``checksum[t, s]``, so no load
can be dropped; ``checksum[t].sum() mod 2^32`` equals the sum of the row's words (:func:`reference_checksum`).

Rows are independent: a row reads its own candidate list even when the rows of one request list the same
tokens (speculative verify rows), as the decode kernel does; the cache may then serve repeats from L2, for both.
Work split: grid ``(T, S)``; the main and the extra list are cut into chunks of whole ``BLOCK_N`` blocks,
``S = s1 + s2`` programs per row, aimed at ``waves`` programs per SM in all (``plan_splits`` of the decode kernel,
one head group); program ``s`` also reads and writes its ``1/S`` share of the row's q and out.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "overlay"))

from dsv4_sm120.attention.plan import cdiv, plan_splits  # noqa: E402

ROW_WORDS = 144    # 576 bytes: 128 + 16 words
SCALE_WORDS = 2    # 8 bytes
BYTES_PER_TOKEN = 584
Q_BLOCK = 1024     # words of q / out per step


@triton.jit
def _word_rows(idx, inb, P, PBW):
    """Page addressing of a block of candidates in 4-byte words (the kernels' ``_token_rows`` in bytes): (valid,
    word offset of each token's 576-byte row, word offset of its 8-byte scale row)."""
    valid = inb & (idx >= 0)
    idx = tl.maximum(idx, 0)
    page32 = idx // P
    off = (idx - page32 * P).to(tl.int64)
    page = page32.to(tl.int64)
    return valid, page * PBW + off * 144, page * PBW + P * 144 + off * 2


@triton.jit
def _gather_list(acc_a, acc_b, acc_c, cache, idx_row, j0, j1, P, PBW, BLOCK_N: tl.constexpr):
    """Add the 146 words of each valid candidate ``j0 <= j < j1`` of one index list into the accumulators."""
    lanes = tl.arange(0, BLOCK_N)
    wa = tl.arange(0, 128)
    wb = tl.arange(0, 16)
    wc = tl.arange(0, 2)
    for j in range(j0, j1, BLOCK_N):
        jj = j + lanes
        inb = jj < j1
        valid, row, sc = _word_rows(tl.load(idx_row + jj, mask=inb, other=-1), inb, P, PBW)
        m = valid[:, None]
        acc_a += tl.load(cache + row[:, None] + wa[None, :], mask=m, other=0)
        acc_b += tl.load(cache + row[:, None] + 128 + wb[None, :], mask=m, other=0)
        acc_c += tl.load(cache + sc[:, None] + wc[None, :], mask=m, other=0)
    return acc_a, acc_b, acc_c


@triton.jit(do_not_specialize=["s1", "S"])  # split counts: one compile whatever the plan
def gather_floor_kernel(q_ptr, out_ptr, QW, QCH,
                        main_ptr, idx1_ptr, idx1_stride, len1_ptr, K1, P1, PBW1, c1, s1,
                        extra_ptr, idx2_ptr, idx2_stride, len2_ptr, K2, P2, PBW2, c2,
                        cs_ptr, S,
                        HAS_EXTRA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr):
    """Grid ``(T, S)``. Program ``(t, s)``: candidates of chunk ``s`` (main for ``s < s1``, else extra chunk
    ``s - s1``) of row ``t``, and words ``[s*QCH, (s+1)*QCH)`` of its q row (read) and out row (written 0);
    ``cs[t, s]`` = the wrapped int32 sum of every word it loaded (stored as int64)."""
    t = tl.program_id(0)
    s = tl.program_id(1)
    acc_a = tl.zeros([BLOCK_N, 128], dtype=tl.int32)
    acc_b = tl.zeros([BLOCK_N, 16], dtype=tl.int32)
    acc_c = tl.zeros([BLOCK_N, 2], dtype=tl.int32)
    if s < s1:
        n = tl.minimum(tl.load(len1_ptr + t), K1)
        j0 = s * c1
        acc_a, acc_b, acc_c = _gather_list(acc_a, acc_b, acc_c, main_ptr, idx1_ptr + t.to(tl.int64) * idx1_stride,
                                           j0, tl.minimum(j0 + c1, n), P1, PBW1, BLOCK_N)
    else:
        if HAS_EXTRA:
            n2 = tl.minimum(tl.load(len2_ptr + t), K2)
            j0 = (s - s1) * c2
            acc_a, acc_b, acc_c = _gather_list(acc_a, acc_b, acc_c, extra_ptr,
                                               idx2_ptr + t.to(tl.int64) * idx2_stride,
                                               j0, tl.minimum(j0 + c2, n2), P2, PBW2, BLOCK_N)
    # q in, out back: this program's share of the row
    qa = tl.zeros([BLOCK_Q], dtype=tl.int32)
    lq = tl.arange(0, BLOCK_Q)
    base = t.to(tl.int64) * QW
    w0 = s * QCH
    w1 = tl.minimum(w0 + QCH, QW)
    for w in range(w0, w1, BLOCK_Q):
        ww = w + lq
        mq = ww < w1
        qa += tl.load(q_ptr + base + ww, mask=mq, other=0)
        tl.store(out_ptr + base + ww, tl.zeros([BLOCK_Q], dtype=tl.int32), mask=mq)
    total = (tl.sum(tl.sum(acc_a.to(tl.int64), axis=1), axis=0) + tl.sum(tl.sum(acc_b.to(tl.int64), axis=1), axis=0)
             + tl.sum(tl.sum(acc_c.to(tl.int64), axis=1), axis=0) + tl.sum(qa.to(tl.int64), axis=0))
    tl.store(cs_ptr + t.to(tl.int64) * S + s, total)


def _words(k_cache: torch.Tensor):
    """``[N, P, 1, 584]`` page view -> (``[N, page_bytes/4]`` int32 words of its pages, P, page words)."""
    if k_cache.ndim == 3:
        k_cache = k_cache.unsqueeze(2)
    n, P = k_cache.shape[0], k_cache.shape[1]
    pb = k_cache.stride(0)
    if k_cache.element_size() != 1 or k_cache.shape[-1] != BYTES_PER_TOKEN or pb % 16 or pb < P * BYTES_PER_TOKEN:
        raise ValueError(f"not a V4 page view: shape {tuple(k_cache.shape)}, page stride {pb}")
    raw = torch.as_strided(k_cache.view(torch.uint8), (n, pb), (pb, 1))
    return raw.view(torch.int32), P, pb // 4


def _lengths(x, idx: torch.Tensor) -> torch.Tensor:
    T, K = idx.shape[0], idx.shape[-1]
    if x is None:
        return torch.full((T,), K, dtype=torch.int32, device=idx.device)
    return x.reshape(T).to(torch.int32).contiguous()


def _indices(ind: torch.Tensor) -> torch.Tensor:
    ind = ind.reshape(ind.shape[0], ind.shape[-1])
    return ind.to(torch.int32).contiguous()


class GatherFloor:
    """The floor's launch for fixed inputs (the benchmark's keyword arguments of one layer call): ``()`` runs it
    and returns (out ``[T, 1, H, 512]`` bf16 of zeros, checksum ``[T, S]`` int64). Tensors are prepared once, so
    a call is one kernel launch (CUDA-graph capturable)."""

    def __init__(self, q, k_cache, indices, topk_length=None, extra_k_cache=None, extra_indices_in_kvcache=None,
                 extra_topk_length=None, *, num_sms: int, waves: float = 8.0, block_n: int = 16, num_warps: int = 4,
                 **_ignored):
        T, _, H, D = q.shape
        if D != 512 or q.dtype != torch.bfloat16:
            raise ValueError(f"q must be [T, 1, H, 512] bf16, got {tuple(q.shape)} {q.dtype}")
        self.q = q.contiguous().view(torch.int32)            # [T, 1, H, 256] words
        self.out = torch.empty((T, 1, H, 512), dtype=torch.bfloat16, device=q.device)
        self.main, self.P1, self.PBW1 = _words(k_cache)
        self.idx1 = _indices(indices)
        self.len1 = _lengths(topk_length, self.idx1)
        K1 = self.idx1.shape[1]
        if extra_k_cache is not None and extra_indices_in_kvcache is not None:
            self.extra, self.P2, self.PBW2 = _words(extra_k_cache)
            self.idx2 = _indices(extra_indices_in_kvcache)
            self.len2 = _lengths(extra_topk_length, self.idx2)
            K2 = self.idx2.shape[1]
        else:
            self.extra, self.P2, self.PBW2, self.idx2, self.len2, K2 = self.main, self.P1, self.PBW1, self.idx1, \
                self.len1, 0
        s1, c1, s2, c2 = plan_splits(T, 1, K1, K2, block_n, num_sms, waves)
        self.T, self.K1, self.K2, self.S, self.s1, self.c1, self.c2 = T, K1, K2, s1 + s2, s1, c1, c2
        self.QW = H * 256
        self.QCH = cdiv(cdiv(self.QW, self.S), 64) * 64        # 256-byte aligned shares
        self.cs = torch.empty((T, self.S), dtype=torch.int64, device=q.device)
        self.block_n, self.num_warps = block_n, num_warps
        self.plan = f"S={self.S} ({s1}+{s2}),BLOCK_N={block_n},waves={waves:g},num_warps={num_warps}"

    def __call__(self):
        gather_floor_kernel[(self.T, self.S)](
            self.q, self.out.view(torch.int32), self.QW, self.QCH,
            self.main, self.idx1, self.idx1.stride(0), self.len1, self.K1, self.P1, self.PBW1, self.c1, self.s1,
            self.extra, self.idx2, self.idx2.stride(0), self.len2, self.K2, self.P2, self.PBW2, self.c2,
            self.cs, self.S,
            HAS_EXTRA=self.K2 > 0, BLOCK_N=self.block_n, BLOCK_Q=Q_BLOCK, num_warps=self.num_warps)
        return self.out, self.cs


def checksum(cs: torch.Tensor) -> torch.Tensor:
    """Per-row checksum ``[T]`` (int64 in ``[0, 2^32)``) from the kernel's ``[T, S]`` partials."""
    return cs.sum(1) & 0xFFFFFFFF


def reference_checksum(q, k_cache, indices, topk_length=None, extra_k_cache=None, extra_indices_in_kvcache=None,
                       extra_topk_length=None, **_ignored) -> torch.Tensor:
    """The same bytes summed by torch, row by row: ``[T]`` int64 in ``[0, 2^32)`` = (sum of the row's q words and
    the 146 words of every valid candidate of both lists) mod 2^32."""
    T = q.shape[0]
    qw = q.contiguous().view(torch.int32).reshape(T, -1).to(torch.int64).sum(1)
    total = qw.clone()
    lists = [(k_cache, indices, topk_length, True)]
    if extra_k_cache is not None and extra_indices_in_kvcache is not None:
        lists.append((extra_k_cache, extra_indices_in_kvcache, extra_topk_length, False))
    for cache, ind, ln, is_main in lists:
        words, P, PBW = _words(cache)
        flat = words.reshape(-1)
        idx = _indices(ind).to(torch.int64)
        n = _lengths(ln, idx).to(torch.int64).clamp(max=idx.shape[1])
        j = torch.arange(idx.shape[1], device=idx.device)
        valid = (j[None, :] < n[:, None]) & (idx >= 0)
        i = idx.clamp(min=0)
        page, off = i // P, i % P
        row = page * PBW + off * ROW_WORDS
        sc = page * PBW + P * ROW_WORDS + off * SCALE_WORDS
        pos = torch.cat([row[..., None] + torch.arange(ROW_WORDS, device=idx.device),
                         sc[..., None] + torch.arange(SCALE_WORDS, device=idx.device)], -1)   # [T, K, 146]
        vals = flat[pos].to(torch.int64) * valid[..., None]
        total += vals.reshape(T, -1).sum(1)
    return total & 0xFFFFFFFF
