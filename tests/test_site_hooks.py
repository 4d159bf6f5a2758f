"""tests/site/sitecustomize.py (on the PYTHONPATH of the children that run Triton's interpreter and of the
stand-in deployments):

* importing it imports no Triton; once the interpreter is imported, a launch patches the language modules once
  instead of once per nested ``@triton.jit`` call, and the kernel's output is bit-identical to the unwrapped
  interpreter's and to a torch reference;
* the router launcher's optional import of SGLang's tracing helpers ends as it does without the hook (the pinned
  SGLang has no such module, so the launcher goes on without them), minus the import of the whole ``sglang``
  package; any other process still finds SGLang.
(The router itself runs under the hook in the orchestration, router and verify tests.)"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

from conftest import SITE

KERNEL = textwrap.dedent("""
    import triton
    import triton.language as tl


    @triton.jit
    def _axpy(x, y, a):
        return a * x + y


    @triton.jit
    def axpy3(X, Y, O, C, a, N: tl.constexpr):
        i = tl.program_id(0) * N + tl.arange(0, N)
        x = tl.load(X + i)
        y = tl.load(Y + i)
        y = _axpy(x, y, a)
        y = _axpy(x, y, a)
        y = _axpy(x, y, a)
        tl.store(O + i, y)
        # conversions through bf16 and fp8 and back (the tables of part 3 and Triton's own function)
        tl.store(C + i, x.to(tl.bfloat16).to(tl.float32) + (y * 64).to(tl.float8e4nv).to(tl.float32))
""")

PROBE = textwrap.dedent("""
    import json, os, sys
    triton_at_start = sorted(m for m in sys.modules if m.split(".")[0] == "triton")
    os.environ["TRITON_INTERPRET"] = "1"            # set after start-up, as `calibrate --device cpu` does
    import torch
    import triton.runtime.interpreter as I
    runs = [0]
    real = I._patch_builtin                        # what every real patching of the language modules calls
    def counted(*a, **k):
        runs[0] += 1
        return real(*a, **k)
    I._patch_builtin = counted
    import kern
    g = torch.Generator().manual_seed(int(sys.argv[1]))
    x, y = torch.randn(8 * 16, generator=g), torch.randn(8 * 16, generator=g)
    x[:4] = torch.tensor([1e-40, -3e-39, float("inf"), float("nan")])   # subnormal, inf and NaN inputs too
    out, conv = torch.empty_like(x), torch.empty_like(x)
    kern.axpy3[(8,)](x, y, out, conv, 0.75, N=16)
    ref = y.clone()
    for _ in range(3):
        ref = 0.75 * x + ref
    print("RESULT" + json.dumps({"triton_at_start": triton_at_start, "runs": runs[0],
                                 "wrapped": bool(getattr(I, "_dsv4_lang_patch_once", False)),
                                 "tables": bool(getattr(I, "_dsv4_tables", False)),
                                 "out": out[4:].tolist(), "ref_err": float((out - ref)[4:].abs().max()),
                                 "conv_bits": conv.view(torch.int32).tolist()}))
