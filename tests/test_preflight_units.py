"""dsv4_sm120.serving.preflight's checks in this process, with a plan built by hand and subprocess.run replaced by a
stand-in that records each command (argv, timeout, environment, directory) and answers what the test says: the
exact line of each failure, what each check runs and with which environment, the checks a dry run and a start
run (and which they leave, saying why), and the host spellings of the ports check (the bind errors a real socket
gives). The checks against real processes, sockets and the patched SGLang: tests/test_serve_preflight.py."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import types

import pytest

from dsv4_sm120.serving import preflight as pf
from dsv4_sm120.serving.plan import Plan, Proc

SETTINGS = {"MODEL_PATH": "/models/x", "MEM_FRACTION": "0.8", "PREFILL_MEM_FRACTION": "", "DECODE_MEM_FRACTION": "0.7",
            "NVIDIA_SMI": "/opt/smi", "PREFLIGHT_SKIP": "", "TRANSFER_BACKEND": "nixl"}


def _plan(roles=("prefill", "decode", "router"), standin=False, python="/venv/bin/python", repo="/repo", **settings):
    procs = []
    if "prefill" in roles:
        procs.append(Proc("prefill", ["p"], {"P": "1"}, "http://h/health", [("127.0.0.1", 30000, "prefill HTTP")],
                          [0, 1]))
    if "decode" in roles:
        procs.append(Proc("decode", ["d"], {}, "http://h/health", [("0.0.0.0", 30001, "decode HTTP")], [2, 3],
                          numa={"node": 1}))
    if "router" in roles:
        procs.append(Proc("router", ["r"], {}, "http://h/health", [("127.0.0.1", 8000, "router HTTP")]))
    return Plan("base", repo, python, "/run", list(roles), standin, dict(SETTINGS, **settings),
                [("NCCL_X", "1", "serve/env/10.env")], procs, {}, {})


class Run:
    """subprocess.run: answers by the first word of the command that matches a key (argv[0], or "-m module"),
    records (argv, kwargs)."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def __call__(self, argv, **kw):
        self.calls.append((list(argv), kw))
        key = argv[2] if len(argv) > 2 and argv[1] == "-m" else argv[0]
        ans = self.answers[key] if key in self.answers else self.answers.get("*")
        if isinstance(ans, BaseException):
            raise ans
        rc, out, err = ans
        return types.SimpleNamespace(returncode=rc, stdout=out, stderr=err)


def _each_answer(run, check, cases):
    """``check(_plan())`` with every command answering ``answer``, for each ``(answer, expected)`` in turn."""
    for answer, want in cases:
        run({"*": answer})
        assert check(_plan()) == want, answer


@pytest.fixture
def run(monkeypatch):
    def install(answers):
        r = Run(answers)
        monkeypatch.setattr(subprocess, "run", r)
        return r
    return install


# ---------------------------------------------------------------------------- skip list and environment


def test_the_skip_list_and_the_overlay_environment():
    assert pf.skipped_checks(_plan()) == [] and pf.skipped_checks(_plan(standin=True)) == list(pf.STANDIN_DEFAULT_SKIP)
    assert pf.skipped_checks(_plan(standin=True, PREFLIGHT_SKIP=" gpu , ports")) == ["gpu", "ports"]
    assert pf.skipped_checks(_plan(PREFLIGHT_SKIP="   ")) == []
    with pytest.raises(ValueError) as e:
        pf.skipped_checks(_plan(PREFLIGHT_SKIP="gpu,bogus"))
    assert str(e.value) == ("PREFLIGHT_SKIP='gpu,bogus' is not valid: unknown check(s) bogus (known: ports, gpu, model, "
                            "memory, patches, nixl, numa, p2p, ucx, router, profile)")
    p = _plan(repo="/r")
    assert pf.overlay_env(p, {"A": "1"}) == {"A": "1", "PYTHONPATH": "/r/overlay"}
    assert pf.overlay_env(p, {"PYTHONPATH": "/x"})["PYTHONPATH"] == "/r/overlay" + os.pathsep + "/x"
    assert pf.overlay_env(p, {"PYTHONPATH": ""})["PYTHONPATH"] == "/r/overlay"
    os.environ["OVERLAY_ENV_TEST_MARK"] = "m"
    try:
        assert pf.overlay_env(p)["OVERLAY_ENV_TEST_MARK"] == "m"
    finally:
        del os.environ["OVERLAY_ENV_TEST_MARK"]


# ---------------------------------------------------------------------------- ports


def _listening(host):
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.bind((host, 0))
    s.listen(1)
    return s


