#!/usr/bin/env python3
"""Benchmark the Triton NVFP4 fused MoE at DeepSeek-V4-Flash shapes; every measured point is appended as a row
to ``bench/results/moe.csv`` (tables: ``bench/results_table.py``).

For each token count M it times, with CUDA-graph replay:
  * ``nvfp4-<path>`` -- :func:`dsv4_sm120.moe.nvfp4_fused_moe` on its default path for this GPU (``fp4`` =
    native FP4 tensor cores on sm_100/sm_120, ``bf16`` = in-kernel upcast elsewhere), and with ``--all-paths``
    the other path too; rel_err against the float64 reference of the exactly dequantized weights;
  * ``fp8-baseline`` -- a W8A8 block-scaled FP8 MoE: this file's simple Triton kernel (weights e4m3 with one
    fp32 scale per 128x128 block, activations quantized per token and 128-column group in-kernel, like
    DeepSeek's FP8 recipe), same routing / reduction kernels as ``nvfp4``;
  * ``bf16-baseline`` -- the same kernel with plain bf16 weights.
GB/s: the weight bytes the step must read (distinct active experts x bytes per expert, scales included) per
time; notes: active experts, weight MB, the share of the GPU's measured device-to-device copy bandwidth.
Each replay runs ``--rotate`` calls with different routings whose expert sets spread over all experts, so
weights come from HBM and not from L2.

Cases (``--cases``): ``tp4`` (H 4096, I 512 per rank, E 256, top-6; M = 1,4,16,64,128,1024,4096; ``--m``
overrides M); ``launch`` (the same shape; a launch sweep: each complete candidate of LAUNCH_CANDIDATES at
M = 1..4096, no default or baseline rows; ``bench/results_table.py launch moe`` then writes this GPU's table). ``--variants 'BN1=64,BK1=128;align=torch;apre=0'``: launch variants of the default path, each a
','-list of launch-table fields (BM, BN1, BK1, BN2, BK2, warps1, warps2, stages; align=inkernel|triton|torch, auto =
the table's) and apre=0|1 (fp4 path: activations quantized in every GEMM program / once per row); fields a
variant does not set keep the launch table's value. Timed at ``--variant-m`` and recorded with that text as
``variant``.

  python bench/bench_moe.py                      # the tp4 case
  python bench/bench_moe.py --m 1,64 --variants 'align=torch;BN1=64' --variant-m 1,64
  python bench/bench_moe.py --dry-run            # the rows it would write; no GPU needed
  python bench/bench_moe.py --cases launch        # this GPU's launch-table sweep
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "overlay"))

from dsv4_sm120.dev import bench_results as R  # noqa: E402

# name -> (hidden, inter per rank, experts, top-k, token counts)
CASES = {"tp4": (4096, 512, 256, 6, (1, 4, 16, 64, 128, 1024, 4096))}
# Launch sweep (case ``launch``, the tp4 shape): every candidate launch of the default path at token counts from
# one to a long prefill chunk, so dsv4_sm120.dev.launch_sweep can generate this GPU's MoE launch table
# (``bench/results_table.py launch moe``). Candidates: the tile sets of the shipped tables, each with the three
# token groupings; every field spelled out.
LAUNCH_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_TILES = ("BM=16,BN1=32,BK1=256,BN2=64,BK2=256,warps1=4,warps2=4,stages=3",
          "BM=16,BN1=64,BK1=256,BN2=64,BK2=256,warps1=4,warps2=4,stages=3",
          "BM=16,BN1=64,BK1=128,BN2=128,BK2=128,warps1=4,warps2=4,stages=3",
          "BM=32,BN1=64,BK1=128,BN2=64,BK2=128,warps1=4,warps2=4,stages=3",
          "BM=64,BN1=64,BK1=128,BN2=128,BK2=128,warps1=8,warps2=8,stages=3")
LAUNCH_CANDIDATES = tuple(f"{t},align={a}" for t in _TILES for a in ("inkernel", "triton", "torch"))
CASES["launch"] = CASES["tp4"][:4] + (LAUNCH_M,)
CONFIG_FIELDS = ("BM", "BN1", "BK1", "BN2", "BK2", "warps1", "warps2", "stages")  # integer Config fields
ALIGN_CHOICES = ("inkernel", "triton", "torch", "auto")  # moe.config.ALIGN_MODES + auto (the table's)
# knobs the kernel no longer has: a variant naming one is refused rather than timed as the default
REMOVED_KEYS = {"deq": "the weight decode is not a launch choice (3 on NVIDIA GPUs, 0 portable)",
                "aload": "the activation load is always the contiguous one"}
VARIANT_KEYS = CONFIG_FIELDS + ("align", "apre")

class UsageError(Exception):
    pass


def parse_variant(spec: str):
    """'BN1=64,align=triton,apre=0' -> (Config field overrides, apre or None); bad items raise. ``align=auto``
    keeps the table's grouping, like leaving it out."""
    fields, apre = {}, None
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        k, sep, v = (x.strip() for x in item.partition("="))
        if not sep or not v:
            raise UsageError(f"--variants item {spec!r}: expected key=value, got {item!r}")
        if k in REMOVED_KEYS:
            raise UsageError(f"--variants item {spec!r}: {k!r} no longer exists ({REMOVED_KEYS[k]}); "
                             f"keys: {', '.join(VARIANT_KEYS)}")
        if k == "align":
            if v not in ALIGN_CHOICES:
                raise UsageError(f"--variants item {spec!r}: align must be one of {', '.join(ALIGN_CHOICES)}, "
                                 f"got {v!r}")
            if v != "auto":
                fields["align"] = v
        elif k == "apre":
            if v not in ("0", "1"):
                raise UsageError(f"--variants item {spec!r}: apre must be 0 or 1, got {v!r}")
            apre = v == "1"
        elif k in CONFIG_FIELDS:
            try:
                fields[k] = int(v)
            except ValueError:
                raise UsageError(f"--variants item {spec!r}: {k} needs an integer, got {v!r}") from None
        else:
            raise UsageError(f"--variants item {spec!r}: unknown key {k!r}; keys: {', '.join(VARIANT_KEYS)}")
    return fields, apre


