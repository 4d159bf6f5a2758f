"""Patch 0002: the DeepSeek-V4 attention backend's sm_120 sparse-attention call, the model's head count, and
the self-check before CUDA-graph capture.

The patched backend hands its sm_120 sparse-attention call (V4 cache layout, 584 bytes per token) to
:func:`sparse_attention`; the patched model's ``_kernel_num_heads`` asks :func:`kernel_num_heads`; the
backend's ``init_cuda_graph_state`` (before any capture) calls :func:`before_graph_capture`.

Who runs a call is decided from its rows T and layout (SWA only / + c4 / + c128) by :mod:`.decisions`:
``DSV4_SM120_ATTN_BACKEND`` set by the user, else the machine profile's winner for that bucket, else
``dsv4``; static per captured graph. The backends:

* ``dsv4``: the overlay's tensor-core Triton kernel (:func:`dsv4_sm120.attention.sparse_mla_decode`) with the
  real per-rank heads, for decode-like rows (decode, target-verify, draft-extend; any T); prefill rows
  (extend / mixed) keep FlashInfer unless ``DSV4_SM120_ATTN_PREFILL=dsv4``;
* ``flashinfer`` / ``triton`` / ``torch``: SGLang 0.5.23's own sm_120 paths, called as stock SGLang calls
  them (``triton`` / ``torch`` with the stock 64-head padding);
* ``stock``: SGLang's own dispatcher ``flash_mla_with_kvcache_sm120``, unchanged; where a ``dsv4`` decision
  goes when the startup self-check (:mod:`.selfcheck`) disabled our kernel in this process.

The first call outside graph capture on a CUDA device runs the self-check too when
:func:`before_graph_capture` did not (``--disable-cuda-graph``).
"""

from __future__ import annotations

from dsv4_sm120 import settings

from . import decisions, selfcheck


def backend() -> str:
    """``DSV4_SM120_ATTN_BACKEND``'s value (its default when unset; the profile may still decide: decisions)."""
    return settings.get("DSV4_SM120_ATTN_BACKEND")


def prefill_backend() -> str:
    return settings.get("DSV4_SM120_ATTN_PREFILL")


_PADDED = ("triton", "torch")


def kernel_num_heads(n_local_heads: int, n_heads: int, num_tokens: int):
    """Heads the attention kernel gets on sm_120, or None to keep SGLang's own choice.

    From the decisions of the three layouts at ``num_tokens`` rows (the model asks once per layer call, before
    it knows the layout): all ``dsv4`` -> the real per-rank heads (our kernel and FlashInfer's prefill kernel
    take any H); any ``triton`` / ``torch`` -> the stock padded shape (64, or all heads above 64; our kernel
    and FlashInfer read only the real heads of it); else SGLang decides."""
    decisions.log_decisions()
    routes = {decisions.attention_route(num_tokens, lay).backend for lay in decisions.LAYOUTS}
    if routes == {"dsv4"}:
        return n_local_heads
    if routes & set(_PADDED):
        return 64 if n_local_heads <= 64 else n_heads
    return None


def is_decode_like(forward_mode) -> bool:
    """Rows with one query each that CUDA graphs capture: decode, target-verify, draft-extend."""
    for attr in ("is_decode", "is_target_verify", "is_draft_extend_v2", "is_idle"):
        f = getattr(forward_mode, attr, None)
        if f is not None and f():
            return True
    return False


def _stock():
    from sglang.kernels.ops.attention import flash_mla_sm120 as m

    return m


def _args(q, kw):
    return (q, kw["k_cache"], kw["indices"], kw.get("topk_length"), kw.get("attn_sink"), kw["head_dim_v"],
            kw["softmax_scale"], kw.get("extra_k_cache"), kw.get("extra_indices_in_kvcache"),
            kw.get("extra_topk_length"))


def _pad_heads(q, kw, heads: int):
    """``q`` (and the sink) zero-padded to ``heads`` heads, for a stock path that needs more heads than given."""
    import torch

    qp = torch.zeros(*q.shape[:-2], heads, q.shape[-1], dtype=q.dtype, device=q.device)
    qp[..., : q.shape[-2], :] = q
    kw = dict(kw)
    if kw.get("attn_sink") is not None:
        s = torch.zeros(heads, dtype=kw["attn_sink"].dtype, device=q.device)
        s[: q.shape[-2]] = kw["attn_sink"].reshape(-1)[: q.shape[-2]]
        kw["attn_sink"] = s
    return qp, kw


