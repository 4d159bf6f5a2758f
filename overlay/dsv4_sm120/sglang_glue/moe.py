"""Patches 0003 and 0005: the MoE runner of DeepSeek-V4 hybrid FP8 + NVFP4 checkpoints on sm_120, and the
``dsv4_triton_nvfp4`` runner backend.

Patch 0003 calls two functions, through ``sglang.srt.dsv4_sm120_hook.import_glue("moe")``:

* :func:`hybrid_nvfp4_moe_runner_backend` from the DeepSeek-V4 server-argument override, when the user left
  ``--moe-runner-backend`` at ``auto`` and the checkpoint is the hybrid format (``quantization_config`` with
  ``moe_quant_algo: NVFP4``; e.g. the output of ``python -m dsv4_sm120.convert_nvfp4``). Stock 0.5.23 forces
  ``flashinfer_trtllm_routed`` there, which only runs on sm_100; on sm_120 the answer is
  :func:`dsv4_sm120.moe_runner.nvfp4_runner`'s (``DSV4_SM120_MOE_BACKEND``, then the machine profile's
  ``moe.nvfp4`` runner, then ``flashinfer_cutlass``; that module states the order for both expert formats).
  The choice is logged once, with its source.
* :func:`draft_mxfp4_expert_method` from ``HybridFp8NvFp4Config.get_quant_method``
  for the MTP draft experts, which that format keeps in MXFP4. Stock 0.5.23 sends
  them to ``Mxfp4FlashinferTrtllmMoEMethod`` (TRT-LLM, sm_100 only); on sm_120
  this picks ``Mxfp4FlashinferCutlassMoEMethod``, the class stock SGLang itself
  uses for MXFP4 experts there (MXFP8 activations x MXFP4 weights).

Both take plain values (no SGLang import), so they are testable on their own; on doubt they return the stock
choice.

Patch 0005 registers :data:`BACKEND_NAME` with SGLang (choices and runner backend names) and, in
``ModelOptNvFp4FusedMoEMethod`` when the layer's runner backend is ours, calls:

* :func:`prepare_layer` from ``process_weights_after_loading`` instead of the
  FlashInfer / CUTLASS weight processing: the kernel reads the loader's NVFP4
  layout as is (gate rows then up rows, row-major E4M3 block scales, per-expert
  fp32 global scales), so nothing is swizzled, padded or copied;
* :func:`apply` from ``apply``: returns the ``[M, H]`` bf16 output of the routed
  experts (:func:`dsv4_sm120.moe.nvfp4_fused_moe`; the patch wraps it in ``StandardCombineInput``). A call
  that raises switches the process to the kernel's other compute path (``fp4`` <-> ``bf16``, the weights
  stay as loaded), which answers it; when that path raises too the server stops with one line naming
  ``DSV4_SM120_MOE_BACKEND=flashinfer_cutlass`` (:func:`.selfcheck.moe_step_aside`; a
  :class:`~dsv4_sm120.rank_agreement.StopServer`, the only exception that leaves a forward of ours).

Only routed experts of ModelOpt NVFP4 layers come here; shared experts keep their
own (FP8) path. The routed scaling factor is not applied, as with
``flashinfer_cutlass`` for NVFP4 (DeepSeek-V4 applies it outside the experts).
"""

from __future__ import annotations

import logging

from dsv4_sm120 import settings
from dsv4_sm120.moe import BACKEND_NAME
from dsv4_sm120.moe_runner import (ENV_BACKEND, SM120_NVFP4_BACKEND, STOCK_HYBRID_BACKEND,  # noqa: F401
                                   TRITON_NVFP4_BACKEND, nvfp4_runner)

logger = logging.getLogger(__name__)

#: Draft-expert (MXFP4) method names returned by draft_mxfp4_expert_method.
DRAFT_CUTLASS = "flashinfer_cutlass_mxfp4"  # Mxfp4FlashinferCutlassMoEMethod
DRAFT_TRTLLM = "flashinfer_trtllm_mxfp4"  # Mxfp4FlashinferTrtllmMoEMethod (stock)


# ---- patch 0003: runner choice


