"""Shared case builder for the sparse MLA decode tests (CPU interpreter and GPU); no tests here."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from dsv4_sm120.attention.cache import cache_view, random_cache


@dataclass
class Case:
    T: int
    H: int
    main_page: int = 64
    main_pages: int = 3
    K: int = 32
    extra: Optional[str] = None  # None | "c4" | "c128"
    extra_page: int = 64
    extra_pages: int = 3
    extra_K: int = 32
    lengths: Optional[str] = None  # None | "random" | "zero_some"
    sink: Optional[str] = "finite"  # None | "finite" | "-inf"
    head_slice: bool = False
    neg_frac: float = 0.1
    all_invalid_rows: tuple = ()
    cache_mode: str = "normal"
    seed: int = 0
    kw: dict = field(default_factory=dict)


def build(case: Case, device="cpu"):
    """Fresh random inputs for ``case``; returns the kwargs of ``sparse_mla_decode``.

    Candidates beyond a row's length point at poisoned (NaN) slots, so reading them shows."""
    g = torch.Generator().manual_seed(case.seed)
    T, H = case.T, case.H

    def make(pages, page, K, lengths_mode, all_invalid):
        n = pages * page
        poison = torch.arange(n - max(1, n // 8), n)  # last slots are NaN tokens
        cache = random_cache(pages, page, generator=g, mode=case.cache_mode, poison_slots=poison)
        good = n - poison.numel()
        idx = torch.randint(0, good, (T, 1, K), generator=g, dtype=torch.int32)
        neg = torch.rand(T, 1, K, generator=g) < case.neg_frac
        idx[neg] = -1
        lengths = None
        if lengths_mode is not None:
            lengths = torch.randint(0, K + 1, (T,), generator=g, dtype=torch.int32)
            if lengths_mode == "zero_some":
                lengths[:: 2] = 0
            # candidates past the length point at poisoned slots
            for t in range(T):
                L = int(lengths[t])
                if L < K:
                    idx[t, 0, L:] = torch.randint(good, n, (K - L,), generator=g, dtype=torch.int32)
        for t in all_invalid:
            if t < T:
                idx[t] = -1
        return cache, idx, lengths

    main, idx, lens = make(case.main_pages, case.main_page, case.K, case.lengths, case.all_invalid_rows)
    kw = dict(k_cache=cache_view(main.raw.to(device), main.page_size), indices=idx.to(device))
    if lens is not None:
        kw["topk_length"] = lens.to(device)
    if case.extra is not None:
        ec, eidx, elens = make(case.extra_pages, case.extra_page, case.extra_K, case.lengths, case.all_invalid_rows)
        kw["extra_k_cache"] = cache_view(ec.raw.to(device), ec.page_size)
        kw["extra_indices_in_kvcache"] = eidx.to(device)
        if elens is not None:
            kw["extra_topk_length"] = elens.to(device)
    if case.head_slice:
        full = torch.randn(T, 1, H + 5, 512, generator=g).to(torch.bfloat16).to(device)
        q = full[:, :, 2 : 2 + H, :]
    else:
        q = torch.randn(T, 1, H, 512, generator=g).to(torch.bfloat16).to(device)
    kw["q"] = q
    if case.sink == "finite":
        kw["attn_sink"] = (torch.randn(H, generator=g) * 2).to(device)
    elif case.sink == "-inf":
        kw["attn_sink"] = torch.full((H,), -math.inf).to(device)
    kw["head_dim_v"] = 512
    kw["softmax_scale"] = 512 ** -0.5
    kw.update(case.kw)
    return kw


def lonely_rows(kw) -> torch.Tensor:
    """Bool [T]: rows with no valid candidate in either cache."""
    def valid(idx, lens):
        v = idx[:, 0, :].cpu() >= 0
        if lens is not None:
            v &= torch.arange(idx.shape[-1])[None, :] < lens.cpu().long()[:, None]
        return v.any(1)

    any_valid = valid(kw["indices"], kw.get("topk_length"))
    if "extra_k_cache" in kw:
        any_valid |= valid(kw["extra_indices_in_kvcache"], kw.get("extra_topk_length"))
    return ~any_valid
