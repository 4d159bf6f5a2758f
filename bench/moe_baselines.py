"""The baselines and GPU helpers of bench/bench_moe.py: W8A8 block-FP8 and bf16 MoE GEMMs with the same
routing / reduce kernels as the NVFP4 path, the copy-bandwidth probe, graph timing and random routings.
Imported by the driver only when it runs on a GPU, so its --help, --dry-run and argument errors need neither
torch nor Triton."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "overlay"))

from dsv4_sm120.cuda_timing import cuda_graph_us  # noqa: E402

try:
    import torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    torch = triton = tl = None


if triton is not None:

    @triton.jit
    def _fp8_rows(a):
        """bf16 activation tile -> (e4m3 tile, fp32 scale per row): one scale per token and K step (the K step
        is the 128-column group)."""
        af = a.to(tl.float32)
        am = tl.max(tl.abs(af), axis=1)
        sa = tl.where(am > 0, am / 448.0, 1.0)
        return (af / sa[:, None]).to(tl.float8e4nv), sa

    @triton.jit
    def _block_expert(be_ptr):
        """This program's row block and column block, and the expert of the row block (-1: no rows)."""
        pid_m = tl.program_id(0)
        return pid_m, tl.program_id(1), tl.load(be_ptr + pid_m)

    @triton.jit
    def _block_rows(sorted_ptr, pid_m, pid_n, P, BM: tl.constexpr, BN: tl.constexpr):
        """The rows of row block ``pid_m`` (slots of the sorted order), their pair index, which hold a pair, and
        the output columns of ``pid_n``."""
        rows = pid_m * BM + tl.arange(0, BM)
        pair = tl.load(sorted_ptr + rows)
        return rows, pair, pair < P, pid_n * BN + tl.arange(0, BN)

    @triton.jit
    def _base_gemm1(x_ptr, w_ptr, s_ptr, sorted_ptr, be_ptr, h_ptr, P, TOPK, H, I,
                    stride_we, stride_wn, stride_se, stride_sn, swiglu_limit,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr):
        pid_m, pid_n, e = _block_expert(be_ptr)
        if e >= 0:
            e64 = e.to(tl.int64)
            rows, pair, rvalid, offs_n = _block_rows(sorted_ptr, pid_m, pid_n, P, BM, BN)
            tok = tl.where(rvalid, pair // TOPK, 0).to(tl.int64)
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
                    aq, sa = _fp8_rows(a)
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
        pid_m, pid_n, e = _block_expert(be_ptr)
        if e >= 0:
            e64 = e.to(tl.int64)
            rows, pair, rvalid, offs_n = _block_rows(sorted_ptr, pid_m, pid_n, P, BM, BN)
            kk = tl.arange(0, BK)
            a_row = h_ptr + rows[:, None].to(tl.int64) * I
            w_p = w_ptr + e64 * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + kk[:, None]
            s_p = s_ptr + e64 * stride_se + (offs_n // 128) * stride_sn
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(0, I, BK):
                a = tl.load(a_row + k0 + kk[None, :], mask=rvalid[:, None], other=0.0)
                w = tl.load(w_p + k0)
                if FP8:
                    aq, sa = _fp8_rows(a)
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
    """Median microseconds per call: the calls in ``fns`` run eagerly once, then captured in one graph."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    return cuda_graph_us(fns, reps)


def routings(M, E, k, n, gen_seed):
    g = torch.Generator(device="cuda").manual_seed(gen_seed)
    out = []
    for _ in range(n):
        ids = torch.rand((M, E), generator=g, device="cuda").argsort(dim=1)[:, :k].to(torch.int32).contiguous()
        w = torch.rand((M, k), generator=g, device="cuda") + 0.1
        out.append(((w / w.sum(1, keepdim=True)).float().contiguous(), ids))
    return out
