"""Loading SGLang's own block-FP8 kernel module for the tuner: the tuner times SGLang's launcher
(``w8a8_block_fp8_matmul_triton``) and never carries a copy of the kernel.

Sources (``--kernel-source``):

* ``installed`` -- ``import sglang.kernels.ops.gemm.fp8_kernel`` (and SGLang's ``fp8_utils`` for the
  end-to-end linear and the default backend, when importable);
* ``installed-file`` -- the installed package's ``fp8_kernel.py`` alone, for environments where SGLang as a
  whole does not import (another torch);
* ``wheel`` -- ``fp8_kernel.py`` and SGLang's shipped configs extracted from the pinned wheel
  (``--sglang-wheel``; default: the last by name of the ``sglang-<pinned>-*.whl`` files under
  ``$DSV4_SM120_CACHE/wheels``);
* ``auto`` -- installed when importable, else the wheel.

Loading the file alone replaces the few SGLang names it imports with stand-ins that compute what SGLang
computes on a CUDA device; ``sys.modules`` is restored afterwards.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import sys
import types
import zipfile
from pathlib import Path
from typing import Optional

from dsv4_sm120 import SGLANG_VERSION, settings
from dsv4_sm120.fp8.errors import UsageError


KERNEL_MODULE = "sglang.kernels.ops.gemm.fp8_kernel"
KERNEL_PATH_IN_WHEEL = "sglang/kernels/ops/gemm/fp8_kernel.py"
CONFIGS_IN_WHEEL = "sglang/kernels/ops/gemm/configs/"


def default_wheel() -> Optional[Path]:
    """The pinned SGLang wheel in the project's cache (the last by name), or None."""
    cache = Path(settings.get("DSV4_SM120_CACHE"))  # the project's download cache
    hits = sorted(glob.glob(str(cache / "wheels" / f"sglang-{SGLANG_VERSION}-*.whl")))
    return Path(hits[-1]) if hits else None


def extract_from_wheel(wheel: Path, dest: Path) -> Path:
    """Extract fp8_kernel.py and SGLang's shipped GEMM configs from the wheel; returns the .py path."""
    if not wheel.is_file():
        raise UsageError(f"--sglang-wheel {wheel}: no such file")
    if f"sglang-{SGLANG_VERSION}-" not in wheel.name:
        raise UsageError(f"--sglang-wheel {wheel.name}: expected the pinned sglang {SGLANG_VERSION} wheel")
    try:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n == KERNEL_PATH_IN_WHEEL or
                     (n.startswith(CONFIGS_IN_WHEEL) and n.endswith(".json"))]
            if KERNEL_PATH_IN_WHEEL not in names:
                raise UsageError(f"{wheel.name} has no {KERNEL_PATH_IN_WHEEL}")
            for n in names:
                target = dest / n
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(n))
    except zipfile.BadZipFile:
        raise UsageError(f"--sglang-wheel {wheel}: not a wheel (zip) file") from None
    return dest / KERNEL_PATH_IN_WHEEL


def load_kernel_from_file(path: Path):
    """Import SGLang's fp8_kernel.py alone, with stand-ins for the few SGLang names it imports.

    The stand-ins compute what SGLang computes for a CUDA device (device name, sm_90 check, core count);
    DeepGEMM is reported absent.  sys.modules is restored afterwards, so nothing else sees them."""
    import torch

    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)

    class _Platform:
        is_sm90 = tuple(cap) == (9, 0)
        is_sm120 = cap[0] == 12
        is_blackwell = cap[0] in (10, 11, 12)

    def _register_custom_op(*a, **kw):
        if a and callable(a[0]) and not kw:
            return a[0]
        return lambda f: f

    stubs = {
        "sglang": types.ModuleType("sglang"),
        "sglang.srt": types.ModuleType("sglang.srt"),
        "sglang.srt.layers": types.ModuleType("sglang.srt.layers"),
        "sglang.srt.layers.deep_gemm_wrapper": types.ModuleType("sglang.srt.layers.deep_gemm_wrapper"),
        "sglang.srt.runtime_context": types.ModuleType("sglang.srt.runtime_context"),
        "sglang.srt.utils": types.ModuleType("sglang.srt.utils"),
        "sglang.srt.utils.custom_op": types.ModuleType("sglang.srt.utils.custom_op"),
    }
    for k in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.utils"):
        stubs[k].__path__ = []
    stubs["sglang.srt.layers"].deep_gemm_wrapper = stubs["sglang.srt.layers.deep_gemm_wrapper"]
    stubs["sglang.srt.layers.deep_gemm_wrapper"].ENABLE_JIT_DEEPGEMM = False
    stubs["sglang.srt.runtime_context"].get_platform = lambda: _Platform
    u = stubs["sglang.srt.utils"]
    u.get_device_core_count = lambda device_id=0: torch.cuda.get_device_properties(device_id).multi_processor_count
    u.get_device_name = lambda device_id=0: torch.cuda.get_device_name(device_id)
    u.is_cuda = lambda: torch.cuda.is_available() and torch.version.cuda is not None
    u.is_hip = lambda: torch.version.hip is not None
    u.is_gfx1250_supported = lambda: False
    u.log_info_on_rank0 = lambda logger, msg: logger.info(msg)
    stubs["sglang.srt.utils.custom_op"].register_custom_op = _register_custom_op
    saved = {k: sys.modules.get(k) for k in stubs}
    name = "_dsv4_sglang_fp8_kernel"
    try:
        sys.modules.update(stubs)
        spec = importlib.util.spec_from_file_location(name, str(path))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return mod


def load_kernel(source: str, wheel: Optional[Path], workdir: Path):
    """(kernel module, fp8_utils module or None, source description, kernel file path)."""
    if source in ("auto", "installed"):
        try:
            mod = importlib.import_module(KERNEL_MODULE)
            try:
                utils = importlib.import_module("sglang.srt.layers.quantization.fp8_utils")
            except Exception as e:  # the GEMM kernel still works without the linear wrappers
                utils = None
                print(f"note: sglang fp8_utils not importable ({type(e).__name__}: {e}); "
                      "default backend not timed", file=sys.stderr)
            import sglang

            return mod, utils, f"installed sglang {getattr(sglang, '__version__', '?')}", Path(mod.__file__)
        except Exception as e:
            if source == "installed":
                raise UsageError(f"cannot import {KERNEL_MODULE}: {type(e).__name__}: {e}") from None
    if source == "installed-file":
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.origin:
            raise UsageError("--kernel-source installed-file: sglang is not installed")
        path = Path(spec.origin).parent / "kernels" / "ops" / "gemm" / "fp8_kernel.py"
        if not path.is_file():
            raise UsageError(f"--kernel-source installed-file: {path} missing")
        return load_kernel_from_file(path), None, f"installed {path.name} only", path
    wheel = wheel or default_wheel()
    if wheel is None:
        raise UsageError("SGLang is not importable here and no --sglang-wheel was given "
                         f"(looked for sglang-{SGLANG_VERSION}-*.whl under $DSV4_SM120_CACHE/wheels)")
    path = extract_from_wheel(Path(wheel), workdir)
    return load_kernel_from_file(path), None, f"{Path(wheel).name} (fp8_kernel.py only)", path

