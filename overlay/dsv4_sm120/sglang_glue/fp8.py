"""Patch 0004: where SGLang's FP8 block-GEMM config lookup finds the project's tuned configs.

Patched ``get_w8a8_block_fp8_configs`` (``kernels/ops/gemm/fp8_kernel.py``) asks :func:`project_config_path` for
the JSON it wants, under SGLang's own file name, before it reads SGLang's configs directory; None keeps SGLang's
own. The lookup itself (the project directory's order, the file check) is
:func:`dsv4_sm120.fp8_configs.project_config_path`.

Nothing here raises into SGLang: a setting that cannot be used (e.g. ``~nosuchuser/x``, refused by the settings
check at start-up too) or any other error of the lookup logs one warning and keeps SGLang's own configs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from dsv4_sm120.fp8_configs import ENV_CONFIG_DIR, project_config_dir  # noqa: F401 - the answers next to the hook
from dsv4_sm120.fp8_configs import project_config_path as _project_config_path

logger = logging.getLogger(__name__)

_warned: set = set()


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
