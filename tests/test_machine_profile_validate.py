"""dsv4_sm120.machine_profile, each rule against its documentation (module doc, docs/calibrate.md), in this
process: the file name of a GPU, the directory order, every schema rule with its one-line message naming the file,
the written file's form, the versions this process runs with (git, the driver and the packages through stand-ins),
which version mismatches void a profile (one that cannot be determined does), the bucket a call of n rows uses,
the server-wide vote, the cache and the log lines, and the status command."""

from __future__ import annotations

import json
import logging
import subprocess
import types
from pathlib import Path

import pytest

from dsv4_sm120 import machine_profile as P
from dsv4_sm120 import paths

GPU = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
VERS = {"sglang": "0.5.23", "flashinfer": "0.6.0", "triton": "3.8.0", "torch": "2.14.1", "cuda": "13.0",
        "driver": "580.1", "dsv4_sm120": "1.0+abc"}


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.delenv("DSV4_SM120_PROFILE_DIR", raising=False)
    monkeypatch.delenv("DSV4_SM120_TEST_GPU_NAME", raising=False)
    P.clear_cache()
    monkeypatch.setattr(P, "_VERSIONS", {})
    # the status command quiets the module's logger (it prints the reasons instead): a test that ran it in this
    # process before must not hide the warnings these tests read
    lg = logging.getLogger(P.__name__)
    level = lg.level
    lg.setLevel(logging.NOTSET)
    yield monkeypatch
    lg.setLevel(level)
    P.clear_cache()


def _decision(winners, kind="rows", overall=None):
    rows = {}
    for b, w in winners.items():
        cands = {"other": {"status": "failed", "us": None, "err": None, "tol": 0.02, "reason": "x"}}
        if w is not None:
            cands[w] = {"status": "ok", "us": 1.0, "err": 1e-3, "tol": 0.02}
        rows[str(b)] = {"winner": w, "candidates": cands}
    d = {"bucket_kind": kind, "default": "x", "buckets": rows}
    if overall is not None:
        d["overall"] = overall
    return d


def _profile(decisions=None, gpu=GPU, versions=None):
    return {"schema": 1, "gpu": gpu, "created_at": "2025-01-01T00:00:00Z", "versions": dict(versions or VERS),
            "deployment": {"tp": 4}, "decisions": decisions if decisions is not None else {}}


def _write(tmp_path, prof, gpu=GPU):
    path = tmp_path / f"{P.file_stem(gpu)}.json"
    path.write_text(json.dumps(prof))
    return path


# ---------------------------------------------------------------------------- where profiles live


def test_the_file_name_of_a_gpu():
    assert P.file_stem(" NVIDIA RTX PRO 6000 Blackwell Server Edition ") == \
        "NVIDIA_RTX_PRO_6000_Blackwell_Server_Edition"
    assert P.file_stem("GPU a/b:c (x) v1.0-2") == "GPU_a_b_c__x__v1.0-2"
    assert P.profile_path("A B", Path("/d")) == Path("/d/A_B.json")


def test_the_directory_order(clean, tmp_path):
    clean.setenv("DSV4_SM120_PROFILE_DIR", str(tmp_path))
    assert P.profile_dir() == tmp_path and P.profile_path("X") == tmp_path / "X.json"
    clean.setenv("DSV4_SM120_PROFILE_DIR", " ")
    assert P.profile_dir() is None and P.profile_path("X") is None
    assert P.profile_path("X", tmp_path) == tmp_path / "X.json"       # an explicit directory wins
    clean.delenv("DSV4_SM120_PROFILE_DIR")
    repo = tmp_path / "repo"
    clean.setattr(paths, "applied_repo_root", lambda sglang_root=None: repo)
    assert P.profile_dir() == paths.CONFIGS_DIR / "profiles"              # the applied checkout has no configs/
    (repo / "configs").mkdir(parents=True)
    assert P.profile_dir() == repo / "configs" / "profiles"
    clean.setattr(paths, "applied_repo_root", lambda sglang_root=None: None)
    assert P.profile_dir() == paths.CONFIGS_DIR / "profiles"


# ---------------------------------------------------------------------------- the schema