def plan(args):
    """(shape, token counts of the default rows, token counts of the variant rows, variant texts). A launch
    sweep has no default rows: its variants are the complete candidates, timed at the case's token counts."""
    if args.cases not in CASES:
        raise UsageError(f"unknown case {args.cases!r}; cases: {', '.join(CASES)}")
    H, I, E, k, ms = CASES[args.cases]
    try:
        if args.m:
            ms = [int(v) for v in args.m.split(",") if v.strip()]
        vms = [int(v) for v in args.variant_m.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--m / --variant-m must be comma-separated integers, got {args.m!r} / "
                         f"{args.variant_m!r}") from None
    ms = list(ms)
    if not ms or min(ms + vms) < 1:
        raise UsageError("--m / --variant-m must be positive integers")
    variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    if args.cases == "launch":
        from dsv4_sm120.dev.launch_sweep import SweepError, moe_entry

        variants = variants or list(LAUNCH_CANDIDATES)
        for v in variants:
            try:
                moe_entry(v)
            except SweepError as exc:
                raise UsageError(f"--variants item {v!r} of a launch sweep: {exc}") from None
        ms, vms = [], ms
    for v in variants:
        parse_variant(v)
    return (H, I, E, k), list(ms), vms, variants


def dry_run(args, shape, ms, vms, variants, command):
    H, I, E, k = shape
    print(f"results file: {args.results}\ncommand recorded: {command}")
    print(",".join(R.columns("moe")))
    rows = []
    paths = ["<default path>"] + (["<other path>"] if args.all_paths else [])
    for M in ms:
        impls = [f"nvfp4-{p}" for p in paths] + ([] if args.no_baselines else ["fp8-baseline", "bf16-baseline"])
        rows += [(M, i, "default") for i in impls]
    rows += [(M, "nvfp4-<default path>", v) for v in variants for M in vms]
    for M, impl, variant in rows:
        print(R.csv_line("moe", R.make_row("moe", case=args.cases, impl=impl, variant=variant, tokens=M, hidden=H,
                                           inter=I, experts=E, topk=k, routing="random", date=R.now(),
                                           command=command)))
    print(f"{len(rows)} rows (GPU, versions, us, GB/s, rel_err filled when run)")
    return 0


