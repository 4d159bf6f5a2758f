"""The GEMM shapes the FP8 tuner covers: DeepSeek-V4-Flash's dense block-FP8 weights, per TP size.

A shape is the weight's (N, K) = (output features, input features) on one TP rank; the token count M is the
activation's row count.  SGLang keys its config files by (N, K) and picks the entry of the nearest M.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from dsv4_sm120.fp8.errors import UsageError

# Token counts M tuned by default: every decode batch size up to 64 finely, prefill chunks coarsely.
DEFAULT_MS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096)
# DeepSeek-V4-Flash's FP8 weights are quantized in 128x128 blocks (SGLang's block_shape=[128, 128]).
BLOCK = (128, 128)
DECODE_MAX_M = 64        # "decode" range for the tuned-vs-default table and the backend decision
PREFILL_MIN_M = 256      # "prefill" range for the same

# DeepSeek-V4-Flash dense FP8 GEMMs, (name, N, K) at TP=4 and how each is split across TP ranks:
# "col" = output dim N split, "row" = input dim K split, "rep" = replicated.
_SHAPES_TP4 = (
    ("fused wqkv_a", 1536, 4096, "rep"),
    ("wq_b / indexer wq_b", 8192, 1024, "col"),
    ("wo_b", 4096, 2048, "row"),
    ("shared expert gate_up", 1024, 4096, "col"),
    ("shared expert down", 4096, 512, "row"),
    ("MTP e/h proj", 4096, 4096, "rep"),
)


@dataclass(frozen=True)
class Shape:
    N: int
    K: int
    name: str = ""

    @property
    def key(self) -> str:
        """The shape's key in the summary (``N=...,K=...``)."""
        return f"N={self.N},K={self.K}"


def shapes_for_tp(tp: int) -> List[Shape]:
    """The DSv4-Flash shapes on one rank at tensor-parallel size ``tp`` (1, 2, 4 or 8), duplicates dropped."""
    if tp <= 0 or 4 % tp and tp % 4:
        raise UsageError(f"--tp {tp}: expected 1, 2, 4 or 8")
    out: List[Shape] = []
    for name, n, k, split in _SHAPES_TP4:
        if split == "col":
            n = n * 4 // tp
        elif split == "row":
            k = k * 4 // tp
        if n % BLOCK[0] or k % BLOCK[1]:
            raise UsageError(f"--tp {tp}: {name} would be ({n}, {k}), not a multiple of the 128x128 block")
        out.append(Shape(n, k, name))
    # de-duplicate, keep order
    seen, uniq = set(), []
    for s in out:
        if (s.N, s.K) not in seen:
            seen.add((s.N, s.K))
            uniq.append(s)
    return uniq


def parse_shapes(text: str) -> List[Shape]:
    """``--shapes 'N,K;N,K'``: explicit weight shapes, each a positive multiple of the 128x128 block."""
    out = []
    for part in text.replace(" ", "").split(";"):
        if not part:
            continue
        try:
            n, k = (int(x) for x in part.split(","))
        except ValueError:
            raise UsageError(f"--shapes: {part!r} is not N,K") from None
        if n <= 0 or k <= 0 or n % BLOCK[0] or k % BLOCK[1]:
            raise UsageError(f"--shapes: ({n}, {k}) must be positive multiples of 128")
        out.append(Shape(n, k, "custom"))
    if not out:
        raise UsageError("--shapes: no shapes given")
    return out


def parse_ms(text: str) -> List[int]:
    """``--ms 1,2,4``: token counts, sorted and de-duplicated."""
    try:
        ms = sorted({int(x) for x in text.replace(" ", "").split(",") if x})
    except ValueError:
        raise UsageError(f"--ms: {text!r} is not a comma-separated list of integers") from None
    if not ms or ms[0] <= 0:
        raise UsageError("--ms: need positive integers")
    return ms
