"""A bit-exact simulator of the few PTX instructions our inline-asm decoders use, so their bit tricks are
checked on a CPU box against independent torch conversions (the GPU tests then run the real thing).

Supported: ``mov.b32``, ``prmt.b32`` (default mode), ``shl.b32``, ``shr.b32`` (logical), ``and.b32``,
``or.b32``, ``lop3.b32``, ``fma.rn.bf16x2``, ``mul.rn.bf16x2``. Anything else raises, so an asm edit that uses a new
instruction cannot pass unchecked.
"""

from __future__ import annotations

import re
from typing import Dict

import torch

M32 = 0xFFFFFFFF


def _bf16_to_f64(bits: int) -> float:
    return torch.tensor([bits & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).double().item()


def _f64_to_bf16(x: float) -> int:
    # torch rounds float64 -> bfloat16 to nearest even (subnormals included)
    return int(torch.tensor([x], dtype=torch.float64).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


def _fma_bf16(a: int, b: int, c: int) -> int:
    # a * b is exact in float64 (8-bit significands); + c exact for the values our decoders use
    return _f64_to_bf16(_bf16_to_f64(a) * _bf16_to_f64(b) + _bf16_to_f64(c))


def _prmt(a: int, b: int, sel: int) -> int:
    src = (a & M32) | ((b & M32) << 32)
    out = 0
    for i in range(4):
        c = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (c & 7))) & 0xFF
        if c & 8:  # sign-replicate mode
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1) << bit
    return out


def run(asm: str, operands: Dict[str, int]) -> Dict[str, int]:
    """Run ``asm`` (the text given to ``tl.inline_asm_elementwise``) with ``operands`` (``{"$4": 0x..}``,
    32-bit ints) and return every register and operand after it."""
    regs: Dict[str, int] = {k: v & M32 for k, v in operands.items()}

    def val(tok: str) -> int:
        tok = tok.strip()
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok):
            return int(tok, 0) & M32
        if tok not in regs:
            raise KeyError(f"register {tok} read before it is written")
        return regs[tok]

    body = re.sub(r"//[^\n]*", "", str(asm))
    for raw in body.split(";"):
        line = raw.strip().strip("{}").strip()
        if not line or line.startswith(".reg"):
            continue
        op, _, rest = line.partition(" ")
        args = [a.strip() for a in rest.split(",")]
        d = args[0]
        if op == "mov.b32":
            regs[d] = val(args[1])
        elif op == "prmt.b32":
            regs[d] = _prmt(val(args[1]), val(args[2]), val(args[3]))
        elif op == "shl.b32":
            regs[d] = (val(args[1]) << min(val(args[2]), 32)) & M32
        elif op == "shr.b32":
            regs[d] = val(args[1]) >> min(val(args[2]), 32)
        elif op == "and.b32":
            regs[d] = val(args[1]) & val(args[2])
        elif op == "or.b32":
            regs[d] = val(args[1]) | val(args[2])
        elif op == "lop3.b32":
            regs[d] = _lop3(val(args[1]), val(args[2]), val(args[3]), val(args[4]))
        elif op == "fma.rn.bf16x2":
            a, b, c = val(args[1]), val(args[2]), val(args[3])
            lo = _fma_bf16(a & 0xFFFF, b & 0xFFFF, c & 0xFFFF)
            hi = _fma_bf16(a >> 16, b >> 16, c >> 16)
            regs[d] = lo | (hi << 16)
        elif op == "mul.rn.bf16x2":
            a, b = val(args[1]), val(args[2])
            regs[d] = _fma_bf16(a & 0xFFFF, b & 0xFFFF, 0x8000) | (_fma_bf16(a >> 16, b >> 16, 0x8000) << 16)
        else:
            raise NotImplementedError(f"ptxsim: unsupported instruction {op!r}")
    return regs


def halves(word: int):
    """The two 16-bit halves of a 32-bit register, low first."""
    return word & 0xFFFF, (word >> 16) & 0xFFFF


def bf16_bits(x: float) -> int:
    return _f64_to_bf16(x)


def bf16_value(bits: int) -> float:
    return _bf16_to_f64(bits)
