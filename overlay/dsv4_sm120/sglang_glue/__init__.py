"""dsv4_sm120.sglang_glue: everything the patched SGLang calls, and nothing else.

Patched SGLang reaches the overlay only through ``sglang.srt.dsv4_sm120_hook`` (patch 0001), and the hook
imports only this package: ``import_glue("attention")`` gives :mod:`.attention` and so on. Each module is the
SGLang-facing side of one part; the kernels and the rest of the logic live in the overlay's other packages
and are called from here.

* :func:`start` (:mod:`.startup`): run once by the hook when the patched SGLang first uses the overlay;
  validates every dsv4_sm120 setting (an invalid one stops the server with one line per problem) and logs
  the active overlay version and patch series.
* :mod:`.attention` (patch 0002): the DeepSeek-V4 backend's sm_120 sparse-attention call and the model's
  head count, routed per row bucket and layout from the machine profile (``make calibrate``), an explicit
  setting, or the default; a call of our kernel that raises is answered by the stock path and the rows of its
  launch stay there for the rest of the process.
* :mod:`.selfcheck` (:mod:`.graphs` at each CUDA-graph capture loop; :mod:`.moe` at its first layer): every
  launch of our kernels that the captured rows reach is run once against the stock implementation; a failing
  launch steps aside to the stock path for its rows (the MoE: to its other compute path).
* :mod:`.graphs` (patch 0006): the capture loops' hooks (decode, target-verify, draft, prefill): the self-check
  over the rows they capture, and a second capture of a size whose capture raised after one of our kernels
  stepped aside during it; the ranks of the tensor-parallel group agree on both (the union of their fallbacks,
  every rank captures again together, or every rank stops with one line).
* :mod:`.allreduce` (patch 0007): the group the ranks agree in (:mod:`dsv4_sm120.rank_agreement` over SGLang's
  tensor-parallel group), and the agreed set-up of SGLang's FlashInfer PCIe-IPC all-reduce (any rank failed:
  NCCL on every rank).
* :mod:`.moe` (patches 0003, 0005): the MoE runner for hybrid FP8 + NVFP4 checkpoints, the MTP draft
  experts' MXFP4 method, and the ``dsv4_triton_nvfp4`` runner backend.
* :mod:`.fp8` (patch 0004): where SGLang's FP8 block-GEMM config lookup finds the project's tuned configs.

Importing this package imports neither torch, Triton nor SGLang.
"""

from __future__ import annotations

from . import attention, selfcheck
from .startup import start

# .selfcheck runs .attention's kernel, so .attention calls the first-call self-check through this reference
attention.first_call_check = selfcheck.first_call

__all__ = ["start"]
