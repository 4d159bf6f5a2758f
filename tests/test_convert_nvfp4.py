"""The MXFP4 -> NVFP4 checkpoint converter on a small synthetic DeepSeek-V4 checkpoint.

The synthetic checkpoint uses the released checkpoint's tensor names, dtypes and
layout (routed experts I8 + F8_E8M0 per 32, FP8 attention with scales, BF16
norms, an MTP layer), few layers / experts and small dims; it is written with the
official `safetensors` library and the output is read back with it, so the
converter's hand-written safetensors reader/writer is checked independently.
References are computed here from the format's bit fields.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from dsv4_sm120 import convert_nvfp4 as C  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OVERLAY = REPO / "overlay"

H, I, E, LAYERS = 256, 128, 4, 2  # hidden, moe_intermediate, routed experts, main layers
V = 64

# ----------------------------------------------------------------------------
# synthetic checkpoint
# ----------------------------------------------------------------------------


def dsv4_config(**over) -> dict:
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "hidden_size": H,
        "moe_intermediate_size": I,
        "intermediate_size": I,
        "num_hidden_layers": LAYERS,
        "num_nextn_predict_layers": 1,
        "n_routed_experts": E,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "q_lora_rank": 64,
        "o_lora_rank": 64,
        "o_groups": 2,
        "qk_nope_head_dim": 448,
        "qk_rope_head_dim": 64,
        "v_head_dim": 512,
        "head_dim": 512,
        "index_topk": 16,
        "index_n_heads": 4,
        "index_head_dim": 128,
        "window_size": 128,
        "sliding_window": 128,
        "kv_lora_rank": 512,
        "compress_ratios": [0, 4, 0],
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "n_hash_layers": 0,
        "hc_mult": 4,
        "vocab_size": V,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "swiglu_limit": 10.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        },
    }
    cfg.update(over)
    return cfg


def _fp8(shape, g):
    return (torch.randn(*shape, generator=g) * 0.5).to(torch.float8_e4m3fn)


def _e8m0(shape, g, lo=120, hi=130):
    return torch.randint(lo, hi + 1, shape, dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)


def synth_tensors(seed: int = 0, expert_dtype=torch.int8, oor: bool = False):
    """Tensor dict in the released checkpoint's naming; experts for layers 0..LAYERS-1 and mtp.0."""
    g = torch.Generator().manual_seed(seed)
    t = {}
    t["embed.weight"] = torch.randn(V, H, generator=g).to(torch.bfloat16)
    t["head.weight"] = torch.randn(V, H, generator=g).to(torch.bfloat16)
    t["norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    for pre in [f"layers.{i}" for i in range(LAYERS)] + ["mtp.0"]:
        t[f"{pre}.attn_norm.weight"] = torch.randn(H, generator=g).to(torch.bfloat16)
        t[f"{pre}.ffn_norm.weight"] = torch.randn(H, generator=g).to(torch.bfloat16)
        t[f"{pre}.attn.wq_a.weight"] = _fp8((64, H), g)
        t[f"{pre}.attn.wq_a.scale"] = _e8m0((1, 2), g)
        t[f"{pre}.attn.wo_b.weight"] = _fp8((H, 128), g)
        t[f"{pre}.attn.wo_b.scale"] = torch.rand(2, 1, generator=g)  # F32 block scales exist too
        t[f"{pre}.attn.attn_sink"] = torch.randn(4, generator=g)
        t[f"{pre}.ffn.gate.weight"] = torch.randn(E, H, generator=g).to(torch.bfloat16)
        t[f"{pre}.ffn.gate.bias"] = torch.randn(E, generator=g)
        for w, shp in (("w1", (I, H)), ("w2", (H, I)), ("w3", (I, H))):
            t[f"{pre}.ffn.shared_experts.{w}.weight"] = _fp8(shp, g)
            t[f"{pre}.ffn.shared_experts.{w}.scale"] = _e8m0((math.ceil(shp[0] / 128), math.ceil(shp[1] / 128)), g)
        for e in range(E):
            for w, (n, k) in (("w1", (I, H)), ("w2", (H, I)), ("w3", (I, H))):
                t[f"{pre}.ffn.experts.{e}.{w}.weight"] = torch.randint(
                    -128, 128, (n, k // 2), dtype=torch.int8, generator=g).view(expert_dtype)
                # realistic spread: within 17 binades per w1/w3 pair -> exact;
                # w1's maximum is below w3's, so only a shared global scale is right
                lo, hi = {"w1": (116, 123), "w2": (110, 125), "w3": (118, 126)}[w]
                t[f"{pre}.ffn.experts.{e}.{w}.scale"] = _e8m0((n, k // 32), g, lo, hi)
    t["mtp.0.e_proj.weight"] = _fp8((H, H), g)
    t["mtp.0.e_proj.scale"] = _e8m0((2, 2), g)
    t["mtp.0.enorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    if oor:
        # layer 1 expert 2: w3 holds the pair's max exponent (w1 shares it), a
        # w1 block 18 binades lower (one step out of range) and a w3 block 40 lower.
        s1 = t["layers.1.ffn.experts.2.w1.scale"].view(torch.uint8)
        s3 = t["layers.1.ffn.experts.2.w3.scale"].view(torch.uint8)
        s3[0, 0] = 126
        s1[5, 3] = 126 - 18
        s3[7, 1] = 126 - 40
        s3[9, 2] = 126 - 17  # exactly at the edge: still exact
    return t


def write_checkpoint(root: Path, tensors: dict, config: dict, n_shards: int = 3, index: bool = True):
    """Shards by insertion order, with a deliberately awkward split: layer 0 expert 1's
    w3 lands in another shard than its w1, and one scale lands apart from its weight."""
    root.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    # move a few tensors to the last shard
    move = ["layers.0.ffn.experts.1.w3.weight", "layers.0.ffn.experts.1.w3.scale",
            "layers.1.ffn.experts.0.w2.scale"]
    names = [n for n in names if n not in move] + [n for n in move if n in tensors]
    per = math.ceil(len(names) / n_shards)
    wm = {}
    for s in range(n_shards):
        fn = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        chunk = {n: tensors[n].contiguous() for n in names[s * per:(s + 1) * per]}
        save_file(chunk, str(root / fn), metadata={"format": "pt"})
        for n in chunk:
            wm[n] = fn
    if index:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (root / C.INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wm}))
    (root / "config.json").write_text(json.dumps(config, indent=2))
    (root / "tokenizer.json").write_text('{"dummy": true}')
    (root / "inference").mkdir(exist_ok=True)
    (root / "inference" / "model.py").write_text("# reference code\n")
    return root


def make_synthetic_checkpoint(root: Path, seed: int = 0, oor: bool = False, **kw) -> Path:
    return write_checkpoint(Path(root), synth_tensors(seed, oor=oor), dsv4_config(), **kw)


def tree_hashes(root: Path) -> dict:
    out = {}
    for p in sorted(Path(root).rglob("*")):
        if p.is_file():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def load_all(root: Path) -> dict:
    idx = json.loads((root / C.INDEX_FILE).read_text())["weight_map"]
    out = {}
    for fn in sorted(set(idx.values())):
        with safe_open(str(root / fn), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    assert set(out) == set(idx)
    return out


# independent reference dequantization (bit fields, float64)
def _e2m1_table():
    vals = []
    for c in range(16):
        s = -1.0 if c & 8 else 1.0
        e, m = (c >> 1) & 3, c & 1
        vals.append(s * ((m * 0.5) if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)))
    return torch.tensor(vals, dtype=torch.float64)


_T = _e2m1_table()


def ref_codes(w):
    b = w.view(torch.uint8).long()
    return torch.stack((b & 15, b >> 4), -1).reshape(b.shape[0], -1)


def ref_mx(w, s):
    v = _T[ref_codes(w)]
    sc = torch.pow(2.0, s.view(torch.uint8).double() - 127).repeat_interleave(32, -1)
    return v * sc


def ref_nv(w, sc, s2):
    v = _T[ref_codes(w)]
    return v * sc.double().repeat_interleave(16, -1) * float(s2)


def run_cli(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(OVERLAY))
    return subprocess.run([sys.executable, "-m", "dsv4_sm120.convert_nvfp4", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=str(REPO))


# ----------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    base = tmp_path_factory.mktemp("conv")
    src = make_synthetic_checkpoint(base / "src", seed=1)
    before = tree_hashes(src)
    res = C.convert(src, base / "dst", verify=True, progress=False, quiet=True)
    assert tree_hashes(src) == before  # SRC untouched
    return src, base / "dst", res


def test_bit_exact_layout_and_carry(converted):
    src, dst, res = converted
    a, b = load_all(src), load_all(dst)
    assert res.stats.out_of_range == 0 and res.stats.max_abs_err == 0.0
    assert res.verify["ok"] and res.verify["experts_exact_in_range"] == LAYERS * E * 3
    n_conv = 0
    for name, t in a.items():
        m = C.EXPERT_RE.match(name)
        if m and m["kind"] == "layers":
            if m["field"] == "scale":
                assert name not in b  # never an NVFP4 ".scale"
                continue
            pre = name[: -len(".weight")]
            w, sc = b[f"{pre}.weight"], b[f"{pre}.weight_scale"]
            s2, isc = b[f"{pre}.weight_scale_2"], b[f"{pre}.input_scale"]
            assert w.dtype == torch.uint8 and w.shape == t.shape
            assert torch.equal(w, t.view(torch.uint8))  # nibbles verbatim
            assert sc.dtype == torch.float8_e4m3fn and sc.shape == (t.shape[0], t.shape[1] * 2 // 16)
            assert s2.dtype == torch.float32 and s2.shape == () and isc.shape == ()
            assert torch.equal(ref_nv(w, sc, s2), ref_mx(t, a[f"{pre}.scale"]))
            # w1 / w3 share one global scale: 2^(max exponent of the pair - 8)
            if m["proj"] in ("w1", "w3"):
                base = f"{m['base']}"
                mx = max(int(a[f"{base}.w1.scale"].view(torch.uint8).max()),
                         int(a[f"{base}.w3.scale"].view(torch.uint8).max())) - 127
                assert s2.item() == 2.0 ** (mx - 8)
                assert b[f"{base}.w1.weight_scale_2"].item() == b[f"{base}.w3.weight_scale_2"].item()
            n_conv += 1
        else:
            # everything else, MTP experts and their ".scale" included, byte for byte
            assert b[name].dtype == t.dtype and torch.equal(b[name].view(torch.uint8), t.view(torch.uint8)), name
    assert n_conv == LAYERS * E * 3
    assert len(b) == len(a) + 2 * n_conv  # +weight_scale_2 +input_scale, scale -> weight_scale
    # aux files copied, config rewritten, index complete
    assert (dst / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
    assert (dst / "inference" / "model.py").exists()
    cfg = json.loads((dst / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    assert qc["quant_algo"] == "MIXED_PRECISION" and qc["moe_quant_algo"] == "NVFP4" and qc["group_size"] == 16
    src_cfg = json.loads((src / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == \
        {k: v for k, v in src_cfg.items() if k != "quantization_config"}
    rep = json.loads((dst / C.REPORT_FILE).read_text())
    assert rep["out_of_range_blocks"] == 0 and rep["nvfp4_expert_projections"] == LAYERS * E * 3
    assert rep["mtp_expert_projections_kept_mxfp4"] == E * 3


def test_default_input_scales_documented_formula(converted):
    src, dst, _ = converted
    b = load_all(dst)
    lim = 10.0
    assert b["layers.0.ffn.experts.0.w1.input_scale"].item() == pytest.approx(448 / 2688)
    assert b["layers.0.ffn.experts.0.w3.input_scale"].item() == pytest.approx(448 / 2688)
    assert b["layers.1.ffn.experts.3.w2.input_scale"].item() == pytest.approx(
        lim * lim / (1 + math.exp(-lim)) / 2688)


def test_out_of_range_blocks_clamped_counted_measured(tmp_path):
    src = make_synthetic_checkpoint(tmp_path / "src", seed=2, oor=True)
    res = C.convert(src, tmp_path / "dst", verify=True, progress=False, quiet=True)
    a, b = load_all(src), load_all(tmp_path / "dst")
    # independent count: blocks more than 17 binades below the pair maximum
    n_oor, max_err = 0, 0.0
    for name in a:
        m = C.EXPERT_RE.match(name)
        if not (m and m["kind"] == "layers" and m["field"] == "weight"):
            continue
        base, proj = m["base"], m["proj"]
        pair = ("w1", "w3") if proj != "w2" else ("w2",)
        kmax = max(int(a[f"{base}.{p}.scale"].view(torch.uint8).max()) for p in pair) - 127
        k = a[f"{base}.{proj}.scale"].view(torch.uint8).long() - 127
        n_oor += int((k - (kmax - 8) < -9).sum())
        pre = f"{base}.{proj}"
        diff = (ref_nv(b[f"{pre}.weight"], b[f"{pre}.weight_scale"], b[f"{pre}.weight_scale_2"])
                - ref_mx(a[f"{pre}.weight"], a[f"{pre}.scale"])).abs()
        inr = (k - (kmax - 8) >= -9).repeat_interleave(32, -1)
        assert diff[inr].max().item() == 0.0, pre  # in-range blocks stay exact
        max_err = max(max_err, diff.max().item())
    assert n_oor == 2
    assert res.stats.out_of_range == 2
    assert res.stats.max_abs_err == max_err and max_err > 0
    assert res.stats.max_abs_err_tensor.startswith("layers.1.ffn.experts.2.")
    assert res.verify["ok"] and res.verify["out_of_range_blocks"] == 2
    rep = json.loads((tmp_path / "dst" / C.REPORT_FILE).read_text())
    assert rep["out_of_range_blocks"] == 2 and rep["max_abs_err"] == max_err


class PlantedCrash(Exception):
    """A failure planted in the middle of a conversion."""


def convert_until_crash(src, dst, shard: str, index: int) -> None:
    """Convert ``src`` into ``dst`` until the converter's fault hook raises at tensor ``index`` of the shard whose
    file name starts with ``shard`` (the crash a resumed run recovers from)."""

    def fault(fn, i):
        if fn.startswith(shard) and i == index:
            raise PlantedCrash()

    with pytest.raises(PlantedCrash):
        C.convert(src, dst, progress=False, quiet=True, _fault=fault)


def test_resume_after_crash_gives_identical_output(tmp_path, converted):
    src, clean_dst, _ = converted
    dst = tmp_path / "dst"

    convert_until_crash(src, dst, "model-00002", 5)
    assert (dst / "model-00001-of-00003.safetensors").exists()
    assert (dst / ".model-00002-of-00003.safetensors.partial").exists()
    assert not (dst / "model-00002-of-00003.safetensors").exists()
    assert not (dst / C.INDEX_FILE).exists() and not (dst / "config.json").exists()  # not loadable yet
    first_mtime = (dst / "model-00001-of-00003.safetensors").stat().st_mtime_ns
    res = C.convert(src, dst, progress=False, quiet=True)
    assert res.skipped == ["model-00001-of-00003.safetensors"]
    assert (dst / "model-00001-of-00003.safetensors").stat().st_mtime_ns == first_mtime
    want = {k: v for k, v in tree_hashes(clean_dst).items() if not k.startswith(C.STATE_DIR)}
    got = {k: v for k, v in tree_hashes(dst).items() if not k.startswith(C.STATE_DIR)}
    assert got == want
    # a finished shard that was damaged afterwards is detected and redone
    p = dst / "model-00003-of-00003.safetensors"
    raw = bytearray(p.read_bytes())
    raw[-3] ^= 0xFF
    p.write_bytes(bytes(raw))
    res = C.convert(src, dst, progress=False, quiet=True)
    assert res.converted == ["model-00003-of-00003.safetensors"]
    got = {k: v for k, v in tree_hashes(dst).items() if not k.startswith(C.STATE_DIR)}
    assert got == want
    # a complete DST reruns as a no-op
    res = C.convert(src, dst, progress=False, quiet=True)
    assert res.converted == [] and len(res.skipped) == 3


def test_refusals_cli(tmp_path, converted):
    src, dst_ok, _ = converted
    r = run_cli("--help")
    assert r.returncode == 0 and "SRC" in r.stdout and "--verify" in r.stdout

    def refused(args, needle):
        r = run_cli(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert needle in r.stderr, (needle, r.stderr)
        assert "Traceback" not in r.stderr
        return r

    refused([tmp_path / "nope", tmp_path / "o1"], "does not exist")
    refused([src, src / "out"], "never writes into SRC")
    refused([src, src], "never writes into SRC")
    refused([dst_ok, tmp_path / "o2"], "already a hybrid FP8+NVFP4")
    # not DSv4
    other = tmp_path / "llama"
    write_checkpoint(other, {"model.embed_tokens.weight": torch.zeros(4, 4)},
                     {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, n_shards=1)
    refused([other, tmp_path / "o3"], "not a DeepSeek-V4 checkpoint")
    # DSv4 with FP8 experts (an FP8-converted checkpoint)
    t = synth_tensors(3)
    for k in list(t):
        m = C.EXPERT_RE.match(k)
        if m and m["field"] == "weight":
            n, kh = t[k].shape
            t[k] = torch.zeros(n, kh * 2).to(torch.float8_e4m3fn)
    write_checkpoint(tmp_path / "fp8", t, dsv4_config())
    refused([tmp_path / "fp8", tmp_path / "o4"], "not MXFP4")
    # missing scale
    t = synth_tensors(4)
    del t["layers.1.ffn.experts.3.w2.scale"]
    write_checkpoint(tmp_path / "noscale", t, dsv4_config())
    refused([tmp_path / "noscale", tmp_path / "o5"], "has no layers.1.ffn.experts.3.w2.scale")
    # index pointing at a missing shard
    bad = make_synthetic_checkpoint(tmp_path / "missing", seed=5)
    (bad / "model-00002-of-00003.safetensors").unlink()
    refused([bad, tmp_path / "o6"], "is missing")
    # truncated shard
    tr = make_synthetic_checkpoint(tmp_path / "trunc", seed=6)
    p = tr / "model-00003-of-00003.safetensors"
    p.write_bytes(p.read_bytes()[:-100])
    refused([tr, tmp_path / "o7"], "truncated")
    # a non-empty foreign DST
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x.txt").write_text("mine")
    refused([src, foreign], "not empty")
    assert (foreign / "x.txt").read_text() == "mine"
    # no routed experts at all
    t = {k: v for k, v in synth_tensors(7).items() if ".experts." not in k or "shared" in k}
    write_checkpoint(tmp_path / "noexp", t, dsv4_config())
    refused([tmp_path / "noexp", tmp_path / "o8"], "no routed expert tensors")


def dst_snapshot(root: Path) -> dict:
    """Every path under DST (hidden ones included) with its content hash and mtime."""
    out = {}
    for q in sorted(Path(root).rglob("*")):
        st = q.stat()
        out[str(q.relative_to(root))] = (hashlib.sha256(q.read_bytes()).hexdigest() if q.is_file() else "dir",
                                         st.st_mtime_ns)
    return out


def shard_of(root: Path, name: str) -> str:
    return json.loads((root / C.INDEX_FILE).read_text())["weight_map"][name]


def poke_tensor_byte(root: Path, name: str, offset: int, value: int) -> None:
    """Overwrite one data byte of a tensor in place (the header, hence the source fingerprint, stays)."""
    fn = shard_of(root, name)
    with safe_open(str(root / fn), "pt") as f:
        assert name in f.keys()
    hdr = C.read_header(root / fn)
    with open(root / fn, "r+b") as f:
        f.seek(hdr.data_start + hdr.tensors[name].begin + offset)
        f.write(bytes([value]))


def test_nan_scale_refused_before_anything_is_written(tmp_path):
    """A 0xFF (NaN) E8M0 scale in the last shard: exit 2 naming shard, tensor and position, no
    traceback, DST never created (before, the earlier shards were converted first)."""
    t = synth_tensors(11)
    name = "layers.1.ffn.experts.0.w2.scale"  # moved to the last shard by write_checkpoint
    t[name].view(torch.uint8)[3, 1] = 0xFF
    src = write_checkpoint(tmp_path / "src", t, dsv4_config())
    fn = shard_of(src, name)
    assert fn == "model-00003-of-00003.safetensors"
    r = run_cli(src, tmp_path / "dst", "--no-progress")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    line = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and fn in line[0] and name in line[0] and "0xFF" in line[0] and "[3, 1]" in line[0]
    assert not (tmp_path / "dst").exists()
    # --dry-run reads and checks SRC too; --verify-only refuses the same way
    assert C.main([str(src), str(tmp_path / "dry"), "--dry-run", "-q"]) == 2
    assert not (tmp_path / "dry").exists()
    # a NaN in an MTP draft expert (carried as MXFP4, never decoded here) is no less damaged
    t = synth_tensors(11)
    t["mtp.0.ffn.experts.3.w1.scale"].view(torch.uint8)[0, 0] = 0xFF
    src2 = write_checkpoint(tmp_path / "src2", t, dsv4_config())
    (tmp_path / "dst2").mkdir()
    assert C.main([str(src2), str(tmp_path / "dst2"), "-q", "--no-progress"]) == 2
    assert list((tmp_path / "dst2").iterdir()) == []


def test_damaged_source_leaves_partial_dst_untouched(tmp_path, capsys):
    """A resumable partial DST from an earlier run stays byte for byte and mtime for mtime as it
    was when SRC turns out damaged (NaN scale, F32 scale that is no power of two); once SRC is
    repaired the same DST resumes."""
    src = make_synthetic_checkpoint(tmp_path / "src", seed=12)
    dst = tmp_path / "dst"

    convert_until_crash(src, dst, "model-00002", 3)
    before = dst_snapshot(dst)
    assert "model-00001-of-00003.safetensors" in before and ".model-00002-of-00003.safetensors.partial" in before
    name = "layers.0.ffn.experts.1.w3.scale"
    poke_tensor_byte(src, name, 17, 0xFF)
    capsys.readouterr()
    assert C.main([str(src), str(dst), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "model-00003-of-00003.safetensors" in err and name in err and "0xFF" in err
    assert dst_snapshot(dst) == before
    assert C.main([str(src), str(dst), "--no-progress", "--quick-resume", "-q"]) == 2
    assert dst_snapshot(dst) == before
    poke_tensor_byte(src, name, 17, 125)
    res = C.convert(src, dst, progress=False, quiet=True, verify=True)
    assert res.skipped == ["model-00001-of-00003.safetensors"] and res.verify["ok"]


@pytest.mark.parametrize("bad", ["shape", "dtype", "f32_not_pow2", "f32_nan"])
def test_malformed_scale_refused_naming_shard_and_tensor(tmp_path, capsys, bad):
    """Scales that do not fit their weight (shape, dtype) or hold values no E8M0 byte encodes
    (F32 that is not a power of two, F32 NaN) are refused with exit 2 before DST is created."""
    t = synth_tensors(13)
    name = "layers.1.ffn.experts.0.w2.scale"
    n, c = t[name].shape
    if bad == "shape":
        t[name] = t[name][:, : c - 1].contiguous()
        needle = "does not fit"
    elif bad == "dtype":
        t[name] = t[name].view(torch.uint8).to(torch.bfloat16)
        needle = "dtype BF16"
    else:
        t[name] = torch.pow(2.0, t[name].view(torch.uint8).float() - 127)
        t[name][n - 1, c - 1] = 0.75 if bad == "f32_not_pow2" else float("nan")
        needle = "not all powers of two"
    src = write_checkpoint(tmp_path / "src", t, dsv4_config())
    capsys.readouterr()
    assert C.main([str(src), str(tmp_path / "dst"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "model-00003-of-00003.safetensors" in line[0] and name in line[0] and needle in line[0]
    assert not (tmp_path / "dst").exists()


def test_far_out_of_range_blocks_counted_in_report(tmp_path):
    """Scale bytes 0..10 next to 254 in one expert (blocks ~230 binades below the maximum, where a
    float32 shift underflows): report and stats count every block whose values change, with its
    error, against a count made here from the source bytes."""
    t = synth_tensors(14)
    g = torch.Generator().manual_seed(14)
    pre = "layers.0.ffn.experts.3.w2"
    sc = t[f"{pre}.scale"].view(torch.uint8)
    w = t[f"{pre}.weight"].view(torch.uint8)
    sc[:] = torch.randint(237, 255, sc.shape, dtype=torch.uint8, generator=g)  # in range of 254
    sc[0, 0] = 254
    far = torch.rand(sc.shape, generator=g) < 0.3
    far[0, 0] = False
    sc[far] = torch.randint(0, 11, (int(far.sum()),), dtype=torch.uint8, generator=g)
    w[far.repeat_interleave(16, -1) & (torch.arange(w.shape[0]) % 4 == 1).unsqueeze(-1)] = 0x88  # -0: unchanged
    src = write_checkpoint(tmp_path / "src", t, dsv4_config())
    res = C.convert(src, tmp_path / "dst", verify=True, progress=False, quiet=True)
    # far blocks: every nonzero magnitude rounds to 0 on the clamped grid, so a block changes iff
    # it holds a nonzero code; its error is its largest |value|
    codes = ref_codes(t[f"{pre}.weight"]).reshape(sc.shape[0], sc.shape[1], 32)
    nonzero = ((codes & 7) != 0).any(-1)
    n_lossy = int((far & nonzero).sum())
    vals = ref_mx(t[f"{pre}.weight"], sc).abs().reshape(codes.shape).amax(-1)
    max_err = vals[far].max().item()
    assert 0 < n_lossy < int(far.sum())
    assert res.stats.out_of_range == int(far.sum()) and res.stats.lossy == n_lossy
    assert res.stats.max_abs_err == max_err and res.stats.max_abs_err_tensor == f"{pre}.weight"
    assert res.verify["ok"] and res.verify["out_of_range_blocks"] == int(far.sum())
    rep = json.loads((tmp_path / "dst" / C.REPORT_FILE).read_text())
    assert rep["lossy_blocks"] == n_lossy and rep["max_abs_err"] == max_err


def test_disk_space_check_and_dry_run(tmp_path, converted):
    src, _, _ = converted
    with pytest.raises(C.ConvertError, match="not enough free space"):
        C.convert(src, tmp_path / "d", progress=False, quiet=True, min_free_margin=1 << 60)
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())
    r = run_cli(src, tmp_path / "dry", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "converted to NVFP4" in r.stderr and "free" in r.stderr
    assert not (tmp_path / "dry").exists()


def test_input_scales_from_json_and_checkpoint(tmp_path, converted):
    src, _, _ = converted
    js = tmp_path / "scales.json"
    js.write_text(json.dumps({"w13": 0.25, "w2": 0.0625,
                              "tensors": {"layers.1.ffn.experts.2.w2.input_scale": 0.5}}))
    d1 = tmp_path / "d1"
    C.convert(src, d1, input_scales=str(js), progress=False, quiet=True)
    b = load_all(d1)
    assert b["layers.0.ffn.experts.0.w1.input_scale"].item() == 0.25
    assert b["layers.0.ffn.experts.0.w2.input_scale"].item() == 0.0625
    assert b["layers.1.ffn.experts.2.w2.input_scale"].item() == 0.5
    # take them from an existing NVFP4 checkpoint (d1) for a second conversion
    d2 = tmp_path / "d2"
    C.convert(src, d2, input_scales=str(d1), progress=False, quiet=True)
    b2 = load_all(d2)
    for k, v in b.items():
        if k.endswith(".input_scale"):
            assert b2[k].item() == v.item()
    # same DST, other options: refused rather than mixed
    with pytest.raises(C.ConvertError, match="different options"):
        C.convert(src, d1, progress=False, quiet=True)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"w13": -1}))
    r = run_cli(src, tmp_path / "d3", "--input-scales", bad)
    assert r.returncode == 2 and "positive" in r.stderr and "Traceback" not in r.stderr
    bad.write_text(json.dumps({"layers.0.attn.wq_a.input_scale": 1.0}))
    r = run_cli(src, tmp_path / "d4", "--input-scales", bad)
    assert r.returncode == 2 and "not a routed-expert input_scale" in r.stderr


def test_verify_only_detects_tampering(tmp_path, converted):
    src, dst_ok, _ = converted
    r = run_cli(src, dst_ok, "--verify-only", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stderr
    # flip one nibble of one converted expert in a copy of the output
    import shutil

    d = tmp_path / "t"
    shutil.copytree(dst_ok, d)
    fn = json.loads((d / C.INDEX_FILE).read_text())["weight_map"]["layers.1.ffn.experts.1.w2.weight"]
    hdr = C.read_header(d / fn)
    ti = hdr.tensors["layers.1.ffn.experts.1.w2.weight"]
    with open(d / fn, "r+b") as f:
        f.seek(hdr.data_start + ti.begin + 10)
        byte = f.read(1)[0]
        f.seek(hdr.data_start + ti.begin + 10)
        f.write(bytes([byte ^ 0x01]))
    r = run_cli(src, d, "--verify-only", "--no-progress")
    assert r.returncode == 1
    assert "layers.1.ffn.experts.1.w2" in r.stderr and "not bit-exact" in r.stderr
    # and a carried tensor
    shutil.rmtree(d)
    shutil.copytree(dst_ok, d)
    fn = json.loads((d / C.INDEX_FILE).read_text())["weight_map"]["layers.0.attn.wq_a.weight"]
    hdr = C.read_header(d / fn)
    ti = hdr.tensors["layers.0.attn.wq_a.weight"]
    with open(d / fn, "r+b") as f:
        f.seek(hdr.data_start + ti.begin)
        f.write(b"\x00\x00\x00\x01")
    r = run_cli(src, d, "--verify-only", "--no-progress")
    assert r.returncode == 1 and "carried tensor differs" in r.stderr


def test_uint8_experts_no_index_and_f32_scales(tmp_path):
    """U8-stored experts, a single shard without an index, F32 power-of-two scales."""
    t = synth_tensors(8, expert_dtype=torch.uint8)
    for k in list(t):
        m = C.EXPERT_RE.match(k)
        if m and m["field"] == "scale" and m["layer"] == "0":
            t[k] = torch.pow(2.0, t[k].view(torch.uint8).float() - 127)
    src = write_checkpoint(tmp_path / "src", t, dsv4_config(), n_shards=1, index=False)
    res = C.convert(src, tmp_path / "dst", verify=True, progress=False, quiet=True)
    assert res.verify["ok"] and res.stats.out_of_range == 0
    b = load_all(tmp_path / "dst")
    for e in range(E):
        pre = f"layers.0.ffn.experts.{e}.w1"
        s = torch.log2(t[f"{pre}.scale"]).round().to(torch.int64) + 127
        assert torch.equal(ref_nv(b[f"{pre}.weight"], b[f"{pre}.weight_scale"], b[f"{pre}.weight_scale_2"]),
                           ref_mx(t[f"{pre}.weight"], s.to(torch.uint8)))


SGLANG_DETECT = r"""
import json, logging, sys
logging.disable(logging.WARNING)
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.configs.deepseek_v4 import try_detect_fp4_experts
from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config
out = {}
for tag, path in (("src", sys.argv[1]), ("dst", sys.argv[2])):
    mc = ModelConfig(path, trust_remote_code=False)
    out[tag] = {"nvfp4_moe_meta": mc.nvfp4_moe_meta, "is_fp4_experts": mc.is_fp4_experts,
                "probe": try_detect_fp4_experts(path), "quant_method": mc.hf_quant_config.get("quant_method")}
    if mc.nvfp4_moe_meta:
        # the exclusion list exactly as the loader builds it (loader.py, hybrid NVFP4 branch)
        cfg = ModelOptFp4Config(is_checkpoint_nvfp4_serialized=True, group_size=mc.nvfp4_moe_meta["group_size"],
                                exclude_modules=list(mc.nvfp4_moe_meta["exclude_modules"]) + ["model.decoder.*", "stages.*"],
                                packed_modules_mapping={})
        out[tag]["excluded"] = {p: cfg.is_layer_excluded(p) for p in
                                ["model.layers.0.mlp.experts", "model.layers.42.mlp.experts", "model.decoder.mlp.experts"]}
print("RESULT" + json.dumps(out))
"""


def test_sglang_0523_detects_hybrid_nvfp4(converted, python_child):
    """SGLang 0.5.23's own (unpatched) config detection on SRC and on the converter's output."""
    src, dst, _ = converted
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = python_child(SGLANG_DETECT, [src, dst], env=env, timeout=300, cwd="/tmp")
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    if not lines and "No module named 'sglang'" in r.stderr:
        pytest.skip("sglang not installed in this environment")
    assert lines, r.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT"):])
    assert out["src"]["nvfp4_moe_meta"] is None and out["src"]["is_fp4_experts"] is True
    d = out["dst"]
    assert d["nvfp4_moe_meta"] == {"group_size": 16, "exclude_modules": C.NVFP4_IGNORE}
    assert d["quant_method"] == "fp8"
    # routed experts still probe as packed FP4 (U8), so the MTP experts load as MXFP4
    assert d["is_fp4_experts"] is True and d["probe"] is True
    assert d["excluded"] == {"model.layers.0.mlp.experts": False, "model.layers.42.mlp.experts": False,
                             "model.decoder.mlp.experts": True}
