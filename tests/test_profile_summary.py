"""dsv4_sm120.perf.profile_summary (command: bench/profile_summary.py) on synthetic torch-profiler traces
(fresh random durations each run, expected numbers recomputed independently here)."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
from dsv4_sm120.perf import profile_summary as ps  # noqa: E402

# Real-world kernel names (as CUPTI reports them) -> expected group.
NAMES = {
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "void cross_device_reduce_1stage<__nv_bfloat16, 4>(...)": "communication",
    "_dsv4_split_kernel": "sparse attention",
    "_dsv4_combine_kernel": "sparse attention",
    "_dsv4_split_kernel_tiled": "sparse attention",
    "_q_fp8_kernel": "sparse attention",
    "_dsv4_split_kernel_reg": "sparse attention",
    # dsv4_sm120.attention.kernels as Triton names them
    "split_kernel_reg": "sparse attention",
    "split_kernel_tiled": "sparse attention",
    "split_kernel_flat": "sparse attention",
    "combine_kernel": "sparse attention",
    "q_fp8_kernel": "sparse attention",
    "_gemm2_kernel": "MoE",
    "_reduce_kernel": "MoE",
    "_tiled_sparse_decode_kernel": "sparse attention",
    "void flashinfer::BatchPrefillWithPagedKVCacheKernel<...>": "sparse attention",
    "void flash::flash_fwd_splitkv_mla_kernel<...>": "sparse attention",
    "void deep_gemm::fp8_paged_mqa_logits<...>": "sparse attention",
    "fused_moe_kernel": "MoE",
    "_gemm1_kernel": "MoE",
    "_align_kernel": "MoE",
    "_quant_rows_kernel": "MoE",
    "void moe_align_block_size_kernel<int>(...)": "MoE",
    "void tensorrt_llm::kernels::cutlass_kernels::moe_gemm<...>": "MoE",
    "void topk_softmax<...>": "MoE",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "dense GEMM",
    "nvjet_tst_128x64_64x8_1x2_h_bz_coopA_NNT": "dense GEMM",
    "_w8a8_block_fp8_matmul": "dense GEMM",
    "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<...>>": "dense GEMM",
    "void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(...)": "norm/rope/other",
    "void rotary_embedding_kernel<c10::BFloat16, true>(...)": "norm/rope/other",
    "Memcpy DtoD (Device -> Device)": "norm/rope/other",
    "void at::native::vectorized_elementwise_kernel<4, ...>": "norm/rope/other",
}


@pytest.mark.parametrize("name,group", list(NAMES.items()))
def test_classification(name, group):
    assert ps.classify(name) == group


def make_trace(rng, n_per_kernel=(3, 12), gap_us=(0.0, 4.0), streams=2):
    """Kernels laid out on `streams` streams; returns (trace dict, expected per-name totals, busy, window)."""
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10_000, "pid": 1, "tid": 1},
              {"ph": "i", "cat": "kernel", "name": "not a span", "ts": 5}]
    totals = {}
    clocks = [1000.0 * (s + 1) for s in range(streams)]
    intervals = []
    for name in NAMES:
        for _ in range(rng.randint(*n_per_kernel)):
            s = rng.randrange(streams)
            dur = round(rng.uniform(1, 400), 3)
            ts = clocks[s] + rng.uniform(*gap_us)
            clocks[s] = ts + dur
            cat = "gpu_memcpy" if name.startswith("Memcpy") else "kernel"
            events.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7 + s})
            totals[name] = totals.get(name, 0.0) + dur
            intervals.append((ts, ts + dur))
    rng.shuffle(events)
    # independent union length (sweep over sorted endpoints)
    pts = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    busy, depth, last = 0.0, 0, None
    for t, d in pts:
        if depth > 0:
            busy += t - last
        depth += d
        last = t
    window = max(b for _, b in intervals) - min(a for a, _ in intervals)
    return {"traceEvents": events, "displayTimeUnit": "ms"}, totals, busy, window


def test_summary_numbers_match_an_independent_count(tmp_path):
    rng = random.Random()
    traces, all_totals, busy_sum, window_sum = [], {}, 0.0, 0.0
    for rank in range(2):
        tr, totals, busy, window = make_trace(rng)
        p = tmp_path / f"prof-TP-{rank}.trace.json.gz"
        p.write_bytes(gzip.compress(json.dumps(tr).encode()))
        traces.append(p)
        for k, v in totals.items():
            all_totals[k] = all_totals.get(k, 0.0) + v
        busy_sum += busy
        window_sum += window
    s = ps.summarise(traces, top=5)
    total = sum(all_totals.values())
    assert s["total_kernel_us"] == pytest.approx(total, rel=1e-9)
    want_groups = {}
    for k, v in all_totals.items():
        want_groups[NAMES[k]] = want_groups.get(NAMES[k], 0.0) + v
    got = {g["group"]: g["us"] for g in s["groups"]}
    for g in ps.GROUPS:
        assert got[g] == pytest.approx(want_groups.get(g, 0.0), rel=1e-9), g
    assert sum(g["share"] for g in s["groups"]) == pytest.approx(1.0)
    assert [g["us"] for g in s["groups"]] == sorted((g["us"] for g in s["groups"]), reverse=True)
    top = sorted(all_totals.items(), key=lambda kv: -kv[1])[:5]
    assert [k["name"] for k in s["top_kernels"]] == [n for n, _ in top]
    assert s["busy_us"] == pytest.approx(busy_sum, rel=1e-9)
    assert s["window_us"] == pytest.approx(window_sum, rel=1e-9)
    assert s["idle_us"] == pytest.approx(window_sum - busy_sum, rel=1e-6, abs=1e-6)
    biggest = max(want_groups, key=want_groups.get)
    if s["bottleneck_kind"] != "idle":
        assert s["bottleneck_kind"] == biggest and s["bottleneck"].startswith(biggest)


def test_bottleneck_names_the_dominant_group_or_idle(tmp_path):
    def ev(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}
    # MoE dominates, kernels back to back
    p = tmp_path / "a.json"
    p.write_text(json.dumps({"traceEvents": [ev("fused_moe_kernel", 0, 70), ev("_dsv4_split_kernel", 70, 20),
                                             ev("nccl_AllReduce", 90, 10)]}))
    s = ps.summarise([p])
    assert s["bottleneck_kind"] == "MoE" and "70.0%" in s["bottleneck"] and "fused_moe_kernel" in s["bottleneck"]
    assert s["idle_us"] == 0
    # same kernels, spread out: the GPU is mostly idle
    p.write_text(json.dumps({"traceEvents": [ev("fused_moe_kernel", 0, 70), ev("_dsv4_split_kernel", 500, 20),
                                             ev("nccl_AllReduce", 990, 10)]}))
    s = ps.summarise([p])
    assert s["bottleneck_kind"] == "idle" and s["idle_us"] == pytest.approx(900)
    assert "90.0% of the traced window" in s["bottleneck"]


def test_cli_text_json_and_errors(tmp_path):
    rng = random.Random()
    tr, totals, _, _ = make_trace(rng)
    d = tmp_path / "profile"
    d.mkdir()
    (d / "x-TP-0.trace.json").write_text(json.dumps(tr))
    out = tmp_path / "summary.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "profile_summary.py"), str(d), "--json", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "largest remaining bottleneck:" in r.stdout.splitlines()[-1]
    for g in ps.GROUPS:
        assert g in r.stdout
    data = json.loads(out.read_text())
    assert data["total_kernel_us"] == pytest.approx(sum(totals.values()))
    # errors: one line, no traceback
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "ts": 0, "dur": 1}]}))
    cases = [([str(bad)], 2, "not a readable JSON trace"), ([str(tmp_path / "missing.json")], 2, "no such file"),
             ([str(empty)], 1, "no GPU kernel events"), ([str(tmp_path / "summary.json")], 2, "no traceEvents")]
    for args, rc, needle in cases:
        r = subprocess.run([sys.executable, str(REPO / "bench" / "profile_summary.py"), *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == rc and needle in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    r = subprocess.run([sys.executable, str(REPO / "bench" / "profile_summary.py"), "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Summarise" in r.stdout
