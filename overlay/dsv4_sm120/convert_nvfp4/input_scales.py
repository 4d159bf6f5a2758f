"""Activation (``input_scale``) values of the NVFP4 experts: the uncalibrated defaults, or values read from an
NVFP4 checkpoint or a JSON file (``--input-scales``)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from dsv4_sm120.safetensors_index import read_header

from .layout import A_OVER_S, EXPERT_RE, INDEX_FILE, ConvertError
from .safetensors_io import load_json, read_tensor


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
    return a13 / A_OVER_S, a2 / A_OVER_S


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
        return InputScales(d13, d2, _scales_from_checkpoint(p), origin=f"checkpoint {p}")
    obj, _ = load_json(p, "input-scale JSON")
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


def _scales_from_checkpoint(p: Path) -> Dict[str, float]:
    # every routed-expert input_scale tensor of the NVFP4 checkpoint directory p (its index, else its shard
    # headers, say where they are)
    src_w = {}
    idx = p / INDEX_FILE
    if idx.exists():
        wm = load_json(idx, INDEX_FILE)[0].get("weight_map") or {}
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
    return src_w
