"""Speculative decoding's attention calls on sm_120 reach our kernel (CPU, Triton interpreter).

One subprocess on the patched pinned SGLang (`run_patched`) drives SGLang's own entry,
``DeepseekV4AttnBackend.forward``, under a forced sm_120 platform, once per call kind of
docs/speculative.md's table, at the real argument shapes (small batches):

* the SWA indices and lengths come from SGLang's own metadata builder
  (``make_core_attn_metadata``: ``ComputeDsparkWindowGather`` + ``BuildDsparkSwaPageIndices`` for the
  DSpark draft, ``BuildCausalSwaPageIndices`` for the rest), the c128 indices from its compression
  metadata; the c4 indexer's top-k is stood in for by random c4 slots (up to 512, as many as the
  position allows);
* q has the head count the model hands over: DSpark pads its 16 real heads to 64 (the padded rows are
  NaN here, so a leak shows), the target / MTP layers ask the patched ``_kernel_num_heads``; the sink
  carries NaN beyond the real heads;
* ``dsv4_sm120.attention.launch.sparse_mla_decode`` is wrapped to count calls, and every sm_120
  FlashInfer entry of SGLang (``flash_mla_with_kvcache_sm120``, ``_flash_mla_flashinfer``,
  ``_flash_mla_sm120_prefill``, ...) is replaced by a function that raises.

Each test asserts its own case from the shared result: our kernel ran with the real heads, FlashInfer
was never reached, the output matches SGLang's torch path ``_sm120_sparse_decode_fwd`` and the float64
reference on the real heads, no NaN leaked. A deliberately wrong route (the backend switch forced to
``flashinfer``) must be seen by the same checks.
"""

from __future__ import annotations

import math
import random

import pytest

from conftest import probe_result

