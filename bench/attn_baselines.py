"""The baselines bench/bench_attention.py times next to ours, found where they are installed: SGLang's sm_120
sparse decode paths (FlashInfer on sm_120, its Triton fallback, its torch reference; from the installed SGLang, the
pristine copy ``make setup`` keeps under ~/.cache/dsv4_sm120, or a file given on the command line) and FlashMLA
(sgl-flash-mla, sm_90 / sm_100). A baseline that is missing is None, with the reason in ``Baselines.notes``."""

from __future__ import annotations

import importlib.util
import os
import sys


def load_file_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def stub_sglang_for_file():
    """flash_mla_sm120.py imports sglang.srt.environ / sglang.srt.utils; give it minimal stand-ins."""
    import types

    if "sglang.srt.environ" in sys.modules:
        return
    sg = types.ModuleType("sglang")
    srt = types.ModuleType("sglang.srt")
    env = types.ModuleType("sglang.srt.environ")
    utl = types.ModuleType("sglang.srt.utils")

    class _E:
        def get(self):
            return "torch"

    class _Envs:
        def __getattr__(self, k):
            return _E()

    env.envs = _Envs()
    utl.is_hip = lambda: False
    sg.srt = srt
    for k, v in {"sglang": sg, "sglang.srt": srt, "sglang.srt.environ": env, "sglang.srt.utils": utl}.items():
        sys.modules.setdefault(k, v)


class Baselines:
    def __init__(self, args, torch):
        self.notes = {}
        self.upstream = None
        self.torch_fwd = None
        self.flashinfer = None
        self.flashmla = None
        try:
            from sglang.kernels.ops.attention import flash_mla_sm120 as m  # noqa

            self.torch_fwd = m._sm120_sparse_decode_fwd
            if torch.cuda.get_device_capability()[0] == 12:
                self.flashinfer = m._flash_mla_flashinfer
            from sglang.kernels.ops.attention.flash_mla_sm120_triton import flash_mla_sparse_decode_triton

            self.upstream = flash_mla_sparse_decode_triton
        except Exception as e:
            self.notes["sglang"] = f"not importable: {type(e).__name__}: {e}"
        pristine = os.path.expanduser("~/.cache/dsv4_sm120/pristine/sglang/kernels/ops/attention")
        if not args.upstream_file and os.path.exists(os.path.join(pristine, "flash_mla_sm120_triton.py")):
            args.upstream_file = os.path.join(pristine, "flash_mla_sm120_triton.py")
        if not args.sglang_sm120_file and os.path.exists(os.path.join(pristine, "flash_mla_sm120.py")):
            args.sglang_sm120_file = os.path.join(pristine, "flash_mla_sm120.py")
        if self.upstream is None and args.upstream_file:
            try:
                self.upstream = load_file_module("_up_triton", args.upstream_file).flash_mla_sparse_decode_triton
            except Exception as e:
                self.notes["upstream"] = f"{type(e).__name__}: {e}"
        if self.torch_fwd is None and args.sglang_sm120_file:
            try:
                stub_sglang_for_file()
                self.torch_fwd = load_file_module("_sg_sm120", args.sglang_sm120_file)._sm120_sparse_decode_fwd
            except Exception as e:
                self.notes["torch"] = f"{type(e).__name__}: {e}"
        if torch.cuda.get_device_capability()[0] in (9, 10):
            try:
                import flash_mla

                self.flashmla = flash_mla
            except Exception as e:
                self.notes["flashmla"] = f"{type(e).__name__}: {e}"
        else:
            self.notes["flashmla"] = "FlashMLA runs on sm_90/sm_100 only"
        if self.flashinfer is None and torch.cuda.get_device_capability()[0] == 12:
            self.notes.setdefault("flashinfer", "needs SGLang + FlashInfer on sm_120")