@pytest.mark.parametrize("mutate,msg", [
    (lambda p: [1], "not a JSON object"),
    (lambda p: dict(p, schema=2), "schema 2, expected 1 (rerun `make calibrate`)"),
    (lambda p: {k: v for k, v in p.items() if k != "schema"}, "schema None, expected 1 (rerun `make calibrate`)"),
    (lambda p: dict(p, gpu=""), "no GPU name"),
    (lambda p: dict(p, gpu=3), "no GPU name"),
    (lambda p: dict(p, versions={k: v for k, v in VERS.items() if k != "driver"}),
     "versions must hold sglang, flashinfer, triton, torch, cuda, driver, dsv4_sm120"),
    (lambda p: dict(p, versions=["sglang"]), "versions must hold sglang, flashinfer, triton, torch, cuda, driver, "
                                             "dsv4_sm120"),
    (lambda p: dict(p, decisions=[]), "no decisions object"),
    (lambda p: dict(p, decisions={"fp8_gemm": []}), "decision 'fp8_gemm' has no buckets"),
    (lambda p: dict(p, decisions={"fp8_gemm": {"buckets": []}}), "decision 'fp8_gemm' has no buckets"),
    (lambda p: dict(p, decisions={"d": {"buckets": {"0": {}}}}),
     "decision 'd': bucket '0' is not a positive integer written plainly (e.g. \"8\")"),
    (lambda p: dict(p, decisions={"d": {"buckets": {"08": {}}}}), "decision 'd': bucket '08' is not a positive"),
    (lambda p: dict(p, decisions={"d": {"buckets": {"x": {}}}}), "decision 'd': bucket 'x' is not a positive"),
    (lambda p: dict(p, decisions={"d": {"buckets": {"٣": {}}}}), "decision 'd': bucket '٣' is not a positive"),
    (lambda p: dict(p, decisions={"d": {"buckets": {"8": []}}}), "decision 'd' bucket 8: no candidates"),
    (lambda p: dict(p, decisions={"d": {"buckets": {"8": {"candidates": []}}}}), "decision 'd' bucket 8: no candidates"),
    (lambda p: dict(p, decisions={"d": {"buckets": {"8": {"candidates": {"a": {"status": "good"}}}}}}),
     "decision 'd' bucket 8: candidate 'a' has no valid status"),
    (lambda p: dict(p, decisions={"d": {"buckets": {"8": {"candidates": {"a": "ok"}}}}}),
     "decision 'd' bucket 8: candidate 'a' has no valid status"),
    (lambda p: dict(p, decisions={"d": {"buckets": {"8": {"winner": 3, "candidates": {}}}}}),
     "decision 'd' bucket 8: winner 3 is not a name"),
    (lambda p: dict(p, decisions={"d": {"buckets": {"8": {"winner": "b", "candidates": {"a": {"status": "ok"}}}}}}),
     "decision 'd' bucket 8: winner 'b' did not pass the correctness gate"),
    (lambda p: dict(p, decisions={"d": {"buckets": {"8": {"winner": "a", "candidates": {"a": {"status": "failed"}}}}}}),
     "decision 'd' bucket 8: winner 'a' did not pass the correctness gate"),
    (lambda p: dict(p, decisions={"d": dict(_decision({8: "a"}), overall=[])}),
     "decision 'd': overall must be an object whose recommended_backend is a name"),
    (lambda p: dict(p, decisions={"d": dict(_decision({8: "a"}), overall={"recommended_backend": 3})}),
     "decision 'd': overall must be an object whose recommended_backend is a name"),
    (lambda p: dict(p, decisions={"allreduce": {"servers": []}}), "decision 'allreduce': no servers object"),
])
def test_every_schema_rule_names_the_file(mutate, msg):
    with pytest.raises(P.ProfileError) as e:
        P.validate(mutate(_profile()), "/x/p.json")
    assert str(e.value).startswith(f"/x/p.json: {msg}"), str(e.value)
    with pytest.raises(P.ProfileError, match=r"^profile: "):
        P.validate(mutate(_profile()))