SCRIPT = r'''
import json, math, os, sys, types, traceback
import torch
sys.path.insert(0, "tests")
job = json.loads(sys.argv[1])
torch.manual_seed(job["seed"])

# count our kernel's calls (whichever name the glue imports it by)
import dsv4_sm120.attention as A
import dsv4_sm120.attention.launch as L
from dsv4_sm120.attention.cache import cache_view, random_cache
from dsv4_sm120.attention.reference import rel_fro, sparse_mla_decode_ref
OURS, FI = [], []
_ours = L.sparse_mla_decode
def counted(q, *a, **k):
    idx = k.get("indices", a[1] if len(a) > 1 else None)
    ex = k.get("extra_indices_in_kvcache", a[7] if len(a) > 7 else None)
    OURS.append({"q": list(q.shape), "K": int(idx.shape[-1]), "K2": None if ex is None else int(ex.shape[-1])})
    return _ours(q, *a, **k)
L.sparse_mla_decode = counted
A.sparse_mla_decode = counted

# every sm_120 FlashInfer entry of SGLang raises
from sglang.kernels.ops.attention import flash_mla_sm120 as m
torch_path = m._sm120_sparse_decode_fwd
class FlashInferReached(RuntimeError):
    pass
def trap(name):
    def f(*a, **k):
        FI.append(name)
        raise FlashInferReached(name)
    return f
for n in ("flash_mla_with_kvcache_sm120", "_flash_mla_flashinfer", "_flash_mla_sm120_prefill",
          "_split_kv_pages_to_64", "flashinfer_sparse_mla_forward"):
    setattr(m, n, trap(n))

import sglang.srt.layers.attention.deepseek_v4_backend as be
import sglang.srt.models.deepseek_v4 as mdl
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import override_platform
# the sm_100 FlashMLA scheduler metadata (needs CUDA); the sm_120 branch never reads it
be._create_flashmla_metadata = lambda: None

H, HPAD, BLOCK, NREQ, CTX = 16, 64, 5, 18, 512
SCALE = 512 ** -0.5
req_to_token = (256 + torch.arange(NREQ * CTX, dtype=torch.int32)).view(NREQ, CTX)
swa = random_cache(8, 256, poison_slots=torch.arange(7 * 256, 8 * 256))          # last page poisoned
c4 = random_cache(8, 64, poison_slots=torch.arange(7 * 64, 8 * 64))
c128 = random_cache(40, 2)
f2s = torch.randint(0, 7 * 256, (256 + NREQ * CTX,), dtype=torch.int64)           # full slot -> SWA slot
LAYERS = {0: (0, None), 2: (4, c4), 3: (128, c128)}                               # layer id -> ratio, cache

class Pool(DeepSeekV4TokenToKVPool):
    """The pool's attention-facing getters over test caches (the real constructor allocates GPU pools)."""
    def __init__(self):
        self.request_window = None
        self.swa_req_ring_size = None
        self.swa_valid_from = None
        self.full_to_swa_index_mapping = f2s
    def get_swa_key_buffer_radix(self, layer_id): return swa.raw
    def get_swa_key_page_size(self): return 256
    def get_swa_key_bytes_per_token(self): return 584
    def get_extra_key_buffer(self, layer_id): return LAYERS[layer_id][1].raw
    def get_extra_key_page_size(self, layer_id): return LAYERS[layer_id][1].page_size
    def get_extra_key_bytes_per_token(self, layer_id): return 584

def backend(dspark, ratio):
    bk = object.__new__(be.DeepseekV4AttnBackend)
    bk.__dict__.update(token_to_kv_pool=Pool(), req_to_token=req_to_token, page_size=256, is_dspark_draft=dspark,
                       speculative_num_draft_tokens=BLOCK + 1, cuda_int32_kwargs={}, index_topk=512,
                       present_ratios=(4, 128) if ratio else (), low_ratios=(), encoder_row_floor=None,
                       encoder_replay=False, mtp_enabled=True, trtllm_attn=False, head_dim_v=512,
                       softmax_scale=SCALE, is_dsv41=False)
    return bk

def metadata(bk, prefixes, n, dspark, ratio):
    """SGLang's own metadata for requests with `prefixes` committed tokens and n query rows each."""
    rp = torch.arange(len(prefixes)).repeat_interleave(n)
    slc = torch.cat([p + 1 + torch.arange(n) for p in prefixes]).to(torch.int32)
    out_loc = torch.cat([req_to_token[b, p:p + n] for b, p in enumerate(prefixes)]).to(torch.int64)
    meta = bk.make_core_attn_metadata(req_to_token=req_to_token, req_pool_indices_repeated=rp, seq_lens_casual=slc,
                                      max_seq_len=CTX, out_loc=out_loc, need_compress=bool(ratio),
                                      num_tokens=slc.numel(), dspark_block_size=BLOCK if dspark else None)
    if ratio == 4:  # the indexer's top-k: random good c4 slots, as many as the position has (<= 512)
        T = slc.numel()
        n4 = meta.c4_topk_lengths_clamp1.clamp(max=512).to(torch.int32)
        idx = torch.full((T, 512), -1, dtype=torch.int32)
        for t in range(T):
            idx[t, : int(n4[t])] = torch.randperm(7 * 64)[: int(n4[t])].to(torch.int32)
        meta.c4_sparse_page_indices, meta.c4_sparse_topk_lengths = idx, n4
    return meta

fake_layer = types.SimpleNamespace(n_local_heads=H, n_heads=64, attn_tp_size=4)

def run_case(c):
    mode = getattr(ForwardMode, c["mode"])
    dspark, ratio, n = c["dspark"], LAYERS[c["layer"]][0], c["rows"]
    bk = backend(dspark, ratio)
    meta = metadata(bk, c["prefixes"], n, dspark, ratio)
    bk.forward_metadata = types.SimpleNamespace(core_attn_metadata=meta, late_layer_tail=None)
    T = len(c["prefixes"]) * n
    with override_platform(is_sm120=True):
        # DSpark pads to 64 heads itself; the target / MTP layers ask the (patched) model for the head count
        hk = HPAD if dspark else mdl.MqaAttentionBase._kernel_num_heads(fake_layer, T)
    q = torch.full((T, hk, 512), float("nan")).to(torch.bfloat16)
    q[:, :H] = torch.randn(T, H, 512).to(torch.bfloat16)
    sink = torch.full((max(hk, HPAD),), float("nan"))
    sink[:H] = torch.randn(H) * 2
    kv = torch.zeros(T, 512, dtype=torch.bfloat16)
    layer = types.SimpleNamespace(layer_id=c["layer"], tp_q_head_num=H, v_head_dim=512)
    fb = types.SimpleNamespace(forward_mode=mode)
    OURS.clear(); FI.clear()
    r = {"T": T, "heads_given": hk, "swa_K": int(meta.swa_page_indices.shape[-1]),
         "swa_len": [int(x) for x in meta.swa_topk_lengths]}
    try:
        with override_platform(is_sm120=True):
            o = bk.forward(q, kv, kv, layer, fb, compress_ratio=ratio, save_kv_cache=False, attn_sink=sink)
    except FlashInferReached:
        r.update(ours=list(OURS), flashinfer=list(FI))
        return r
    r.update(ours=list(OURS), flashinfer=list(FI), out_shape=list(o.shape))
    real = o[:, :H].unsqueeze(1)
    view = lambda cache: cache_view(cache.raw, cache.page_size)
    args = dict(q=q[:, :H].unsqueeze(1), k_cache=view(swa), indices=meta.swa_page_indices.unsqueeze(1),
                topk_length=meta.swa_topk_lengths, attn_sink=sink[:H], head_dim_v=512, softmax_scale=SCALE)
    if ratio:
        args.update(extra_k_cache=view(LAYERS[c["layer"]][1]),
                    extra_indices_in_kvcache=meta.sparse_page_indices(ratio).unsqueeze(1),
                    extra_topk_length=meta.sparse_topk_lengths(ratio))
        r["extra_K"] = int(args["extra_indices_in_kvcache"].shape[-1])
    ref_t = torch_path(args["q"], args["k_cache"], args["indices"], args["topk_length"], args["attn_sink"], 512, SCALE,
                       args.get("extra_k_cache"), args.get("extra_indices_in_kvcache"), args.get("extra_topk_length"))[0]
    ref64 = sparse_mla_decode_ref(**args)[0]
    r.update(finite=bool(torch.isfinite(real.float()).all()), err_torch=rel_fro(real, ref_t),
             err_f64=rel_fro(real, ref64), ref_finite=bool(torch.isfinite(ref64).all()))
    return r

res = {}
for c in job["cases"]:
    env = c.get("env", {})
    os.environ.update(env)
    try:
        res[c["name"]] = run_case(c)
    except Exception:
        res[c["name"]] = {"error": traceback.format_exc()[-3000:]}
    for k in env:
        os.environ.pop(k)
print("RESULT" + json.dumps(res))
'''

