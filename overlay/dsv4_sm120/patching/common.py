"""The patch tool's shared pieces: its error, the pinned SGLang wheels, the series path, sha256 helpers."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Dict, Optional

from dsv4_sm120.paths import repo_root


class PatchError(Exception):
    """A refusal or failure with a one-line message for the user."""

    def __init__(self, msg: str, code: int = 1):
        super().__init__(msg)
        self.code = code


def wheels_file() -> Path:
    return repo_root() / "requirements" / "sglang-wheels.txt"


def load_pinned_wheels(path: Optional[Path] = None) -> Dict[str, str]:
    """{wheel file name: sha256} of the pinned SGLang wheels (requirements/sglang-wheels.txt); {} if absent."""
    path = path or wheels_file()
    out: Dict[str, str] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for raw in text.splitlines():
        parts = raw.split("#", 1)[0].split()
        if len(parts) == 2 and parts[0].endswith(".whl") and re.fullmatch(r"[0-9a-f]{64}", parts[1]):
            out[parts[0]] = parts[1]
    return out


# sha256 of the pinned wheel(s) on PyPI; `check` and `setup` refuse anything else.
PINNED_WHEELS = load_pinned_wheels()


def default_series_path() -> Path:
    return repo_root() / "patches" / "series"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> Optional[str]:
    try:
        return sha256_bytes(path.read_bytes())
    except FileNotFoundError:
        return None