def test_what_the_schema_accepts():
    for status in P.STATUSES:
        p = _profile({"d": {"buckets": {"1": {"winner": None, "candidates": {"a": {"status": status}}}}}})
        assert P.validate(p) is p
    p = _profile({"d": dict(_decision({1: "a", 16: None}), overall={"recommended_backend": None}),
                  "e": dict(_decision({2: "b"}), overall={"recommended_backend": "b", "reason": "r"})})
    assert P.validate(p) is p
    assert P.STATUSES == ("ok", "failed", "unavailable", "rejected")


def test_load_and_save(tmp_path):
    with pytest.raises(P.ProfileError) as e:
        P.load(tmp_path / "none.json")
    assert str(e.value) == f"{tmp_path / 'none.json'}: cannot read (No such file or directory)"
    (tmp_path / "bad.json").write_text("{x")
    with pytest.raises(P.ProfileError) as e:
        P.load(tmp_path / "bad.json")
    assert str(e.value).startswith(f"{tmp_path / 'bad.json'}: not valid JSON (Expecting property name")
    (tmp_path / "old.json").write_text(json.dumps(dict(_profile(), schema=0)))
    with pytest.raises(P.ProfileError, match=rf"^{tmp_path / 'old.json'}: schema 0"):
        P.load(tmp_path / "old.json")
    prof = {"schema": 1, "gpu": GPU, "versions": VERS, "decisions": {"z": _decision({4: "a"}), "a": _decision({})}}
    (tmp_path / "sub").mkdir()
    out = P.save(prof, tmp_path / "sub" / "p.json")
    assert out == tmp_path / "sub" / "p.json"
    assert out.read_text() == json.dumps(prof, indent=1) + "\n"       # indent 1, the keys in their order
    assert P.load(out) == prof
    with pytest.raises(P.ProfileError, match=rf"^{tmp_path / 'q.json'}: no GPU name"):
        P.save(dict(prof, gpu=""), tmp_path / "q.json")
    assert not (tmp_path / "q.json").exists()


# ---------------------------------------------------------------------------- versions


