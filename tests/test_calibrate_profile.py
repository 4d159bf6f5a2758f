"""Machine profile (dsv4_sm120.machine_profile): schema round trip, atomic save, version keying, per-bucket
winner lookup and the glue's decision(name, bucket) -> (choice, source)."""

from __future__ import annotations

import json
import os
import random

import pytest

from dsv4_sm120 import machine_profile as P

GPU = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
VERSIONS = {"sglang": "0.5.23", "flashinfer": "0.7.2", "triton": "3.8.0", "torch": "2.14.1", "cuda": "13.0",
            "driver": "580.1", "dsv4_sm120": "0.1.0+abc"}


def make_profile(seed=0, gpu=GPU, versions=None):
    rng = random.Random(seed)
    decisions = {}
    for name, cands, buckets in (("attention.swa_c4", ["dsv4", "flashinfer", "triton"], [1, 4, 16, 64]),
                                 ("moe.nvfp4", ["flashinfer_cutlass", "dsv4_triton_nvfp4"], [1, 8, 64])):
        rows = {}
        for b in buckets:
            cs = {c: {"status": "ok", "us": round(rng.uniform(5, 100), 2), "err": 1e-3, "tol": 2e-2} for c in cands}
            cs[cands[-1]] = {"status": "unavailable", "reason": "needs sglang"}
            ok = [(v["us"], c) for c, v in cs.items() if v["status"] == "ok"]
            rows[str(b)] = {"winner": min(ok)[1], "candidates": cs}
        decisions[name] = {"bucket_kind": "rows", "default": P.DEFAULTS[name], "buckets": rows}
    return {"schema": P.SCHEMA, "gpu": gpu, "created_at": P.now_iso(), "versions": dict(versions or VERSIONS),
            "deployment": {"tp": 4}, "decisions": decisions}


@pytest.fixture(autouse=True)
def _fresh_cache():
    P.clear_cache()
    yield
    P.clear_cache()


def test_round_trip_and_file_name(tmp_path):
    prof = make_profile(seed=3)
    path = P.profile_path(GPU, tmp_path)
    assert path.name == "NVIDIA_RTX_PRO_6000_Blackwell_Server_Edition.json"
    P.save(prof, path)
    assert P.load(path) == prof
    assert json.loads(path.read_text()) == prof


def test_save_is_atomic_old_profile_survives_a_crash(tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    old = make_profile(seed=1)
    P.save(old, path)
    before = path.read_bytes()

    def crash(fd):
        raise OSError(5, "disk died mid-write")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError):
        P.save(make_profile(seed=2), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]   # no temp file left behind


def test_invalid_profiles_are_refused(tmp_path):
    prof = make_profile()
    bad = json.loads(json.dumps(prof))
    b = bad["decisions"]["moe.nvfp4"]["buckets"]["1"]
    b["winner"] = "dsv4_triton_nvfp4"          # unavailable candidate named winner
    with pytest.raises(P.ProfileError, match="did not pass the correctness gate"):
        P.save(bad, tmp_path / "x.json")
    assert not (tmp_path / "x.json").exists()
    for mutate, msg in ((lambda d: d.update(schema=99), "schema"),
                        (lambda d: d["versions"].pop("torch"), "versions"),
                        (lambda d: d["decisions"]["moe.nvfp4"]["buckets"].update({"0": {}}), "bucket")):
        d = json.loads(json.dumps(prof))
        mutate(d)
        with pytest.raises(P.ProfileError, match=msg):
            P.validate(d)
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(P.ProfileError, match="not valid JSON"):
        P.load(tmp_path / "junk.json")


