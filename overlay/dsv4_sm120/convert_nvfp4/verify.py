"""Verification of a converted DST against SRC (``--verify``, ``--verify-only``): every NVFP4 expert dequantized
and compared with its MXFP4 source, every carried tensor compared byte for byte, config and index compared
with the plan."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from dsv4_sm120.safetensors_index import ShardHeader, read_header

from .console import Progress, log
from .layout import CONFIG_FILE, INDEX_FILE
from .plan import Plan, make_plan
from .safetensors_io import OutTensor, lazy_torch, load_json, read_tensor, same_bytes
from .source import SourceReader, check_expert_scales, e8m0_bytes, load_source


@dataclass
class _Tally:
    exact: int = 0  # expert projections bit-exact in every in-range block
    inexact: int = 0
    oor_blocks: int = 0  # blocks below the exact range (17 binades under their tensor pair's largest)
    max_err: float = 0.0
    carried: int = 0
    problems: List[str] = field(default_factory=list)


class _DstScalars:
    """Scalar tensors of DST by name (for a projection's w1/w3 sibling, which may sit in another shard)."""

    def __init__(self, dst: Path, out_map: Dict[str, str]):
        self.dst, self.out_map = dst, out_map
        self.headers: Dict[str, ShardHeader] = {}

    def __call__(self, name: str):
        fn = self.out_map[name]
        if fn not in self.headers:
            self.headers[fn] = read_header(self.dst / fn)
        with open(self.dst / fn, "rb") as f:
            return read_tensor(f, self.headers[fn], name)


def verify_conversion(src: Path, dst: Path, plan: Optional[Plan] = None, quiet: bool = False,
                      progress: bool = True) -> dict:
    """Dequantize every converted expert from SRC and DST and compare; check
    every carried tensor byte for byte and the config/index. Returns a summary;
    ``ok`` is False on any difference other than reported out-of-range blocks."""
    src, dst = Path(src).resolve(), Path(dst).resolve()
    if plan is None:
        plan = make_plan(load_source(src))
        check_expert_scales(plan.source, plan.experts, quiet=quiet, progress=progress)
    tally = _Tally()
    out_cfg, _ = load_json(dst / CONFIG_FILE, "DST config.json")
    if out_cfg != plan.out_config:
        tally.problems.append("config.json differs from the expected output config")
    idx, _ = load_json(dst / INDEX_FILE, f"DST {INDEX_FILE}")
    if idx.get("weight_map") != plan.weight_map():
        tally.problems.append(f"{INDEX_FILE} weight_map differs from the plan")
    reader = SourceReader(plan.source)
    dst_scalar = _DstScalars(dst, plan.weight_map())
    bar = Progress(sum(len(ts) for ts in plan.shards.values()), progress and not quiet)
    try:
        for fn, ts in plan.shards.items():
            _verify_shard(plan, fn, ts, dst, reader, dst_scalar, tally, bar)
    finally:
        bar.close()
        reader.close()
    problems = tally.problems
    n = tally.exact + tally.inexact
    res = {"ok": not problems, "experts_checked": n, "experts_exact_in_range": tally.exact,
           "out_of_range_blocks": tally.oor_blocks, "max_abs_err": tally.max_err,
           "carried_tensors_checked": tally.carried, "problems": problems[:50], "n_problems": len(problems)}
    log(f"verify: {n} expert projections checked ({tally.exact} bit-exact in range), "
        f"{tally.carried} carried tensors checked, {tally.oor_blocks} out-of-range blocks, "
        f"max abs err {tally.max_err:.6g}: " + ("OK" if not problems else f"{len(problems)} PROBLEM(S)"), quiet)
    for p in problems[:20]:
        log(f"  - {p}", quiet)
    return res


def _verify_shard(plan: Plan, fn: str, ts: List[OutTensor], dst: Path, reader: SourceReader,
                  dst_scalar: _DstScalars, tally: _Tally, bar: Progress) -> None:
    # one output shard: its tensor list against the plan, then each carried tensor and each expert projection
    source = plan.source
    h = read_header(dst / fn)
    if [(t.name, t.dtype, t.shape) for t in h.ordered()] != [(t.name, t.dtype, t.shape) for t in ts]:
        tally.problems.append(f"{fn}: tensors differ from the plan")
        return
    with open(dst / fn, "rb") as df, open(source.root / fn, "rb") as sf:
        for t in ts:
            bar(1)
            if t.source[0] == "carry":
                sh = source.headers[fn]
                si = sh.tensors[t.source[1]]
                di = h.tensors[t.name]
                if not same_bytes(sf, sh.data_start + si.begin, df, h.data_start + di.begin,
                                  si.nbytes if si.nbytes == di.nbytes else -1):
                    tally.problems.append(f"{t.name}: carried tensor differs from SRC")
                tally.carried += 1
                continue
            _, base, proj, fld = t.source
            if fld == "weight":
                _verify_expert(plan, base, proj, df, h, reader, dst_scalar, tally)


def _verify_expert(plan: Plan, base: str, proj: str, df, h: ShardHeader, reader: SourceReader,
                   dst_scalar: _DstScalars, tally: _Tally) -> None:
    # one expert projection: its four DST tensors dequantized against the MXFP4 source, block by block
    torch = lazy_torch()
    from dsv4_sm120 import nvfp4

    pre = f"{base}.{proj}"
    ep = plan.experts[(base, proj)]
    sw = reader.get(ep.weight).view(torch.uint8)
    ss = e8m0_bytes(reader.get(ep.scale), ep.scale)
    w = read_tensor(df, h, f"{pre}.weight")
    sc = read_tensor(df, h, f"{pre}.weight_scale")
    s2 = read_tensor(df, h, f"{pre}.weight_scale_2")
    isc = read_tensor(df, h, f"{pre}.input_scale")
    if not (float(isc) > 0 and math.isfinite(float(isc))):
        tally.problems.append(f"{pre}.input_scale is not positive and finite")
    sib = ep.sibling
    if sib and float(dst_scalar(f"{base}.{sib}.weight_scale_2")) != float(s2):
        tally.problems.append(f"{base}: w1 and w3 weight_scale_2 differ")
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
        tally.problems.append(f"{pre}: {int(bad.sum())} in-range block(s) not bit-exact")
        tally.inexact += 1
    else:
        tally.exact += 1
    if bool(ne.any()):
        tally.max_err = max(tally.max_err, float((got.double() - ref.double()).abs().max()))
    tally.oor_blocks += int(oor.sum())
