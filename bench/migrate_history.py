#!/usr/bin/env python3
"""One-off: turn the per-run result files under bench/results (JSON / markdown written by earlier versions of the
bench drivers) into rows of bench/results/{attention,moe,fp8}.csv. Run once from the repository root before those
files are deleted; git history keeps both this script and its inputs."""

from __future__ import annotations

import csv
import glob
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "overlay"))
sys.path.insert(0, str(REPO / "bench"))
from dsv4_sm120 import bench_results as R  # noqa: E402
import bench_fp8  # noqa: E402

RES = REPO / "bench" / "results"
ATTN_CASES = {("swa128+c4", 16): "tp4_decode", ("single512", 16): "single512", ("swa128+c4", 64): "h64",
              ("single512", 64): "h64_single512", ("swa128+c4", 32): "h32", ("swa128+c4", 128): "h128"}
ATTN_IMPL = {"flashmla(64 heads)": ("flashmla", "q padded to 64 heads"),
             "upstream-triton(64 heads)": ("upstream-triton", "q padded to 64 heads"),
             "torch(eager)": ("torch-eager", "eager, no graph"), "flashinfer": ("flashinfer", "")}
# rows measured as a variant that the committed table names the current default (the register-body launch
# became the bf16 default for H > 16 in commit 109bdd8, from these runs)
REG_H = "impl=reg,BLOCK_H=16,BLOCK_N=32,num_warps=4,Q_RES=1,DEC_LATE=1,SPAN=1,PART_BF16=1,waves=2"
PROMOTE = {"attention_h200_call24_h64.json": lambda r: r["H"] == 64,
           "attention_h200_call25_h32_h128.json": lambda r: r["H"] == 32 or (r["H"] == 128 and r["B"] != 128)}


def git(*args):
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()


def added(path):
    """(short commit, ISO date) of the commit that added ``path``."""
    out = git("log", "--diff-filter=A", "--format=%h %aI", "--", str(path)).splitlines()
    return tuple(out[-1].split()) if out else ("unknown", "")


def cuda_of(torch_version):
    m = re.search(r"\+cu(\d+)(\d)$", torch_version or "")
    return f"{m.group(1)}.{m.group(2)}" if m else ""


def attention_rows():
    out = []
    files = sorted(glob.glob(str(RES / "attention_h200*.json")), key=lambda f: json.load(open(f))["meta"]["date"])
    for f in files:
        d = json.load(open(f))
        m = d["meta"]
        commit, _ = added(f)
        name = Path(f).name
        env = dict(gpu=m["gpu"], torch=m["torch"], triton=m["triton"], cuda=cuda_of(m["torch"]), driver="",
                   commit=commit, date=m["date"], command=m["command"])
        promoted = []
        for r in d["rows"]:
            impl, _, variant = r["impl"].partition("[")
            variant = variant[:-1] if variant else "default"
            impl, note = ATTN_IMPL.get(impl, (impl, ""))
            notes = [f"source=bench/results/{name}", f"layers={m['layers_per_graph']}"]
            if note:
                notes.append(note)
            if "spread_us" in r:
                notes.append(f"spread_us={r['spread_us']}")
            if r.get("graph_equals_eager") is False:
                notes.append("graph_equals_eager=false")
            if "error" in r:
                notes.append("error=" + r["error"].replace(";", ","))
            row = dict(case=ATTN_CASES[(r["layout"], r["H"])], variant=variant, impl=impl, layout=r["layout"],
                       heads=r["H"], batch=r["B"], context=m["context"], us=r.get("us"), gbps=r.get("gbps"),
                       rel_err=r.get("rel_err"), notes="; ".join(notes), **env)
            out.append(R.make_row("attention", **row))
            if name in PROMOTE and variant == REG_H and impl == "ours-bf16" and PROMOTE[name](r):
                promoted.append(R.make_row("attention", **dict(row, variant="default", notes="; ".join(
                    notes + [f"note=measured as variant {REG_H}, the default launch for this shape since commit "
                             "109bdd8"]))))
        out += promoted  # after the run's own default rows: the same date, so the later line wins
    return out


MOE_ROW = re.compile(r"^\| (\d+) \| (\S+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (\d+) \| ([\d.]+) \|$")
MOE_VAR = re.compile(r"^(?:  )?variant M=(\d+) \[([^\]]*)\](?: Config\([^)]*\))?: (?:([\d.]+) us, (\d+) GB/s "
                     r"\(([\d.]+)% of copy\), rel err ([\d.e+-]+)|failed (.*))$")
MOE_SWEEP = re.compile(r"^sweep M=(\d+) deq=(\d) BN1=(\d+) BK1=(\d+) BN2=(\d+) BK2=(\d+) warps=(\d+): ([\d.]+) us, "
                       r"(\d+) GB/s, diff vs deq0 ([\d.e+-]+)$")
MOE_IMPL = {"fp8": "fp8-baseline", "bf16": "bf16-baseline"}