""")


def _run(tmp_path, with_site: bool, seed: int) -> dict:
    (tmp_path / "kern.py").write_text(KERNEL)
    paths = [str(tmp_path)] + ([str(SITE)] if with_site else [])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join(paths)
    r = subprocess.run([sys.executable, "-c", PROBE, str(seed)], capture_output=True, text=True, env=env,
                       cwd=str(tmp_path), timeout=300)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT"):])


def test_nested_helpers_stop_repatching_and_results_are_bit_identical(tmp_path):
    seed = random.randrange(1 << 30)
    plain = _run(tmp_path, False, seed)
    fast = _run(tmp_path, True, seed)
    assert fast["triton_at_start"] == [] and fast["wrapped"] and not plain["wrapped"]
    assert fast["tables"] and not plain["tables"]
    assert fast["out"] == plain["out"], seed                           # bit for bit
    assert fast["conv_bits"] == plain["conv_bits"], seed
    assert fast["ref_err"] < 1e-5 and plain["ref_err"] < 1e-5, (fast["ref_err"], plain["ref_err"])
    # the launch patches once per language module; the plain interpreter again for each of 8 x 3 helper calls
    assert 0 < fast["runs"] and fast["runs"] * 8 < plain["runs"], (fast["runs"], plain["runs"])


ROUTER_PROBE = textwrap.dedent("""
    import importlib.util, json, runpy, sys
    sys.argv = ["launch_router", "--help"]
    try:                                   # as `python -m sglang_router.launch_router --help` runs it
        runpy.run_module("sglang_router.launch_router", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    in_router = sorted(m for m in sys.modules if m.split(".")[0] == "sglang")
    print("RESULT" + json.dumps({"code": code, "sglang_in_router": in_router,
                                 "trace_imported": sys.modules["sglang_router.mini_lb"].trace_package_imported,
                                 "found_outside": importlib.util.find_spec("sglang") is not None}))
""")


def test_router_launcher_skips_the_sglang_import_it_cannot_use(tmp_path):
    import importlib.util
    from pathlib import Path

    sglang_dir = Path(importlib.util.find_spec("sglang").origin).parent
    # mini_lb tries `from sglang.srt.tracing.trace import ...`: absent from the pinned SGLang, so that try fails
    # with or without the hook (if a new pin adds it, the hook would change the router: revisit it)
    assert (sglang_dir / "srt").is_dir() and not (sglang_dir / "srt" / "tracing").exists()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(SITE)
    r = subprocess.run([sys.executable, "-c", ROUTER_PROBE], capture_output=True, text=True, env=env,
                       cwd=str(tmp_path), timeout=300)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT"):])
    assert res == {"code": 0, "sglang_in_router": [], "trace_imported": False, "found_outside": True}, res


TABLES_PROBE = textwrap.dedent("""
    import importlib.util, itertools, json, sys
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as I
    from triton._C.libtriton import ir
    convert, np_dtype = I._convert_float, I._get_np_dtype       # Triton's own
    spec = importlib.util.spec_from_file_location("site_hook", sys.argv[1])
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)                                 # wraps the imported interpreter (parts 1 and 3)
    assert I._convert_float is not convert and I._get_np_dtype is not np_dtype
    rng = np.random.default_rng(int(sys.argv[2]))
    floats = [tl.float8e4nv, tl.float8e5, tl.float8e4b15, tl.bfloat16, tl.float16, tl.float32]
    modes = [None, ir.ROUNDING_MODE.RTNE, ir.ROUNDING_MODE.RTZ]
    checked, bad = 0, []
    for a, b in itertools.product(floats, floats):
        if a == b:
            continue
        bits = a.primitive_bitwidth
        for mode in modes:
            if bits == 32:    # not tabled: the same function, on random bits with the special exponents
                codes = rng.integers(0, 1 << 32, 4096, dtype=np.uint64).astype(np.uint32)
                codes[:8] = [0, 1, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0x00800000, 0x807FFFFF]
            else:             # every code, shuffled, in a 2-D block; and a 0-d one
                codes = rng.permutation(np.arange(1 << bits, dtype=f"uint{bits}"))
            for x in (codes.reshape(-1, 16), codes[:1].reshape(())):
                try:
                    want = convert(x, a, b, mode)
                except Exception as e:                            # a pair Triton cannot convert: same error
                    try:
                        I._convert_float(x, a, b, mode)
                        bad.append(f"{a}->{b} {mode}: no {type(e).__name__}")
                    except type(e):
                        pass
                    continue
                got = I._convert_float(x, a, b, mode)
                checked += x.size
                if not (isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
                        and np.array_equal(got, want)):
                    bad.append(f"{a}->{b} {mode} {x.shape}")
    types = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64] + floats
    types += [tl.pointer_type(t) for t in types[:3]] + [tl.block_type(t, [4, 8]) for t in types]
    types += [tl.block_type(tl.pointer_type(tl.float32), [16])]
    for t in types * 2:
        if I._get_np_dtype(t) != np_dtype(t):
            bad.append(f"np dtype of {t}")
    print("RESULT" + json.dumps({"checked": checked, "bad": bad}))
""")


def test_conversion_tables_give_tritons_bits_for_every_code():
    """Part 3: the tabled conversions return what Triton's own function returns (bits, dtype, shape) for every
    8- and 16-bit code of every float format pair and rounding mode, wider inputs are passed through, and the
    remembered dtype lookup agrees for scalar, pointer and block types."""
    seed = random.randrange(1 << 30)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    r = subprocess.run([sys.executable, "-c", TABLES_PROBE, str(SITE / "sitecustomize.py"), str(seed)],
                       capture_output=True, text=True, env=env, timeout=300)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT"):])
    assert res["bad"] == [] and res["checked"] > 3 * 2 * 65536, (res, seed)