def run(args, shape, ms, vms, variants, command):
    import dataclasses

    import torch
    from moe_baselines import baseline_moe, copy_bandwidth, routings, time_graph

    from dsv4_sm120.moe.fused_moe import choose_config, default_path, nvfp4_fused_moe_impl
    from dsv4_sm120.moe.reference import moe_reference, rel_err
    from dsv4_sm120.moe.testing import make_experts

    H, I, E, k = shape

    from dsv4_sm120 import settings

    align_env = "DSV4_SM120_MOE_ALIGN"  # overrides the launch table's grouping in every call
    if settings.get(align_env) not in ("", "auto") and variants:
        raise UsageError(f"{align_env}={settings.raw(align_env)} would override every variant's grouping; "
                         "unset it and name the grouping in --variants (align=...)")
    dev = torch.device("cuda")
    limit = 10.0
    env = R.environment(REPO, command)
    bw = copy_bandwidth()
    print(f"# {env['gpu']}, torch {env['torch']}, triton {env['triton']}; copy bandwidth (read+write) {bw:.0f} GB/s",
          flush=True)
    W = make_experts(E, H, I, 0, device=dev)
    fp4_bytes = (W["w13"].numel() + W["w13_scale"].numel() + W["w2"].numel() + W["w2_scale"].numel()) // E
    base = {}
    if not args.no_baselines and args.cases != "launch":
        gen = torch.Generator(device="cuda").manual_seed(1)
        w13b = (torch.randn((E, 2 * I, H), generator=gen, device=dev) * H ** -0.5).to(torch.bfloat16)
        w2b = (torch.randn((E, H, I), generator=gen, device=dev) * I ** -0.5).to(torch.bfloat16)
        s13 = torch.full((E, 2 * I // 128, H // 128), 2.0 / 448, device=dev)
        s2 = torch.full((E, H // 128, I // 128), 2.0 / 448, device=dev)
        w13f = (w13b.float() * 448 * 0.5).to(torch.float8_e4m3fn)
        w2f = (w2b.float() * 448 * 0.5).to(torch.float8_e4m3fn)
        base["fp8-baseline"] = (w13f, s13, w2f, s2, True,
                                (w13f.numel() + w2f.numel()) // E + (s13.numel() + s2.numel()) * 4 // E)
        base["bf16-baseline"] = (w13b, s13, w2b, s2, False, (w13b.numel() + w2b.numel()) * 2 // E)
    dpath = default_path(dev)
    paths = [dpath] + ([p for p in ("bf16", "fp4") if p != dpath] if args.all_paths else [])
    out_rows = []

    def emit(M, impl, variant, t, nbytes, active, err=None, extra=(), error=None):
        notes = [f"copy_gbps={bw:.0f}", f"rotate={args.rotate}", *extra]
        gbs = None
        if t is not None:
            gbs = nbytes * active / t / 1e3
            notes += [f"active_experts={active:.1f}", f"weight_mb={nbytes * active / 1e6:.1f}",
                      f"pct_of_copy={100 * gbs / bw:.1f}"]
        if error:
            notes.append("error=" + error.replace(";", ","))
        row = R.make_row("moe", case=args.cases, impl=impl, variant=variant, tokens=M, hidden=H, inter=I,
                         experts=E, topk=k, routing="random", us=None if t is None else round(t, 2),
                         gbps=None if gbs is None else round(gbs, 1), rel_err=err, notes="; ".join(notes), **env)
        R.append_rows(args.results, "moe", [row])  # row by row: an interrupted run keeps what it measured
        out_rows.append(row)
        print(f"M={M:5d} {impl:14s} {variant:24s} " + (f"{t:9.1f} us  {gbs:7.0f} GB/s" if t is not None else "failed")
              + (f"  rel err {err:.2e}" if err is not None else "") + (f"  {error}" if error else ""), flush=True)

    def check(x, tw, ids, **kw):
        if args.no_check:
            return None
        ref = moe_reference(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=limit)
        return rel_err(nvfp4_fused_moe_impl(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=limit, **kw), ref)

    for M in ms:
        rot = max(1, min(args.rotate, 4096 * 4 // M))
        routs = routings(M, E, k, rot, 100 + M)
        active = statistics.mean(float(torch.unique(ids).numel()) for _, ids in routs)
        xs = [(torch.randn((M, H), device=dev) * 2).to(torch.bfloat16) for _ in range(min(rot, 4))]
        for p in paths:
            fns = [lambda tw=tw, ids=ids, x=xs[i % len(xs)], p=p: nvfp4_fused_moe_impl(
                x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=limit, path=p)
                for i, (tw, ids) in enumerate(routs)]
            cfg = choose_config(M, k, E, H, I, p)
            try:
                err = check(xs[0], *routs[0], path=p)
                emit(M, f"nvfp4-{p}", "default", time_graph(fns, args.reps), fp4_bytes, active, err,
                     extra=[f"config={cfg}".replace(",", "")])
            except Exception as exc:  # noqa: BLE001 - record the failure, go on
                emit(M, f"nvfp4-{p}", "default", None, fp4_bytes, active, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        for bn, (a13, b13, a2, b2, fp8, nbytes) in base.items():
            fns = [lambda tw=tw, ids=ids, x=xs[i % len(xs)]: baseline_moe(x, a13, b13, a2, b2, tw, ids, limit, fp8)
                   for i, (tw, ids) in enumerate(routs)]
            try:
                emit(M, bn, "default", time_graph(fns, args.reps), nbytes, active)
            except Exception as exc:  # noqa: BLE001
                emit(M, bn, "default", None, nbytes, active, error=f"{type(exc).__name__}: {str(exc)[:300]}")
    for M in vms if variants else []:
        routs = routings(M, E, k, max(1, min(args.rotate, 4096 * 4 // M)), 300 + M)
        active = statistics.mean(float(torch.unique(ids).numel()) for _, ids in routs)
        x0 = (torch.randn((M, H), device=dev) * 2).to(torch.bfloat16)
        for spec in variants:
            fields, apre = parse_variant(spec)
            try:
                # the table's launch for this M with the variant's fields replaced (align included: the
                # table's grouping unless the variant names one)
                cfg = dataclasses.replace(choose_config(M, k, E, H, I, dpath), **fields)
                err = check(x0, *routs[0], path=dpath, config=cfg, apre=apre)
                fns = [lambda tw=tw, ids=ids, cfg=cfg: nvfp4_fused_moe_impl(
                    x0, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=limit, path=dpath, config=cfg, apre=apre)
                    for (tw, ids) in routs]
                emit(M, f"nvfp4-{dpath}", spec, time_graph(fns, args.reps), fp4_bytes, active, err,
                     extra=[f"config={cfg}".replace(",", "")])
            except Exception as exc:  # noqa: BLE001
                emit(M, f"nvfp4-{dpath}", spec, None, fp4_bytes, active, error=f"{type(exc).__name__}: {str(exc)[:300]}")
    print(R.render_table("moe", out_rows, env["gpu"], all_variants=True) if out_rows else "no rows measured")
    if args.cases == "launch":
        print(f"launch table from these rows: python bench/results_table.py launch moe --gpu '{env['gpu']}'"
              + ("" if args.results == REPO / "bench" / "results" / "moe.csv" else f" --results {args.results}"))
    print(f"appended {len(out_rows)} rows to {args.results}")
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--cases", default="tp4", help=f"one of {', '.join(CASES)}")
    p.add_argument("--m", default="", help="comma-separated token counts M (default: the case's)")
    p.add_argument("--rotate", type=int, default=16, help="routings per graph replay")
    p.add_argument("--reps", type=int, default=30, help="timed graph replays (median)")
    p.add_argument("--all-paths", action="store_true", help="also time the non-default nvfp4 path")
    p.add_argument("--no-baselines", action="store_true", help="skip the fp8 / bf16 baselines")
    p.add_argument("--variants", default="", help="';'-separated launch variants of the default path (see below)")
    p.add_argument("--variant-m", default="1,4,16,64", help="token counts for --variants")
    p.add_argument("--no-check", action="store_true", help="skip the float64 reference (rows get no rel_err)")
    p.add_argument("--results", type=Path, default=R.user_results("moe"),
                   help="results file to append to (default: DSV4_SM120_CACHE/bench/moe.csv, outside the tree; "
                        "the project's recorded rows: bench/results/moe.csv)")
    p.add_argument("--dry-run", action="store_true", help="list the rows it would write; no GPU")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    command = "python bench/bench_moe.py " + " ".join(shlex.quote(a) for a in argv)
    try:
        shape, ms, vms, variants = plan(args)
    except UsageError as exc:
        print(f"bench_moe: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(args, shape, ms, vms, variants, command)
    error = R.missing_gpu("bench_moe")
    if error:
        print(error, file=sys.stderr)
        return 2
    try:
        return run(args, shape, ms, vms, variants, command)
    except UsageError as exc:
        print(f"bench_moe: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
