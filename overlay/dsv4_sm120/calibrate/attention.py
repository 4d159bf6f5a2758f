"""Sparse-MLA decode candidates: ours (default launch + launch variants), SGLang 0.5.23's sm_120 dispatcher
backends (FlashInfer, its Triton fallback, the torch path), FlashMLA (reference point where it runs).

Decisions ``attention.swa`` (SWA window only: ratio-0 layers and the MTP draft layer), ``attention.swa_c4``
(+ the c4 pool, indexer top-k), ``attention.swa_c128`` (+ the c128 pool, K = ceil64(2*ceil(ctx/256))), each
over row counts T (decode batches and verify rows B x draft tokens). Inputs are random V4-layout FP8 caches
(SWA pages of 256 tokens, c4 pages of 64, c128 pages of 2) with the deployment's per-rank heads; the gate
compares sampled rows against :mod:`dsv4_sm120.attention.reference` (float64).

Our kernel is called only through ``dsv4_sm120.attention.sparse_mla_decode``; a launch variant is the text
passed as the call's ``launch=`` (the ``DSV4_SM120_ATTN_CONFIG`` syntax; the choice string is ``dsv4:<text>``);
``dsv4+fp8qk`` is the block-scaled QK mode (sm_120 only). SGLang's triton / torch backends get the stock 64-head
padding (what stock serving runs); FlashInfer gets the real heads, through the same decode/prefill split as the
dispatcher.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import List, Optional

from .candidates import Candidate, Case, NotApplicable
from .deployment import C4_PAGE, C128_PAGE, SWA_PAGE, Deployment
from .. import settings, tolerances

LAYOUTS = ("swa", "swa_c4", "swa_c128")
# impl=reg: the register body, 16 heads per program (what sm_120's 32- / 64-head tables took before the
# warp-specialized body with 32 / 64 heads per program, impl=wspec,BLOCK_H=32 / 64); a variant with more heads per
# program than the deployment's head count rounded up to 16 / 32 / 64 does not apply there (masked MMA rows)
VARIANTS = ("impl=tiled", "spanning_splits=0", "late_decode=0", "BLOCK_N=64,num_warps=8,waves=1", "BLOCK_N=16",
            "e4m3_int_decode=0", "impl=wspec", "impl=reg", "impl=wspec,BLOCK_H=32", "impl=wspec,BLOCK_H=64")
QUICK_VARIANTS = ("impl=tiled", "e4m3_int_decode=0")
TORCH_MAX_ROWS = 16     # SGLang's torch path is an exact but slow oracle: time it only at small T
ENV_UPSTREAM_FILE = "DSV4_SM120_UPSTREAM_TRITON_FILE"


def _is_cuda(device) -> bool:
    return str(device).startswith("cuda")


def _capability():
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


class AttnCase(Case):
    def __init__(self, layout: str, T: int, dep: Deployment, device, seed: int = 0):
        import torch

        from dsv4_sm120.attention.cache import random_cache, random_cache_device

        from .candidates import sample_rows

        self.device, self.layout, self.T, self.H = device, layout, T, dep.heads
        g = torch.Generator(device=device).manual_seed(seed + 7919 * T + 31 * LAYOUTS.index(layout))

        def cache(pages, page):
            if _is_cuda(device):
                return random_cache_device(pages, page, device, generator=g)
            return random_cache(pages, page, generator=g, mode="bytes")

        def rand_slots(pool):   # a random permutation of each row's pool
            return torch.rand(T, pool, device=device, generator=g).argsort(1)

        K1 = dep.window
        main = cache(T * 2 + 1, SWA_PAGE)       # each row owns two pages; its window starts at a random offset
        start = torch.randint(0, SWA_PAGE, (T, 1), device=device, generator=g)
        slots = (torch.arange(T, device=device)[:, None] * 2 * SWA_PAGE + start + torch.arange(K1, device=device))
        kw = dict(k_cache=main.view, indices=slots.to(torch.int32).view(T, 1, K1),
                  topk_length=torch.full((T,), K1, dtype=torch.int32, device=device))
        if layout != "swa":
            page = C4_PAGE if layout == "swa_c4" else C128_PAGE
            K2 = dep.index_topk if layout == "swa_c4" else dep.c128_topk
            valid = K2 if layout == "swa_c4" else 2 * -(-dep.context_len // 256)
            pool = -(-2 * K2 // page) * page
            extra = cache(T * pool // page, page)
            e = rand_slots(pool)[:, :K2] + torch.arange(T, device=device)[:, None] * pool
            ar = torch.arange(K2, device=device)[None, :]
            e = torch.where(ar < valid, e, torch.full_like(e, -1))
            kw.update(extra_k_cache=extra.view, extra_indices_in_kvcache=e.to(torch.int32).view(T, 1, K2),
                      extra_topk_length=torch.full((T,), min(valid, K2), dtype=torch.int32, device=device))
        self.kw = kw
        self.q = torch.randn(T, 1, self.H, 512, device=device, generator=g).to(torch.bfloat16)
        self.sink = torch.randn(self.H, device=device, generator=g)
        self.scale = 512 ** -0.5
        self.rows = sample_rows(T)
        self._ref = None

    def padded(self, heads: int):
        import torch

        q = torch.zeros(self.T, 1, heads, 512, device=self.device, dtype=torch.bfloat16)
        q[:, :, :self.H] = self.q
        s = torch.zeros(heads, device=self.device)
        s[:self.H] = self.sink
        return q, s

    def args(self, q, sink):
        kw = self.kw
        return (q, kw["k_cache"], kw["indices"], kw["topk_length"], sink, 512, self.scale,
                kw.get("extra_k_cache"), kw.get("extra_indices_in_kvcache"), kw.get("extra_topk_length"))

    def error(self, out) -> float:
        from dsv4_sm120.attention.reference import rel_fro, sparse_mla_decode_ref

        if self._ref is None:
            r = self.rows
            sub = {k: (v[r] if k != "k_cache" and k != "extra_k_cache" else v) for k, v in self.kw.items()}
            self._ref = sparse_mla_decode_ref(self.q[r], attn_sink=self.sink, softmax_scale=self.scale, **sub)[0]
        o = out[self.rows][:, :, :self.H].double().cpu()
        import torch

        if not torch.isfinite(o).all():
            return float("inf")
        return rel_fro(o, self._ref)


class Ours(Candidate):
    tol = tolerances.ATTN_BF16

    def __init__(self, variant: str = "", qk: Optional[str] = None, device="cuda"):
        self.variant, self.qk, self.device = variant, qk, device
        self.name = "dsv4" + (f":{variant}" if variant else "") + ("+fp8qk" if qk == "fp8" else "")
        if qk == "fp8":
            self.tol = tolerances.ATTN_FP8QK

    def available(self):
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if not _is_cuda(self.device) and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            return "on CPU our Triton kernel needs TRITON_INTERPRET=1"
        if self.variant:
            from dsv4_sm120.attention.config import parse_config

            try:
                parse_config(self.variant, "variant")
            except ValueError as e:
                return str(e)
        return None

    def build(self, case: AttnCase):
        from dsv4_sm120.attention import sparse_mla_decode
        from dsv4_sm120.attention.config import head_class, parse_config

        variant = parse_config(self.variant, "variant") if self.variant else {}
        if int(variant.get("BLOCK_H", 0)) > head_class(case.H):
            raise NotApplicable(f"{variant['BLOCK_H']} heads per program for {case.H} heads: masked MMA rows")

        def fn():
            # the variant's launch keys for this call only
            return sparse_mla_decode(case.q, attn_sink=case.sink, head_dim_v=512, softmax_scale=case.scale,
                                     qk_mode=self.qk or "bf16", launch=self.variant or None, **case.kw)[0]
        return fn


def _load_file(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, str(path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class SGLangBackend(Candidate):
    """One of SGLang 0.5.23's sm_120 dispatcher backends (``SGLANG_SM120_FLASHMLA_BACKEND`` values)."""

    def __init__(self, which: str, device="cuda"):
        self.name, self.device = which, device
        self.tol = tolerances.ATTN_BF16
        self._mod = self._why = None

    def _sglang_module(self):
        try:
            from sglang.kernels.ops.attention import flash_mla_sm120 as m

            return m, None
        except Exception as e:  # noqa: BLE001
            return None, f"SGLang's flash_mla_sm120 does not import: {type(e).__name__}: {str(e)[:200]}"

    def available(self):
        if self.name == "flashinfer":
            if not _is_cuda(self.device):
                return "FlashInfer's sparse-MLA decode needs a CUDA GPU"
            cap = _capability()
            if not cap or cap[0] != 12:
                return f"FlashInfer's DSv4 sparse-MLA decode is SGLang's sm_120 path (this GPU is sm_{cap[0]}{cap[1]})"
        if self.name == "triton":
            try:
                from sglang.kernels.ops.attention import flash_mla_sm120_triton as mod
            except Exception as e:  # noqa: BLE001
                path = upstream_triton_file()
                if path is None:
                    return f"sglang: {type(e).__name__}, and no single-file copy found (set {ENV_UPSTREAM_FILE})"
                mod = _load_file("_dsv4_upstream_triton", path)
            if not _is_cuda(self.device):
                # the interpreter has no benchmarker: give the upstream kernel's autotuner a single config
                k = getattr(mod, "_tiled_sparse_decode_kernel", None)
                if k is not None and getattr(k, "configs", None):
                    k.configs = k.configs[:1]
            self._mod = mod.flash_mla_sparse_decode_triton
            return None
        m, why = self._sglang_module()
        if m is None:
            return why
        self._mod = m
        return None

    def build(self, case: AttnCase):
        if self.name == "triton":
            q, s = case.padded(max(64, case.H))
            return lambda: self._mod(*case.args(q, s))[0]
        m = self._mod
        if self.name == "torch":
            if case.T > TORCH_MAX_ROWS:
                raise NotApplicable(f"the torch path is timed up to {TORCH_MAX_ROWS} rows only (slow oracle)")
            q, s = case.padded(max(64, case.H))
            return lambda: m._sm120_sparse_decode_fwd(*case.args(q, s))[0]
        T, H = case.T, case.H
        if T <= m.SM120_DECODE_MAX_TOKENS and m.flashinfer_dsv4_decode_supports_num_heads(H, T):
            return lambda: m._flash_mla_flashinfer(*case.args(case.q, case.sink))[0]
        return lambda: m._flash_mla_sm120_prefill(*case.args(case.q, case.sink))[0]


