"""``python -m dsv4_sm120.calibrate``: measure every candidate of every decision on this GPU, write the profile.

See ``dsv4_sm120/calibrate/__init__.py`` for what is measured; ``--help`` for the options.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

DECISIONS = ("attention", "moe", "fp8", "allreduce")
EXIT_USAGE = 2


class UsageError(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m dsv4_sm120.calibrate",
        description="Time every candidate implementation of each decision the patches make (sparse-MLA decode, "
                    "MoE runner, FP8 GEMM backend; the TP all-reduce of each server on its GPU group) on this box "
                    "at the deployment's shapes (serve settings: DECODE_GPUS = TP, SPEC_NUM_DRAFT_TOKENS, "
                    "CONTEXT_LEN, MODEL_PATH; PREFILL_GPUS, MAX_RUNNING, CHUNKED_PREFILL_SIZE for the all-reduce), "
                    "gate each against a float64 reference, and write the machine profile (JSON) + a report "
                    "(markdown, PNG).",
        epilog="Exit codes: 0 written, 2 bad usage / no GPU / bad settings, 130 interrupted (nothing written).")
    ap.add_argument("--decisions", default=",".join(DECISIONS),
                    help="comma list of %s (default: all)" % ", ".join(DECISIONS))
    ap.add_argument("--quick", action="store_true", help="fewer buckets and launch variants (a few minutes)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (shapes, buckets, candidates); no GPU")
    ap.add_argument("--out", type=Path, help="profile directory (default: the project's configs/profiles, "
                                             "or $DSV4_SM120_PROFILE_DIR)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default); cpu = Triton interpreter with tiny shapes, to test the harness only")
    ap.add_argument("--variants", help="our attention launch variants, ';'-separated DSV4_SM120_ATTN_CONFIG texts "
                                       "(default: a built-in set; empty: none)")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the inputs")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    return ap


def parse_decisions(text: str) -> List[str]:
    ds = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in ds if d not in DECISIONS]
    if bad or not ds:
        raise UsageError(f"--decisions {text!r}: expected a comma list of {', '.join(DECISIONS)}")
    return ds


def _plan(args, dep, ds, device):
    from . import attention, moe
    from .deployment import attention_buckets, moe_buckets

    cpu = device == "cpu"
    variants = None if args.variants is None else [v for v in args.variants.split(";") if v.strip()]
    plan = []
    if "attention" in ds:
        cands = attention.candidates(device, args.quick, cpu, variants)
        for layout in attention.LAYOUTS:
            plan.append((f"attention.{layout}", "rows", attention_buckets(dep, args.quick, cpu), cands,
                         attention.make_case_factory(layout, dep, device)))
    if "moe" in ds:
        plan.append((f"moe.{dep.moe_format}", "tokens", moe_buckets(args.quick, cpu),
                     moe.candidates(dep, device, args.seed), moe.make_case_factory(dep, device, args.seed)))
    if "fp8" in ds:
        plan.append(("fp8_gemm", "tokens", [1, 4, 16, 64, 256], [], None))
    return plan


def main(argv: Optional[List[str]] = None) -> int:
    from dsv4_sm120 import hints

    a = build_parser().parse_args(argv)
    return hints.run_command(lambda: _main(a), UsageError, "interrupted: no profile written", EXIT_USAGE)


def _main(a) -> int:
    from dsv4_sm120 import hints

    ds = parse_decisions(a.decisions)
    if a.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"   # before any Triton kernel is imported
    from .. import machine_profile as P
    from .deployment import DeploymentError, from_env, tiny

    try:
        dep = from_env(os.environ)
    except DeploymentError as e:
        raise UsageError(str(e)) from None
    if a.device == "cpu":
        dep = tiny(dep)
    out_dir = a.out if a.out is not None else P.profile_dir()
    if out_dir is None:
        raise UsageError(f"{P.ENV_DIR} is empty (profiles off): pass the directory ({hints.args('--out DIR')})")
    if a.dry_run:
        return dry_run(a, dep, ds, out_dir)
    device, gpu = "cpu", "cpu-interpreter"
    if a.device == "cuda":
        try:
            import torch
        except ImportError:
            raise UsageError("torch is not installed: run `make setup` and use its environment") from None
        if not torch.cuda.is_available():
            raise UsageError("no CUDA GPU visible: make calibrate measures this box's GPU "
                             f"({hints.args('--dry-run')} shows the plan; {hints.args('--device cpu')} "
                             "tests the harness)")
        device, gpu = "cuda", torch.cuda.get_device_name(0)
        ds = _allreduce_gpus(a, ds)
    return run(a, dep, ds, Path(out_dir), device, gpu)


def _allreduce_gpus(a, ds: List[str]) -> List[str]:
    """``ds`` without ``allreduce`` on a box of one GPU (a line says so); asked for by name there, a usage error."""
    if "allreduce" not in ds:
        return ds
    from .allreduce import visible_gpus

    n = visible_gpus()
    if n >= 2:
        return ds
    if a.decisions != ",".join(DECISIONS):
        raise UsageError(f"the allreduce decision needs a box with 2 or more GPUs (this one has {n})")
    print(f"allreduce: skipped: {n} GPU on this box, nothing to all-reduce", file=sys.stderr)
    return [d for d in ds if d != "allreduce"]


def _allreduce_plan(a, dep, device):
    from . import allreduce

    try:
        return allreduce.build_plan(os.environ, dep.hidden, dep.draft_tokens, device, a.quick)
    except allreduce.AllreduceError as e:
        raise UsageError(str(e)) from None


def dry_run(a, dep, ds, out_dir) -> int:
    from dsv4_sm120.fp8_configs import detect_device_name

    from ..machine_profile import file_stem

    device = a.device
    gpu = "cpu-interpreter" if device == "cpu" else (detect_device_name() or "<GPU name>")
    from .report import deployment_lines

    print("\n".join(deployment_lines(dep.summary())))
    for name, kind, buckets, cands, _ in _plan(a, dep, ds, device):
        names = ", ".join(c.name for c in cands) if cands else "triton (tuned), default (SGLang's backend) via tune_fp8"
        print(f"{name}: {kind} {','.join(map(str, buckets))}; candidates: {names}")
    if "allreduce" in ds:
        from .allreduce import dry_run_lines

        print("\n".join(dry_run_lines(_allreduce_plan(a, dep, device))))
    print(f"profile -> {Path(out_dir) / (file_stem(gpu) if gpu != '<GPU name>' else gpu + '.json')} (+ .md, .png)")
    return 0


def run(a, dep, ds, out_dir: Path, device: str, gpu: str) -> int:
    from . import allreduce, fp8, report
    from .. import machine_profile as P
    from .candidates import Progress, run_decision

    plan = _plan(a, dep, ds, device)
    ar_plan = _allreduce_plan(a, dep, device) if "allreduce" in ds else None
    total = sum(len(b) * max(1, len(c)) for _, _, b, c, _ in plan) + (allreduce.units(ar_plan) if ar_plan else 0)
    prog = Progress(total, quiet=a.quiet)
    t0 = time.monotonic()
    prog.step(f"{gpu}: TP {dep.tp}, {dep.heads} heads/rank, {dep.draft_tokens} draft tokens, "
              f"MoE {dep.moe_format} ({dep.config_source})", 0)
    decisions = {}
    for name, kind, buckets, cands, make_case in plan:
        if name == "fp8_gemm":
            from dsv4_sm120.fp8_configs import project_config_dir

            fp8_dir = out_dir / "fp8" if a.out is not None else (project_config_dir() or out_dir.parent / "fp8")
            entry = fp8.calibrate(dep.tp, gpu, fp8_dir, a.quick, device, prog, buckets)
            prog.step("fp8 done", len(buckets))
        else:
            entry = run_decision(name, cands, buckets, make_case, prog)
        entry.update(bucket_kind=kind, default=P.DEFAULTS.get(name))
        decisions[name] = entry
    if ar_plan is not None:
        try:
            env = allreduce.base_env(os.environ)
        except allreduce.AllreduceError as e:
            raise UsageError(str(e)) from None
        decisions["allreduce"] = allreduce.calibrate(ar_plan, env, allreduce.visible_gpus() if device == "cuda"
                                                     else 0, prog)
    path = P.profile_path(gpu, out_dir)
    versions = P.running_versions()
    old_note = ""
    if path.is_file():   # keep decisions this run did not measure when the old profile still applies
        try:
            old = P.load(path)
            ok, _ = P.match(old, gpu, versions)
            if ok:
                decisions = {**{k: v for k, v in old["decisions"].items() if k not in decisions}, **decisions}
            else:
                old_note = " (replaced a profile made with other versions)"
        except P.ProfileError:
            old_note = " (replaced an unreadable profile)"
    prof = {"schema": P.SCHEMA, "gpu": gpu, "created_at": P.now_iso(), "versions": versions, "device": device,
            "quick": bool(a.quick), "deployment": dep.summary(), "wall_s": round(time.monotonic() - t0, 1),
            "decisions": decisions}
    P.save(prof, path)
    md, png, note = report.write(prof, path.with_suffix(".md"))
    for name, d in decisions.items():
        if name == "allreduce":
            print("\n".join(allreduce.summary_lines(d)))
            continue
        if name == "shape":       # kept from the old profile: make verify --stages shape records it
            continue
        wins = {b: r.get("winner") for b, r in d["buckets"].items()}
        print(f"{name}: " + ", ".join(f"{b}:{w or '-'}" for b, w in sorted(wins.items(), key=lambda x: int(x[0]))))
    print(f"profile: {path}{old_note}\nreport: {md}" + (f"\nplot: {png}" if png else f"\nplot: none ({note})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
