"""Start-up hook of the test run's Triton-interpreter processes: Python imports ``sitecustomize`` from the
first ``sys.path`` entry that has one, and the tests put this folder on the PYTHONPATH of the children that
run kernels under ``TRITON_INTERPRET=1`` (conftest's ``run_patched`` probes, the ``calibrate --device cpu``
run); tests/conftest.py installs the same in the pytest process itself. Nothing else of the product's or the
tests' behaviour changes: it only makes Triton's interpreter cheaper, and its kernels compute what they did.

What it changes: Triton's interpreter patches the language modules a kernel sees (``tl``, ``tl.core``) once
per launch and restores them when the launch ends; each call of a jitted helper inside the kernel patches
them again and drops the result, which repeats the same assignments (it re-walks every module member). Helpers
include Triton's own (``tl.zeros`` is one), so this cost a third of the kernel time of the speculative-attention
probe (the attention split and combine kernels) and a quarter of the MoE GEMMs'. The wrapper skips the repeat
when every language module the helper sees is already patched, and otherwise does what Triton does. If this
Triton lacks what it wraps, nothing is changed.

``triton.runtime.interpreter`` is wrapped when it is imported (a meta-path finder waits for it, so importing
this module imports no Triton: ``TRITON_INTERPRET`` may still be set later), or at once if it already is.
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


def install() -> None:
    """Wrap the interpreter now if it is imported, else when it is (idempotent)."""
    if TARGET in sys.modules:
        wrap_interpreter(sys.modules[TARGET])
    elif not any(isinstance(f, _WrapOnImport) or type(f).__name__ == "_WrapOnImport" for f in sys.meta_path):
        sys.meta_path.insert(0, _WrapOnImport())


install()
