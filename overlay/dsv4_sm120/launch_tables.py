"""Launch configurations as data: the one lookup of per-GPU JSON tables for our Triton kernels.

Laid out the way SGLang keeps its fused-MoE and FP8 GEMM configs: one JSON file per kernel, shape and device,

    dsv4_sm120/launch_tables/<kernel>/<shape>,device_name=<device>.json

whose top level maps a size (rows ``T`` for attention, tokens ``M`` for the MoE) to a launch configuration
(a flat dict of the kernel's launch keys). The nearest size wins (ties go to the smaller one), as in SGLang's
``get_config``. ``<device>`` is ``torch.cuda.get_device_name()`` with spaces as underscores (e.g.
``NVIDIA_H200``, ``NVIDIA_RTX_PRO_6000_Blackwell_Server_Edition``).

A GPU without its own table falls back, in this order, to the table of its architecture
(``device_name=arch_sm_<major><minor>``, e.g. ``arch_sm_120`` for every RTX PRO 6000 / RTX 50 variant), then
to ``device_name=default``. Keys beginning with ``_`` (``"_source"``, ``"_about"``) are metadata and never
configurations. The answer says which file it came from, so callers can log why a launch was chosen.

Torch-free on purpose: the serving preflight and ``make`` helpers read tables without a GPU.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Dict, NamedTuple, Optional, Tuple

from .paths import PACKAGE_DIR

TABLE_DIR = PACKAGE_DIR / "launch_tables"
DEFAULT_DEVICE = "default"


class TableError(ValueError):
    """A launch table that exists but cannot be used (bad JSON, no sizes, a non-dict entry)."""


class Lookup(NamedTuple):
    config: Dict[str, object]
    size: int            # the table size that was chosen (nearest to the one asked for)
    path: Path           # the file it came from
    level: str           # "device", "arch" or "default"


def device_key(name: str) -> str:
    """``"NVIDIA RTX PRO 6000 Blackwell"`` -> ``"NVIDIA_RTX_PRO_6000_Blackwell"`` (SGLang's file-name rule)."""
    return str(name).strip().replace(" ", "_")


def arch_key(capability: Tuple[int, int]) -> str:
    major, minor = capability
    return f"arch_sm_{int(major)}{int(minor)}"


def table_path(kernel: str, shape: str, device: str, root: Optional[Path] = None) -> Path:
    return Path(root or TABLE_DIR) / kernel / f"{shape},device_name={device}.json"


@lru_cache(maxsize=None)
def _load(path: str, mtime_ns: int) -> Dict[int, Dict[str, object]]:
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TableError(f"launch table {path}: cannot be read as JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise TableError(f"launch table {path}: top level must be an object of size -> config")
    table: Dict[int, Dict[str, object]] = {}
    for key, cfg in raw.items():
        if key.startswith("_"):
            continue
        if not re.fullmatch(r"[0-9]+", key) or not isinstance(cfg, dict):
            raise TableError(f"launch table {path}: entry {key!r} must be a positive integer size -> object")
        table[int(key)] = dict(cfg)
    if not table:
        raise TableError(f"launch table {path}: no size entries")
    return table


def read_table(path: Path) -> Dict[int, Dict[str, object]]:
    """size -> config of one table file (validated, cached by modification time)."""
    path = Path(path)
    return {k: dict(v) for k, v in _load(str(path), path.stat().st_mtime_ns).items()}


def nearest(sizes, size: int) -> int:
    return min(sizes, key=lambda s: (abs(s - size), s))


def lookup(kernel: str, shape: str, size: int, device_name: str = DEFAULT_DEVICE,
           capability: Optional[Tuple[int, int]] = None, root: Optional[Path] = None) -> Optional[Lookup]:
    """The configuration for ``size`` from the most specific table that exists: this device's, this
    architecture's, then the default. None when there is no table at all for ``kernel`` / ``shape``."""
    levels = [("device", device_key(device_name))] if device_name and device_name != DEFAULT_DEVICE else []
    if capability is not None:
        levels.append(("arch", arch_key(capability)))
    levels.append(("default", DEFAULT_DEVICE))
    for level, dev in levels:
        path = table_path(kernel, shape, dev, root)
        if path.is_file():
            table = read_table(path)
            pick = nearest(table, int(size))
            return Lookup(table[pick], pick, path, level)
    return None
