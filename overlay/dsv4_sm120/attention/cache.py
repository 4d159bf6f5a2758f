"""Build DeepSeek-V4 ("MODEL1" / KVLayout.V4) paged FP8 KV caches for tests and benchmarks.

Layout of one page of ``P`` tokens (``page_bytes = ceil(P * 584 / 576) * 576``):

* ``[0, P*576)``: one 576-byte row per token: 448 FP8 e4m3 "nope" bytes then 64 bf16 rope values;
* ``[P*576, P*584)``: 8 bytes per token: 7 UE8M0 exponents (scale ``2**(byte-127)`` of the nope
  tile ``64*i .. 64*i+63``) and one pad byte;
* zero padding up to ``page_bytes``.

The kernel receives a 4-D view ``[num_pages, P, 1, 584]`` whose ``stride(0)`` is ``page_bytes``,
exactly as SGLang's DeepSeek-V4 backend builds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

NOPE_DIM = 448
ROPE_DIM = 64
HEAD_DIM = NOPE_DIM + ROPE_DIM  # 512
TILE = 64
NUM_TILES = NOPE_DIM // TILE  # 7
ROW_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
SCALE_BYTES = NUM_TILES + 1  # 8
BYTES_PER_TOKEN = ROW_BYTES + SCALE_BYTES  # 584

# e4m3 finite bytes exclude 0x7F / 0xFF (NaN); these are the poison bytes used for unused slots.
FP8_NAN_BYTE = 0x7F


def page_bytes(page_size: int) -> int:
    """Bytes per page of ``page_size`` tokens in the V4 layout (a multiple of 576)."""
    return math.ceil(page_size * BYTES_PER_TOKEN / ROW_BYTES) * ROW_BYTES


def cache_view(raw: torch.Tensor, page_size: int) -> torch.Tensor:
    """The ``[N, P, 1, 584]`` float8_e4m3fn view over a ``[N, page_bytes]`` uint8 buffer (SGLang's view)."""
    n = raw.shape[0]
    return raw[:, : page_size * BYTES_PER_TOKEN].view(torch.float8_e4m3fn).view(
        n, page_size, 1, BYTES_PER_TOKEN
    )


def raw_pages(k_cache: torch.Tensor) -> torch.Tensor:
    """The whole ``[N, page_bytes]`` uint8 buffer behind a ``[N, P, 1, 584]`` view."""
    n = k_cache.shape[0]
    pb = k_cache.stride(0)
    return torch.as_strided(k_cache.view(torch.uint8), (n, pb), (pb, 1))


@dataclass
class PagedCache:
    raw: torch.Tensor  # [N, page_bytes] uint8
    page_size: int

    @property
    def view(self) -> torch.Tensor:
        return cache_view(self.raw, self.page_size)

    @property
    def num_slots(self) -> int:
        return self.raw.shape[0] * self.page_size


def quantize_tokens(kv: torch.Tensor):
    """DSv4's cache writer, vectorized: per 64-wide nope tile a UE8M0 scale ``2**ceil(log2(amax/448))``,
    e4m3 values; rope kept in bf16. Returns (row bytes ``[n, 576]``, scale bytes ``[n, 8]``) uint8."""
    kv = kv.to(torch.float32)
    n = kv.shape[0]
    nope = kv[:, :NOPE_DIM].reshape(n, NUM_TILES, TILE)
    amax = nope.abs().amax(-1).clamp(min=2.0**-100)
    exp = torch.ceil(torch.log2(amax / 448.0)).clamp(-127, 127)
    q8 = (nope / torch.exp2(exp)[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, NOPE_DIM)
    rope = kv[:, NOPE_DIM:].to(torch.bfloat16).contiguous().view(torch.uint8).reshape(n, 2 * ROPE_DIM)
    scales = torch.zeros(n, SCALE_BYTES, dtype=torch.uint8)
    scales[:, :NUM_TILES] = (exp + 127).to(torch.uint8)
    return torch.cat([q8, rope], 1), scales


def random_cache(
    num_pages: int,
    page_size: int,
    *,
    device="cpu",
    generator: Optional[torch.Generator] = None,
    mode: str = "normal",
    poison_slots: Optional[torch.Tensor] = None,
) -> PagedCache:
    """A cache full of random tokens.

    ``mode="normal"``: vectors ~ N(0, 1) with a few 8x-larger channels, quantized as DSv4's writer
    does (realistic magnitudes). ``mode="bytes"``: uniformly random finite e4m3 bytes with UE8M0
    scales in [118, 127] and N(0,1) rope (adversarial magnitudes, spiky softmax).
    Slots in ``poison_slots`` get NaN nope bytes, NaN rope and scale byte 255, so a kernel that
    reads them produces NaN. Padding bytes after the scale region are poisoned too."""
    g = generator
    pb = page_bytes(page_size)
    ntok = num_pages * page_size
    raw = torch.full((num_pages, pb), 0xFF, dtype=torch.uint8)
    if mode == "normal":
        kv = torch.randn(ntok, HEAD_DIM, generator=g)
        kv[:, ::61] *= 8.0
        data, scales = quantize_tokens(kv)
    elif mode == "bytes":
        nope = torch.randint(0, 256, (ntok, NOPE_DIM), dtype=torch.uint8, generator=g)
        nope[(nope & 0x7F) == 0x7F] ^= 0x01  # no NaN bytes in valid tokens
        rope = torch.randn(ntok, ROPE_DIM, generator=g).to(torch.bfloat16)
        data = torch.cat([nope, rope.view(torch.uint8).reshape(ntok, 2 * ROPE_DIM)], 1)
        scales = torch.zeros(ntok, SCALE_BYTES, dtype=torch.uint8)
        scales[:, :NUM_TILES] = torch.randint(118, 128, (ntok, NUM_TILES), dtype=torch.uint8, generator=g)
    else:
        raise ValueError(f"mode must be 'normal' or 'bytes', got {mode!r}")
    if poison_slots is not None and poison_slots.numel() > 0:
        ps = poison_slots.to(torch.long).cpu()
        data[ps, :NOPE_DIM] = FP8_NAN_BYTE
        data[ps, NOPE_DIM:] = torch.tensor([0xC0, 0x7F], dtype=torch.uint8).repeat(ROPE_DIM)
        scales[ps, :NUM_TILES] = 255
    scales[:, NUM_TILES] = 0xFF  # the pad byte is never read
    raw[:, : page_size * ROW_BYTES] = data.view(num_pages, page_size * ROW_BYTES)
    raw[:, page_size * ROW_BYTES : page_size * BYTES_PER_TOKEN] = scales.view(
        num_pages, page_size * SCALE_BYTES
    )
    return PagedCache(raw.to(device), page_size)


def write_tokens(cache: PagedCache, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Quantize vectors ``kv [n, 512]`` into ``slots`` of ``cache`` (see ``quantize_tokens``)."""
    raw = cache.raw
    P = cache.page_size
    data, scales = quantize_tokens(kv.cpu())
    slots = slots.to(torch.long).cpu()
    for j in range(slots.numel()):
        pg, off = int(slots[j]) // P, int(slots[j]) % P
        raw[pg, off * ROW_BYTES : (off + 1) * ROW_BYTES] = data[j].to(raw.device)
        sb = P * ROW_BYTES + off * SCALE_BYTES
        raw[pg, sb : sb + SCALE_BYTES] = scales[j].to(raw.device)


def random_cache_device(
    num_pages: int, page_size: int, device, *, generator: Optional[torch.Generator] = None
) -> PagedCache:
    """Like ``random_cache(mode="bytes")`` but generated on ``device`` (for large benchmark caches):
    random finite e4m3 nope bytes, UE8M0 scales in [118, 127], N(0, 1) bf16 rope."""
    pb = page_bytes(page_size)
    g = generator
    raw = torch.empty(num_pages, pb, dtype=torch.uint8, device=device)
    data = raw[:, : page_size * ROW_BYTES].view(num_pages, page_size, ROW_BYTES)
    nope = torch.randint(0, 256, (num_pages, page_size, NOPE_DIM), dtype=torch.uint8, device=device, generator=g)
    nope = torch.where((nope & 0x7F) == 0x7F, nope ^ 1, nope)
    data[:, :, :NOPE_DIM] = nope
    rope = torch.randn(num_pages, page_size, ROPE_DIM, device=device, generator=g).to(torch.bfloat16)
    data[:, :, NOPE_DIM:] = rope.view(torch.uint8)
    sc = raw[:, page_size * ROW_BYTES : page_size * BYTES_PER_TOKEN].view(num_pages, page_size, SCALE_BYTES)
    sc[:, :, :NUM_TILES] = torch.randint(
        118, 128, (num_pages, page_size, NUM_TILES), dtype=torch.uint8, device=device, generator=g
    )
    sc[:, :, NUM_TILES] = 0xFF
    raw[:, page_size * BYTES_PER_TOKEN :] = 0xFF
    return PagedCache(raw, page_size)
