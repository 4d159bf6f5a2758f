#!/usr/bin/env python3
"""Benchmark DeepSeek-V4 sparse MLA decode: dsv4_sm120's Triton kernel against the baselines present.

Per point (batch B, heads H, layout): microseconds per call under CUDA-graph replay (several
"layers" with their own caches per graph, so the caches do not sit in L2), achieved GB/s (bytes of
the valid KV tokens read + q + out, per call), and correctness (relative Frobenius error of out
against a float64 reference on a few rows).

Baselines, each used when present:
* ``flashmla``: sgl-flash-mla (``flash_mla.flash_mla_with_kvcache``, ``use_legacy=True``, V4 layout,
  q padded to 64 heads) on sm_90 / sm_100;
* ``flashinfer``: SGLang's FlashInfer sm_120 path (``_flash_mla_flashinfer``) on sm_120 with SGLang;
* ``upstream``: SGLang's Triton fallback ``flash_mla_sparse_decode_triton`` (q padded to 64 heads as
  SGLang does), from the installed SGLang or from ``--upstream-file``;
* ``torch``: SGLang's torch reference ``_sm120_sparse_decode_fwd`` (eager: it syncs the host).

Layouts: ``swa128+c4`` (main SWA cache, page 256, 128 candidates + c4 cache, page 64, top-512) and
``single512`` (one cache, page 256, 512 candidates).

Example: ``python3 bench/bench_attention.py --batches 1,16 --heads 16 --out bench/results/x``
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "overlay"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,4,16,64,128", help="comma list of T (query rows)")
    p.add_argument("--heads", default="16,64", help="comma list of per-rank heads")
    p.add_argument("--layouts", default="swa128+c4,single512", help="comma list of layouts")
    p.add_argument("--impls", default="ours,flashmla,flashinfer,upstream,torch",
                   help="comma list; missing baselines are skipped with a note")
    p.add_argument("--variants", default="", help="';'-separated kernel overrides for ours, e.g. "
                   "'BLOCK_N=64,num_warps=4;waves=4' (each becomes an extra row 'ours-<qk mode>[...]' for every "
                   "--qk-modes entry; bf16-only bodies skip fp8)")
    p.add_argument("--variant-layouts", default="swa128+c4",
                   help="layouts at which --variants run (each variant is a few Triton compiles per shape)")
    p.add_argument("--variant-heads", default="16", help="per-rank head counts at which --variants run")
    p.add_argument("--qk-modes", default="bf16", help="comma list of ours' qk modes (bf16, fp8)")
    p.add_argument("--layers", type=int, default=4, help="caches per graph (defeats L2 reuse)")
    p.add_argument("--context", type=int, default=16384, help="tokens of context per row (c4 range = context/4)")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--upstream-file", default="", help="path of SGLang's flash_mla_sm120_triton.py if SGLang is absent")
    p.add_argument("--sglang-sm120-file", default="", help="path of SGLang's flash_mla_sm120.py (torch baseline) if SGLang is absent")
    p.add_argument("--torch-max-batch", type=int, default=16, help="skip the eager torch baseline above this B")
    p.add_argument("--upstream-max-batch", type=int, default=128)
    p.add_argument("--out", default="", help="write OUT.json and OUT.md (atomically)")
    return p.parse_args(argv)


def atomic_write(path, text):
    d = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp_")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def load_file_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def stub_sglang_for_file():
    """flash_mla_sm120.py imports sglang.srt.environ / sglang.srt.utils; give it minimal stand-ins."""
    import types

    if "sglang.srt.environ" in sys.modules:
        return
    sg = types.ModuleType("sglang")
    srt = types.ModuleType("sglang.srt")
    env = types.ModuleType("sglang.srt.environ")
    utl = types.ModuleType("sglang.srt.utils")

    class _E:
        def get(self):
            return "torch"

    class _Envs:
        def __getattr__(self, k):
            return _E()

    env.envs = _Envs()
    utl.is_hip = lambda: False
    sg.srt = srt
    for k, v in {"sglang": sg, "sglang.srt": srt, "sglang.srt.environ": env, "sglang.srt.utils": utl}.items():
        sys.modules.setdefault(k, v)


class Baselines:
    def __init__(self, args, torch):
        self.notes = {}
        self.upstream = None
        self.torch_fwd = None
        self.flashinfer = None
        self.flashmla = None
        try:
            from sglang.kernels.ops.attention import flash_mla_sm120 as m  # noqa

            self.torch_fwd = m._sm120_sparse_decode_fwd
            if torch.cuda.get_device_capability()[0] == 12:
                self.flashinfer = m._flash_mla_flashinfer
            from sglang.kernels.ops.attention.flash_mla_sm120_triton import flash_mla_sparse_decode_triton

            self.upstream = flash_mla_sparse_decode_triton
        except Exception as e:
            self.notes["sglang"] = f"not importable: {type(e).__name__}: {e}"
        pristine = os.path.expanduser("~/.cache/dsv4_sm120/pristine/sglang/kernels/ops/attention")
        if not args.upstream_file and os.path.exists(os.path.join(pristine, "flash_mla_sm120_triton.py")):
            args.upstream_file = os.path.join(pristine, "flash_mla_sm120_triton.py")
        if not args.sglang_sm120_file and os.path.exists(os.path.join(pristine, "flash_mla_sm120.py")):
            args.sglang_sm120_file = os.path.join(pristine, "flash_mla_sm120.py")
        if self.upstream is None and args.upstream_file:
            try:
                self.upstream = load_file_module("_up_triton", args.upstream_file).flash_mla_sparse_decode_triton
            except Exception as e:
                self.notes["upstream"] = f"{type(e).__name__}: {e}"
        if self.torch_fwd is None and args.sglang_sm120_file:
            try:
                stub_sglang_for_file()
                self.torch_fwd = load_file_module("_sg_sm120", args.sglang_sm120_file)._sm120_sparse_decode_fwd
            except Exception as e:
                self.notes["torch"] = f"{type(e).__name__}: {e}"
        if torch.cuda.get_device_capability()[0] in (9, 10):
            try:
                import flash_mla

                self.flashmla = flash_mla
            except Exception as e:
                self.notes["flashmla"] = f"{type(e).__name__}: {e}"
        else:
            self.notes["flashmla"] = "FlashMLA runs on sm_90/sm_100 only"
        if self.flashinfer is None and torch.cuda.get_device_capability()[0] == 12:
            self.notes.setdefault("flashinfer", "needs SGLang + FlashInfer on sm_120")


def make_layer(torch, layout, B, context, gen, device):
    from dsv4_sm120.attention.cache import random_cache_device

    swa = layout.startswith("swa")
    K = 128 if swa else 512
    # main: page 256; each row owns two pages, its window starts at a random offset
    span = 512 if swa else max(1024, context)
    pages_per_row = span // 256
    main = random_cache_device(B * pages_per_row + 1, 256, device, generator=gen)
    if swa:
        start = torch.randint(0, 256, (B, 1), device=device, generator=gen)
        slots = start + torch.arange(K, device=device)[None, :]
    else:
        slots = torch.rand(B, span, device=device, generator=gen).argsort(1)[:, :K]
    base = (torch.arange(B, device=device) * span)[:, None]
    idx = (base + slots).to(torch.int32).view(B, 1, K)
    kw = dict(k_cache=main.view, indices=idx, topk_length=torch.full((B,), K, dtype=torch.int32, device=device))
    raws = [main.raw]
    if swa:
        c = max(1024, context // 4)
        extra = random_cache_device(B * (c // 64), 64, device, generator=gen)
        e = torch.rand(B, c, device=device, generator=gen).argsort(1)[:, :512]
        eidx = ((torch.arange(B, device=device) * c)[:, None] + e).to(torch.int32).view(B, 1, 512)
        kw.update(extra_k_cache=extra.view, extra_indices_in_kvcache=eidx,
                  extra_topk_length=torch.full((B,), 512, dtype=torch.int32, device=device))
        raws.append(extra.raw)
    return kw, raws


def valid_tokens(kw):
    n = int(kw["indices"].shape[0] * kw["indices"].shape[-1])
    if "extra_indices_in_kvcache" in kw:
        n += int(kw["extra_indices_in_kvcache"].shape[0] * kw["extra_indices_in_kvcache"].shape[-1])
    return n


def main(argv=None):
    args = parse_args(argv)
    import torch

    from dsv4_sm120.attention import kernel as K

    variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    for v in variants:
        try:
            K.parse_config(v, f"--variants item {v!r}")  # a typo fails here, before any GPU work
        except K.DecodeInputError as exc:
            print(f"bench_attention: error: {exc}", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA device; nothing to measure", file=sys.stderr)
        return 2
    import triton

    from dsv4_sm120.attention.reference import rel_fro, sparse_mla_decode_ref

    dev = torch.device("cuda")
    bl = Baselines(args, torch)
    impls = [s for s in args.impls.split(",") if s]
    qk_modes = [m for m in args.qk_modes.split(",") if m]
    gen = torch.Generator(device=dev).manual_seed(1234)
    meta = dict(
        gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
        sms=torch.cuda.get_device_properties(0).multi_processor_count, torch=torch.__version__,
        triton=triton.__version__, python=platform.python_version(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command="python3 bench/bench_attention.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        notes=bl.notes, layers_per_graph=args.layers, context=args.context,
    )
    print(json.dumps(meta), flush=True)
    rows = []

    def run_point(layout, B, H):
        layers = [make_layer(torch, layout, B, args.context, gen, dev) for _ in range(args.layers)]
        qs = [torch.randn(B, 1, H, 512, device=dev, generator=gen).to(torch.bfloat16) for _ in layers]
        sink = torch.randn(H, device=dev, generator=gen)
        scale = 512 ** -0.5
        ntok = valid_tokens(layers[0][0])
        bytes_call = ntok * 584 + B * H * 512 * 2 * 2
        check_rows = sorted({0, B // 2, B - 1})
        ref = None

        def reference():
            kw = layers[0][0]
            sub = {k: (v[check_rows] if k in ("indices", "topk_length", "extra_indices_in_kvcache", "extra_topk_length") else v)
                   for k, v in kw.items()}
            return sparse_mla_decode_ref(qs[0][check_rows], attn_sink=sink, head_dim_v=512, softmax_scale=scale, **sub)[0]

        # callables: name -> f(layer_i) returning out [B,1,H,512]
        calls = {}
        if "ours" in impls:
            with_variants = (layout in args.variant_layouts.split(",")
                             and str(H) in args.variant_heads.split(","))
            for mode in qk_modes:
                for v in [""] + (variants if with_variants else []):
                    ov = K.parse_config(v, f"--variants item {v!r}")
                    if mode == "fp8" and ov.get("impl") in K.launch_config.BF16_ONLY_IMPLS:
                        continue  # bf16-only bodies (they refuse fp8 QK)
                    name = f"ours-{mode}" + (f"[{v}]" if v else "")

                    def f(i, mode=mode, ov=ov):
                        K.CONFIG_OVERRIDE.clear()
                        K.CONFIG_OVERRIDE.update(ov)
                        try:
                            return K.sparse_mla_decode(qs[i], attn_sink=sink, head_dim_v=512, softmax_scale=scale,
                                                       qk_mode=mode, **layers[i][0])[0]
                        finally:
                            K.CONFIG_OVERRIDE.clear()

                    calls[name] = (f, True)
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

            calls["flashmla(64 heads)"] = (f, True)
        if "flashinfer" in impls and bl.flashinfer is not None:
            def f(i):
                kw = layers[i][0]
                return bl.flashinfer(qs[i], kw["k_cache"], kw["indices"], kw["topk_length"], sink, 512, scale,
                                     kw.get("extra_k_cache"), kw.get("extra_indices_in_kvcache"),
                                     kw.get("extra_topk_length"))[0]

            calls["flashinfer"] = (f, True)
        if "upstream" in impls and bl.upstream is not None and B <= args.upstream_max_batch:
            def f(i):
                kw = layers[i][0]
                return bl.upstream(q64[i], kw["k_cache"], kw["indices"], kw["topk_length"], sink64, 512, scale,
                                   kw.get("extra_k_cache"), kw.get("extra_indices_in_kvcache"),
                                   kw.get("extra_topk_length"))[0][:, :, :H]

            calls["upstream-triton(64 heads)"] = (f, True)
        if "torch" in impls and bl.torch_fwd is not None and B <= args.torch_max_batch:
            def f(i):
                kw = layers[i][0]
                return bl.torch_fwd(qs[i], kw["k_cache"], kw["indices"], kw["topk_length"], sink, 512, scale,
                                    kw.get("extra_k_cache"), kw.get("extra_indices_in_kvcache"),
                                    kw.get("extra_topk_length"))[0]

            calls["torch(eager)"] = (f, False)

        for name, (f, graph) in calls.items():
            row = dict(layout=layout, B=B, H=H, impl=name)
            try:
                out0 = f(0)
                torch.cuda.synchronize()
                if ref is None:
                    ref = reference()
                row["rel_err"] = rel_fro(out0[check_rows], ref)
                for i in range(len(layers)):
                    f(i)
                torch.cuda.synchronize()
                if graph:
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        for i in range(len(layers)):
                            f(i)
                    torch.cuda.current_stream().wait_stream(s)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        for i in range(len(layers)):
                            f(i)
                    run = g.replay
                else:
                    def run():
                        for i in range(len(layers)):
                            f(i)
                for _ in range(3):
                    run()
                torch.cuda.synchronize()
                samples = []
                n = args.replays if graph else max(3, args.replays // 10)
                for _ in range(5):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    for _ in range(n):
                        run()
                    e1.record()
                    torch.cuda.synchronize()
                    samples.append(e0.elapsed_time(e1) * 1000.0 / (n * len(layers)))
                us = statistics.median(samples)
                row.update(us=round(us, 2), spread_us=round(max(samples) - min(samples), 2),
                           gbps=round(bytes_call / us / 1e3, 1), graph=graph)
                if graph and name.startswith("ours"):
                    # graph replay must equal eager
                    row["graph_equals_eager"] = bool(torch.equal(f(0), out0))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
        del layers
        torch.cuda.empty_cache()

    for layout in [s for s in args.layouts.split(",") if s]:
        for H in [int(x) for x in args.heads.split(",") if x]:
            for B in [int(x) for x in args.batches.split(",") if x]:
                run_point(layout, B, H)

    md = render(meta, rows)
    print(md)
    if args.out:
        atomic_write(args.out + ".json", json.dumps(dict(meta=meta, rows=rows), indent=1))
        atomic_write(args.out + ".md", md)
    return 0


def render(meta, rows):
    lines = [f"# sparse MLA decode: {meta['gpu']} (sm_{meta['capability'][0]}{meta['capability'][1]}, "
             f"{meta['sms']} SMs), torch {meta['torch']}, triton {meta['triton']}, {meta['date']}", "",
             f"Command: `{meta['command']}`", "",
             f"us per call under CUDA-graph replay ({meta['layers_per_graph']} layers with their own caches "
             "per graph), GB/s of valid KV tokens + q + out, rel_err = relative Frobenius error of out vs "
             "float64 on 3 rows.", ""]
    for k, v in meta["notes"].items():
        lines.append(f"- {k}: {v}")
    lines.append("")
    keys = sorted({(r["layout"], r["H"]) for r in rows}, key=lambda x: (x[0], x[1]))
    for layout, H in keys:
        sel = [r for r in rows if r["layout"] == layout and r["H"] == H]
        impls = list(dict.fromkeys(r["impl"] for r in sel))
        Bs = sorted({r["B"] for r in sel})
        lines.append(f"## {layout}, H={H}")
        lines.append("")
        lines.append("| impl | " + " | ".join(f"B={b} us (GB/s, err)" for b in Bs) + " |")
        lines.append("| --- | " + " | ".join("---" for _ in Bs) + " |")
        for im in impls:
            cells = []
            for b in Bs:
                r = next((x for x in sel if x["impl"] == im and x["B"] == b), None)
                if r is None:
                    cells.append("-")
                elif "error" in r:
                    cells.append("error")
                else:
                    cells.append(f"{r['us']:.1f} ({r['gbps']:.0f}, {r['rel_err']:.1e})")
            lines.append(f"| {im} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += best_variants(rows)
    errs = [r for r in rows if "error" in r]
    if errs:
        lines.append("Errors:")
        for r in errs:
            lines.append(f"- {r['layout']} B={r['B']} H={r['H']} {r['impl']}: {r['error']}")
    return "\n".join(lines) + "\n"


def best_variants(rows):
    """Per (layout, H, qk mode): the fastest of ours' default and its --variants rows at each B, and the
    DSV4_SM120_ATTN_CONFIG line that picks a variant which is never slower than the default by more than 2%
    and faster by more than 3% somewhere (so the user's box can adopt what won there)."""
    ours = [r for r in rows if r["impl"].startswith("ours-") and "error" not in r and "us" in r]
    groups = sorted({(r["layout"], r["H"], r["impl"].split("[")[0]) for r in ours})
    lines = []
    for layout, H, base in groups:
        sel = [r for r in ours if r["layout"] == layout and r["H"] == H and r["impl"].split("[")[0] == base]
        variants = sorted({r["impl"][len(base) + 1:-1] for r in sel if "[" in r["impl"]})
        if not variants:
            continue
        Bs = sorted({r["B"] for r in sel})
        default = {r["B"]: r["us"] for r in sel if r["impl"] == base}
        cells, candidates = [], []
        for b in Bs:
            at_b = [r for r in sel if r["B"] == b]
            best = min(at_b, key=lambda r: r["us"])
            name = best["impl"][len(base) + 1:-1] if "[" in best["impl"] else "default"
            ref = default.get(b)
            cells.append(f"B={b}: {name} {best['us']:.1f} us" + (f" ({ref / best['us']:.2f}x)" if ref else ""))
        for v in variants:
            us = {r["B"]: r["us"] for r in sel if r["impl"] == f"{base}[{v}]"}
            if all(b in us and b in default for b in Bs):
                ratios = [default[b] / us[b] for b in Bs]
                if min(ratios) >= 0.98 and max(ratios) > 1.03:
                    candidates.append((sum(ratios) / len(ratios), v))
        lines.append(f"Best of ours at {layout}, H={H}, {base}: " + "; ".join(cells) + ".")
        if candidates:
            gain, v = max(candidates)
            qk = " DSV4_SM120_ATTN_QK=fp8" if base == "ours-fp8" else ""
            lines.append(f"Variant never >2% slower and >3% faster somewhere (mean {gain:.2f}x): "
                         f"`DSV4_SM120_ATTN_CONFIG='{v}'{qk}` (serve scripts pass the environment through).")
        else:
            lines.append("No variant beats the default across these batch sizes: keep the default.")
        lines.append("")
    return lines


if __name__ == "__main__":
    sys.exit(main())
