"""Bytes one prefill-to-decode KV transfer of DeepSeek-V4-Flash moves per TP rank, by prompt length.

What SGLang 0.5.23 sends for DSv4 (``srt/mem_cache/deepseek_v4_memory_pool.py``,
``DeepSeekV4TokenToKVPool``; ``srt/disaggregation/prefill.py`` for the SWA window), KVLayout.V4 pages:

* ``get_contiguous_buf_infos`` (indexed by 256-token pages, every page of the prompt):
  - per c4 layer (compress ratio 4): its c4 KV page (64 compressed tokens, ``kv_page_bytes(64)`` = 37440 B)
    and its indexer page (64 tokens x ``get_dsv4_indexer_bytes_per_token(128, fp8)`` = 132 B);
  - per c128 layer: its c128 KV page (2 compressed tokens, ``kv_page_bytes(2)`` = 1728 B).
* ``get_state_buf_infos``: per layer the SWA pages (256 tokens, 149760 B) that hold the last
  ``sliding_window`` (128) tokens: the window start is rounded down to a page, so 1 or 2 pages.
  The compressor / indexer state rings that travel with them are a fixed amount per request (not per
  token) and are left out here.

Every TP rank holds the whole latent KV (one KV head), and with equal TP on both sides decode rank i
pulls from prefill rank i (``_resolve_rank_mapping``, ``common/conn.py``): at TP4 four such transfers run
at once over four GPU pairs.

compress_ratios: DeepSeek-V4-Flash has 43 layers: two SWA-only layers (ratio 0), then c4 and c128
alternating, c4 first (21 x c4, 20 x c128), plus the MTP layer (ratio 0, not transferred without MTP).
Pass the checkpoint's config.json to use its own list.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

TOKEN_ROW = 576
SCALE_BYTES = 8
SWA_PAGE_TOKENS = 256
SLIDING_WINDOW = 128
INDEX_HEAD_DIM = 128
NUM_LAYERS = 43
FLASH_COMPRESS_RATIOS: List[int] = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)]


def kv_page_bytes(page_tokens: int) -> int:
    """One KVLayout.V4 page: token rows of 576 B + 8 B of scales per token, padded to a multiple of 576."""
    if page_tokens <= 0:
        raise ValueError("page_tokens must be positive")
    return -(-page_tokens * (TOKEN_ROW + SCALE_BYTES) // TOKEN_ROW) * TOKEN_ROW


def indexer_bytes_per_token(index_head_dim: int = INDEX_HEAD_DIM) -> int:
    """fp8 indexer key + one fp32 scale per 128 dims (SGLang's get_dsv4_indexer_bytes_per_token)."""
    return index_head_dim + index_head_dim // 128 * 4


@dataclass(frozen=True)
class CacheKind:
    """One kind of buffer the transfer touches: ``items`` descriptors of ``item_bytes`` each."""
    name: str
    layers: int
    item_bytes: int
    items_per_layer: int

    @property
    def bytes(self) -> int:
        return self.layers * self.items_per_layer * self.item_bytes


def compress_ratios_from_config(path: Optional[Path]) -> List[int]:
    """The first ``num_hidden_layers`` entries of ``compress_ratios`` in a config.json (the default: Flash's)."""
    if path is None:
        return list(FLASH_COMPRESS_RATIOS)
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}")
    ratios = cfg.get("compress_ratios")
    n = cfg.get("num_hidden_layers")
    if not isinstance(ratios, list) or not isinstance(n, int) or len(ratios) < n:
        raise ValueError(f"{path}: needs num_hidden_layers and at least that many compress_ratios")
    bad = sorted({r for r in ratios[:n] if r not in (0, 4, 128)})
    if bad:
        raise ValueError(f"{path}: compress ratios {bad} are not DeepSeek-V4-Flash's (0, 4, 128)")
    return [int(r) for r in ratios[:n]]


def swa_pages(prompt_tokens: int, window: int = SLIDING_WINDOW, page: int = SWA_PAGE_TOKENS) -> int:
    """SWA pages holding the last ``window`` tokens, the start rounded down to a page boundary."""
    start = (max(0, prompt_tokens - window) // page) * page
    return math.ceil(prompt_tokens / page) - start // page


def transfer_plan(prompt_tokens: int, ratios: Sequence[int] = FLASH_COMPRESS_RATIOS) -> List[CacheKind]:
    """The buffers one TP rank sends for a prompt of ``prompt_tokens`` tokens."""
    if prompt_tokens <= 0:
        raise ValueError("prompt_tokens must be positive")
    pages = math.ceil(prompt_tokens / SWA_PAGE_TOKENS)
    c4 = sum(1 for r in ratios if r == 4)
    c128 = sum(1 for r in ratios if r == 128)
    kinds = [CacheKind("swa", len(ratios), kv_page_bytes(SWA_PAGE_TOKENS), swa_pages(prompt_tokens)),
             CacheKind("c4", c4, kv_page_bytes(SWA_PAGE_TOKENS // 4), pages),
             CacheKind("c4_indexer", c4, (SWA_PAGE_TOKENS // 4) * indexer_bytes_per_token(), pages),
             CacheKind("c128", c128, kv_page_bytes(SWA_PAGE_TOKENS // 128), pages)]
    return [k for k in kinds if k.layers and k.items_per_layer]


def transfer_bytes(prompt_tokens: int, ratios: Sequence[int] = FLASH_COMPRESS_RATIOS) -> int:
    return sum(k.bytes for k in transfer_plan(prompt_tokens, ratios))


def summary(prompt_tokens: int, ratios: Sequence[int] = FLASH_COMPRESS_RATIOS) -> Dict[str, int]:
    plan = transfer_plan(prompt_tokens, ratios)
    d = {k.name: k.bytes for k in plan}
    d["descriptors"] = sum(k.layers * k.items_per_layer for k in plan)
    d["total"] = sum(k.bytes for k in plan)
    return d
