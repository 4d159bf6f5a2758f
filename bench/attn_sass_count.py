#!/usr/bin/env python3
"""Count the SASS instructions of the sparse-MLA split kernel's candidate loop on a CPU box (no GPU).

Compiles ``dsv4_sm120.attention.kernel._dsv4_split_kernel_<impl>`` for sm_90 / sm_120 with Triton's own
ptxas (H=16 launch shape: BLOCK_H 16, SWA main + c4 extra, bf16 QK, index prefetch), disassembles it with
the nvdisasm / cuobjdump that Triton's wheel carries, and prints registers / stack / shared memory, the number of
instructions of the longest loop (one candidate block, per warp) and the opcodes that matter for the
pipes: conversions (F2F, F2FP: 16 results per SM per clock on sm_90), shared-memory traffic, barriers.
docs/attention.md quotes it. Runs without torch (stubbed) so a bare ``pip install triton==3.6.0`` (the
H200 image's version) is enough:

  python3 bench/attn_sass_count.py --impl tiled --kcvt 0,1
  python3 bench/attn_sass_count.py --impl bt --block-n 32 --maxnreg 0 --arch 90
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

OP = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+ )?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?")


def _load_kernel_module():
    try:
        import torch  # noqa: F401
    except ImportError:
        from unittest.mock import MagicMock
        sys.modules["torch"] = MagicMock()
    from dsv4_sm120.attention import kernel
    return kernel


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", default="tiled", help="tiled | bt | pipe | wg (the _dsv4_split_kernel_<impl>)")
    p.add_argument("--arch", default="90,120", help="comma list of compute capabilities")
    p.add_argument("--kcvt", default="0,1", help="comma list of KCVT values")
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--num-warps", type=int, default=8)
    p.add_argument("--num-stages", type=int, default=0, help="0: 2 on sm_90, 1 elsewhere (the defaults)")
    p.add_argument("--maxnreg", type=int, default=128, help="0: no cap")
    p.add_argument("--qk", default="bf16", choices=("bf16", "fp8"), help="QK path (fp8: dot_scaled, native on sm_120)")
    p.add_argument("--extra", default="", help="more constexprs of the kernel, e.g. PREFETCH=0")
    args = p.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        print(f"needs triton with the ASTSource/GPUTarget API: {exc}", file=sys.stderr)
        return 2
    K = _load_kernel_module()
    fn = getattr(K, f"_dsv4_split_kernel_{args.impl}", None)
    if fn is None:
        print(f"no kernel _dsv4_split_kernel_{args.impl}", file=sys.stderr)
        return 2
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    print(f"triton {triton.__version__}, impl={args.impl}, BLOCK_H=16 BLOCK_N={args.block_n}, "
          f"{args.num_warps} warps, maxnreg {args.maxnreg or 'none'}")
    for arch in [int(a) for a in args.arch.split(",") if a]:
        for kcvt in [int(c) for c in args.kcvt.split(",") if c]:
            cst = dict(HAS_MAIN_LEN=False, HAS_EXTRA=True, HAS_EXTRA_LEN=False, BLOCK_H=16, BLOCK_N=args.block_n,
                       FP8_QK=args.qk == "fp8", INTERP=False)
            if "PREFETCH" in fn.arg_names:
                cst["PREFETCH"] = True
            if "KCVT" in fn.arg_names:
                cst["KCVT"] = bool(kcvt)
            if "QPRE" in fn.arg_names:
                cst["QPRE"] = args.qk == "fp8"  # the fp8 path's default: Q quantized before the launch
            for kv in (x for x in args.extra.split(",") if x):
                k_, v_ = kv.split("=")
                cst[k_] = bool(int(v_)) if k_ in ("KCVT", "QPRE") else int(v_)
            if not cst.get("QPRE", True):
                cst.update(q8_ptr=None, qsc_ptr=None)
            sig = {}
            for n in fn.arg_names:
                if n in cst:
                    sig[n] = "constexpr"
                elif n in ("q8_ptr", "qsc_ptr"):
                    sig[n] = "*u8"
                elif n in ("q_ptr", "acc_ws"):
                    sig[n] = "*bf16"
                elif n in ("m_ws", "l_ws"):
                    sig[n] = "*fp32"
                elif n.endswith("_ptr"):
                    sig[n] = "*i32" if ("idx" in n or "len" in n) else "*u8"
                else:
                    sig[n] = "fp32" if n == "sm_scale_log2" else "i32"
            div = [n for n, v in sig.items()
                   if v.startswith("*") or n.startswith("stride") or n.endswith(("_PB", "_PB2"))]
            src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in cst.items()},
                            attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div})
            opts = {"num_warps": args.num_warps,
                    "num_stages": args.num_stages or (2 if arch == 90 else 1)}
            if args.maxnreg:
                opts["maxnreg"] = args.maxnreg
            try:
                k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
            except Exception as exc:  # noqa: BLE001
                print(f"sm_{arch} KCVT={kcvt}: compile failed: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(k.asm["cubin"])
                f.flush()
                ru = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
                sass = subprocess.run([str(tool.with_name("nvdisasm")), "-c", f.name], capture_output=True,
                                      text=True).stdout
            res = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", ru)
            lines = sass.splitlines()
            loops = []
            for i, line in enumerate(lines):
                m = re.search(r"\bBRA\b[^`]*`\(\.(L_x_\d+)\)", line)
                if m:
                    start = next((j for j, x in enumerate(lines) if x.strip().startswith(f".{m.group(1)}:")), None)
                    if start is not None and start < i:
                        loops.append((i - start, start, i))
            body = lines[max(loops)[1]:max(loops)[2] + 1] if loops else []
            ops = [m.group(2) for x in body if (m := OP.match(x))]
            full = collections.Counter(m.group(2) + (m.group(3) or "") for x in body if (m := OP.match(x)))
            pipes = {k: sum(n for o, n in full.items() if o.startswith(k)) for k in ("F2F.", "F2FP.", "LDS", "STS",
                                                                                     "BAR", "SHFL", "HMMA")}
            print(f"sm_{arch} KCVT={kcvt}: REG {res.group(1) if res else '?'} STACK {res.group(2) if res else '?'} "
                  f"smem {k.metadata.shared} B; loop {len(ops)} instructions per warp and candidate block; "
                  + ", ".join(f"{k.rstrip('.')} {v}" for k, v in pipes.items()))
            print("   top: " + ", ".join(f"{n} {o}" for o, n in collections.Counter(ops).most_common(12)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