def test_a_bind_problem_is_the_errno_of_the_bind():
    s = _listening("127.0.0.1")
    try:
        port = s.getsockname()[1]
        assert pf.bind_problem("127.0.0.1", port) == errno.EADDRINUSE and pf.port_in_use("127.0.0.1", port)
        assert pf.bind_problem("0.0.0.0", port) == errno.EADDRINUSE       # every address includes the busy one
    finally:
        s.close()
    assert pf.bind_problem("127.0.0.1", port) is None and not pf.port_in_use("127.0.0.1", port)
    assert pf.bind_problem("192.0.2.1", port) == errno.EADDRNOTAVAIL      # TEST-NET: not this host's
    try:
        s6 = _listening("::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        assert pf.bind_problem("::1", s6.getsockname()[1]) == errno.EADDRINUSE
    finally:
        s6.close()


def test_the_ports_check_names_the_host_and_the_variable(monkeypatch):
    answers = {("127.0.0.1", 30000): errno.EADDRINUSE, ("0.0.0.0", 30001): errno.EADDRNOTAVAIL}
    monkeypatch.setattr(pf, "bind_problem", lambda h, p: answers.get((h, p)))
    assert pf.check_ports(_plan()) == [
        "port 30000 on 127.0.0.1 (prefill HTTP) is already in use: stop what holds it (serve/stop.sh for an earlier "
        "deployment) or set PREFILL_PORT to a free port",
        "0.0.0.0 is not an address of this host (decode HTTP binds 0.0.0.0:30001): run this part on the host that has "
        "it, or set DECODE_HOST to one of this host's addresses"]
    answers.clear()
    answers[("127.0.0.1", 8000)] = errno.EADDRNOTAVAIL
    assert pf.check_ports(_plan())[0].endswith("or set ROUTER_HOST to one of this host's addresses")
    answers[("127.0.0.1", 8000)] = -1
    assert pf.check_ports(_plan())[0].endswith("or set ROUTER_PORT to a free port")


# ---------------------------------------------------------------------------- gpu


def test_nvidia_smi_rows_and_the_gpu_table():
    gpus = pf.parse_nvidia_smi("0, NVIDIA RTX PRO 6000, Blackwell, 12.0, 97887, 96000\n1, H200, 9.0, 143771, 1000\n")
    assert gpus == {0: {"name": "NVIDIA RTX PRO 6000, Blackwell", "cc": "12.0", "total_mib": 97887.0,
                        "free_mib": 96000.0},
                    1: {"name": "H200", "cc": "9.0", "total_mib": 143771.0, "free_mib": 1000.0}}
    with pytest.raises(ValueError) as e:
        pf.parse_nvidia_smi("0, x, 12.0, 5")
    assert str(e.value) == "unexpected nvidia-smi line: '0, x, 12.0, 5'"
    assert pf.parse_nvidia_smi("") == {}
    table = {0: {"name": "A", "cc": "12.0", "total_mib": 1024.0, "free_mib": 819.2},
             1: {"name": "B", "cc": "12.1", "total_mib": 2048.0, "free_mib": 2048.0},
             2: {"name": "C", "cc": "9.0", "total_mib": 1024.0, "free_mib": 1024.0},
             3: {"name": "D", "cc": "120", "total_mib": 1024.0, "free_mib": 1024.0}}
    assert pf.check_gpus_table(table, [("prefill", [0, 1], 0.8)]) == []             # exactly enough is enough
    assert pf.check_gpus_table(table, [("decode", [0], 0.81)]) == [
        "decode: GPU 0 has 0.8 GiB free of 1.0 GiB; mem fraction 0.81 needs 0.8 GiB (another process is using it?)"]
    assert pf.check_gpus_table(table, [("decode", [2, 3], 0.5)]) == [
        "decode: GPU 2 (C) has compute capability 9.0, need 12.x (sm_120)",
        "decode: GPU 3 (D) has compute capability 120, need 12.x (sm_120)"]
    assert pf.check_gpus_table(table, [("prefill", [7], 0.5)]) == [
        "prefill: GPU 7 not found (nvidia-smi lists 4 GPU(s): 0,1,2,3)"]
    assert pf.check_gpus_table({}, [("prefill", [0], 0.5)]) == [
        "prefill: GPU 0 not found (nvidia-smi lists 0 GPU(s): none)"]
    # an RTX PRO 6000 (97887 MiB) with 40000 MiB free: MiB -> GiB by 1024 (39.06 / 95.59 / 86.03 GiB)
    big = {4: {"name": "RTX PRO 6000", "cc": "12.0", "total_mib": 97887.0, "free_mib": 40000.0}}
    assert pf.check_gpus_table(big, [("decode", [4], 0.9)]) == [
        "decode: GPU 4 has 39.1 GiB free of 95.6 GiB; mem fraction 0.9 needs 86.0 GiB (another process is using it?)"]


def test_the_gpu_check_asks_nvidia_smi(run):
    r = run({"/opt/smi": (0, "0, G, 12.0, 1000, 980\n1, G, 12.0, 1000, 1000\n2, G, 12.0, 1000, 650\n"
                            "3, G, 12.0, 1000, 1000\n", "")})
    assert pf.check_gpu(_plan()) == ["decode: GPU 2 has 0.6 GiB free of 1.0 GiB; mem fraction 0.7 needs 0.7 GiB "
                                     "(another process is using it?)"]
    assert r.calls[0] == (["/opt/smi", "--query-gpu=index,name,compute_cap,memory.total,memory.free",
                           "--format=csv,noheader,nounits"], {"capture_output": True, "text": True, "timeout": 30})
    p = _plan(PREFILL_MEM_FRACTION="0.99")
    assert pf.check_gpu(p)[0] == ("prefill: GPU 0 has 1.0 GiB free of 1.0 GiB; mem fraction 0.99 needs 1.0 GiB "
                                  "(another process is using it?)")
    assert pf.check_gpu(_plan(roles=("router",))) == [] and len(r.calls) == 2
    r.answers["nvidia-smi"] = r.answers["/opt/smi"]
    assert pf.check_gpu(_plan(NVIDIA_SMI="")) and r.calls[-1][0][0] == "nvidia-smi"
    _each_answer(run, pf.check_gpu, [
        ((9, "", "NVIDIA-SMI has failed\nbecause no driver\n"), ["nvidia-smi failed (exit 9): because no driver"]),
        ((9, "out only\n", ""), ["nvidia-smi failed (exit 9): out only"]),
        ((9, "", ""), ["nvidia-smi failed (exit 9): no output"]),
        (FileNotFoundError("x"), ["nvidia-smi not found (/opt/smi): no NVIDIA driver on this host?"]),
        (subprocess.TimeoutExpired("smi", 30), ["nvidia-smi did not answer within 30 s"]),
        ((0, "garbage\n", ""), ["unexpected nvidia-smi line: 'garbage'"])])


# ---------------------------------------------------------------------------- patches, nixl, router, python


def test_the_patch_status(run):
    ok = {"patched": True, "matches_repo": True}
    assert pf.interpret_patch_status(ok) == [] and pf.interpret_patch_status(dict(ok, overlay_current=None)) == []
    assert pf.interpret_patch_status(dict(ok, overlay_current=False)) == [
        "the dsv4_sm120 installed in the environment differs from this checkout (overlay code changed since `make "
        "apply-patches`): run `make apply-patches`"]
    assert pf.interpret_patch_status({"sglang_root": "/s", "state": "applying"}) == [
        "SGLang at /s is in patch state 'applying': run `make apply-patches` (it rolls back first)"]
    assert pf.interpret_patch_status({"sglang_root": "/s", "state": "applied", "patched": True,
                                      "modified_files": list("abcdef")}) == [
        "SGLang at /s: patched files were modified since apply: a, b, c, d, e; run `make revert-patches && make "
        "apply-patches`"]
    assert pf.interpret_patch_status({}) == ["SGLang at ? is not patched: run `make apply-patches`"]
    assert pf.interpret_patch_status({"patched": True, "series_hash": "0123456789abcdef",
                                      "repo_series_hash": "fedcba9876543210"}) == [
        "SGLang at ? is patched with series 0123456789ab but this repo's series is fedcba987654: run `make "
        "revert-patches && make apply-patches`"]
    assert pf.interpret_patch_status({"patched": True})[0].startswith("SGLang at ? is patched with series ? but this "
                                                                      "repo's series is ?:")
    r = run({"dsv4_sm120.patching": (0, json.dumps(ok), "")})
    assert pf.check_patches(_plan(repo="/r", python="/py")) == []
    argv, kw = r.calls[0]
    assert argv == ["/py", "-m", "dsv4_sm120.patching", "status", "--python", "/py", "--json"]
    assert kw["timeout"] == 120 and kw["cwd"] == "/r" and kw["env"]["PYTHONPATH"].startswith("/r/overlay")
    assert kw["capture_output"] and kw["text"]
    assert pf.check_patches(_plan(roles=("router",))) == [] and len(r.calls) == 1
    _each_answer(run, pf.check_patches, [
        ((1, "", "Traceback\nImportError: x\n"), ["could not read the patch status: ImportError: x"]),
        ((3, "", ""), ["could not read the patch status: exit 3"]),
        (subprocess.TimeoutExpired("x", 120), ["patch status check timed out after 120 s"])])


def test_the_nixl_check(run):
    r = run({"dsv4_sm120.serving.nixl_check": (0, "", "")})
    assert pf.check_nixl(_plan(repo="/r")) == []
    argv, kw = r.calls[0]
    assert argv == ["/venv/bin/python", "-m", "dsv4_sm120.serving.nixl_check", "--json", "--timeout", "30"]
    assert kw["timeout"] == 90 and kw["cwd"] == "/r" and kw["env"]["NCCL_X"] == "1"
    assert kw["env"]["PYTHONPATH"].startswith("/r/overlay")
    assert pf.check_nixl(_plan(roles=("router",))) == [] and len(r.calls) == 1
    _each_answer(run, pf.check_nixl, [
        ((1, "nixl check: first\nother\n", "nixl check: UCX backend missing\n"), ["nixl check: first"]),
        ((1, "", "nixl check: a\nnixl check: UCX backend missing\n"), ["nixl check: UCX backend missing"]),
        ((2, "out\n", "some error\nlast line\n"), ["NIXL check failed (exit 2): last line"]),
        ((2, "out tail\n", ""), ["NIXL check failed (exit 2): out tail"]),
        ((2, "", ""), ["NIXL check failed (exit 2): "]),
        (subprocess.TimeoutExpired("x", 90), ["NIXL check timed out after 90 s"])])


def test_the_router_and_python_checks(run, tmp_path):
    r = run({"/py": (0, "", "")})
    assert pf.check_router(_plan(python="/py")) == []
    argv, kw = r.calls[0]
    assert argv[:2] == ["/py", "-c"] and "find_spec('sglang_router')" in argv[2] and kw["timeout"] == 60
    assert pf.check_router(_plan(roles=("prefill",), python="/py")) == [] and len(r.calls) == 1
    run({"/py": (3, "", "")})
    assert pf.check_router(_plan(python="/py")) == [
        "sglang_router is not installed in /py (pip install sglang-router==0.3.2)"]
    py = tmp_path / "python"
    py.write_text("#!/bin/sh\n")
    assert pf.check_python(_plan(python=str(py))) == [f"no python at {py}: run `make setup` or set VENV to the "
                                                      "serving environment"]
    py.chmod(0o755)
    r = run({str(py): (0, "", "")})
    assert pf.check_python(_plan(python=str(py))) == []
    assert "find_spec('sglang')" in r.calls[0][0][2] and r.calls[0][1]["timeout"] == 60
    assert pf.check_python(_plan(python=str(py), standin=True)) == [] and len(r.calls) == 1
    assert pf.check_python(_plan(python=str(py), roles=("router",))) == [] and len(r.calls) == 1
    run({str(py): (3, "", "")})
    assert pf.check_python(_plan(python=str(py))) == [f"sglang is not installed in {py}: run `make setup`"]
    assert pf.check_python(_plan(python=str(tmp_path))) != []             # a directory is no python


# ---------------------------------------------------------------------------- the servers' environment


def test_an_allocator_setting_nixl_cannot_register(monkeypatch):
    p = _plan()
    bad = "garbage_collection_threshold:0.8, expandable_segments : True"
    assert pf.check_alloc_conf(p, {"PYTORCH_CUDA_ALLOC_CONF": bad}) == [
        f"PYTORCH_CUDA_ALLOC_CONF={bad!r} turns on expandable_segments, which NIXL's memory registration of the KV "
        "cache wants off: remove expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF (or set "
        "expandable_segments:False)"]
    assert pf.check_alloc_conf(p, {"PYTORCH_ALLOC_CONF": "expandable_segments:TRUE"})[0].startswith(
        "PYTORCH_ALLOC_CONF='expandable_segments:TRUE' turns on")
    assert pf.check_alloc_conf(p, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) == []
    assert pf.check_alloc_conf(p, {"PYTORCH_CUDA_ALLOC_CONF": "other:True"}) == []
    assert pf.check_alloc_conf(_plan(TRANSFER_BACKEND="mooncake"), {"PYTORCH_CUDA_ALLOC_CONF": bad}) == []
    assert pf.check_alloc_conf(_plan(roles=("router",)), {"PYTORCH_CUDA_ALLOC_CONF": bad}) == []
    p2 = _plan()
    del p2.settings["TRANSFER_BACKEND"]
    assert pf.check_alloc_conf(p2, {"PYTORCH_CUDA_ALLOC_CONF": bad}) != []   # nixl is the default backend


def test_a_split_body_sm120_does_not_run():
    assert pf.check_attention_arch({}) == [] and pf.check_attention_arch({"DSV4_SM120_ATTN_CONFIG": "BLOCK_N=32"}) == []
    assert pf.check_attention_arch({"DSV4_SM120_ATTN_CONFIG": "impl=tiled"}) == []
    assert pf.check_attention_arch({"DSV4_SM120_ATTN_CONFIG": "impl=nope"}) == []      # the settings check says it
    out = pf.check_attention_arch({"DSV4_SM120_ATTN_CONFIG": "impl=wgmma"})
    assert len(out) == 1 and out[0].startswith("DSV4_SM120_ATTN_CONFIG='impl=wgmma' names impl=wgmma, which runs on ")
    assert out[0].endswith("and the servers' GPUs are sm_120: remove impl=wgmma (or name one of tiled, reg, flat, "
                           "wspec)") or "(or name one of " in out[0]
    others = out[0].split("(or name one of ")[1].rstrip(")").split(", ")
    from dsv4_sm120.attention.keys import IMPLS, runs_on

    assert others == [i for i in IMPLS if runs_on(i, 12)] and "wgmma" not in others and len(others) >= 2


def test_the_servers_environment_is_validated_with_the_env_files(monkeypatch):
    p = _plan()
    p.common_env = [("DSV4_SM120_SELFCHECK", "maybe", "serve/env/x.env"), ("PYTORCH_CUDA_ALLOC_CONF",
                                                                          "expandable_segments:True", "f")]
    out = pf.check_overlay_env(p, {"DSV4_SM120_ATTN_CONFIG": "impl=wgmma"})
    assert len(out) == 3 and out[0].startswith("DSV4_SM120_SELFCHECK='maybe' is not valid")
    assert "impl=wgmma" in out[1] and "expandable_segments" in out[2]
    assert pf.check_overlay_env(p, {"DSV4_SM120_SELFCHECK": "1"})[0].startswith("PYTORCH_CUDA_ALLOC_CONF=")
    unknown = "DSV4_SM120_" + "NO_SUCH"   # two parts: the tree scan of tests/test_settings.py passes it
    monkeypatch.setenv(unknown, "1")
    assert any(unknown in x for x in pf.check_overlay_env(_plan()))


# ---------------------------------------------------------------------------- the machine profile


def test_the_servers_gpu_names(run):
    r = run({"/opt/smi": (0, "0, RTX A\n1, RTX A\n2, RTX B\n3, RTX A\nx, nope\n5,\n9, RTX Z\n", "")})
    assert pf.server_gpu_names(_plan()) == ({"RTX A": "prefill GPU 0, prefill GPU 1, decode GPU 3",
                                             "RTX B": "decode GPU 2"}, None)
    assert r.calls[0] == (["/opt/smi", "--query-gpu=index,name", "--format=csv,noheader"],
                          {"capture_output": True, "text": True, "timeout": 30})
    p = _plan()
    p.procs[1].gpus = [1, 2]                                   # a GPU both servers use
    assert pf.server_gpu_names(p)[0]["RTX A"] == "prefill GPU 0, prefill/decode GPU 1"
    assert pf.server_gpu_names(_plan(roles=("router",))) == ({}, None) and len(r.calls) == 2
    run({"*": (4, "", "")})
    assert pf.server_gpu_names(_plan()) == ({}, "nvidia-smi failed (exit 4)")
    run({"*": FileNotFoundError(2, "No such file")})
    assert pf.server_gpu_names(_plan(NVIDIA_SMI="")) == ({}, "nvidia-smi (nvidia-smi) did not run: [Errno 2] No "
                                                              "such file")


def test_the_profile_notes():
    where = {"G": "decode GPU 4"}
    rows = [{"gpu": "G", "usable": True, "path": "/p.json", "reasons": ["warning: driver 1 in profile, 2 running",
                                                                         "warning: cuda a in profile, b running"]},
            {"gpu": "H", "usable": False, "reasons": ["no profile /q.json", "warning: x"]},
            {"usable": False, "reasons": []}]
    assert pf.interpret_profile_status(rows, where) == [
        "machine profile /p.json applies to G (decode GPU 4); driver 1 in profile, 2 running; cuda a in profile, b "
        "running",
        "WARNING: no matching machine profile for H (): no profile /q.json; the servers use the default choices (`make "
        "calibrate`, or CALIBRATE=1, picks by measurement)",
        "WARNING: no matching machine profile for ? (): no reason given; the servers use the default choices (`make "
        "calibrate`, or CALIBRATE=1, picks by measurement)"]
    assert pf.interpret_profile_status([{"gpu": "G", "usable": True, "path": "/p"}], where) == [
        "machine profile /p applies to G (decode GPU 4)"]
    two = [{"gpu": "G", "usable": False, "reasons": ["driver 580 in profile, 590 running", "warning: w",
                                                       "no allreduce decision"]}]
    assert pf.interpret_profile_status(two, where) == [
        "WARNING: no matching machine profile for G (decode GPU 4): driver 580 in profile, 590 running; no allreduce "
        "decision; the servers use the default choices (`make calibrate`, or CALIBRATE=1, picks by measurement)"]


def test_the_profile_check(run, monkeypatch):
    monkeypatch.setattr(pf, "server_gpu_names", lambda plan: ({"G": "decode GPU 2"}, None))
    row = {"gpu": "G", "usable": True, "path": "/p.json", "reasons": []}
    r = run({"dsv4_sm120.machine_profile": (0, "noise\n" + json.dumps(row) + "\n", "")})
    assert pf.check_profile(_plan(repo="/r")) == ([], ["machine profile /p.json applies to G (decode GPU 2)"])
    argv, kw = r.calls[0]
    assert argv == ["/venv/bin/python", "-m", "dsv4_sm120.machine_profile", "status", "--json", "--gpu", "G"]
    assert kw["timeout"] == 120 and kw["cwd"] == "/r" and kw["env"]["NCCL_X"] == "1" and kw["capture_output"]
    assert pf.check_profile(_plan(standin=True)) == ([], []) and len(r.calls) == 1
    run({"*": (1, "", "Traceback\nKeyError: 'x'\n")})
    assert pf.check_profile(_plan()) == ([], ["WARNING: could not check the machine profile: KeyError: 'x'"])
    run({"*": (0, "", "")})
    assert pf.check_profile(_plan()) == ([], ["WARNING: could not check the machine profile: exit 0"])
    run({"*": (0, "{not json\n", "")})
    assert pf.check_profile(_plan())[1][0].startswith("WARNING: could not check the machine profile (JSONDecodeError: ")
    run({"*": subprocess.TimeoutExpired("x", 120)})
    assert pf.check_profile(_plan())[1][0].startswith("WARNING: could not check the machine profile (TimeoutExpired: ")
    monkeypatch.setattr(pf, "server_gpu_names", lambda plan: ({}, "nvidia-smi failed (exit 4)"))
    assert pf.check_profile(_plan()) == ([], ["WARNING: could not check the machine profile (nvidia-smi failed (exit "
                                              "4))"])
    monkeypatch.setattr(pf, "server_gpu_names", lambda plan: ({}, None))
    assert pf.check_profile(_plan()) == ([], [])


def test_calibrate_first(run):
    said = []
    p = _plan(repo="/r")
    assert pf.calibrate_first(p, said.append) == [] and said == []                 # no CALIBRATE=1
    p.calibrate_argv = ["/py", "-m", "dsv4_sm120.calibrate", "--tp", "4"]
    p.calibrate_env = {"CUDA_VISIBLE_DEVICES": "4"}
    r = run({"dsv4_sm120.calibrate": (0, "", "")})
    assert pf.calibrate_first(p, said.append) == []
    assert said == ["calibrate: measuring this box first (CALIBRATE=1): -m dsv4_sm120.calibrate --tp 4"]
    argv, kw = r.calls[0]
    assert argv == p.calibrate_argv and kw["cwd"] == "/r" and kw["env"]["CUDA_VISIBLE_DEVICES"] == "4"
    assert kw["env"]["NCCL_X"] == "1" and kw["env"]["PYTHONPATH"].startswith("/r/overlay") and "timeout" not in kw
    run({"*": (3, "", "")})
    assert pf.calibrate_first(p, said.append) == [
        "CALIBRATE=1: `python -m dsv4_sm120.calibrate` failed (exit 3); its output is above (CALIBRATE=0 starts with "
        "the profile there is)"]
    run({"*": OSError("exec format error")})
    assert pf.calibrate_first(p, said.append) == ["CALIBRATE=1: the calibration did not start (exec format error)"]
    said.clear()
    p.standin = True
    assert pf.calibrate_first(p, said.append) == [] and said == ["calibrate: skipped (stand-in servers need no profile)"]


# ---------------------------------------------------------------------------- the runs


def test_nvidia_smi_answering(run):
    r = run({"/opt/smi": (0, "0, G, 12.0, 1, 1\n", "")})
    assert pf.smi_problem(_plan()) is None
    assert r.calls[0][1] == {"capture_output": True, "text": True, "timeout": 30}
    run({"*": (0, "  \n", "")})
    assert pf.smi_problem(_plan()) == "/opt/smi failed (exit 0)"
    run({"*": (6, "x", "")})
    assert pf.smi_problem(_plan(NVIDIA_SMI="")) == "nvidia-smi failed (exit 6)"
    _each_answer(run, pf.smi_problem, [
        (FileNotFoundError(), "/opt/smi not found"),
        (PermissionError(), "/opt/smi did not run (PermissionError)"),
        (subprocess.TimeoutExpired("x", 30), "/opt/smi did not run (TimeoutExpired)")])


def test_why_a_check_does_not_run():
    p = _plan()
    assert pf._not_run(p, "patches", {"python"}, False, None) == "needs the python check, which failed"
    assert pf._not_run(p, "ports", {"python"}, False, None) is None
    assert pf._not_run(p, "p2p", {"gpu"}, True, None) == "needs the gpu check, which failed"
    assert pf._not_run(p, "nixl", set(), True, None) == "dry run: moves KV pages through NIXL"
    assert pf._not_run(p, "nixl", set(), False, None) is None
    assert pf._not_run(p, "profile", set(), True, "smi gone") == ("dry run: needs nvidia-smi, which does not answer "
                                                                  "here: smi gone")
    assert pf._not_run(p, "profile", set(), False, "smi gone") is None
    assert pf._not_run(p, "gpu", set(), True, None) is None


def _runners(monkeypatch, results):
    ran = []
    for name in pf.CHECKS:
        def check(plan, name=name):
            ran.append(name)
            return results.get(name, [])
        monkeypatch.setitem(pf.RUNNERS, name, check)
    return ran


def test_a_start_runs_every_check_in_order_and_stops_at_a_missing_python(monkeypatch):
    monkeypatch.setattr(pf, "check_overlay_env", lambda plan: [])
    monkeypatch.setattr(pf, "check_python", lambda plan: [])
    cal = []
    monkeypatch.setattr(pf, "calibrate_first", lambda plan, say: cal.append(1) or [])
    ran = _runners(monkeypatch, {"gpu": ["no gpu"], "model": (["bad model"], ["a note"]), "numa": ([], ["node 1"])})
    said = []
    out = pf.run_preflight(_plan(PREFLIGHT_SKIP="router"), said.append)
    assert out == ["no gpu", "bad model"] and cal == [1]
    assert ran == ["ports", "gpu", "model", "patches", "nixl", "numa"]
    assert said == ["preflight env: ok", "preflight ports: ok", "preflight gpu: FAILED", "  no gpu",
                    "preflight model: FAILED", "  bad model", "preflight model: a note",
                    "preflight memory: not run (needs the gpu check, which failed)", "preflight patches: ok",
                    "preflight nixl: ok", "preflight numa: ok", "preflight numa: node 1",
                    "preflight p2p: not run (needs the gpu check, which failed)",
                    "preflight ucx: not run (needs the gpu check, which failed)", "preflight router: skipped",
                    "preflight profile: not run (needs the gpu check, which failed)"]
    monkeypatch.setattr(pf, "check_python", lambda plan: ["no python"])
    said.clear()
    assert pf.run_preflight(_plan(), said.append) == ["no python"] and said == []
    monkeypatch.setattr(pf, "check_python", lambda plan: [])
    monkeypatch.setattr(pf, "calibrate_first", lambda plan, say: ["calibration failed"])
    assert pf.run_preflight(_plan(), said.append) == ["calibration failed"]
    monkeypatch.setattr(pf, "check_overlay_env", lambda plan: ["bad env"])
    cal.clear()
    monkeypatch.setattr(pf, "calibrate_first", lambda plan, say: cal.append(1) or [])
    said.clear()
    assert pf.run_preflight(_plan(), said.append)[0] == "bad env" and cal == []      # no calibration on a bad env
    assert said[:2] == ["preflight env: FAILED", "  bad env"]


def test_a_dry_run_runs_what_it_has_inputs_for(monkeypatch):
    monkeypatch.setattr(pf, "check_overlay_env", lambda plan: [])
    monkeypatch.setattr(pf, "check_python", lambda plan: ["no python at /venv"])
    monkeypatch.setattr(pf, "smi_problem", lambda plan: "smi gone")
    monkeypatch.setattr(pf, "_model_note", lambda plan: "the note")
    ran = _runners(monkeypatch, {"numa": ([], ["numa detail"])})
    said = []
    out = pf.run_dry_checks(_plan(), said.append)
    assert out == ["no python at /venv"] and ran == ["ports", "model", "numa"]
    assert said == ["# preflight: every check a start runs that needs no GPU, NIXL or running server (a start runs "
                    "them again, with the rest):",
                    "preflight env: ok", "preflight python: FAILED", "  no python at /venv", "preflight ports: ok",
                    "preflight gpu: not run (dry run: needs nvidia-smi, which does not answer here: smi gone)",
                    "preflight model: ok (the note)",
                    "preflight memory: not run (dry run: needs nvidia-smi, which does not answer here: smi gone)",
                    "preflight patches: not run (needs the python check, which failed)",
                    "preflight nixl: not run (needs the python check, which failed)",
                    "preflight numa: ok (the numa lines above)",
                    "preflight p2p: not run (needs the python check, which failed)",
                    "preflight ucx: not run (needs the python check, which failed)",
                    "preflight router: not run (needs the python check, which failed)",
                    "preflight profile: not run (needs the python check, which failed)"]
    monkeypatch.setattr(pf, "check_python", lambda plan: [])
    monkeypatch.setattr(pf, "smi_problem", lambda plan: None)
    ran.clear()
    said.clear()
    p = _plan()
    p.procs[1].numa = {}
    assert pf.run_dry_checks(p, said.append) == []
    assert ran == ["ports", "gpu", "model", "memory", "patches", "numa", "router", "profile"]
    assert "preflight numa: ok" in said and "preflight nixl: not run (dry run: moves KV pages through NIXL)" in said
    assert "preflight p2p: not run (dry run: copies between the GPUs)" in said
    assert "preflight ucx: not run (dry run: moves KV pages between the GPUs through NIXL/UCX)" in said
    # a bad overlay environment and a missing python: a dry run returns both failures, env first
    monkeypatch.setattr(pf, "check_overlay_env", lambda plan: ["bad env"])
    monkeypatch.setattr(pf, "check_python", lambda plan: ["no python at /venv"])
    said.clear()
    assert pf.run_dry_checks(p, said.append) == ["bad env", "no python at /venv"]
    assert said[1:5] == ["preflight env: FAILED", "  bad env", "preflight python: FAILED", "  no python at /venv"]
    monkeypatch.setattr(pf, "check_python", lambda plan: [])
    assert pf.run_dry_checks(p, said.append) == ["bad env"]


def test_the_dry_runs_model_note(monkeypatch):
    from dsv4_sm120 import model_config

    answers = {"local": types.SimpleNamespace(where="local", source="config.json of /m"),
               "hub": types.SimpleNamespace(where="hub", source="x"),
               "hub-cache": types.SimpleNamespace(where="hub-cache", source="config.json in the cache")}
    for where, want in (("local", "config.json of /m, shard headers read"),
                        ("hub", "a Hugging Face id not in the local Hugging Face cache: SGLang downloads it at start"),
                        ("hub-cache", "config.json in the cache")):
        monkeypatch.setattr(model_config, "read", lambda mp, w=where: answers[w])
        assert pf._model_note(_plan()) == want
    assert pf._model_note(_plan(roles=("router",))) == "no server on this host"


# ---------------------------------------------------------------------------- the memory check, one-role hosts

SMI_4 = "".join(f"{i}, NVIDIA RTX PRO 6000, 12.0, 97887, 97000\n" for i in range(4))


def test_the_memory_check_hands_each_server_and_the_model_to_memory_check(run, monkeypatch):
    from dsv4_sm120 import model_config
    from dsv4_sm120.serving import memory_check

    mc = types.SimpleNamespace(directory="/models/x", config={"layers": 43}, problems=lambda: [])
    read, got = [], []
    monkeypatch.setattr(model_config, "read", lambda path: read.append(path) or mc)
    monkeypatch.setattr(memory_check, "check", lambda *a: got.append(a) or (["too big"], ["a note"]))
    monkeypatch.setattr(memory_check, "by_gpu", lambda table: ("by", sorted(table)))
    run({"/opt/smi": (0, SMI_4, "")})
    assert pf.check_memory(_plan(CONTEXT_LEN="65536")) == (["too big"], ["a note"])
    assert read == ["/models/x"]
    assert got == [([("prefill", "prefill", [0, 1], 0.8), ("decode", "decode", [2, 3], 0.7)], "/models/x",
                     {"layers": 43}, 65536, ("by", [0, 1, 2, 3]))]
    mc.problems = lambda: ["a shard is missing"]              # the weights cannot be sized: config only
    pf.check_memory(_plan(CONTEXT_LEN="65536"))
    assert got[-1][1] is None and got[-1][2] == {"layers": 43}
    got.clear()
    read.clear()
    assert pf.check_memory(_plan(roles=("router",), CONTEXT_LEN="1")) == ([], []) and got == [] and read == []
    run({"*": (9, "", "no driver\n")})
    assert pf.check_memory(_plan(CONTEXT_LEN="1")) == ([], ["not checked: nvidia-smi failed (exit 9): no driver"])


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_host_with_one_server_runs_the_server_checks(run, monkeypatch, role):
    from dsv4_sm120 import model_config

    r = run({"dsv4_sm120.patching": (0, json.dumps({"patched": True, "matches_repo": True}), ""),
             "dsv4_sm120.serving.nixl_check": (0, "", "")})
    assert pf.check_patches(_plan(roles=(role,))) == [] and pf.check_nixl(_plan(roles=(role,))) == []
    assert [c[0][2] for c in r.calls] == ["dsv4_sm120.patching", "dsv4_sm120.serving.nixl_check"]
    read = []
    monkeypatch.setattr(model_config, "read", lambda path: read.append(path) or types.SimpleNamespace(
        where="hub-cache", source="config.json in the cache"))
    assert pf._model_note(_plan(roles=(role,))) == "config.json in the cache" and read == ["/models/x"]


def test_what_the_commands_are_asked(run):
    r = run({"*": (0, SMI_4, "")})
    assert pf.smi_problem(_plan()) is None
    assert r.calls[-1][0] == ["/opt/smi", "--query-gpu=index,name,compute_cap,memory.total,memory.free",
                              "--format=csv,noheader,nounits"]
    r = run({"/py": (0, "", "")})
    pf.check_router(_plan(python="/py"))
    assert r.calls[0][1] == {"capture_output": True, "text": True, "timeout": 60}
    run({"*": (1, "", "Traceback\n  File x\nImportError: the last line\n")})
    assert pf.check_patches(_plan()) == ["could not read the patch status: ImportError: the last line"]


def test_the_attention_body_named_for_sm120():
    # the split bodies for sm_120 (docs/attention.md): tiled, flat, reg, wspec; the warpgroup-MMA ones are Hopper's
    assert pf.check_attention_arch({"DSV4_SM120_ATTN_CONFIG": "impl=reg"}) == []
    assert pf.check_attention_arch({}) == []
    assert pf.check_attention_arch({"DSV4_SM120_ATTN_CONFIG": "impl=wgmma"}) == [
        "DSV4_SM120_ATTN_CONFIG='impl=wgmma' names impl=wgmma, which runs on sm_90 only, and the servers' GPUs are "
        "sm_120: remove impl=wgmma (or name one of tiled, flat, reg, wspec)"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_one_server_hosts_get_the_allocator_and_model_checks(monkeypatch, role):
    from dsv4_sm120 import model_config

    bad = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert len(pf.check_alloc_conf(_plan(roles=(role,)), bad)) == 1
    assert pf.check_alloc_conf(_plan(roles=("router",)), bad) == []
    monkeypatch.setattr(pf, "check_model", lambda plan: [])
    monkeypatch.setattr(model_config, "read", lambda path: types.SimpleNamespace(warnings=lambda: ["unknown id"]))
    assert pf.check_model_notes(_plan(roles=(role,))) == ([], ["unknown id"])
    assert pf.check_model_notes(_plan(roles=("router",))) == ([], [])
    monkeypatch.setattr(pf, "check_model", lambda plan: ["no weights"])
    assert pf.check_model_notes(_plan(roles=(role,))) == (["no weights"], [])


def test_the_p2p_notes_when_it_does_not_run_and_a_start_asks_no_nvidia_smi(monkeypatch):
    seen = []
    monkeypatch.setattr(pf, "ipc_unverified", lambda plan, why: seen.append(plan) or [f"IPC server: {why}"])
    monkeypatch.setattr(pf, "check_overlay_env", lambda plan: [])
    monkeypatch.setattr(pf, "check_python", lambda plan: [])
    monkeypatch.setattr(pf, "calibrate_first", lambda plan, say: [])
    monkeypatch.setattr(pf, "smi_problem", lambda plan: (_ for _ in ()).throw(AssertionError("a start asks smi")))
    _runners(monkeypatch, {})
    said = []
    p = _plan(PREFLIGHT_SKIP="p2p,ucx")
    assert pf.run_preflight(p, said.append) == [] and seen == [p]
    assert said[said.index("preflight p2p: skipped") + 1] == "preflight p2p: IPC server: not verified (the p2p check " \
                                                              "is skipped)"
    assert said[-2:] == ["preflight router: ok", "preflight profile: ok"] and "preflight ucx: skipped" in said
    _runners(monkeypatch, {"gpu": ["no gpu"]})
    said.clear()
    pf.run_preflight(_plan(), said.append)
    assert said[said.index("preflight p2p: not run (needs the gpu check, which failed)") + 1] == (
        "preflight p2p: IPC server: not verified (needs the gpu check, which failed)")
    monkeypatch.setattr(pf, "smi_problem", lambda plan: None)
    _runners(monkeypatch, {})
    said.clear()
    pf.run_dry_checks(_plan(), said.append)
    assert said[said.index("preflight p2p: not run (dry run: copies between the GPUs)") + 1] == (
        "preflight p2p: IPC server: a start's p2p check verifies it (the server runs NCCL where it is missing)")
    assert [x for x in said if "IPC server" in x and not x.startswith("preflight p2p: ")] == []


def test_table_and_profile_edges(run, monkeypatch):
    gpus = {0: {"name": "G", "cc": "12.0", "total_mib": 10240, "free_mib": 5120}}
    # a missing GPU does not stop the rows after it; the GiB shown are MiB / 1024
    assert pf.check_gpus_table(gpus, [("prefill", [7, 0], 0.9)]) == [
        "prefill: GPU 7 not found (nvidia-smi lists 1 GPU(s): 0)",
        "prefill: GPU 0 has 5.0 GiB free of 10.0 GiB; mem fraction 0.9 needs 9.0 GiB (another process is using it?)"]
    r = run({"/opt/smi": (0, "0, NVIDIA RTX PRO 6000, Blackwell\n", "")})
    assert pf.server_gpu_names(_plan())[0] == {"NVIDIA RTX PRO 6000, Blackwell": "prefill GPU 0"}
    assert r.calls
    assert pf.interpret_profile_status([{"gpu": "Z", "usable": True, "path": "/p"}], {}) == [
        "machine profile /p applies to Z ()"]
    assert pf.interpret_profile_status([{"gpu": "Z", "usable": False}], {})[0].startswith(
        "WARNING: no matching machine profile for Z (): no reason given;")
    monkeypatch.setattr(pf, "server_gpu_names", lambda plan: ({"G": "decode GPU 2"}, None))
    run({"*": (1, "", "first\nsecond\nthe last\n")})
    assert pf.check_profile(_plan()) == ([], ["WARNING: could not check the machine profile: the last"])


def test_a_bind_error_without_an_errno_still_counts_as_busy(monkeypatch):
    class Sock:
        def __init__(self, *a):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def setsockopt(self, *a):
            pass

        def bind(self, addr):
            raise OSError("refused, no errno")

    monkeypatch.setattr(socket, "socket", Sock)
    assert pf.bind_problem("127.0.0.1", 1) == -1 and pf.port_in_use("127.0.0.1", 1)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_one_server_hosts_get_the_python_and_model_checks(run, monkeypatch, tmp_path, role):
    from dsv4_sm120 import model_config

    py = tmp_path / "python"
    py.write_text("#!/bin/sh\n")
    py.chmod(0o755)
    r = run({str(py): (3, "", "")})
    assert pf.check_python(_plan(roles=(role,), python=str(py))) == [
        f"sglang is not installed in {py}: run `make setup`"]
    assert r.calls[0][1] == {"capture_output": True, "text": True, "timeout": 60}
    assert pf.check_python(_plan(roles=("router",), python=str(py))) == [] and len(r.calls) == 1
    # the model: a local directory without weights is a failure (not for stand-ins); shard problems are capped
    (tmp_path / "m").mkdir()
    mc = types.SimpleNamespace(problems=lambda: [], where="local", directory=tmp_path / "m")
    monkeypatch.setattr(model_config, "read", lambda path: mc)
    assert pf.check_model(_plan(roles=(role,), MODEL_PATH="/m")) == [
        "MODEL_PATH=/m: no *.safetensors weights in the directory"]
    assert pf.check_model(_plan(roles=(role,), standin=True, MODEL_PATH="/m")) == []
    assert pf.check_model(_plan(roles=("router",), MODEL_PATH="/m")) == []
    (tmp_path / "m" / "a.safetensors").write_bytes(b"")
    asked = []
    monkeypatch.setattr(pf, "scan_checkpoint", lambda path, **kw: asked.append(kw) or (None, ["shard a: empty"]))
    assert pf.check_model(_plan(roles=(role,), MODEL_PATH="/m")) == ["MODEL_PATH=/m: shard a: empty"]
    assert asked == [{"max_problems": 5}]


def test_a_plan_without_a_skip_setting_skips_nothing():
    p = _plan()
    del p.settings["PREFLIGHT_SKIP"]
    assert pf.skipped_checks(p) == []
    p.standin = True
    assert pf.skipped_checks(p) == ["gpu", "memory", "patches", "nixl", "p2p", "ucx"]
