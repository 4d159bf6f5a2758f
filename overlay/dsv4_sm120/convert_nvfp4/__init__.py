"""Convert a DeepSeek-V4-Flash checkpoint's MXFP4 routed experts to NVFP4.

Usage: ``python -m dsv4_sm120.convert_nvfp4 SRC_DIR DST_DIR [options]``

Modules: ``layout`` (names and constants of both checkpoint layouts), ``source`` (SRC: headers, expert
projections, the scale check), ``input_scales``, ``plan`` (the output shards), ``shard_conversion`` (one
expert projection, one shard), ``resume`` (the journal in DST), ``driver`` (:func:`convert`), ``verify``,
``safetensors_io`` (tensor reads and crash-safe writes), ``console`` (messages, progress), ``cli``. The number
format lives in :mod:`dsv4_sm120.nvfp4` and safetensors headers in :mod:`dsv4_sm120.safetensors_index`.

SRC_DIR is the released checkpoint (config.json, model.safetensors.index.json,
safetensors shards; routed experts ``layers.{i}.ffn.experts.{e}.w{1,2,3}.weight``
packed e2m1 (I8/U8) + ``.scale`` E8M0 per 32). DST_DIR receives a checkpoint in
the hybrid FP8 + NVFP4 layout SGLang 0.5.23 auto-detects (the layout of
nvidia/DeepSeek-V4-Flash-NVFP4): per main-model routed expert ``weight`` U8,
``weight_scale`` F8_E4M3 per 16, ``weight_scale_2`` F32 scalar, ``input_scale``
F32 scalar, and ``quantization_config`` gaining ``quant_algo: MIXED_PRECISION``,
``moe_quant_algo: NVFP4``, ``group_size: 16``. Everything else, including the
MTP (``mtp.*``) draft experts, which SGLang 0.5.23 loads as MXFP4 in this
format, is carried over byte for byte.

Numerics: the closed form of :mod:`dsv4_sm120.nvfp4` (nibbles verbatim, one
global scale per expert shared by w1 and w3, E4M3 block scale 2^(k-m)):
bit-exact for every block within 17 binades of its tensor's largest;
blocks further below are clamped, counted and reported with their error.

Operation: first every shard header is checked against the index and every
expert scale tensor is read and checked (NaN, F32 non-powers of two), so a
damaged source is refused before anything is written; then one shard at a
time, streamed tensor by tensor (peak memory is a few hundred MB whatever the
shard size); every file is written to a temporary name and renamed; a rerun skips shards already finished after checking them
(size + sha256 recorded when written); SRC is only ever read. Exit codes: 0 ok,
1 verification found a difference, 2 refused (bad input, no space, ...).
"""

from dsv4_sm120.safetensors_index import read_header

from .cli import main
from .driver import Result, convert
from .input_scales import InputScales, default_input_scales, load_input_scales
from .layout import (
    CONFIG_FILE,
    COPY_CHUNK,
    DSV4_ARCHS,
    DSV4_MODEL_TYPES,
    EXPERT_RE,
    FORMAT_VERSION,
    INDEX_FILE,
    NVFP4_GROUP,
    NVFP4_IGNORE,
    REPORT_FILE,
    STATE_DIR,
    STATE_FILE,
    ConvertError,
    output_config,
)
from .plan import Plan, make_plan
from .resume import options_fingerprint
from .safetensors_io import OutTensor, ShardWriter, build_header, read_tensor, tensor_bytes
from .shard_conversion import Stats, convert_expert, convert_shard
from .source import ExpertProj, Source, check_expert_scales, find_experts, load_source, source_fingerprint
from .verify import verify_conversion

__all__ = [
    "CONFIG_FILE", "COPY_CHUNK", "DSV4_ARCHS", "DSV4_MODEL_TYPES", "EXPERT_RE", "FORMAT_VERSION", "INDEX_FILE",
    "NVFP4_GROUP", "NVFP4_IGNORE", "REPORT_FILE", "STATE_DIR", "STATE_FILE", "ConvertError", "ExpertProj",
    "InputScales", "OutTensor", "Plan", "Result", "ShardWriter", "Source", "Stats", "build_header",
    "check_expert_scales", "convert", "convert_expert", "convert_shard", "default_input_scales", "find_experts",
    "load_input_scales", "load_source", "main", "make_plan", "options_fingerprint", "output_config",
    "read_header", "read_tensor", "source_fingerprint", "tensor_bytes", "verify_conversion",
]
