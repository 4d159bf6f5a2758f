"""NVFP4 / MXFP4 weight formats: value tables, (un)packing, dequantization,
an RNE quantizer, and the closed-form bit-exact MXFP4 -> NVFP4 conversion.

Pure torch, runs on CPU (and on any device the tensors live on). Shared by the
checkpoint converter (:mod:`dsv4_sm120.convert_nvfp4`) and the Triton NVFP4
MoE kernel (:mod:`dsv4_sm120.moe`); the public API below is kept stable.

Formats (``K`` = length of the packed, innermost axis in elements)
------------------------------------------------------------------
e2m1 (FP4)
    4-bit code ``s eem``: bit 3 = sign, 8 magnitudes
    ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (:data:`E2M1_VALUES` indexes all 16 codes).
    Two codes per byte, **low nibble = even index** (element ``2i`` in bits
    0-3, element ``2i+1`` in bits 4-7): ``uint8 [..., K/2]``.
MXFP4 (the released DeepSeek-V4-Flash routed experts)
    e2m1 ``uint8 [..., K/2]`` + one E8M0 scale per 32 elements
    ``uint8 (or float8_e8m0fnu) [..., K/32]``; value = e2m1 * 2^(e8m0 - 127).
    E8M0 ``0xFF`` is NaN.
NVFP4 (ModelOpt / nvidia/DeepSeek-V4-Flash-NVFP4)
    e2m1 ``uint8 [..., K/2]`` + one E4M3 (``float8_e4m3fn``) block scale per 16
    elements ``[..., K/16]`` + one fp32 per-tensor ``weight_scale_2``;
    value = e2m1 * float(block_scale) * weight_scale_2.

Closed-form MXFP4 -> NVFP4 (as ModelOpt's ``--cast_mxfp4_to_nvfp4``)
-------------------------------------------------------------------
With ``k_j = e8m0_j - 127`` per 32-block and ``m = max_j k_j - 8`` (max over
every block of the tensor, or of several tensors that share one global scale,
e.g. w1 and w3): ``weight_scale_2 = 2^m``; 32-block ``j`` becomes two
16-blocks with E4M3 scale ``2^(k_j - m)``; nibbles are copied verbatim.
E4M3 represents every power of two in ``[2^-9, 2^8]`` exactly (2^-9..2^-7 as
subnormals), so the result is **bit-exact** for each block with
``k_j - m >= -9``. A block with ``k_j - m < -9`` (an exponent more than 17
below the tensor's largest) is *out of range*: its block scale is clamped to
``2^-9`` and its codes are re-rounded (round-to-nearest-even) to
``e2m1 * 2^(k_j - m + 9)``; the loss is counted and measured
(:class:`ConversionStats`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

import torch

__all__ = [
    "E2M1_VALUES",
    "E2M1_MAX",
    "E4M3_MAX",
    "E4M3_MIN_POW2_EXP",
    "E4M3_MAX_POW2_EXP",
    "MXFP4_BLOCK",
    "NVFP4_BLOCK",
    "ConversionStats",
    "unpack_e2m1",
    "pack_e2m1",
    "e2m1_to_float",
    "packed_e2m1_to_float",
    "float_to_e2m1_rne",
    "e8m0_exponent",
    "dequant_mxfp4",
    "dequant_nvfp4",
    "quantize_nvfp4",
    "mxfp4_global_exponent",
    "mxfp4_to_nvfp4",
]

MXFP4_BLOCK = 32
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Range of powers of two that float8_e4m3fn represents exactly (2^-9 is its
# smallest subnormal, 2^8 = 256 its largest power of two).
E4M3_MIN_POW2_EXP = -9
E4M3_MAX_POW2_EXP = 8
# Spread of block exponents a single NVFP4 tensor holds exactly: m = max_k - 8.
_GLOBAL_OFFSET = E4M3_MAX_POW2_EXP

_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# All 16 codes, indexed by the 4-bit code (bit 3 = sign). Code 8 is -0.0.
E2M1_VALUES = torch.tensor(
    list(_E2M1_MAGNITUDES) + [-v for v in _E2M1_MAGNITUDES], dtype=torch.float32
)

# Rounding thresholds between magnitude codes i and i+1 (midpoints), and
# whether a tie goes up (the upper code is even, i.e. has mantissa bit 0).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (False, True, False, True, False, True, False)
# Trailing zero bits of each magnitude code's value in units of 0.5 (0, 1, 2,
# 3, 4, 6, 8, 12); zero gets a count no shift reaches.
_E2M1_HALF_UNIT_TZ = torch.tensor([1 << 30, 0, 1, 0, 2, 1, 3, 2], dtype=torch.int32)
# Shift (binades) from which every e2m1 magnitude rounds to zero (6 * 2^-5 < 0.25).
_ALL_ZERO_SHIFT = 5


def _as_u8(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype == torch.uint8:
        return t
    if t.dtype in (torch.int8,) or t.dtype == getattr(torch, "float8_e8m0fnu", None):
        return t.view(torch.uint8)
    raise TypeError(f"{what}: expected uint8 (or int8 / float8_e8m0fnu), got {t.dtype}")


def unpack_e2m1(w_u8: torch.Tensor) -> torch.Tensor:
    """Split packed e2m1 bytes into 4-bit codes.

    ``uint8 [..., K/2]`` -> ``uint8 [..., K]`` codes in ``0..15``; element
    ``2i`` comes from the low nibble of byte ``i``, ``2i+1`` from the high one.
    """
    w = _as_u8(w_u8, "unpack_e2m1")
    lo = w & 0x0F
    hi = w >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*w.shape[:-1], w.shape[-1] * 2)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unpack_e2m1`: codes ``[..., K]`` (K even, values
    0..15, any integer dtype) -> ``uint8 [..., K/2]``, even index in the low
    nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: last dim must be even, got {codes.shape[-1]}")
    c = codes.to(torch.uint8) & 0x0F
    return c[..., 0::2] | (c[..., 1::2] << 4)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (any integer dtype) -> float32 values."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


_PAIR_LUTS: dict = {}


def _pair_lut(dtype: torch.dtype, device) -> torch.Tensor:
    """``[256, 2]`` table: byte -> (value of low nibble, value of high nibble)."""
    key = (dtype, str(device))
    lut = _PAIR_LUTS.get(key)
    if lut is None:
        v = E2M1_VALUES.to(dtype)
        lut = torch.stack((v.repeat(16), v.repeat_interleave(16)), dim=-1).to(device)
        _PAIR_LUTS[key] = lut
    return lut


def packed_e2m1_to_float(w_u8: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed bytes ``[..., K/2]`` -> values ``[..., K]`` (one table lookup per byte;
    same result as ``e2m1_to_float(unpack_e2m1(w))``)."""
    w = _as_u8(w_u8, "packed_e2m1_to_float")
    return _pair_lut(dtype, w.device)[w.long()].reshape(*w.shape[:-1], w.shape[-1] * 2)


