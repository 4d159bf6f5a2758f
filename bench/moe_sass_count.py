#!/usr/bin/env python3
"""Count the SASS instructions of the w13 GEMM's K loop on a CPU box, per weight decode (DEQ) or fp4 mode.

Compiles ``dsv4_sm120.moe.kernels._gemm1_kernel`` (BM=16, BN/BK as given, 4 warps, 3 stages) with Triton's own
ptxas, disassembles it with the nvdisasm that Triton's wheel carries, and prints the number of instructions of
the main loop and the most frequent opcodes. docs/moe.md quotes it (triton 3.6.0, sm_90, bf16 path: DEQ 2 877,
DEQ 3 610 instructions per 128 weight values per thread at BN=32, BK=256).

  python3 bench/moe_sass_count.py --deq 2,3 --bn 32 --bk 256                  # bf16 upcast path, sm_90
  python3 bench/moe_sass_count.py --path fp4 --arch 120 --apre 0,1            # native FP4 path, sm_120
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "overlay"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_tools import disassemble, hot_loop_ops  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deq", default="2,3", help="comma list of weight decodes (the kernels' DEQ constexpr, 1..4)")
    p.add_argument("--bn", type=int, default=32)
    p.add_argument("--bk", type=int, default=256)
    p.add_argument("--path", default="bf16", choices=("bf16", "fp4"), help="fp4: native dot_scaled (sm_100/120)")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--apre", default="0", help="fp4 path: comma list of APRE values (pre-quantized activations)")
    args = p.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        print(f"needs triton with the ASTSource/GPUTarget API: {exc}", file=sys.stderr)
        return 2
    from dsv4_sm120.moe import kernels as K

    fn = K._gemm1_kernel
    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*fp8e4nv", "wg_ptr": "*fp32", "sorted_ptr": "*i32",
           "block_expert_ptr": "*i32", "h_ptr": "*bf16", "P": "i32", "TOPK": "i32", "H": "i32", "I": "i32",
           "stride_xm": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32",
           "swiglu_limit": "fp32", "E": "i32"}
    fp4 = args.path == "fp4"
    print(f"triton {triton.__version__}, sm_{args.arch}, {args.path} path, BM=16 BN={args.bn} BK={args.bk}, "
          f"4 warps, 3 stages")
    runs = ([(3, int(a)) for a in args.apre.split(",") if a] if fp4
            else [(int(d), 0) for d in args.deq.split(",") if d])
    for deq, apre in runs:
        sig_r = dict(sig)
        if apre:
            sig_r.update(xq_ptr="*u8", xs_ptr="*fp8e4nv", xgs_ptr="*fp32")
        div16 = [k for k, v in sig_r.items() if v.startswith("*") or k.startswith("stride") or k in ("H", "I")]
        attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in div16}
        cst = dict(HAS_LIMIT=True, BM=16, BN=args.bn, BK=args.bk, PATH_FP4=fp4, NATIVE=fp4, INTERP=False,
                   DEQ=deq, ALOAD_SPLIT=True, GROUPED=False, P_PAD=16, E_PAD=16, APRE=bool(apre))
        if not apre:
            cst.update(xq_ptr=None, xs_ptr=None, xgs_ptr=None)
        src = ASTSource(fn=fn, signature=dict(sig_r, **{k: "constexpr" for k in cst}),
                        constexprs={(fn.arg_names.index(k),): v for k, v in cst.items()}, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", args.arch, 32), options={"num_warps": 4, "num_stages": 3})
        ops = [o for o, _ in hot_loop_ops(disassemble(k.asm["cubin"])[1])]
        if not ops:
            print(f"{'APRE ' + str(apre) if fp4 else 'DEQ ' + str(deq)}: no loop found")
            continue
        top = ", ".join(f"{n} {o}" for o, n in collections.Counter(ops).most_common(int(os.environ.get("TOPN", "10"))))
        per = 2 * args.bn * args.bk // 128
        name = f"APRE {apre}" if fp4 else f"DEQ {deq}"
        print(f"{name}: {len(ops)} loop instructions per {per} weight values per thread ({top})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
