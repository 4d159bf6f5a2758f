"""Triton kernels of the sparse MLA decode (device code only; the launch is ``attention.launch``).

Split kernels, grid ``(T, S, HG)``: program ``(t, s, g)`` takes the heads ``g*BLOCK_H ..`` of row ``t`` (padded
to ``BLOCK_H`` with masks: the heads are the M dimension of the tensor-core MMA) and the ``s``-th chunk of that
row's candidates (per-cache chunks, main first; or, with the register body's ``SPAN``, chunks of main ++ extra).
Each gathers its tokens straight from their pages (any page size), decodes the FP8 nope part with its UE8M0 tile
scales, keeps rope in bf16, runs an online softmax in base 2 and writes the un-normalized partial ``acc`` and its
``(m, l)`` to the workspace row ``(t*S + s)*HP + h``:

* ``split_kernel_reg`` (``reg.py``): the register body, bf16 QK.
* ``split_kernel_tiled`` (``tiled.py``): seven 64-wide e4m3 tiles; bf16 QK or fp8 QK (``tl.dot_scaled`` e4m3 x
  e4m3 with UE8M0 scales, Q quantized by ``q_fp8_kernel`` before the launch; native on sm_120).
* ``split_kernel_flat`` (``flat.py``): 512-wide dequantized tiles, both QK paths.
* ``split_kernel_wspec`` (``wspec.py``, Gluon, GPU only): warp-specialized, producer warps gather and decode the
  blocks into a shared-memory ring while consumer warps run QK / softmax / PV; bf16 QK; absent where the installed
  Triton has no Gluon.
* ``split_kernel_wgmma`` (``wgmma.py``, Gluon, sm_90 only): the same producer / consumer split with 64 heads per
  program and Hopper warpgroup MMAs, so a block is gathered and decoded once for up to 64 heads; bf16 QK.
* ``split_kernel_wgmma_t`` (``wgmma_t.py``, Gluon, sm_90 only): warpgroup MMAs with the candidates as M and 16 or 32
  heads as N (no padded MMA rows at 16 heads), two producer partitions; bf16 QK. Its balanced launch (grid ``(C,)``,
  ``plan.plan_balanced``) walks an equal run of blocks across rows per program instead.

The Gluon bodies (wspec, wgmma, wgmma_t) take spanning splits only, bf16 QK, on a GPU: program ``s`` of row
``t`` takes candidates ``s*chunk .. (s+1)*chunk`` of main ++ extra. Their arguments are the Triton bodies' less
what that contract leaves unused (the per-cache split counts and chunks, ``FP8_QK``, ``INTERP``, ``SPAN``): the
query, ``chunk``, each cache's pages / indices / lengths, the workspace, then ``PRODUCER_REGS`` (the producer
partitions' registers, ``keys.producer_regs``).

``combine_kernel`` (``combine.py``), grid ``(T, H, 512 / BLOCK_D)``, merges the ``S`` partials and the sink into
bf16 ``out`` and the natural-log ``lse`` without the sink (zeros and ``-inf`` for rows with no valid candidate).

Under ``TRITON_INTERPRET=1`` (``INTERP``) the MMA operands are upcast to fp32 (the interpreter's bf16 dot is
wrong), Q is rounded onto the e4m3 grid first, and fp8 -> bf16 casts are avoided.
"""

from .combine import combine_kernel
from .common import E4M3_BF16_ASM, q_fp8_kernel
from .flat import split_kernel_flat
from .reg import split_kernel_reg
from .tiled import split_kernel_tiled

SPLIT_KERNELS = {"flat": split_kernel_flat, "tiled": split_kernel_tiled, "reg": split_kernel_reg}
try:  # Gluon (triton.experimental.gluon) comes with Triton >= 3.4
    from .wspec import split_kernel_wspec
except ImportError:  # pragma: no cover - an older Triton: the body is not offered
    split_kernel_wspec = None
else:
    SPLIT_KERNELS["wspec"] = split_kernel_wspec
try:  # Gluon's Hopper module (warpgroup MMA)
    from .wgmma import split_kernel_wgmma
except ImportError:  # pragma: no cover - an older Triton: the body is not offered
    split_kernel_wgmma = None
else:
    SPLIT_KERNELS["wgmma"] = split_kernel_wgmma
try:
    from .wgmma_t import split_kernel_wgmma_t
except ImportError:  # pragma: no cover
    split_kernel_wgmma_t = None
else:
    SPLIT_KERNELS["wgmma_t"] = split_kernel_wgmma_t

__all__ = ["SPLIT_KERNELS", "combine_kernel", "q_fp8_kernel", "split_kernel_flat", "split_kernel_reg",
           "split_kernel_tiled", "E4M3_BF16_ASM"]
