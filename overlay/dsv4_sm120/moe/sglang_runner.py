"""SGLang glue for the ``dsv4_triton_nvfp4`` MoE runner backend (patch 0005).

Patched ``ModelOptNvFp4FusedMoEMethod`` (``srt/layers/quantization/modelopt_quant.py``)
calls, when the layer's runner backend is :data:`dsv4_sm120.moe.BACKEND_NAME`:

* :func:`prepare_layer` from ``process_weights_after_loading`` instead of the
  FlashInfer / CUTLASS weight processing: the kernel reads the loader's NVFP4
  layout as is (gate rows then up rows, row-major E4M3 block scales, per-expert
  fp32 global scales), so nothing is swizzled, padded or copied;
* :func:`apply` from ``apply``: returns the ``[M, H]`` bf16 output of the routed
  experts (the patch wraps it in ``StandardCombineInput``).

Only routed experts of ModelOpt NVFP4 layers come here; shared experts keep their
own (FP8) path. The routed scaling factor is not applied, as with
``flashinfer_cutlass`` for NVFP4 (DeepSeek-V4 applies it outside the experts).
"""

from __future__ import annotations

import logging

from . import BACKEND_NAME

logger = logging.getLogger(__name__)

__all__ = ["BACKEND_NAME", "backend_available", "is_backend", "prepare_layer", "apply"]


def backend_available() -> bool:
    """True when SGLang knows the backend name (patch 0005 applied) and the
    kernel's dependencies import. Never raises."""
    try:
        from sglang.srt.arg_groups.choices import MOE_RUNNER_BACKEND_CHOICES
        from sglang.srt.layers.moe.utils import resolve_moe_runner_backend

        import triton  # noqa: F401

        resolve_moe_runner_backend(BACKEND_NAME)
    except Exception:  # noqa: BLE001
        return False
    return BACKEND_NAME in MOE_RUNNER_BACKEND_CHOICES


def is_backend(backend) -> bool:
    """Whether an SGLang ``MoeRunnerBackend``-like value (or string) is ours."""
    return getattr(backend, "value", backend) == BACKEND_NAME


def _global_scales_13(layer):
    s = layer.w13_weight_scale_2.data
    if s.dim() == 1:  # one shared gate/up scale per expert
        s = s[:, None].expand(-1, 2)
    return s.float().contiguous()


def prepare_layer(layer) -> None:
    """Check the layer's NVFP4 tensors once after loading; keep them as loaded."""
    cfg = getattr(layer, "moe_runner_config", None)
    act = getattr(cfg, "activation", "silu")
    if act != "silu" or not getattr(cfg, "is_gated", True):
        raise ValueError(f"{BACKEND_NAME}: only gated SiLU (SwiGLU) experts are supported, got {act!r}")
    if getattr(cfg, "apply_router_weight_on_input", False):
        raise ValueError(f"{BACKEND_NAME}: apply_router_weight_on_input is not supported")
    import torch

    E, two_i, h2 = layer.w13_weight.shape
    for name, want in (("w13_weight_scale", (E, two_i, h2 * 2 // 16)),
                       ("w2_weight", (E, h2 * 2, two_i // 4)),
                       ("w2_weight_scale", (E, h2 * 2, two_i // 32))):
        got = tuple(getattr(layer, name).shape)
        if got != want:
            raise ValueError(f"{BACKEND_NAME}: {name} has shape {got}, expected {want}")
    for name in ("w13_weight_scale", "w2_weight_scale"):
        if getattr(layer, name).dtype != torch.float8_e4m3fn:
            raise ValueError(f"{BACKEND_NAME}: {name} must be float8_e4m3fn")
    layer._dsv4_w13_scale_2 = _global_scales_13(layer)
    layer._dsv4_w2_scale_2 = layer.w2_weight_scale_2.data.float().reshape(-1).contiguous()
    dispatcher = getattr(layer, "dispatcher", None)
    if dispatcher is not None and hasattr(dispatcher, "set_quant_config"):
        dispatcher.set_quant_config({"input_global_scale": None})  # bf16 activations in
    logger.info("%s: MoE layer with %d local experts, H=%d, I=%d", BACKEND_NAME, E, h2 * 2, two_i // 2)


def apply(layer, dispatch_output):
    """Run the routed experts: ``[M, H]`` bf16."""
    from .fused_moe import nvfp4_fused_moe

    if not hasattr(dispatch_output, "topk_output") or getattr(dispatch_output, "hidden_states_scale", None) is not None:
        raise NotImplementedError(
            f"{BACKEND_NAME} runs on the standard (no all-to-all) MoE dispatcher with bf16 hidden states; got "
            f"{type(dispatch_output).__name__}. Use --moe-runner-backend flashinfer_cutlass with this a2a backend.")
    topk_output = dispatch_output.topk_output
    to_std = getattr(topk_output, "to_standard", None)
    if not hasattr(topk_output, "topk_ids") and to_std is not None:
        topk_output = to_std()
    x = dispatch_output.hidden_states
    cfg = layer.moe_runner_config
    if not hasattr(layer, "_dsv4_w13_scale_2"):
        prepare_layer(layer)
    return nvfp4_fused_moe(
        x,
        layer.w13_weight.data,
        layer.w13_weight_scale.data,
        layer._dsv4_w13_scale_2,
        layer.w2_weight.data,
        layer.w2_weight_scale.data,
        layer._dsv4_w2_scale_2,
        topk_output.topk_weights,
        topk_output.topk_ids,
        swiglu_limit=getattr(cfg, "swiglu_limit", None),
    )
