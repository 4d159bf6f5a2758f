#!/usr/bin/env python3
"""Benchmark DeepSeek-V4 sparse MLA decode: dsv4_sm120's Triton kernel against the baselines present; every
measured point is appended as a row to ``bench/results/attention.csv`` (tables: ``bench/results_table.py``).

Per point (case, batch B): microseconds per call under CUDA-graph replay (several "layers" with their own
caches per graph, so the caches do not sit in L2), achieved GB/s (bytes of the valid KV tokens read + q + out,
per call), and correctness (relative Frobenius error of out against a float64 reference on a few rows).

Cases (``--cases``, comma list; ``default`` = tp4_decode,single512,h64,h64_single512, ``all`` = every case):
  tp4_decode     SWA128 + c4-512 (main SWA cache, page 256, 128 candidates + c4 cache, page 64, top-512), H=16
  single512      one cache (page 256), 512 candidates, H=16
  h64            SWA128 + c4-512, H=64          h64_single512   single-512, H=64
  h32, h128      SWA128 + c4-512, H=32 / H=128 (B = 1, 16, 64, 128)
B = 1, 4, 16, 64, 128 unless noted (``--batches`` overrides).
Speculative decoding (group ``speculative``; ``batch`` = query rows = requests x rows per request, for
1, 2, 4, 8, 16, 32, 64 requests; docs/speculative.md):
  dspark_draft   DSpark draft block: SWA only, 192 candidates (128 window + 5 block slots, 133 valid), the 5 rows
                 of a request share them, H=16; rows = B x 5
  dspark_verify  DSpark verify: SWA128 + c4-512, H=16; rows = B x 6
  eagle_verify   EAGLE verify: SWA128 + c4-512, H=16; rows = B x 4
  eagle_draft    EAGLE draft decode step (MTP layer): SWA128 only, H=16; rows = B
Verify rows against the gather floor (group ``spec_rows``; rows = 6 x 1..64 requests, the 6 rows of a request
share its pages: SWA window shifted by one per row, own c4 top-512 from the request's entries, the same c128 list):
  spec_h{8,16,32,64}_swa         SWA128 only
  spec_h{8,16,32,64}_c4          SWA128 + c4-512 (page 64)
  spec_h{8,16,32,64}_c128        SWA128 + c128 (page 2, every entry of the context: ceil64(2*ceil(ctx/256))
                                 candidates, 128 at --context 16384)
  spec_h{8,16,32,64}_c128_64k    the same at context 65536 (512 candidates); _c128_128k: 131072 (1024)
A run with spec_rows cases ends with the targets judged on its rows (bench/attn_targets.py: 16 heads >= 0.70 of the
gather floor at 32-384 rows, 8-32 heads not slower than FlashMLA / FlashInfer, 64 heads within 1.25x; with
--targets-reference COMMIT also 1-8 rows within 5% of ours at that commit).
Launch sweeps (group ``launch``: launch_h16, launch_h32, launch_h64; SWA128 + c4-512): only ours, each candidate
launch of LAUNCH_CANDIDATES (both --qk-modes) recorded with its text as ``variant``; then
``python bench/results_table.py launch attention`` writes this GPU's launch tables from the rows.

Impls (rows' ``impl``): ``ours-bf16`` / ``ours-fp8`` (``--qk-modes``), and each baseline present:
``flashmla`` (sgl-flash-mla, ``use_legacy=True``, q padded to 64 heads; sm_90 / sm_100), ``flashinfer``
(SGLang's FlashInfer sm_120 path), ``upstream-triton`` (SGLang's Triton fallback, q padded to 64 heads, from
the installed SGLang, the pristine copy under ~/.cache/dsv4_sm120 or ``--upstream-file``), ``torch-eager``
(SGLang's torch reference; it syncs the host), ``gather-floor`` (``floor``: bench/attn_floor.py, a kernel that only
reads the bytes a call must read, through the same gather, and writes out; timed first, and the other rows' notes
carry ``floor_share`` = floor us / their us; docs/attention.md "How to benchmark"), ``mma-floor`` (``mma``, Hopper
only, not in the default list: bench/attn_mma_floor.py, the warpgroup MMAs the candidates-as-M body issues for the
call and nothing else; ours' rows then carry ``mma_share`` = its us / theirs; docs/attention.md "How to benchmark").

``--variants 'A;B'``: launch-config texts passed as the kernel's ``launch=`` (the DSV4_SM120_ATTN_CONFIG syntax,
applied over that setting); each is timed next to the default at ``--variant-cases`` (default tp4_decode; none of
the chosen cases among them: a note on stderr) and recorded with that text as ``variant``.

  python3 bench/bench_attention.py --cases tp4_decode --variants 'spanning_splits=0'
  python3 bench/bench_attention.py --dry-run --cases all     # the rows it would write; no GPU needed
  python3 bench/bench_attention.py --cases launch --qk-modes bf16,fp8   # this GPU's launch-table sweep
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "overlay"))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

REPO = Path(HERE).resolve().parent
from attn_baselines import Baselines  # noqa: E402
from attn_inputs import ROW_KEYS, make_layer, valid_tokens  # noqa: E402
from attn_targets import report as targets_report  # noqa: E402
from attn_timing import FLOOR, MMA_FLOOR, MMA_FLOOR_MAX_HEADS, floor_share_table, time_call, time_floor, \
    time_mma_floor  # noqa: E402
from dsv4_sm120.dev import bench_results as R  # noqa: E402

B_ALL = (1, 4, 16, 64, 128)
CASES = {"tp4_decode": ("swa128+c4", 16, B_ALL), "single512": ("single512", 16, B_ALL),
         "h64": ("swa128+c4", 64, B_ALL), "h64_single512": ("single512", 64, B_ALL),
         "h32": ("swa128+c4", 32, (1, 16, 64, 128)), "h128": ("swa128+c4", 128, (1, 16, 64, 128))}
SPEC_B = (1, 2, 4, 8, 16, 32, 64)  # requests; the cases list query rows
CASES.update({"dspark_draft": ("dspark192", 16, tuple(5 * b for b in SPEC_B)),
              "dspark_verify": ("swa128+c4", 16, tuple(6 * b for b in SPEC_B)),
              "eagle_verify": ("swa128+c4", 16, tuple(4 * b for b in SPEC_B)),
              "eagle_draft": ("swa128", 16, SPEC_B)})
# Speculative verify rows against the gather floor (group ``spec_rows``): 6 rows per request (DSpark verify), 1..64
# requests, every per-rank head count, the three layouts; c128 also at long context. Each case's context (None:
# --context) and the rows per request, whose rows share the request's pages (CASE_ROWS_PER_REQUEST).
SPEC_ROWS, SPEC_HEADS = 6, (8, 16, 32, 64)
SPEC_LAYOUTS = {"swa": ("swa128", None), "c4": ("swa128+c4", None), "c128": ("swa128+c128", None),
                "c128_64k": ("swa128+c128", 65536), "c128_128k": ("swa128+c128", 131072)}
CASE_CONTEXT, CASE_ROWS_PER_REQUEST = {}, {}
for _h in SPEC_HEADS:
    for _k, (_layout, _ctx) in SPEC_LAYOUTS.items():
        _name = f"spec_h{_h}_{_k}"
        CASES[_name] = (_layout, _h, tuple(SPEC_ROWS * b for b in SPEC_B))
        CASE_ROWS_PER_REQUEST[_name] = SPEC_ROWS
        if _ctx:
            CASE_CONTEXT[_name] = _ctx
# Launch sweeps (group ``launch``): every candidate launch of a table shape (heads, qk mode) at grid-row sizes
# from one row to past the decode batches, so dsv4_sm120.dev.launch_sweep can generate this GPU's launch tables
# (``bench/results_table.py launch attention``). Candidates spell out every key of their body; "auto" keys follow
# the rules of attention.config. SWA128 + c4-512 (the TP4 decode layout) at every head count.
LAUNCH_B = (1, 4, 16, 32, 64, 96, 128, 192, 256, 384, 512, 1024)
REG = ("impl=reg,BLOCK_H=16,BLOCK_N=32,num_warps=4,num_stages=1,maxnreg=0,waves=2,e4m3_int_decode=1,late_decode=1,"
       "spanning_splits=1,PART_BF16=1")
TILED_AUTO = ("impl=tiled,BLOCK_H=16,BLOCK_N=64,num_warps=8,num_stages=auto,maxnreg=auto,waves=auto,PREFETCH=auto,"
              "e4m3_int_decode=1,PART_BF16=1")
TILED_W2 = ("impl=tiled,BLOCK_H=16,BLOCK_N=64,num_warps=8,num_stages=auto,maxnreg=auto,waves=2,PREFETCH=0,"
            "e4m3_int_decode=1,PART_BF16=1")
FLAT = "impl=flat,BLOCK_H={H},BLOCK_N=32,num_warps=8,num_stages=1,maxnreg=0,waves=2"
# the Hopper warpgroup-MMA body (timed where the GPU runs it: attention.keys.runs_on)
WGMMA = "impl=wgmma,BLOCK_H=64,BLOCK_N=64,num_warps=8,num_stages=1,maxnreg=168,waves=1,spanning_splits=1,PART_BF16=1"
# its candidates-as-M sibling, all heads up to 32 as the MMA's N
WGMMA_T = ("impl=wgmma_t,BLOCK_H={H},BLOCK_N=64,num_warps=4,num_stages=1,maxnreg=168,waves=1,spanning_splits=1,"
           "PART_BF16=1")
LAUNCH_CANDIDATES = {  # (heads, qk) -> candidate launch texts
    (16, "bf16"): (REG, TILED_AUTO, WGMMA, WGMMA_T.format(H=16)), (16, "fp8"): (TILED_AUTO, TILED_W2),
    (32, "bf16"): (REG, FLAT.format(H=32), TILED_W2, WGMMA, WGMMA_T.format(H=32)),
    (32, "fp8"): (TILED_W2, FLAT.format(H=32), TILED_AUTO),
    (64, "bf16"): (REG, FLAT.format(H=64), TILED_W2, WGMMA), (64, "fp8"): (TILED_W2, FLAT.format(H=64), TILED_AUTO)}
CASES.update({f"launch_h{h}": ("swa128+c4", h, LAUNCH_B) for h in (16, 32, 64)})
GROUPS = {"default": ("tp4_decode", "single512", "h64", "h64_single512"),
          "all": tuple(c for c in CASES if not c.startswith("launch")),
          "speculative": ("dspark_draft", "dspark_verify", "eagle_verify", "eagle_draft"),
          "spec_rows": tuple(c for c in CASES if c.startswith("spec_h")),
          "launch": ("launch_h16", "launch_h32", "launch_h64")}
BASELINES = ("flashmla", "flashinfer", "upstream-triton", "torch-eager")
SHARE_IMPLS = ("ours-bf16", "ours-fp8", "flashmla")  # rows that get floor_share (bench/attn_timing.py)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="default", help="comma list of cases or groups (default, all)")
    p.add_argument("--batches", default="", help="comma list of B for every case (default: each case's own)")
    p.add_argument("--impls", default="ours,flashmla,flashinfer,upstream,torch,floor",
                   help="comma list; missing baselines are skipped with a note; floor = the gather floor "
                   "(bench/attn_floor.py); mma = the MMA floor (bench/attn_mma_floor.py, Hopper only, not by default)")
    p.add_argument("--variants", default="", help="';'-separated launch configs for ours, e.g. "
                   "'BLOCK_N=64,num_warps=4;waves=4' (bf16-only bodies skip fp8)")
    p.add_argument("--variant-cases", default="tp4_decode", help="cases at which --variants run (each variant "
                   "is a few Triton compiles per shape)")
    p.add_argument("--qk-modes", default="bf16", help="comma list of ours' qk modes (bf16, fp8)")
    p.add_argument("--layers", type=int, default=4, help="caches per graph (defeats L2 reuse)")
    p.add_argument("--context", type=int, default=16384, help="tokens of context per row (c4 range = context/4)")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--upstream-file", default="", help="path of SGLang's flash_mla_sm120_triton.py if SGLang is absent")
    p.add_argument("--sglang-sm120-file", default="", help="path of SGLang's flash_mla_sm120.py (torch baseline) if SGLang is absent")
    p.add_argument("--torch-max-batch", type=int, default=16, help="skip the eager torch baseline above this B")
    p.add_argument("--upstream-max-batch", type=int, default=128)
    p.add_argument("--results", type=Path, default=R.user_results("attention"),
                   help="results file to append to (default: DSV4_SM120_CACHE/bench/attention.csv, outside the tree; "
                        "the project's recorded rows: bench/results/attention.csv)")
    p.add_argument("--targets-reference", default="", metavar="COMMIT",
                   help="judge the spec_rows run's 1-8-row points against ours at this earlier commit's rows of the "
                   "same GPU in --results (within 5%%; bench/attn_targets.py)")
    p.add_argument("--device-table", default="", metavar="arch_sm_XY",
                   help="resolve ours' launches as a GPU of that architecture table with this GPU's SM count "
                   "(e.g. arch_sm_120: the launches an sm_120 GPU runs, timed here); ours' rows are labelled "
                   "'<variant> @arch_sm_XY' and their notes say so")
    p.add_argument("--dry-run", action="store_true", help="list the cases and the rows it would write; no GPU")
    return p.parse_args(argv)


def forced_device(name: str, num_sms: int):
    """``--device-table arch_sm_XY`` -> the device facts the launches are resolved with: no table of its own
    (``default``), capability (X, Y), this GPU's SM count; empty name -> None."""
    import re

    from dsv4_sm120.attention.config import Device

    if not name:
        return None
    m = re.fullmatch(r"arch_sm_(\d+)(\d)", name)
    if not m:
        raise UsageError(f"--device-table must name an architecture table such as arch_sm_120, got {name!r}")
    return Device("default", (int(m.group(1)), int(m.group(2))), int(num_sms))


