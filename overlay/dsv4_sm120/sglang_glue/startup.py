"""The glue's startup, run once per process by the hook when the patched SGLang first uses the overlay.

It validates every dsv4_sm120 setting of the environment (:func:`dsv4_sm120.settings.validate`): with a
problem the server does not start (``SystemExit`` with one line per problem, which the hook lets through
while it turns any other overlay failure into SGLang's stock paths). Then it logs, once, the overlay
version and the patch series the SGLang tree was patched with (its apply manifest).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Optional

from dsv4_sm120 import __version__
from dsv4_sm120.settings import validate

logger = logging.getLogger(__name__)


def _manifest(sglang_root: Optional[str]) -> dict:
    if not sglang_root:
        return {}
    try:
        with open(os.path.join(sglang_root, ".dsv4_sm120", "manifest.json")) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def problems_message(problems) -> str:
    return ("dsv4_sm120: invalid settings, the server does not start "
            "(python -m dsv4_sm120.settings lists the valid values; DSV4_SM120_DISABLE=1 runs stock SGLang):\n"
            + "\n".join(f"  {p}" for p in problems))


def start(sglang_root: Optional[str] = None) -> dict:
    """Validate the settings (SystemExit on a problem) and log the active overlay; returns the manifest.

    ``sglang_root``: the patched ``sglang`` package directory (where the apply manifest is)."""
    problems = validate()
    if problems:
        for p in problems:
            logger.error("dsv4_sm120: %s", p)
        raise SystemExit(problems_message(problems))
    m = _manifest(sglang_root)
    logger.info("dsv4_sm120 overlay %s active (patch series %s, applied %s)", __version__,
                str(m.get("series_hash", "unknown"))[:12], m.get("applied_at", "unknown"))
    if m.get("overlay_version") and m["overlay_version"] != __version__:
        logger.warning("dsv4_sm120 overlay %s differs from the version %s the patches were applied with; "
                       "rerun `make apply-patches`", __version__, m["overlay_version"])
    return m
