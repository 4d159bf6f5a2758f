"""The inline-PTX decoders (e4m3 -> bf16 of the attention kernel, e2m1 x e4m3 -> bf16 of the MoE kernels)
run bit-exactly on a CPU through ``ptxsim`` and are compared with torch's own conversions, for every code
and a spread of scales. The GPU tests run the same asm in the kernels; these catch a wrong constant or
selector before a device call does (and on a box where the asm path is never compiled)."""

from __future__ import annotations

import os
import random

import pytest
import torch

# Triton decides interpreter or not when a kernel module is imported: import them the way the kernel tests of
# this process expect (only the asm constants are used here)
os.environ.setdefault("TRITON_INTERPRET", "1")

import ptxsim  # noqa: E402
from dsv4_sm120.attention import kernels as AK  # noqa: E402
from dsv4_sm120.moe import kernels as MK  # noqa: E402

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _asm(c):
    return str(getattr(c, "value", c))


def _e2m1(code: int) -> float:
    v = E2M1[code & 7]
    return -v if code & 8 else v


def _e4m3_value(code: int) -> float:
    return torch.tensor([code], dtype=torch.uint8).view(torch.float8_e4m3fn).double().item()


def _words(codes, rng):
    codes = list(codes)
    rng.shuffle(codes)
    return [codes[i : i + 4] for i in range(0, len(codes), 4)]


def test_e4m3_to_bf16_all_codes_exact():
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    asm = _asm(AK.E4M3_BF16_ASM)
    seen = 0
    for four in _words(range(256), rng):
        word = four[0] | (four[1] << 8) | (four[2] << 16) | (four[3] << 24)
        regs = ptxsim.run(asm, {"$2": word})
        got = ptxsim.halves(regs["$0"]) + ptxsim.halves(regs["$1"])
        for code, bits in zip(four, got):
            ref = _e4m3_value(code)
            if code & 0x7F == 0x7F:  # e4m3 NaN: documented as +-480 (never stored in the KV cache)
                assert ptxsim.bf16_value(bits) == (-480.0 if code & 0x80 else 480.0)
            else:
                assert bits == ptxsim.bf16_bits(ref), f"code {code:#04x}: {ptxsim.bf16_value(bits)} vs {ref}"
            seen += 1
    assert seen == 256


def test_e4m3_to_bf16_sim_rejects_a_wrong_constant():
    """The simulator is strict enough to catch a one-bit slip in the asm."""
    bad = _asm(AK.E4M3_BF16_ASM).replace("0x87F087F0", "0x83F083F0", 1)
    assert bad != _asm(AK.E4M3_BF16_ASM)
    regs = ptxsim.run(bad, {"$2": 0x00C0_4038})  # codes 0x38 (1.0), 0x40 (2.0), 0xC0 (-2.0), 0x00
    got = [ptxsim.bf16_value(b) for b in ptxsim.halves(regs["$0"]) + ptxsim.halves(regs["$1"])]
    assert got != [1.0, 2.0, -2.0, 0.0]
    with pytest.raises(NotImplementedError):
        ptxsim.run("cvt.rn.bf16x2.f32 $0, $1, $2;", {"$1": 0, "$2": 0})


def test_e4m3_scaled_decode_all_codes_exact():
    """The Gluon producers' decode (``wspec.E4M3X4_SCALED_ASM``): every e4m3 code times UE8M0 tile scales from
    2^-126 to 2^127, against the float64 product rounded once to bf16 (overflow to inf, underflow to the bf16
    subnormals, as the hardware's bf16 multiply does)."""
    from dsv4_sm120.attention.kernels import wspec
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    asm = _asm(wspec.E4M3X4_SCALED_ASM)
    for sbyte in [1, 100, 120, 127, 134, 135, 254] + rng.sample(range(1, 255), 6):
        sc2 = (sbyte << 7) | (sbyte << 23)
        for four in _words([c for c in range(256) if c & 0x7F != 0x7F], rng):
            four = four + [0] * (4 - len(four))
            word = four[0] | (four[1] << 8) | (four[2] << 16) | (four[3] << 24)
            regs = ptxsim.run(asm, {"$2": word, "$3": sc2})
            got = ptxsim.halves(regs["$0"]) + ptxsim.halves(regs["$1"])
            for code, bits in zip(four, got):
                ref = _e4m3_value(code) * 2.0 ** (sbyte - 127)
                assert bits == ptxsim.bf16_bits(ref), (
                    f"code {code:#04x} scale 2^{sbyte - 127}: {ptxsim.bf16_value(bits)} vs {ref}")


def _scales(rng):
    # e4m3 block scales as stored (positive finite codes), the extremes included
    codes = [0x01, 0x08, 0x38, 0x7E] + rng.sample(range(1, 0x7F), 12)
    return codes


def test_moe_e2m1_shift_decoder_all_codes_exact():
    """The bf16 path's weight decode (``DEQ 3``): every e2m1 code times a spread of e4m3 block scales."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    asm = _asm(MK._E2M1_BF16_SHIFT_ASM)
    for sc_code in _scales(rng):
        scale = _e4m3_value(sc_code)
        # the kernel hands the asm the block scale x 2^119 as bf16 and gets value * scale * 2^-7 back
        sb = ptxsim.bf16_bits(scale * 2.0**119)
        want_factor = scale * 2.0**-7
        for four in _words(range(256), rng):
            word = four[0] | (four[1] << 8) | (four[2] << 16) | (four[3] << 24)
            regs = ptxsim.run(asm, {"$4": word, "$5": sb | (sb << 16), "$6": sb | (sb << 16)})
            lo = ptxsim.halves(regs["$0"]) + ptxsim.halves(regs["$1"])
            hi = ptxsim.halves(regs["$2"]) + ptxsim.halves(regs["$3"])
            for byte, b_lo, b_hi in zip(four, lo, hi):
                for nib, bits in ((byte & 15, b_lo), (byte >> 4, b_hi)):
                    want = _e2m1(nib) * want_factor
                    assert bits == ptxsim.bf16_bits(want), (
                        f"scale {scale} byte {byte:#04x} nibble {nib}: {ptxsim.bf16_value(bits)} vs {want}")
