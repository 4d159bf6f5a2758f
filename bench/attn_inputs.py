"""The inputs of one bench/bench_attention.py point: random paged fp8 caches and per-row candidate lists for a
layout (SWA window, + c4 top-512, + c128 every entry; the DSpark draft block), with verify rows sharing their
request's pages, and the bytes such a call must read."""

from __future__ import annotations

DSPARK_BLOCK, DSPARK_VALID = 5, 133  # draft rows per request; valid candidates = window 128 + block 5
ROW_KEYS = ("indices", "topk_length", "extra_indices_in_kvcache", "extra_topk_length")  # per-row inputs


def make_layer(torch, layout, B, context, gen, device, rows_per_req=1):
    """One layer's caches and indices: (decode keyword arguments, raw cache buffers). ``rows_per_req`` > 1: verify
    rows, that many consecutive rows per request, sharing its pages: row r of a request sees the request's SWA
    window shifted by r (causal), draws its own c4 top-512 from the request's c4 entries, and lists all of the
    request's c128 entries (the same list for every row of the request)."""
    from dsv4_sm120.attention.cache import random_cache_device

    swa = layout.startswith(("swa", "dspark"))
    K = 192 if layout == "dspark192" else 128 if swa else 512
    # main: page 256; each owner (row, or request of verify rows) owns two pages, its window starts at a random offset
    span = 512 if swa else max(1024, context)
    pages_per_row = span // 256
    per = DSPARK_BLOCK if layout == "dspark192" else rows_per_req
    owners = B if rows_per_req == 1 else -(-B // per)
    main = random_cache_device(owners * pages_per_row + 1, 256, device, generator=gen)
    # the request of each row: the rows of one DSpark draft block share their request's window
    req = torch.arange(B, device=device) // per
    if swa:
        start = torch.randint(0, 256, (B, 1), device=device, generator=gen)[req]
        if rows_per_req > 1:
            start = start + (torch.arange(B, device=device) % per)[:, None]
        slots = start + torch.arange(K, device=device)[None, :]
    else:
        slots = torch.rand(B, span, device=device, generator=gen).argsort(1)[:, :K]
    base = (req * span)[:, None]
    idx = (base + slots).to(torch.int32).view(B, 1, K)
    valid = K
    if layout == "dspark192":  # window + block slots, -1 padded to 192 (SGLang's BuildDsparkSwaPageIndices)
        valid = DSPARK_VALID
        idx[:, :, valid:] = -1
    kw = dict(k_cache=main.view, indices=idx, topk_length=torch.full((B,), valid, dtype=torch.int32, device=device))
    raws = [main.raw]
    if layout.endswith("+c4"):
        c = max(1024, context // 4)
        extra = random_cache_device(owners * (c // 64), 64, device, generator=gen)
        e = torch.rand(B, c, device=device, generator=gen).argsort(1)[:, :512]
        eidx = ((req * c)[:, None] + e).to(torch.int32).view(B, 1, 512)
        kw.update(extra_k_cache=extra.view, extra_indices_in_kvcache=eidx,
                  extra_topk_length=torch.full((B,), 512, dtype=torch.int32, device=device))
        raws.append(extra.raw)
    elif layout.endswith("+c128"):
        n, K2 = c128_topk(context)  # entries of the context, candidates (-1 padded)
        pages = -(-n // 2)           # 2-token pages
        extra = random_cache_device(owners * pages, 2, device, generator=gen)
        perm = torch.rand(owners, n, device=device, generator=gen).argsort(1)[req]
        eidx = torch.full((B, K2), -1, dtype=torch.int32, device=device)
        eidx[:, :n] = ((req * 2 * pages)[:, None] + perm).to(torch.int32)
        kw.update(extra_k_cache=extra.view, extra_indices_in_kvcache=eidx.view(B, 1, K2),
                  extra_topk_length=torch.full((B,), n, dtype=torch.int32, device=device))
        raws.append(extra.raw)
    return kw, raws


def c128_topk(context):
    """(c128 entries of a context, candidates of a c128 layer = ceil64 of them; 512 at 64k, 1024 at 128k)."""
    n = 2 * -(-context // 256)
    return n, 64 * -(-n // 64)


def valid_tokens(kw):
    n = int(kw["topk_length"].sum())
    if "extra_indices_in_kvcache" in kw:
        n += int(kw["extra_topk_length"].sum())
    return n
