"""Names and constants of the source (MXFP4) and output (hybrid FP8 + NVFP4) checkpoint layouts, the converter's
own files, and the error it refuses with."""

from __future__ import annotations

import json
import re

from dsv4_sm120.safetensors_index import INDEX_FILE, CheckpointError  # noqa: F401  (INDEX_FILE re-exported)

FORMAT_VERSION = 1
STATE_DIR = ".dsv4_sm120_convert"
STATE_FILE = "state.json"
REPORT_FILE = "dsv4_sm120_nvfp4_report.json"
CONFIG_FILE = "config.json"
NVFP4_GROUP = 16
COPY_CHUNK = 64 << 20
# E4M3 normal range of block scales: amax 448 * 6 * s down to 2^-6 * 6 * s.
A_OVER_S = 448.0 * 6.0

DSV4_ARCHS = ("DeepseekV4ForCausalLM",)
DSV4_MODEL_TYPES = ("deepseek_v4",)

# Routed-expert tensor names of the released checkpoint (MTP layers included).
EXPERT_RE = re.compile(
    r"^(?P<base>(?P<kind>layers|mtp)\.(?P<layer>\d+)\.ffn\.experts\.(?P<expert>\d+))"
    r"\.(?P<proj>w[123])\.(?P<field>weight|scale)$"
)

# Checkpoint-name globs of what stays FP8 / MXFP4; SGLang only consults this for
# FusedMoE prefixes (model.layers.{i}.mlp.experts must not match) and adds
# model.decoder.* (the MTP draft experts) itself.
NVFP4_IGNORE = [
    "*.attn.*",
    "*.ffn.shared_experts.*",
    "*.ffn.gate",
    "mtp.*",
    "embed",
    "head",
]

# A refusal with a one-line message for the user (exit code 2): the class the shared
# safetensors header reader raises, so its refusals need no translation.
ConvertError = CheckpointError


def output_config(config: dict) -> dict:
    """The source ``config.json`` with the ``quantization_config`` of the hybrid FP8 + NVFP4 layout."""
    cfg = json.loads(json.dumps(config))
    qc = dict(cfg.get("quantization_config") or {})
    qc.setdefault("quant_method", "fp8")
    qc["quant_algo"] = "MIXED_PRECISION"
    qc["moe_quant_algo"] = "NVFP4"
    qc["group_size"] = NVFP4_GROUP
    qc["ignore"] = list(NVFP4_IGNORE)
    cfg["quantization_config"] = qc
    return cfg