def float_to_e2m1_rne(x: torch.Tensor) -> torch.Tensor:
    """Round float values to e2m1 codes, round-to-nearest-even, saturating.

    ``x [...]`` (already divided by its scale) -> ``uint8 [...]`` codes.
    |x| > 6 saturates to 6 (like ``cvt.rn.satfinite.e2m1x2``); the sign bit is
    kept, so negative values that round to zero give code 8 (-0). NaN is
    rejected with ``ValueError``.
    """
    xf = x.float()
    if torch.isnan(xf).any():
        raise ValueError("float_to_e2m1_rne: input contains NaN")
    a = xf.abs()
    mag = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for thr, up in zip(_E2M1_MIDPOINTS, _E2M1_TIE_UP):
        mag += (a >= thr if up else a > thr).to(torch.uint8)
    sign = torch.signbit(xf).to(torch.uint8) << 3
    return mag | sign


def e8m0_exponent(scale_e8m0: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> int32 unbiased exponents ``byte - 127``. Raises on the
    NaN encoding 0xFF."""
    s = _as_u8(scale_e8m0, "e8m0 scale")
    if (s == 0xFF).any():
        raise ValueError("E8M0 scale contains 0xFF (NaN)")
    return s.to(torch.int32) - 127


def _check_blocks(w_u8: torch.Tensor, scale: torch.Tensor, block: int, what: str) -> int:
    k = w_u8.shape[-1] * 2
    if k % block:
        raise ValueError(f"{what}: K={k} is not a multiple of the block size {block}")
    want = tuple(w_u8.shape[:-1]) + (k // block,)
    if tuple(scale.shape) != want:
        raise ValueError(f"{what}: scale shape {tuple(scale.shape)} != expected {want}")
    return k


def dequant_mxfp4(
    w_u8: torch.Tensor,
    scale_e8m0_u8: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """MXFP4 -> float32 (or ``out_dtype``).

    ``w_u8 uint8 [..., K/2]``, ``scale_e8m0_u8 uint8|float8_e8m0fnu [..., K/32]``
    -> ``float32 [..., K]`` = e2m1 * 2^(e8m0 - 127). Every value is exact in
    float32 except past its range: scales >= 2^126 times codes >= 4 overflow
    to +-inf (pass ``out_dtype=torch.float64`` for an exact result over the
    whole E8M0 range). Scale 2^-127 values are exact float32 subnormals.
    """
    k = _check_blocks(w_u8, scale_e8m0_u8, MXFP4_BLOCK, "dequant_mxfp4")
    vals = packed_e2m1_to_float(w_u8, out_dtype)
    exps = e8m0_exponent(scale_e8m0_u8)
    mult = torch.ldexp(torch.ones_like(exps, dtype=out_dtype), exps)
    out = vals.reshape(*vals.shape[:-1], k // MXFP4_BLOCK, MXFP4_BLOCK) * mult.unsqueeze(-1)
    return out.reshape(vals.shape)


def dequant_nvfp4(
    w_u8: torch.Tensor,
    scale_e4m3: torch.Tensor,
    scale_2: Union[torch.Tensor, float],
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """NVFP4 -> float32 (or ``out_dtype``, e.g. float64).

    ``w_u8 uint8 [..., K/2]``, ``scale_e4m3 float8_e4m3fn [..., K/16]``,
    ``scale_2`` fp32 scalar (0-d / 1-element tensor or float; a tensor
    broadcastable to ``[..., 1]`` is also accepted) -> ``float32 [..., K]`` =
    e2m1 * float(scale_e4m3) * scale_2, computed in ``out_dtype`` (products of
    e2m1, an E4M3 scale and a power-of-two ``scale_2`` are exact unless they
    leave the dtype's range).
    """
    if scale_e4m3.dtype != torch.float8_e4m3fn:
        raise TypeError(f"dequant_nvfp4: scale must be float8_e4m3fn, got {scale_e4m3.dtype}")
    k = _check_blocks(w_u8, scale_e4m3, NVFP4_BLOCK, "dequant_nvfp4")
    vals = packed_e2m1_to_float(w_u8, out_dtype)
    bs = scale_e4m3.to(out_dtype)
    out = vals.reshape(*vals.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK) * bs.unsqueeze(-1)
    out = out.reshape(vals.shape)
    s2 = torch.as_tensor(scale_2, device=out.device).to(out_dtype)
    if s2.numel() == 1:
        s2 = s2.reshape(())
    return out * s2


def quantize_nvfp4(
    x: torch.Tensor,
    scale_2: Optional[Union[torch.Tensor, float]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize floats to NVFP4 (round-to-nearest-even everywhere).

    ``x [..., K]`` (K a multiple of 16, finite) ->
    ``(w uint8 [..., K/2], scale float8_e4m3fn [..., K/16], scale_2 float32 0-d)``.

    ``scale_2`` defaults to ``amax(|x|) / (448 * 6)`` (1.0 for an all-zero
    tensor), the standard NVFP4 recipe; pass one to share it between tensors
    (e.g. w1 and w3). Per 16-block: ``s = RNE_e4m3(amax_b / (6 * scale_2))``
    (saturated to 448), codes = ``RNE_e2m1(x / (float(s) * scale_2))``
    (saturating at 6); a block whose scale is 0 gets zero codes.
    """
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"quantize_nvfp4: K={x.shape[-1]} is not a multiple of {NVFP4_BLOCK}")
    xf = x.float()
    if not torch.isfinite(xf).all():
        raise ValueError("quantize_nvfp4: input contains inf/NaN")
    if scale_2 is None:
        amax = xf.abs().max() if xf.numel() else torch.tensor(0.0)
        s2 = (amax / (E4M3_MAX * E2M1_MAX)).to(torch.float32)
        if s2 <= 0 or not torch.isfinite(s2):
            s2 = torch.tensor(1.0)
    else:
        s2 = torch.as_tensor(scale_2, dtype=torch.float32).reshape(())
        if not (s2 > 0 and torch.isfinite(s2)):
            raise ValueError(f"quantize_nvfp4: scale_2 must be positive and finite, got {s2}")
    s2 = s2.to(xf.device)
    k = xf.shape[-1]
    blocks = xf.reshape(*xf.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK)
    bamax = blocks.abs().amax(dim=-1)
    raw = (bamax / (E2M1_MAX * s2)).clamp(max=E4M3_MAX)
    scale = raw.to(torch.float8_e4m3fn)  # torch casts with RNE
    denom = (scale.float() * s2).unsqueeze(-1)
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    q = torch.where(denom > 0, blocks / safe, torch.zeros_like(blocks))
    codes = float_to_e2m1_rne(q).reshape(xf.shape)
    return pack_e2m1(codes), scale, s2


def mxfp4_global_exponent(*scales_e8m0: torch.Tensor) -> int:
    """The shared NVFP4 global exponent ``m = max k_j - 8`` over every E8M0
    block scale of all given tensors (pass w1's and w3's scales together to
    give them one ``weight_scale_2``)."""
    if not scales_e8m0:
        raise ValueError("mxfp4_global_exponent: no scales given")
    mx = None
    for s in scales_e8m0:
        if s.numel() == 0:
            continue
        v = int(e8m0_exponent(s).max())
        mx = v if mx is None else max(mx, v)
    if mx is None:
        raise ValueError("mxfp4_global_exponent: all scale tensors are empty")
    return mx - _GLOBAL_OFFSET


@dataclass
class ConversionStats:
    """What :func:`mxfp4_to_nvfp4` did to one tensor.

    ``blocks``: number of 32-blocks; ``out_of_range``: blocks with
    ``k_j - m < -9`` (clamped, re-rounded); ``lossy``: of those, blocks whose
    dequantized values actually changed; ``max_abs_err``: largest
    ``|dequant_mxfp4(src) - dequant_nvfp4(dst)|`` over the tensor (0.0 when
    bit-exact); ``max_rel_err``: ``max_abs_err`` / ``amax(|src|)``.
    """

    blocks: int = 0
    out_of_range: int = 0
    lossy: int = 0
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    global_exponent: int = 0
    extra: dict = field(default_factory=dict)

    def merge(self, other: "ConversionStats") -> "ConversionStats":
        return ConversionStats(
            blocks=self.blocks + other.blocks,
            out_of_range=self.out_of_range + other.out_of_range,
            lossy=self.lossy + other.lossy,
            max_abs_err=max(self.max_abs_err, other.max_abs_err),
            max_rel_err=max(self.max_rel_err, other.max_rel_err),
        )


def mxfp4_to_nvfp4(
    w_u8: torch.Tensor,
    scale_e8m0: torch.Tensor,
    global_exponent: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, ConversionStats]:
    """Closed-form MXFP4 -> NVFP4 for one tensor.

    Args:
        w_u8: packed e2m1 ``uint8|int8 [..., K/2]`` (K a multiple of 32).
        scale_e8m0: E8M0 block scales ``uint8|float8_e8m0fnu [..., K/32]``.
        global_exponent: ``m``; default :func:`mxfp4_global_exponent` of this
            tensor. Pass the shared value to give w1 and w3 one global scale.

    Returns:
        ``(weight uint8 [..., K/2], weight_scale float8_e4m3fn [..., K/16],
        weight_scale_2 float32 0-d (= 2^m), stats)``. ``weight`` is the input
        bytes verbatim (a copy) except in out-of-range blocks.

    Raises ``ValueError`` if a block exponent exceeds ``m + 8`` (a
    ``global_exponent`` that is too small) or a scale is NaN (0xFF).
    """
    w = _as_u8(w_u8, "mxfp4_to_nvfp4 weight")
    k = _check_blocks(w, scale_e8m0, MXFP4_BLOCK, "mxfp4_to_nvfp4")
    exps = e8m0_exponent(scale_e8m0)
    m = mxfp4_global_exponent(scale_e8m0) if global_exponent is None else int(global_exponent)
    d = exps - m  # per 32-block E4M3 exponent
    if d.numel() and int(d.max()) > E4M3_MAX_POW2_EXP:
        raise ValueError(
            f"mxfp4_to_nvfp4: block exponent {int(d.max()) + m} > m + 8 = {m + 8}; "
            "global_exponent too small"
        )
    oor = d < E4M3_MIN_POW2_EXP
    d_cl = d.clamp(min=E4M3_MIN_POW2_EXP)
    s32 = torch.ldexp(torch.ones_like(d_cl, dtype=torch.float32), d_cl)
    bscale32 = s32.to(torch.float8_e4m3fn)  # exact powers of two
    scale16 = bscale32.unsqueeze(-1).expand(*bscale32.shape, 2).reshape(
        *bscale32.shape[:-1], bscale32.shape[-1] * 2
    ).contiguous()
    out_w = w.clone()
    stats = ConversionStats(blocks=int(exps.numel()), global_exponent=m)
    n_oor = int(oor.sum())
    stats.out_of_range = n_oor
    if n_oor:
        # Re-round the out-of-range blocks: values e2m1 * 2^d expressed on
        # the clamped scale 2^-9 are e2m1 * 2^-s with s = -9 - d > 0 binades.
        codes = unpack_e2m1(w).reshape(*exps.shape, MXFP4_BLOCK)
        s = (E4M3_MIN_POW2_EXP - d).clamp(min=0).unsqueeze(-1)  # int32, > 0 exactly where oor
        # Every magnitude (<= 6) times 2^-5 is below 0.25 and rounds to 0, so
        # the float shift stops there: it never underflows, whatever s is.
        shift = torch.ldexp(torch.ones_like(s, dtype=torch.float32), -s.clamp(max=_ALL_ZERO_SHIFT))
        new_codes = float_to_e2m1_rne(e2m1_to_float(codes) * shift)
        new_codes = torch.where(oor.unsqueeze(-1), new_codes, codes)
        # Lossy, counted in integers: a code keeps its value on the grid 2^-s
        # iff its magnitude in units of 0.5 (1,2,3,4,6,8,12) is divisible by
        # 2^s (the quotients are again e2m1 magnitudes); zero always does.
        tz = _E2M1_HALF_UNIT_TZ.to(codes.device)[(codes & 7).long()]
        lossy = (tz < s) & oor.unsqueeze(-1)
        stats.lossy = int(lossy.any(dim=-1).sum())
        out_w = pack_e2m1(new_codes.reshape(*w.shape[:-1], k))
        if stats.lossy:
            src = dequant_mxfp4(w, scale_e8m0, out_dtype=torch.float64)
            s2 = torch.ldexp(torch.tensor(1.0, dtype=torch.float64), torch.tensor(m))
            dst = dequant_nvfp4(out_w, scale16, s2, out_dtype=torch.float64)
            err = (src - dst).abs().max()
            amax = src.abs().max()
            stats.max_abs_err = float(err)
            stats.max_rel_err = float(err / amax) if amax > 0 else 0.0
    scale_2 = torch.ldexp(torch.tensor(1.0, dtype=torch.float32), torch.tensor(m, dtype=torch.int32))
    return out_w, scale16, scale_2, stats
