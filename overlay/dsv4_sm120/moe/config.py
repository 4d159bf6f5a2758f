"""Launch configurations of the NVFP4 fused MoE: read from per-GPU JSON tables, never computed here.

Tables live in ``dsv4_sm120/launch_tables/moe/`` and are read through :mod:`dsv4_sm120.launch_tables`
(this device's table, then ``arch_sm_XY``, then ``default``; nearest token count ``M`` wins). File names::

    E=<experts>,topk=<k>,path=<fp4|bf16>,device_name=<device>.json

Each entry maps tokens ``M`` to ``{"BM", "BN1", "BK1", "BN2", "BK2", "warps1", "warps2", "stages", "align"}``:
row tile, w13 N / K tiles, w2 N / K tiles, warps of the two GEMMs, pipeline stages, and the token grouping
(``inkernel``: every GEMM program finds its expert's pairs itself; ``triton``: the one-program align kernel;
``torch``: sort + scans). ``H`` and ``I`` are not in the key: a table's ``BK1`` / ``BK2`` are the K steps it
wants, and :func:`legal_bk` halves them (down to 32) until they divide ``H`` / ``I``, which is a correctness
rule, not a tuning choice.

A shape without a ``default`` table of its own (an expert-parallel split we ship no table for) takes the
table of the nearest shipped shape: same path, the same ``topk`` if there is one, the nearest ``E`` on a log
scale. The choice is logged once per shape.

Exceptions kept in code, on purpose:

* Under the Triton CPU interpreter (``TRITON_INTERPRET=1``) every launch uses :data:`INTERPRETER_TILES`
  (small tiles, one stage: the CPU tests' shapes are tiny and the interpreter has no pipeline) and the grouping
  :func:`interpreter_align` (in-kernel up to 32 pairs, the align kernel up to 2048, sort above), so the CPU
  tests exercise every grouping mode.
* ``deq`` (the bf16 path's weight decode) is not tuned: 3 (inline-PTX shift decode) on NVIDIA GPUs,
  0 (portable float32 decode) under the interpreter and on non-NVIDIA builds, where inline PTX cannot run.

Torch-free, like :mod:`dsv4_sm120.launch_tables`: the caller passes the device name and capability.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Optional, Tuple

from .. import launch_tables as LT

logger = logging.getLogger(__name__)

KERNEL = "moe"
ALIGN_MODES = ("inkernel", "triton", "torch")
DECODES = (0, 3)  # bf16 path weight decode: 0 float32 math (portable), 3 inline-PTX shift decode (NVIDIA)
_TABLE_KEYS = ("BM", "BN1", "BK1", "BN2", "BK2", "warps1", "warps2", "stages", "align")


@dataclass(frozen=True)
class Config:
    """One launch of the fused MoE. ``BK1`` / ``BK2`` must divide ``H`` / ``I`` (see :func:`legal_bk`)."""

    BM: int
    BN1: int
    BK1: int
    BN2: int
    BK2: int
    warps1: int
    warps2: int
    stages: int
    deq: int = 3
    align: str = "triton"


# Interpreter launches (see the module docstring).
INTERPRETER_TILES = dict(BM=16, BN1=16, BK1=32, BN2=16, BK2=32, warps1=4, warps2=4, stages=1)


def interpreter_align(pairs: int) -> str:
    return "inkernel" if pairs <= 32 else ("triton" if pairs <= 2048 else "torch")


def legal_bk(K: int, want: int) -> int:
    """The K step actually used: ``want`` halved (not below 32) until it divides ``K``."""
    bk = int(want)
    while bk > 32 and K % bk:
        bk //= 2
    return bk


def shape_key(E: int, topk: int, path: str) -> str:
    return f"E={int(E)},topk={int(topk)},path={path}"


_SHAPE_RE = re.compile(r"E=(\d+),topk=(\d+),path=(\w+),device_name=default\.json")


@lru_cache(maxsize=None)
def _default_shapes(path: str, root: Optional[str]) -> Tuple[Tuple[int, int], ...]:
    d = (Path(root) if root else LT.TABLE_DIR) / KERNEL
    out = []
    for f in sorted(d.glob("*,device_name=default.json")) if d.is_dir() else []:
        m = _SHAPE_RE.fullmatch(f.name)
        if m and m.group(3) == path:
            out.append((int(m.group(1)), int(m.group(2))))
    return tuple(out)


@lru_cache(maxsize=None)
def _nearest_shape(E: int, topk: int, path: str, root: Optional[str]) -> Optional[str]:
    shapes = _default_shapes(path, root)
    if not shapes:
        return None
    e2, k2 = min(shapes, key=lambda s: (s[1] != topk, abs(s[1] - topk), abs(math.log2(s[0] / E)), s[0]))
    key = shape_key(e2, k2, path)
    logger.info("dsv4 MoE: no launch table for %s; using the one for %s", shape_key(E, topk, path), key)
    return key


def _from_entry(entry: dict, where) -> dict:
    missing = [k for k in _TABLE_KEYS if k not in entry]
    if missing:
        raise LT.TableError(f"{where}: an entry lacks {', '.join(missing)}")
    vals = {k: entry[k] for k in _TABLE_KEYS}
    if vals["align"] not in ALIGN_MODES:
        raise LT.TableError(f"{where}: align {vals['align']!r} is not one of {', '.join(ALIGN_MODES)}")
    for k in _TABLE_KEYS[:-1]:
        if not isinstance(vals[k], int) or vals[k] <= 0:
            raise LT.TableError(f"{where}: {k} must be a positive integer, got {vals[k]!r}")
    return vals


def parse_entry(text: str, source: str = "launch") -> dict:
    """``"BM=16,BN1=32,BK1=256,BN2=64,BK2=256,warps1=4,warps2=4,stages=3,align=inkernel"`` -> a complete table
    entry (the text a launch sweep records as a candidate); a missing, unknown or invalid key raises
    :class:`~dsv4_sm120.launch_tables.TableError` naming ``source``."""
    entry = {}
    for item in (x.strip() for x in str(text).split(",")):
        if not item:
            continue
        k, sep, v = (x.strip() for x in item.partition("="))
        if not sep or k not in _TABLE_KEYS:
            raise LT.TableError(f"{source}: expected key=value items with keys {', '.join(_TABLE_KEYS)}, "
                                f"got {item!r}")
        try:
            entry[k] = v if k == "align" else int(v)
        except ValueError:
            raise LT.TableError(f"{source}: {k} needs an integer, got {v!r}") from None
    return _from_entry(entry, source)


def lookup_table(M: int, topk: int, E: int, path: str, device_name: str = LT.DEFAULT_DEVICE,
                 capability: Optional[Tuple[int, int]] = None, root=None) -> Tuple[dict, "LT.Lookup"]:
    """The table entry for ``M`` tokens (tiles as stored, before :func:`legal_bk`) and where it came from."""
    root_s = str(root) if root else None
    shape = shape_key(E, topk, path)
    hit = LT.lookup(KERNEL, shape, M, device_name, capability, root)
    if hit is None:
        near = _nearest_shape(int(E), int(topk), path, root_s)
        hit = LT.lookup(KERNEL, near, M, device_name, capability, root) if near else None
    if hit is None:
        raise LT.TableError(f"no MoE launch table for path {path} under {(root or LT.TABLE_DIR)}/{KERNEL}: "
                            "the package is incomplete; reinstall the overlay")
    return _from_entry(hit.config, f"launch table {hit.path}"), hit


def choose_config(M: int, topk: int, E: int, H: int, I: int, path: str, *,
                  device_name: str = LT.DEFAULT_DEVICE, capability: Optional[Tuple[int, int]] = None,
                  interpreting: bool = False, portable_decode: bool = False, root=None) -> Config:
    """The launch for ``M`` tokens x ``topk`` experts over ``E`` experts, hidden ``H``, intermediate ``I``.
    Memoized (the MoE asks once per layer and call): a table edited while a process runs is seen by shapes
    and token counts that process has not launched yet."""
    return _choose(int(M), int(topk), int(E), int(H), int(I), path, device_name,
                   tuple(capability) if capability is not None else None, bool(interpreting),
                   bool(portable_decode), root)


@lru_cache(maxsize=4096)
def _choose(M, topk, E, H, I, path, device_name, capability, interpreting, portable_decode, root) -> Config:
    deq = 0 if (interpreting or portable_decode) else 3
    if interpreting:
        t = dict(INTERPRETER_TILES)
        t["BK1"], t["BK2"] = legal_bk(H, t["BK1"]), legal_bk(I, t["BK2"])
        return Config(**t, deq=deq, align=interpreter_align(M * topk))
    vals, _ = lookup_table(M, topk, E, path, device_name, capability, root)
    cfg = Config(**vals, deq=deq)
    return replace(cfg, BK1=legal_bk(H, cfg.BK1), BK2=legal_bk(I, cfg.BK2))
