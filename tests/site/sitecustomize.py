"""Start-up hook of the test run's child processes: Python imports ``sitecustomize`` from the first
``sys.path`` entry that has one, and the tests put this folder on the PYTHONPATH of the children that run kernels
under ``TRITON_INTERPRET=1`` (conftest's ``run_patched`` probes, the ``calibrate --device cpu`` run) and of the
stand-in deployments (tests/test_serve_orchestration.py's ``env``: the supervisor, its parts, the real router);
tests/conftest.py installs the Triton parts in the pytest process itself. It changes three costs, nothing the
tests check.

1. Triton's interpreter patches the language modules a kernel sees (``tl``, ``tl.core``) once per launch and
restores them when the launch ends; each call of a jitted helper inside the kernel patches them again and drops
the result, which repeats the same assignments (it re-walks every module member). Helpers include Triton's own
(``tl.zeros`` is one), so this cost a third of the kernel time of the speculative-attention probe (the attention
split and combine kernels) and a quarter of the MoE GEMMs'. The wrapper skips the repeat when every language
module the helper sees is already patched, and otherwise does what Triton does; kernels compute what they did.
If this Triton lacks what it wraps, nothing is changed. ``triton.runtime.interpreter`` is wrapped when it is
imported (a meta-path finder waits for it, so importing this module imports no Triton: ``TRITON_INTERPRET`` may
still be set later), or at once if it already is.

2. The router (``python -m sglang_router.launch_router``) imports ``sglang_router.mini_lb``, the Python debugging
balancer, which tries ``from sglang.srt.tracing.trace import ...`` and goes on without tracing when that fails.
The pinned SGLang has no ``sglang.srt.tracing``, so the try always fails, but only after importing all of
``sglang`` (torch, transformers: ~8 s of CPU on a 2-core box, per router start, about 15 starts a run). In a
process whose ``__main__`` is that launcher, importing ``sglang`` raises ModuleNotFoundError here instead: mini_lb
ends in the same state without the import (tests/test_site_hooks.py checks both facts), and the Rust router the
deployment runs never uses SGLang. Any other use of SGLang in the router would fail loudly, not differently.

3. The interpreter converts between float formats bit by bit (``_convert_float``: a dozen NumPy passes over the
block, a loop over the mantissa bits where a subnormal occurs) on every ``.to()`` between bf16 / fp8 / fp32, and
rebuilds a 20-entry dtype table on every NumPy dtype lookup (``_get_np_dtype``): together about a tenth of the
attention kernels' interpreter time. A conversion from an 8- or 16-bit format maps each element on its own, so it
is looked up in a table of all 256 / 65,536 codes made by Triton's own function (once per format pair and
rounding mode): the same bits by construction (tests/test_site_hooks.py compares every code, in blocks); wider
inputs still go through Triton's function. The dtype lookup is remembered per scalar type.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import inspect
import sys

TARGET = "triton.runtime.interpreter"


def wrap_interpreter(interp) -> bool:
    """Wrap ``interp._patch_lang`` (once); True when the interpreter is (now) wrapped."""
    if getattr(interp, "_dsv4_lang_patch_once", False):
        return True
    orig = getattr(interp, "_patch_lang", None)
    scope_cls = getattr(interp, "_LangPatchScope", None)
    tl = sys.modules.get("triton.language")
    if orig is None or scope_cls is None or tl is None or not hasattr(tl.core, "is_builtin"):
        return False

    def patched_already(lang) -> bool:
        # every builtin (tl.arange among them) is replaced by a plain function while a launch is patched
        member = getattr(lang, "arange", None)
        return member is not None and not tl.core.is_builtin(member)

    def patch_lang(fn):
        langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core)]
        if langs and all(patched_already(v) for v in langs):
            return scope_cls()  # nothing to undo: the launch's own scope restores everything
        return orig(fn)

    interp._patch_lang = patch_lang
    interp._dsv4_lang_patch_once = True
    table_conversions(interp, tl)
    return True


def table_conversions(interp, tl) -> bool:
    """Part 3: ``interp._convert_float`` from 8- / 16-bit formats by table lookup, ``interp._get_np_dtype``
    remembered per scalar type (once; False when this Triton lacks either)."""
    if getattr(interp, "_dsv4_tables", False):
        return True
    convert, np_dtype, np = (getattr(interp, n, None) for n in ("_convert_float", "_get_np_dtype", "np"))
    if convert is None or np_dtype is None or np is None:
        return False
    tables = {}

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        bits = input_dtype.primitive_bitwidth
        if bits not in (8, 16):
            return convert(input, input_dtype, output_dtype, rounding_mode)
        key = (str(input_dtype), str(output_dtype), rounding_mode)
        table = tables.get(key)
        if table is None:
            table = tables[key] = convert(np.arange(1 << bits, dtype=f"uint{bits}"), input_dtype, output_dtype,
                                          rounding_mode)
        codes = np.asarray(input).view(f"uint{bits}")
        return table[codes.reshape(-1)].reshape(codes.shape)

    known = {}

    def get_np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return np_dtype(scalar)
        try:
            return known[scalar]
        except KeyError:
            known[scalar] = found = np_dtype(scalar)
            return found

    interp._convert_float = convert_float
    interp._get_np_dtype = get_np_dtype
    interp._dsv4_tables = True
    return True


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds ``triton.runtime.interpreter`` through the other finders and wraps it once it has run."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            wrap_interpreter(module)

        spec.loader.exec_module = exec_module
        return spec


ROUTER_MAIN = "sglang_router.launch_router"


class _RouterWithoutSGLang(importlib.abc.MetaPathFinder):
    """Refuses ``import sglang`` while ``__main__`` is the router launcher (part 2 above); passes otherwise."""

    def find_spec(self, name, path, target=None):
        if name == "sglang" and getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None) \
                == ROUTER_MAIN:
            raise ModuleNotFoundError(f"the tests' router process does not import {name} "
                                      "(tests/site/sitecustomize.py)", name=name)
        return None


def _installed(cls) -> bool:
    return any(isinstance(f, cls) or type(f).__name__ == cls.__name__ for f in sys.meta_path)


def install() -> None:
    """Wrap the interpreter now if it is imported, else when it is; refuse SGLang in the router (idempotent)."""
    if TARGET in sys.modules:
        wrap_interpreter(sys.modules[TARGET])
    elif not _installed(_WrapOnImport):
        sys.meta_path.insert(0, _WrapOnImport())
    if not _installed(_RouterWithoutSGLang):
        sys.meta_path.insert(0, _RouterWithoutSGLang())


install()
