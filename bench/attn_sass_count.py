#!/usr/bin/env python3
"""Count the SASS instructions of the sparse-MLA split kernel's candidate loop on a CPU box (no GPU).

Compiles ``dsv4_sm120.attention.kernels.split_kernel_<impl>`` for sm_90 / sm_120 with Triton's own ptxas (H=16
launch shape: BLOCK_H 16, SWA main + c4 extra, bf16 or fp8 QK, index prefetch), disassembles it with the
nvdisasm / cuobjdump that Triton's wheel carries (``dsv4_sm120.dev.sass``), and prints registers / stack /
shared memory, the number of instructions of the longest loop (one candidate block, per warp) and the opcodes
that matter for the pipes: conversions (F2F, F2FP: 16 results per SM per clock on sm_90), shared-memory traffic,
barriers. docs/attention.md quotes it. Runs without torch (stubbed) so a bare ``pip install triton==3.6.0`` (the
H200 image's version) is enough:

  python3 bench/attn_sass_count.py --impl tiled --kcvt 0,1
  python3 bench/attn_sass_count.py --impl reg --num-stages 1 --maxnreg 0 --arch 90 --ops
  python3 bench/attn_sass_count.py --impl reg --extra DEC_LATE=0,SPAN=0
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "overlay"))
from dsv4_sm120.dev.sass import compile_inspect, hot_loop_ops, split_kernel_source  # noqa: E402


class UsageError(Exception):
    pass


def _kernels():
    try:
        import torch  # noqa: F401
    except ImportError:
        from unittest.mock import MagicMock
        sys.modules["torch"] = MagicMock()
    from dsv4_sm120.attention import kernels
    return kernels


def _int_list(text: str, what: str):
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{what} must be a comma list of integers, got {text!r}") from None


def parse_extra(fn, text: str) -> dict:
    """'DEC_LATE=0,SPAN=1' -> constexpr values; a name the kernel does not declare is an error."""
    declared = {p.name: p for p in fn.params if p.is_constexpr}
    out = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        k, sep, v = (x.strip() for x in item.partition("="))
        if k not in declared:
            raise UsageError(f"--extra {item!r}: {fn.__name__} has no constexpr {k!r}; it has "
                             f"{', '.join(declared)}")
        try:
            val = int(v) if sep else None
        except ValueError:
            val = None
        if val is None:
            raise UsageError(f"--extra {item!r}: expected {k}=<integer>")
        # a flag declared with a bool default stays a bool (0/1); anything else keeps its integer
        out[k] = bool(val) if isinstance(declared[k].default, bool) and val in (0, 1) else val
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", default="tiled", help="tiled | reg | flat (the kernels.split_kernel_<impl>)")
    p.add_argument("--arch", default="90,120", help="comma list of compute capabilities")
    p.add_argument("--kcvt", default="0,1", help="comma list of KCVT values (bodies that have KCVT)")
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--num-warps", type=int, default=8)
    p.add_argument("--num-stages", type=int, default=0, help="0: 2 on sm_90, 1 elsewhere (the defaults)")
    p.add_argument("--maxnreg", type=int, default=128, help="0: no cap")
    p.add_argument("--qk", default="bf16", choices=("bf16", "fp8"), help="QK path (fp8: dot_scaled, native on sm_120)")
    p.add_argument("--ops", action="store_true", help="also print every loop opcode with its suffixes")
    p.add_argument("--extra", default="", help="more constexprs of the kernel, e.g. PREFETCH=0 or DEC_LATE=0,SPAN=0")
    args = p.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401  (compile_inspect's target API)
        from triton.compiler import ASTSource  # noqa: F401  (the API the compile below needs)
    except ImportError as exc:
        print(f"attn_sass_count: error: needs triton with the ASTSource/GPUTarget API: {exc}", file=sys.stderr)
        return 2
    K = _kernels()
    fn = K.SPLIT_KERNELS.get(args.impl)
    try:
        if fn is None:
            raise UsageError(f"--impl {args.impl!r}: expected one of {', '.join(K.SPLIT_KERNELS)}")
        from dsv4_sm120.attention.config import BF16_ONLY_IMPLS

        if args.qk == "fp8" and args.impl in BF16_ONLY_IMPLS:
            raise UsageError(f"--impl {args.impl} has no fp8 QK path (bf16 only)")
        extra = parse_extra(fn, args.extra)
        arches, kcvts = _int_list(args.arch, "--arch"), _int_list(args.kcvt, "--kcvt")
    except UsageError as exc:
        print(f"attn_sass_count: error: {exc}", file=sys.stderr)
        return 2
    if "KCVT" not in fn.arg_names:
        kcvts = [0]
    print(f"triton {triton.__version__}, impl={args.impl}, BLOCK_H=16 BLOCK_N={args.block_n}, "
          f"{args.num_warps} warps, maxnreg {args.maxnreg or 'none'}")
    for arch in arches:
        for kcvt in kcvts:
            cst = dict(HAS_MAIN_LEN=False, HAS_EXTRA=True, HAS_EXTRA_LEN=False, BLOCK_H=16, BLOCK_N=args.block_n)
            if "FP8_QK" in fn.arg_names:   # the Gluon bodies are bf16 only and never interpreted
                cst.update(FP8_QK=args.qk == "fp8", INTERP=False)
            if "PREFETCH" in fn.arg_names:
                cst["PREFETCH"] = True
            if "KCVT" in fn.arg_names:
                cst["KCVT"] = bool(kcvt)
            cst.update(extra)
            if "q8_ptr" in fn.arg_names and args.qk == "bf16":
                cst.update(q8_ptr=None, qsc_ptr=None)  # Q pre-quantized by q_fp8_kernel only on the fp8 path
            src = split_kernel_source(fn, cst)
            opts = {"num_warps": args.num_warps,
                    "num_stages": args.num_stages or (2 if arch == 90 else 1)}
            if args.maxnreg:
                opts["maxnreg"] = args.maxnreg
            try:
                k, sass, res = compile_inspect(src, arch, opts)
            except Exception as exc:  # noqa: BLE001
                print(f"sm_{arch} KCVT={kcvt}: compile failed: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            loop = hot_loop_ops(sass)
            ops = [o for o, _ in loop]
            full = collections.Counter(f for _, f in loop)
            pipes = {k: sum(n for o, n in full.items() if o.startswith(k)) for k in ("F2F.", "F2FP.", "LDS", "STS",
                                                                                     "BAR", "SHFL", "HMMA")}
            print(f"sm_{arch} KCVT={kcvt}: REG {res.get('regs', '?')} STACK {res.get('stack', '?')} "
                  f"smem {k.metadata.shared} B; loop {len(ops)} instructions per warp and candidate block; "
                  + ", ".join(f"{k.rstrip('.')} {v}" for k, v in pipes.items()))
            print("   top: " + ", ".join(f"{n} {o}" for o, n in collections.Counter(ops).most_common(12)))
            if args.ops:
                print("   all: " + ", ".join(f"{n} {o}" for o, n in sorted(full.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