def hybrid_nvfp4_moe_runner_backend(
    *,
    is_sm120: bool,
    is_hip: bool = False,
    stock: str = STOCK_HYBRID_BACKEND,
    hf_config=None,
    nvfp4_meta=None,
    moe_a2a_backend=None,
) -> str:
    """MoE runner backend for a hybrid FP8+NVFP4 DeepSeek-V4 checkpoint.

    Called only when ``--moe-runner-backend`` is ``auto``. ``stock`` is what
    SGLang would pick; it is returned unchanged off sm_120 (and on ROCm).
    On sm_120: :func:`dsv4_sm120.moe_runner.nvfp4_runner` with
    ``DSV4_SM120_MOE_BACKEND`` and :func:`backend_available`. When the machine
    profile (not the setting) picks ``dsv4_triton_nvfp4`` and the checkpoint
    (``hf_config``, ``nvfp4_meta``: SGLang's ``nvfp4_moe_meta``; ``moe_a2a_backend``)
    has something :func:`prepare_layer` or :func:`apply` would refuse
    (:func:`model_problem`), the stock CUTLASS
    runner serves instead, with one warning: this is the last point where the
    server-wide runner can still change (below).
    """
    if not is_sm120 or is_hip:
        return stock
    runner, source, warning = nvfp4_runner(settings.get(ENV_BACKEND), backend_available, stock)
    if warning:
        logger.warning("%s", warning)
    problem = model_problem(hf_config, nvfp4_meta, moe_a2a_backend) if runner == TRITON_NVFP4_BACKEND else None
    if problem and not source.startswith("env"):
        logger.warning("dsv4_sm120 decision moe.nvfp4: %s picks %s, but %s; %s serves instead", source,
                       TRITON_NVFP4_BACKEND, problem, SM120_NVFP4_BACKEND)
        runner, source = SM120_NVFP4_BACKEND, f"{source}; stepped aside: {problem}"
    elif problem:
        logger.warning("dsv4_sm120: %s=%s, but %s: the server will stop at the first MoE layer; unset it to serve "
                       "with %s", ENV_BACKEND, TRITON_NVFP4_BACKEND, problem, SM120_NVFP4_BACKEND)
    _log_decision(runner, source)
    return runner


def model_problem(hf_config=None, nvfp4_meta=None, moe_a2a_backend=None):
    """What of the checkpoint's config our runner cannot serve (one phrase), or None: the NVFP4 block size (our
    kernel reads 16-element blocks with E4M3 scales, :func:`prepare_layer`), the experts' activation (gated
    SiLU) and the MoE all-to-all backend (ours runs on the standard dispatcher, :func:`apply`). Never raises: a
    value it cannot read is no problem here (:func:`prepare_layer` checks the tensors)."""
    try:
        if moe_a2a_backend not in (None, "none"):
            return f"the MoE all-to-all backend is {moe_a2a_backend} (ours runs on the standard dispatcher)"
        group = (nvfp4_meta or {}).get("group_size")
        if group is not None and int(group) != 16:
            return f"the checkpoint's NVFP4 group size is {group} (ours reads 16-element blocks)"
        act = getattr(hf_config, "hidden_act", None)
        if act is not None and str(act).lower() not in ("silu", "swiglu"):
            return f"the experts' activation is {act!r} (ours runs gated SiLU)"
    except Exception:  # noqa: BLE001
        return None
    return None


_logged: set = set()


def _log_decision(choice: str, source: str) -> None:
    if (choice, source) not in _logged:
        _logged.add((choice, source))
        logger.info("dsv4_sm120 decision moe.nvfp4: %s (%s)", choice, source)


def draft_mxfp4_expert_method(*, is_sm120: bool, is_hip: bool = False) -> str:
    """Which MXFP4 MoE method the MTP draft experts of a hybrid checkpoint get.

    ``flashinfer_cutlass_mxfp4`` (``Mxfp4FlashinferCutlassMoEMethod``) on sm_120,
    where stock SGLang runs MXFP4 experts with that class; elsewhere the stock
    ``flashinfer_trtllm_mxfp4`` (``Mxfp4FlashinferTrtllmMoEMethod``, sm_100).
    """
    if is_hip or not is_sm120:
        return DRAFT_TRTLLM
    return DRAFT_CUTLASS


def describe(is_sm120: bool) -> dict:
    """Both choices for a platform, for logs and reports."""
    return {
        "hybrid_nvfp4_moe_runner_backend": hybrid_nvfp4_moe_runner_backend(is_sm120=is_sm120),
        "draft_mxfp4_expert_method": draft_mxfp4_expert_method(is_sm120=is_sm120),
        "triton_nvfp4_backend_available": backend_available(),
        "env": settings.raw(ENV_BACKEND),
    }


# ---- patch 0005: the dsv4_triton_nvfp4 runner backend


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