class _Run:
    """subprocess.run stand-in: answers per command (its first argument words), records the calls."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def __call__(self, cmd, **kw):
        self.calls.append((cmd, kw))
        for key, ans in self.answers.items():
            if key in cmd:
                if isinstance(ans, BaseException):
                    raise ans
                rc, out = ans
                return types.SimpleNamespace(returncode=rc, stdout=out)
        raise AssertionError(cmd)


def test_the_git_commit_of_the_checkout(monkeypatch, tmp_path):
    run = _Run({"rev-parse": (0, "abcdef123456\n"), "status": (0, " M x.py\n")})
    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(P, "applied_repo_root", lambda: tmp_path)
    assert P._git_commit() == "abcdef123456-dirty"
    assert run.calls[0] == (["git", "-C", str(tmp_path), "rev-parse", "--short=12", "HEAD"],
                            {"capture_output": True, "text": True, "timeout": 10})
    assert run.calls[1] == (["git", "-C", str(tmp_path), "status", "--porcelain", "--untracked-files=no"],
                            {"capture_output": True, "text": True, "timeout": 10})
    run.answers["status"] = (0, "\n")
    assert P._git_commit() == "abcdef123456"
    run.answers["status"] = (128, "M x\n")
    assert P._git_commit() == "abcdef123456"
    run.answers["rev-parse"] = (0, "  \n")
    assert P._git_commit() is None
    run.answers["rev-parse"] = (1, "abc\n")
    assert P._git_commit() is None
    run.answers["rev-parse"] = subprocess.TimeoutExpired("git", 10)
    assert P._git_commit() is None
    run.answers["rev-parse"] = FileNotFoundError("git")
    assert P._git_commit() is None
    monkeypatch.setattr(P, "applied_repo_root", lambda: None)
    run.answers["rev-parse"] = (0, "c\n")
    P._git_commit()
    assert run.calls[-2][0][2] == str(P.CHECKOUT_DIR)


def test_the_driver_version(monkeypatch):
    run = _Run({"nvidia-smi": (0, " 580.65.06 \n580.65.06\n")})
    monkeypatch.setattr(subprocess, "run", run)
    assert P._driver() == "580.65.06"
    assert run.calls[0] == (["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                            {"capture_output": True, "text": True, "timeout": 20})
    for ans in ((9, "580\n"), (0, ""), FileNotFoundError("nvidia-smi"), subprocess.TimeoutExpired("x", 20)):
        run.answers["nvidia-smi"] = ans
        assert P._driver() is None, ans


def test_the_versions_this_process_runs_with(clean):
    import torch

    from dsv4_sm120 import __version__

    asked = []
    clean.setattr(P, "_dist_version", lambda n: asked.append(n) or f"v-{n}")
    clean.setattr(P, "_driver", lambda: "drv")
    clean.setattr(P, "_git_commit", lambda: "c0ffee")
    want = {"sglang": "v-sglang", "flashinfer": "v-flashinfer-python", "triton": "v-triton", "torch": "v-torch",
            "cuda": torch.version.cuda, "driver": "drv", "dsv4_sm120": f"{__version__}+c0ffee"}
    assert P.running_versions() == want and asked == ["sglang", "flashinfer-python", "triton", "torch"]
    clean.setattr(P, "_git_commit", lambda: None)
    assert P.running_versions()["dsv4_sm120"] == __version__
    got = P._process_versions()
    clean.setattr(P, "_driver", lambda: "other")
    assert P._process_versions() == got and P._process_versions() is not P._VERSIONS     # once per process


def test_a_distributions_version():
    import pytest as pt

    assert P._dist_version("no-such-dist-dsv4") is None and P._dist_version("pytest") == pt.__version__


def test_which_mismatches_void_a_profile():
    prof = _profile()
    assert P.match(prof, GPU, dict(VERS)) == (True, [])
    assert P.match(prof, "NVIDIA H200", VERS) == (False, [f"profile is for GPU {GPU!r}, this is 'NVIDIA H200'"])
    ok, why = P.match(prof, GPU, dict(VERS, triton="3.7.0", driver="575"))
    assert not ok and why == ["triton 3.8.0 in profile, 3.7.0 running (rerun `make calibrate`)",
                              "warning: driver 580.1 in profile, 575 running"]
    ok, why = P.match(prof, GPU, dict(VERS, sglang=None))          # a version that cannot be checked
    assert not ok and why == ["sglang 0.5.23 in profile, None running (rerun `make calibrate`)"]
    ok, why = P.match(_profile(versions=dict(VERS, torch=None)), GPU, dict(VERS, torch=None))
    assert not ok and why == ["torch None in profile, None running (rerun `make calibrate`)"]
    ok, why = P.match(prof, GPU, dict(VERS, cuda="12.8", dsv4_sm120="1.1", flashinfer="0.6.1"))
    assert not ok and why == ["flashinfer 0.6.0 in profile, 0.6.1 running (rerun `make calibrate`)",
                              "warning: cuda 13.0 in profile, 12.8 running",
                              "warning: dsv4_sm120 1.0+abc in profile, 1.1 running"]
    ok, why = P.match({"gpu": GPU}, GPU, VERS)
    assert not ok and len(why) == 7
    assert P.match(prof, GPU, dict(VERS, cuda=None, driver=None))[0] is True


def test_the_bucket_a_call_uses():
    prof = _profile({"d": _decision({8: "a", 64: "b", 1024: None}), "e": {"buckets": {}}})
    assert [P.winner(prof, "d", n) for n in (1, 8, 9, 64, 65, 1024, 5000)] == ["a", "a", "b", "b", None, None, None]
    assert P.winner(prof, "e", 1) is None and P.winner(prof, "zz", 1) is None and P.winner({}, "d", 1) is None


# ---------------------------------------------------------------------------- the glue's entry points


def test_the_active_profile_its_cache_and_its_lines(clean, tmp_path, caplog):
    path = _write(tmp_path, _profile({"attention.swa": _decision({4: "flashinfer", 64: "dsv4"})}))
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120"):
        prof, p, why = P.active_profile(GPU, VERS, tmp_path)
        assert prof is not None and p == path and why == []
        assert P.active_profile(GPU, dict(VERS, torch="x"), tmp_path)[0] is prof       # cached per (gpu, dir)
    assert caplog.messages == []
    assert P.decision("attention.swa", 5, gpu=GPU, versions=VERS, directory=tmp_path) == ("dsv4", f"profile {path}")
    assert P.decision("attention.swa", 2, "x", gpu=GPU, directory=tmp_path) == ("flashinfer", f"profile {path}")
    assert P.decision("attention.swa_c4", 2, gpu=GPU, directory=tmp_path) == ("dsv4", "default")
    assert P.decision("attention.swa_c4", 2, "mine", gpu=GPU, directory=tmp_path) == ("mine", "default")
    with pytest.raises(KeyError) as e:
        P.decision("nope", 1, gpu=GPU, directory=tmp_path)
    assert "unknown decision 'nope'; known: attention.swa, attention.swa_c128, attention.swa_c4" in str(e.value)
    assert P.bucket_winners("attention.swa", gpu=GPU, directory=tmp_path) == (
        [(4, "flashinfer"), (64, "dsv4")], f"profile {path}")
    assert P.bucket_winners("moe.nvfp4", gpu=GPU, directory=tmp_path) == ([], "default")
    P.clear_cache()
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120"):
        prof, p, why = P.active_profile(GPU, dict(VERS, torch="2.0"), tmp_path)
    assert prof is None and p == path and why == ["torch 2.14.1 in profile, 2.0 running (rerun `make calibrate`)"]
    assert caplog.messages == ["dsv4_sm120 profile: torch 2.14.1 in profile, 2.0 running (rerun `make calibrate`)"]
    assert P.decision("attention.swa", 5, gpu=GPU, directory=tmp_path) == ("dsv4", "default")


def test_a_profile_that_cannot_be_used_is_no_profile(clean, tmp_path, caplog):
    assert P.active_profile(GPU, VERS, tmp_path) == (None, tmp_path / f"{P.file_stem(GPU)}.json",
                                                     [f"no profile {tmp_path / P.file_stem(GPU)}.json (run `make "
                                                      "calibrate`)"])
    clean.setenv("DSV4_SM120_PROFILE_DIR", "")
    assert P.active_profile(GPU, VERS) == (None, None, ["DSV4_SM120_PROFILE_DIR is empty: profiles off"])
    clean.setattr(P, "_current_gpu", lambda: None)
    assert P.active_profile(None, VERS) == (None, None, ["no CUDA GPU"])
    P.clear_cache()
    path = _write(tmp_path, dict(_profile(), schema=9))
    prof, p, why = P.active_profile(GPU, VERS, tmp_path)
    assert prof is None and why == [f"{path}: schema 9, expected 1 (rerun `make calibrate`); ignored: stock decisions"]
    P.clear_cache()
    clean.setattr(P, "load", lambda path: (_ for _ in ()).throw(RecursionError("deep")))
    assert P.active_profile(GPU, VERS, tmp_path)[2] == [f"{path}: cannot be used (RecursionError: deep); ignored: "
                                                        "stock decisions"]
    P.clear_cache()
    clean.setenv("DSV4_SM120_PROFILE_DIR", "~nosuchuser_dsv4/x")
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120"):
        res = P.active_profile(GPU, VERS)
    assert res[0] is None and res[1] is None and "nosuchuser" in res[2][0]
    assert caplog.messages[-1].startswith("dsv4_sm120 profile: ") and caplog.messages[-1].endswith(
        "; ignored: stock decisions")


def test_the_current_gpu(clean):
    clean.setenv("DSV4_SM120_TEST_GPU_NAME", "Fake GPU")
    assert P._current_gpu() == "Fake GPU"
    clean.delenv("DSV4_SM120_TEST_GPU_NAME")
    import torch

    clean.setattr(torch.cuda, "is_available", lambda: True)
    clean.setattr(torch.cuda, "current_device", lambda: 2)
    clean.setattr(torch.cuda, "get_device_name", lambda i: f"GPU{i}")
    assert P._current_gpu() == "GPU2"
    clean.setattr(torch.cuda, "is_available", lambda: False)
    assert P._current_gpu() is None
    clean.setattr(torch.cuda, "is_available", lambda: (_ for _ in ()).throw(RuntimeError("driver")))
    assert P._current_gpu() is None


def test_the_server_wide_vote(clean, tmp_path):
    _write(tmp_path, _profile({
        "moe.nvfp4": _decision({1: "a", 8: "b", 64: "b", 512: None}, kind="tokens"),
        "moe.mxfp4": _decision({1: "a", 8: "b"}),                                   # a tie
        "fp8_gemm": dict(_decision({1: "x"}), overall={"recommended_backend": "deep_gemm", "reason": "faster"}),
        "attention.swa": _decision({1: None})}))
    kw = dict(gpu=GPU, versions=VERS, directory=tmp_path)
    path = tmp_path / f"{P.file_stem(GPU)}.json"
    assert P.overall("moe.nvfp4", **kw) == ("b", f"profile {path}", "a won M=1; b won M=8,64")
    assert P.overall("moe.mxfp4", **kw) == ("b", f"profile {path}", "a won T=1; b won T=8")   # the larger buckets
    assert P.overall("moe.mxfp4", "a", **kw)[0] == "a"                                        # the default is tied
    assert P.overall("fp8_gemm", **kw) == ("deep_gemm", f"profile {path}", "faster")
    assert P.overall("attention.swa", **kw) == ("dsv4", "default", "no bucket has a winner")
    assert P.overall("attention.swa_c4", **kw) == ("dsv4", "default", "")
    with pytest.raises(KeyError):
        P.overall("nope", **kw)
    P.clear_cache()
    _write(tmp_path, _profile({"fp8_gemm": dict(_decision({1: "x", 2: "x"}), overall={"recommended_backend": ""})}))
    assert P.overall("fp8_gemm", **kw) == ("x", f"profile {path}", "x won T=1,2")
    P.clear_cache()
    _write(tmp_path, _profile({"fp8_gemm": dict(_decision({1: "x"}), overall={"recommended_backend": "r"})}))
    assert P.overall("fp8_gemm", **kw)[2] == ""


def test_default_reason_and_status(clean, tmp_path):
    clean.setenv("DSV4_SM120_PROFILE_DIR", str(tmp_path))
    clean.setattr(P, "_process_versions", lambda: dict(VERS))
    assert P.default_reason("moe.nvfp4", GPU) == ("default: no matching profile for this GPU; make calibrate picks by "
                                                  "measurement")
    path = _write(tmp_path, _profile())
    P.clear_cache()
    assert P.default_reason("moe.nvfp4", GPU) == f"default: profile {path} has no winner for moe.nvfp4 here"
    assert P.status(GPU, VERS, tmp_path) == {"gpu": GPU, "usable": True, "path": str(path), "reasons": []}
    P.clear_cache()
    assert P.status(GPU, dict(VERS, sglang="0.5.22"), tmp_path) == {
        "gpu": GPU, "usable": False, "path": str(path),
        "reasons": ["sglang 0.5.23 in profile, 0.5.22 running (rerun `make calibrate`)"]}
    clean.setenv("DSV4_SM120_PROFILE_DIR", "")
    P.clear_cache()
    assert P.status("X", VERS)["path"] is None


def test_the_status_command_on_real_profiles(clean, tmp_path, capsys):
    clean.setattr(P, "running_versions", lambda: dict(VERS))
    path = _write(tmp_path, _profile())
    assert P.main(["status", "--gpu", GPU, "--gpu", "Other GPU", "--gpu", GPU, "--dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == (f"{GPU}: profile {path}\nOther GPU: no usable profile\n  no profile "
                                       f"{tmp_path / 'Other_GPU.json'} (run `make calibrate`)\n")
    P.clear_cache()
    assert P.main(["status", "--gpu", GPU, "--dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"gpu": GPU, "usable": True, "path": str(path), "reasons": []}
    assert logging.getLogger("dsv4_sm120.machine_profile").level == logging.ERROR
    logging.getLogger("dsv4_sm120.machine_profile").setLevel(logging.NOTSET)
    with pytest.raises(SystemExit) as e:
        P.main(["status"])
    assert e.value.code == 2 and "the following arguments are required: --gpu" in capsys.readouterr().err
    assert P.now_iso().endswith("Z") and len(P.now_iso()) == 20


# ---------------------------------------------------------------------------- torch's CUDA version, the command line

class _Dist:
    def __init__(self, root, asked):
        self.root, self.asked = root, asked

    def locate_file(self, rel):
        self.asked.append(rel)
        return self.root / rel


def test_torchs_cuda_version_with_and_without_torch_imported(monkeypatch, tmp_path):
    import importlib.metadata as md
    import sys

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(version=types.SimpleNamespace(cuda="12.8")))
    assert P._torch_cuda() == "12.8"
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace())          # a torch without .version
    assert P._torch_cuda() is None
    monkeypatch.delitem(sys.modules, "torch")
    asked, names = [], []
    monkeypatch.setattr(md, "distribution", lambda name: names.append(name) or _Dist(tmp_path, asked))
    (tmp_path / "torch").mkdir()
    version = tmp_path / "torch" / "version.py"
    for text, want in (("__version__ = '2.14.0'\ngit_version = 'abc'\ncuda: Optional[str] = '12.9'\n", "12.9"),
                       ('cuda = "13.0"\nhip = None\n', "13.0"),
                       ("cuda = ''\n", None),                  # a CPU build
                       ("hip = '6.2'\n", None),
                       ("CUDA = '12.1'\n  cuda = '12.2'\n", None)):
        version.write_text(text)
        assert P._torch_cuda() == want, text
    assert names[0] == "torch" and asked[0] == "torch/version.py"
    version.unlink()
    assert P._torch_cuda() is None


@pytest.fixture
def logger_level():
    """main() quiets the module's logger (it prints the reasons instead); put its level back for the other tests."""
    lg = logging.getLogger(P.__name__)
    old = lg.level
    yield
    lg.setLevel(old)


