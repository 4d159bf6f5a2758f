"""`make calibrate`'s harness (dsv4_sm120.calibrate): the per-bucket winner logic with a poisoned candidate,
unavailable / failing candidates reported with reasons, the FP8 summary reader, the deployment shapes from
the serve settings, the CLI's errors, and the whole CPU harness end to end under the Triton interpreter
through the real pinned SGLang (patched scratch copy): our attention kernel and SGLang's Triton / torch
backends, SGLang's own FusedMoE with our runner, the others reported unavailable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import OVERLAY, REPO, SITE

from dsv4_sm120.calibrate import fp8, moe
from dsv4_sm120 import machine_profile as P
from dsv4_sm120.calibrate.candidates import Candidate, Case, Outcome, run_decision
from dsv4_sm120.calibrate.deployment import DeploymentError, attention_buckets, from_env


class VecCase(Case):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.n = n
        self.ref = torch.randn(n, 64, generator=g, dtype=torch.float64)

    def error(self, out):
        o = out.double()
        if not torch.isfinite(o).all():
            return float("inf")
        return float((o - self.ref).norm() / self.ref.norm())


class Good(Candidate):
    name, tol = "good", 1e-2

    def build(self, case):
        noisy = (case.ref * (1 + 1e-4 * torch.randn_like(case.ref))).float()

        def fn():
            time.sleep(0.02)
            return noisy
        return fn


class Poison(Candidate):
    """The fastest candidate, and wrong (a small bias: plausible numbers, not NaN)."""
    name, tol = "poison", 1e-2

    def build(self, case):
        bad = (case.ref * 1.05).float()
        return lambda: bad


class NaNs(Candidate):
    name = "nans"

    def build(self, case):
        return lambda: torch.full((case.n, 64), float("nan"))


class Raises(Candidate):
    name = "raises"

    def build(self, case):
        raise RuntimeError("no kernel image is available for execution on the device\nsecond line")


class Missing(Candidate):
    name = "missing"

    def available(self):
        return "module foo is not installed"


class FastReference(Candidate):
    """Correct and fastest, but a reference point the glue cannot route to."""
    name, eligible = "refpoint", False

    def build(self, case):
        r = case.ref.float()
        return lambda: r


class BatchLiar(Candidate):
    """A batch (subprocess-style) candidate that reports itself ok with an error above its tolerance."""
    name, batch, tol = "liar", True, 0.05

    def measure_all(self, buckets, progress=None):
        return {b: Outcome("ok", us=0.001, err=0.5) for b in buckets}


def test_poisoned_candidate_never_wins_and_every_cell_has_a_reason():
    seed = int(time.time()) % 1000
    entry = run_decision("t", [Poison(), Good(), NaNs(), Raises(), Missing(), FastReference(), BatchLiar()],
                         [1, 3], lambda n: VecCase(n, seed + n))
    P.validate({"schema": P.SCHEMA, "gpu": "g", "versions": {k: "x" for k in P.VERSION_FIELDS},
                "decisions": {"t": entry}})
    assert entry["reference_only"] == ["refpoint"]
    for b in ("1", "3"):
        row = entry["buckets"][b]
        c = row["candidates"]
        assert row["winner"] == "good", row
        assert c["poison"]["status"] == "rejected" and "tolerance" in c["poison"]["reason"]
        assert c["poison"]["err"] > c["poison"]["tol"]
        assert c["nans"]["status"] == "rejected" and "NaN" in c["nans"]["reason"]
        assert c["raises"] == {"status": "failed",
                               "reason": "RuntimeError: no kernel image is available for execution on the device"}
        assert c["missing"] == {"status": "unavailable", "reason": "module foo is not installed"}
        assert c["refpoint"]["status"] == "ok" and c["refpoint"]["us"] < c["good"]["us"]
        assert c["liar"]["status"] == "rejected"
        assert c["good"]["err"] < 1e-3 and c["good"]["timing"] == "wall"
    # nothing passes: no winner, still a complete entry
    entry = run_decision("t", [Poison(), Missing()], [2], lambda n: VecCase(n, seed))
    assert entry["buckets"]["2"]["winner"] is None


def test_inputs_that_cannot_be_built_fail_the_bucket_not_the_run():
    def make(n):
        if n == 2:
            raise MemoryError("out of memory")
        return VecCase(n, 0)

    entry = run_decision("t", [Good()], [1, 2], make)
    assert entry["buckets"]["1"]["winner"] == "good"
    assert entry["buckets"]["2"]["candidates"]["good"]["status"] == "failed"
    assert "out of memory" in entry["buckets"]["2"]["candidates"]["good"]["reason"]


def test_worker_output_parsing():
    res = moe.parse_worker_output("", "Traceback...\nSegmentation fault (core dumped)\n", -11, [1, 4])
    assert {o.status for o in res.values()} == {"failed"}
    assert "Segmentation fault" in res[4].reason
    res = moe.parse_worker_output('noise\nRESULT{"status": "unavailable", "reason": "sglang does not import"}\n',
                                  "", 0, [1])
    assert res[1].status == "unavailable" and res[1].reason == "sglang does not import"
    ok = {"status": "ok", "buckets": {"1": {"status": "ok", "us": 3.5, "err": 0.01, "tol": 0.3}}}
    res = moe.parse_worker_output("RESULT" + json.dumps(ok), "", 0, [1, 8])
    assert res[1].us == 3.5 and res[8].status == "failed"


def test_fp8_summary_to_decision():
    def row(t, d):
        return {"triton_linear_us": t, "default_backend_linear_us": d}

    summary = {"mode": "quick", "default_backend": {"name": "cutlass", "available": True},
               "decision": {"recommended_backend": None, "reason": "rule not met"},
               "shapes": {"a": {"complete": True, "rows": {"1": row(3.0, 5.0), "64": row(9.0, 4.0)}},
                          "b": {"complete": True, "rows": {"1": row(2.0, 1.0), "64": row(1.0, 1.5)}},
                          "c": {"complete": False, "rows": {"1": row(100.0, 1.0)}}}}
    e = fp8.from_summary(summary)
    assert e["buckets"]["1"]["winner"] == "triton"      # 5.0 vs 6.0 (shape c is incomplete, not counted)
    assert e["buckets"]["64"]["winner"] == "default"    # 10.0 vs 5.5
    assert e["buckets"]["1"]["candidates"]["triton"]["us"] == 5.0
    assert e["overall"]["recommended_backend"] == "default"
    summary["shapes"]["b"]["rows"]["64"]["triton_linear_us"] = None
    e = fp8.from_summary(summary)
    assert e["buckets"]["64"]["candidates"]["triton"]["status"] == "failed"
    assert e["buckets"]["64"]["winner"] == "default"
    e = fp8.calibrate(4, "cpu", REPO / "nonexistent", True, "cpu", buckets=[1, 2])
    assert e["buckets"]["2"]["candidates"]["default"]["status"] == "unavailable"


def test_deployment_from_serve_settings(tmp_path):
    d = from_env({})
    assert (d.tp, d.heads, d.draft_tokens, d.moe_format, d.moe_intermediate) == (4, 16, 4, "mxfp4", 512)
    assert d.c128_topk == 512 and "not a local directory" in d.config_source
    assert 4 * 256 in attention_buckets(d, quick=False) and 256 in attention_buckets(d, quick=False)
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({"hidden_size": 4096, "moe_intermediate_size": 2048,
                                                "num_attention_heads": 64,
                                                "quantization_config": {"moe_quant_algo": "NVFP4"}}))
    d = from_env({"DECODE_GPUS": "4,5", "SPEC_NUM_DRAFT_TOKENS": "3", "MODEL_PATH": str(ck), "CONTEXT_LEN": "1000000"})
    assert (d.tp, d.heads, d.draft_tokens, d.moe_format, d.moe_intermediate) == (2, 32, 3, "nvfp4", 1024)
    assert d.c128_topk == 7872
    for env, msg in (({"DECODE_GPUS": "0,1,2"}, "TP size 3"), ({"SPEC_NUM_DRAFT_TOKENS": "x"}, "integers"),
                     ({"MODEL_PATH": str(tmp_path)}, "config.json")):
        with pytest.raises(DeploymentError, match=msg):
            from_env(env)


def _cli(args, env=None, pythonpath=None, timeout=600):
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    e["PYTHONPATH"] = pythonpath or str(OVERLAY)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "dsv4_sm120.calibrate", *args], capture_output=True, text=True,
                          env=e, timeout=timeout, cwd=str(REPO))


def test_cli_errors_and_dry_run(tmp_path):
    r = _cli(["--out", str(tmp_path)], env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2 and r.stderr.startswith("error: no CUDA GPU visible") and r.stderr.count("\n") == 1
    r = _cli(["--decisions", "attention,bogus"])
    assert r.returncode == 2 and "--decisions" in r.stderr and "Traceback" not in r.stderr
    r = _cli(["--dry-run"], env={"DECODE_GPUS": "0,1,2,3,4,5,6,7", "SPEC_NUM_DRAFT_TOKENS": "2"})
    assert r.returncode == 0, r.stderr
    assert "TP 8, 8 heads per rank, 2 draft tokens" in r.stdout and "{'" not in r.stdout and "attention.swa_c128: rows 1,2,4,8,16,32,64,128,256,512" in r.stdout
    assert "moe.mxfp4" in r.stdout and "flashinfer_mxfp4, deep_gemm" in r.stdout
    r = _cli(["--dry-run"], env={"DECODE_GPUS": "0,0"})
    assert r.returncode == 2 and "twice" in r.stderr
    assert not list(tmp_path.iterdir())


def test_cpu_harness_end_to_end_through_sglang(patched_sglang_site, tmp_path):
    from test_convert_nvfp4 import dsv4_config

    ck = tmp_path / "ck"
    ck.mkdir()
    cfg = dsv4_config()
    cfg["quantization_config"].update(quant_algo="MIXED_PRECISION", moe_quant_algo="NVFP4", group_size=16,
                                      ignore=["*.attn.*", "*.ffn.shared_experts.*", "*.ffn.gate", "mtp.*"])
    (ck / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "profiles"
    r = _cli(["--device", "cpu", "--decisions", "attention,moe", "--out", str(out)],
             env={"MODEL_PATH": str(ck)}, pythonpath=os.pathsep.join(map(str, (patched_sglang_site, OVERLAY, SITE))))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "eta" in r.stderr and "[calibrate" in r.stderr
    prof = P.load(out / "cpu-interpreter.json")
    assert prof["versions"]["sglang"] == "0.5.23" and prof["deployment"]["moe_format"] == "nvfp4"
    for layout in ("swa", "swa_c4", "swa_c128"):
        d = prof["decisions"][f"attention.{layout}"]
        for b, row in d["buckets"].items():
            c = row["candidates"]
            for name in ("dsv4", "dsv4:impl=tiled", "triton", "torch"):
                assert c[name]["status"] == "ok" and c[name]["err"] < 2e-2, (layout, b, name, c[name])
            assert c["flashinfer"]["status"] == "unavailable" and "CUDA" in c["flashinfer"]["reason"]
            assert c["flashmla"]["status"] == "unavailable"
            ok = {n: o["us"] for n, o in c.items() if o["status"] == "ok" and n not in d["reference_only"]}
            assert row["winner"] == min(ok, key=ok.get)
    m = prof["decisions"]["moe.nvfp4"]
    for b, row in m["buckets"].items():
        c = row["candidates"]
        assert c["dsv4_triton_nvfp4"]["status"] == "ok" and c["dsv4_triton_nvfp4"]["err"] < 2e-2, c
        assert c["dsv4_kernel"]["status"] == "ok" and c["dsv4_kernel"]["err"] < 2e-2
        assert c["flashinfer_cutlass"]["status"] == "unavailable" and "CUDA" in c["flashinfer_cutlass"]["reason"]
        assert row["winner"] == "dsv4_triton_nvfp4"      # the direct kernel is a reference point only
    md = (out / "cpu-interpreter.md").read_text()
    assert "## moe.nvfp4" in md and "`flashinfer_cutlass` unavailable" in md
    assert (out / "cpu-interpreter.png").stat().st_size > 1000
    P.clear_cache()
    want = m["buckets"]["5"]["winner"]
    assert P.decision("moe.nvfp4", 3, gpu="cpu-interpreter", versions=prof["versions"], directory=out) == \
        (want, f"profile {out / 'cpu-interpreter.json'}")


def test_attention_variants_with_more_heads_per_program_than_the_deployment_do_not_apply():
    """The wide warp-specialized variants (impl=wspec,BLOCK_H=32 / 64) are offered, and are not applicable (reported
    as such, never timed) where a program would hold more heads than the deployment's count rounded up to 16 / 32 /
    64; the register body's 16-head programs (impl=reg) apply everywhere."""
    from types import SimpleNamespace

    from dsv4_sm120.calibrate.attention import VARIANTS, Ours
    from dsv4_sm120.calibrate.candidates import NotApplicable, measure

    assert {"impl=reg", "impl=wspec,BLOCK_H=32", "impl=wspec,BLOCK_H=64"} <= set(VARIANTS)
    for H, variant, applies in ((16, "impl=wspec,BLOCK_H=32", False), (8, "impl=wspec,BLOCK_H=64", False),
                                (32, "impl=wspec,BLOCK_H=64", False), (32, "impl=wspec,BLOCK_H=32", True),
                                (64, "impl=wspec,BLOCK_H=64", True), (24, "impl=wspec,BLOCK_H=32", True)):
        case = SimpleNamespace(H=H, device="cpu")
        if applies:
            assert callable(Ours(variant, device="cpu").build(case)), (H, variant)
        else:
            with pytest.raises(NotApplicable, match="masked MMA rows"):
                Ours(variant, device="cpu").build(case)
            assert measure(Ours(variant, device="cpu"), case).status == "unavailable"
