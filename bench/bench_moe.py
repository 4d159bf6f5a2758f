#!/usr/bin/env python3
"""Benchmark the Triton NVFP4 fused MoE at DeepSeek-V4-Flash TP4 shapes.

For each M (tokens) it times, with CUDA-graph replay:
  * ``nvfp4`` — :func:`dsv4_sm120.moe.nvfp4_fused_moe` on its default path for
    this GPU (``fp4`` = native FP4 tensor cores on sm_100/sm_120, ``bf16`` =
    in-kernel upcast elsewhere), and with ``--all-paths`` the other path too;
  * ``fp8`` — a W8A8 block-scaled FP8 MoE baseline: our own simple Triton
    kernel in this file (weights e4m3 with one fp32 scale per 128x128 block,
    activations quantized per token and 128-column group in-kernel, like
    DeepSeek's FP8 recipe), same routing / reduction kernels as ``nvfp4``;
  * ``bf16`` — the same baseline kernel with plain bf16 weights.
Reported: time per call, the weight bytes the step must read (distinct active
experts x bytes per expert, scales included), achieved weight bandwidth and
its share of the GPU's measured device-to-device copy bandwidth
(bytes read + written / time).

Each replay runs ``--rotate`` calls with different routings, whose expert
sets are spread over all experts, so weights come from HBM and not from L2.

  python bench/bench_moe.py                 # full table (H 4096, I 512, E 256, k 6)
  python bench/bench_moe.py --out bench/results/moe_h200.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "overlay"))

try:  # the kernels below need triton; --help does not
    import torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    torch = triton = tl = None


if triton is not None:

    @triton.jit
    def _base_gemm1(x_ptr, w_ptr, s_ptr, sorted_ptr, be_ptr, h_ptr, P, TOPK, H, I,
                    stride_we, stride_wn, stride_se, stride_sn, swiglu_limit,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(be_ptr + pid_m)
        if e >= 0:
            e64 = e.to(tl.int64)
            rows = pid_m * BM + tl.arange(0, BM)
            pair = tl.load(sorted_ptr + rows)
            rvalid = pair < P
            tok = tl.where(rvalid, pair // TOPK, 0).to(tl.int64)
            offs_n = pid_n * BN + tl.arange(0, BN)
            kk = tl.arange(0, BK)
            a_row = x_ptr + tok[:, None] * H
            wg_p = w_ptr + e64 * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + kk[:, None]
            wu_p = wg_p + I * stride_wn
            sg_p = s_ptr + e64 * stride_se + (offs_n // 128) * stride_sn
            su_p = s_ptr + e64 * stride_se + ((offs_n + I) // 128) * stride_sn
            acc_g = tl.zeros([BM, BN], dtype=tl.float32)
            acc_u = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(0, H, BK):
                a = tl.load(a_row + k0 + kk[None, :], mask=rvalid[:, None], other=0.0)
                wg = tl.load(wg_p + k0)
                wu = tl.load(wu_p + k0)
                if FP8:
                    af = a.to(tl.float32)
                    am = tl.max(tl.abs(af), axis=1)
                    sa = tl.where(am > 0, am / 448.0, 1.0)
                    aq = (af / sa[:, None]).to(tl.float8e4nv)
                    sg = tl.load(sg_p + k0 // 128)
                    su = tl.load(su_p + k0 // 128)
                    acc_g += tl.dot(aq, wg) * (sa[:, None] * sg[None, :])
                    acc_u += tl.dot(aq, wu) * (sa[:, None] * su[None, :])
                else:
                    acc_g = tl.dot(a, wg, acc_g)
                    acc_u = tl.dot(a, wu, acc_u)
            g = tl.minimum(acc_g, swiglu_limit)
            u = tl.minimum(tl.maximum(acc_u, -swiglu_limit), swiglu_limit)
            h = g / (1.0 + tl.exp(-g)) * u
            tl.store(h_ptr + rows[:, None].to(tl.int64) * I + offs_n[None, :], h.to(tl.bfloat16),
                     mask=rvalid[:, None])

    @triton.jit
    def _base_gemm2(h_ptr, w_ptr, s_ptr, sorted_ptr, be_ptr, tw_ptr, y_ptr, P, H, I,
                    stride_we, stride_wn, stride_se, stride_sn,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(be_ptr + pid_m)
        if e >= 0:
            e64 = e.to(tl.int64)
            rows = pid_m * BM + tl.arange(0, BM)
            pair = tl.load(sorted_ptr + rows)
            rvalid = pair < P
            offs_n = pid_n * BN + tl.arange(0, BN)
            kk = tl.arange(0, BK)
            a_row = h_ptr + rows[:, None].to(tl.int64) * I
            w_p = w_ptr + e64 * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + kk[:, None]
            s_p = s_ptr + e64 * stride_se + (offs_n // 128) * stride_sn
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(0, I, BK):
                a = tl.load(a_row + k0 + kk[None, :], mask=rvalid[:, None], other=0.0)
                w = tl.load(w_p + k0)
                if FP8:
                    af = a.to(tl.float32)
                    am = tl.max(tl.abs(af), axis=1)
                    sa = tl.where(am > 0, am / 448.0, 1.0)
                    aq = (af / sa[:, None]).to(tl.float8e4nv)
                    sw = tl.load(s_p + k0 // 128)
                    acc += tl.dot(aq, w) * (sa[:, None] * sw[None, :])
                else:
                    acc = tl.dot(a, w, acc)
            tw = tl.load(tw_ptr + tl.where(rvalid, pair, 0), mask=rvalid, other=0.0)
            y = acc * tw[:, None]
            tl.store(y_ptr + tl.where(rvalid, pair, 0).to(tl.int64)[:, None] * H + offs_n[None, :], y,
                     mask=rvalid[:, None])


def baseline_moe(x, w13, s13, w2, s2, tw, ids, limit, fp8):
    """W8A8 block-FP8 (fp8=True) or bf16 MoE with the same routing / reduce
    kernels as the NVFP4 one. ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` (e4m3 or
    bf16); ``s13 [E, 2I/128, H/128]``, ``s2 [E, H/128, I/128]`` fp32."""
    from dsv4_sm120.moe import kernels as K

    M, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    k = ids.shape[1]
    P = M * k
    per = P / max(1, min(E, P))
    if per <= 16:
        BM, BN1, BN2, w = 16, 64, 64, 4
    elif per <= 48:
        BM, BN1, BN2, w = 32, 64, 128, 4
    else:
        BM, BN1, BN2, w = 64, 128, 128, 8
    BK = 128
    stages = 2 if BM == 64 else 3  # bf16 at 64x128x128 x 3 stages exceeds the H200's shared memory
    idv = ids.view(-1)
    max_blocks = triton.cdiv(P, BM) + min(E, P)
    sp = torch.empty(max_blocks * BM, dtype=torch.int32, device=x.device)
    be = torch.empty(max_blocks, dtype=torch.int32, device=x.device)
    e_pad = triton.next_power_of_2(E)
    K._align_kernel[(1,)](idv, sp, be, P, E, max_blocks * BM, max_blocks, BM=BM, E_PAD=e_pad,
                          CHUNK=max(16, min(128, 16384 // e_pad)), FILL=1024,
                          BCHUNK=max(16, min(64, 8192 // e_pad)), num_warps=8)
    h = torch.empty((max_blocks * BM, I), dtype=torch.bfloat16, device=x.device)
    y = torch.empty((P, H), dtype=torch.float32, device=x.device)
    _base_gemm1[(max_blocks, triton.cdiv(I, BN1))](
        x, w13, s13, sp, be, h, P, k, H, I, w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
        float(limit), BM=BM, BN=BN1, BK=BK, FP8=fp8, num_warps=w, num_stages=stages)
    _base_gemm2[(max_blocks, triton.cdiv(H, BN2))](
        h, w2, s2, sp, be, tw.view(-1), y, P, H, I, w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        BM=BM, BN=BN2, BK=BK, FP8=fp8, num_warps=w, num_stages=stages)
    out = torch.empty((M, H), dtype=torch.bfloat16, device=x.device)
    K._reduce_kernel[(M, triton.cdiv(H, 1024))](y, idv, out, H, E, TOPK=k, BLOCK=1024)
    return out


def copy_bandwidth():
    """Device-to-device copy of 2 GiB: (bytes read + written) / median time, GB/s."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint16, device="cuda").random_(0, 1 << 15)
    b = torch.empty_like(a)
    ts = []
    for i in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        if i >= 2:
            ts.append(s.elapsed_time(e))
    del a, b
    return 2 * 2 * n / (statistics.median(ts) * 1e-3) / 1e9


def time_graph(fns, reps):
    """Median microseconds per call: the calls in ``fns`` captured in one graph."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    del g
    return statistics.median(ts) * 1e3 / len(fns)


def _routings(M, E, k, n, gen_seed):
    g = torch.Generator(device="cuda").manual_seed(gen_seed)
    out = []
    for _ in range(n):
        ids = torch.rand((M, E), generator=g, device="cuda").argsort(dim=1)[:, :k].to(torch.int32).contiguous()
        w = torch.rand((M, k), generator=g, device="cuda") + 0.1
        out.append(((w / w.sum(1, keepdim=True)).float().contiguous(), ids))
    return out


def run(args, ms):
    from dsv4_sm120.moe.fused_moe import Config, choose_config, default_path, nvfp4_fused_moe_impl
    from dsv4_sm120.moe.testing import make_experts

    H, I, E, k = args.hidden, args.inter, args.experts, args.topk
    if args.aload:
        os.environ["DSV4_SM120_MOE_ALOAD"] = args.aload
    if args.align:
        os.environ["DSV4_SM120_MOE_ALIGN"] = args.align
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    cap = torch.cuda.get_device_capability()
    limit = 10.0
    print(f"# {name} sm_{cap[0]}{cap[1]}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth (read+write): {bw:.0f} GB/s", flush=True)
    W = make_experts(E, H, I, 0, device=dev)
    fp4_bytes = (W["w13"].numel() + W["w13_scale"].numel() + W["w2"].numel() + W["w2_scale"].numel()) // E
    base = {}
    if not args.no_baselines:
        gen = torch.Generator(device="cuda").manual_seed(1)
        w13b = (torch.randn((E, 2 * I, H), generator=gen, device=dev) * H ** -0.5).to(torch.bfloat16)
        w2b = (torch.randn((E, H, I), generator=gen, device=dev) * I ** -0.5).to(torch.bfloat16)
        s13 = torch.full((E, 2 * I // 128, H // 128), 2.0 / 448, device=dev)
        s2 = torch.full((E, H // 128, I // 128), 2.0 / 448, device=dev)
        w13f = (w13b.float() * 448 * 0.5).to(torch.float8_e4m3fn)
        w2f = (w2b.float() * 448 * 0.5).to(torch.float8_e4m3fn)
        base["fp8"] = (w13f, s13, w2f, s2, True, (w13f.numel() + w2f.numel()) // E + (s13.numel() + s2.numel()) * 4 // E)
        base["bf16"] = (w13b, s13, w2b, s2, False, (w13b.numel() + w2b.numel()) * 2 // E)
    dpath = default_path(dev)
    check_lines = []
    if not args.no_check:
        from dsv4_sm120.moe.reference import moe_reference, rel_err

        tw_c, ids_c = _routings(64, E, k, 1, 7)[0]
        ids_c[::5, 0] = -1  # some dropped slots
        x_c = (torch.randn((64, H), device=dev) * 2).to(torch.bfloat16)
        ref = moe_reference(x_c, **W, topk_weights=tw_c, topk_ids=ids_c, swiglu_limit=limit)
        refq = moe_reference(x_c, **W, topk_weights=tw_c, topk_ids=ids_c, swiglu_limit=limit, act_quant=True)
        for p in ("bf16", "fp4"):
            try:
                o = nvfp4_fused_moe_impl(x_c, **W, topk_weights=tw_c, topk_ids=ids_c, swiglu_limit=limit, path=p)
                line = (f"correctness M=64 path={p}{' (default)' if p == dpath else ''}: rel err vs float64 "
                        f"{rel_err(o, ref):.2e}" + (f", vs act-quant reference {rel_err(o, refq):.2e} (activation "
                                                     f"quantization alone {rel_err(refq, ref):.2e})" if p == "fp4" else ""))
            except Exception as exc:  # noqa: BLE001
                line = f"correctness M=64 path={p}: failed {type(exc).__name__}: {str(exc)[:200]}"
            print("  " + line, flush=True)
            check_lines.append(line)
    sweep_lines = []
    if args.sweep and dpath == "bf16":
        import dataclasses

        best = {}
        for M in (1, 64):
            routs = _routings(M, E, k, args.rotate, 100 + M)
            active = statistics.mean(float(torch.unique(ids).numel()) for _, ids in routs)
            x0 = (torch.randn((M, H), device=dev) * 2).to(torch.bfloat16)
            ref_cfg = dataclasses.replace(choose_config(M, k, E, H, I, dpath), deq=0)
            tw0, ids0 = routs[0]
            ref_out = nvfp4_fused_moe_impl(x0, **W, topk_weights=tw0, topk_ids=ids0, swiglu_limit=limit,
                                           path=dpath, config=ref_cfg).double()
            variants = [Config(16, 32, 256, 64, 256, 4, 4, 3, 0)] + [
                Config(16, bn1, bk1, bn2, bk2, w, w, 3, deq)
                for deq in (1, 2)
                for (bn1, bk1, bn2, bk2, w) in ((32, 256, 64, 256, 4), (64, 128, 128, 128, 4), (32, 256, 64, 256, 8))]
            for cfg in variants:
                try:
                    o = nvfp4_fused_moe_impl(x0, **W, topk_weights=tw0, topk_ids=ids0, swiglu_limit=limit,
                                             path=dpath, config=cfg).double()
                    diff = ((o - ref_out).norm() / ref_out.norm()).item()
                    fns = [lambda tw=tw, ids=ids, cfg=cfg: nvfp4_fused_moe_impl(
                        x0, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=limit, path=dpath, config=cfg)
                        for (tw, ids) in routs]
                    t = time_graph(fns, max(10, args.reps // 2))
                    line = (f"sweep M={M} deq={cfg.deq} BN1={cfg.BN1} BK1={cfg.BK1} BN2={cfg.BN2} BK2={cfg.BK2} "
                            f"warps={cfg.warps1}: {t:.1f} us, {fp4_bytes * active / t / 1e3:.0f} GB/s, "
                            f"diff vs deq0 {diff:.1e}")
                    if diff < 1e-2 and (M not in best or t < best[M][0]):
                        best[M] = (t, cfg)
                except Exception as exc:  # noqa: BLE001
                    line = f"sweep M={M} {cfg}: failed {type(exc).__name__}: {str(exc)[:200]}"
                print("  " + line, flush=True)
                sweep_lines.append(line)
        if args.deq == "auto" and 64 in best:
            os.environ["DSV4_SM120_MOE_DEQ"] = str(best[64][1].deq)
        for M, (t, cfg) in sorted(best.items()):
            line = f"best M={M}: {t:.1f} us with {cfg}"
            print("  " + line, flush=True)
            sweep_lines.append(line)
    if args.variants and dpath == "bf16":
        import dataclasses

        from dsv4_sm120.moe.reference import moe_reference, rel_err

        sweep_lines.append("variants: rel err = out vs float64 reference (first routing); us = graph replay")
        for M in [int(v) for v in args.variant_m.split(",") if v]:
            routs = _routings(M, E, k, max(1, min(args.rotate, 4096 * 4 // M)), 300 + M)
            active = statistics.mean(float(torch.unique(ids).numel()) for _, ids in routs)
            x0 = (torch.randn((M, H), device=dev) * 2).to(torch.bfloat16)
            tw0, ids0 = routs[0]
            ref = moe_reference(x0, **W, topk_weights=tw0, topk_ids=ids0, swiglu_limit=limit)
            for spec in [v for v in args.variants.split(";") if v.strip()]:
                kv = dict(item.split("=", 1) for item in spec.split(",") if item.strip())
                saved = os.environ.get("DSV4_SM120_MOE_ALIGN")
                try:
                    if "align" in kv:
                        os.environ["DSV4_SM120_MOE_ALIGN"] = kv.pop("align")
                    apre = bool(int(kv.pop("apre"))) if "apre" in kv else None
                    cfg = choose_config(M, k, E, H, I, dpath)
                    cfg = dataclasses.replace(cfg, **{f: int(v) for f, v in kv.items()})
                    o = nvfp4_fused_moe_impl(x0, **W, topk_weights=tw0, topk_ids=ids0, swiglu_limit=limit,
                                             path=dpath, config=cfg, apre=apre)
                    err = rel_err(o, ref)
                    fns = [lambda tw=tw, ids=ids, cfg=cfg: nvfp4_fused_moe_impl(
                        x0, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=limit, path=dpath, config=cfg,
                        apre=apre)
                        for (tw, ids) in routs]
                    t = time_graph(fns, args.reps)
                    line = (f"variant M={M} [{spec}] {cfg}: {t:.1f} us, {fp4_bytes * active / t / 1e3:.0f} GB/s "
                            f"({100 * fp4_bytes * active / t / 1e3 / bw:.1f}% of copy), rel err {err:.2e}")
                except Exception as exc:  # noqa: BLE001
                    line = f"variant M={M} [{spec}]: failed {type(exc).__name__}: {str(exc)[:300]}"
                finally:
                    if saved is None:
                        os.environ.pop("DSV4_SM120_MOE_ALIGN", None)
                    else:
                        os.environ["DSV4_SM120_MOE_ALIGN"] = saved
                print("  " + line, flush=True)
                sweep_lines.append(line)
    if args.deq in ("0", "1", "2", "3", "4"):
        os.environ["DSV4_SM120_MOE_DEQ"] = args.deq
    deq_used = os.environ.get("DSV4_SM120_MOE_DEQ", "default")
    print(f"  main table uses DSV4_SM120_MOE_DEQ={deq_used}", flush=True)
    paths = [dpath] + ([p for p in ("bf16", "fp4") if p != dpath] if args.all_paths else [])
    rows = []
    for M in ms:
        rot = max(1, min(args.rotate, 4096 * 4 // M))
        routs = _routings(M, E, k, rot, 100 + M)
        active = statistics.mean(float(torch.unique(ids).numel()) for _, ids in routs)
        xs = [(torch.randn((M, H), device=dev) * 2).to(torch.bfloat16) for _ in range(min(rot, 4))]
        res = {}
        for p in paths:
            fns = [lambda tw=tw, ids=ids, x=xs[i % len(xs)], p=p: nvfp4_fused_moe_impl(
                x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=limit, path=p)
                for i, (tw, ids) in enumerate(routs)]
            try:
                res[f"nvfp4-{p}"] = (time_graph(fns, args.reps), fp4_bytes)
            except Exception as exc:  # noqa: BLE001
                print(f"  nvfp4-{p} M={M}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        if base and M == ms[0]:
            tw0, ids0 = routs[0]
            ob = baseline_moe(xs[0], *base["bf16"][:4], tw0, ids0, limit, False).double()
            of = baseline_moe(xs[0], *base["fp8"][:4], tw0, ids0, limit, True).double()
            print(f"  sanity: fp8 baseline vs bf16 baseline rel diff {((of - ob).norm() / ob.norm()).item():.3e}",
                  flush=True)
        for bn, (a13, b13, a2, b2, fp8, nbytes) in base.items():
            fns = [lambda tw=tw, ids=ids, x=xs[i % len(xs)]: baseline_moe(x, a13, b13, a2, b2, tw, ids, limit, fp8)
                   for i, (tw, ids) in enumerate(routs)]
            try:
                res[bn] = (time_graph(fns, args.reps), nbytes)
            except Exception as exc:  # noqa: BLE001
                print(f"  {bn} M={M}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        for kname, (t, nbytes) in res.items():
            gbs = nbytes * active / t / 1e3
            rows.append((M, kname, t, active, nbytes * active / 1e6, gbs, gbs / bw))
            print(f"M={M:5d} {kname:12s} {t:9.1f} us  experts {active:6.1f}  weights {nbytes * active / 1e6:8.1f} MB"
                  f"  {gbs:7.0f} GB/s  {100 * gbs / bw:5.1f}% of copy", flush=True)
        cfg = choose_config(M, k, E, H, I, dpath)
        print(f"  (nvfp4 config for M={M}: {cfg})", flush=True)
    lines = [
        f"# MoE benchmark: {name} (sm_{cap[0]}{cap[1]})",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- versions: torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}",
        f"- command: `python bench/bench_moe.py {' '.join(sys.argv[1:])}`",
        f"- shapes: H {H}, I {I}, E {E}, k {k}, swiglu_limit {limit}; random routing (distinct experts per "
        f"token), {args.rotate} routings per CUDA-graph replay (median of {args.reps} replays)",
        f"- measured copy bandwidth (read + write): {bw:.0f} GB/s",
        f"- bf16-path weight decode (DSV4_SM120_MOE_DEQ): {deq_used}; activation load (DSV4_SM120_MOE_ALOAD): "
        f"{os.environ.get('DSV4_SM120_MOE_ALOAD', 'default (split)')}; grouping (DSV4_SM120_MOE_ALIGN): "
        f"{os.environ.get('DSV4_SM120_MOE_ALIGN', 'default (auto)')}",
        f"- nvfp4 default path here: `{dpath}`; `fp8` = this file's Triton W8A8 block-FP8 MoE; `bf16` = same kernel, "
        "bf16 weights; bytes = distinct active experts x weight bytes per expert (scales included)",
        "",
        "| M | kernel | us / call | active experts | weight MB | GB/s | % of copy bw |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for (M, kname, t, active, mb, gbs, frac) in rows:
        lines.append(f"| {M} | {kname} | {t:.1f} | {active:.1f} | {mb:.1f} | {gbs:.0f} | {100 * frac:.1f} |")
    if check_lines:
        lines += ["", "Correctness (float64 reference from exactly dequantized weights):", ""] + [
            f"- {c}" for c in check_lines]
    if sweep_lines:
        lines += ["", "Sweep (nvfp4 bf16 path, tile / weight-decode variants):", "", "```"] + sweep_lines + ["```"]
    text = "\n".join(lines) + "\n"
    print(text)
    out_arg = args.out or str(REPO / "bench" / "results" / ("moe_" + "".join(
        c if c.isalnum() else "_" for c in name) + ".md"))
    if out_arg != "-":
        out = Path(out_arg)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out)
        print(f"wrote {out}")
    return 0



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--m", default="1,4,16,64,128,1024,4096", help="comma-separated token counts M")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=512, help="expert intermediate size per rank (TP4: 512)")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--rotate", type=int, default=16, help="routings per graph replay")
    p.add_argument("--reps", type=int, default=30, help="timed graph replays (median)")
    p.add_argument("--all-paths", action="store_true", help="also time the non-default nvfp4 path")
    p.add_argument("--no-baselines", action="store_true", help="skip the fp8 / bf16 baselines")
    p.add_argument("--sweep", action="store_true",
                   help="first time tile / weight-decode variants of the bf16 path at M=1 and M=64")
    p.add_argument("--variants", default="",
                   help="';'-separated launch variants of the default path timed at --variant-m, each a ','-list "
                        "of Config fields (deq, BN1, BK1, BN2, BK2, warps1, warps2, stages, BM), align=... and "
                        "apre=0|1 (fp4 path: activations quantized in every GEMM program / once per row), "
                        "e.g. 'deq=3;deq=3,align=triton;apre=0'")
    p.add_argument("--variant-m", default="1,4,16,64", help="token counts for --variants")
    p.add_argument("--deq", default="default", choices=("default", "auto", "0", "1", "2", "3", "4"),
                   help="weight decode of the bf16 path for the table (auto: fastest at M=64 in --sweep)")
    p.add_argument("--aload", default=None, choices=("strided", "split"),
                   help="activation tile load of the nvfp4 kernel (env DSV4_SM120_MOE_ALOAD; default split)")
    p.add_argument("--align", default=None, choices=("inkernel", "triton", "torch", "auto"),
                   help="token grouping of the nvfp4 kernel (env DSV4_SM120_MOE_ALIGN; default auto)")
    p.add_argument("--out", default=None,
                   help="write the markdown table here (atomically); default bench/results/moe_<gpu name>.md; '-' = none")
    p.add_argument("--no-check", action="store_true", help="skip the float64 correctness check at M=64")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("error: torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: bench_moe needs a CUDA GPU (none visible)", file=sys.stderr)
        return 2
    try:
        ms = [int(v) for v in args.m.split(",") if v.strip()]
        if not ms or min(ms) < 1:
            raise ValueError
    except ValueError:
        print(f"error: --m must be positive integers, got {args.m!r}", file=sys.stderr)
        return 2
    return run(args, ms)


if __name__ == "__main__":
    sys.exit(main())