def moe_rows():
    out = []
    files = sorted(glob.glob(str(RES / "moe_h200*.md")))
    runs = []
    for f in files:
        commit, _ = added(f)
        ctx = None
        for line in Path(f).read_text().splitlines():
            if line.startswith("# MoE benchmark: "):
                ctx = dict(gpu=line[len("# MoE benchmark: "):].split(" (")[0], file=Path(f).name, commit=commit,
                           rows=[], variant="default", err=None)
                runs.append(ctx)
            if ctx is None:
                continue
            if line.startswith("- date: "):
                ctx["date"] = line[8:].replace(" UTC", "").replace(" ", "T") + ":00+00:00"
            elif line.startswith("- versions: "):
                v = re.search(r"torch (\S+), triton (\S+)", line)
                ctx["torch"], ctx["triton"] = v.group(1).rstrip(","), v.group(2).rstrip(",")
            elif line.startswith("- command: "):
                ctx["command"] = line.split("`")[1]
            elif line.startswith("- measured copy bandwidth"):
                ctx["copy"] = re.search(r"(\d+) GB/s", line).group(1)
            elif line.startswith("- bf16-path weight decode"):
                parts = []
                deq = re.search(r"DEQ\): (\w+)", line).group(1)
                if deq != "default":
                    parts.append(f"deq={deq}")
                if "strided" in line:
                    parts.append("aload=strided")
                if "grouping: the one-program Triton kernel" in line:
                    parts.append("align=triton")
                ctx["variant"] = ",".join(parts) or "default"
            elif line.startswith("- correctness M=64 path=bf16"):
                ctx["err"] = re.search(r"float64 ([\d.e+-]+)", line).group(1)
            mr = MOE_ROW.match(line)
            mv = MOE_VAR.match(line.strip() if line.strip().startswith("variant") else line)
            ms = MOE_SWEEP.match(line.strip())
            if mr:
                M, k, us, act, mb, gbs, pct = mr.groups()
                ctx["rows"].append(dict(tokens=M, impl=MOE_IMPL.get(k, k), variant=ctx["variant"], us=us, gbps=gbs,
                                        notes=f"active_experts={act}; weight_mb={mb}; pct_of_copy={pct}"))
            elif mv:
                M, spec, us, gbs, pct, err, fail = mv.groups()
                ctx["rows"].append(dict(tokens=M, impl="nvfp4-bf16", variant=spec or "default", us=us, gbps=gbs,
                                        rel_err=err, notes=(f"pct_of_copy={pct}" if pct else
                                                            "error=" + (fail or "").replace(";", ","))))
            elif ms:
                M, deq, bn1, bk1, bn2, bk2, w, us, gbs, diff = ms.groups()
                ctx["rows"].append(dict(tokens=M, impl="nvfp4-bf16", us=us, gbps=gbs,
                                        variant=f"deq={deq},BN1={bn1},BK1={bk1},BN2={bn2},BK2={bk2},warps1={w},"
                                                f"warps2={w}", notes=f"diff_vs_deq0={diff}"))
    for ctx in sorted(runs, key=lambda c: c["date"]):
        for r in ctx["rows"]:
            notes = [f"source=bench/results/{ctx['file']}", r.pop("notes")]
            if "copy" in ctx:
                notes.append(f"copy_gbps={ctx['copy']}")
            if (ctx["err"] and r["impl"] == "nvfp4-bf16" and r["variant"] == "default" and r["tokens"] == "64"
                    and not r.get("rel_err")):
                r["rel_err"] = ctx["err"]
            out.append(R.make_row("moe", case="tp4", hidden=4096, inter=512, experts=256, topk=6, routing="random",
                                  gpu=ctx["gpu"], torch=ctx["torch"], triton=ctx["triton"], cuda=cuda_of(ctx["torch"]),
                                  commit=ctx["commit"], date=ctx["date"], command=ctx["command"],
                                  notes="; ".join(notes), **r))
    f = RES / "moe_gpu_matrix_h200.csv"
    commit, date = added(f)
    for r in csv.DictReader(open(f)):
        mode = r["mode"]
        impl, variant = ("nvfp4-fp4-emulated", "default") if mode == "fp4-emulated" else (
            "nvfp4-bf16", mode.split("-", 1)[1].replace("deq", "deq=") if "-" in mode else "default")
        out.append(R.make_row("moe", case="correctness_matrix", impl=impl, variant=variant, tokens=r["M"],
                              hidden=4096, inter=r["I"], experts=r["E"], topk=6, routing=r["routing"],
                              gpu="NVIDIA H200", torch="2.11.0+cu130", triton="3.6.0", cuda="13.0", commit=commit,
                              date=date, command="python3 -m pytest tests/gpu/test_moe_gpu.py (its test_matrix)",
                              rel_err=r["total_err"],
                              notes=f"source=bench/results/moe_gpu_matrix_h200.csv; kernel_err={r['kernel_err']}; "
                                    f"act_quant_err={r['act_quant_err']}"))
    return out


def fp8_rows():
    out = []
    for f, cmd in ((RES / "fp8_h200_run1_summary.json",
                    "python3 -m dsv4_sm120.tune_fp8 --quick --kernel-source wheel --sglang-wheel .whl_fp8/... "
                    "--time-budget 210"),
                   (REPO / "configs" / "fp8" / "summary_NVIDIA_H200.json",
                    "python3 -m dsv4_sm120.tune_fp8 --quick --kernel-source wheel --sglang-wheel "
                    "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl --out-dir $OUT/fp8 --time-budget 150 "
                    "--jobs 15")):
        s = json.load(open(f))
        commit, _ = added(f)
        env = dict(gpu=s["device_name_raw"], commit=commit, date=s["updated_at"], command=cmd, driver="")
        rel = f.relative_to(REPO)
        out += bench_fp8.summary_rows(s, f"tp{s.get('tp', 4)}_gemms", env, extra_notes=f"source={rel}")
    return out


def main():
    for subject, rows in (("attention", attention_rows()), ("moe", moe_rows()), ("fp8", fp8_rows())):
        path = RES / f"{subject}.csv"
        if path.exists():
            path.unlink()
        R.append_rows(path, subject, rows)
        print(f"{path}: {len(rows)} rows")


if __name__ == "__main__":
    main()
