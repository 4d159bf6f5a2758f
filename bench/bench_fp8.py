#!/usr/bin/env python3
"""FP8 block GEMM: tune SGLang's Triton kernel for this GPU (``python -m dsv4_sm120.tune_fp8``) and append what
the tuner measured to ``bench/results/fp8.csv``.

Per weight shape (N, K) and token count M the tuner times the best config it found (impl ``triton-tuned``),
SGLang's fallback Triton config (``triton-sglang-default-cfg``), the config SGLang ships for this GPU if any
(``triton-sglang-shipped-cfg``) and, where SGLang is importable, activation quantization + GEMM with the tuned
config and with SGLang's default FP8 backend (``linear-triton-tuned`` / ``linear-default-backend``). Every
candidate is checked against an fp32 reference inside the tuner (rows carry no rel_err of their own).

Cases: ``tp4_gemms`` (the DeepSeek-V4-Flash dense GEMMs sharded for TP 4, the default), ``tp8_gemms``.
Only shapes the tuner (re)measured in this run are appended; ``--from-summary FILE`` appends every shape of an
existing ``summary_<gpu>.json`` instead of tuning.

  python bench/bench_fp8.py                          # quick search, TP 4, configs into configs/fp8/
  python bench/bench_fp8.py --cases tp8_gemms -- --force
  python bench/bench_fp8.py --dry-run                # the plan and the rows it would write; no GPU
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "overlay"))

from dsv4_sm120.dev import bench_results as R  # noqa: E402

CASES = {"tp4_gemms": 4, "tp8_gemms": 8}
# summary key -> impl
IMPLS = {"best_us": "triton-tuned", "sglang_default_cfg_us": "triton-sglang-default-cfg",
         "sglang_shipped_cfg_us": "triton-sglang-shipped-cfg", "triton_linear_us": "linear-triton-tuned",
         "default_backend_linear_us": "linear-default-backend"}
CONFIG_OF = {"best_us": "best_config", "sglang_shipped_cfg_us": "sglang_shipped_cfg"}


def cfg_text(c) -> str:
    if not c:
        return ""
    s = f"{c.get('BLOCK_SIZE_M')}x{c.get('BLOCK_SIZE_N')}x{c.get('BLOCK_SIZE_K')} g{c.get('GROUP_SIZE_M')} " \
        f"w{c.get('num_warps')} s{c.get('num_stages')}"
    return s + (" swap" if c.get("SWAP_AB") else "") + (f" sk{c['SPLIT_K']}" if c.get("SPLIT_K", 1) > 1 else "")


def summary_rows(summary: dict, case: str, env: dict, only=None, extra_notes: str = ""):
    """Rows for every (shape, M, timed impl) of a tuner summary; ``only``: the shape keys to take."""
    v = summary.get("versions") or {}
    base = dict(env, gpu=summary.get("device_name_raw") or env.get("gpu", ""), torch=v.get("torch", env.get("torch")),
                triton=v.get("triton", env.get("triton")), cuda=v.get("cuda", env.get("cuda")))
    rows = []
    for key, s in (summary.get("shapes") or {}).items():
        if only is not None and key not in only:
            continue
        for m, r in sorted(s.get("rows", {}).items(), key=lambda kv: int(kv[0])):
            for field, impl in IMPLS.items():
                if r.get(field) is None:
                    continue
                notes = [f"layer={s.get('name', '')}", f"mode={summary.get('mode', '')}"]
                if field in CONFIG_OF:
                    notes.append(f"config={cfg_text(r.get(CONFIG_OF[field]))}")
                if field == "best_us":
                    notes.append(f"candidates={r.get('candidates')} failed={r.get('failed')}")
                if extra_notes:
                    notes.append(extra_notes)
                rows.append(R.make_row("fp8", case=case, impl=impl, n=s["N"], k=s["K"], m=int(m), us=r[field],
                                       notes="; ".join(notes), **base))
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="tp4_gemms", help=f"one of {', '.join(CASES)} (the tuner's --tp)")
    p.add_argument("--quick", action=argparse.BooleanOptionalAction, default=True,
                   help="the tuner's small search space (default on; --no-quick = the full search)")
    p.add_argument("--from-summary", type=Path, help="append the rows of this tuner summary JSON; no tuning")
    p.add_argument("--results", type=Path, default=R.user_results("fp8"),
                   help="results file to append to (default: DSV4_SM120_CACHE/bench/fp8.csv, outside the tree; "
                        "the project's recorded rows: bench/results/fp8.csv)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the rows it would write; no GPU")
    p.add_argument("tuner_args", nargs="*", help="after '--': more options for python -m dsv4_sm120.tune_fp8 "
                   "(e.g. --out-dir DIR --force --time-budget 300)")
    return p.parse_args(argv)


def _out_dir(tuner_args):
    for i, a in enumerate(tuner_args):
        if a == "--out-dir" and i + 1 < len(tuner_args):
            return Path(tuner_args[i + 1])
        if a.startswith("--out-dir="):
            return Path(a.split("=", 1)[1])
    return REPO / "configs" / "fp8"


def main(argv=None) -> int:
    a = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    command = "python bench/bench_fp8.py " + " ".join(shlex.quote(x) for x in argv)
    if a.cases not in CASES:
        print(f"bench_fp8: error: unknown case {a.cases!r}; cases: {', '.join(CASES)}", file=sys.stderr)
        return 2
    tp = CASES[a.cases]
    tuner_args = ["--tp", str(tp)] + (["--quick"] if a.quick else []) + list(a.tuner_args)
    if a.from_summary:
        try:
            summary = json.loads(a.from_summary.read_text())
        except (OSError, ValueError) as exc:
            print(f"bench_fp8: error: cannot read {a.from_summary}: {exc}", file=sys.stderr)
            return 2
        env = R.environment(REPO, command)
        env["date"] = summary.get("updated_at") or env["date"]  # when the tuner measured, not now
        rows = summary_rows(summary, a.cases, env)
        if a.dry_run:
            return _print_dry(a, rows)
        n = R.append_rows(a.results, "fp8", rows)
        print(f"appended {n} rows to {a.results}")
        return 0
    from dsv4_sm120 import tune_fp8

    if a.dry_run:
        print(f"case {a.cases}: python -m dsv4_sm120.tune_fp8 {' '.join(tuner_args)}")
        rc = tune_fp8.main(tuner_args + ["--dry-run"])
        print(f"would append one row per (shape, M) and timed impl ({', '.join(IMPLS.values())}) of the shapes "
              f"the tuner measures to {a.results}")
        return rc
    error = R.missing_gpu("bench_fp8")
    if error:
        print(error, file=sys.stderr)
        return 2
    import torch

    out = _out_dir(tuner_args)
    path = out / (tune_fp8.summary_file_stem(torch.cuda.get_device_name()) + ".json")
    before = json.loads(path.read_text()) if path.is_file() else {}
    env = R.environment(REPO, command)
    rc = tune_fp8.main(tuner_args)
    if not path.is_file():
        print(f"bench_fp8: error: the tuner wrote no summary at {path} (exit code {rc})", file=sys.stderr)
        return rc or 2
    after = json.loads(path.read_text())
    changed = {k for k, s in after.get("shapes", {}).items() if s != (before.get("shapes") or {}).get(k)}
    rows = summary_rows(after, a.cases, env, only=changed)
    n = R.append_rows(a.results, "fp8", rows)
    print(f"appended {n} rows ({len(changed)} shapes measured in this run) to {a.results}")
    return rc


def _print_dry(a, rows) -> int:
    print(f"case {a.cases}: {len(rows)} rows would be appended to {a.results}:")
    print(",".join(R.columns("fp8")))
    for r in rows:
        print(R.csv_line("fp8", r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
