"""The MoE runner names :mod:`dsv4_sm120.moe_runner` decides between, and ``DSV4_SM120_MOE_BACKEND``'s choices
(declared by :mod:`dsv4_sm120.settings`). Imports nothing.
"""

ENV_BACKEND = "DSV4_SM120_MOE_BACKEND"
MOE_FLAG = "--moe-runner-backend"

#: What stock SGLang 0.5.23 picks for the hybrid format (sm_100 only).
STOCK_HYBRID_BACKEND = "flashinfer_trtllm_routed"
#: The FlashInfer runner that runs ModelOpt NVFP4 MoE on sm_120.
SM120_NVFP4_BACKEND = "flashinfer_cutlass"
#: The overlay's Triton NVFP4 fused-MoE runner backend (``dsv4_sm120.moe.BACKEND_NAME``).
TRITON_NVFP4_BACKEND = "dsv4_triton_nvfp4"
#: The NVFP4 runner when neither the setting nor the machine profile picks one.
NVFP4_DEFAULT = SM120_NVFP4_BACKEND
NVFP4_RUNNERS = (SM120_NVFP4_BACKEND, TRITON_NVFP4_BACKEND)
#: ``DSV4_SM120_MOE_BACKEND``'s values and default.
NVFP4_SETTING_CHOICES = ("auto", SM120_NVFP4_BACKEND, TRITON_NVFP4_BACKEND, "stock")
NVFP4_SETTING_DEFAULT = "auto"
