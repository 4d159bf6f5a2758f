"""Aliases of the names this package's former single module exported, for callers not yet moved to the split
layout (bench/bench_attention.py, bench/attn_sass_count.py, tests/test_ptx_decoders.py, all outside the attention
code). New code imports ``attention.launch`` (host), ``attention.config`` (launch configuration) and
``attention.kernels`` (Triton); remove this module once nothing imports it."""

from . import config as launch_config  # noqa: F401  (BF16_ONLY_IMPLS, parse_config, check_env)
from .config import DecodeInputError, parse_config  # noqa: F401
from .kernels import E4M3_BF16_ASM as _E4M3_BF16_ASM  # noqa: F401
from .kernels import combine_kernel as _dsv4_combine_kernel  # noqa: F401
from .kernels import q_fp8_kernel as _q_fp8_kernel  # noqa: F401
from .kernels import split_kernel_flat as _dsv4_split_kernel  # noqa: F401
from .kernels import split_kernel_reg as _dsv4_split_kernel_reg  # noqa: F401
from .kernels import split_kernel_tiled as _dsv4_split_kernel_tiled  # noqa: F401
from .launch import CONFIG_OVERRIDE, plan_span, plan_splits, sparse_mla_decode  # noqa: F401
