"""What the FP8 tuner searches: the candidate tile configs per (M, N, K), the fingerprint that tells a finished
search from a changed one, and the ``Bench`` interface through which candidates are checked and timed
(:class:`dsv4_sm120.fp8.gpu.GpuBench` on a device; the tests use a fake with a fake clock).

The quick space (``--quick``) keeps the tile sizes that win on Hopper and Blackwell for these shapes; the full
space adds smaller/larger tiles, 64-wide K tiles, more pipeline stages and group sizes.  SGLang's own default
config is always a candidate, so the tuned table is never worse than no table (up to timing noise).
"""

from __future__ import annotations

import hashlib
import json
from typing import Dict, List, Optional, Sequence, Tuple

from dsv4_sm120.fp8.shapes import BLOCK, Shape

def _pow2_ceil(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (x - 1).bit_length())


def sglang_default_config() -> Dict[str, int]:
    """SGLang 0.5.23's config when no JSON exists (w8a8_block_fp8_matmul_triton, block [128, 128])."""
    return {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": BLOCK[0], "BLOCK_SIZE_K": BLOCK[1], "GROUP_SIZE_M": 32,
            "num_warps": 4, "num_stages": 3}


def candidate_configs(M: int, N: int, K: int, *, sm90: bool, quick: bool, num_sms: int = 132) -> List[Dict]:
    """Tile configs to try for one (M, N, K).  ``sm90`` adds SGLang's Hopper-only SWAP_AB / SPLIT_K keys
    (ignored by SGLang elsewhere, so they are not searched elsewhere)."""
    m16 = max(16, _pow2_ceil(M))
    if quick:
        if M <= 64:
            bms = [min(m16, 64)]
            bns = [32, 64, 128]
            warps = [4]
        else:
            bms = [64, 128]
            bns = [64, 128]
            warps = [4, 8]
        bks = [128]
        stages = [3, 4]
        groups = [16] if M > 64 else [1]
    else:
        bms = [b for b in (16, 32, 64, 128) if b <= m16]
        bns = [32, 64, 128, 256]
        warps = [4, 8]
        bks = [64, 128]
        stages = [2, 3, 4, 5]
        groups = [1, 16, 32] if M > 64 else [1]
    out = []
    for bm in bms:
        for bn in bns:
            if bn > 2 * N:
                continue
            for bk in bks:
                for w in warps:
                    if w == 8 and bm * bn < 64 * 128:
                        continue
                    for st in stages:
                        for g in groups:
                            base = {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk,
                                    "GROUP_SIZE_M": g, "num_warps": w, "num_stages": st}
                            if not sm90:
                                out.append(base)
                                continue
                            k_tiles = -(-K // bk)
                            ctas = -(-M // bm) * -(-N // bn)
                            splits = [1]
                            if M <= 256:
                                splits += [s for s in ((2, 4, 8) if quick else (2, 4, 8, 16))
                                           if s <= k_tiles and ctas * s <= 4 * num_sms]
                            swaps = [False, True] if M <= 64 else [False]
                            for sw in swaps:
                                for sk in splits:
                                    c = dict(base)
                                    if sw:
                                        c["SWAP_AB"] = True
                                    if sk > 1:
                                        c["SPLIT_K"] = sk
                                    out.append(c)
    default = sglang_default_config()
    if default not in out:   # never pick worse than SGLang's own choice (up to timing noise)
        out.append(default)
    return out


def config_id(cfg: Dict) -> str:
    """A canonical string for a config (key order does not matter)."""
    return json.dumps(cfg, sort_keys=True, separators=(",", ":"))


def search_fingerprint(shape: Shape, ms: Sequence[int], *, sm90: bool, quick: bool, num_sms: int,
                       kernel_tag: str) -> str:
    """Hash of everything that decides a shape's result: the shape, the M list, the candidate space on this
    device and SGLang's kernel source.  A finished shape with the same fingerprint is not tuned again."""
    h = hashlib.sha256()
    h.update(json.dumps({"N": shape.N, "K": shape.K, "ms": list(ms), "sm90": sm90, "quick": quick,
                         "kernel": kernel_tag, "v": 1}).encode())
    for m in ms:
        for c in candidate_configs(m, shape.N, shape.K, sm90=sm90, quick=quick, num_sms=num_sms):
            h.update(config_id(c).encode())
    return h.hexdigest()[:16]


class Bench:
    """What the tuner needs from a device.  Times are microseconds per GEMM.

    Per shape the tuner calls ``setup_shape`` once, then per M ``setup_m`` followed by ``time_config`` for
    every candidate (a failing candidate raises :class:`~dsv4_sm120.fp8.errors.CandidateError`), then
    ``release_shape``."""

    device_name_raw: str = "?"
    sm90: bool = False
    num_sms: int = 132
    kernel_tag: str = "?"
    kernel_source: str = "?"
    versions: Dict[str, str] = {}
    default_backend: Dict[str, object] = {"name": None, "available": False, "reason": "not timed"}

    def setup_shape(self, shape: Shape, ms: Sequence[int]) -> None: ...

    def setup_m(self, shape: Shape, M: int) -> None: ...

    def time_config(self, shape: Shape, M: int, cfg: Optional[Dict]) -> float:
        """Check then time SGLang's Triton launcher with ``cfg`` (None: SGLang's own default)."""
        raise NotImplementedError

    def shipped_config(self, shape: Shape, M: int) -> Optional[Dict]:
        """The config SGLang's shipped JSON for this device gives at M, if SGLang ships one."""
        return None

    def time_linear(self, shape: Shape, M: int, cfg: Dict) -> Optional[float]:
        """End-to-end Triton linear (activation quant + GEMM) with ``cfg``; None if not measurable."""
        return None

    def time_default_backend(self, shape: Shape, M: int) -> Optional[float]:
        """End-to-end linear through SGLang's default FP8 backend for this device; None if not measurable."""
        return None

    def precompile(self, jobs: List[Tuple[Shape, int, Dict]], workers: int, deadline: Optional[float],
                   progress) -> None:
        """Optionally compile candidates ahead of timing (in parallel)."""

    def release_shape(self) -> None: ...

