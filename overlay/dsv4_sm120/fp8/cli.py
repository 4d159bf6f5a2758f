"""``python -m dsv4_sm120.tune_fp8`` (``make tune-fp8``): tune SGLang's Triton block-FP8 GEMM
(``w8a8_block_fp8_matmul``) for the DeepSeek-V4-Flash dense shapes on the local GPU.

Usage::

    python -m dsv4_sm120.tune_fp8 [--tp 4] [--quick] [--dry-run] [--out-dir configs/fp8] ...

For every weight shape (N, K) and token count M it checks and times each candidate tile config through
SGLang's own launcher (see :mod:`dsv4_sm120.fp8.gpu`), and writes one JSON per shape under the exact file name
SGLang 0.5.23 looks up for this device, plus ``summary_<device>.json`` / ``.md``: per M the winner, SGLang's
default config, the JSON SGLang ships for the device (if any) and, where the full SGLang imports, SGLang's
default FP8 GEMM backend against the tuned Triton linear, end to end; and a backend recommendation that
:func:`dsv4_sm120.fp8_configs.recommended_fp8_gemm_backend` reads for the serve scripts.

``--dry-run`` prints the plan (shapes, M values, candidate counts, file names) without a GPU.  A real run
without a CUDA GPU stops with exit code 2 before writing anything.

Exit codes: 0 done, 2 bad usage / no GPU / kernel not loadable, 3 stopped by ``--time-budget`` (rerun to
continue), 130 interrupted (finished M values are kept).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from dsv4_sm120.fp8_configs import config_file_name, summary_file_stem
from dsv4_sm120.fp8.errors import EXIT_USAGE, UsageError
from dsv4_sm120.fp8.search import candidate_configs
from dsv4_sm120.fp8.shapes import DEFAULT_MS, Shape, parse_ms, parse_shapes, shapes_for_tp
from dsv4_sm120.paths import CONFIGS_DIR

PROG = "python -m dsv4_sm120.tune_fp8"


def _repo_default_out() -> Optional[Path]:
    """Default ``--out-dir``: ``configs/fp8`` of the checkout this overlay runs from; else the directory
    patched SGLang reads (:func:`dsv4_sm120.fp8_configs.project_config_dir`)."""
    d = CONFIGS_DIR
    if d.is_dir():
        return d / "fp8"
    from dsv4_sm120.fp8_configs import project_config_dir

    return project_config_dir()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG,
        description="Tune SGLang's Triton block-FP8 GEMM configs for the DeepSeek-V4-Flash dense shapes on the "
                    "local GPU; writes one JSON per shape (named as SGLang looks it up) and a summary.",
        epilog="Exit codes: 0 done, 2 bad usage / no GPU, 3 stopped by --time-budget (rerun to continue).")
    ap.add_argument("--tp", type=int, default=4, help="tensor-parallel size the shapes are sharded for (default 4)")
    ap.add_argument("--shapes", help="explicit weight shapes 'N,K;N,K;...' instead of the DSv4-Flash set")
    ap.add_argument("--ms", help="comma-separated token counts M (default: %s)" % ",".join(map(str, DEFAULT_MS)))
    ap.add_argument("--quick", action="store_true", help="small search space (minutes instead of hours)")
    ap.add_argument("--out-dir", type=Path, help="where JSONs and summary go (default: the project's configs/fp8)")
    ap.add_argument("--force", action="store_true", help="retune shapes that are already done")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan (shapes, M values, candidate counts, files) and exit; needs no GPU")
    ap.add_argument("--time-budget", type=float, help="stop cleanly after this many seconds (rerun to resume)")
    ap.add_argument("--jobs", type=int, default=-1,
                    help="processes compiling candidates ahead of timing (default: CPU count, max 16; 0: off)")
    ap.add_argument("--kernel-source", choices=("auto", "installed", "installed-file", "wheel"), default="auto",
                    help="SGLang's kernel from the installed sglang, its fp8_kernel.py alone (installed-file), or "
                         "from the pinned wheel (auto: installed if importable, else the wheel)")
    ap.add_argument("--sglang-wheel", type=Path, help="the pinned sglang wheel (for --kernel-source wheel/auto)")
    ap.add_argument("--no-default-backend", action="store_true", help="do not time SGLang's default backend")
    ap.add_argument("--sm90", choices=("auto", "yes", "no"), default="auto",
                    help="(--dry-run only) plan for an sm_90 device (adds SWAP_AB/SPLIT_K); auto: GPU 0's, if any")
    ap.add_argument("--device-name", help="(--dry-run only) device name to plan file names for (default: GPU 0's)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default); cpu runs SGLang's kernel in Triton's interpreter (needs TRITON_INTERPRET=1; "
                         "for testing the tuner only)")
    ap.add_argument("--seed", type=int, default=0, help="random seed for the test data")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    from dsv4_sm120 import hints

    a = build_parser().parse_args(argv)
    return hints.run_command(lambda: _main(a), UsageError,
                             "interrupted; finished M values are saved, rerun to continue", EXIT_USAGE)


def _main(a) -> int:
    shapes = parse_shapes(a.shapes) if a.shapes else shapes_for_tp(a.tp)
    ms = parse_ms(a.ms) if a.ms else list(DEFAULT_MS)
    out = a.out_dir or _repo_default_out()
    if out is None:
        from dsv4_sm120 import hints

        raise UsageError(f"no project configs/ directory found: pass the directory ({hints.args('--out-dir DIR')})")
    if a.time_budget is not None and a.time_budget <= 0:
        raise UsageError("--time-budget must be positive")
    if a.dry_run:
        return dry_run(a, shapes, ms, Path(out))
    if a.device_name is not None or a.sm90 != "auto":
        raise UsageError("--device-name and --sm90 apply to --dry-run only (a real run tunes GPU 0 as it is)")
    from dsv4_sm120.fp8.gpu import GpuBench
    from dsv4_sm120.fp8.tuner import Tuner

    jobs = a.jobs if a.jobs >= 0 else min(16, os.cpu_count() or 1)
    bench = GpuBench(source=a.kernel_source,
                     wheel=a.sglang_wheel, seed=a.seed, time_default_backend=not a.no_default_backend,
                     device=a.device)
    print(f"device {bench.device_name_raw} ({bench.versions['capability']}, {bench.num_sms} SMs); "
          f"kernel: {bench.kernel_source}; default backend: {bench.default_backend}", file=sys.stderr)
    t = Tuner(bench, shapes, ms, Path(out), quick=a.quick, force=a.force, time_budget=a.time_budget,
              jobs=jobs, progress=not a.no_progress, tp=None if a.shapes else a.tp)
    rc = t.run()
    print(f"summary: {t.summary_md_path}", file=sys.stderr)
    return rc


def _local_gpu() -> Tuple[Optional[str], Optional[bool], Optional[int]]:
    """(name, is sm_90, SM count) of GPU 0, or Nones when torch or a GPU is missing."""
    try:
        import torch

        if torch.cuda.is_available():
            return (torch.cuda.get_device_name(0), tuple(torch.cuda.get_device_capability(0)) == (9, 0),
                    torch.cuda.get_device_properties(0).multi_processor_count)
    except Exception:
        pass
    return None, None, None


def dry_run(a, shapes: List[Shape], ms: List[int], out: Path) -> int:
    """Print what a run with these arguments would time and write; touches no GPU and writes nothing.

    Per M the run also times SGLang's default config, the config SGLang ships for the device (if any) and,
    where SGLang's fp8_utils imports, two end-to-end linears; the counts below are the candidates searched."""
    dev = a.device_name
    sm90 = {"yes": True, "no": False}.get(a.sm90)
    num_sms = None
    if dev is None or sm90 is None:
        gpu_name, gpu_sm90, num_sms = _local_gpu()
        dev = dev or gpu_name
        sm90 = gpu_sm90 if sm90 is None else sm90
    dev = dev or "UNKNOWN_DEVICE"
    sm90 = bool(sm90)
    kw = {"num_sms": num_sms} if num_sms else {}
    total = 0
    print(f"plan for {dev} ({'sm_90' if sm90 else 'not sm_90'}), {'quick' if a.quick else 'full'} search, "
          f"M = {','.join(map(str, ms))}")
    for s in shapes:
        per_m = [len(candidate_configs(m, s.N, s.K, sm90=sm90, quick=a.quick, **kw)) for m in ms]
        n = sum(per_m)
        total += n
        print(f"  {s.key:16s} {s.name:24s} {n:6d} candidates -> {out / config_file_name(s.N, s.K, dev)}")
        print("      candidates per M: " + " ".join(f"{m}:{c}" for m, c in zip(ms, per_m)))
    print(f"  total {total} candidate timings; summary -> {out / (summary_file_stem(dev) + '.json')} (+ .md)")
    return 0
