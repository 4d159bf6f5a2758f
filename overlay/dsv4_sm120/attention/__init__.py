"""Sparse MLA decode for DeepSeek-V4 on sm_120 (and any CUDA GPU Triton supports).

Public entry point::

    out, lse = dsv4_sm120.attention.sparse_mla_decode(
        q, k_cache, indices, topk_length=None, attn_sink=None, head_dim_v=512,
        softmax_scale=None, extra_k_cache=None, extra_indices_in_kvcache=None,
        extra_topk_length=None, *, qk_mode=None, launch=None)

Same argument meaning as SGLang's ``flash_mla_with_kvcache_sm120``: ``q [T,1,H,512]`` bf16 (any H,
may be a head-slice view), caches in the DeepSeek-V4 page layout (``[N, P, 1, 584]`` views, any
page size), ``indices [T,1,K]`` int32 with -1 = invalid, optional per-row lengths, optional
per-head sink (natural-log logit). Returns ``out [T,1,H,512]`` bf16 (zeros for rows with no valid
candidate) and ``lse [T,H,1]`` fp32 (natural log, sink excluded, -inf for such rows).

``qk_mode``: ``"auto"`` (= bf16) | ``"bf16"`` | ``"fp8"`` (block-scaled QK, native on sm_120) | ``None`` (env
``DSV4_SM120_ATTN_QK``, else bf16). ``launch``: launch keys for this call only (text in the
``DSV4_SM120_ATTN_CONFIG`` syntax, e.g. ``"impl=tiled"``, or a mapping), applied over that setting's (the SGLang glue
passes a machine profile's launch variant this way, benchmarks and calibration their variants). The whole rule, and
what each call resolves to: ``launch_plan.plan_call`` (docs/attention.md, "Launch configuration").

Modules: ``launch`` (host side: checks, launches, workspace), ``launch_plan`` (a call's QK mode, launch keys
with their sources, table entry and row chunks), ``config`` (launch tables, ``resolve``), ``plan`` (split /
combine plans), ``kernels`` (Triton / Gluon), ``reference`` (float64 reference), ``cache`` (paged caches for tests
and benchmarks). The SGLang glue is ``dsv4_sm120.sglang_glue.attention``.
"""

from __future__ import annotations

__all__ = ["sparse_mla_decode", "DecodeInputError", "plan_splits", "plan_span"]


def __getattr__(name):  # lazy: importing the package does not import torch/triton
    if name == "DecodeInputError":
        from .config import DecodeInputError

        return DecodeInputError
    if name in ("plan_splits", "plan_span"):
        from . import plan

        return getattr(plan, name)
    if name == "sparse_mla_decode":
        from .launch import sparse_mla_decode

        return sparse_mla_decode
    raise AttributeError(name)
