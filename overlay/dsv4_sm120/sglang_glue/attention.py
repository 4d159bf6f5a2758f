"""Patch 0002: the DeepSeek-V4 attention backend's sm_120 sparse-attention call and the model's head count.

The patched backend hands its sm_120 sparse-attention call (V4 cache layout, 584 bytes per token) to
:func:`sparse_attention`; the patched model's ``_kernel_num_heads`` asks :func:`kernel_num_heads`.
Settings (``dsv4_sm120.settings``, read on every call, cheap):

* ``DSV4_SM120_ATTN_BACKEND`` = ``dsv4`` (default) | ``flashinfer`` | ``triton`` | ``torch``:
  who runs the decode-like rows (decode, target-verify, draft-extend; any number of rows T).
  ``dsv4`` is the overlay's tensor-core Triton kernel (:func:`dsv4_sm120.attention.sparse_mla_decode`) with
  the real per-rank heads; ``flashinfer`` / ``triton`` / ``torch`` are SGLang 0.5.23's own sm_120 paths,
  called as stock SGLang calls them (``triton`` / ``torch`` with the stock 64-head padding), for A/B runs.
* ``DSV4_SM120_ATTN_PREFILL`` = ``flashinfer`` (default) | ``dsv4``: who runs prefill
  (extend / mixed) rows when the backend is ``dsv4``. ``flashinfer`` keeps FlashInfer's kernels
  (its prefill kernel, or its decode kernel for <= 64 rows when it supports the head count).
"""

from __future__ import annotations

from dsv4_sm120 import settings


def backend() -> str:
    return settings.get("DSV4_SM120_ATTN_BACKEND")


def prefill_backend() -> str:
    return settings.get("DSV4_SM120_ATTN_PREFILL")


def kernel_num_heads(n_local_heads: int, n_heads: int, num_tokens: int):
    """Heads the attention kernel gets on sm_120, or None to keep SGLang's own choice.

    ``dsv4``: the real per-rank heads, for every row count (our kernel takes any H; FlashInfer's
    prefill kernel, which keeps the prefill rows, takes any H too). ``triton`` / ``torch``: the
    stock padded shape (64, or all heads above 64). ``flashinfer``: SGLang decides."""
    b = backend()
    if b == "dsv4":
        return n_local_heads
    if b in ("triton", "torch"):
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


def _flashinfer(m, q, kw):
    args = (q, kw["k_cache"], kw["indices"], kw.get("topk_length"), kw.get("attn_sink"), kw["head_dim_v"],
            kw["softmax_scale"], kw.get("extra_k_cache"), kw.get("extra_indices_in_kvcache"),
            kw.get("extra_topk_length"))
    T, H = q.shape[0], q.shape[-2]
    if T <= m.SM120_DECODE_MAX_TOKENS and m.flashinfer_dsv4_decode_supports_num_heads(H, T):
        return m._flash_mla_flashinfer(*args)[0]
    return m._flash_mla_sm120_prefill(*args)[0]


def sparse_attention(forward_mode, *, q, num_heads: int, **kw):
    """Drop-in for ``flash_mla_with_kvcache_sm120(**kw)[0]`` in the DSv4 backend's sm_120 branch.

    ``q`` may carry padded heads (``q.shape[-2] > num_heads``); the output has ``q``'s head count
    for the stock paths and ``num_heads`` for ours (the model reads only the real heads)."""
    if kw.get("softmax_scale") is None:
        kw["softmax_scale"] = q.shape[-1] ** (-0.5)
    b = backend()
    decode_like = is_decode_like(forward_mode)
    if b == "dsv4" and (decode_like or prefill_backend() == "dsv4"):
        from dsv4_sm120.attention import sparse_mla_decode

        sink = kw.pop("attn_sink", None)
        if sink is not None:
            sink = sink[:num_heads]
        return sparse_mla_decode(q[..., :num_heads, :], attn_sink=sink, **kw)[0]
    m = _stock()
    if b == "triton":
        from sglang.kernels.ops.attention.flash_mla_sm120_triton import flash_mla_sparse_decode_triton

        return flash_mla_sparse_decode_triton(
            q, kw["k_cache"], kw["indices"], kw.get("topk_length"), kw.get("attn_sink"), kw["head_dim_v"],
            kw["softmax_scale"], kw.get("extra_k_cache"), kw.get("extra_indices_in_kvcache"),
            kw.get("extra_topk_length"))[0]
    if b == "torch":
        return m._sm120_sparse_decode_fwd(
            q, kw["k_cache"], kw["indices"], kw.get("topk_length"), kw.get("attn_sink"), kw["head_dim_v"],
            kw["softmax_scale"], kw.get("extra_k_cache"), kw.get("extra_indices_in_kvcache"),
            kw.get("extra_topk_length"))[0]
    # FlashInfer (prefill rows under dsv4, or the flashinfer backend): real heads if it can
    if q.shape[-2] > num_heads and (q.shape[0] > m.SM120_DECODE_MAX_TOKENS
                                    or m.flashinfer_dsv4_decode_supports_num_heads(num_heads, q.shape[0])):
        q = q[..., :num_heads, :].contiguous()
        if kw.get("attn_sink") is not None:
            kw["attn_sink"] = kw["attn_sink"][:num_heads]
    return _flashinfer(m, q, kw)
