"""Compile every sm_120 launch of :mod:`dsv4_sm120.dev.sm120_launches` for sm_120 on this (CPU) box with
Triton's own ptxas, and check what an RTX PRO 6000 / RTX 50 needs of it:

* it compiles;
* its shared memory fits a block (99 KiB) and, with the 1 KiB the driver reserves per CTA, the CTAs per SM the
  launch needs (``Launch.need["ctas"]``) fit the SM's 100 KiB; so do its registers (64K per SM, allocated per warp
  in units of 256) and threads (1536 per SM);
* it spills nothing: no local-memory load or store (LDL/STL) in its SASS, no local memory (a stack frame
  nothing reads or writes, as ptxas leaves in the activation quantizer, is not a spill), but for the bounded
  number :data:`.sm120_launches.ACCEPTED_SPILLS` accepts of a few launches, each with its reason;
* where the product relies on it, the native block-scaled MMA is in its SASS (:data:`MMA_OPCODES`).

Results (numbers only, no SASS) are cached as JSON in ``<DSV4_SM120_CACHE>/sm120-compile/<family>.json``, keyed by a
hash of the kernel source with its dependencies (Triton's ``ASTSource.hash``), the compile options, the Triton
version and :data:`CHECK_VERSION`, so a run after an unchanged one compiles nothing.

``python -m dsv4_sm120.dev.sm120_compile [family ...]`` prints one line per problem and a summary per family,
and exits 1 when there is a problem; ``--json`` prints the summary as ``RESULT<json>`` (tests/test_sm120_compile.py).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Dict, List

from ..paths import cache_dir
from . import sm120_launches as SL

CHECK_VERSION = 2          # bump when what is recorded per launch changes
CAP = 120
SMEM_PER_BLOCK = 99 * 1024     # the most dynamic shared memory one block may ask for on sm_120
SMEM_PER_SM = 100 * 1024
SMEM_RESERVED = 1024           # per CTA, by the driver (cuobjdump reports it as the kernel's static shared memory)
REGS_PER_SM = 65536
THREADS_PER_SM = 1536
CTAS_PER_SM = 32
# SASS opcodes of the native block-scaled MMAs on sm_120 (seen in Triton 3.8's code for these kernels):
# fp4: OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X (tl.dot_scaled e2m1 with e4m3 scales); fp8: QMMA.SF.16832.F32.E4M3.E4M3.E8
MMA_OPCODES = {"fp4": r"OMMA\.SF\.\S*E2M1\.E2M1", "fp8": r"QMMA\.SF\.\S*E4M3\.E4M3"}
MMA_WHAT = {"fp4": "the native block-scaled FP4 MMA (OMMA.SF ... E2M1)",
            "fp8": "the native block-scaled FP8 MMA (QMMA.SF ... E4M3)"}


def cache_file(family: str) -> Path:
    return cache_dir() / "sm120-compile" / f"{family}.json"


def _kernel(name: str):
    mod, fn = name.split(".")
    return getattr(importlib.import_module(f"dsv4_sm120.{mod}.kernels"), fn)


def source(la: SL.Launch):
    """Triton ``ASTSource`` of a launch, with the argument types and alignment its launch passes."""
    from . import sass

    fn = _kernel(la.kernel)
    name = la.kernel.split(".")[1]
    if name.startswith("split_kernel_"):
        return sass.split_kernel_source(fn, la.constexprs, la.sig.get("acc_ws", "*bf16"))
    if name in ("_gemm1_kernel", "_gemm2_kernel"):
        return sass.moe_gemm_source(fn, int(name[5]), la.constexprs)
    return sass.launch_source(fn, la.constexprs, la.sig)


def compile_key(la: SL.Launch, src) -> str:
    import triton

    text = json.dumps([src.hash(), la.options, CAP, triton.__version__, CHECK_VERSION], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def inspect(la: SL.Launch, src) -> Dict[str, object]:
    """What the checks read of one compile: shared memory (dynamic, static), registers, stack / local memory,
    local loads and stores, MMA opcodes; ``{"error": ...}`` when it does not compile."""
    from .sass import compile_inspect

    try:
        k, sass_text, res = compile_inspect(src, CAP, dict(la.options))
    except Exception as e:  # noqa: BLE001 - reported as the launch's problem
        msg = " ".join(str(e).split())
        return {"error": f"{type(e).__name__}: {msg[:400]}"}
    return {"shared": int(k.metadata.shared), "static_shared": res.get("static_shared", 0),
            "regs": res.get("regs"), "stack": res.get("stack", 0), "local": res.get("local", 0),
            "local_ops": len(re.findall(r"\b(?:LDL|STL)\b", sass_text)), "sass_lines": sass_text.count("\n"),
            "mma": sorted(set(re.findall(r"\b[A-Z]*MMA\.[A-Z0-9_.]+", sass_text))),
            "setmaxnreg": sorted({int(n) for n in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)",
                                                             k.asm.get("ptx", ""))})}


def ctas_per_sm(r: Dict[str, object], num_warps: int) -> Dict[str, int]:
    """Resident CTAs per SM by shared memory, registers and threads (the occupancy rules of sm_120)."""
    per_cta = int(r["shared"]) + max(SMEM_RESERVED, int(r.get("static_shared") or 0))
    out = {"shared": SMEM_PER_SM // per_cta, "threads": THREADS_PER_SM // (32 * num_warps)}
    if r.get("regs"):
        per_warp = -(-int(r["regs"]) * 32 // 256) * 256
        out["registers"] = (REGS_PER_SM // per_warp) // num_warps
    out["all"] = min([CTAS_PER_SM] + list(out.values()))
    return out


def problems(la: SL.Launch, r: Dict[str, object]) -> List[str]:
    """One line per broken rule, naming the table file[key] (and variant) the launch comes from."""
    where = la.origins[0] + (f" (and {len(la.origins) - 1} more)" if len(la.origins) > 1 else "")
    what = f"{where}: {la.kernel} [{', '.join(f'{k}={v}' for k, v in sorted(la.options.items()))}]"
    if "error" in r:
        return [f"{what} does not compile for sm_120: {r['error']}"]
    out = []
    if r["shared"] > SMEM_PER_BLOCK:
        out.append(f"{what} asks for {r['shared']} B of shared memory per block; sm_120 allows {SMEM_PER_BLOCK}")
    accepted = int(la.need.get("spills", 0))
    if r["local"] or r["local_ops"] > accepted:
        out.append(f"{what} spills to local memory ({r['local_ops']} LDL/STL in its SASS"
                   + (f", {accepted} accepted (sm120_launches.ACCEPTED_SPILLS)" if accepted else "")
                   + f"; stack frame {r['stack']} B, {r['regs']} registers per thread)")
    need = int(la.need.get("ctas", 1))
    occ = ctas_per_sm(r, int(la.options["num_warps"]))
    if occ["all"] < need:
        by = ", ".join(f"{k} {v}" for k, v in occ.items() if k != "all")
        out.append(f"{what} fits {occ['all']} CTA(s) per SM ({by}; {r['shared']} B shared, {r['regs']} registers "
                   f"per thread), the launch needs {need}")
    if "max_shared" in la.need and r["shared"] > la.need["max_shared"]:
        out.append(f"{what} asks for {r['shared']} B of shared memory per block, over the {la.need['max_shared']} B "
                   "it is pinned to (sm120_launches.RESOURCE_BOUNDS)")
    if "max_regs" in la.need and (r["regs"] or 0) > la.need["max_regs"]:
        out.append(f"{what} takes {r['regs']} registers per thread, over the {la.need['max_regs']} it is pinned to "
                   "(sm120_launches.RESOURCE_BOUNDS)")
    missing = [n for n in la.need.get("partition_regs", ()) if n not in r.get("setmaxnreg", ())]
    if missing:
        out.append(f"{what} gives its warp-specialized partitions {r.get('setmaxnreg')} registers (setmaxnreg), not "
                   f"the {list(la.need['partition_regs'])} it is pinned to (sm120_launches.RESOURCE_BOUNDS)")
    mma = la.need.get("mma")
    if mma and not any(re.fullmatch(MMA_OPCODES[mma] + r"\S*", op) for op in r["mma"]):
        out.append(f"{what} has no {MMA_WHAT[mma]} in its SASS (MMA opcodes: {', '.join(r['mma']) or 'none'})")
    return out


def _read_cache(path: Path) -> Dict[str, dict]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def check_family(family: str) -> Dict[str, object]:
    """Enumerate, compile (what the cache does not hold) and check one family; the summary the test reads."""
    from ..fileio import atomic_write_json

    t0 = time.monotonic()
    launches = SL.enumerate_launches([family])[family]
    path = cache_file(family)
    old = _read_cache(path)
    new, compiled, found = {}, 0, []
    for la in launches:
        src = source(la)
        key = compile_key(la, src)
        r = old.get(key) or new.get(key)
        if r is None:
            r = inspect(la, src)
            compiled += 1
        new[key] = r
        found += problems(la, r)
    try:
        atomic_write_json(path, new, indent=0, sort_keys=True)
    except OSError as e:   # a read-only cache: the checks still ran
        print(f"sm120_compile: cannot write {path}: {e.strerror}", file=sys.stderr)
    done = [r for r in new.values() if "error" not in r]
    return {"launches": len(launches), "compiled": compiled, "seconds": round(time.monotonic() - t0, 1),
            "kernels": sorted({la.kernel for la in launches}), "problems": found,
            "max_shared": max((r["shared"] for r in done), default=0),
            "max_regs": max((r["regs"] or 0 for r in done), default=0)}


def toolchain_problem() -> str:
    """Why nothing can compile here (no Triton compile API, no ptxas in its wheel); empty when it can."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        return f"this Triton has no ASTSource/GPUTarget compile API ({e})"
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return "" if ptxas.is_file() else f"no ptxas in the Triton wheel ({ptxas})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_sm120.dev.sm120_compile", description=__doc__.split("\n")[0])
    ap.add_argument("families", nargs="*", help=f"default: all ({', '.join(SL.FAMILIES)})")
    ap.add_argument("--json", action="store_true", help="print the summary as RESULT<json>")
    a = ap.parse_args(argv)
    bad = [f for f in a.families if f not in SL.FAMILIES]
    if bad:
        ap.error(f"unknown famil{'ies' if len(bad) > 1 else 'y'} {', '.join(bad)}; known: {', '.join(SL.FAMILIES)}")
    why = toolchain_problem()
    if why:
        if a.json:
            print("RESULT" + json.dumps({"toolchain": {"error": why}}))
            return 0
        print(f"sm120_compile: {why}", file=sys.stderr)
        return 2
    out = {f: check_family(f) for f in (a.families or SL.FAMILIES)}
    if a.json:
        print("RESULT" + json.dumps(out))
        return 0
    for f, s in out.items():
        for p in s["problems"]:
            print(p)
        print(f"{f}: {s['launches']} launches ({s['compiled']} compiled, the rest cached), {len(s['problems'])} "
              f"problem(s), {s['seconds']} s; max shared {s['max_shared']} B, max registers {s['max_regs']}")
    return 1 if any(s["problems"] for s in out.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