def test_the_status_command(monkeypatch, tmp_path, capsys, logger_level):
    with pytest.raises(SystemExit) as e:
        P.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and out.startswith("usage: python -m dsv4_sm120.machine_profile [-h] {status}")
    assert ("Whether a machine profile applies to a GPU with this environment's versions (the serve preflight's "
            "profile check).") in out
    assert "status print whether a profile matches GPU (JSON with --json)" in out
    with pytest.raises(SystemExit):
        P.main(["status", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--gpu GPU GPU name as nvidia-smi prints it (repeatable)" in out
    assert "--dir DIR profile directory (default: the one the patched SGLang reads)" in out
    assert "--json one JSON object per GPU name, one per line" in out
    with pytest.raises(SystemExit) as e:
        P.main([])
    assert e.value.code == 2 and "the following arguments are required: cmd" in capsys.readouterr().err
    mine = {"cuda": "12.8"}
    monkeypatch.setattr(P, "running_versions", lambda: mine)
    calls = []

    def status(g, versions, directory):
        calls.append((g, versions, directory))
        return {"gpu": g, "usable": g == "A", "path": "/p/A.json" if g == "A" else None,
                "reasons": [] if g == "A" else ["no profile /p/B.json", "warning: x"]}

    monkeypatch.setattr(P, "status", status)
    assert P.main(["status", "--gpu", "A", "--gpu", "B", "--gpu", "A", "--dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "A: profile /p/A.json\nB: no usable profile\n  no profile /p/B.json\n  warning: x\n"
    assert calls == [("A", mine, tmp_path), ("B", mine, tmp_path)] and isinstance(calls[0][2], Path)


def test_the_allreduce_and_shape_decisions_are_checked_by_their_own_rules():
    from dsv4_sm120.machine_profile.shape_decision import VARIANTS

    ok = _profile({"allreduce": {"servers": {}}})
    assert P.validate(ok) is ok                              # no buckets: the all-reduce entry has its own form
    with pytest.raises(P.ProfileError) as e:                 # the entries after it are still checked
        P.validate(_profile({"allreduce": {"servers": {}}, "attention.swa": {}}), "/p.json")
    assert str(e.value) == "/p.json: decision 'attention.swa' has no buckets"
    with pytest.raises(P.ProfileError) as e:
        P.validate(_profile({"allreduce": {}}), "/p.json")
    assert str(e.value) == "/p.json: decision 'allreduce': no servers object"
    with pytest.raises(P.ProfileError) as e:
        P.validate(_profile({"shape": {"variants": {"bogus": {}}}}), "/p.json")
    assert str(e.value) == f"/p.json: decision 'shape': variant 'bogus': expected one of {', '.join(VARIANTS)}"


def test_the_driver_version_and_the_process_versions_found_once(clean):
    answers = []
    clean.setattr(P.subprocess, "run", lambda *a, **k: answers.pop(0))
    answers.append(types.SimpleNamespace(returncode=0, stdout=" 580.95.05 \n"))
    assert P._driver() == "580.95.05"
    answers.append(types.SimpleNamespace(returncode=9, stdout="580\n"))
    assert P._driver() is None
    answers.append(types.SimpleNamespace(returncode=0, stdout="\n"))
    assert P._driver() is None
    calls = []
    clean.setattr(P, "running_versions", lambda: calls.append(1) or dict(VERS))
    assert P._process_versions() == VERS and P._process_versions() == VERS and calls == [1]


def test_the_versions_asked_for_not_the_process_ones(clean, tmp_path, caplog):
    clean.setattr(P, "running_versions", lambda: dict(VERS, torch="0.0"))     # this process would not match
    path = _write(tmp_path, _profile({"attention.swa": _decision({4: "flashinfer", 64: "dsv4"}),
                                      "moe.mxfp4": _decision({1: "z", 8: "a"})}))
    assert P.bucket_winners("attention.swa", gpu=GPU, versions=VERS, directory=tmp_path) == (
        [(4, "flashinfer"), (64, "dsv4")], f"profile {path}")
    # a tie between winners other than the default: the winner of the larger buckets, whatever their names
    assert P.overall("moe.mxfp4", "other", gpu=GPU, versions=VERS, directory=tmp_path)[0] == "a"
    with pytest.raises(KeyError) as e:
        P.overall("nope", gpu=GPU, versions=VERS, directory=tmp_path)
    assert e.value.args[0] == f"unknown decision 'nope'; known: {', '.join(sorted(P.DEFAULTS))}"
    usable, why = P.match(_profile(), GPU, dict(VERS, torch="0.0"))
    assert usable is False and why == ["torch 2.14.1 in profile, 0.0 running (rerun `make calibrate`)"]
    P.clear_cache()
    clean.setenv("DSV4_SM120_PROFILE_DIR", "~nosuchuser_dsv4/x")
    with caplog.at_level(logging.WARNING, logger="dsv4_sm120"):
        P.active_profile(GPU, VERS)
    assert "nosuchuser_dsv4" in caplog.messages[-1]          # the warning says what could not be read


def test_the_creation_time_is_utc(monkeypatch):
    import time

    monkeypatch.setenv("TZ", "XYZ-9")                           # nine hours east of UTC
    time.tzset()
    try:
        before = time.gmtime()
        got = P.now_iso()
        # the UTC hour (local time would be nine hours on); the clock may pass the full hour in between
        assert got[:13] in (time.strftime("%Y-%m-%dT%H", before), time.strftime("%Y-%m-%dT%H", time.gmtime())), got
        assert got.endswith("Z") and len(got) == 20
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_the_entries_after_a_valid_shape_decision_are_checked():
    from dsv4_sm120.machine_profile import shape_decision as sd

    cands = [{"name": "p4-d4", "prefill_gpus": "0,1,2,3", "decode_gpus": "4,5,6,7", "spec": None, "max_running": 16,
              "status": "ok", "agrees": True, "per_concurrency": {"1": {"output_tok_s": 1000.0}}}]
    shape = {"variants": {"base": {"standin": False, "candidates": cands, "winners": {"1": "p4-d4"},
                                   "measured_at": "2026-01-01T00:00:00Z"}}}
    assert sd.validate_entry(shape) is None
    ok = _profile({"shape": shape})
    assert P.validate(ok) is ok
    with pytest.raises(P.ProfileError) as e:
        P.validate(_profile({"shape": shape, "attention.swa": {}}), "/p.json")
    assert str(e.value) == "/p.json: decision 'attention.swa' has no buckets"