def _flashinfer(m, q, kw):
    T, H = q.shape[0], q.shape[-2]
    if T <= m.SM120_DECODE_MAX_TOKENS:
        if not m.flashinfer_dsv4_decode_supports_num_heads(H, T) and H < 64:
            q, kw = _pad_heads(q, kw, 64)   # FlashInfer's decode kernel takes the stock 64-head shape
        return m._flash_mla_flashinfer(*_args(q, kw))[0]
    return m._flash_mla_sm120_prefill(*_args(q, kw))[0]


def ours(q, num_heads: int, kw: dict, launch=None, qk=None):
    """Our kernel on the real heads of ``q`` -> ``[T, 1, num_heads, 512]`` (what serving and the self-check
    call). ``DSV4_SM120_TEST_SELFCHECK_FAULT=attention`` makes it wrong on purpose (tests of the self-check)."""
    from dsv4_sm120.attention import sparse_mla_decode

    kw = dict(kw)
    sink = kw.pop("attn_sink", None)
    if sink is not None:
        sink = sink[:num_heads]
    out = sparse_mla_decode(q[..., :num_heads, :], attn_sink=sink, launch=launch, qk_mode=qk, **kw)[0]
    if settings.get("DSV4_SM120_TEST_SELFCHECK_FAULT") == "attention":
        out = out * 2
    return out


def stock_dispatch(q, kw):
    """SGLang's own sm_120 dispatcher, as unpatched SGLang calls it (``SGLANG_SM120_FLASHMLA_BACKEND`` picks)."""
    m = _stock()
    if (getattr(m, "_sm120_default_backend", "flashinfer") == "flashinfer" and q.shape[0] <= m.SM120_DECODE_MAX_TOKENS
            and not m.flashinfer_dsv4_decode_supports_num_heads(q.shape[-2], q.shape[0]) and q.shape[-2] < 64):
        q, kw = _pad_heads(q, kw, 64)
    return m.flash_mla_with_kvcache_sm120(q=q, **kw)[0]


def _maybe_self_check(q, num_heads: int) -> None:
    if q.device.type != "cuda" or selfcheck.done():
        return
    import torch

    if torch.cuda.is_current_stream_capturing():
        selfcheck.skipped("the first attention call is inside CUDA-graph capture")
        return
    selfcheck.run(heads=[num_heads], device=q.device)


def before_graph_capture(model_runner=None) -> None:
    """Called by the patched backend before CUDA-graph capture: log the decisions and run the self-check with
    the model's per-rank head counts on the runner's device."""
    decisions.log_decisions()
    selfcheck.run_for_runner(model_runner)


def sparse_attention(forward_mode, *, q, num_heads: int, **kw):
    """Drop-in for ``flash_mla_with_kvcache_sm120(**kw)[0]`` in the DSv4 backend's sm_120 branch.

    ``q`` may carry padded heads (``q.shape[-2] > num_heads``); the output has ``q``'s head count
    for the stock paths and ``num_heads`` for ours (the model reads only the real heads)."""
    if kw.get("softmax_scale") is None:
        kw["softmax_scale"] = q.shape[-1] ** (-0.5)
    _maybe_self_check(q, num_heads)
    decisions.log_decisions()
    r = decisions.attention_route(q.shape[0], decisions.layout_of(kw.get("extra_k_cache")))
    b = r.backend
    if b == "dsv4" and (is_decode_like(forward_mode) or prefill_backend() == "dsv4"):
        return ours(q, num_heads, kw, r.launch, r.qk)
    if b == decisions.STOCK:
        return stock_dispatch(q, kw)
    m = _stock()
    if b == "triton":
        from sglang.kernels.ops.attention.flash_mla_sm120_triton import flash_mla_sparse_decode_triton

        return flash_mla_sparse_decode_triton(*_args(q, kw))[0]
    if b == "torch":
        return m._sm120_sparse_decode_fwd(*_args(q, kw))[0]
    # FlashInfer (prefill rows under dsv4, or the flashinfer backend): real heads if it can
    if q.shape[-2] > num_heads and (q.shape[0] > m.SM120_DECODE_MAX_TOKENS
                                    or m.flashinfer_dsv4_decode_supports_num_heads(num_heads, q.shape[0])):
        q = q[..., :num_heads, :].contiguous()
        if kw.get("attn_sink") is not None:
            kw["attn_sink"] = kw["attn_sink"][:num_heads]
    return _flashinfer(m, q, kw)
