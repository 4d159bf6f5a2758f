"""Compile a Triton kernel for a GPU target on a CPU box and read its SASS (no GPU, no torch).

Used by ``bench/attn_sass_count.py``, ``bench/moe_sass_count.py``, the compile tests of
``tests/test_attention.py`` / ``tests/test_moe.py`` and :mod:`dsv4_sm120.dev.sm120_compile`:

* :func:`kernel_source`: an ``ASTSource`` from a signature and constexprs, with the launch's 16-byte
  alignment facts (they decide the vector widths of loads); :func:`split_kernel_source` and
  :func:`moe_gemm_source` build the signatures of the attention split kernels and the MoE GEMMs as
  their launches pass them.
* :func:`launch_source`: the same for the combine, Q quantizer, MoE activation quantizer, align and reduce
  kernels (:data:`LAUNCH_SIGS`).
* :func:`compile_inspect`: compile for ``sm_<cap>`` with Triton's own ptxas, disassemble with the nvdisasm /
  cuobjdump its wheel carries; registers and stack per thread.
* :func:`hot_loop_ops`: the opcodes of the longest loop of the SASS.

Needs a Triton with the ``ASTSource`` / ``GPUTarget`` compile API (3.x); imported lazily, so importing this
module costs nothing.
"""
from __future__ import annotations

import inspect
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, Iterable, List, Tuple

# one SASS instruction line of nvdisasm -c: optional predicate, opcode, optional .SUFFIXES
OP = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+ )?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?")

# MoE GEMM arguments (dsv4_sm120.moe.kernels), as fused_moe launches them
MOE_GEMM1_SIG = {"x_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*fp8e4nv", "wg_ptr": "*fp32", "sorted_ptr": "*i32",
                 "block_expert_ptr": "*i32", "h_ptr": "*bf16", "P": "i32", "TOPK": "i32", "H": "i32", "I": "i32",
                 "stride_xm": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32",
                 "swiglu_limit": "fp32", "E": "i32"}
MOE_GEMM2_SIG = {"h_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*fp8e4nv", "wg_ptr": "*fp32", "sorted_ptr": "*i32",
                 "block_expert_ptr": "*i32", "tw_ptr": "*fp32", "y_ptr": "*fp32", "P": "i32", "H": "i32", "I": "i32",
                 "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32", "E": "i32"}
# the pre-quantized activations of each GEMM (APRE)
MOE_APRE_SIG = {1: {"xq_ptr": "*u8", "xs_ptr": "*fp8e4nv", "xgs_ptr": "*fp32"},
                2: {"hq_ptr": "*u8", "hs_ptr": "*fp8e4nv", "hgs_ptr": "*fp32"}}
MOE_QUANT_SIG = {"a_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp8e4nv", "gs_ptr": "*fp32", "R": "i32", "K": "i32",
                 "stride_a": "i32", "sel_ptr": "*i32", "SEL_HI": "i32"}
# the other kernels' arguments as their launches pass them (attention.launch, moe.fused_moe), by kernel name
LAUNCH_SIGS = {
    "combine_kernel": {"acc_ws": "*fp32", "m_ws": "*fp32", "l_ws": "*fp32", "sink_ptr": "*fp32", "out_ptr": "*bf16",
                       "lse_ptr": "*fp32", "H": "i32", "S": "i32", "HP": "i32"},
    "q_fp8_kernel": {"q_ptr": "*bf16", "stride_qt": "i32", "stride_qh": "i32", "q8_ptr": "*u8", "qsc_ptr": "*u8",
                     "H": "i32", "HP": "i32"},
    "_quant_rows_kernel": MOE_QUANT_SIG,
    "_align_kernel": {"ids_ptr": "*i32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "P": "i32", "E": "i32",
                      "MAX_SLOTS": "i32", "MAX_BLOCKS": "i32"},
    "_reduce_kernel": {"y_ptr": "*fp32", "ids_ptr": "*i32", "out_ptr": "*bf16", "H": "i32", "E": "i32"},
}


def with_defaults(fn, cst: Dict[str, object]) -> Dict[str, object]:
    """``cst`` plus the declared defaults of the constexprs it leaves out (a newer flag must not turn into an
    i32 argument)."""
    out = dict(cst)
    for p in fn.params:
        if p.is_constexpr and p.name not in out and p.default is not inspect.Parameter.empty:
            out[p.name] = p.default
    return out


def kernel_source(fn, sig: Dict[str, str], cst: Dict[str, object], divisible: Iterable[str] = ()):
    """``ASTSource`` of ``fn``: arguments typed by ``sig``, constexprs ``cst`` (``None`` for an absent optional
    pointer), and ``tt.divisibility 16`` on the arguments named in ``divisible``."""
    from triton.compiler import ASTSource

    if getattr(fn, "is_gluon", lambda: False)():  # a Gluon kernel compiles through Gluon's own source class
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    typed = dict(sig, **{k: "constexpr" for k in cst})
    unknown = sorted(set(typed) - set(fn.arg_names))
    if unknown:
        raise ValueError(f"{getattr(fn, '__name__', fn)} has no argument(s) {', '.join(unknown)}")
    full = {n: typed[n] for n in fn.arg_names if n in typed}  # in argument order
    return ASTSource(fn=fn, signature=full, constexprs={(fn.arg_names.index(k),): v for k, v in cst.items()},
                     attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible})