# forcing SGLang's own FlashInfer path (both spellings of the switch, before and after the env rename)
FORCE_FLASHINFER = {"DSV4_SM120_ATTN_BACKEND": "flashinfer"}


def _cases(rng: random.Random) -> list:
    small = lambda n: [rng.randint(1, 12) for _ in range(n)]  # short contexts keep the interpreter cheap
    return [
        # call 1: DSpark draft block (TARGET_VERIFY on the draft backend, SWA only, top-k 192, T = B x 5)
        dict(name="dspark_draft", mode="TARGET_VERIFY", dspark=True, layer=0, rows=5, prefixes=[rng.randint(1, 8), 300]),
        dict(name="dspark_draft_T65", mode="TARGET_VERIFY", dspark=True, layer=0, rows=5,
             prefixes=[rng.randint(129, 400)] + small(12)),
        # call 2: DSpark verify of the target, T = B x 6, c4 and c128 layers (T > 64 on the c128 one)
        dict(name="dspark_verify_c4", mode="TARGET_VERIFY", dspark=False, layer=2, rows=6,
             prefixes=[rng.randint(20, 60), 300]),
        dict(name="dspark_verify_c128_T66", mode="TARGET_VERIFY", dspark=False, layer=3, rows=6,
             prefixes=[rng.randint(260, 400)] + small(10)),
        # call 3: EAGLE verify, T = B x 4 with B = 17 (past the stock decode cut-over), SWA-only layer
        dict(name="eagle_verify_T68", mode="TARGET_VERIFY", dspark=False, layer=0, rows=4,
             prefixes=[rng.randint(130, 400)] + small(16)),
        # call 4: EAGLE draft decode step of the MTP layer (ratio 0, no extra cache), T = B
        dict(name="eagle_draft_decode", mode="DECODE", dspark=False, layer=0, rows=1,
             prefixes=[rng.randint(1, 20), 140, 300]),
        # call 5: EAGLE draft extend after verify, T = B x 4
        dict(name="eagle_draft_extend", mode="DRAFT_EXTEND_V2", dspark=False, layer=0, rows=4,
             prefixes=[rng.randint(1, 30), 200, 300]),
        # call 6: draft over the prompt on the prefill server (EXTEND): the prefill policy, FlashInfer's prefill
        dict(name="prefill_draft_extend", mode="EXTEND", dspark=False, layer=0, rows=80, prefixes=[0]),
        # the same DSpark draft call with the switch forced to SGLang's FlashInfer path: the checks must see it
        dict(name="dspark_draft_forced_flashinfer", mode="TARGET_VERIFY", dspark=True, layer=0, rows=5,
             prefixes=[3, 300], env=FORCE_FLASHINFER),
        dict(name="eagle_verify_forced_flashinfer", mode="TARGET_VERIFY", dspark=False, layer=0, rows=4,
             prefixes=[5] * 17, env=FORCE_FLASHINFER),
    ]


