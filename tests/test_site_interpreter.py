"""tests/site/sitecustomize.py (on the PYTHONPATH of the children that run Triton's interpreter): importing it
imports no Triton; once the interpreter is imported, a launch patches the language modules once instead of
once per nested ``@triton.jit`` call, and the kernel's output is bit-identical to the unwrapped interpreter's
and to a torch reference."""

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
    def axpy3(X, Y, O, a, N: tl.constexpr):
        i = tl.program_id(0) * N + tl.arange(0, N)
        x = tl.load(X + i)
        y = tl.load(Y + i)
        y = _axpy(x, y, a)
        y = _axpy(x, y, a)
        y = _axpy(x, y, a)
        tl.store(O + i, y)
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
    out = torch.empty_like(x)
    kern.axpy3[(8,)](x, y, out, 0.75, N=16)
    ref = y.clone()
    for _ in range(3):
        ref = 0.75 * x + ref
    print("RESULT" + json.dumps({"triton_at_start": triton_at_start, "runs": runs[0],
                                 "wrapped": bool(getattr(I, "_dsv4_lang_patch_once", False)),
                                 "out": out.tolist(), "ref_err": float((out - ref).abs().max())}))
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
    assert fast["out"] == plain["out"], seed                           # bit for bit
    assert fast["ref_err"] < 1e-5 and plain["ref_err"] < 1e-5, (fast["ref_err"], plain["ref_err"])
    # the launch patches once per language module; the plain interpreter again for each of 8 x 3 helper calls
    assert 0 < fast["runs"] and fast["runs"] * 8 < plain["runs"], (fast["runs"], plain["runs"])