def split_kernel_signature(fn, cst: Dict[str, object], acc: str = "*bf16") -> Dict[str, str]:
    """Triton signature of an attention ``split_kernel_*`` given its constexprs ``cst`` (pointer and scalar
    types of the real launch); ``acc``: the workspace's partial accumulator, ``*bf16`` (``PART_BF16``) or
    ``*fp32``."""
    sig = {}
    for n in fn.arg_names:
        if n in cst:
            sig[n] = "constexpr"
        elif n == "acc_ws":
            sig[n] = acc
        elif n in ("q_ptr", "out_ptr"):
            sig[n] = "*bf16"
        elif n in ("m_ws", "l_ws", "lse_ptr", "sink_ptr"):
            sig[n] = "*fp32"
        elif n.endswith("_ptr"):
            sig[n] = "*i32" if ("idx" in n or "len" in n) else "*u8"
        else:
            sig[n] = "fp32" if n == "sm_scale_log2" else "i32"
    return sig


def split_kernel_source(fn, cst: Dict[str, object], acc: str = "*bf16"):
    """``ASTSource`` of an attention ``split_kernel_*`` with constexprs ``cst`` (left-out ones take their declared
    defaults), the workspace accumulator type ``acc`` and the launch's 16-byte alignment facts (pointers, strides,
    page bytes), which decide the gathers' vector widths."""
    cst = with_defaults(fn, cst)
    sig = {n: t for n, t in split_kernel_signature(fn, cst, acc).items() if t != "constexpr"}
    div = [n for n, v in sig.items() if v.startswith("*") or n.startswith("stride") or n.endswith(("_PB", "_PB2"))]
    return kernel_source(fn, sig, cst, div)


def moe_gemm_source(fn, which: int, cst: Dict[str, object]):
    """``ASTSource`` of the MoE GEMM ``fn`` (``which`` 1: ``_gemm1_kernel``, 2: ``_gemm2_kernel``) with
    constexprs ``cst`` (left-out ones take their declared defaults, as in a launch without grouping). ``APRE``
    true types the pre-quantized activation pointers; false passes them as ``None``. Pointers, strides, ``H``
    and ``I`` are 16-divisible, as in every launch."""
    sig = dict(MOE_GEMM1_SIG if which == 1 else MOE_GEMM2_SIG)
    cst = with_defaults(fn, cst)
    if cst.get("APRE"):
        sig.update(MOE_APRE_SIG[which])
    else:
        cst.update({k: None for k in MOE_APRE_SIG[which]})
    div = [k for k, v in sig.items() if v.startswith("*") or k.startswith("stride") or k in ("H", "I")]
    return kernel_source(fn, sig, cst, div)


def launch_source(fn, cst: Dict[str, object], types: Dict[str, str] = None):
    """``ASTSource`` of a kernel of :data:`LAUNCH_SIGS` (by its name) with constexprs ``cst``, argument types
    ``types`` over the table's, and every pointer 16-byte aligned (fresh allocations, as the launches pass)."""
    sig = dict(LAUNCH_SIGS[fn.__name__], **(types or {}))
    return kernel_source(fn, sig, cst, [n for n, t in sig.items() if t.startswith("*")])


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


def compile_for(src, cap: int, options: Dict[str, int]):
    """``triton.compile`` of ``src`` for ``sm_<cap>`` (no GPU needed). Compile errors propagate."""
    import triton
    from triton.backends.compiler import GPUTarget

    return triton.compile(src, target=GPUTarget("cuda", cap, 32), options=options)


def compile_inspect(src, cap: int, options: Dict[str, int]):
    """Compile ``src`` for ``sm_<cap>`` and disassemble it: (kernel, ``nvdisasm -c`` SASS, resources), resources
    being ``{"regs": ..., "stack": ...}`` per thread when cuobjdump reports them (else empty). Compile errors
    propagate. cuobjdump's static shared memory and local memory per thread, where it reports them, come as
    ``static_shared`` / ``local``."""
    k = compile_for(src, cap, options)
    usage, sass = disassemble(k.asm["cubin"])
    m = re.search(r"REG:(\d+) STACK:(\d+)(?: SHARED:(\d+) LOCAL:(\d+))?", usage)
    res = {"regs": int(m.group(1)), "stack": int(m.group(2))} if m else {}
    if m and m.group(3) is not None:
        res.update(static_shared=int(m.group(3)), local=int(m.group(4)))
    return k, sass, res


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
