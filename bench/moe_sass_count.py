#!/usr/bin/env python3
"""Count the SASS instructions of the w13 GEMM's K loop on a CPU box, per weight decode (bf16 path) or activation
quantization mode (fp4 path).

Compiles ``dsv4_sm120.moe.kernels._gemm1_kernel`` (BM=16, BN/BK as given, 4 warps, 3 stages, aligned grouping)
with Triton's own ptxas, disassembles it with the nvdisasm that Triton's wheel carries
(``dsv4_sm120.dev.sass``), and prints the number of instructions of the main loop and the most frequent
opcodes. Weight decodes of the bf16 path (``Config.deq``): 0 float32 math (portable), 3 inline-PTX shift decode
(the default on NVIDIA GPUs). docs/moe.md quotes the fp4 counts.

  python3 bench/moe_sass_count.py --deq 0,3 --bn 32 --bk 256                  # bf16 upcast path, sm_90
  python3 bench/moe_sass_count.py --path fp4 --arch 120 --apre 0,1            # native FP4 path, sm_120
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "overlay"))
from dsv4_sm120.dev.sass import compile_for, disassemble, hot_loop_ops, moe_gemm_source  # noqa: E402

DECODES = (0, 3)  # dsv4_sm120.moe.config.DECODES (not imported: --help needs no triton)


def _int_list(parser, text: str, what: str, allowed) -> list:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = None
    if not vals or any(v not in allowed for v in vals):
        parser.error(f"{what} must be a comma list of {', '.join(map(str, allowed))}, got {text!r}")  # exits 2
    return vals


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deq", default="3", help="bf16 path: comma list of weight decodes, 0 (float32) and/or 3 "
                                              "(inline-PTX shift decode; the default)")
    p.add_argument("--bn", type=int, default=32)
    p.add_argument("--bk", type=int, default=256)
    p.add_argument("--path", default="bf16", choices=("bf16", "fp4"), help="fp4: native dot_scaled (sm_100/120)")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--apre", default="0", help="fp4 path: comma list of APRE values (pre-quantized activations)")
    args = p.parse_args(argv)
    fp4 = args.path == "fp4"
    runs = ([(0, a) for a in _int_list(p, args.apre, "--apre", (0, 1))] if fp4
            else [(d, 0) for d in _int_list(p, args.deq, "--deq", DECODES)])
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as exc:
        print(f"moe_sass_count: error: needs triton with the ASTSource/GPUTarget API: {exc}", file=sys.stderr)
        return 2
    from dsv4_sm120.moe import kernels as K

    print(f"triton {triton.__version__}, sm_{args.arch}, {args.path} path, BM=16 BN={args.bn} BK={args.bk}, "
          f"4 warps, 3 stages")
    for deq, apre in runs:
        name = f"APRE {apre}" if fp4 else f"DEQ {deq}"
        cst = dict(HAS_LIMIT=True, BM=16, BN=args.bn, BK=args.bk, PATH_FP4=fp4, NATIVE=fp4, INTERP=False,
                   DEQ=deq, GROUPED=False, P_PAD=16, E_PAD=16, APRE=bool(apre))
        k = compile_for(moe_gemm_source(K._gemm1_kernel, 1, cst), args.arch, {"num_warps": 4, "num_stages": 3})
        ops = [o for o, _ in hot_loop_ops(disassemble(k.asm["cubin"])[1])]
        if not ops:
            print(f"{name}: no loop found")
            continue
        top = ", ".join(f"{n} {o}" for o, n in collections.Counter(ops).most_common(int(os.environ.get("TOPN", "10"))))
        per = 2 * args.bn * args.bk // 128
        print(f"{name}: {len(ops)} loop instructions per {per} weight values per thread ({top})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
