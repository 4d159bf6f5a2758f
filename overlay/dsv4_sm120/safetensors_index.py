"""Safetensors shard headers and a checkpoint directory's index, checked without reading tensor data.

One implementation for the NVFP4 converter (:mod:`dsv4_sm120.convert_nvfp4`) and the serving
preflight (:mod:`dsv4_sm120.serving.preflight`). Pure standard library (no torch import).

A shard is ``8-byte little-endian header length N``, ``N bytes of JSON`` (tensor name ->
``dtype``, ``shape``, ``data_offsets [begin, end)`` relative to the data region; optional
``__metadata__``), then the data region. :func:`read_header` checks what the ``safetensors``
loader checks: the header lies inside the file, every entry is well formed, each tensor's byte
size matches its dtype and shape, the tensors tile the data region from 0 without gaps or
overlaps, and the data region ends exactly at the end of the file (a shorter file is truncated,
a longer one is refused by the loader too). :func:`scan_checkpoint` checks a directory: its
``model.safetensors.index.json`` (or, without one, every ``*.safetensors``) against the shard
headers: missing or unreadable shards, tensors listed in the index but absent from their shard.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

INDEX_FILE = "model.safetensors.index.json"
# The safetensors loader refuses longer headers.
MAX_HEADER_BYTES = 100_000_000

# Bits per element of the safetensors dtypes.
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "F64": 64, "I64": 64, "U64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
# Bytes per element of the whole-byte dtypes.
DTYPE_SIZE = {k: v // 8 for k, v in DTYPE_BITS.items() if v % 8 == 0}


class CheckpointError(Exception):
    """A malformed checkpoint, with a one-line message for the user."""


@dataclass
class TensorInfo:
    name: str
    dtype: str
    shape: Tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class ShardHeader:
    path: Path
    data_start: int
    tensors: Dict[str, TensorInfo]
    metadata: Optional[Dict[str, str]]
    file_size: int

    def ordered(self) -> List[TensorInfo]:
        return sorted(self.tensors.values(), key=lambda t: (t.begin, t.end, t.name))


def numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def tensor_nbytes(dtype: str, shape: Iterable[int]) -> Optional[int]:
    """Byte size of a tensor, or None for a dtype this module does not know."""
    bits = DTYPE_BITS.get(dtype)
    if bits is None:
        return None
    total = numel(shape) * bits
    return total // 8 if total % 8 == 0 else -1


def read_header(path: Path) -> ShardHeader:
    """Parse and check one shard's header (reads 8 bytes + the JSON, no tensor data).

    Raises :class:`CheckpointError` naming the file and what is wrong with it."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if size == 0:
                raise CheckpointError(f"{path}: empty file (0 bytes): truncated download or copy?")
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, too short; truncated?)")
            (hlen,) = struct.unpack("<Q", raw)
            if hlen > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: not a safetensors file (header length {hlen} is implausible)")
            if hlen > size - 8:
                raise CheckpointError(
                    f"{path}: header of {hlen} bytes runs past the end of the {size}-byte file (truncated?)")
            hdr = json.loads(f.read(hlen))
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(hdr, dict):
        raise CheckpointError(f"{path}: malformed safetensors header (not a JSON object)")
    meta = hdr.pop("__metadata__", None)
    if meta is not None and not isinstance(meta, dict):
        raise CheckpointError(f"{path}: malformed safetensors header (__metadata__ is not an object)")
    data_start = 8 + hlen
    data_size = size - data_start
    tensors: Dict[str, TensorInfo] = {}
    for name, info in hdr.items():
        try:
            dtype = info["dtype"]
            shape = tuple(int(d) for d in info["shape"])
            b, e = (int(x) for x in info["data_offsets"])
            if not isinstance(dtype, str) or min(shape, default=0) < 0 or b < 0 or e < b:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}") from None
        want = tensor_nbytes(dtype, shape)
        if want is not None and want != e - b:
            raise CheckpointError(
                f"{path}: tensor {name!r} ({dtype} {list(shape)}) claims {e - b} bytes, its shape needs "
                f"{want if want >= 0 else 'a whole number of'} bytes")
        tensors[name] = TensorInfo(name, dtype, shape, b, e)
    hdr_info = ShardHeader(path, data_start, tensors, meta, size)
    pos, prev = 0, None
    for t in hdr_info.ordered():
        if t.begin != pos:
            if t.begin < pos:
                raise CheckpointError(f"{path}: tensor {t.name!r} overlaps {prev!r} (header offsets are wrong)")
            raise CheckpointError(f"{path}: gap of {t.begin - pos} bytes before tensor {t.name!r} "
                                  "(header offsets are wrong)")
        if t.end > data_size:
            raise CheckpointError(
                f"{path}: tensor {t.name!r} ends at data byte {t.end} but the file holds only {data_size} "
                f"data bytes ({size} bytes in all): truncated?")
        pos, prev = t.end, t.name
    if pos != data_size:
        raise CheckpointError(
            f"{path}: {data_size - pos} bytes after the last tensor (data region {pos} bytes, file {size} "
            "bytes): not a valid safetensors file")
    return hdr_info