def test_bucket_keys_and_winners_the_glue_cannot_read_are_refused(tmp_path):
    prof = make_profile()
    for mutate, msg in ((lambda b: b.update({"01": b.pop("1")}), "bucket '01'"),
                        (lambda b: b.update({"+4": b.pop("4")}), "bucket '\\+4'"),
                        (lambda b: b.update({"\u0664": b.pop("4")}), "bucket"),     # an Arabic-Indic 4
                        (lambda b: b["4"].update(winner=["dsv4"]), "is not a name"),
                        (lambda b: b["4"].update(winner={"dsv4": 1}), "is not a name")):
        d = json.loads(json.dumps(prof))
        mutate(d["decisions"]["attention.swa_c4"]["buckets"])
        with pytest.raises(P.ProfileError, match=msg):
            P.validate(d)
        path = tmp_path / "NVIDIA_X.json"
        path.write_text(json.dumps(dict(d, gpu="NVIDIA X")))
        P.clear_cache()
        prof_used, _, reasons = P.active_profile("NVIDIA X", VERSIONS, tmp_path)     # never raises
        assert prof_used is None and len(reasons) == 1 and reasons[0].endswith("ignored: stock decisions"), reasons
    d = json.loads(json.dumps(prof))
    d["decisions"]["moe.nvfp4"]["overall"] = "flashinfer_cutlass"
    with pytest.raises(P.ProfileError, match="overall must be an object"):
        P.validate(d)


def test_version_keying():
    prof = make_profile()
    assert P.match(prof, GPU, VERSIONS) == (True, [])
    ok, why = P.match(prof, "NVIDIA H200", VERSIONS)
    assert not ok and "GPU" in why[0]
    for field in P.MUST_MATCH:
        ok, why = P.match(prof, GPU, {**VERSIONS, field: "9.9"})
        assert not ok and any(r.startswith(field) for r in why), (field, why)
    ok, why = P.match(prof, GPU, {**VERSIONS, "triton": None})
    assert not ok
    for field in P.WARN_ONLY:
        ok, why = P.match(prof, GPU, {**VERSIONS, field: "other"})
        assert ok and why and why[0].startswith("warning") and field in why[0]


def test_winner_by_bucket():
    prof = make_profile(seed=5)
    rows = prof["decisions"]["attention.swa_c4"]["buckets"]
    assert P.winner(prof, "attention.swa_c4", 1) == rows["1"]["winner"]
    assert P.winner(prof, "attention.swa_c4", 3) == rows["4"]["winner"]     # smallest bucket >= n
    assert P.winner(prof, "attention.swa_c4", 16) == rows["16"]["winner"]
    assert P.winner(prof, "attention.swa_c4", 500) == rows["64"]["winner"]  # beyond: the largest
    assert P.winner(prof, "fp8_gemm", 4) is None


def test_decision_uses_profile_only_when_versions_match(tmp_path, monkeypatch):
    prof = make_profile(seed=7)
    P.save(prof, P.profile_path(GPU, tmp_path))
    want = prof["decisions"]["moe.nvfp4"]["buckets"]["8"]["winner"]
    choice, source = P.decision("moe.nvfp4", 5, gpu=GPU, versions=VERSIONS, directory=tmp_path)
    assert (choice, source) == (want, f"profile {P.profile_path(GPU, tmp_path)}")
    P.clear_cache()
    choice, source = P.decision("moe.nvfp4", 5, gpu=GPU, versions={**VERSIONS, "torch": "2.15"}, directory=tmp_path)
    assert (choice, source) == ("flashinfer_cutlass", "default")
    _, _, reasons = P.active_profile(GPU, {**VERSIONS, "torch": "2.15"}, tmp_path)
    assert any("torch" in r for r in reasons)
    P.clear_cache()
    assert P.decision("fp8_gemm", 4, gpu=GPU, versions=VERSIONS, directory=tmp_path) == ("default", "default")
    assert P.decision("attention.swa", 1, "triton", gpu="Other GPU", versions=VERSIONS,
                      directory=tmp_path) == ("triton", "default")
    with pytest.raises(KeyError, match="unknown decision"):
        P.decision("attention.bogus", 1, gpu=GPU, versions=VERSIONS, directory=tmp_path)
    # no GPU at all: the default, no exception
    P.clear_cache()
    monkeypatch.setattr(P, "_current_gpu", lambda: None)
    assert P.decision("attention.swa_c4", 1) == ("dsv4", "default")


def test_profile_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv(P.ENV_DIR, str(tmp_path / "profiles"))
    assert P.profile_dir() == tmp_path / "profiles"
    monkeypatch.setenv(P.ENV_DIR, "")
    assert P.profile_dir() is None
    assert P.decision("moe.mxfp4", 1, gpu=GPU, versions=VERSIONS) == ("flashinfer_mxfp4", "default")
    monkeypatch.delenv(P.ENV_DIR)
    assert P.profile_dir().parts[-2:] == ("configs", "profiles")
