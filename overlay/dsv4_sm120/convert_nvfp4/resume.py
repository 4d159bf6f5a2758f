"""The converter's journal in DST (``.dsv4_sm120_convert/state.json``): which source and options a DST belongs
to, which shards are finished (size + sha256 as written), and the checks a rerun makes before it keeps them."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Dict, Optional

from dsv4_sm120.safetensors_index import read_header

from .console import log
from .input_scales import InputScales
from .layout import FORMAT_VERSION, ConvertError
from .plan import Plan
from .safetensors_io import atomic_write_bytes, load_json, sha256_file


def options_fingerprint(scales: InputScales) -> str:
    """sha256 of what changes the output besides SRC: format version, package version, input scales."""
    from dsv4_sm120 import __version__

    return hashlib.sha256(json.dumps([FORMAT_VERSION, __version__, scales.fingerprint()]).encode()).hexdigest()


def open_state(dst: Path, state_path: Path, src: Path, src_fp: str, opt_fp: str) -> dict:
    """The journal of a DST that holds a conversion of this source with these options, or a new one for a new
    or empty DST; any other DST is refused."""
    state: Optional[dict] = None
    if dst.exists():
        if not dst.is_dir():
            raise ConvertError(f"DST {dst} exists and is not a directory")
        if state_path.exists():
            state, _ = load_json(state_path, "converter state")
            if state.get("src_fingerprint") != src_fp:
                raise ConvertError(
                    f"DST {dst} holds a conversion of a different source checkpoint; use an empty DST")
            if state.get("options_fingerprint") != opt_fp:
                raise ConvertError(
                    f"DST {dst} holds a conversion made with different options (input scales / converter "
                    "version); use an empty DST or rerun with the same options")
        elif any(p for p in dst.iterdir()):
            raise ConvertError(f"DST {dst} is not empty and holds no converter state; use an empty or new directory")
    if state is None:
        state = {"format": FORMAT_VERSION, "src": str(src), "src_fingerprint": src_fp,
                 "options_fingerprint": opt_fp, "shards": {}, "complete": False}
    return state


def finished_shards(plan: Plan, dst: Path, state: dict, quick_resume: bool, quiet: bool) -> Dict[str, dict]:
    """The journal records of the shards already in DST that a rerun keeps: the planned size, and the recorded
    sha256 (``quick_resume``: the planned header instead). Any other is converted again."""
    done: Dict[str, dict] = {}
    for fn in plan.shards:
        rec = state["shards"].get(fn)
        p = dst / fn
        if not rec or not p.is_file():
            continue
        want = plan.shard_size(fn)
        if p.stat().st_size != want or rec.get("size") != want:
            log(f"resume: {fn} has the wrong size; converting it again", quiet)
            continue
        if quick_resume:
            try:
                h = read_header(p)
            except ConvertError:
                h = None
            planned = [(t.name, t.dtype, t.shape) for t in plan.shards[fn]]
            if h is None or [(t.name, t.dtype, t.shape) for t in h.ordered()] != planned:
                log(f"resume: {fn} header differs from the plan; converting it again", quiet)
                continue
        elif sha256_file(p) != rec.get("sha256"):
            log(f"resume: {fn} does not match its recorded sha256; converting it again", quiet)
            continue
        done[fn] = rec
    return done


def save_state(path: Path, state: dict) -> None:
    atomic_write_bytes(path, (json.dumps(state, indent=1) + "\n").encode())


def free_bytes(p: Path) -> int:
    """Free bytes of the file system that holds ``p`` (or, when ``p`` does not exist yet, its nearest parent)."""
    q = p
    while not q.exists():
        q = q.parent
    return shutil.disk_usage(q).free
