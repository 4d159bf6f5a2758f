"""The conversion of one expert projection (MXFP4 -> the four NVFP4 tensors, :mod:`dsv4_sm120.nvfp4`) and of
one shard, streamed tensor by tensor into its output file; the statistics of the converted blocks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Tuple

from .input_scales import InputScales
from .layout import ConvertError
from .plan import Plan
from .safetensors_io import ShardWriter, copy_range, lazy_torch, tensor_bytes
from .source import SourceReader, e8m0_bytes


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
        """Count one converted tensor's ``nvfp4.ConversionStats``."""
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


def convert_expert(reader: SourceReader, plan: Plan, base: str, proj: str, scales: InputScales):
    """-> dict of the four output tensors and nvfp4.ConversionStats."""
    torch = lazy_torch()
    from dsv4_sm120 import nvfp4

    ep = plan.experts[(base, proj)]
    s = e8m0_bytes(reader.get(ep.scale), ep.scale)
    sib = ep.sibling
    try:
        if sib:
            sp = plan.experts[(base, sib)]
            m = nvfp4.mxfp4_global_exponent(s, e8m0_bytes(reader.get(sp.scale), sp.scale))
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


def convert_shard(plan: Plan, fn: str, dst: Path, scales: InputScales,
                  progress: Optional[Callable[[int], None]] = None,
                  fault: Optional[Callable[[str, int], None]] = None) -> Tuple[str, int, Stats]:
    """Write output shard ``fn`` under ``dst`` (temporary name, renamed when complete): carried tensors copied
    byte for byte, expert projections converted. ``progress`` gets each tensor's bytes; ``fault(fn, i)`` runs
    before tensor ``i`` (the tests' crash injection). Returns (sha256, size, stats)."""
    src = plan.source
    hdr = src.headers[fn]
    tensors = plan.shards[fn]
    tmp = dst / f".{fn}.partial"
    writer = ShardWriter(tmp, dst / fn, tensors, hdr.metadata)
    reader = SourceReader(src)
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
                    copy_range(sf, hdr.data_start + ti.begin, ti.nbytes, writer)
                else:
                    _, base, proj, fld = t.source
                    if cache[0] != (base, proj):
                        out, st = convert_expert(reader, plan, base, proj, scales)
                        stats.add(f"{base}.{proj}.weight", st)
                        cache = ((base, proj), out)
                    writer.write(tensor_bytes(cache[1][fld]))
                if progress:
                    progress(t.nbytes)
        sha, size = writer.commit()
        ok = True
    finally:
        reader.close()
        if not ok:
            writer.abort()
    return sha, size, stats
