"""The whole conversion (:func:`convert`): plan, resume checks, free space, the scale check before the first
write, the shards one at a time with the journal updated after each, then the other files, the report, and
config and index last (a DST is loadable only when complete)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

from .console import Progress, human, log
from .input_scales import InputScales, load_input_scales
from .layout import CONFIG_FILE, FORMAT_VERSION, INDEX_FILE, REPORT_FILE, STATE_DIR, STATE_FILE, ConvertError
from .plan import Plan, make_plan
from .resume import finished_shards, free_bytes, open_state, options_fingerprint, save_state
from .safetensors_io import atomic_copy, atomic_write_bytes, sha256_file
from .shard_conversion import Stats, convert_shard
from .source import check_expert_scales, load_source, source_fingerprint
from .verify import verify_conversion


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
    """Convert the checkpoint SRC into DST (see the package docstring); a rerun on the same DST resumes.
    ``dry_run``: every check, nothing written. ``verify``: :func:`verify_conversion` afterwards, its summary in
    ``Result.verify``. ``_fault(shard, i)`` runs before each tensor written (the tests' crash injection).
    Refusals raise :class:`ConvertError`."""
    src, dst = _check_paths(Path(src).resolve(), Path(dst).resolve())
    source = load_source(src)
    plan = make_plan(source)
    scales = load_input_scales(input_scales, source.config)
    src_fp = source_fingerprint(source)
    opt_fp = options_fingerprint(scales)
    state_path = dst / STATE_DIR / STATE_FILE
    state = open_state(dst, state_path, src, src_fp, opt_fp)

    # Which shards are finished (checked), which are left.
    done = finished_shards(plan, dst, state, quick_resume, quiet)
    todo = [fn for fn in plan.shards if fn not in done]
    need = sum(plan.shard_size(fn) for fn in todo)
    need += sum((src / r).stat().st_size for r in plan.aux_files)
    free = free_bytes(dst)
    _log_plan(plan, scales, dst, need, free, len(done), len(todo), quiet)
    if not dry_run and need + min_free_margin > free:
        raise ConvertError(
            f"not enough free space under {dst}: need {human(need)} (+{human(min_free_margin)} margin), "
            f"free {human(free)}")
    # Every scale value, before the first write: a damaged source is refused with DST untouched
    # (also a partial DST from an earlier run), not after hours of converted shards.
    check_expert_scales(source, plan.experts, quiet=quiet, progress=progress)
    if dry_run:
        log(f"dry run: {len(todo)} shard(s) would be converted; nothing written", quiet)
        return Result([], sorted(done), Stats(), dst=dst)

    (dst / STATE_DIR).mkdir(parents=True, exist_ok=True)
    save_state(state_path, state)
    converted = _convert_shards(plan, todo, dst, scales, state, state_path, progress and not quiet, _fault)
    stats = Stats()
    for fn in plan.shards:
        stats.merge(Stats(**state["shards"][fn]["stats"]))

    # Everything else, then config and index last: a DST is loadable only when complete.
    _write_outputs(plan, dst, scales, stats, state)
    state["complete"] = True
    save_state(state_path, state)
    _log_result(len(converted), len(done), stats, quiet)
    res = Result(converted, sorted(done), stats, dst=dst)
    if verify:
        res.verify = verify_conversion(src, dst, plan=plan, quiet=quiet, progress=progress)
    return res


def _is_within(a: Path, b: Path) -> bool:
    try:
        a.relative_to(b)
        return True
    except ValueError:
        return False


def _check_paths(src: Path, dst: Path):
    # SRC is only ever read: DST may be neither SRC, nor inside it, nor hold it
    if src == dst or _is_within(dst, src):
        raise ConvertError(f"DST {dst} is SRC or inside it; the converter never writes into SRC")
    if _is_within(src, dst):
        raise ConvertError(f"SRC {src} is inside DST {dst}; pick a DST outside the source checkpoint")
    return src, dst


def _log_plan(plan: Plan, scales: InputScales, dst: Path, need: int, free: int, n_done: int, n_todo: int,
              quiet: bool) -> None:
    source = plan.source
    n_main, n_mtp = plan.expert_counts()
    log(f"source      {source.root}", quiet)
    log(f"            {len(source.headers)} shards, {len(source.weight_map)} tensors; routed expert projections: "
        f"{n_main} converted to NVFP4, {n_mtp} MTP kept MXFP4", quiet)
    log(f"destination {dst}  (output {human(plan.total_size())}; still to write {human(need)}; "
        f"free {human(free)})", quiet)
    log(f"input_scale {scales.origin}: w13 default {scales.w13:.6g}, w2 default {scales.w2:.6g}"
        + (f", {len(scales.per_tensor)} per-tensor values" if scales.per_tensor else ""), quiet)
    if n_done:
        log(f"resume: {n_done} finished shard(s) checked and kept, {n_todo} to convert", quiet)


def _convert_shards(plan: Plan, todo: List[str], dst: Path, scales: InputScales, state: dict, state_path: Path,
                    progress: bool, fault: Optional[Callable[[str, int], None]]) -> List[str]:
    # the shards left, one at a time, each recorded in the journal as soon as it is renamed into place
    todo_bytes = sum(sum(t.nbytes for t in plan.shards[fn]) for fn in todo)
    bar = Progress(todo_bytes, progress and todo_bytes > 0)
    converted = []
    try:
        for fn in todo:
            sha, size, st = convert_shard(plan, fn, dst, scales, progress=bar, fault=fault)
            state["shards"][fn] = {"size": size, "sha256": sha, "stats": asdict(st)}
            save_state(state_path, state)
            converted.append(fn)
    finally:
        bar.close()
    return converted


def _report(plan: Plan, scales: InputScales, stats: Stats, state: dict) -> Dict[str, object]:
    # DST's dsv4_sm120_nvfp4_report.json
    n_main, n_mtp = plan.expert_counts()
    return {
        "converter": "dsv4_sm120.convert_nvfp4",
        "format_version": FORMAT_VERSION,
        "source": str(plan.source.root),
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


def _write_outputs(plan: Plan, dst: Path, scales: InputScales, stats: Stats, state: dict) -> None:
    # the other files of SRC (copied unless already identical), the report, then config and index
    src = plan.source.root
    for r in plan.aux_files:
        d = dst / r
        s = src / r
        if not (d.is_file() and d.stat().st_size == s.stat().st_size and sha256_file(d) == sha256_file(s)):
            atomic_copy(s, d)
    atomic_write_bytes(dst / REPORT_FILE, (json.dumps(_report(plan, scales, stats, state), indent=2) + "\n").encode())
    atomic_write_bytes(dst / CONFIG_FILE, (json.dumps(plan.out_config, indent=2) + "\n").encode())
    index = {"metadata": {**{k: v for k, v in plan.source.index_meta.items() if k != "total_size"},
                          "total_size": sum(t.nbytes for ts in plan.shards.values() for t in ts)},
             "weight_map": dict(sorted(plan.weight_map().items()))}
    atomic_write_bytes(dst / INDEX_FILE, (json.dumps(index, indent=2) + "\n").encode())


def _log_result(n_converted: int, n_kept: int, stats: Stats, quiet: bool) -> None:
    log(f"converted {n_converted} shard(s), kept {n_kept}; {stats.tensors} expert tensors, "
        f"{stats.blocks} blocks", quiet)
    if stats.out_of_range:
        log(f"WARNING: {stats.out_of_range} block(s) out of the exact range were clamped "
            f"({stats.lossy} changed value); max abs error {stats.max_abs_err:.6g} in "
            f"{stats.max_abs_err_tensor}, max rel error {stats.max_rel_err:.3g} in {stats.max_rel_err_tensor}",
            quiet)
    else:
        log("all blocks in range: the NVFP4 experts are bit-exact", quiet)
