"""Compile helpers of the attention code-generation tests (a copy of bench/sass_tools.py: tests do not import
bench/): the split kernel's compile source with the launch's alignment facts, disassembly with the tools Triton's
wheel carries, and the opcodes of a kernel's hot loop."""
from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

# one SASS instruction line of nvdisasm -c: optional predicate, opcode, optional .SUFFIXES
OP = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+ )?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?")


def split_kernel_signature(fn, cst: Dict[str, object]) -> Dict[str, str]:
    """Triton signature of a ``split_kernel_*`` given its constexprs ``cst`` (pointer and scalar types of
    the real launch)."""
    sig = {}
    for n in fn.arg_names:
        if n in cst:
            sig[n] = "constexpr"
        elif n in ("q_ptr", "acc_ws"):
            sig[n] = "*bf16"
        elif n in ("m_ws", "l_ws"):
            sig[n] = "*fp32"
        elif n.endswith("_ptr"):
            sig[n] = "*i32" if ("idx" in n or "len" in n) else "*u8"
        else:
            sig[n] = "fp32" if n == "sm_scale_log2" else "i32"
    return sig


def split_kernel_source(fn, cst: Dict[str, object]):
    """``ASTSource`` of a ``split_kernel_*`` with constexprs ``cst`` and the launch's 16-byte alignment
    facts (pointers, strides, page bytes), which decide the gathers' vector widths."""
    import inspect

    from triton.compiler import ASTSource

    # constexprs left out take their declared defaults (a newer flag must not turn into an i32 argument)
    cst = dict(cst)
    for p in fn.params:
        if p.is_constexpr and p.name not in cst and p.default is not inspect.Parameter.empty:
            cst[p.name] = p.default
    sig = split_kernel_signature(fn, cst)
    div = [n for n, v in sig.items() if v.startswith("*") or n.startswith("stride") or n.endswith(("_PB", "_PB2"))]
    return ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in cst.items()},
                     attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div})


def disassemble(cubin: bytes) -> Tuple[str, str]:
    """(``cuobjdump -res-usage`` text, ``nvdisasm -c`` SASS) of a cubin, with the binaries of the installed
    Triton wheel."""
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([str(bin_dir / "cuobjdump"), "-res-usage", f.name], capture_output=True,
                             text=True).stdout
        sass = subprocess.run([str(bin_dir / "nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
    return res, sass


def compile_inspect(src, cap: int, options: Dict[str, int]):
    """Compile ``src`` for ``sm_<cap>`` and disassemble it: (kernel, ``nvdisasm -c`` SASS, resources), resources being
    ``{"regs": ..., "stack": ...}`` per thread when cuobjdump reports them (else empty). Compile errors propagate."""
    import triton
    from triton.backends.compiler import GPUTarget

    k = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=options)
    usage, sass = disassemble(k.asm["cubin"])
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return k, sass, ({"regs": int(m.group(1)), "stack": int(m.group(2))} if m else {})


def hot_loop_ops(sass: str) -> List[Tuple[str, str]]:
    """(opcode, opcode with suffixes) of every instruction of the longest loop: from the label a backward branch
    jumps to, to that branch. Empty when the kernel has no loop."""
    lines = sass.splitlines()
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"\bBRA\b[^`]*`\(\.(L_x_\d+)\)", line)
        if m:
            start = next((j for j, x in enumerate(lines) if x.strip().startswith(f".{m.group(1)}:")), None)
            if start is not None and start < i and (best is None or i - start > best[1] - best[0]):
                best = (start, i)
    if best is None:
        return []
    return [(m.group(2), m.group(2) + (m.group(3) or "")) for x in lines[best[0]:best[1] + 1] if (m := OP.match(x))]