def layer_problem(layer):
    """Why our runner cannot serve ``layer`` as loaded (one phrase), or None."""
    cfg = getattr(layer, "moe_runner_config", None)
    act = getattr(cfg, "activation", "silu")
    if act != "silu" or not getattr(cfg, "is_gated", True):
        return f"only gated SiLU (SwiGLU) experts are supported, got {act!r}"
    if getattr(cfg, "apply_router_weight_on_input", False):
        return "apply_router_weight_on_input is not supported"
    import torch

    E, two_i, h2 = layer.w13_weight.shape
    for name, want in (("w13_weight_scale", (E, two_i, h2 * 2 // 16)),
                       ("w2_weight", (E, h2 * 2, two_i // 4)),
                       ("w2_weight_scale", (E, h2 * 2, two_i // 32))):
        got = tuple(getattr(layer, name).shape)
        if got != want:
            return f"{name} has shape {got}, expected {want}"
    for name in ("w13_weight_scale", "w2_weight_scale"):
        if getattr(layer, name).dtype != torch.float8_e4m3fn:
            return f"{name} must be float8_e4m3fn"
    return None


def prepare_layer(layer) -> None:
    """Check the layer's NVFP4 tensors once after loading; keep them as loaded.

    A layer our runner cannot serve stops the server with one line
    (:class:`~dsv4_sm120.rank_agreement.StopServer`, a ``RuntimeError``, on every rank alike: the check reads the
    layer's shapes, the same on every rank). No stock path can take over here: SGLang 0.5.23 fixes the MoE runner
    server-wide before the weights load (``FusedMoE`` caches whether it is CUTLASS at construction, the NVFP4
    method reads the global runner), so the machine profile's choice steps aside earlier, where the runner is
    decided (:func:`hybrid_nvfp4_moe_runner_backend`, :func:`model_problem`)."""
    problem = layer_problem(layer)
    if problem:
        from dsv4_sm120.rank_agreement import StopServer

        raise StopServer(f"{BACKEND_NAME}: {problem}; restart with {ENV_BACKEND}={SM120_NVFP4_BACKEND} (and "
                         f"without --moe-runner-backend {BACKEND_NAME})")
    E, two_i, h2 = layer.w13_weight.shape
    layer._dsv4_w13_scale_2 = _global_scales_13(layer)
    layer._dsv4_w2_scale_2 = layer.w2_weight_scale_2.data.float().reshape(-1).contiguous()
    dispatcher = getattr(layer, "dispatcher", None)
    if dispatcher is not None and hasattr(dispatcher, "set_quant_config"):
        dispatcher.set_quant_config({"input_global_scale": None})  # bf16 activations in
    logger.info("%s: MoE layer with %d local experts, H=%d, I=%d", BACKEND_NAME, E, h2 * 2, two_i // 2)
    # the self-check on the first layer with loaded weights (once per process, before CUDA-graph capture)
    from . import selfcheck

    selfcheck.check_moe(layer, lambda x, tw, ids: run_experts(layer, x, tw, ids), layer.w13_weight.device)


def run_experts(layer, x, topk_weights, topk_ids):
    """Our NVFP4 fused MoE on ``layer``'s routed experts -> ``[M, H]`` bf16 (serving and the self-check).
    ``DSV4_SM120_TEST_SELFCHECK_FAULT=moe`` makes it wrong on its first path, ``moe-raise`` makes it raise there
    (tests of the self-check and the fallback)."""
    from dsv4_sm120.moe import nvfp4_fused_moe

    from . import selfcheck

    from .attention import test_fault

    fault = test_fault()
    if fault == "moe-raise" and not selfcheck.moe_fallback_active():
        raise RuntimeError("planted test fault moe-raise (DSV4_SM120_TEST_SELFCHECK_FAULT) on the first path")
    cfg = layer.moe_runner_config
    out = nvfp4_fused_moe(
        x,
        layer.w13_weight.data,
        layer.w13_weight_scale.data,
        layer._dsv4_w13_scale_2,
        layer.w2_weight.data,
        layer.w2_weight_scale.data,
        layer._dsv4_w2_scale_2,
        topk_weights,
        topk_ids,
        swiglu_limit=getattr(cfg, "swiglu_limit", None),
    )
    if fault == "moe" and not selfcheck.moe_fallback_active():
        out = out * 2
    return out


def apply(layer, dispatch_output):
    """Run the routed experts: ``[M, H]`` bf16."""
    if not hasattr(dispatch_output, "topk_output") or getattr(dispatch_output, "hidden_states_scale", None) is not None:
        from dsv4_sm120.rank_agreement import StopServer

        raise StopServer(
            f"{BACKEND_NAME} runs on the standard (no all-to-all) MoE dispatcher with bf16 hidden states; got "
            f"{type(dispatch_output).__name__}; restart with {ENV_BACKEND}={SM120_NVFP4_BACKEND} (and without "
            f"--moe-runner-backend {BACKEND_NAME})")
    topk_output = dispatch_output.topk_output
    to_std = getattr(topk_output, "to_standard", None)
    if not hasattr(topk_output, "topk_ids") and to_std is not None:
        topk_output = to_std()
    if not hasattr(layer, "_dsv4_w13_scale_2"):
        prepare_layer(layer)
    x = dispatch_output.hidden_states
    try:
        return run_experts(layer, x, topk_output.topk_weights, topk_output.topk_ids)
    except Exception as e:  # noqa: BLE001 - the other compute path answers; both failing stops the server
        from . import selfcheck

        E, two_i, h2 = layer.w13_weight.shape
        shape = f"M={x.shape[0]} E={E} H={h2 * 2} I={two_i // 2}"
        selfcheck.moe_step_aside(shape, f"{type(e).__name__}: {str(e)[:300]}", x.device)
    try:
        return run_experts(layer, x, topk_output.topk_weights, topk_output.topk_ids)
    except Exception as e:  # noqa: BLE001 - only StopServer leaves a forward: SGLang then stops every rank
        from dsv4_sm120.rank_agreement import StopServer

        raise StopServer(f"dsv4_sm120: our MoE kernel fails on this GPU at {shape} on its "
                         f"{selfcheck.moe_fallback_path()} path too ({type(e).__name__}: {str(e)[:300]}); restart "
                         f"with {ENV_BACKEND}={SM120_NVFP4_BACKEND}") from e
