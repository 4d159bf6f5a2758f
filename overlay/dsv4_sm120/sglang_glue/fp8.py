"""Patch 0004: where SGLang's FP8 block-GEMM config lookup finds the project's tuned configs.

Patched ``get_w8a8_block_fp8_configs`` (``kernels/ops/gemm/fp8_kernel.py``) asks
:func:`project_config_path` for the JSON it wants, under SGLang's own file name, before it reads
SGLang's configs directory; None keeps SGLang's own. The project directory
(:func:`dsv4_sm120.fp8_configs.project_config_dir`) is ``$DSV4_SM120_FP8_CONFIG_DIR`` when set (empty:
none), else ``configs/fp8`` of the checkout the patches were applied from.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

from dsv4_sm120.fp8.configs import parse_config_file_name, validate_config_table
from dsv4_sm120.fp8_configs import project_config_dir

logger = logging.getLogger(__name__)

_warned: set = set()


def project_config_path(json_file_name: str, sglang_root: Optional[Path] = None) -> Optional[str]:
    """Path of the project's config named ``json_file_name`` (SGLang's name), or None to use SGLang's own.

    A project file that is not a valid config is skipped with a warning (SGLang's own is used).
    """
    if os.path.basename(json_file_name) != json_file_name:
        return None
    d = project_config_dir(sglang_root)
    if d is None:
        return None
    path = d / json_file_name
    if not path.is_file():
        return None
    try:
        with open(path) as fh:
            table = json.load(fh)
        info = parse_config_file_name(json_file_name)
        validate_config_table(table, block_k=int(info["block_k"]) if info else 128)
    except (OSError, ValueError) as e:
        if str(path) not in _warned:
            _warned.add(str(path))
            logger.warning("ignoring invalid FP8 GEMM config %s (%s); using SGLang's own", path, e)
        return None
    return str(path)
