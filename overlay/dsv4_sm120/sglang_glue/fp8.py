"""Patch 0004: where SGLang's FP8 block-GEMM config lookup finds the project's tuned configs.

Patched ``get_w8a8_block_fp8_configs`` (``kernels/ops/gemm/fp8_kernel.py``) asks
:func:`project_config_path` for the JSON it wants, under SGLang's own file name, before it reads
SGLang's configs directory; None keeps SGLang's own. The project directory
(:func:`project_config_dir`) is ``$DSV4_SM120_FP8_CONFIG_DIR`` when set (empty: none), else ``configs/fp8`` of
the checkout the patches were applied from, else that of the checkout holding this source tree.

Nothing here raises into SGLang: a setting that cannot be used (e.g. ``~nosuchuser/x``, refused by the settings
check at start-up too) or any other error of the lookup logs one warning and keeps SGLang's own configs.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

from dsv4_sm120 import settings
from dsv4_sm120.fp8.configs import parse_config_file_name, validate_config_table
from dsv4_sm120.paths import CONFIGS_DIR, applied_repo_root

logger = logging.getLogger(__name__)

ENV_CONFIG_DIR = "DSV4_SM120_FP8_CONFIG_DIR"

_warned: set = set()


def project_config_dir(sglang_root: Optional[Path] = None) -> Optional[Path]:
    """The project's FP8 config directory (module doc), or None when switched off / not found."""
    env = settings.raw(ENV_CONFIG_DIR)
    if env is not None:
        if not env.strip():
            return None
        p = Path(settings.get(ENV_CONFIG_DIR))      # validated and expanded (SettingsError: a ValueError)
        if not p.is_dir() and str(p) not in _warned:
            _warned.add(str(p))
            logger.warning("%s=%s is not a directory; using SGLang's own FP8 GEMM configs", ENV_CONFIG_DIR, p)
        return p if p.is_dir() else None
    repo = applied_repo_root(sglang_root)
    candidates = [repo / "configs" / "fp8" if repo is not None else None, CONFIGS_DIR / "fp8"]
    for c in candidates:
        if c is not None and c.is_dir():
            return c
    return None


def project_config_path(json_file_name: str, sglang_root: Optional[Path] = None) -> Optional[str]:
    """Path of the project's config named ``json_file_name`` (SGLang's name), or None to use SGLang's own.

    A project file that is not a valid config is skipped with a warning (SGLang's own is used); so is any error
    of the lookup itself (never raises).
    """
    try:
        return _project_config_path(json_file_name, sglang_root)
    except Exception as e:  # noqa: BLE001 - a lookup of ours must never stop SGLang's GEMM config lookup
        why = f"{type(e).__name__}: {e}"
        if why not in _warned:
            _warned.add(why)
            logger.warning("dsv4_sm120: FP8 GEMM config lookup failed (%s); using SGLang's own configs", why)
        return None


def _project_config_path(json_file_name: str, sglang_root: Optional[Path]) -> Optional[str]:
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
