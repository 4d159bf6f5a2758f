"""The conversion plan: every output shard's tensors in order (carried tensors and the four NVFP4 tensors of
each main-model expert projection), the other files to copy, and the output config."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

from .layout import CONFIG_FILE, INDEX_FILE, NVFP4_GROUP, output_config
from .safetensors_io import OutTensor, build_header
from .source import ExpertProj, Source, find_experts


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

    def expert_counts(self) -> Tuple[int, int]:
        """(main-model expert projections converted to NVFP4, MTP ones kept MXFP4)."""
        n_main = sum(1 for e in self.experts.values() if not e.is_mtp)
        return n_main, len(self.experts) - n_main


def _aux_files(src: Path) -> List[Path]:
    # every file of SRC but config, index and top-level shards (hidden files and directories skipped)
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
    """One output shard per source shard, its tensors in the source's order; a main-model expert projection's
    MXFP4 weight becomes its four NVFP4 tensors and its scale is dropped; tensors the index does not name
    are dropped."""
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
