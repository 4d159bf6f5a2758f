"""CPU tests of the Triton NVFP4 fused MoE (Triton interpreter, tiny shapes).

Both kernel paths run here: ``bf16`` (weights upcast in-kernel) and ``fp4``
(activations quantized to NVFP4 on the fly; the scaled dot is emulated
exactly because the interpreter's dot_scaled reads E4M3 scales as E8M0).
The native ``tl.dot_scaled`` variant and the full matrix run on the GPU
(``tests/gpu/test_moe_gpu.py``).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover
    pytest.skip("CPU MoE tests need TRITON_INTERPRET=1 (set before triton is imported)", allow_module_level=True)

import triton  # noqa: E402

from conftest import gpu_compile_result  # noqa: E402
from dsv4_sm120 import nvfp4  # noqa: E402
from dsv4_sm120.moe import BACKEND_NAME, nvfp4_fused_moe  # noqa: E402
from dsv4_sm120.moe import kernels as K  # noqa: E402
from dsv4_sm120.moe.fused_moe import MoEInputError, align_torch, nvfp4_fused_moe_impl  # noqa: E402
from dsv4_sm120.moe.reference import moe_reference, quantize_rows_nvfp4, rel_err  # noqa: E402
from dsv4_sm120.moe.testing import make_experts, random_routing  # noqa: E402

H = 64
TOL_BF16 = 1.5e-2   # bf16 path vs the exact float64 reference (bf16 h and output)
TOL_FP4_KERNEL = 3e-2  # fp4 path vs the reference with the same activation quantization
# Sanity cap on the NVFP4 activation quantization itself (two stages, K = 32/64, fresh random data):
# a broken quantized reference lands near 1. Measured over 4800 draws of these cases: mean 0.21,
# p99 0.35, max 0.53, so a tighter cap (0.35 until 2026-11-30) flakes about 1 run in 20; the
# kernel itself is held by TOL_FP4_KERNEL against the reference with the same quantization.
TOL_ACT_QUANT = 0.8

_SEED = [1000]


def _seed():
    _SEED[0] += 1
    return _SEED[0] + int.from_bytes(os.urandom(2), "little") * 7


def _case(M, E, I, kind, limit, path, seed=None):
    seed = _seed() if seed is None else seed
    W = make_experts(E, H, I, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn((M, H), generator=g) * 2).to(torch.bfloat16)
    if M > 2:
        x[1] = 0  # an all-zero row (gs fallback on the fp4 path)
        x[2, : H // 2] *= 1e-3  # a row with a large dynamic range
    tw, ids = random_routing(M, E, 6, seed + 2, kind=kind)
    out = nvfp4_fused_moe_impl(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=limit, path=path)
    ref = moe_reference(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=limit)
    refq = moe_reference(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=limit, act_quant=True)
    return out, ref, refq, (x, W, tw, ids)


@pytest.mark.parametrize("path", ["bf16", "fp4"])
@pytest.mark.parametrize(
    "M,E,I,kind,limit",
    [
        (1, 8, 32, "random", 1.5),
        (2, 8, 64, "dropped", None),
        (7, 8, 32, "repeat", 1.5),
        (7, 8, 32, "one", 1.5),
        (5, 8, 64, "mixed", 1.0),
        (33, 256, 32, "mixed", 1.5),
    ],
)
def test_matches_float64_reference(M, E, I, kind, limit, path):
    out, ref, refq, _ = _case(M, E, I, kind, limit, path)
    assert out.shape == (M, H) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    act_q = rel_err(refq, ref)
    if path == "bf16":
        err = rel_err(out, ref)
        assert err < TOL_BF16, f"bf16 path rel err {err:.3e} (activation-quant ref would be {act_q:.3e})"
    else:
        err_k = rel_err(out, refq)
        err_t = rel_err(out, ref)
        print(f"fp4 M={M} E={E} I={I} {kind}: kernel err {err_k:.3e}, act-quant err {act_q:.3e}, total {err_t:.3e}")
        assert err_k < TOL_FP4_KERNEL, f"fp4 kernel err {err_k:.3e} vs act-quant reference"
        assert act_q < TOL_ACT_QUANT, f"quantized reference is off by {act_q:.3e}"


def test_reference_is_not_trivially_matched():
    """The tolerance means something: a wrong clamp, swapped gate/up or a
    dropped slot counted all fail it."""
    M, E, I = 6, 8, 32
    out, ref, _, (x, W, tw, ids) = _case(M, E, I, "dropped", 1.0, "bf16")
    assert rel_err(out, ref) < TOL_BF16
    no_clamp = moe_reference(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=None)
    assert rel_err(no_clamp, ref) > 5 * TOL_BF16
    W2 = dict(W)  # gate and up halves swapped
    W2["w13"] = torch.cat([W["w13"][:, I:], W["w13"][:, :I]], dim=1)
    W2["w13_scale"] = torch.cat([W["w13_scale"][:, I:], W["w13_scale"][:, :I]], dim=1)
    W2["w13_scale_2"] = W["w13_scale_2"].flip(1).contiguous()
    assert rel_err(moe_reference(x, **W2, topk_weights=tw, topk_ids=ids, swiglu_limit=1.0), ref) > 5 * TOL_BF16
    ids_all = torch.where(ids < 0, torch.zeros_like(ids), ids)
    assert rel_err(moe_reference(x, **W, topk_weights=tw, topk_ids=ids_all, swiglu_limit=1.0), ref) > 5 * TOL_BF16


@pytest.mark.parametrize("path", ["bf16", "fp4"])
def test_all_dropped_gives_exact_zeros(path):
    M, E, I = 3, 8, 32
    W = make_experts(E, H, I, _seed())
    x = torch.randn((M, H)).to(torch.bfloat16)
    ids = torch.full((M, 6), -1, dtype=torch.int32)
    ids[1, 2] = E + 5  # out of range counts as dropped too
    tw = torch.rand((M, 6))
    out = nvfp4_fused_moe_impl(x, **W, topk_weights=tw, topk_ids=ids, path=path)
    assert torch.equal(out, torch.zeros_like(out))


def test_slot_order_and_repeat_invariance():
    M, E, I = 5, 8, 32
    out, ref, _, (x, W, tw, ids) = _case(M, E, I, "dropped", 1.5, "bf16")
    perm = torch.randperm(6)
    out2 = nvfp4_fused_moe_impl(x, **W, topk_weights=tw[:, perm], topk_ids=ids[:, perm], swiglu_limit=1.5, path="bf16")
    assert rel_err(out2, out.double()) < 1e-2
    # deterministic: same inputs -> same bits
    out3 = nvfp4_fused_moe_impl(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=1.5, path="bf16")
    assert torch.equal(out3, out)


def test_public_entry_point_and_int64_ids():
    M, E, I = 2, 8, 32
    W = make_experts(E, H, I, _seed())
    x = torch.randn((M, H)).to(torch.bfloat16)
    tw, ids = random_routing(M, E, 6, _seed(), kind="dropped")
    out = nvfp4_fused_moe(x, W["w13"], W["w13_scale"], W["w13_scale_2"], W["w2"], W["w2_scale"],
                          W["w2_scale_2"], tw, ids.long(), swiglu_limit=10.0)
    ref = moe_reference(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=10.0)
    assert rel_err(out, ref) < TOL_BF16
    assert BACKEND_NAME == "dsv4_triton_nvfp4"


@pytest.mark.parametrize("E,BM", [(8, 16), (256, 16), (5, 32)])
def test_align_groups_every_valid_pair_once(E, BM):
    M, k = 29, 6
    g = torch.Generator().manual_seed(_seed())
    ids = torch.randint(-1, E + 2, (M * k,), generator=g, dtype=torch.int32)
    ids[:20] = E - 1  # one hot expert spanning several blocks
    P = M * k
    max_blocks = triton.cdiv(P, BM) + min(E, P)
    sp = torch.full((max_blocks * BM,), -7, dtype=torch.int32)
    be = torch.full((max_blocks,), -7, dtype=torch.int32)
    e_pad = triton.next_power_of_2(E)
    K._align_kernel[(1,)](ids, sp, be, P, E, max_blocks * BM, max_blocks, BM=BM, E_PAD=e_pad,
                          CHUNK=max(16, min(128, 16384 // e_pad)), FILL=64, BCHUNK=16)
    assert (sp != -7).all() and (be != -7).all()
    # the torch variant (used for large P) gives exactly the same grouping
    sp2 = torch.full_like(sp, -7)
    be2 = torch.full_like(be, -7)
    align_torch(ids, E, BM, sp2, be2)
    assert torch.equal(sp2, sp) and torch.equal(be2, be)
    valid = [i for i in range(P) if 0 <= ids[i] < E]
    slots = sp.view(max_blocks, BM)
    seen = []
    for b in range(max_blocks):
        e = int(be[b])
        rows = [int(p) for p in slots[b] if int(p) < P]
        if e < 0:
            assert rows == []
            continue
        assert all(int(ids[p]) == e for p in rows), f"block {b} (expert {e}) holds {rows}"
        seen += rows
    assert sorted(seen) == valid
    # blocks of one expert are contiguous, experts ascending
    used = [int(e) for e in be if int(e) >= 0]
    assert used == sorted(used)


def test_quantize_rows_matches_shared_quantizer():
    g = torch.Generator().manual_seed(_seed())
    a = torch.randn((5, 64), generator=g) * torch.logspace(-3, 2, 5)[:, None]
    a[3] = 0
    q = quantize_rows_nvfp4(a)
    for r in range(5):
        amax = a[r].abs().max()
        s2 = (amax / 2688.0) if amax > 0 else torch.tensor(1.0)
        w, s, s2o = nvfp4.quantize_nvfp4(a[r : r + 1], scale_2=s2)
        assert torch.equal(q[r : r + 1], nvfp4.dequant_nvfp4(w, s, s2o))


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda a: a.update(x=a["x"].float()), "x must be bf16"),
        (lambda a: a.update(w13=a["w13"][:, :, :-1].contiguous()), "w13 is"),
        (lambda a: a.update(w13_scale=a["w13_scale"].float()), "w13_scale must be"),
        (lambda a: a.update(w2_scale_2=a["w2_scale_2"][:-1]), "w2_scale_2 must be"),
        (lambda a: a.update(topk_ids=a["topk_ids"][:1]), "topk_ids must be"),
        (lambda a: a.update(topk_weights=a["topk_weights"][:, :3]), "topk_weights must be"),
    ],
)
def test_bad_inputs_raise_clear_errors(mutate, needle):
    W = make_experts(8, H, 32, 3)
    tw, ids = random_routing(2, 8, 6, 4)
    args = dict(x=torch.randn((2, H)).to(torch.bfloat16), **W, topk_weights=tw, topk_ids=ids)
    mutate(args)
    with pytest.raises(MoEInputError, match=needle):
        nvfp4_fused_moe(**args)


def test_unusable_settings_are_refused_with_clear_errors(monkeypatch):
    """A launch the kernels cannot run (inline-PTX decode under the interpreter, a K step that does not
    divide H, an unknown grouping) and bad environment values raise MoEInputError naming the setting."""
    from dsv4_sm120.moe.config import Config

    W = make_experts(8, H, 32, 3)
    tw, ids = random_routing(2, 8, 6, 4)
    kw = dict(**W, topk_weights=tw, topk_ids=ids, path="bf16")
    x = torch.randn((2, H)).to(torch.bfloat16)
    with pytest.raises(MoEInputError, match="deq=3"):
        nvfp4_fused_moe_impl(x, **kw, config=Config(16, 16, 32, 16, 32, 4, 4, 1, deq=3))
    with pytest.raises(MoEInputError, match="must divide H=64"):
        nvfp4_fused_moe_impl(x, **kw, config=Config(16, 16, 128, 16, 32, 4, 4, 1, deq=0))
    with pytest.raises(MoEInputError, match="grouping 'sorted'"):
        nvfp4_fused_moe_impl(x, **kw, config=Config(16, 16, 32, 16, 32, 4, 4, 1, deq=0, align="sorted"))
    for name, bad in (("DSV4_SM120_MOE_PATH", "fp8"), ("DSV4_SM120_MOE_SCALED_DOT", "fast"),
                      ("DSV4_SM120_MOE_APRE", "yes"), ("DSV4_SM120_MOE_ALIGN", "sorted")):
        with monkeypatch.context() as m:
            m.setenv(name, bad)
            with pytest.raises(MoEInputError, match=name):
                nvfp4_fused_moe(x, W["w13"], W["w13_scale"], W["w13_scale_2"], W["w2"], W["w2_scale"],
                                W["w2_scale_2"], tw, ids)


# A bit-level model of the PTX instructions of the inline-PTX weight decode (PTX ISA semantics of
# prmt default mode, lop3, fma.rn.bf16x2, ...), to check it on every byte.
def _prmt(a, b, c):
    src = (b << 32) | a
    out = 0
    for k in range(4):
        sel = (c >> (4 * k)) & 0xF
        byte = (src >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * k)
    return out


def _lop3(a, b, c, lut):
    out = 0
    for i in range(32):
        idx = (((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1)
        out |= ((lut >> idx) & 1) << i
    return out


def _bf16(bits):
    return torch.tensor([bits << 16], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


def _to_bf16_bits(f):
    return torch.tensor([f], dtype=torch.float32).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF


def _run_ptx(asm, regs):
    R = dict(regs)

    def val(tok):
        tok = tok.strip()
        if tok.startswith("0x"):
            return int(tok, 16)
        if tok.isdigit():
            return int(tok)
        return R[tok]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        a = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            R[a[0]] = val(a[1])
        elif op == "prmt.b32":
            R[a[0]] = _prmt(val(a[1]), val(a[2]), val(a[3]))
        elif op == "and.b32":
            R[a[0]] = val(a[1]) & val(a[2])
        elif op == "or.b32":
            R[a[0]] = val(a[1]) | val(a[2])
        elif op == "shl.b32":
            R[a[0]] = (val(a[1]) << val(a[2])) & 0xFFFFFFFF
        elif op == "shr.b32":
            R[a[0]] = val(a[1]) >> val(a[2])
        elif op == "lop3.b32":
            R[a[0]] = _lop3(val(a[1]), val(a[2]), val(a[3]), val(a[4]))
        elif op == "fma.rn.bf16x2":
            x, y, z = val(a[1]), val(a[2]), val(a[3])
            R[a[0]] = sum(_to_bf16_bits(_bf16((x >> 16 * h) & 0xFFFF) * _bf16((y >> 16 * h) & 0xFFFF)
                                        + _bf16((z >> 16 * h) & 0xFFFF)) << 16 * h for h in range(2))
        else:
            raise AssertionError(f"unmodelled PTX op {op}")
    return R


_COMPILE = r"""
import json
from dsv4_sm120.moe import kernels as K
from dsv4_sm120.dev.sass import compile_for, moe_gemm_source
out = {}
for name, cap, fp4, native, deq in (("sm120_fp4", 120, True, True, 0), ("sm90_deq3", 90, False, False, 3)):
    cst = dict(HAS_LIMIT=True, BM=16, BN=32, BK=256, PATH_FP4=fp4, NATIVE=native, INTERP=False, DEQ=deq,
               GROUPED=True, P_PAD=512, E_PAD=256, APRE=False)
    try:
        k = compile_for(moe_gemm_source(K._gemm1_kernel, 1, cst), cap, {"num_warps": 4, "num_stages": 3})
        ptx = k.asm["ptx"]
        out[name] = {"cubin": bool(k.asm.get("cubin")), "fp4_mma": ptx.count("kind::mxf4nvf4.block_scale"),
                     "ue4m3": ptx.count(".ue4m3"), "bf16x2_fma": ptx.count("fma.rn.bf16x2")}
    except Exception as e:
        out[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
print("RESULT" + json.dumps(out))
"""


def test_gpu_code_generation_for_sm120_and_sm90():
    """Without a GPU: Triton compiles the FP4 path for sm_120 to the native FP4
    block-scaled MMA (e2m1 x e2m1, UE4M3 scales, K-packed) and the upcast path's inline-PTX shift
    decode (deq 3) assembles for sm_90 (ptxas, cubin produced)."""
    out = gpu_compile_result(_COMPILE)
    assert out["sm120_fp4"].get("cubin"), out
    assert out["sm120_fp4"]["fp4_mma"] > 0 and out["sm120_fp4"]["ue4m3"] > 0, out
    assert out["sm90_deq3"].get("cubin") and out["sm90_deq3"]["bf16x2_fma"] > 0, out


@pytest.mark.parametrize("path", ["bf16", "fp4"])
def test_opt_in_variants_compute_the_same(monkeypatch, path):
    """DSV4_SM120_MOE_ALIGN=torch (sort-based grouping) changes nothing but speed."""
    M, E, I = 6, 8, 32
    out0, ref, refq, (x, W, tw, ids) = _case(M, E, I, "mixed", 1.5, path)
    monkeypatch.setenv("DSV4_SM120_MOE_ALIGN", "torch")
    out1 = nvfp4_fused_moe_impl(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=1.5, path=path)
    assert torch.equal(out1, out0)
    monkeypatch.setenv("DSV4_SM120_MOE_ALIGN", "bogus")
    with pytest.raises(MoEInputError, match="DSV4_SM120_MOE_ALIGN"):
        nvfp4_fused_moe_impl(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=1.5, path=path)


def test_inline_ptx_shift_decode_model_covers_every_byte():
    """DEQ=3 (shift decode): with scales times 2^119, every byte decodes to
    value * scale * 2^-7 exactly (subnormal bf16 intermediates included; the
    model follows IEEE without flush-to-zero, which the GPU tests check)."""
    asm = K._E2M1_BF16_SHIFT_ASM.value
    g = torch.Generator().manual_seed(_seed())
    scales = torch.exp2(torch.rand(256, generator=g) * 17 - 9).to(torch.float8_e4m3fn).float()
    scales[:4] = torch.tensor([448.0, 2.0 ** -9, 0.0, 1.0])  # max, smallest subnormal, zero, one
    for q in range(64):
        bs = [4 * q + i for i in range(4)]
        sc = [scales[(b * 7 + q) % 256].item() for b in bs]
        sb = [_to_bf16_bits(s * 2.0 ** 119) for s in sc]
        R = _run_ptx(asm, {"$4": bs[0] | bs[1] << 8 | bs[2] << 16 | bs[3] << 24,
                           "$5": sb[0] | sb[1] << 16, "$6": sb[2] | sb[3] << 16})
        lo = [R["$0"] & 0xFFFF, R["$0"] >> 16, R["$1"] & 0xFFFF, R["$1"] >> 16]
        hi = [R["$2"] & 0xFFFF, R["$2"] >> 16, R["$3"] & 0xFFFF, R["$3"] >> 16]
        for i, b in enumerate(bs):
            assert _bf16(lo[i]) == nvfp4.E2M1_VALUES[b & 15].item() * sc[i] * 2.0 ** -7, (b, sc[i])
            assert _bf16(hi[i]) == nvfp4.E2M1_VALUES[b >> 4].item() * sc[i] * 2.0 ** -7, (b, sc[i])


@pytest.mark.parametrize("path", ["bf16", "fp4"])
def test_inkernel_grouping_equals_align_kernel(monkeypatch, path):
    """DSV4_SM120_MOE_ALIGN=inkernel (each GEMM program finds its expert's pairs
    itself) gives the same bits as the align kernel, including an expert with
    more pairs than one row tile (3 tiles), repeats, dropped / out-of-range ids
    and many more slots than distinct experts."""
    M, E, I = 40, 8, 32
    W = make_experts(E, H, I, _seed())
    x = torch.randn((M, H)).to(torch.bfloat16)
    tw, ids = random_routing(M, E, 6, _seed(), kind="mixed")
    ids[:, 2] = 3  # expert 3: >= 40 pairs -> row tiles 0, 16, 32
    ids[5, 4] = E + 2
    outs = {}
    for mode in ("triton", "inkernel"):
        monkeypatch.setenv("DSV4_SM120_MOE_ALIGN", mode)
        outs[mode] = nvfp4_fused_moe_impl(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=1.5, path=path)
    assert torch.equal(outs["inkernel"], outs["triton"])
    ref = moe_reference(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=1.5)
    if path == "bf16":
        assert rel_err(outs["inkernel"], ref) < TOL_BF16


def test_slot_expert_and_pairs_kernel_helpers():
    """The in-kernel grouping helpers against a direct Python grouping: every
    (expert, row tile) owned by exactly one slot, in expert order, each tile's
    pairs in routing order; slots past the last tile get expert -1."""
    import triton.language as tl

    @triton.jit
    def probe(ids_ptr, e_out, pair_out, valid_out, P, E, P_PAD: tl.constexpr, E_PAD: tl.constexpr,
              BM: tl.constexpr):
        s = tl.program_id(0)
        e, r0 = K._slot_expert(ids_ptr, s, P, E, BM, P_PAD, E_PAD)
        tl.store(e_out + 2 * s, e)
        tl.store(e_out + 2 * s + 1, r0)
        pair, valid = K._expert_pairs(ids_ptr, P, E, e, r0, BM, P_PAD)
        o = s * BM + tl.arange(0, BM)
        tl.store(pair_out + o, pair)
        tl.store(valid_out + o, valid.to(tl.int32))

    g = torch.Generator().manual_seed(_seed())
    E, P, BM = 37, 150, 16
    ids = torch.randint(-1, E + 2, (P,), generator=g, dtype=torch.int32)
    ids[torch.randperm(P, generator=g)[:40]] = 11  # one expert with 3 row tiles
    nslot = min(E, P) + triton.cdiv(P, BM)
    e_out = torch.full((2 * nslot,), -7, dtype=torch.int32)
    pair_out = torch.full((nslot * BM,), -7, dtype=torch.int32)
    valid_out = torch.full((nslot * BM,), -7, dtype=torch.int32)
    probe[(nslot,)](ids, e_out, pair_out, valid_out, P, E, P_PAD=256, E_PAD=64, BM=BM)
    want_tiles = []
    for e in sorted({int(v) for v in ids.tolist() if 0 <= v < E}):
        pairs = [p for p in range(P) if ids[p].item() == e]
        for r0 in range(0, len(pairs), BM):
            want_tiles.append((e, r0, pairs[r0:r0 + BM]))
    assert len(want_tiles) <= nslot
    for s in range(nslot):
        e, r0 = e_out[2 * s].item(), e_out[2 * s + 1].item()
        if s >= len(want_tiles):
            assert e == -1
            continue
        we, wr0, wp = want_tiles[s]
        assert (e, r0) == (we, wr0)
        v = valid_out[s * BM:(s + 1) * BM].tolist()
        assert v == [1] * len(wp) + [0] * (BM - len(wp))
        assert pair_out[s * BM:s * BM + len(wp)].tolist() == wp


_SM120_CONFIGS = r"""
import json
import triton
from dsv4_sm120.moe import kernels as K
from dsv4_sm120.moe.config import choose_config
from dsv4_sm120.dev.sass import MOE_QUANT_SIG, compile_for, kernel_source, moe_gemm_source
out = {}


def build(key, src, w, stages):
    try:
        k = compile_for(src, 120, {"num_warps": w, "num_stages": stages})
        out[key] = {"smem": k.metadata.shared, "cubin": bool(k.asm.get("cubin")),
                    "setp": k.asm["ptx"].count("setp.")}
    except Exception as e:
        out[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}


for M in (1, 16, 4096):
    cfg = choose_config(M, 6, 256, 4096, 512, "fp4", device_name="NVIDIA RTX PRO 6000 Blackwell Server Edition",
                        capability=(12, 0))
    P = M * 6
    for which, fn, bn, bk, w in ((1, K._gemm1_kernel, cfg.BN1, cfg.BK1, cfg.warps1),
                                 (2, K._gemm2_kernel, cfg.BN2, cfg.BK2, cfg.warps2)):
        for apre in (False, True):  # True: the default (DSV4_SM120_MOE_APRE=1)
            cst = dict(BM=cfg.BM, BN=bn, BK=bk, PATH_FP4=True, NATIVE=True, INTERP=False, DEQ=0,
                       GROUPED=cfg.align == "inkernel", P_PAD=max(16, triton.next_power_of_2(P)), E_PAD=256,
                       APRE=apre)
            if which == 1:
                cst["HAS_LIMIT"] = True
            build(f"M{M}_g{which}" + ("_apre" if apre else ""), moe_gemm_source(fn, which, cst), w, cfg.stages)
    for name, bk in (("qx", cfg.BK1), ("qh", cfg.BK2)):
        src = kernel_source(K._quant_rows_kernel, MOE_QUANT_SIG, dict(BR=16, BK=bk, HAS_SEL=name == "qh"))
        build(f"M{M}_{name}", src, 4, 1)
print("RESULT" + json.dumps(out))
"""


def test_sm120_default_configs_compile_within_shared_memory():
    """The launch configurations the launch tables give the sm_120 FP4 path (decode with in-kernel
    grouping, the 64-wide decode tile, prefill), with and without pre-quantized activations, and the
    activation quantization kernel compile for sm_120 and fit its ~99 KB of shared memory per block (an RTX
    PRO 6000 would refuse the launch otherwise; nothing here can launch it)."""
    out = gpu_compile_result(_SM120_CONFIGS, timeout=900)
    for name, v in out.items():
        assert "error" not in v and v["cubin"], (name, v)
        assert v["smem"] <= 99 * 1024, (name, v)
    # with the activations pre-quantized (the default) the GEMMs no longer carry the quantizer's compares
    for M in (1, 16, 4096):
        for g in ("g1", "g2"):
            assert out[f"M{M}_{g}_apre"]["setp"] * 4 < out[f"M{M}_{g}"]["setp"], (M, g, out[f"M{M}_{g}_apre"])


@pytest.mark.parametrize("M,E,kind,align", [(3, 8, "mixed", "inkernel"), (7, 8, "repeat", "triton"),
                                              (9, 16, "dropped", "torch"), (6, 8, "one", "triton")])
def test_fp4_pre_quantized_activations_are_bit_identical(M, E, kind, align, monkeypatch):
    """APRE (activations NVFP4-quantized once per row before each GEMM) gives the fp4 path's in-loop result
    bit for bit: same quantizer, same operands, in every grouping mode (the aligned order quantizes only
    its real h rows). Also against float64 with the same activation quantization."""
    monkeypatch.setenv("DSV4_SM120_MOE_ALIGN", align)
    seed = _seed()
    W = make_experts(E, H, 64, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn((M, H), generator=g) * 2).to(torch.bfloat16)
    x[1] = 0
    tw, ids = random_routing(M, E, 6, seed + 2, kind=kind)
    kw = dict(**W, topk_weights=tw, topk_ids=ids, swiglu_limit=1.5, path="fp4")
    inloop = nvfp4_fused_moe_impl(x, apre=False, **kw)
    pre = nvfp4_fused_moe_impl(x, apre=True, **kw)
    assert torch.equal(pre, inloop)
    refq = moe_reference(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=1.5, act_quant=True)
    assert rel_err(pre, refq) < TOL_FP4_KERNEL
    monkeypatch.setenv("DSV4_SM120_MOE_APRE", "maybe")
    with pytest.raises(MoEInputError, match="DSV4_SM120_MOE_APRE"):
        nvfp4_fused_moe_impl(x, **kw)


def test_quant_rows_kernel_matches_the_reference_quantizer():
    """The pre-pass kernel's packed codes / scales / global scale decode to exactly the reference
    quantizer's values (``quantize_rows_nvfp4``), zero rows and a large dynamic range included; rows not
    selected by ``sel`` are never read."""
    from dsv4_sm120.moe.fused_moe import _quantize_rows

    g = torch.Generator().manual_seed(_seed())
    R, Kd = 5, 64
    a = (torch.randn((R, Kd), generator=g) * torch.logspace(-3, 2, R)[:, None]).to(torch.bfloat16)
    a[3] = 0
    q, s, gs = _quantize_rows(a, R, Kd, 32)
    lo = torch.tensor([_e2m1v(c) for c in range(16)], dtype=torch.float64)
    codes = torch.stack([q & 15, q >> 4], dim=-1).reshape(R, Kd).long()
    # (e2m1 x block scale) is exact in float32; the row scale last, as the reference applies it
    deq = (lo[codes].float() * s.float().repeat_interleave(16, dim=1)) * gs[:, None]
    ref = quantize_rows_nvfp4(a.float())
    assert torch.equal(deq, ref)
    assert torch.equal(gs[3], torch.tensor(1.0)) and not q[3].any()  # zero row: gs 1, all codes 0
    # rows 1 and 3 unselected: padding of the aligned order (sel >= P = 5), or dropped pairs of the
    # in-kernel grouping (ids outside [0, E = 8)); they hold inf, which must never be read
    import numpy as np

    a_bad = a.clone()
    a_bad[1] = float("inf")
    a_bad[3] = float("-inf")
    for sel, hi in (([0, 9, 2, 9, 4], 5), ([3, -1, 0, 8, 7], 8)):
        with np.errstate(all="raise"):
            q2, s2, gs2 = _quantize_rows(a_bad, R, Kd, 32, sel=torch.tensor(sel, dtype=torch.int32), sel_hi=hi)
        for r in (0, 2, 4):
            assert torch.equal(q2[r], q[r]) and torch.equal(s2[r].view(torch.uint8), s[r].view(torch.uint8))
            assert torch.equal(gs2[r], gs[r])


def _e2m1v(c):
    v = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][c & 7]
    return -v if c & 8 else v


def _poisoning_empty(monkeypatch):
    """torch.empty that returns float buffers full of +inf (e4m3: its NaN code) and 0xFF bytes, so a kernel
    that reads memory nobody wrote computes inf / inf (NumPy: invalid value) instead of quietly using
    whatever the allocator left there."""
    real = torch.empty

    def empty(*a, **kw):
        t = real(*a, **kw)
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).fill_(0x7F)
        elif t.dtype.is_floating_point:
            t.fill_(float("inf"))
        elif t.dtype == torch.uint8:
            t.fill_(0xFF)
        return t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("path,align", [("fp4", "inkernel"), ("fp4", "triton"), ("bf16", "inkernel")])
def test_rows_nobody_wrote_are_never_read(monkeypatch, path, align):
    """Dropped pairs (ids -1 / >= E) leave their rows of h unwritten; quantizing or loading them reads
    uninitialised memory. With every buffer from torch.empty poisoned (+inf) and NumPy's floating-point
    errors raised (the interpreter computes with NumPy), the call must raise nothing and give exactly the
    unpoisoned result, which matches the float64 reference."""
    import numpy as np

    monkeypatch.setenv("DSV4_SM120_MOE_ALIGN", align)
    M, E, I = 5, 8, 32
    seed = _seed()
    W = make_experts(E, H, I, seed)
    x = (torch.randn((M, H), generator=torch.Generator().manual_seed(seed)) * 2).to(torch.bfloat16)
    tw, ids = random_routing(M, E, 6, seed + 1, kind="dropped")
    ids[0, :3] = -1
    ids[2, 1] = E + 3
    kw = dict(**W, topk_weights=tw, topk_ids=ids, swiglu_limit=1.5, path=path)
    clean = nvfp4_fused_moe_impl(x, **kw)
    _poisoning_empty(monkeypatch)
    with np.errstate(all="raise"):
        out = nvfp4_fused_moe_impl(x, **kw)
    assert torch.equal(out, clean)
    ref = moe_reference(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=1.5, act_quant=path == "fp4")
    assert rel_err(out, ref) < (TOL_FP4_KERNEL if path == "fp4" else TOL_BF16)