@pytest.fixture(scope="module")
def probe(run_patched):
    seed = random.randrange(1 << 30)
    cases = _cases(random.Random(seed))
    res = probe_result(run_patched, SCRIPT, {"seed": seed, "cases": cases},
                       env={"TRITON_INTERPRET": "1", "SGLANG_SM120_FLASHMLA_BACKEND": "flashinfer"}, timeout=900)
    return {c["name"]: (c, res[c["name"]]) for c in cases}, seed


def _ours_ran(probe, name, extra_K=None):
    cases, seed = probe
    c, r = cases[name]
    assert "error" not in r, f"seed {seed}: {r.get('error')}"
    T = len(c["prefixes"]) * c["rows"]
    assert r["T"] == T
    assert r["flashinfer"] == [], f"{name} reached FlashInfer: {r['flashinfer']}"
    # one call of our kernel, with the real heads only (the padded ones never reach it)
    assert len(r["ours"]) == 1, r["ours"]
    call = r["ours"][0]
    assert call["q"] == [T, 1, 16, 512] and call["K"] == r["swa_K"] and call["K2"] == extra_K, call
    assert r["out_shape"][0] == T and r["out_shape"][-1] == 512 and r["out_shape"][1] >= 16
    assert r["finite"] and r["ref_finite"], f"{name}: NaN in the real heads (padded-head poison leaked?)"
    assert r["err_torch"] < 1e-2, (name, r["err_torch"], seed)
    assert r["err_f64"] < 1e-2, (name, r["err_f64"], seed)
    return c, r


@pytest.mark.parametrize("name", ["dspark_draft", "dspark_draft_T65"])
def test_dspark_draft_block_reaches_our_kernel(probe, name):
    c, r = _ours_ran(probe, name)
    assert r["heads_given"] == 64                      # DSpark's own padding, rows 16-63 NaN
    assert r["swa_K"] == 192                           # ceil64(128 + block 5): FlashInfer's missing top-k
    lens = r["swa_len"]
    assert len(lens) == r["T"] > (64 if name.endswith("T65") else 0)
    for b, p in enumerate(c["prefixes"]):              # the block attends to itself non-causally
        assert lens[5 * b: 5 * b + 5] == [min(p, 128) + 5] * 5
    assert max(lens) == 133


def test_dspark_verify_c4_reaches_our_kernel(probe):
    c, r = _ours_ran(probe, "dspark_verify_c4", extra_K=512)
    assert r["heads_given"] == 16 and r["swa_K"] == 128
    assert r["swa_len"][:6] == [min(c["prefixes"][0] + 1 + i, 128) for i in range(6)]  # causal verify rows


def test_dspark_verify_c128_beyond_64_rows_reaches_our_kernel(probe):
    c, r = _ours_ran(probe, "dspark_verify_c128_T66", extra_K=64)
    assert r["T"] == 66 and r["heads_given"] == 16


def test_eagle_verify_beyond_64_rows_reaches_our_kernel(probe):
    c, r = _ours_ran(probe, "eagle_verify_T68")
    assert r["T"] == 68 and r["heads_given"] == 16 and r["swa_K"] == 128


def test_eagle_draft_decode_reaches_our_kernel(probe):
    c, r = _ours_ran(probe, "eagle_draft_decode")
    assert r["T"] == 3 and r["swa_len"] == [min(p + 1, 128) for p in c["prefixes"]]


def test_eagle_draft_extend_reaches_our_kernel(probe):
    _ours_ran(probe, "eagle_draft_extend")


def test_prefill_server_draft_keeps_the_prefill_policy(probe):
    """Call 6 (EXTEND rows on the prefill server) follows the prefill switch, FlashInfer's prefill kernel by
    default (top-k 128, which it has); our kernel is not called for it."""
    cases, seed = probe
    _, r = cases["prefill_draft_extend"]
    assert "error" not in r, r.get("error")
    assert r["ours"] == [] and r["flashinfer"] == ["_flash_mla_sm120_prefill"], r


@pytest.mark.parametrize("name", ["dspark_draft_forced_flashinfer", "eagle_verify_forced_flashinfer"])
def test_a_wrong_route_is_detected(probe, name):
    """With the switch forced to SGLang's FlashInfer path the same call reaches a trap and not our kernel,
    so the assertions above would fail on a routing regression."""
    cases, seed = probe
    _, r = cases[name]
    assert "error" not in r, r.get("error")
    assert r["ours"] == [] and r["flashinfer"], r
    with pytest.raises(AssertionError):
        _ours_ran(probe, name)
