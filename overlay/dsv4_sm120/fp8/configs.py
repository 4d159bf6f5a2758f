"""SGLang 0.5.23's block-FP8 GEMM config files: their names, their schema, and reading/writing them.

SGLang looks a Triton ``w8a8_block_fp8_matmul`` tile config up in a JSON named

    N={N},K={K},device_name={dev},dtype=fp8_w8a8,block_shape=[{bn}, {bk}].json

(``dev`` = ``torch.cuda.get_device_name().replace(" ", "_")``) that maps token counts M (string keys) to tile
configs, and uses the entry of the nearest M.  The tuner writes these files and :mod:`dsv4_sm120.fp8_configs`
finds them for patched SGLang; both use this module, so there is one implementation of the scheme.

No torch or SGLang imports.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Optional

# SGLang 0.5.23, kernels/ops/gemm/fp8_kernel.py, get_w8a8_block_fp8_configs
CONFIG_NAME_RE = re.compile(
    r"^N=(?P<N>[1-9][0-9]*),K=(?P<K>[1-9][0-9]*),device_name=(?P<dev>[^,/\\]+),"
    r"dtype=fp8_w8a8,block_shape=\[(?P<bn>[1-9][0-9]*), (?P<bk>[1-9][0-9]*)\]\.json$"
)
REQUIRED_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
OPTIONAL_KEYS = {"SWAP_AB": bool, "SPLIT_K": int}  # honoured by SGLang 0.5.23 on sm_90 only


def sglang_device_name(raw: str) -> str:
    """The device-name field SGLang puts in config file names (spaces -> underscores)."""
    return raw.replace(" ", "_")


def config_file_name(N: int, K: int, device_name: str, block_n: int = 128, block_k: int = 128) -> str:
    """The exact file name SGLang 0.5.23 looks up for a block-FP8 GEMM of weight shape (N, K)."""
    dev = sglang_device_name(device_name)
    return f"N={N},K={K},device_name={dev},dtype=fp8_w8a8,block_shape=[{block_n}, {block_k}].json"


def parse_config_file_name(name: str) -> Optional[Dict[str, object]]:
    """The fields of a block-FP8 config file name (N, K, device_name, block_n, block_k), or None."""
    m = CONFIG_NAME_RE.match(name)
    if not m:
        return None
    return {"N": int(m["N"]), "K": int(m["K"]), "device_name": m["dev"],
            "block_n": int(m["bn"]), "block_k": int(m["bk"])}


def summary_file_stem(device_name: str) -> str:
    """The tuner's summary for a device is ``<stem>.json`` / ``<stem>.md`` next to the config files."""
    return f"summary_{sglang_device_name(device_name)}"


def validate_config_table(table: object, block_k: int = 128) -> None:
    """Raise ValueError unless ``table`` is a config JSON SGLang 0.5.23 can use as is."""
    if not isinstance(table, dict) or not table:
        raise ValueError("config must be a non-empty JSON object mapping M to a tile config")
    for key, cfg in table.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) > 0):
            raise ValueError(f"key {key!r} is not a positive integer M")
        if not isinstance(cfg, dict):
            raise ValueError(f"M={key}: value is not an object")
        missing = [k for k in REQUIRED_KEYS if k not in cfg]
        if missing:
            raise ValueError(f"M={key}: missing {missing}")
        extra = [k for k in cfg if k not in REQUIRED_KEYS and k not in OPTIONAL_KEYS]
        if extra:
            raise ValueError(f"M={key}: unknown keys {extra}")
        for k in REQUIRED_KEYS:
            v = cfg[k]
            if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
                raise ValueError(f"M={key}: {k}={v!r} is not a positive integer")
        for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps"):
            if cfg[k] & (cfg[k] - 1):
                raise ValueError(f"M={key}: {k}={cfg[k]} is not a power of two")
        if min(cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]) < 16:
            raise ValueError(f"M={key}: Triton tl.dot needs every block size >= 16")
        bk = cfg["BLOCK_SIZE_K"]
        if bk > block_k or block_k % bk:
            raise ValueError(f"M={key}: BLOCK_SIZE_K={bk} must divide the quantization block {block_k}")
        if "SWAP_AB" in cfg and not isinstance(cfg["SWAP_AB"], bool):
            raise ValueError(f"M={key}: SWAP_AB must be true/false")
        if "SPLIT_K" in cfg:
            s = cfg["SPLIT_K"]
            if not (isinstance(s, int) and not isinstance(s, bool) and s > 0 and not s & (s - 1)):
                raise ValueError(f"M={key}: SPLIT_K={s!r} must be a power of two")


def config_for_m(table: Dict[str, dict], M: int, block_k: int = 128) -> dict:
    """The tile config SGLang uses at token count ``M`` from a loaded table: the entry of the nearest M (the
    first in file order on a tie), with a BLOCK_SIZE_K below the quantization block that does not divide it
    raised to the block (as SGLang's lookup does on CUDA)."""
    by_m = {int(k): v for k, v in table.items()}
    cfg = dict(by_m[min(by_m, key=lambda x: abs(x - M))])
    if cfg.get("BLOCK_SIZE_K", block_k) < block_k and block_k % cfg["BLOCK_SIZE_K"]:
        cfg["BLOCK_SIZE_K"] = block_k
    return cfg


def read_json_object(path: Path) -> Optional[dict]:
    """The JSON object in ``path``, or None when it is missing, unreadable, not JSON or not an object."""
    try:
        with open(path) as fh:
            d = json.load(fh)
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None