class FlashMLA(Candidate):
    """FlashMLA's sparse FP8 decode (sm_90 / sm_100): a reference point; the sm_120 glue cannot route to it."""

    name, eligible, tol = "flashmla", False, tolerances.ATTN_BF16

    def __init__(self, device="cuda"):
        self.device = device

    def available(self):
        if not _is_cuda(self.device):
            return "FlashMLA needs a CUDA GPU"
        cap = _capability()
        if not cap or cap[0] not in (9, 10):
            return "FlashMLA runs on sm_90 / sm_100 only"
        if importlib.util.find_spec("flash_mla") is None:
            return "module flash_mla (sgl-flash-mla wheel) is not installed"
        return None

    def build(self, case: AttnCase):
        import flash_mla

        q, s = case.padded(max(64, case.H))
        meta = flash_mla.get_mla_metadata()[0]
        kw = case.kw

        def fn():
            return flash_mla.flash_mla_with_kvcache(
                q=q, k_cache=kw["k_cache"], block_table=None, cache_seqlens=None, head_dim_v=512,
                tile_scheduler_metadata=meta, softmax_scale=case.scale, is_fp8_kvcache=True, indices=kw["indices"],
                attn_sink=s, extra_k_cache=kw.get("extra_k_cache"),
                extra_indices_in_kvcache=kw.get("extra_indices_in_kvcache"), topk_length=kw["topk_length"],
                extra_topk_length=kw.get("extra_topk_length"), use_legacy=True)[0]
        return fn


def upstream_triton_file() -> Optional[Path]:
    env = settings.get(ENV_UPSTREAM_FILE)
    cands = [Path(env)] if env else []
    cache = Path(settings.get("DSV4_SM120_CACHE"))
    cands.append(cache / "pristine" / "sglang" / "kernels" / "ops" / "attention" / "flash_mla_sm120_triton.py")
    return next((c for c in cands if c.is_file()), None)


def candidates(device, quick: bool, cpu: bool = False, variants: Optional[List[str]] = None) -> List[Candidate]:
    vs = list(variants) if variants is not None else (["impl=tiled"] if cpu else list(QUICK_VARIANTS if quick else VARIANTS))
    out: List[Candidate] = [Ours("", device=device)] + [Ours(v, device=device) for v in vs]
    if _is_cuda(device) and (_capability() or (0,))[0] == 12:
        out.append(Ours("", qk="fp8", device=device))
    out += [SGLangBackend(b, device) for b in ("flashinfer", "triton", "torch")] + [FlashMLA(device)]
    return out


def make_case_factory(layout: str, dep: Deployment, device):
    return lambda T: AttnCase(layout, T, dep, device)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use python -m dsv4_sm120.calibrate")
