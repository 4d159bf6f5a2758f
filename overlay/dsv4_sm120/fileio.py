"""Atomic file writes shared by every part that saves results, state or configs.

A file is written to a temporary file in the same directory, flushed and fsynced, then renamed onto its
name: a reader (or a run interrupted at any point) sees either the previous file or the whole new one,
never a half-written one. On any error the temporary file is removed and the error propagates.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Optional, Union

__all__ = ["atomic_write_bytes", "atomic_write_json", "atomic_write_text"]

PathLike = Union[str, "os.PathLike[str]"]


def atomic_write_bytes(path: PathLike, data: bytes, mode: Optional[int] = None) -> Path:
    """Write ``data`` to ``path`` atomically, creating its parent directories. ``mode`` sets the file's
    permission bits; None leaves those of a new temporary file (0o600). Returns ``path`` as a Path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def atomic_write_text(path: PathLike, text: str, mode: Optional[int] = None) -> Path:
    """:func:`atomic_write_bytes` of ``text`` encoded as UTF-8."""
    return atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_write_json(path: PathLike, obj, mode: Optional[int] = None, **dumps) -> Path:
    """:func:`atomic_write_text` of ``json.dumps(obj, **dumps)`` plus a final newline."""
    return atomic_write_text(path, json.dumps(obj, **dumps) + "\n", mode)
