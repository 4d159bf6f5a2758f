"""Convert a DeepSeek-V4-Flash checkpoint's MXFP4 routed experts to NVFP4.

Usage: ``python -m dsv4_sm120.convert_nvfp4 SRC_DIR DST_DIR [options]``

Over 800 lines on purpose: the streaming, resumable conversion (plan, validation of every scale before a write,
per-shard conversion with its journal, verification, report) shares one plan and one journal format; the
number format lives in ``nvfp4.py`` and safetensors headers in ``safetensors_index.py``.

SRC_DIR is the released checkpoint (config.json, model.safetensors.index.json,
safetensors shards; routed experts ``layers.{i}.ffn.experts.{e}.w{1,2,3}.weight``
packed e2m1 (I8/U8) + ``.scale`` E8M0 per 32). DST_DIR receives a checkpoint in
the hybrid FP8 + NVFP4 layout SGLang 0.5.23 auto-detects (the layout of
nvidia/DeepSeek-V4-Flash-NVFP4): per main-model routed expert ``weight`` U8,
``weight_scale`` F8_E4M3 per 16, ``weight_scale_2`` F32 scalar, ``input_scale``
F32 scalar, and ``quantization_config`` gaining ``quant_algo: MIXED_PRECISION``,
``moe_quant_algo: NVFP4``, ``group_size: 16``. Everything else, including the
MTP (``mtp.*``) draft experts, which SGLang 0.5.23 loads as MXFP4 in this
format, is carried over byte for byte.

Numerics: the closed form of :mod:`dsv4_sm120.nvfp4` (nibbles verbatim, one
global scale per expert shared by w1 and w3, E4M3 block scale 2^(k-m)):
bit-exact for every block within 17 binades of its tensor's largest;
blocks further below are clamped, counted and reported with their error.

Operation: first every shard header is checked against the index and every
expert scale tensor is read and checked (NaN, F32 non-powers of two), so a
damaged source is refused before anything is written; then one shard at a
time, streamed tensor by tensor (peak memory is a few hundred MB whatever the
shard size); every file is written to a temporary name and renamed; a rerun skips shards already finished after checking them
(size + sha256 recorded when written); SRC is only ever read. Exit codes: 0 ok,
1 verification found a difference, 2 refused (bad input, no space, ...).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import struct
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from dsv4_sm120.safetensors_index import (
    DTYPE_SIZE,
    INDEX_FILE,
    CheckpointError,
    ShardHeader,
    TensorInfo,
    numel,
    read_header,
    scan_checkpoint,
)

FORMAT_VERSION = 1
STATE_DIR = ".dsv4_sm120_convert"
STATE_FILE = "state.json"
REPORT_FILE = "dsv4_sm120_nvfp4_report.json"
CONFIG_FILE = "config.json"
NVFP4_GROUP = 16
COPY_CHUNK = 64 << 20
# E4M3 normal range of block scales: amax 448 * 6 * s down to 2^-6 * 6 * s.
_A_OVER_S = 448.0 * 6.0

DSV4_ARCHS = ("DeepseekV4ForCausalLM",)
DSV4_MODEL_TYPES = ("deepseek_v4",)

# Routed-expert tensor names of the released checkpoint (MTP layers included).
EXPERT_RE = re.compile(
    r"^(?P<base>(?P<kind>layers|mtp)\.(?P<layer>\d+)\.ffn\.experts\.(?P<expert>\d+))"
    r"\.(?P<proj>w[123])\.(?P<field>weight|scale)$"
)

# Checkpoint-name globs of what stays FP8 / MXFP4; SGLang only consults this for
# FusedMoE prefixes (model.layers.{i}.mlp.experts must not match) and adds
# model.decoder.* (the MTP draft experts) itself.
NVFP4_IGNORE = [
    "*.attn.*",
    "*.ffn.shared_experts.*",
    "*.ffn.gate",
    "mtp.*",
    "embed",
    "head",
]

# A refusal with a one-line message for the user (exit code 2): the class the shared
# safetensors header reader raises, so its refusals need no translation.
ConvertError = CheckpointError


# --------------------------------------------------------------------------
# safetensors, read and written by hand so both stream with bounded memory
# (headers: dsv4_sm120.safetensors_index, shared with the serving preflight)
# --------------------------------------------------------------------------


def _torch():
    import torch

    return torch


def read_tensor(f, hdr: ShardHeader, name: str):
    """Read one tensor from an open shard as a torch tensor (F8_E8M0 as uint8)."""
    torch = _torch()
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


@dataclass
class OutTensor:
    name: str
    dtype: str
    shape: Tuple[int, ...]
    # ("carry", src_name) or ("expert", base, proj, field)
    source: Tuple

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * DTYPE_SIZE[self.dtype]


def build_header(tensors: List[OutTensor], metadata: Optional[Dict[str, str]]) -> bytes:
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
        _fsync_dir(self.final.parent)
        return self.h.hexdigest(), self.size

    def abort(self) -> None:
        try:
            self.f.close()
        except OSError:
            pass


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _atomic_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.partial")
    shutil.copyfile(src, tmp)
    shutil.copymode(src, tmp)
    os.replace(tmp, dst)


def _tensor_bytes(t) -> memoryview:
    torch = _torch()
    t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# --------------------------------------------------------------------------
# Source checkpoint
# --------------------------------------------------------------------------


@dataclass
class Source:
    root: Path
    config: dict
    config_raw: bytes
    weight_map: Dict[str, str]  # tensor -> shard file name
    index_meta: dict
    headers: Dict[str, ShardHeader]  # shard file name -> header
    index_raw: bytes

    def info(self, name: str) -> TensorInfo:
        return self.headers[self.weight_map[name]].tensors[name]


def _load_json(path: Path, what: str) -> Tuple[dict, bytes]:
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


def load_source(src: Path) -> Source:
    if not src.exists():
        raise ConvertError(f"SRC {src} does not exist")
    if not src.is_dir():
        raise ConvertError(f"SRC {src} is not a directory")
    config, config_raw = _load_json(src / CONFIG_FILE, "config.json")
    archs = config.get("architectures") or []
    if not (set(archs) & set(DSV4_ARCHS) or config.get("model_type") in DSV4_MODEL_TYPES):
        raise ConvertError(
            f"{src} is not a DeepSeek-V4 checkpoint (architectures={archs}, "
            f"model_type={config.get('model_type')!r}); this converter only handles "
            "DeepSeek-V4(-Flash) MXFP4 checkpoints"
        )
    qc = config.get("quantization_config") or {}
    if str(qc.get("moe_quant_algo", "")).upper() == "NVFP4" or str(qc.get("quant_algo", "")).upper() == "MIXED_PRECISION":
        raise ConvertError(f"{src} is already a hybrid FP8+NVFP4 checkpoint (quantization_config says so)")
    ck, problems = scan_checkpoint(src, max_problems=1)
    if problems:
        raise ConvertError("; ".join(problems))
    return Source(src, config, config_raw, ck.weight_map, ck.index_meta, ck.headers, ck.index_raw)


@dataclass
class ExpertProj:
    base: str  # layers.{i}.ffn.experts.{e}
    proj: str  # w1 | w2 | w3
    is_mtp: bool
    weight: TensorInfo
    scale: TensorInfo

    @property
    def sibling(self) -> Optional[str]:
        return {"w1": "w3", "w3": "w1"}.get(self.proj)


def find_experts(source: Source) -> Dict[Tuple[str, str], ExpertProj]:
    """Every routed-expert projection, validated as MXFP4."""
    parts: Dict[Tuple[str, str], Dict[str, TensorInfo]] = {}
    kinds: Dict[Tuple[str, str], bool] = {}
    for name in source.weight_map:
        m = EXPERT_RE.match(name)
        if not m:
            if name.endswith((".weight_scale_2", ".weight_scale")) and ".experts." in name:
                raise ConvertError(f"{source.root} already holds NVFP4 expert tensors ({name})")
            continue
        key = (m["base"], m["proj"])
        parts.setdefault(key, {})[m["field"]] = source.info(name)
        kinds[key] = m["kind"] == "mtp"
    if not parts:
        raise ConvertError(
            f"{source.root} has no routed expert tensors named layers.{{i}}.ffn.experts.{{e}}.w{{1,2,3}}.weight: "
            "not a DeepSeek-V4 MXFP4 checkpoint"
        )
    out: Dict[Tuple[str, str], ExpertProj] = {}
    for key, d in sorted(parts.items()):
        name = f"{key[0]}.{key[1]}"
        w, s = d.get("weight"), d.get("scale")
        if w is None:
            raise ConvertError(f"{source.weight_map[s.name]}: {name}.scale has no {name}.weight")
        wfn = source.weight_map[w.name]
        if w.dtype == "F8_E4M3":
            raise ConvertError(
                f"{wfn}: {name}.weight is FP8 (F8_E4M3): the routed experts of this checkpoint are not MXFP4 "
                "(an FP8-converted checkpoint?); convert from the released MXFP4 checkpoint"
            )
        if w.dtype not in ("I8", "U8"):
            raise ConvertError(f"{wfn}: {name}.weight has dtype {w.dtype}; expected packed e2m1 as I8 or U8")
        if s is None:
            raise ConvertError(f"{wfn}: {name}.weight has no {name}.scale: not an MXFP4 checkpoint")
        sfn = source.weight_map[s.name]
        if s.dtype not in ("F8_E8M0", "U8", "F32"):
            raise ConvertError(f"{sfn}: {name}.scale has dtype {s.dtype}; expected E8M0 (F8_E8M0 / U8) or F32")
        if len(w.shape) != 2 or len(s.shape) != 2:
            raise ConvertError(f"{wfn}: {name}: expected 2-D weight and scale, got {list(w.shape)} and "
                               f"{list(s.shape)} ({name}.scale in {sfn})")
        n, kh = w.shape
        k = kh * 2
        if k % 32 or tuple(s.shape) != (n, k // 32):
            raise ConvertError(
                f"{sfn}: {name}.scale has shape {list(s.shape)}, which does not fit {name}.weight "
                f"{list(w.shape)} in {wfn} (MXFP4: one scale per 32 elements, expected [{n}, {k // 32}])"
            )
        out[key] = ExpertProj(key[0], key[1], kinds[key], w, s)
    for (base, proj), ep in out.items():
        sib = ep.sibling
        if sib and not ep.is_mtp and (base, sib) not in out:
            raise ConvertError(f"{base}.{proj} has no {sib}: w1 and w3 must both be present")
    return out


# --------------------------------------------------------------------------
# Activation (input) scales
# --------------------------------------------------------------------------


def default_input_scales(config: dict) -> Tuple[float, float]:
    """Uncalibrated defaults ``(w13, w2)``.

    ``input_scale = A / (448 * 6)`` where ``A`` is the activation magnitude
    that maps to the largest E4M3 block scale. w1/w3 (the MoE input, a
    normalized hidden state): A = 448. w2 (the SwiGLU output): with the
    config's ``swiglu_limit`` L the output is bounded by silu(L) * L, else
    A = 448 as well.
    """
    a13 = 448.0
    lim = config.get("swiglu_limit")
    try:
        lim = float(lim) if lim is not None else None
    except (TypeError, ValueError):
        lim = None
    if lim and lim > 0 and math.isfinite(lim):
        a2 = lim / (1.0 + math.exp(-lim)) * lim
    else:
        a2 = 448.0
    return a13 / _A_OVER_S, a2 / _A_OVER_S


@dataclass
class InputScales:
    w13: float
    w2: float
    per_tensor: Dict[str, float] = field(default_factory=dict)
    origin: str = "default"
    used_default: int = 0

    def get(self, base: str, proj: str) -> float:
        name = f"{base}.{proj}.input_scale"
        v = self.per_tensor.get(name)
        if v is None:
            self.used_default += 1
            return self.w2 if proj == "w2" else self.w13
        return v

    def fingerprint(self) -> str:
        d = json.dumps([self.w13, self.w2, sorted(self.per_tensor.items())]).encode()
        return hashlib.sha256(d).hexdigest()


def _check_scale(v, what: str) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ConvertError(f"{what}: input scale {v!r} is not a number") from None
    if not (f > 0 and math.isfinite(f)):
        raise ConvertError(f"{what}: input scale must be positive and finite, got {f}")
    return f


def load_input_scales(spec: Optional[str], config: dict) -> InputScales:
    """``spec`` None: defaults. A directory: an NVFP4 checkpoint whose routed
    experts carry ``input_scale``. A file: JSON ``{"w13": x, "w2": y,
    "tensors": {"layers.3.ffn.experts.0.w1.input_scale": z, ...}}`` (every
    key optional) or a flat ``{tensor name: value}`` map."""
    d13, d2 = default_input_scales(config)
    if spec is None:
        return InputScales(d13, d2)
    p = Path(spec)
    if p.is_dir():
        src_w = {}
        idx = p / INDEX_FILE
        if idx.exists():
            wm = _load_json(idx, INDEX_FILE)[0].get("weight_map") or {}
        else:
            wm = {}
            for fn in sorted(x.name for x in p.glob("*.safetensors")):
                for name in read_header(p / fn).tensors:
                    wm[name] = fn
        by_shard: Dict[str, List[str]] = {}
        for name, fn in wm.items():
            if name.endswith(".input_scale") and ".ffn.experts." in name:
                by_shard.setdefault(fn, []).append(name)
        if not by_shard:
            raise ConvertError(f"{p}: no routed-expert input_scale tensors found (not an NVFP4 checkpoint?)")
        for fn, names in sorted(by_shard.items()):
            hdr = read_header(p / fn)
            with open(p / fn, "rb") as f:
                for name in names:
                    t = read_tensor(f, hdr, name)
                    if t.numel() != 1:
                        raise ConvertError(f"{p}/{fn}: {name} is not a scalar")
                    src_w[name] = _check_scale(float(t.float().reshape(())), name)
        return InputScales(d13, d2, src_w, origin=f"checkpoint {p}")
    obj, _ = _load_json(p, "input-scale JSON")
    if "tensors" in obj or "w13" in obj or "w2" in obj:
        extra = set(obj) - {"w13", "w2", "tensors", "comment"}
        if extra:
            raise ConvertError(f"{p}: unknown keys {sorted(extra)}")
        tens = obj.get("tensors") or {}
        if not isinstance(tens, dict):
            raise ConvertError(f"{p}: 'tensors' must be an object")
        w13 = _check_scale(obj.get("w13", d13), f"{p}: w13")
        w2 = _check_scale(obj.get("w2", d2), f"{p}: w2")
    else:
        tens, w13, w2 = obj, d13, d2
    per = {}
    for k, v in tens.items():
        if not (k.endswith(".input_scale") and EXPERT_RE.match(k[: -len(".input_scale")] + ".weight")):
            raise ConvertError(f"{p}: {k!r} is not a routed-expert input_scale name")
        per[k] = _check_scale(v, k)
    return InputScales(w13, w2, per, origin=f"json {p}")


# --------------------------------------------------------------------------
# Plan
# --------------------------------------------------------------------------


@dataclass
class Plan:
    source: Source
    experts: Dict[Tuple[str, str], ExpertProj]
    shards: Dict[str, List[OutTensor]]  # output shard name -> tensors
    aux_files: List[Path]  # relative to SRC
    out_config: dict

    def shard_size(self, name: str) -> int:
        ts = self.shards[name]
        return len(build_header(ts, self.source.headers[name].metadata)) + sum(t.nbytes for t in ts)

    def total_size(self) -> int:
        return sum(self.shard_size(n) for n in self.shards)

    def weight_map(self) -> Dict[str, str]:
        return {t.name: fn for fn, ts in self.shards.items() for t in ts}


def output_config(config: dict) -> dict:
    cfg = json.loads(json.dumps(config))
    qc = dict(cfg.get("quantization_config") or {})
    qc.setdefault("quant_method", "fp8")
    qc["quant_algo"] = "MIXED_PRECISION"
    qc["moe_quant_algo"] = "NVFP4"
    qc["group_size"] = NVFP4_GROUP
    qc["ignore"] = list(NVFP4_IGNORE)
    cfg["quantization_config"] = qc
    return cfg


def _aux_files(src: Path) -> List[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel = Path(dirpath).relative_to(src)
        for fn in sorted(filenames):
            r = rel / fn
            if fn.startswith("."):
                continue
            if r.parent == Path(".") and (fn in (CONFIG_FILE, INDEX_FILE) or fn.endswith(".safetensors")):
                continue
            out.append(r)
    return out


def make_plan(source: Source) -> Plan:
    experts = find_experts(source)
    by_weight = {ep.weight.name: ep for ep in experts.values() if not ep.is_mtp}
    consumed = {ep.scale.name for ep in experts.values() if not ep.is_mtp}
    shards: Dict[str, List[OutTensor]] = {}
    for fn, hdr in sorted(source.headers.items()):
        outs: List[OutTensor] = []
        for t in hdr.ordered():
            if source.weight_map.get(t.name) != fn:
                continue  # not indexed: dropped, like any loader would
            if t.name in consumed:
                continue
            ep = by_weight.get(t.name)
            if ep is None:
                outs.append(OutTensor(t.name, t.dtype, t.shape, ("carry", t.name)))
                continue
            n, kh = ep.weight.shape
            pre = f"{ep.base}.{ep.proj}"
            src = ("expert", ep.base, ep.proj)
            outs += [
                OutTensor(f"{pre}.weight", "U8", (n, kh), src + ("weight",)),
                OutTensor(f"{pre}.weight_scale", "F8_E4M3", (n, kh * 2 // NVFP4_GROUP), src + ("weight_scale",)),
                OutTensor(f"{pre}.weight_scale_2", "F32", (), src + ("weight_scale_2",)),
                OutTensor(f"{pre}.input_scale", "F32", (), src + ("input_scale",)),
            ]
        shards[fn] = outs
    return Plan(source, experts, shards, _aux_files(source.root), output_config(source.config))


# --------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------


@dataclass
class Stats:
    tensors: int = 0
    blocks: int = 0
    out_of_range: int = 0
    lossy: int = 0
    max_abs_err: float = 0.0
    max_abs_err_tensor: str = ""
    max_rel_err: float = 0.0
    max_rel_err_tensor: str = ""

    def add(self, name: str, st) -> None:
        self.tensors += 1
        self.blocks += st.blocks
        self.out_of_range += st.out_of_range
        self.lossy += st.lossy
        if st.max_abs_err > self.max_abs_err:
            self.max_abs_err, self.max_abs_err_tensor = st.max_abs_err, name
        if st.max_rel_err > self.max_rel_err:
            self.max_rel_err, self.max_rel_err_tensor = st.max_rel_err, name

    def merge(self, o: "Stats") -> None:
        self.tensors += o.tensors
        self.blocks += o.blocks
        self.out_of_range += o.out_of_range
        self.lossy += o.lossy
        if o.max_abs_err > self.max_abs_err:
            self.max_abs_err, self.max_abs_err_tensor = o.max_abs_err, o.max_abs_err_tensor
        if o.max_rel_err > self.max_rel_err:
            self.max_rel_err, self.max_rel_err_tensor = o.max_rel_err, o.max_rel_err_tensor


class _Reader:
    """Open source shards on demand (at most a few file handles)."""

    def __init__(self, source: Source):
        self.source = source
        self.files: Dict[str, object] = {}

    def get(self, ti: TensorInfo):
        fn = self.source.weight_map[ti.name]
        f = self.files.get(fn)
        if f is None:
            if len(self.files) >= 4:
                for x in self.files.values():
                    x.close()
                self.files.clear()
            f = self.files[fn] = open(self.source.root / fn, "rb")
        return read_tensor(f, self.source.headers[fn], ti.name)

    def close(self) -> None:
        for x in self.files.values():
            x.close()
        self.files.clear()


def _e8m0_bytes(t, ti: TensorInfo):
    """Scale tensor as raw E8M0 bytes; F32 scales must be exact powers of two."""
    torch = _torch()
    if ti.dtype in ("F8_E8M0", "U8"):
        return t.view(torch.uint8)
    m, e = torch.frexp(t.float())
    ok = (m == 0.5) & (e - 1 >= -127) & (e - 1 <= 127)
    if not bool(ok.all()):
        raise ConvertError(f"{ti.name}: F32 scales are not all powers of two in 2^-127..2^127")
    return (e - 1 + 127).to(torch.uint8)


_E8M0_NAN = b"\xff"


def check_expert_scales(source: Source, experts: Dict[Tuple[str, str], ExpertProj], quiet: bool = False,
                        progress: bool = True) -> int:
    """Read every routed-expert scale tensor (main-model and MTP) and refuse a bad value before
    anything is written: E8M0 0xFF (NaN), or F32 scales that are not powers of two in
    2^-127..2^127. Reads only the scale tensors (1/16 of the expert bytes), shard by shard in
    file order. Returns how many were checked."""
    by_shard: Dict[str, List[TensorInfo]] = {}
    for ep in experts.values():
        by_shard.setdefault(source.weight_map[ep.scale.name], []).append(ep.scale)
    n = sum(len(v) for v in by_shard.values())
    total = sum(ti.nbytes for v in by_shard.values() for ti in v)
    _log(f"checking {n} expert scale tensors ({_human(total)}) before writing anything", quiet)
    bar = _Progress(total, progress and not quiet and total > 0, desc="check scales")
    try:
        for fn in sorted(by_shard):
            hdr = source.headers[fn]
            with open(hdr.path, "rb") as f:
                for ti in sorted(by_shard[fn], key=lambda t: t.begin):
                    cols = ti.shape[-1] if ti.shape and ti.shape[-1] else 1
                    if ti.dtype == "F32":
                        try:
                            _e8m0_bytes(read_tensor(f, hdr, ti.name), ti)
                        except ConvertError as e:
                            raise ConvertError(f"{fn}: {e}") from None
                    else:
                        f.seek(hdr.data_start + ti.begin)
                        buf = f.read(ti.nbytes)
                        if len(buf) != ti.nbytes:
                            raise ConvertError(f"{fn}: {ti.name}: short read (the file shrank while being read?)")
                        i = buf.find(_E8M0_NAN)
                        if i >= 0:
                            raise ConvertError(
                                f"{fn}: {ti.name} holds the E8M0 NaN encoding 0xFF at [{i // cols}, {i % cols}] "
                                f"({buf.count(_E8M0_NAN)} such byte(s) in that tensor): the source shard is damaged; "
                                "re-download it")
                    bar(ti.nbytes)
    finally:
        bar.close()
    return n


def convert_expert(reader: _Reader, plan: Plan, base: str, proj: str, scales: InputScales):
    """-> dict of the four output tensors and nvfp4.ConversionStats."""
    torch = _torch()
    from dsv4_sm120 import nvfp4

    ep = plan.experts[(base, proj)]
    s = _e8m0_bytes(reader.get(ep.scale), ep.scale)
    sib = ep.sibling
    try:
        if sib:
            sp = plan.experts[(base, sib)]
            m = nvfp4.mxfp4_global_exponent(s, _e8m0_bytes(reader.get(sp.scale), sp.scale))
        else:
            m = nvfp4.mxfp4_global_exponent(s)
        w = reader.get(ep.weight).view(torch.uint8)
        ow, osc, os2, st = nvfp4.mxfp4_to_nvfp4(w, s, m)
    except ValueError as e:
        # check_expert_scales refuses such input up front; a shard changed since then gets here
        raise ConvertError(f"{base}.{proj}: {e} (the source changed during the conversion?)") from None
    out = {
        "weight": ow,
        "weight_scale": osc,
        "weight_scale_2": os2.reshape(()),
        "input_scale": torch.tensor(scales.get(base, proj), dtype=torch.float32),
    }
    return out, st


def _copy_range(src_f, start: int, n: int, writer: ShardWriter) -> None:
    src_f.seek(start)
    while n:
        b = src_f.read(min(COPY_CHUNK, n))
        if not b:
            raise ConvertError(f"{src_f.name}: unexpected end of file")
        writer.write(b)
        n -= len(b)


def convert_shard(plan: Plan, fn: str, dst: Path, scales: InputScales,
                  progress: Optional[Callable[[int], None]] = None,
                  fault: Optional[Callable[[str, int], None]] = None) -> Tuple[str, int, Stats]:
    src = plan.source
    hdr = src.headers[fn]
    tensors = plan.shards[fn]
    tmp = dst / f".{fn}.partial"
    writer = ShardWriter(tmp, dst / fn, tensors, hdr.metadata)
    reader = _Reader(src)
    stats = Stats()
    cache: Tuple[Optional[Tuple[str, str]], Optional[dict]] = (None, None)
    ok = False
    try:
        with open(src.root / fn, "rb") as sf:
            for i, t in enumerate(tensors):
                if fault:
                    fault(fn, i)
                writer.begin(t.name)
                if t.source[0] == "carry":
                    ti = hdr.tensors[t.source[1]]
                    _copy_range(sf, hdr.data_start + ti.begin, ti.nbytes, writer)
                else:
                    _, base, proj, fld = t.source
                    if cache[0] != (base, proj):
                        out, st = convert_expert(reader, plan, base, proj, scales)
                        stats.add(f"{base}.{proj}.weight", st)
                        cache = ((base, proj), out)
                    writer.write(_tensor_bytes(cache[1][fld]))
                if progress:
                    progress(t.nbytes)
        sha, size = writer.commit()
        ok = True
    finally:
        reader.close()
        if not ok:
            writer.abort()
    return sha, size, stats


# --------------------------------------------------------------------------
# State, resume, disk space
# --------------------------------------------------------------------------


def source_fingerprint(source: Source) -> str:
    h = hashlib.sha256()
    h.update(source.config_raw)
    h.update(source.index_raw)
    for fn, hdr in sorted(source.headers.items()):
        h.update(fn.encode())
        h.update(str(hdr.file_size).encode())
        with open(hdr.path, "rb") as f:
            h.update(f.read(hdr.data_start))
    return h.hexdigest()


def options_fingerprint(scales: InputScales) -> str:
    from dsv4_sm120 import __version__

    return hashlib.sha256(json.dumps([FORMAT_VERSION, __version__, scales.fingerprint()]).encode()).hexdigest()


def _sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while True:
            b = f.read(COPY_CHUNK)
            if not b:
                return h.hexdigest()
            h.update(b)


def _free_bytes(p: Path) -> int:
    q = p
    while not q.exists():
        q = q.parent
    return shutil.disk_usage(q).free


def _is_within(a: Path, b: Path) -> bool:
    try:
        a.relative_to(b)
        return True
    except ValueError:
        return False


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


class _Progress:
    def __init__(self, total: int, enabled: bool, desc: str = "convert"):
        self.bar = None
        self.enabled = enabled
        self.total, self.done, self.last = total, 0, 0.0
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                                desc=desc, file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def __call__(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and time.monotonic() - self.last > 2:
            self.last = time.monotonic()
            print(f"  {100 * self.done / max(self.total, 1):5.1f}%  {_human(self.done)} / {_human(self.total)}",
                  file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _log(msg: str, quiet: bool = False) -> None:
    if not quiet:
        print(msg, file=sys.stderr)


@dataclass
class Result:
    converted: List[str]
    skipped: List[str]
    stats: Stats
    verify: Optional[dict] = None
    dst: Optional[Path] = None


def convert(src: Path, dst: Path, input_scales: Optional[str] = None, verify: bool = False,
            dry_run: bool = False, quick_resume: bool = False, progress: bool = True,
            quiet: bool = False, min_free_margin: int = 256 << 20,
            _fault: Optional[Callable[[str, int], None]] = None) -> Result:
    src = Path(src).resolve()
    dst = Path(dst).resolve()
    if src == dst or _is_within(dst, src):
        raise ConvertError(f"DST {dst} is SRC or inside it; the converter never writes into SRC")
    if _is_within(src, dst):
        raise ConvertError(f"SRC {src} is inside DST {dst}; pick a DST outside the source checkpoint")
    source = load_source(src)
    plan = make_plan(source)
    scales = load_input_scales(input_scales, source.config)
    src_fp = source_fingerprint(source)
    opt_fp = options_fingerprint(scales)

    n_main = sum(1 for e in plan.experts.values() if not e.is_mtp)
    n_mtp = len(plan.experts) - n_main
    total = plan.total_size()
    state_path = dst / STATE_DIR / STATE_FILE
    state = None
    if dst.exists():
        if not dst.is_dir():
            raise ConvertError(f"DST {dst} exists and is not a directory")
        if state_path.exists():
            state, _ = _load_json(state_path, "converter state")
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

    # Which shards are finished (checked), which are left.
    done: Dict[str, dict] = {}
    for fn in plan.shards:
        rec = state["shards"].get(fn)
        p = dst / fn
        if not rec or not p.is_file():
            continue
        want = plan.shard_size(fn)
        if p.stat().st_size != want or rec.get("size") != want:
            _log(f"resume: {fn} has the wrong size; converting it again", quiet)
            continue
        if quick_resume:
            try:
                h = read_header(p)
            except ConvertError:
                h = None
            planned = [(t.name, t.dtype, t.shape) for t in plan.shards[fn]]
            if h is None or [(t.name, t.dtype, t.shape) for t in h.ordered()] != planned:
                _log(f"resume: {fn} header differs from the plan; converting it again", quiet)
                continue
        elif _sha256_file(p) != rec.get("sha256"):
            _log(f"resume: {fn} does not match its recorded sha256; converting it again", quiet)
            continue
        done[fn] = rec
    todo = [fn for fn in plan.shards if fn not in done]
    need = sum(plan.shard_size(fn) for fn in todo)
    need += sum((src / r).stat().st_size for r in plan.aux_files)
    free = _free_bytes(dst)

    _log(f"source      {src}", quiet)
    _log(f"            {len(source.headers)} shards, {len(source.weight_map)} tensors; routed expert projections: "
         f"{n_main} converted to NVFP4, {n_mtp} MTP kept MXFP4", quiet)
    _log(f"destination {dst}  (output {_human(total)}; still to write {_human(need)}; free {_human(free)})", quiet)
    _log(f"input_scale {scales.origin}: w13 default {scales.w13:.6g}, w2 default {scales.w2:.6g}"
         + (f", {len(scales.per_tensor)} per-tensor values" if scales.per_tensor else ""), quiet)
    if done:
        _log(f"resume: {len(done)} finished shard(s) checked and kept, {len(todo)} to convert", quiet)
    if not dry_run and need + min_free_margin > free:
        raise ConvertError(
            f"not enough free space under {dst}: need {_human(need)} (+{_human(min_free_margin)} margin), "
            f"free {_human(free)}")
    # Every scale value, before the first write: a damaged source is refused with DST untouched
    # (also a partial DST from an earlier run), not after hours of converted shards.
    check_expert_scales(source, plan.experts, quiet=quiet, progress=progress)
    if dry_run:
        _log(f"dry run: {len(todo)} shard(s) would be converted; nothing written", quiet)
        return Result([], sorted(done), Stats(), dst=dst)

    (dst / STATE_DIR).mkdir(parents=True, exist_ok=True)
    _save_state(state_path, state)
    todo_bytes = sum(sum(t.nbytes for t in plan.shards[fn]) for fn in todo)
    bar = _Progress(todo_bytes, progress and not quiet and todo_bytes > 0)
    stats = Stats()
    converted = []
    try:
        for fn in todo:
            sha, size, st = convert_shard(plan, fn, dst, scales, progress=bar, fault=_fault)
            state["shards"][fn] = {"size": size, "sha256": sha, "stats": asdict(st)}
            _save_state(state_path, state)
            converted.append(fn)
    finally:
        bar.close()
    for fn in plan.shards:
        stats.merge(Stats(**state["shards"][fn]["stats"]))

    # Everything else, then config and index last: a DST is loadable only when complete.
    for r in plan.aux_files:
        d = dst / r
        s = src / r
        if not (d.is_file() and d.stat().st_size == s.stat().st_size and _sha256_file(d) == _sha256_file(s)):
            _atomic_copy(s, d)
    report = {
        "converter": "dsv4_sm120.convert_nvfp4",
        "format_version": FORMAT_VERSION,
        "source": str(src),
        "nvfp4_expert_projections": n_main,
        "mtp_expert_projections_kept_mxfp4": n_mtp,
        "input_scale": {"origin": scales.origin, "w13_default": scales.w13, "w2_default": scales.w2,
                        "per_tensor_values": len(scales.per_tensor)},
        "blocks": stats.blocks,
        "out_of_range_blocks": stats.out_of_range,
        "lossy_blocks": stats.lossy,
        "max_abs_err": stats.max_abs_err,
        "max_abs_err_tensor": stats.max_abs_err_tensor,
        "max_rel_err": stats.max_rel_err,
        "max_rel_err_tensor": stats.max_rel_err_tensor,
        "shards": {fn: {"sha256": state["shards"][fn]["sha256"], "size": state["shards"][fn]["size"]}
                   for fn in plan.shards},
    }
    _atomic_write_bytes(dst / REPORT_FILE, (json.dumps(report, indent=2) + "\n").encode())
    _atomic_write_bytes(dst / CONFIG_FILE, (json.dumps(plan.out_config, indent=2) + "\n").encode())
    index = {"metadata": {**{k: v for k, v in source.index_meta.items() if k != "total_size"},
                          "total_size": sum(t.nbytes for ts in plan.shards.values() for t in ts)},
             "weight_map": dict(sorted(plan.weight_map().items()))}
    _atomic_write_bytes(dst / INDEX_FILE, (json.dumps(index, indent=2) + "\n").encode())
    state["complete"] = True
    _save_state(state_path, state)

    _log(f"converted {len(converted)} shard(s), kept {len(done)}; {stats.tensors} expert tensors, "
         f"{stats.blocks} blocks", quiet)
    if stats.out_of_range:
        _log(f"WARNING: {stats.out_of_range} block(s) out of the exact range were clamped "
             f"({stats.lossy} changed value); max abs error {stats.max_abs_err:.6g} in "
             f"{stats.max_abs_err_tensor}, max rel error {stats.max_rel_err:.3g} in {stats.max_rel_err_tensor}",
             quiet)
    else:
        _log("all blocks in range: the NVFP4 experts are bit-exact", quiet)
    res = Result(converted, sorted(done), stats, dst=dst)
    if verify:
        res.verify = verify_conversion(src, dst, plan=plan, quiet=quiet, progress=progress)
    return res


def _save_state(path: Path, state: dict) -> None:
    _atomic_write_bytes(path, (json.dumps(state, indent=1) + "\n").encode())


# --------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------


def verify_conversion(src: Path, dst: Path, plan: Optional[Plan] = None, quiet: bool = False,
                      progress: bool = True) -> dict:
    """Dequantize every converted expert from SRC and DST and compare; check
    every carried tensor byte for byte and the config/index. Returns a summary;
    ``ok`` is False on any difference other than reported out-of-range blocks."""
    torch = _torch()
    from dsv4_sm120 import nvfp4

    src, dst = Path(src).resolve(), Path(dst).resolve()
    if plan is None:
        plan = make_plan(load_source(src))
        check_expert_scales(plan.source, plan.experts, quiet=quiet, progress=progress)
    source = plan.source
    problems: List[str] = []
    out_cfg, _ = _load_json(dst / CONFIG_FILE, "DST config.json")
    if out_cfg != plan.out_config:
        problems.append("config.json differs from the expected output config")
    idx, _ = _load_json(dst / INDEX_FILE, f"DST {INDEX_FILE}")
    if idx.get("weight_map") != plan.weight_map():
        problems.append(f"{INDEX_FILE} weight_map differs from the plan")
    reader = _Reader(source)
    out_map = plan.weight_map()
    dst_headers: Dict[str, ShardHeader] = {}

    def dst_scalar(name: str):
        fn = out_map[name]
        if fn not in dst_headers:
            dst_headers[fn] = read_header(dst / fn)
        with open(dst / fn, "rb") as f:
            return read_tensor(f, dst_headers[fn], name)

    exact = inexact = 0
    oor_blocks = 0
    max_err = 0.0
    carried = 0
    bar = _Progress(sum(len(ts) for ts in plan.shards.values()), progress and not quiet)
    try:
        for fn, ts in plan.shards.items():
            h = read_header(dst / fn)
            if [(t.name, t.dtype, t.shape) for t in h.ordered()] != [(t.name, t.dtype, t.shape) for t in ts]:
                problems.append(f"{fn}: tensors differ from the plan")
                continue
            with open(dst / fn, "rb") as df, open(source.root / fn, "rb") as sf:
                for t in ts:
                    bar(1)
                    if t.source[0] == "carry":
                        si = source.headers[fn].tensors[t.source[1]]
                        di = h.tensors[t.name]
                        if not _same_bytes(sf, source.headers[fn].data_start + si.begin,
                                           df, h.data_start + di.begin, si.nbytes if si.nbytes == di.nbytes else -1):
                            problems.append(f"{t.name}: carried tensor differs from SRC")
                        carried += 1
                        continue
                    _, base, proj, fld = t.source
                    if fld != "weight":
                        continue
                    pre = f"{base}.{proj}"
                    ep = plan.experts[(base, proj)]
                    sw = reader.get(ep.weight).view(torch.uint8)
                    ss = _e8m0_bytes(reader.get(ep.scale), ep.scale)
                    w = read_tensor(df, h, f"{pre}.weight")
                    sc = read_tensor(df, h, f"{pre}.weight_scale")
                    s2 = read_tensor(df, h, f"{pre}.weight_scale_2")
                    isc = read_tensor(df, h, f"{pre}.input_scale")
                    if not (float(isc) > 0 and math.isfinite(float(isc))):
                        problems.append(f"{pre}.input_scale is not positive and finite")
                    sib = ep.sibling
                    if sib and float(dst_scalar(f"{base}.{sib}.weight_scale_2")) != float(s2):
                        problems.append(f"{base}: w1 and w3 weight_scale_2 differ")
                    # float32 holds every product exactly unless a value can pass 2^128
                    # (e2m1 <= 6 = 1.5 * 2^2, so an exponent >= 126); then float64.
                    k = ss.to(torch.int32) - 127
                    dt = torch.float64 if ss.numel() and int(k.max()) >= 126 else torch.float32
                    ref = nvfp4.dequant_mxfp4(sw, ss, out_dtype=dt)
                    got = nvfp4.dequant_nvfp4(w, sc, s2.to(dt), out_dtype=dt)
                    ne = (got != ref).reshape(ref.shape[0], -1, 32).any(-1)
                    # Blocks whose source exponent is more than 17 below the
                    # tensor-pair maximum are the documented out-of-range ones.
                    m = int(round(math.log2(float(s2))))
                    oor = (k - m) < -9
                    bad = ne & ~oor
                    if bool(bad.any()):
                        problems.append(f"{pre}: {int(bad.sum())} in-range block(s) not bit-exact")
                        inexact += 1
                    else:
                        exact += 1
                    if bool(ne.any()):
                        max_err = max(max_err, float((got.double() - ref.double()).abs().max()))
                    oor_blocks += int(oor.sum())
    finally:
        bar.close()
        reader.close()
    res = {"ok": not problems, "experts_checked": exact + inexact, "experts_exact_in_range": exact,
           "out_of_range_blocks": oor_blocks, "max_abs_err": max_err, "carried_tensors_checked": carried,
           "problems": problems[:50], "n_problems": len(problems)}
    _log(f"verify: {exact + inexact} expert projections checked ({exact} bit-exact in range), "
         f"{carried} carried tensors checked, {oor_blocks} out-of-range blocks, max abs err {max_err:.6g}: "
         + ("OK" if not problems else f"{len(problems)} PROBLEM(S)"), quiet)
    for p in problems[:20]:
        _log(f"  - {p}", quiet)
    return res


def _same_bytes(fa, a: int, fb, b: int, n: int) -> bool:
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


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dsv4_sm120.convert_nvfp4",
        description="Convert DeepSeek-V4-Flash MXFP4 routed experts to NVFP4 (hybrid FP8+NVFP4 checkpoint "
                    "that SGLang 0.5.23 auto-detects). Bit-exact for every in-range block; streams one shard at "
                    "a time; resumable; never writes into SRC.",
        epilog="Exit codes: 0 ok, 1 --verify found a difference, 2 refused. See docs/nvfp4.md.",
    )
    ap.add_argument("src", metavar="SRC", help="source checkpoint directory (DeepSeek-V4-Flash, MXFP4 experts)")
    ap.add_argument("dst", metavar="DST", help="output directory (new or empty, or a previous partial run)")
    ap.add_argument("--input-scales", metavar="PATH", default=None,
                    help="activation scales: an NVFP4 checkpoint directory with routed-expert input_scale tensors, "
                         "or a JSON file ({\"w13\": x, \"w2\": y, \"tensors\": {name: value}}); default: the "
                         "uncalibrated bound documented in docs/nvfp4.md")
    ap.add_argument("--verify", action="store_true",
                    help="after converting, dequantize SRC and DST experts and compare all of them, and compare "
                         "every carried tensor byte for byte")
    ap.add_argument("--verify-only", action="store_true", help="only verify an existing DST")
    ap.add_argument("--dry-run", action="store_true", help="check SRC, plan, print sizes; write nothing")
    ap.add_argument("--quick-resume", action="store_true",
                    help="on a rerun, check finished shards by size and header only (default: sha256)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("-q", "--quiet", action="store_true", help="only errors")
    a = ap.parse_args(argv)
    try:
        if a.verify_only:
            r = verify_conversion(Path(a.src), Path(a.dst), quiet=a.quiet, progress=not a.no_progress)
            return 0 if r["ok"] else 1
        res = convert(Path(a.src), Path(a.dst), input_scales=a.input_scales, verify=a.verify,
                      dry_run=a.dry_run, quick_resume=a.quick_resume, progress=not a.no_progress, quiet=a.quiet)
        if res.verify is not None and not res.verify["ok"]:
            return 1
        return 0
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
