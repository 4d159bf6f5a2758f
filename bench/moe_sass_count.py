#!/usr/bin/env python3
"""Count the SASS instructions of the w13 GEMM's K loop for sm_90, per weight decode (DEQ), on a CPU box.

Compiles ``dsv4_sm120.moe.kernels._gemm1_kernel`` (bf16 upcast path, BM=16, BN/BK as given, 4 warps, 3 stages)
with Triton's own ptxas, disassembles it with the nvdisasm that Triton's wheel carries, and prints the number of
instructions of the main loop and the most frequent opcodes. docs/moe.md quotes it (triton 3.6.0: DEQ 2 877,
DEQ 3 610 instructions per 128 weight values per thread at BN=32, BK=256).

  python3 bench/moe_sass_count.py --deq 2,3 --bn 32 --bk 256
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "overlay"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deq", default="2,3", help="comma list of DSV4_SM120_MOE_DEQ decodes (1..4)")
    p.add_argument("--bn", type=int, default=32)
    p.add_argument("--bk", type=int, default=256)
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

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    fn = K._gemm1_kernel
    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*fp8e4nv", "wg_ptr": "*fp32", "sorted_ptr": "*i32",
           "block_expert_ptr": "*i32", "h_ptr": "*bf16", "P": "i32", "TOPK": "i32", "H": "i32", "I": "i32",
           "stride_xm": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32",
           "swiglu_limit": "fp32", "E": "i32"}
    div16 = [k for k, v in sig.items() if v.startswith("*") or k.startswith("stride") or k in ("H", "I")]
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in div16}
    print(f"triton {triton.__version__}, sm_90, BM=16 BN={args.bn} BK={args.bk}, 4 warps, 3 stages")
    for deq in [int(d) for d in args.deq.split(",") if d]:
        cst = dict(HAS_LIMIT=True, BM=16, BN=args.bn, BK=args.bk, PATH_FP4=False, NATIVE=False, INTERP=False,
                   DEQ=deq, ALOAD_SPLIT=True, GROUPED=False, P_PAD=16, E_PAD=16)
        src = ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in cst}),
                        constexprs={(fn.arg_names.index(k),): v for k, v in cst.items()}, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
        lines = sass.splitlines()
        # the main loop: from the label the backward branch jumps to, to that branch
        back = [i for i, l in enumerate(lines) if re.search(r"BRA `\(\.L_x_\d+\)", l)]
        loop = None
        for i in back:
            label = re.search(r"\(\.(L_x_\d+)\)", lines[i]).group(1)
            start = next((j for j, l in enumerate(lines) if l.startswith(f".{label}:")), None)
            if start is not None and start < i and (loop is None or i - start > loop[1] - loop[0]):
                loop = (start, i)
        if loop is None:
            print(f"DEQ {deq}: no loop found")
            continue
        ops = [m.group(2) for l in lines[loop[0]:loop[1] + 1]
               if (m := re.match(r"\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+ )?([A-Z0-9_]+)", l))]
        top = ", ".join(f"{n} {o}" for o, n in collections.Counter(ops).most_common(int(os.environ.get("TOPN", "8"))))
        per = 2 * args.bn * args.bk // 128
        print(f"DEQ {deq}: {len(ops)} loop instructions per {per} weight values per thread ({top})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