class UsageError(Exception):
    pass


def plan(args):
    """[(case, layout, H, [B...], with_variants, context, rows per request)] and the variant texts; bad names
    raise UsageError."""
    names = []
    for item in (x.strip() for x in args.cases.split(",")):
        if not item:
            continue
        if item in GROUPS:
            names += GROUPS[item]
        elif item in CASES:
            names.append(item)
        else:
            raise UsageError(f"unknown case {item!r}; cases: {', '.join(CASES)}; groups: {', '.join(GROUPS)}")
    vcases = [x.strip() for x in args.variant_cases.split(",") if x.strip()]
    for c in vcases:
        if c not in CASES:
            raise UsageError(f"--variant-cases: unknown case {c!r}; cases: {', '.join(CASES)}")
    try:
        batches = [int(x) for x in args.batches.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--batches must be comma-separated integers, got {args.batches!r}") from None
    if any(b < 1 for b in batches):
        raise UsageError("--batches must be positive")
    modes = [m for m in args.qk_modes.split(",") if m]
    if not modes or any(m not in ("bf16", "fp8") for m in modes):
        raise UsageError(f"--qk-modes must be a comma list of bf16, fp8; got {args.qk_modes!r}")
    variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    ref = args.targets_reference.strip()
    if ref and not (7 <= len(ref) <= 40 and all(c in "0123456789abcdef" for c in ref.lower())):
        raise UsageError(f"--targets-reference must be a commit id (7-40 hex digits), got {args.targets_reference!r}")
    out = []
    for n in dict.fromkeys(names):
        layout, H, bs = CASES[n]
        out.append((n, layout, H, batches or list(bs), n in vcases, CASE_CONTEXT.get(n, args.context),
                    CASE_ROWS_PER_REQUEST.get(n, 1)))
    return out, variants, modes


def variants_note(cases, variants, variant_cases: str):
    """The note for --variants that no chosen case runs (each runs only at --variant-cases, default tp4_decode; `make
    bench-attention` always passes its ATTN_VARIANTS), or None."""
    if not variants or any(c[4] for c in cases) or not cases:
        return None
    return (f"note: --variants run only at the --variant-cases ({variant_cases or 'none'}), and none of the chosen "
            f"cases is one of them: only the default launch is timed (add --variant-cases {cases[0][0]} to time them)")


def check_variants(variants):
    """Validate the variant texts and the launch candidates with the kernel's torch-free parser (a typo fails
    before any GPU work); the kernel validates them again when it runs."""
    from dsv4_sm120.attention.config import parse_config
    from dsv4_sm120.dev.launch_sweep import SweepError, attention_entry

    for texts in LAUNCH_CANDIDATES.values():
        for t in texts:
            try:
                attention_entry(t)
            except SweepError as exc:
                raise UsageError(str(exc)) from None

    for v in variants:
        try:
            parse_config(v, f"--variants item {v!r}")
        except ValueError as exc:
            raise UsageError(str(exc)) from None


def dry_run(args, cases, variants, modes, command):
    impls = [s for s in args.impls.split(",") if s]
    print(f"results file: {args.results}")
    print(f"command recorded: {command}")
    print(",".join(R.columns("attention")))
    n = 0
    for case, layout, H, bs, with_v, ctx, _ in cases:
        for B in bs:
            names = []
            if case.startswith("launch"):
                names += [(f"ours-{m}", v) for m in modes for v in LAUNCH_CANDIDATES[(H, m)]]
            else:
                if "ours" in impls:
                    names += [(f"ours-{m}", v or "default") for m in modes
                              for v in [""] + (variants if with_v else [])]
                names += [(b, "default") for b in BASELINES if b.split("-")[0] in impls]
                if "floor" in impls:
                    names.append((FLOOR, "default"))
                if "mma" in impls and H <= MMA_FLOOR_MAX_HEADS:
                    names.append((MMA_FLOOR, "default"))
            for impl, variant in names:
                row = R.make_row("attention", case=case, variant=variant, impl=impl, layout=layout, heads=H,
                                 batch=B, context=ctx, date=R.now(), command=command,
                                 notes="" if impl.startswith("ours") or impl == FLOOR else
                                 "Hopper only" if impl == MMA_FLOOR else "if present")
                print(R.csv_line("attention", row))
                n += 1
    print(f"{n} rows at most (baselines only where present; GPU, versions, us, GB/s, rel_err filled when run)")
    return 0


def main(argv=None):
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    command = "python3 bench/bench_attention.py " + " ".join(shlex.quote(a) for a in argv)
    try:
        cases, variants, modes = plan(args)
        check_variants(variants)
        forced_device(args.device_table, 1)
    except UsageError as exc:
        print(f"bench_attention: error: {exc}", file=sys.stderr)
        return 2
    note = variants_note(cases, variants, args.variant_cases)
    if note:
        print(f"bench_attention: {note}", file=sys.stderr)
    if args.dry_run:
        return dry_run(args, cases, variants, modes, command)
    error = R.missing_gpu("bench_attention")
    if error:
        print(error, file=sys.stderr)
        return 2
    import torch

    from dsv4_sm120.attention import launch

    launch.DEVICE_OVERRIDE = forced_device(args.device_table, torch.cuda.get_device_properties(0).multi_processor_count)
    env = R.environment(REPO, command)
    bl = Baselines(args, torch)
    for k, v in bl.notes.items():
        print(f"note: {k}: {v}", flush=True)
    rows = []
    for case, layout, H, bs, with_v, ctx, per in cases:
        for B in bs:
            got = run_point(args, torch, bl, case, layout, B, H, variants if with_v else [], modes, env, ctx, per)
            R.append_rows(args.results, "attention", got)  # per point: an interrupted run keeps what it measured
            rows += got
    print(R.render_table("attention", rows, env["gpu"], all_variants=True) if rows else "no rows measured")
    print("\n".join(R.best_variants([r for r in rows if not r["case"].startswith("launch")])))
    for shares in (floor_share_table(rows),
                   floor_share_table(rows, "mma_share", "MMA floor share (mma-floor us / impl us: the body's MMAs alone):")):
        if shares:
            print(shares)
    reference, ref = None, args.targets_reference.strip().lower()
    if ref:
        reference = [r for r in R.read_rows(args.results, "attention")
                     if r["commit"].lower().startswith(ref) and r["gpu"] == env["gpu"] and r["date"] != env["date"]]
        if not reference:
            print(f"note: no rows of commit {ref} on {env['gpu']} in {args.results}: the 1-8-row target is not judged",
                  file=sys.stderr)
    targets = targets_report(rows, reference, ref)
    if targets:
        print(targets)
    if any(r["case"].startswith("launch") for r in rows):
        print(f"launch tables from these rows: python bench/results_table.py launch attention --gpu '{env['gpu']}'"
              + ("" if args.results == REPO / "bench" / "results" / "attention.csv" else f" --results {args.results}"))
    print(f"appended {len(rows)} rows to {args.results}")
    return 0


def run_point(args, torch, bl, case, layout, B, H, variants, modes, env, context, rows_per_req=1):
    from dsv4_sm120.attention import config, launch
    from dsv4_sm120.attention.keys import runs_on
    from dsv4_sm120.attention.reference import rel_fro, sparse_mla_decode_ref

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1234 + B * 131 + H)
    impls = [s for s in args.impls.split(",") if s]
    layers = [make_layer(torch, layout, B, context, gen, dev, rows_per_req) for _ in range(args.layers)]
    qs = [torch.randn(B, 1, H, 512, device=dev, generator=gen).to(torch.bfloat16) for _ in layers]
    sink = torch.randn(H, device=dev, generator=gen)
    scale = 512 ** -0.5
    ntok = valid_tokens(layers[0][0])
    bytes_call = ntok * 584 + B * H * 512 * 2 * 2
    check_rows = sorted({0, B // 2, B - 1})
    ref = None

    def reference():
        kw = layers[0][0]
        sub = {k: (v[check_rows] if k in ROW_KEYS else v) for k, v in kw.items()}
        return sparse_mla_decode_ref(qs[0][check_rows], attn_sink=sink, head_dim_v=512, softmax_scale=scale, **sub)[0]

    # (impl, variant) -> (f(layer_i) returning out [B,1,H,512], graph replay?, notes)
    calls = {}
    launch_sweep = case.startswith("launch")
    if launch_sweep:
        impls = ["ours"]  # a launch sweep times our candidates only
    if "ours" in impls:
        for mode in modes:
            for v in (LAUNCH_CANDIDATES[(H, mode)] if launch_sweep else [""] + variants):
                ov = config.parse_config(v, f"--variants item {v!r}")
                if mode == "fp8" and ov.get("impl") in config.BF16_ONLY_IMPLS:
                    continue  # bf16-only bodies refuse fp8 QK
                cap = (launch.DEVICE_OVERRIDE or launch.device_facts(dev)).capability
                if not runs_on(ov.get("impl"), cap[0]):
                    continue  # a body this architecture does not run (refused by the launch)

                def f(i, mode=mode, v=v):
                    return launch.sparse_mla_decode(qs[i], attn_sink=sink, head_dim_v=512, softmax_scale=scale,
                                                    qk_mode=mode, launch=v or None, **layers[i][0])[0]

                forced = launch.DEVICE_OVERRIDE
                # another architecture's launch: its rows carry the table in the variant label (never taken for
                # this GPU's own default rows) and in the notes
                label = (v or "default") + (f" @{args.device_table}" if forced else "")
                calls[(f"ours-{mode}", label)] = (
                    f, True, f"device_table={args.device_table}; device_sms={forced.num_sms}" if forced else "")
    pad = max(64, H)
    q64 = [torch.zeros(B, 1, pad, 512, device=dev, dtype=torch.bfloat16) for _ in layers]
    for i in range(len(layers)):
        q64[i][:, :, :H] = qs[i]
    sink64 = torch.zeros(pad, device=dev)
    sink64[:H] = sink
    if "flashmla" in impls and bl.flashmla is not None:
        metas = [bl.flashmla.get_mla_metadata()[0] for _ in layers]

        def f(i):
            kw = layers[i][0]
            o = bl.flashmla.flash_mla_with_kvcache(
                q=q64[i], k_cache=kw["k_cache"], block_table=None, cache_seqlens=None, head_dim_v=512,
                tile_scheduler_metadata=metas[i], softmax_scale=scale, is_fp8_kvcache=True,
                indices=kw["indices"], attn_sink=sink64, extra_k_cache=kw.get("extra_k_cache"),
                extra_indices_in_kvcache=kw.get("extra_indices_in_kvcache"), topk_length=kw["topk_length"],
                extra_topk_length=kw.get("extra_topk_length"), use_legacy=True)[0]
            return o[:, :, :H]

        calls[("flashmla", "default")] = (f, True, f"q padded to {pad} heads")
    def sglang_call(fn, q, kw, sink_):
        """SGLang's sparse decode entry points share FlashMLA's positional signature; -> out."""
        return fn(q, kw["k_cache"], kw["indices"], kw["topk_length"], sink_, 512, scale, kw.get("extra_k_cache"),
                  kw.get("extra_indices_in_kvcache"), kw.get("extra_topk_length"))[0]

    if "flashinfer" in impls and bl.flashinfer is not None:
        def f(i):
            return sglang_call(bl.flashinfer, qs[i], layers[i][0], sink)

        calls[("flashinfer", "default")] = (f, True, "")
    if "upstream" in impls and bl.upstream is not None and B <= args.upstream_max_batch:
        def f(i):
            return sglang_call(bl.upstream, q64[i], layers[i][0], sink64)[:, :, :H]

        calls[("upstream-triton", "default")] = (f, True, f"q padded to {pad} heads")
    if "torch" in impls and bl.torch_fwd is not None and B <= args.torch_max_batch:
        def f(i):
            return sglang_call(bl.torch_fwd, qs[i], layers[i][0], sink)

        calls[("torch-eager", "default")] = (f, False, "eager, no graph")

    rows = []
    floor_us = None
    if "floor" in impls and not launch_sweep:
        row, floor_us = time_floor(args, torch, layers, qs, check_rows, bytes_call)
        rows.append(R.make_row("attention", case=case, impl=FLOOR, layout=layout, heads=H, batch=B, context=context,
                               notes=row.pop("notes"), **row, **env))
        print_row(rows[-1])
    mma_us = None
    if "mma" in impls and not launch_sweep:
        row, mma_us = time_mma_floor(args, torch, H, layers)
        if row is not None:
            rows.append(R.make_row("attention", case=case, impl=MMA_FLOOR, layout=layout, heads=H, batch=B,
                                   context=context, notes=row.pop("notes"), **row, **env))
            print_row(rows[-1])
    for (impl, variant), (f, graph, note) in calls.items():
        res = dict(us=None, gbps=None, rel_err=None)
        notes = [f"layers={args.layers}"] + ([note] if note else [])
        try:
            out0 = f(0)
            torch.cuda.synchronize()
            if ref is None:
                ref = reference()
            res["rel_err"] = rel_fro(out0[check_rows], ref)
            us, spread = time_call(torch, f, len(layers), graph, args.replays)
            res.update(us=round(us, 2), gbps=round(bytes_call / us / 1e3, 1))
            notes.append(f"spread_us={spread:.2f}")
            if graph and impl.startswith("ours") and not torch.equal(f(0), out0):
                notes.append("graph_equals_eager=false")  # graph replay must equal eager
            if floor_us and impl in SHARE_IMPLS:
                notes.append(f"floor_share={floor_us / us:.3f}")
            if mma_us and impl.startswith("ours"):
                notes.append(f"mma_share={mma_us / us:.3f}")
        except Exception as e:  # noqa: BLE001 - one failing impl must not stop the others
            notes.append("error=" + f"{type(e).__name__}: {str(e)[:300]}".replace(";", ","))
        row = R.make_row("attention", case=case, variant=variant, impl=impl, layout=layout, heads=H, batch=B,
                         context=context, notes="; ".join(notes), **res, **env)
        print_row(row)
        rows.append(row)
    del layers
    torch.cuda.empty_cache()
    return rows


def print_row(row):
    print(",".join(row[c] for c in ("case", "impl", "variant", "batch", "us", "gbps", "rel_err", "notes")), flush=True)


if __name__ == "__main__":
    sys.exit(main())
