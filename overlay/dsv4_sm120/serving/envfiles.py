"""``serve/env/*.env`` files: ``KEY=VALUE`` lines, ``#`` comments, no shell expansion.

Files are read in name order; a later file overrides an earlier one; a variable already set
in the caller's environment wins over every file (so one-off overrides need no edit).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Mapping, Tuple

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class EnvFileError(Exception):
    pass


def parse_env_text(text: str, origin: str = "<env>") -> List[Tuple[str, str]]:
    out: List[Tuple[str, str]] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].strip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _KEY.match(key):
            raise EnvFileError(f"{origin}:{n}: expected KEY=VALUE, got {raw.strip()!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        elif "#" in value:  # trailing comment after an unquoted value
            value = value.split(" #", 1)[0].rstrip()
        if "$" in value or "`" in value:
            raise EnvFileError(f"{origin}:{n}: no shell expansion in env files ({key})")
        out.append((key, value))
    return out


def load_env_dir(env_dir: Path, environ: Mapping[str, str]) -> List[Tuple[str, str, str]]:
    """[(key, value, source)] in file order; ``source`` is the file, or ``environment`` when the caller's value wins."""
    merged: Dict[str, Tuple[str, str]] = {}
    if not env_dir.is_dir():
        raise EnvFileError(f"env directory {env_dir} does not exist")
    for f in sorted(env_dir.glob("*.env")):
        for k, v in parse_env_text(f.read_text(), str(f)):
            merged[k] = (v, f.name)
    out = []
    for k, (v, src) in merged.items():
        if k in environ:
            out.append((k, environ[k], "environment"))
        else:
            out.append((k, v, src))
    return out