@dataclass
class Checkpoint:
    root: Path
    weight_map: Dict[str, str]  # tensor -> shard file name
    index_meta: dict
    index_raw: bytes  # b"" without an index file
    headers: Dict[str, ShardHeader]  # shard file name -> header (the shards that could be read)


def _valid_shard_name(fn: str) -> bool:
    return bool(fn) and "/" not in fn and "\\" not in fn and not fn.startswith(".")


def scan_checkpoint(root: Path, max_problems: int = 20) -> Tuple[Checkpoint, List[str]]:
    """Read a checkpoint directory's index and every shard header; check them against each other.

    Returns the checkpoint and a list of problems (empty: consistent), at most ``max_problems``
    lines plus one saying how many more there were. One line per problem: an unreadable index,
    a shard listed in the index that is missing, a shard whose header is malformed / truncated /
    lies about its offsets (:func:`read_header`), tensors listed in the index but absent from
    their shard (counted per shard)."""
    root = Path(root)
    problems: List[str] = []
    ck = Checkpoint(root, {}, {}, b"", {})
    idx_path = root / INDEX_FILE
    if idx_path.exists():
        try:
            raw = idx_path.read_bytes()
            index = json.loads(raw)
        except OSError as e:
            return ck, [f"cannot read {idx_path}: {e.strerror or e}"]
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return ck, [f"{idx_path} is not valid JSON ({e})"]
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
            return ck, [f"{idx_path}: no weight_map (tensor name -> shard file name)"]
        meta = index.get("metadata") or {}
        ck.weight_map, ck.index_meta, ck.index_raw = dict(wm), meta if isinstance(meta, dict) else {}, raw
        for fn in sorted(set(wm.values())):
            if not _valid_shard_name(fn):
                problems.append(f"{INDEX_FILE}: unsupported shard name {fn!r} (must be a file in {root})")
            elif not (root / fn).is_file():
                problems.append(f"shard {fn} listed in {INDEX_FILE} is missing from {root}")
            else:
                try:
                    ck.headers[fn] = read_header(root / fn)
                except CheckpointError as e:
                    problems.append(str(e))
        absent: Dict[str, List[str]] = {}
        for name, fn in wm.items():
            h = ck.headers.get(fn)
            if h is not None and name not in h.tensors:
                absent.setdefault(fn, []).append(name)
        for fn, names in sorted(absent.items()):
            more = f" (and {len(names) - 1} more tensor(s) listed for that shard)" if len(names) > 1 else ""
            problems.append(f"{INDEX_FILE} puts {names[0]!r} in {fn}, but that shard does not hold it{more}")
    else:
        files = sorted(p.name for p in root.glob("*.safetensors") if not p.name.startswith("."))
        if not files:
            return ck, [f"{root} holds no {INDEX_FILE} and no *.safetensors files"]
        for fn in files:
            try:
                ck.headers[fn] = read_header(root / fn)
            except CheckpointError as e:
                problems.append(str(e))
                continue
            for name in ck.headers[fn].tensors:
                ck.weight_map.setdefault(name, fn)
    if len(problems) > max_problems:
        problems = problems[:max_problems] + [f"... and {len(problems) - max_problems} more problem(s)"]
    return ck, problems
