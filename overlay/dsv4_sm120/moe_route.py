"""MoE runner choice for DeepSeek-V4 hybrid FP8 + NVFP4 checkpoints on sm_120.

Patched SGLang (``patches/0003-nvfp4-sm120-route.patch``) calls two functions
here, through ``sglang.srt.dsv4_sm120_hook.import_overlay("moe_route")``:

* :func:`hybrid_nvfp4_moe_runner_backend` from the DeepSeek-V4 server-argument
  override, when the user left ``--moe-runner-backend`` at ``auto`` and the
  checkpoint is the hybrid format (``quantization_config`` with
  ``moe_quant_algo: NVFP4``; e.g. the output of :mod:`dsv4_sm120.convert_nvfp4`).
  Stock 0.5.23 forces ``flashinfer_trtllm_routed`` there, which only runs on
  sm_100; on sm_120 this returns ``flashinfer_cutlass`` (ModelOpt NVFP4 through
  FlashInfer's CUTLASS fused MoE, which has sm_120 kernels and is what the
  measured +24% decode gain used). The overlay's own Triton runner
  (``dsv4_triton_nvfp4``) is opt-in: it missed its H200 targets and has not run
  on sm_120 yet (docs/moe.md); ``make bench-moe`` on sm_120 decides, then
  ``SGLANG_DSV4_SM120_NVFP4_MOE_BACKEND=dsv4_triton_nvfp4`` selects it.
* :func:`draft_mxfp4_expert_method` from ``HybridFp8NvFp4Config.get_quant_method``
  for the MTP draft experts, which that format keeps in MXFP4. Stock 0.5.23 sends
  them to ``Mxfp4FlashinferTrtllmMoEMethod`` (TRT-LLM, sm_100 only); on sm_120
  this picks ``Mxfp4FlashinferCutlassMoEMethod``, the class stock SGLang itself
  uses for MXFP4 experts there (MXFP8 activations x MXFP4 weights).

Both take plain values (no SGLang import), so they are testable on their own,
and never raise: on doubt they return the stock choice.

Environment: ``SGLANG_DSV4_SM120_NVFP4_MOE_BACKEND`` = ``auto`` (default) |
``flashinfer_cutlass`` | ``dsv4_triton_nvfp4`` | ``stock`` (keep SGLang's own
choice) forces the hybrid-NVFP4 runner on sm_120; an explicit
``--moe-runner-backend`` always wins over all of this.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ENV_BACKEND = "SGLANG_DSV4_SM120_NVFP4_MOE_BACKEND"

#: What stock SGLang 0.5.23 picks for the hybrid format (sm_100 only).
STOCK_HYBRID_BACKEND = "flashinfer_trtllm_routed"
#: The FlashInfer runner that runs ModelOpt NVFP4 MoE on sm_120.
SM120_NVFP4_BACKEND = "flashinfer_cutlass"
#: The overlay's Triton NVFP4 fused-MoE runner backend (dsv4_sm120.moe), once wired in.
TRITON_NVFP4_BACKEND = "dsv4_triton_nvfp4"

#: Draft-expert (MXFP4) method names returned by draft_mxfp4_expert_method.
DRAFT_CUTLASS = "flashinfer_cutlass_mxfp4"  # Mxfp4FlashinferCutlassMoEMethod
DRAFT_TRTLLM = "flashinfer_trtllm_mxfp4"  # Mxfp4FlashinferTrtllmMoEMethod (stock)

_CHOICES = ("auto", SM120_NVFP4_BACKEND, TRITON_NVFP4_BACKEND, "stock")


def triton_nvfp4_backend_available() -> bool:
    """Whether patched SGLang can run the ``dsv4_triton_nvfp4`` MoE runner backend.

    THE single switch for the overlay's Triton NVFP4 MoE. It returns False until
    the MoE-kernel work registers that backend with SGLang (a patch adding the
    name to SGLang's MoE runner backends, and a runner that reads the ModelOpt
    NVFP4 layer parameters); that work replaces this body with its own check
    (e.g. "the backend name is registered and dsv4_sm120.moe imports"). While it
    returns True, :func:`hybrid_nvfp4_moe_runner_backend` picks
    ``dsv4_triton_nvfp4`` on sm_120 when the environment asks for it.

    (Issue 5, patch 0005: true when SGLang knows the backend name, i.e. patch
    0005 is applied and the overlay's MoE package and Triton import; see
    :func:`dsv4_sm120.moe.sglang_runner.backend_available`.)
    """
    try:
        from dsv4_sm120.moe.sglang_runner import backend_available
    except Exception:  # noqa: BLE001
        return False
    return backend_available()


def _env_choice() -> str:
    v = os.environ.get(ENV_BACKEND, "auto").strip() or "auto"
    if v not in _CHOICES:
        logger.warning("%s=%r is not one of %s; using auto", ENV_BACKEND, v, ", ".join(_CHOICES))
        return "auto"
    return v


def hybrid_nvfp4_moe_runner_backend(
    *,
    is_sm120: bool,
    is_hip: bool = False,
    stock: str = STOCK_HYBRID_BACKEND,
) -> str:
    """MoE runner backend for a hybrid FP8+NVFP4 DeepSeek-V4 checkpoint.

    Called only when ``--moe-runner-backend`` is ``auto``. ``stock`` is what
    SGLang would pick; it is returned unchanged off sm_120 (and on ROCm).
    On sm_120: ``flashinfer_cutlass`` by default (``auto``);
    ``SGLANG_DSV4_SM120_NVFP4_MOE_BACKEND=dsv4_triton_nvfp4`` selects the overlay's
    Triton runner when :func:`triton_nvfp4_backend_available`, ``stock`` keeps SGLang's.
    """
    if not is_sm120 or is_hip:
        return stock
    choice = _env_choice()
    if choice == "stock":
        return stock
    if choice == TRITON_NVFP4_BACKEND:
        if triton_nvfp4_backend_available():
            return TRITON_NVFP4_BACKEND
        logger.warning("%s=%s but that backend is not available; using %s",
                       ENV_BACKEND, TRITON_NVFP4_BACKEND, SM120_NVFP4_BACKEND)
        return SM120_NVFP4_BACKEND
    if choice == SM120_NVFP4_BACKEND:
        return SM120_NVFP4_BACKEND
    # auto: the path with measured sm_120 results. Flip this default only with an sm_120 `make bench-moe`
    # showing dsv4_triton_nvfp4 ahead (it was slower than an FP8 MoE on the H200: bench/results/moe_h200.md).
    return SM120_NVFP4_BACKEND


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
    """Both choices for a platform, for logs and ``--dry-run`` style reports."""
    return {
        "hybrid_nvfp4_moe_runner_backend": hybrid_nvfp4_moe_runner_backend(is_sm120=is_sm120),
        "draft_mxfp4_expert_method": draft_mxfp4_expert_method(is_sm120=is_sm120),
        "triton_nvfp4_backend_available": triton_nvfp4_backend_available(),
        "env": os.environ.get(ENV_BACKEND),
    }
