"""safetensors tensors read and written by hand, so both stream with bounded memory (headers:
:mod:`dsv4_sm120.safetensors_index`, shared with the serving preflight), and the crash-safe file writes
(temporary name, fsync, rename)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from dsv4_sm120.safetensors_index import DTYPE_SIZE, ShardHeader, numel

from .layout import COPY_CHUNK, ConvertError


def lazy_torch():
    """torch, imported on first use (``--help`` and the refusals of a bad SRC do not pay for it)."""
    import torch

    return torch


def read_tensor(f, hdr: ShardHeader, name: str):
    """Read one tensor from an open shard as a torch tensor (F8_E8M0 as uint8)."""
    torch = lazy_torch()
    t = hdr.tensors[name]
    f.seek(hdr.data_start + t.begin)
    buf = bytearray(f.read(t.nbytes))
    if len(buf) != t.nbytes:
        raise ConvertError(f"{hdr.path}: short read for {name!r} (file truncated?)")
    dt = {
        "U8": torch.uint8, "I8": torch.int8, "F8_E8M0": torch.uint8, "F8_E4M3": torch.float8_e4m3fn,
        "F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16, "F16": torch.float16,
    }.get(t.dtype)
    if dt is None:
        raise ConvertError(f"{hdr.path}: cannot read {name!r} of dtype {t.dtype}")
    x = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    return x.view(dt).reshape(t.shape)


def tensor_bytes(t) -> memoryview:
    """The bytes of a torch tensor as stored in a safetensors file (row-major, little-endian)."""
    torch = lazy_torch()
    t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass
class OutTensor:
    """One planned tensor of an output shard."""
    name: str
    dtype: str
    shape: Tuple[int, ...]
    # ("carry", src_name) or ("expert", base, proj, field)
    source: Tuple

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * DTYPE_SIZE[self.dtype]


def build_header(tensors: List[OutTensor], metadata: Optional[Dict[str, str]]) -> bytes:
    """The safetensors header (length prefix, JSON padded to 8 bytes) of ``tensors`` stored in order."""
    hdr: Dict[str, object] = {}
    if metadata:
        hdr["__metadata__"] = metadata
    off = 0
    for t in tensors:
        hdr[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class ShardWriter:
    """Writes a planned safetensors file to ``tmp`` while hashing it; ``commit``
    fsyncs and renames it onto ``final``."""

    def __init__(self, tmp: Path, final: Path, tensors: List[OutTensor], metadata):
        self.tmp, self.final, self.tensors = tmp, final, tensors
        self.f = open(tmp, "wb")
        self.h = hashlib.sha256()
        self.i = 0
        self.left = 0
        self.size = 0
        self._put(build_header(tensors, metadata))

    def _put(self, b) -> None:
        self.f.write(b)
        self.h.update(b)
        self.size += len(b)

    def begin(self, name: str) -> None:
        if self.left:
            raise RuntimeError(f"tensor {self.tensors[self.i - 1].name} incomplete")
        t = self.tensors[self.i]
        if t.name != name:
            raise RuntimeError(f"writing {name}, planned {t.name}")
        self.i += 1
        self.left = t.nbytes

    def write(self, b) -> None:
        b = memoryview(b).cast("B")
        if len(b) > self.left:
            raise RuntimeError("tensor larger than planned")
        self.left -= len(b)
        self._put(b)

    def commit(self) -> Tuple[str, int]:
        if self.left or self.i != len(self.tensors):
            raise RuntimeError("shard incomplete")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.final)
        fsync_dir(self.final.parent)
        return self.h.hexdigest(), self.size

    def abort(self) -> None:
        try:
            self.f.close()
        except OSError:
            pass


def copy_range(src_f, start: int, n: int, writer: ShardWriter) -> None:
    """Copy ``n`` bytes of the open file ``src_f`` from ``start`` into ``writer`` in bounded chunks."""
    src_f.seek(start)
    while n:
        b = src_f.read(min(COPY_CHUNK, n))
        if not b:
            raise ConvertError(f"{src_f.name}: unexpected end of file")
        writer.write(b)
        n -= len(b)


def same_bytes(fa, a: int, fb, b: int, n: int) -> bool:
    """Byte ranges [a, a+n) of fa and [b, b+n) of fb are equal (n < 0: sizes differ)."""
    if n < 0:
        return False
    while n:
        c = min(COPY_CHUNK, n)
        fa.seek(a)
        fb.seek(b)
        x, y = fa.read(c), fb.read(c)
        if len(x) != c or x != y:
            return False
        a, b, n = a + c, b + c, n - c
    return True


def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while True:
            b = f.read(COPY_CHUNK)
            if not b:
                return h.hexdigest()
            h.update(b)


def fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary name beside ``path``, fsync, rename onto ``path``."""
    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_copy(src: Path, dst: Path) -> None:
    """Copy ``src`` (content and mode) to a temporary name beside ``dst`` and rename it onto ``dst``."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.partial")
    shutil.copyfile(src, tmp)
    shutil.copymode(src, tmp)
    os.replace(tmp, dst)


def load_json(path: Path, what: str) -> Tuple[dict, bytes]:
    """A JSON object file as (object, raw bytes); a missing or unparsable file is a refusal naming ``what``."""
    try:
        raw = path.read_bytes()
        obj = json.loads(raw)
    except FileNotFoundError:
        raise ConvertError(f"{what} not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"cannot parse {path}: {e}") from None
    if not isinstance(obj, dict):
        raise ConvertError(f"{path}: expected a JSON object")
    return obj, raw
