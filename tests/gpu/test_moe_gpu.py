"""GPU tests of the Triton NVFP4 fused MoE: the issue's full matrix.

M in {1, 2, 7, 64, 257, 2048}, E in {8, 256}, k = 6, I in {512, 256}, H = 4096;
routings with dropped (-1) ids, repeated experts, a few hot experts and many
empty ones, plus all tokens on one expert. Paths: ``bf16`` (upcast), ``fp4``
with native ``tl.dot_scaled`` and ``fp4`` with the exact emulation. Reference:
float64 from exactly dequantized weights; activation quantization error is
reported separately from the kernel error. Run with ``python3 -m pytest
tests/gpu/test_moe_gpu.py -s``; set ``MOE_GPU_REPORT=path`` to write a CSV.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs a CUDA GPU (and no TRITON_INTERPRET)", allow_module_level=True)

from dsv4_sm120.moe.fused_moe import choose_config, nvfp4_fused_moe_impl  # noqa: E402
from dsv4_sm120.moe.reference import moe_reference, rel_err  # noqa: E402
from dsv4_sm120.moe.testing import make_experts, random_routing  # noqa: E402

H = 4096
LIMIT = 10.0  # DeepSeek-V4's swiglu_limit
TOL_BF16 = 1.5e-2
# fp4 path vs the float64 reference with the same activation quantization: the kernel's
# fp32-accumulated SwiGLU output is rounded to bf16 and re-quantized to NVFP4, and at K = 4096
# fp32-vs-float64 differences move ~1% of values across e2m1 rounding boundaries (measured
# 3-6e-2 on the H200, 8.5e-2 once at M=1 E=8 where only 4096 outputs are compared; the activation
# quantization itself is ~0.17). CPU tests (K = 64) hold 5e-2. Because that comparison is dominated by
# boundary flips, the fp4 path is also held to what matters: its total error against float64 stays within
# 10% of the error of activation quantization alone (measured ratio 0.99-1.05 over 31 H200 cases,
# the correctness_matrix case of bench/results/moe.csv); a wrong scale, expert or weight would
# put it far above (a wrong expert gives ~1.4).
TOL_FP4_KERNEL = 1.2e-1
TOL_FP4_TOTAL_OVER_ACT = 1.10
TOL_ACT_QUANT = 0.35
DEV = torch.device("cuda")
CAP = torch.cuda.get_device_capability()

_cache = {}
_rows = []


def _data(M, E, I, kind):
    key = (M, E, I, kind)
    if key not in _cache:
        _cache.clear()
        seed = hash(key) % 10007 + int.from_bytes(os.urandom(2), "little")
        W = make_experts(E, H, I, seed, device=DEV)
        g = torch.Generator().manual_seed(seed)
        # activations scaled so a real share of gate/up values hit the clamp
        x = (torch.randn((M, H), generator=g) * 6).to(torch.bfloat16).to(DEV)
        tw, ids = random_routing(M, E, 6, seed + 1, device=DEV, kind=kind)
        ref = moe_reference(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=LIMIT)
        refq = moe_reference(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=LIMIT, act_quant=True)
        _cache[key] = (x, W, tw, ids, ref, refq)
    return _cache[key]


CASES = [(M, E, I, "mixed") for M in (1, 2, 7, 64, 257, 2048) for E in (8, 256) for I in (512, 256)]
CASES += [(M, 256, 512, "one") for M in (7, 257, 2048)]
CASES += [(64, 256, 512, "random"), (257, 256, 512, "dropped"), (64, 8, 512, "repeat")]


@pytest.mark.parametrize("M,E,I,kind", CASES)
@pytest.mark.parametrize("mode", ["bf16-deq0", "bf16-deq3", "fp4-native", "fp4-emulated", "fp4-native-inloop",
                                  "fp4-emulated-inloop"])
def test_matrix(M, E, I, kind, mode):
    """fp4 modes: activations pre-quantized once per row (the default, DSV4_SM120_MOE_APRE=1) or, with
    -inloop, inside every GEMM program."""
    x, W, tw, ids, ref, refq = _data(M, E, I, kind)
    path = "bf16" if mode.startswith("bf16") else "fp4"
    sd = "emulated" if mode.startswith("fp4-emulated") else "native"
    apre = None if path == "bf16" else not mode.endswith("-inloop")
    cfg = None
    if path == "bf16":
        cfg = dataclasses.replace(choose_config(M, 6, E, H, I, path), deq=int(mode[-1]))
    try:
        out = nvfp4_fused_moe_impl(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=LIMIT, path=path,
                                   scaled_dot=sd, config=cfg, apre=apre)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        if mode.startswith("fp4-native") and CAP[0] not in (10, 12):
            pytest.skip(f"native dot_scaled nvfp4 does not compile on sm_{CAP[0]}{CAP[1]}: "
                        f"{type(exc).__name__}: {str(exc)[:200]}")
        raise
    act = rel_err(refq, ref)
    err_t = rel_err(out, ref)
    err_k = err_t if path == "bf16" else rel_err(out, refq)
    _rows.append((M, E, I, kind, mode, err_k, act, err_t))
    print(f"M={M} E={E} I={I} {kind} {mode}: kernel err {err_k:.3e} | act-quant err {act:.3e} | total {err_t:.3e}")
    assert torch.isfinite(out).all()
    if path == "bf16":
        assert err_t < TOL_BF16
    else:
        assert err_k < TOL_FP4_KERNEL
        assert err_t < TOL_ACT_QUANT
        assert err_t <= TOL_FP4_TOTAL_OVER_ACT * act + 1e-3


@pytest.mark.parametrize("sd", ["emulated", "native"])
@pytest.mark.parametrize("M,E,kind", [(1, 256, "random"), (64, 256, "random"), (257, 256, "dropped")])
def test_fp4_pre_quantized_activations_bit_identical(M, E, kind, sd):
    """Activations quantized once per row (default) == quantized inside every GEMM program, bit for bit."""
    if sd == "native" and CAP[0] not in (10, 12):
        pytest.skip(f"native dot_scaled nvfp4 needs sm_100 / sm_120 (this is sm_{CAP[0]}{CAP[1]})")
    x, W, tw, ids, ref, refq = _data(M, E, 512, kind)
    kw = dict(**W, topk_weights=tw, topk_ids=ids, swiglu_limit=LIMIT, path="fp4", scaled_dot=sd)
    a = nvfp4_fused_moe_impl(x, apre=True, **kw)
    b = nvfp4_fused_moe_impl(x, apre=False, **kw)
    assert torch.equal(a, b)


@pytest.mark.parametrize("path", ["bf16", "fp4"])
def test_cuda_graph_replay_matches_eager(path):
    M, E, I = 16, 256, 512
    W = make_experts(E, H, I, 5, device=DEV)
    x = torch.randn((M, H), device=DEV).to(torch.bfloat16)
    tw, ids = random_routing(M, E, 6, 6, device=DEV, kind="mixed")

    def step():
        return nvfp4_fused_moe_impl(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=LIMIT, path=path)

    step()  # compile outside capture
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for seed in (7, 8):
        x.copy_(torch.randn((M, H), device=DEV).to(torch.bfloat16))
        tw2, ids2 = random_routing(M, E, 6, seed, device=DEV, kind="mixed")
        tw.copy_(tw2)
        ids.copy_(ids2)
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        assert torch.equal(static_out, eager)


def teardown_module(module):
    path = os.environ.get("MOE_GPU_REPORT")
    if path and _rows:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write("M,E,I,routing,mode,kernel_err,act_quant_err,total_err\n")
            for r in _rows:
                f.write(",".join(str(v) if not isinstance(v, float) else f"{v:.4e}" for v in r) + "\n")
        os.replace(tmp, path)


@pytest.mark.parametrize("align", ["inkernel", "triton"])
def test_weight_decodes_are_exact_on_every_byte_and_scale(monkeypatch, align):
    """Every e2m1 byte with E4M3 block scales from the smallest subnormal (2^-9) to 448: the shift decode
    (deq 3: bf16 subnormal intermediates, scales times 2^119) gives the same bits as the float32 decode
    (deq 0)."""
    monkeypatch.setenv("DSV4_SM120_MOE_ALIGN", align)
    M, E, I = 7, 8, 256
    W = make_experts(E, H, I, 11, device=DEV)
    g = torch.Generator(device="cuda").manual_seed(12)
    for name in ("w13", "w2"):
        W[name] = torch.randint(0, 256, W[name].shape, generator=g, device=DEV, dtype=torch.int32).to(torch.uint8)
    for name in ("w13_scale", "w2_scale"):
        codes = torch.randint(1, 127, W[name].shape, generator=g, device=DEV, dtype=torch.int32)  # 2^-9 .. 448
        W[name] = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    x = torch.randn((M, H), device=DEV).to(torch.bfloat16)
    tw, ids = random_routing(M, E, 6, 13, device=DEV, kind="mixed")
    outs = {}
    for deq in (0, 3):
        cfg = dataclasses.replace(choose_config(M, 6, E, H, I, "bf16"), deq=deq)
        outs[deq] = nvfp4_fused_moe_impl(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=LIMIT, path="bf16",
                                         config=cfg)
    torch.cuda.synchronize()
    assert torch.isfinite(outs[0]).all() and outs[0].abs().max() > 0
    assert torch.equal(outs[3], outs[0])


@pytest.mark.parametrize("align", ["inkernel", "triton"])
@pytest.mark.parametrize("path", ["bf16", "fp4"])
def test_rows_nobody_wrote_are_never_read(monkeypatch, align, path):
    """Dropped pairs leave rows of h unwritten. With every buffer the launcher allocates filled with inf
    first, the output is finite and the same bits as with fresh buffers."""
    monkeypatch.setenv("DSV4_SM120_MOE_ALIGN", align)
    x, W, tw, ids, ref, refq = _data(7, 8, 512, "mixed")
    kw = dict(**W, topk_weights=tw, topk_ids=ids, swiglu_limit=LIMIT, path=path)
    clean = nvfp4_fused_moe_impl(x, **kw)
    real = torch.empty

    def empty(*a, **k):
        t = real(*a, **k)
        if t.dtype.is_floating_point and t.dtype != torch.float8_e4m3fn:
            t.fill_(float("inf"))
        return t

    monkeypatch.setattr(torch, "empty", empty)
    out = nvfp4_fused_moe_impl(x, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.equal(out, clean)
