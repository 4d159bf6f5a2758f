"""The source checkpoint: its config, index and shard headers, its routed-expert projections (validated as
MXFP4), the check of every expert scale value before anything is written, reads of its tensors, and its
fingerprint (what a resumed run must match)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from dsv4_sm120.safetensors_index import ShardHeader, TensorInfo, scan_checkpoint

from .console import Progress, human, log
from .layout import CONFIG_FILE, DSV4_ARCHS, DSV4_MODEL_TYPES, EXPERT_RE, ConvertError
from .safetensors_io import lazy_torch, load_json, read_tensor


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


def load_source(src: Path) -> Source:
    """Read and check SRC's config, index and every shard header; refuse anything but a DeepSeek-V4 MXFP4
    checkpoint."""
    if not src.exists():
        raise ConvertError(f"SRC {src} does not exist")
    if not src.is_dir():
        raise ConvertError(f"SRC {src} is not a directory")
    config, config_raw = load_json(src / CONFIG_FILE, "config.json")
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


def source_fingerprint(source: Source) -> str:
    """sha256 of SRC's config, index and every shard's name, size and header bytes."""
    h = hashlib.sha256()
    h.update(source.config_raw)
    h.update(source.index_raw)
    for fn, hdr in sorted(source.headers.items()):
        h.update(fn.encode())
        h.update(str(hdr.file_size).encode())
        with open(hdr.path, "rb") as f:
            h.update(f.read(hdr.data_start))
    return h.hexdigest()


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
        w, s = _check_mxfp4_pair(source, f"{key[0]}.{key[1]}", d.get("weight"), d.get("scale"))
        out[key] = ExpertProj(key[0], key[1], kinds[key], w, s)
    for (base, proj), ep in out.items():
        sib = ep.sibling
        if sib and not ep.is_mtp and (base, sib) not in out:
            raise ConvertError(f"{base}.{proj} has no {sib}: w1 and w3 must both be present")
    return out


def _check_mxfp4_pair(source: Source, name: str, w: Optional[TensorInfo],
                      s: Optional[TensorInfo]) -> Tuple[TensorInfo, TensorInfo]:
    # one projection's weight and scale: both present, packed e2m1 + E8M0 (or F32) dtypes, shapes of one
    # scale per 32 elements
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
    return w, s


class SourceReader:
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


def e8m0_bytes(t, ti: TensorInfo):
    """Scale tensor as raw E8M0 bytes; F32 scales must be exact powers of two."""
    torch = lazy_torch()
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
    log(f"checking {n} expert scale tensors ({human(total)}) before writing anything", quiet)
    bar = Progress(total, progress and not quiet and total > 0, desc="check scales")
    try:
        for fn in sorted(by_shard):
            hdr = source.headers[fn]
            with open(hdr.path, "rb") as f:
                for ti in sorted(by_shard[fn], key=lambda t: t.begin):
                    _check_scale_tensor(f, fn, hdr, ti)
                    bar(ti.nbytes)
    finally:
        bar.close()
    return n


def _check_scale_tensor(f, fn: str, hdr: ShardHeader, ti: TensorInfo) -> None:
    # one scale tensor of the open shard f: F32 through e8m0_bytes, E8M0 bytes searched for the NaN code
    cols = ti.shape[-1] if ti.shape and ti.shape[-1] else 1
    if ti.dtype == "F32":
        try:
            e8m0_bytes(read_tensor(f, hdr, ti.name), ti)
        except ConvertError as e:
            raise ConvertError(f"{fn}: {e}") from None
        return
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
