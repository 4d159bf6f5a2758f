"""The serve plan (``dsv4_sm120.serving.plan``) called in this process: ``build_plan`` over many environments and
its helpers one by one, each result checked against values written out here from docs/serving.md's variable table,
the serve scripts' documented behaviour and SGLang's / sglang_router's flags (never computed by the plan itself).

The dry-run tests (tests/test_serve_dryrun.py and friends) check the same plan through the serve scripts in a child
process; this file is what ``make mutate`` sees (scripts/mutate_targets.txt). No network, no GPU: nvidia-smi is a
fake script or absent, the machine profiles an empty directory."""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "overlay"))
sys.path.insert(0, str(REPO / "tests"))
from pcie_box import make_smi, make_sysfs  # noqa: E402

from dsv4_sm120 import machine_profile as mp  # noqa: E402
from dsv4_sm120.serving import plan as P  # noqa: E402
from dsv4_sm120.serving import profile_choices  # noqa: E402
from dsv4_sm120.serving.plan import ConfigError, Plan, Proc, build_plan  # noqa: E402

PY = "/opt/venv/bin/python"
FP8_LIST = "auto, deep_gemm, flashinfer_trtllm, flashinfer_cutlass, flashinfer_deepgemm, flashinfer_cutedsl, cutlass, " \
           "triton, aiter"
NO_GPU_FP8 = "SGLang default (no GPU name from nvidia-smi, so no tuning summary applies)"
NO_GPU_MOE = "SGLang default (no GPU name from nvidia-smi, so no machine profile applies)"
# serve/env/*.env, in file order (10-nccl, 20-nixl, 30-sm120)
SERVE_ENV = [("CUDA_DEVICE_ORDER", "PCI_BUS_ID", "10-nccl.env"), ("NCCL_DEBUG", "WARN", "10-nccl.env"),
             ("SGLANG_DISAGGREGATION_NIXL_BACKEND", "UCX", "20-nixl.env"), ("UCX_MEMTYPE_CACHE", "n", "20-nixl.env"),
             ("PYTHONUNBUFFERED", "1", "30-sm120.env")]
HEAD = [PY, "-m", "sglang.launch_server", "--model-path", "deepseek-ai/DeepSeek-V4-Flash", "--context-length", "65536",
        "--disaggregation-transfer-backend", "nixl"]


@pytest.fixture(autouse=True)
def clean_process(tmp_path, monkeypatch):
    """The process environment the plan (and what it asks) reads besides its ``environ``: no FP8 override, an
    empty machine-profile directory, no profiler directory, no repo-root override."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "process-hf-home"))      # the caller's environ names its own
    for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "DSV4_SM120_FP8_GEMM_BACKEND", "SGLANG_TORCH_PROFILER_DIR",
              "DSV4_SM120_REPO_ROOT",
              "DSV4_SM120_SERVE_SYSFS_ROOT", "NCCL_PROTO", "NCCL_ALGO", "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE",
              "SGLANG_PCIE_IPC_MAX_NUMEL", "NCCL_P2P_DISABLE"):
        monkeypatch.delenv(k, raising=False)
    prof = tmp_path / "profiles"
    prof.mkdir()
    monkeypatch.setenv("DSV4_SM120_PROFILE_DIR", str(prof))
    mp.clear_cache()
    yield
    mp.clear_cache()


def env_for(tmp_path, **kv):
    env = {"VENV": "/opt/venv", "RUN_DIR": str(tmp_path / "run"), "NVIDIA_SMI": "/nonexistent/nvidia-smi",
           "HF_HOME": "/nonexistent/dsv4-hf-home", "DSV4_SM120_SERVE_SYSFS_ROOT": str(tmp_path / "nosysfs")}
    env.update(kv)
    return env


def plan(tmp_path, variant="base", now=0.0, **kv) -> Plan:
    return build_plan(env_for(tmp_path, **kv), variant, now=now)


def refused(tmp_path, variant="base", **kv) -> str:
    with pytest.raises(ConfigError) as e:
        plan(tmp_path, variant, **kv)
    return str(e.value)


def by_name(p: Plan):
    return {x.label: x for x in p.procs}


def flag(argv, name):
    """The value after the last ``name`` in argv (None: absent)."""
    idx = [i for i, t in enumerate(argv) if t == name]
    return argv[idx[-1] + 1] if idx else None


def naming_smi(tmp_path, table=False) -> str:
    """An nvidia-smi that names GPU i ``Fake GPU i`` for ``-i i`` queries (``table``: also in the index,name
    table of all eight), fails every other query, and logs its arguments to calls.log."""
    d = tmp_path / "smi"
    d.mkdir(exist_ok=True)
    p = d / "nvidia-smi"
    rows = "".join(f"{i}, Fake GPU {i}\\n" for i in range(8))
    p.write_text("#!/bin/sh\n"
                 f"echo \"$*\" >> {d}/calls.log\n"
                 "case \"$*\" in\n"
                 "  '--query-gpu=name --format=csv,noheader -i '*) echo \"Fake GPU $4\"; exit 0;;\n"
                 + (f"  '--query-gpu=index,name --format=csv,noheader') printf '{rows}'; exit 0;;\n" if table else "")
                 + "esac\nexit 1\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(p)


def smi_calls(smi: str):
    f = Path(smi).parent / "calls.log"
    return f.read_text().splitlines() if f.exists() else []


def script(tmp_path, name, body) -> str:
    p = tmp_path / name
    p.write_text("#!/bin/sh\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(p)


# ---------------------------------------------------------------- the default deployment, exactly


def test_default_plan_is_the_documented_deployment(tmp_path):
    run = tmp_path / "run"
    p = plan(tmp_path)
    assert p.variant == "base" and p.python == PY and p.run_dir == str(run) and p.repo == str(REPO)
    assert p.roles == ["prefill", "decode", "router"] and p.standin is False
    assert [x.name for x in p.procs] == ["prefill", "decode", "router"]
    assert [x.role for x in p.procs] == ["prefill", "decode", "router"]
    pre, dec, rou = p.procs
    assert pre.argv == HEAD + ["--tp", "4", "--host", "127.0.0.1", "--port", "30100", "--disaggregation-mode", "prefill",
                               "--disaggregation-bootstrap-port", "8998", "--mem-fraction-static", "0.85"]
    assert dec.argv == HEAD + ["--tp", "4", "--host", "127.0.0.1", "--port", "30200", "--disaggregation-mode", "decode",
                               "--mem-fraction-static", "0.85", "--max-running-requests", "16",
                               "--cuda-graph-max-bs-decode", "16"]
    assert rou.argv == [PY, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                        "--prefill", "http://127.0.0.1:30100", "8998", "--decode", "http://127.0.0.1:30200",
                        "--host", "127.0.0.1", "--port", "30000", "--prometheus-host", "127.0.0.1",
                        "--prometheus-port", "29000", "--log-level", "info", "--shutdown-grace-period-secs", "5"]
    assert pre.gpus == [0, 1, 2, 3] and dec.gpus == [4, 5, 6, 7] and rou.gpus == []
    assert pre.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and dec.env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert pre.env["SGLANG_TORCH_PROFILER_DIR"] == str(run / "profile") == dec.env["SGLANG_TORCH_PROFILER_DIR"]
    assert pre.env["UCX_NET_DEVICES"] == "lo" and dec.env["UCX_NET_DEVICES"] == "lo"
    assert "SGLANG_HOST_IP" not in pre.env and "SGLANG_HOST_IP" not in dec.env
    assert rou.env == {} and rou.unset == [] and rou.allreduce == "" and rou.numa == {}
    assert pre.binds == [("127.0.0.1", 30100, "prefill HTTP"), ("127.0.0.1", 8998, "prefill bootstrap")]
    assert dec.binds == [("127.0.0.1", 30200, "decode HTTP")]
    assert rou.binds == [("127.0.0.1", 30000, "router HTTP"), ("127.0.0.1", 29000, "router metrics")]
    assert [x.health_url for x in p.procs] == ["http://127.0.0.1:30100/health", "http://127.0.0.1:30200/health",
                                                "http://127.0.0.1:30000/health"]
    assert [x.log for x in p.procs] == [str(run / "prefill.log"), str(run / "decode.log"), str(run / "router.log")]
    assert p.urls == {"router": "http://127.0.0.1:30000", "prefill": "http://127.0.0.1:30100",
                      "decode": "http://127.0.0.1:30200"}
    assert p.remote_health == {}
    assert p.common_env == SERVE_ENV
    assert p.fp8_reason == NO_GPU_FP8 and p.moe_reason == NO_GPU_MOE and p.spec_reason == ""
    assert p.calibrate_argv == [] and p.calibrate_env == {}
    assert p.shape_reason.startswith("the default layout 0,1,2,3 / 4,5,6,7 (")
    # the settings: every serve variable's text, the defaults where unset
    assert p.settings["PREFILL_PORT"] == "30100" and p.settings["NODE_ROLE"] == "all"
    assert p.settings["MODEL_PATH"] == "deepseek-ai/DeepSeek-V4-Flash" and p.settings["SERVED_MODEL_NAME"] == ""
    assert p.value("MAX_RUNNING") == 16 and p.value("DECODE_GPUS") == [[4, 5, 6, 7]]
    assert p.value("MEM_FRACTION") == 0.85 and p.value("NODE_ROLE") == ["prefill", "decode", "router"]
    # the all-reduce environment without a profile: decode keeps LL / Ring, prefill forces nothing
    assert dec.env["NCCL_PROTO"] == "LL" and dec.env["NCCL_ALGO"] == "Ring"
    assert "NCCL_PROTO" not in pre.env and "NCCL_ALGO" not in pre.env
    assert set(pre.unset) == {"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", "SGLANG_PCIE_IPC_MAX_NUMEL", "NCCL_PROTO",
                              "NCCL_ALGO"}
    assert set(dec.unset) == {"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", "SGLANG_PCIE_IPC_MAX_NUMEL"}
    assert pre.allreduce.startswith("default: ") and dec.allreduce.startswith("default: NCCL_PROTO=LL NCCL_ALGO=Ring")
    # no NUMA information without nvidia-smi: unbound, no --numa-node
    assert pre.numa["node"] is None and pre.numa["text"].startswith("unbound") and "--numa-node" not in pre.argv
    assert dec.numa["gpus"] == [4, 5, 6, 7] and dec.numa["role"] == "decode"


def test_labels_names_and_the_json_round_trip(tmp_path):
    assert Proc("decode", [], {}, "", []).label == "decode"
    assert Proc("decode", [], {}, "", [], name="decode2").label == "decode2"
    p = plan(tmp_path, PREFILL_GPUS="0,1;2,3")
    text = p.to_json()
    assert text.startswith('{\n  "calibrate_argv": []')          # sorted keys, indent 2
    raw = json.loads(text)
    assert raw["procs"][0]["binds"][0] == ["127.0.0.1", 30100, "prefill1 HTTP"]
    back = Plan.from_json(text)
    assert back == p
    assert back.procs[1].binds == [("127.0.0.1", 30101, "prefill2 HTTP"), ("127.0.0.1", 8999, "prefill2 bootstrap")]
    assert isinstance(back.procs[0], Proc) and back.procs[0].label == "prefill1"
    assert back.common_env[0] == ("CUDA_DEVICE_ORDER", "PCI_BUS_ID", "10-nccl.env")
    assert isinstance(back.common_env[0], tuple) and isinstance(back.procs[2].binds[0], tuple)


# ---------------------------------------------------------------- variants


def test_unknown_variants_are_refused(tmp_path):
    for bad in ("foo", "MTP", "", "Base"):
        with pytest.raises(ConfigError) as e:
            build_plan(env_for(tmp_path), bad)
        assert str(e.value) == f"unknown variant {bad!r}"


def test_mtp_variant_adds_the_speculative_flags_and_metrics(tmp_path):
    p = plan(tmp_path, "mtp")
    spec = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", "4", "--enable-metrics"]
    pre, dec, rou = p.procs
    assert p.variant == "mtp"
    assert pre.argv[-len(spec):] == spec and dec.argv[-len(spec):] == spec
    assert "--enable-metrics" not in rou.argv and "--speculative-algorithm" not in rou.argv
    assert p.spec_reason.startswith("EAGLE chosen from the published config.json")
    assert str(tmp_path / "run") == p.run_dir
    p = plan(tmp_path, "mtp", SPEC_NUM_STEPS="2", SERVER_EXTRA_ARGS="--log-level debug")
    assert p.procs[1].argv[-9:] == ["--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
                                    "--speculative-num-draft-tokens", "3", "--enable-metrics", "--log-level", "debug"]
    base = plan(tmp_path, "base")
    assert not any(t.startswith("--speculative") or t == "--enable-metrics" for x in base.procs for t in x.argv)


def test_mtp_problems_are_config_errors(tmp_path):
    assert refused(tmp_path, "mtp", SPEC_EAGLE_TOPK="2") == \
        "SPEC_EAGLE_TOPK=2: DeepSeek-V4 speculation in SGLang 0.5.23 supports topk 1 only"
    msg = refused(tmp_path, "mtp", SPEC_ALGORITHM="dspark")
    assert msg.startswith("SPEC_ALGORITHM=dspark: MODEL_PATH=deepseek-ai/DeepSeek-V4-Flash carries no DSpark head")
    # the base variant reads no SPEC_* variable beyond its range check
    assert plan(tmp_path, "base", SPEC_EAGLE_TOPK="2").spec_reason == ""


# ---------------------------------------------------------------- settings


def test_settings_from_env_empty_means_default_except_model_path():
    s = P.settings_from_env({"PREFILL_PORT": "", "MAX_RUNNING": "32", "UNRELATED": "x"})
    assert s["PREFILL_PORT"] == "30100" and s["MAX_RUNNING"] == "32" and "UNRELATED" not in s
    assert s["MODEL_PATH"] == "deepseek-ai/DeepSeek-V4-Flash" and s["SERVED_MODEL_NAME"] == ""
    assert set(s) == set(P.VARIABLES)
    assert P.settings_from_env({"MODEL_PATH": ""})["MODEL_PATH"] == ""
    assert P.settings_from_env({"MODEL_PATH": "/m"})["MODEL_PATH"] == "/m"
    assert P.settings_from_env({"DECODE_GPUS": ""})["DECODE_GPUS"] == "4,5,6,7"


def test_typed_settings_parse_and_name_the_variable():
    v = P.typed_settings(P.settings_from_env({"DECODE_GPUS": "4,5;6,7", "NODE_ROLE": "decode,prefill",
                                              "SERVER_EXTRA_ARGS": "--a 'b c'", "PREFILL_MEM_FRACTION": "0.5"}))
    assert v["DECODE_GPUS"] == [[4, 5], [6, 7]] and v["PREFILL_GPUS"] == [[0, 1, 2, 3]]
    assert v["NODE_ROLE"] == ["prefill", "decode"] and v["SERVER_EXTRA_ARGS"] == ["--a", "b c"]
    assert v["PREFILL_MEM_FRACTION"] == 0.5 and v["DECODE_MEM_FRACTION"] is None and v["PREFILL_PORT"] == 30100
    with pytest.raises(ConfigError) as e:
        P.typed_settings(P.settings_from_env({"ROUTER_PORT": "70000"}))
    assert str(e.value) == "ROUTER_PORT='70000' is out of range: expected 1..65535"


BAD = [
    (dict(PREFILL_GPUS="0,0"), "PREFILL_GPUS='0,0' is not valid: it lists a GPU twice"),
    (dict(DECODE_GPUS="4,5,6"), "DECODE_GPUS='4,5,6' is not valid: TP size 3 does not divide DeepSeek-V4's 64 heads "
                                "evenly in SGLang (use 1, 2, 4 or 8 GPUs)"),
    (dict(PREFILL_GPUS="-1"), "PREFILL_GPUS='-1' is not valid: expected a comma list of GPU indices, e.g. 0,1,2,3"),
    (dict(PREFILL_GPUS="0;1,2"), "PREFILL_GPUS='0;1,2' is not valid: the groups have different sizes (1, 2 GPUs): "
                                 "replicas of one server run one TP size"),
    (dict(PREFILL_GPUS="0,1", DECODE_GPUS="1,2"), "PREFILL_GPUS=0,1 and DECODE_GPUS=1,2 share GPUs [1] on this host"),
    (dict(PREFILL_GPUS="3,0;5,6", DECODE_GPUS="6,5;0,3"),
     "PREFILL_GPUS=3,0;5,6 and DECODE_GPUS=6,5;0,3 share GPUs [0, 3, 5, 6] on this host"),
    (dict(PREFILL_PORT="0"), "PREFILL_PORT='0' is out of range: expected 1..65535"),
    (dict(BOOTSTRAP_PORT="65536"), "BOOTSTRAP_PORT='65536' is out of range: expected 1..65535"),
    (dict(DECODE_PORT="abc"), "DECODE_PORT='abc' is not valid: expected an integer"),
    (dict(MEM_FRACTION="1"), "MEM_FRACTION='1' is out of range: expected > 0, <= 0.99"),
    (dict(DECODE_MEM_FRACTION="0"), "DECODE_MEM_FRACTION='0' is out of range: expected > 0, <= 0.99"),
    (dict(CONTEXT_LEN="100"), "CONTEXT_LEN='100' is out of range: expected 256..2097152"),
    (dict(NODE_ROLE="bogus"), "NODE_ROLE='bogus' is not valid: unknown role 'bogus' (use all, or a comma list of "
                              "prefill, decode, router)"),
    (dict(FP8_GEMM_BACKEND="bogus"), f"FP8_GEMM_BACKEND='bogus' is not valid: expected one of {FP8_LIST}"),
    (dict(SERVER_EXTRA_ARGS="'unclosed"), "SERVER_EXTRA_ARGS=\"'unclosed\" is not valid: cannot split it as shell "
                                          "words (No closing quotation)"),
    (dict(MODEL_PATH=""), "MODEL_PATH is set but empty: unset it for the default (deepseek-ai/DeepSeek-V4-Flash) or "
                          "set it to a directory, or a Hugging Face id (org/name)"),
    (dict(SERVER_EXTRA_ARGS="--tp 2"), "SERVER_EXTRA_ARGS passes --tp, an abbreviation of --tp-size (the parser "
                                       "expands unique prefixes), which the plan sets from PREFILL_GPUS / DECODE_GPUS "
                                       "(TP = their count): set that instead (docs/serving.md, \"Variables\")"),
    (dict(DECODE_EXTRA_ARGS="--max-running-requests=4"),
     "DECODE_EXTRA_ARGS passes --max-running-requests, which the plan sets from MAX_RUNNING: set that instead "
     "(docs/serving.md, \"Variables\")"),
]


@pytest.mark.parametrize("kv,msg", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_values_are_one_line_naming_the_variable(tmp_path, kv, msg):
    assert refused(tmp_path, **kv) == msg


def test_a_speculative_flag_in_extra_args_is_the_users_in_base_only(tmp_path):
    p = plan(tmp_path, "base", DECODE_EXTRA_ARGS="--speculative-num-steps 2")
    assert p.procs[1].argv[-2:] == ["--speculative-num-steps", "2"]
    assert refused(tmp_path, "mtp", DECODE_EXTRA_ARGS="--speculative-num-steps 2") == \
        ("DECODE_EXTRA_ARGS passes --speculative-num-steps, which the plan sets from SPEC_NUM_STEPS: set that instead "
         "(docs/serving.md, \"Variables\")")


def test_shared_gpus_are_fine_when_one_role_runs_here(tmp_path):
    p = plan(tmp_path, NODE_ROLE="prefill", PREFILL_GPUS="0,1", DECODE_GPUS="1,2")
    assert [x.name for x in p.procs] == ["prefill"] and p.procs[0].gpus == [0, 1]
    p = plan(tmp_path, NODE_ROLE="decode,router", PREFILL_GPUS="0,1", DECODE_GPUS="1,2")
    assert [x.name for x in p.procs] == ["decode", "router"] and p.procs[0].gpus == [1, 2]


# ---------------------------------------------------------------- helpers one by one


def test_parse_groups_and_gpus():
    assert P.parse_groups("DECODE_GPUS", "4,5;6,7") == [[4, 5], [6, 7]]
    assert P.parse_groups("PREFILL_GPUS", " 3 , 1 ") == [[3, 1]]
    assert P.parse_gpus("DECODE_GPUS", "6,7;4,5") == [6, 7]
    assert P.parse_gpus("PREFILL_GPUS", "2") == [2]
    for key, text, why in [("PREFILL_GPUS", "", "expected a comma list of GPU indices, e.g. 0,1,2,3"),
                           ("DECODE_GPUS", "0,1;1,2", "GPU 1 is in two groups (each server needs its own GPUs)"),
                           ("DECODE_GPUS", "4,5;x", "group 2 ('x'): expected a comma list of GPU indices, e.g. "
                                                    "0,1,2,3")]:
        with pytest.raises(ConfigError) as e:
            P.parse_groups(key, text)
        assert str(e.value) == f"{key}={text!r} is not valid: {why}"
        with pytest.raises(ConfigError) as e:
            P.parse_gpus(key, text)
        assert str(e.value) == f"{key}={text!r} is not valid: {why}"


def test_replica_names():
    assert P.replica_names("decode", 1) == ["decode"]
    assert P.replica_names("prefill", 2) == ["prefill1", "prefill2"]
    assert P.replica_names("decode", 3) == ["decode1", "decode2", "decode3"]
    assert P.replica_names("decode", 0) == []


def test_port_variable():
    assert P.port_variable("prefill HTTP") == "PREFILL_PORT"
    assert P.port_variable("prefill2 HTTP") == "PREFILL_PORT"
    assert P.port_variable("prefill12 bootstrap") == "BOOTSTRAP_PORT"
    assert P.port_variable("decode HTTP") == "DECODE_PORT"
    assert P.port_variable("decode3 HTTP") == "DECODE_PORT"
    assert P.port_variable("router HTTP") == "ROUTER_PORT"
    assert P.port_variable("router metrics") == "ROUTER_PROMETHEUS_PORT"
    for other in ("router", "", "prefill HTTPS", "decode bootstrap", "proxy HTTP", "prefillX HTTP", "Xdecode HTTP"):
        assert P.port_variable(other) == "the port's variable"


def test_user_moe_flag():
    none = {"SERVER_EXTRA_ARGS": [], "PREFILL_EXTRA_ARGS": [], "DECODE_EXTRA_ARGS": []}
    assert P.user_moe_flag(none) is None
    assert P.user_moe_flag(dict(none, DECODE_EXTRA_ARGS=["--moe-runner-backend", "marlin"])) == "DECODE_EXTRA_ARGS"
    assert P.user_moe_flag(dict(none, PREFILL_EXTRA_ARGS=["--moe-runner-backend=marlin"])) == "PREFILL_EXTRA_ARGS"
    both = dict(none, SERVER_EXTRA_ARGS=["--x", "--moe-runner-backend=a"], PREFILL_EXTRA_ARGS=["--moe-runner-backend"])
    assert P.user_moe_flag(both) == "SERVER_EXTRA_ARGS"
    assert P.user_moe_flag(dict(none, PREFILL_EXTRA_ARGS=["--moe-runner-backend"],
                                DECODE_EXTRA_ARGS=["--moe-runner-backend"])) == "PREFILL_EXTRA_ARGS"
    for near in (["--moe-runner-backends", "x"], ["--moe-runner"], ["moe-runner-backend"], ["x--moe-runner-backend"]):
        assert P.user_moe_flag(dict(none, SERVER_EXTRA_ARGS=near)) is None, near


def test_gpu_name_asks_nvidia_smi_for_one_index(tmp_path):
    echo = script(tmp_path, "echo-smi", 'echo "$*"\n')
    assert P.gpu_name(echo, 3) == "--query-gpu=name --format=csv,noheader -i 3"
    two = script(tmp_path, "two", 'printf "  NVIDIA H200  \\nsecond\\n"\n')
    assert P.gpu_name(two, 0) == "NVIDIA H200"
    assert P.gpu_name(script(tmp_path, "lead", 'printf "\\n\\n  NVIDIA B\\n"\n'), 0) == "NVIDIA B"
    assert P.gpu_name(script(tmp_path, "fail", 'echo "NVIDIA X"; exit 3\n'), 0) is None
    assert P.gpu_name(script(tmp_path, "empty", 'printf "  \\n"\n'), 0) is None
    assert P.gpu_name(script(tmp_path, "silent", "exit 0\n"), 0) is None
    assert P.gpu_name(str(tmp_path / "missing-smi"), 0) is None
    noexec = tmp_path / "noexec"
    noexec.write_text("echo x\n")
    assert P.gpu_name(str(noexec), 0) is None
    assert P.gpu_name(str(tmp_path), 0) is None            # a directory


def write_summary(repo: Path, device: str, backend, reason="triton measured faster", complete=True):
    d = repo / "configs" / "fp8"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"summary_{device.replace(' ', '_')}.json").write_text(json.dumps(
        {"decision": {"recommended_backend": backend, "reason": reason},
         "shapes": {"N=1,K=1": {"complete": complete}}}))


def test_fp8_gemm_backend_explicit_auto_and_the_tuner_summary(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    assert P.fp8_gemm_backend("cutlass", repo, None) == ("cutlass", "FP8_GEMM_BACKEND=cutlass")
    assert P.fp8_gemm_backend(" Triton ", repo, "NVIDIA H200") == ("triton", "FP8_GEMM_BACKEND=triton")
    with pytest.raises(ConfigError) as e:
        P.fp8_gemm_backend("bogus", repo, None)
    assert str(e.value) == f"FP8_GEMM_BACKEND='bogus': expected one of {FP8_LIST}"
    for auto in ("auto", "", None, " AUTO ", "   ", "\t"):   # blank is the table's default, auto
        assert P.fp8_gemm_backend(auto, repo, None) == (None, NO_GPU_FP8)
    assert P.fp8_gemm_backend("auto", repo, "Fake GPU") == \
        (None, "SGLang default: no FP8 tuning summary for Fake_GPU (run `make tune-fp8`)")
    write_summary(repo, "Fake GPU", "triton")
    assert P.fp8_gemm_backend("auto", repo, "Fake GPU") == ("triton", "triton: triton measured faster")
    write_summary(repo, "Other GPU", None, reason="deep_gemm wins")
    assert P.fp8_gemm_backend("", repo, "Other GPU") == (None, "SGLang default: deep_gemm wins")
    # the overlay's own override applies even without a GPU name; blank is no override
    monkeypatch.setenv("DSV4_SM120_FP8_GEMM_BACKEND", "cutlass")
    assert P.fp8_gemm_backend("auto", repo, None) == ("cutlass", "cutlass: DSV4_SM120_FP8_GEMM_BACKEND=cutlass")
    monkeypatch.setenv("DSV4_SM120_FP8_GEMM_BACKEND", "default")
    assert P.fp8_gemm_backend("auto", repo, None) == \
        (None, "SGLang default: DSV4_SM120_FP8_GEMM_BACKEND=default: SGLang's default backend")
    monkeypatch.setenv("DSV4_SM120_FP8_GEMM_BACKEND", "   ")
    assert P.fp8_gemm_backend("auto", repo, None) == (None, NO_GPU_FP8)
    monkeypatch.setenv("DSV4_SM120_FP8_GEMM_BACKEND", "warp_speed")
    with pytest.raises(ConfigError) as e:
        P.fp8_gemm_backend("auto", repo, "Fake GPU")
    assert str(e.value) == (f"FP8 backend 'warp_speed' (DSV4_SM120_FP8_GEMM_BACKEND=warp_speed) is not one of "
                            f"{FP8_LIST}")
    # an explicit setting is passed as is, the override notwithstanding
    assert P.fp8_gemm_backend("deep_gemm", repo, "Fake GPU") == ("deep_gemm", "FP8_GEMM_BACKEND=deep_gemm")


def test_fp8_gemm_backend_keeps_the_profile_loggers_level(tmp_path):
    log = logging.getLogger("dsv4_sm120.machine_profile")
    old = log.level
    try:
        log.setLevel(logging.INFO)
        P.fp8_gemm_backend("auto", tmp_path, "Fake GPU")
        assert log.level == logging.INFO
        log.setLevel(logging.DEBUG)
        with pytest.raises(ConfigError):
            P.fp8_gemm_backend("bogus", tmp_path, "Fake GPU")
        assert log.level == logging.DEBUG
    finally:
        log.setLevel(old)


def test_fp8_gemm_backend_silences_the_profile_lookup(tmp_path, caplog):
    """A profile for the GPU that does not apply (other versions): the lookup would log why at WARNING; the FP8
    choice runs it with that logger at ERROR (the preflight's profile check says it)."""
    gpu = "Fake GPU"
    prof = {"schema": mp.SCHEMA, "gpu": gpu, "created_at": mp.now_iso(), "versions": dict(mp.running_versions(), sglang="0.0.1"),
            "deployment": {}, "decisions": {}}
    mp.save(prof, mp.profile_path(gpu, Path(os.environ["DSV4_SM120_PROFILE_DIR"])))
    mp.clear_cache()
    with caplog.at_level(logging.DEBUG):
        P.fp8_gemm_backend("auto", tmp_path, gpu)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("dsv4_sm120.machine_profile")
            and r.levelno < logging.ERROR] == []


def test_directory_problem(tmp_path):
    assert P.directory_problem(tmp_path) is None
    before = sorted(os.listdir(tmp_path))
    assert P.directory_problem(tmp_path / "a" / "b" / "c") is None
    assert sorted(os.listdir(tmp_path)) == before                   # the probe left nothing behind
    f = tmp_path / "file"
    f.write_text("x")
    assert P.directory_problem(f) == f"{f} is not a directory"
    assert P.directory_problem(f / "sub" / "dir") == f"{f} is a file, not a directory"
    assert P.directory_problem(Path("/proc/dsv4-nope/x")) == \
        "cannot create a directory in /proc (No such file or directory)"
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere")
    assert P.directory_problem(link) == f"{link} is not a directory"


def test_calibrate_command():
    s = P.settings_from_env({"CALIBRATE": "1", "MODEL_PATH": "/models/v4"})
    roles = ["prefill", "decode", "router"]
    assert P.calibrate_command(s, PY, roles, [0, 1], [6, 7]) == \
        ([PY, "-m", "dsv4_sm120.calibrate"], {"CUDA_VISIBLE_DEVICES": "6", "DECODE_GPUS": "6,7",
                                              "MODEL_PATH": "/models/v4"})
    assert P.calibrate_command(s, PY, ["prefill", "router"], [2, 3], [6, 7])[1] == \
        {"CUDA_VISIBLE_DEVICES": "2", "DECODE_GPUS": "2,3", "MODEL_PATH": "/models/v4"}
    assert P.calibrate_command(s, PY, ["router"], [2, 3], [6, 7]) == ([], {})
    off = P.settings_from_env({"CALIBRATE": "0"})
    assert P.calibrate_command(off, PY, roles, [0], [1]) == ([], {})
    assert P.calibrate_command(P.settings_from_env({}), PY, roles, [0], [1]) == ([], {})


# ---------------------------------------------------------------- the run directory


def test_run_directory_default_relative_and_home(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    p = plan(tmp_path, RUN_DIR="", LOG_DIR=str(logs), now=86400 * 365 + 3723)
    assert p.run_dir == str(logs / f"serve-base-19710101-010203-{os.getpid()}")
    assert p.procs[0].log == str(logs / f"serve-base-19710101-010203-{os.getpid()}" / "prefill.log")
    p = plan(tmp_path, "mtp", RUN_DIR="", LOG_DIR=str(logs), now=0)
    assert p.run_dir == str(logs / f"serve-mtp-19700101-000000-{os.getpid()}")
    t0 = time.time()
    p = build_plan(env_for(tmp_path, RUN_DIR="", LOG_DIR=str(logs)), "base")
    stamps = {time.strftime("%Y%m%d-%H%M%S", time.gmtime(t)) for t in (t0 - 1, t0, t0 + 1, t0 + 2)}
    assert Path(p.run_dir).parent == logs and Path(p.run_dir).name[len("serve-base-"):-len(f"-{os.getpid()}")] in stamps
    assert not logs.exists()                                         # nothing made
    # relative to the checkout, ~ expanded
    p = plan(tmp_path, RUN_DIR="logs/dsv4-unit-run-dir")
    assert p.run_dir == str(REPO / "logs" / "dsv4-unit-run-dir")
    p = plan(tmp_path, RUN_DIR="", LOG_DIR="logs")
    assert p.run_dir == str(REPO / "logs" / f"serve-base-19700101-000000-{os.getpid()}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    p = plan(tmp_path, RUN_DIR="~/r1")
    assert p.run_dir == str(tmp_path / "home" / "r1")
    p = plan(tmp_path, RUN_DIR="", LOG_DIR="~/lg")
    assert p.run_dir == str(tmp_path / "home" / "lg" / f"serve-base-19700101-000000-{os.getpid()}")


def test_run_directory_that_cannot_be_made(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    assert refused(tmp_path, RUN_DIR=str(f / "run")) == \
        f"RUN_DIR={f}/run: the run directory cannot go there ({f} is a file, not a directory); set RUN_DIR to a " \
        f"writable directory"
    assert refused(tmp_path, RUN_DIR="", LOG_DIR=str(f)) == \
        f"LOG_DIR={f}: the run directory cannot go there ({f} is not a directory); set LOG_DIR to a writable directory"
    # LOG_DIR is checked even with RUN_DIR set (LOG_DIR/latest goes there)
    assert refused(tmp_path, LOG_DIR=str(f / "logs")).startswith(f"LOG_DIR={f}/logs: the run directory cannot go")
    assert refused(tmp_path, RUN_DIR="/proc/dsv4-run") == \
        "RUN_DIR=/proc/dsv4-run: the run directory cannot go there (cannot create a directory in /proc (No such " \
        "file or directory)); set RUN_DIR to a writable directory"


# ---------------------------------------------------------------- the caller's environment


def test_callers_switches_are_listed_and_the_plans_own_are_not(tmp_path, monkeypatch):
    extra = {"SGLANG_FOO": "1", "NCCL_DEBUG": "INFO", "TORCH_NCCL_X": "2", "NIXL_A": "3", "UCX_TLS": "tcp",
             "DSV4_SM120_FP8_GEMM_BACKEND": "", "DSV4_SM120_DISABLE": "1", "CUDA_DEVICE_ORDER_X": "1", "XSGLANG_Y": "1", "PATH_X": "1",
             "SGLANG_TORCH_PROFILER_DIR": str(tmp_path / "prof"), "SGLANG_HOST_IP": "10.1.1.1",
             "DSV4_SM120_CACHE": "/c", "DSV4_SM120_VARIANT": "base", "DSV4_SM120_STANDIN_ROLE": "decode",
             "DSV4_SM120_SERVE_STANDIN": "0", "DSV4_SM120_REPO_ROOT": str(REPO), "NCCL_PROTO": "Simple"}
    p = plan(tmp_path, **extra)
    assert p.common_env == [("CUDA_DEVICE_ORDER", "PCI_BUS_ID", "10-nccl.env"), ("NCCL_DEBUG", "INFO", "environment"),
                            ("SGLANG_DISAGGREGATION_NIXL_BACKEND", "UCX", "20-nixl.env"),
                            ("UCX_MEMTYPE_CACHE", "n", "20-nixl.env"), ("PYTHONUNBUFFERED", "1", "30-sm120.env"),
                            ("DSV4_SM120_DISABLE", "1", "environment"), ("NCCL_PROTO", "Simple", "environment"),
                            ("NIXL_A", "3", "environment"), ("SGLANG_FOO", "1", "environment"),
                            ("TORCH_NCCL_X", "2", "environment"), ("UCX_TLS", "tcp", "environment")]
    pre, dec, _ = p.procs
    # the caller's profiler directory, your NCCL_PROTO reaching both servers' all-reduce choice
    assert pre.env["SGLANG_TORCH_PROFILER_DIR"] == str(tmp_path / "prof") == dec.env["SGLANG_TORCH_PROFILER_DIR"]
    assert pre.allreduce.startswith("env NCCL_PROTO=Simple (yours)") and \
        dec.allreduce.startswith("env NCCL_PROTO=Simple (yours)")
    assert "NCCL_PROTO" not in dec.env and "NCCL_PROTO" not in dec.unset
    assert "SGLANG_HOST_IP" not in pre.env                      # one host: no host IP, whatever the caller set
    assert P.not_listed("SGLANG_TORCH_PROFILER_DIR") and P.not_listed("SGLANG_HOST_IP")
    assert P.not_listed("DSV4_SM120_CACHE") and P.not_listed("DSV4_SM120_REPO_ROOT")
    assert P.not_listed("DSV4_SM120_STANDIN_ROLE") and P.not_listed("MAX_RUNNING")
    assert P.not_listed("DSV4_SM120_FP8_GEMM_BACKEND") and P.not_listed("DSV4_SM120_SERVE_POLL_S")
    assert not P.not_listed("SGLANG_FOO") and not P.not_listed("DSV4_SM120_DISABLE")
    assert not P.not_listed("DSV4_SM120_PROFILE_DIR") and not P.not_listed("DSV4_SM120_ATTN_WS_MB")
    assert not P.not_listed("NCCL_DEBUG")


def test_callers_ucx_devices_or_an_ib_device_keep_ucx_off_loopback(tmp_path):
    p = plan(tmp_path, UCX_NET_DEVICES="mlx5_0:1")
    assert ("UCX_NET_DEVICES", "mlx5_0:1", "environment") in p.common_env
    assert all("UCX_NET_DEVICES" not in x.env for x in p.procs)
    p = plan(tmp_path, IB_DEVICE="mlx5_1")
    for x in p.procs[:2]:
        assert "UCX_NET_DEVICES" not in x.env
        assert x.argv[9:11] == ["--disaggregation-ib-device", "mlx5_1"]
    assert "--disaggregation-ib-device" not in p.procs[2].argv
    p = plan(tmp_path, NODE_ROLE="prefill,router")
    assert p.procs[0].env["UCX_NET_DEVICES"] == "lo" and "UCX_NET_DEVICES" not in p.procs[1].env


# ---------------------------------------------------------------- server flags


def test_server_flags_from_the_variables(tmp_path):
    p = plan(tmp_path, SERVED_MODEL_NAME="dsv4", FP8_GEMM_BACKEND="cutlass", TRANSFER_BACKEND="mooncake",
             CONTEXT_LEN="4096", MEM_FRACTION="0.8", DECODE_MEM_FRACTION="0.7", PREFILL_MAX_RUNNING="8",
             CHUNKED_PREFILL_SIZE="2048", MAX_RUNNING="64", MODEL_PATH="org/other-model")
    pre, dec, _ = p.procs
    head = [PY, "-m", "sglang.launch_server", "--model-path", "org/other-model", "--context-length", "4096",
            "--disaggregation-transfer-backend", "mooncake", "--served-model-name", "dsv4",
            "--fp8-gemm-backend", "cutlass"]
    assert pre.argv == head + ["--tp", "4", "--host", "127.0.0.1", "--port", "30100", "--disaggregation-mode",
                               "prefill", "--disaggregation-bootstrap-port", "8998", "--mem-fraction-static", "0.8",
                               "--max-running-requests", "8", "--chunked-prefill-size", "2048"]
    assert dec.argv == head + ["--tp", "4", "--host", "127.0.0.1", "--port", "30200", "--disaggregation-mode",
                               "decode", "--mem-fraction-static", "0.7", "--max-running-requests", "64",
                               "--cuda-graph-max-bs-decode", "64"]
    assert p.fp8_reason == "FP8_GEMM_BACKEND=cutlass"
    p = plan(tmp_path, PREFILL_MEM_FRACTION="0.5", PREFILL_GPUS="0", DECODE_GPUS="1,2,3,4,5,6,7,0".replace(",0", ",8"))
    assert flag(p.procs[0].argv, "--mem-fraction-static") == "0.5" and flag(p.procs[0].argv, "--tp") == "1"
    assert flag(p.procs[1].argv, "--mem-fraction-static") == "0.85" and flag(p.procs[1].argv, "--tp") == "8"
    assert p.procs[1].env["CUDA_VISIBLE_DEVICES"] == "1,2,3,4,5,6,7,8"


def test_extra_args_come_after_the_plans_flags_in_order(tmp_path):
    p = plan(tmp_path, SERVER_EXTRA_ARGS="--log-level debug", PREFILL_EXTRA_ARGS="--page-size 64",
             DECODE_EXTRA_ARGS="--enable-foo 'a b'", ROUTER_EXTRA_ARGS="--policy random")
    pre, dec, rou = p.procs
    assert pre.argv[-4:] == ["--log-level", "debug", "--page-size", "64"]
    assert dec.argv[-4:] == ["--log-level", "debug", "--enable-foo", "a b"]
    assert rou.argv[-2:] == ["--policy", "random"]
    assert rou.argv.count("--log-level") == 1 and flag(rou.argv, "--log-level") == "info"
    assert "--page-size" not in dec.argv and "--enable-foo" not in pre.argv and "--page-size" not in rou.argv


def test_standin_servers(tmp_path):
    p = plan(tmp_path, DSV4_SM120_SERVE_STANDIN="1")
    assert p.standin is True
    assert p.procs[0].argv[:3] == [PY, "-m", "dsv4_sm120.serving.standin"]
    assert p.procs[1].argv[:5] == [PY, "-m", "dsv4_sm120.serving.standin", "--model-path",
                                   "deepseek-ai/DeepSeek-V4-Flash"]
    assert p.procs[2].argv[:3] == [PY, "-m", "sglang_router.launch_router"]


def test_venv_and_model_path_made_absolute(tmp_path, monkeypatch):
    p = plan(tmp_path, VENV="envs/serve")
    assert p.python == str(REPO / "envs" / "serve" / "bin" / "python")
    assert p.procs[0].argv[0] == p.python and p.procs[2].argv[0] == p.python
    monkeypatch.chdir(tmp_path)
    p = plan(tmp_path, MODEL_PATH="./ckpt")
    assert p.settings["MODEL_PATH"] == str(tmp_path / "ckpt")
    assert flag(p.procs[0].argv, "--model-path") == str(tmp_path / "ckpt")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "nvfp4").mkdir()
    p = plan(tmp_path, MODEL_PATH="out/nvfp4")
    assert flag(p.procs[1].argv, "--model-path") == str(tmp_path / "out" / "nvfp4")
    assert plan(tmp_path, MODEL_PATH="org/name").settings["MODEL_PATH"] == "org/name"


# ---------------------------------------------------------------- replicas, ports, hosts


def test_replicas_listen_on_the_roles_ports_plus_i(tmp_path):
    run = tmp_path / "run"
    p = plan(tmp_path, PREFILL_GPUS="0,1;2,3", DECODE_GPUS="4,5;6,7;8,9")
    names = [x.name for x in p.procs]
    assert names == ["prefill1", "prefill2", "decode1", "decode2", "decode3", "router"]
    x = by_name(p)
    assert x["prefill2"].binds == [("127.0.0.1", 30101, "prefill2 HTTP"), ("127.0.0.1", 8999, "prefill2 bootstrap")]
    assert x["decode3"].binds == [("127.0.0.1", 30202, "decode3 HTTP")]
    assert flag(x["prefill2"].argv, "--port") == "30101" and flag(x["prefill2"].argv, "--disaggregation-bootstrap-port") \
        == "8999"
    assert flag(x["decode2"].argv, "--port") == "30201" and flag(x["decode2"].argv, "--tp") == "2"
    assert x["decode3"].env["CUDA_VISIBLE_DEVICES"] == "8,9" and x["decode3"].gpus == [8, 9]
    assert x["prefill1"].env["SGLANG_TORCH_PROFILER_DIR"] == str(run / "profile" / "prefill1")
    assert x["decode2"].env["SGLANG_TORCH_PROFILER_DIR"] == str(run / "profile" / "decode2")
    assert x["decode2"].log == str(run / "decode2.log") and x["decode2"].role == "decode"
    assert x["decode3"].health_url == "http://127.0.0.1:30202/health"
    assert p.urls == {"router": "http://127.0.0.1:30000", "prefill1": "http://127.0.0.1:30100",
                      "prefill2": "http://127.0.0.1:30101", "prefill": "http://127.0.0.1:30100",
                      "decode1": "http://127.0.0.1:30200", "decode2": "http://127.0.0.1:30201",
                      "decode3": "http://127.0.0.1:30202", "decode": "http://127.0.0.1:30200"}
    assert x["router"].argv == [PY, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                                "--prefill", "http://127.0.0.1:30100", "8998", "--prefill", "http://127.0.0.1:30101",
                                "8999", "--decode", "http://127.0.0.1:30200", "--decode", "http://127.0.0.1:30201",
                                "--decode", "http://127.0.0.1:30202", "--host", "127.0.0.1", "--port", "30000",
                                "--prometheus-host", "127.0.0.1", "--prometheus-port", "29000", "--log-level", "info",
                                "--shutdown-grace-period-secs", "5", "--decode-policy", "round_robin"]


def test_replicas_with_the_callers_profiler_directory(tmp_path):
    p = plan(tmp_path, DECODE_GPUS="4;5", SGLANG_TORCH_PROFILER_DIR="/prof")
    x = by_name(p)
    assert x["prefill"].env["SGLANG_TORCH_PROFILER_DIR"] == "/prof/prefill"
    assert x["decode1"].env["SGLANG_TORCH_PROFILER_DIR"] == "/prof/decode1"
    p = plan(tmp_path, PREFILL_GPUS="0;1", DECODE_GPUS="4", SGLANG_TORCH_PROFILER_DIR="/prof")
    assert by_name(p)["decode"].env["SGLANG_TORCH_PROFILER_DIR"] == "/prof/decode"
    # round robin only for several decode servers
    assert "--decode-policy" not in by_name(p)["router"].argv
    assert by_name(p)["router"].argv[4:10] == ["--prefill", "http://127.0.0.1:30100", "8998",
                                               "--prefill", "http://127.0.0.1:30101", "8999"]


def test_a_router_policy_of_yours_replaces_round_robin(tmp_path):
    for extra in ("--policy random", "--decode-policy cache_aware", "--policy=random", "--decode-policy=power_of_two",
                  "--policy=a=b"):
        p = plan(tmp_path, DECODE_GPUS="4,5;6,7", ROUTER_EXTRA_ARGS=extra)
        argv = by_name(p)["router"].argv
        assert "round_robin" not in argv, extra
        assert argv[-len(extra.split()):] == extra.split()
    p = plan(tmp_path, DECODE_GPUS="4,5;6,7", ROUTER_EXTRA_ARGS="--prefill-policy random --policyx 1")
    argv = by_name(p)["router"].argv
    assert argv[-6:] == ["--decode-policy", "round_robin", "--prefill-policy", "random", "--policyx", "1"]


def test_replica_ports_stop_at_65535(tmp_path):
    p = plan(tmp_path, PREFILL_GPUS="0;1", PREFILL_PORT="65534", BOOTSTRAP_PORT="65532")
    assert p.urls["prefill2"] == "http://127.0.0.1:65535"
    assert by_name(p)["router"].argv[4:10] == ["--prefill", "http://127.0.0.1:65534", "65532",
                                               "--prefill", "http://127.0.0.1:65535", "65533"]
    p = plan(tmp_path, PREFILL_GPUS="0;1", BOOTSTRAP_PORT="65534")
    assert by_name(p)["prefill2"].binds[1] == ("127.0.0.1", 65535, "prefill2 bootstrap")
    assert refused(tmp_path, PREFILL_GPUS="0;1", PREFILL_PORT="65535") == \
        "prefill replica 2 would listen past port 65535 (PREFILL_PORT + 1): set PREFILL_PORT / BOOTSTRAP_PORT lower"
    assert refused(tmp_path, PREFILL_GPUS="0;1", BOOTSTRAP_PORT="65535").startswith("prefill replica 2 would listen "
                                                                                      "past port 65535")
    assert refused(tmp_path, DECODE_GPUS="4;5;6", DECODE_PORT="65534") == \
        "decode replica 3 would listen past port 65535 (DECODE_PORT + 2): set DECODE_PORT / BOOTSTRAP_PORT lower"
    # the bootstrap port is prefill's: decode replicas do not care
    p = plan(tmp_path, DECODE_GPUS="4;5", BOOTSTRAP_PORT="65535", DECODE_PORT="65533")
    assert p.urls["decode2"] == "http://127.0.0.1:65534"
    # one server of a role at the top port is fine
    p = plan(tmp_path, PREFILL_PORT="65535", BOOTSTRAP_PORT="65534", NODE_ROLE="prefill")
    assert p.urls["prefill"] == "http://127.0.0.1:65535"


def test_port_clashes_name_both_variables(tmp_path):
    def clash(port, host, a, b):
        return f"port {port} is configured twice on {host}: {a} ({P.port_variable(a)}) and {b} " \
               f"({P.port_variable(b)}): set one of them to another port"
    assert refused(tmp_path, PREFILL_PORT="30200") == \
        "port 30200 is configured twice on 127.0.0.1: prefill HTTP (PREFILL_PORT) and decode HTTP (DECODE_PORT): set " \
        "one of them to another port"
    assert refused(tmp_path, DECODE_PORT="8998") == \
        "port 8998 is configured twice on 127.0.0.1: prefill bootstrap (BOOTSTRAP_PORT) and decode HTTP " \
        "(DECODE_PORT): set one of them to another port"
    assert refused(tmp_path, ROUTER_PROMETHEUS_PORT="30000") == \
        "port 30000 is configured twice on 127.0.0.1: router HTTP (ROUTER_PORT) and router metrics " \
        "(ROUTER_PROMETHEUS_PORT): set one of them to another port"
    assert refused(tmp_path, BOOTSTRAP_PORT="30100") == clash(30100, "127.0.0.1", "prefill HTTP", "prefill bootstrap")
    assert refused(tmp_path, PREFILL_GPUS="0;1", DECODE_PORT="8999") == \
        "port 8999 is configured twice on 127.0.0.1: prefill2 bootstrap (BOOTSTRAP_PORT) and decode HTTP " \
        "(DECODE_PORT): set one of them to another port"
    assert refused(tmp_path, DECODE_GPUS="4;5", ROUTER_PORT="30201") == \
        "port 30201 is configured twice on 127.0.0.1: decode2 HTTP (DECODE_PORT) and router HTTP (ROUTER_PORT): set " \
        "one of them to another port"
    # a wildcard bind takes the port on every address
    assert refused(tmp_path, PREFILL_HOST="0.0.0.0", DECODE_PORT="30100") == \
        "port 30100 is configured twice on 127.0.0.1: prefill HTTP (PREFILL_PORT) and decode HTTP (DECODE_PORT): set " \
        "one of them to another port"
    assert refused(tmp_path, ROUTER_HOST="::", DECODE_PORT="29000").startswith(
        "port 29000 is configured twice on ::: decode HTTP (DECODE_PORT) and router metrics")
    assert refused(tmp_path, PREFILL_HOST="::1", DECODE_HOST="::1", DECODE_PORT="30100").startswith(
        "port 30100 is configured twice on ::1: prefill HTTP (PREFILL_PORT) and decode HTTP")
    # other hosts, or a part another host runs: no clash
    p = plan(tmp_path, PREFILL_HOST="10.0.0.1", DECODE_HOST="10.0.0.2", DECODE_PORT="30100")
    assert [x.name for x in p.procs] == ["prefill", "decode", "router"]
    p = plan(tmp_path, NODE_ROLE="decode,router", DECODE_PORT="30100")
    assert [x.name for x in p.procs] == ["decode", "router"]


def test_check_ports_directly():
    def proc(*binds):
        return Proc("x", [], {}, "", list(binds))
    P._check_ports([proc(("127.0.0.1", 1, "prefill HTTP")), proc(("10.0.0.1", 1, "decode HTTP"))])
    P._check_ports([proc(("127.0.0.1", 1, "prefill HTTP"), ("127.0.0.1", 2, "prefill bootstrap"))])
    with pytest.raises(ConfigError) as e:
        P._check_ports([proc(("0.0.0.0", 7, "router HTTP")), proc(("127.0.0.1", 9, "a")),
                        proc(("127.0.0.1", 7, "decode4 HTTP"))])
    assert str(e.value) == "port 7 is configured twice on 127.0.0.1: router HTTP (ROUTER_PORT) and decode4 HTTP " \
                           "(DECODE_PORT): set one of them to another port"


def test_hosts_urls_and_the_host_ip_of_a_multi_node_plan(tmp_path):
    p = plan(tmp_path, PREFILL_HOST="10.0.0.1", DECODE_HOST="10.0.0.2", ROUTER_HOST="0.0.0.0")
    pre, dec, rou = p.procs
    assert pre.env["SGLANG_HOST_IP"] == "10.0.0.1" and dec.env["SGLANG_HOST_IP"] == "10.0.0.2"
    assert "UCX_NET_DEVICES" not in pre.env and "UCX_NET_DEVICES" not in dec.env
    assert p.urls == {"router": "http://127.0.0.1:30000", "prefill": "http://10.0.0.1:30100",
                      "decode": "http://10.0.0.2:30200"}
    assert flag(pre.argv, "--host") == "10.0.0.1" and flag(dec.argv, "--host") == "10.0.0.2"
    assert flag(rou.argv, "--host") == "0.0.0.0" and flag(rou.argv, "--prometheus-host") == "0.0.0.0"
    assert rou.binds == [("0.0.0.0", 30000, "router HTTP"), ("0.0.0.0", 29000, "router metrics")]
    assert rou.argv[4:9] == ["--prefill", "http://10.0.0.1:30100", "8998", "--decode", "http://10.0.0.2:30200"]
    # one remote host is enough for a multi-node plan; a wildcard bind gets no host IP
    p = plan(tmp_path, PREFILL_HOST="0.0.0.0", DECODE_HOST="fe80::2", ROUTER_HOST="::")
    pre, dec, rou = p.procs
    assert "SGLANG_HOST_IP" not in pre.env and dec.env["SGLANG_HOST_IP"] == "fe80::2"
    assert "UCX_NET_DEVICES" not in pre.env
    assert p.urls == {"router": "http://127.0.0.1:30000", "prefill": "http://127.0.0.1:30100",
                      "decode": "http://[fe80::2]:30200"}
    p = plan(tmp_path, DECODE_HOST="::", PREFILL_HOST="127.0.0.1")
    assert "SGLANG_HOST_IP" not in p.procs[1].env and p.procs[0].env["SGLANG_HOST_IP"] == "127.0.0.1"
    assert p.urls["decode"] == "http://127.0.0.1:30200"
    # loopback names: one host
    for host in ("localhost", "::1", "127.0.0.1"):
        p = plan(tmp_path, PREFILL_HOST=host, DECODE_HOST="localhost")
        assert all("SGLANG_HOST_IP" not in x.env for x in p.procs), host
        assert p.procs[0].env["UCX_NET_DEVICES"] == "lo"
    assert plan(tmp_path, PREFILL_HOST="::1").urls["prefill"] == "http://[::1]:30100"
    assert plan(tmp_path, ROUTER_HOST="localhost").urls["router"] == "http://localhost:30000"


# ---------------------------------------------------------------- roles on this host


def test_node_roles_and_remote_health(tmp_path):
    p = plan(tmp_path, NODE_ROLE="prefill")
    assert p.roles == ["prefill"] and [x.name for x in p.procs] == ["prefill"] and p.remote_health == {}
    assert p.shape_reason == "yours (NODE_ROLE=prefill: a recorded shape is for the whole deployment on one host)"
    p = plan(tmp_path, NODE_ROLE="router,decode", PREFILL_GPUS="0;1", PREFILL_HOST="10.0.0.1")
    assert p.roles == ["decode", "router"] and [x.name for x in p.procs] == ["decode", "router"]
    assert p.remote_health == {"prefill1": "http://10.0.0.1:30100/health", "prefill2": "http://10.0.0.1:30101/health"}
    assert p.shape_reason == "yours (NODE_ROLE=router,decode: a recorded shape is for the whole deployment on one host)"
    p = plan(tmp_path, NODE_ROLE="router", DECODE_HOST="10.0.0.2", CALIBRATE="1")
    assert [x.name for x in p.procs] == ["router"]
    assert p.remote_health == {"prefill": "http://127.0.0.1:30100/health", "decode": "http://10.0.0.2:30200/health"}
    assert p.moe_reason == "no server on this host" and p.fp8_reason == NO_GPU_FP8
    assert p.calibrate_argv == [] and p.calibrate_env == {}
    p = plan(tmp_path, NODE_ROLE="prefill,decode")
    assert [x.name for x in p.procs] == ["prefill", "decode"] and p.remote_health == {}
    assert plan(tmp_path, NODE_ROLE="prefill,decode,router").shape_reason.startswith("the default layout")


def test_calibrate_from_the_plan(tmp_path):
    p = plan(tmp_path, CALIBRATE="1", DECODE_GPUS="6,7;4,5", MODEL_PATH="/models/v4")
    assert p.calibrate_argv == [PY, "-m", "dsv4_sm120.calibrate"]
    assert p.calibrate_env == {"CUDA_VISIBLE_DEVICES": "6", "DECODE_GPUS": "6,7", "MODEL_PATH": "/models/v4"}
    p = plan(tmp_path, CALIBRATE="1", NODE_ROLE="prefill", PREFILL_GPUS="2,3")
    assert p.calibrate_env == {"CUDA_VISIBLE_DEVICES": "2", "DECODE_GPUS": "2,3",
                               "MODEL_PATH": "deepseek-ai/DeepSeek-V4-Flash"}


# ---------------------------------------------------------------- the GPU the runner choices ask about


def test_runner_choices_ask_nvidia_smi_about_the_first_decode_gpu(tmp_path):
    smi = naming_smi(tmp_path)
    p = plan(tmp_path, NVIDIA_SMI=smi, DECODE_GPUS="6,7;4,5")
    assert "-i 6" in " ".join(c for c in smi_calls(smi) if "--query-gpu=name " in c)
    assert p.fp8_reason == "SGLang default: no FP8 tuning summary for Fake_GPU_6 (run `make tune-fp8`)"
    assert p.moe_reason.startswith("SGLang default (no matching machine profile for Fake GPU 6: ")
    p = plan(tmp_path, NVIDIA_SMI=smi, NODE_ROLE="prefill", PREFILL_GPUS="3,2")
    assert p.moe_reason.startswith("SGLang default (no matching machine profile for Fake GPU 3: ")
    assert p.fp8_reason == "SGLang default: no FP8 tuning summary for Fake_GPU_3 (run `make tune-fp8`)"


def test_gpu_name_is_asked_only_when_a_choice_needs_it(tmp_path):
    smi = naming_smi(tmp_path)
    named = lambda: [c for c in smi_calls(smi) if c.startswith("--query-gpu=name ")]  # noqa: E731
    # an explicit FP8 backend and an MXFP4 checkpoint (the published V4-Flash): the MoE runner needs the name
    p = plan(tmp_path, NVIDIA_SMI=smi, FP8_GEMM_BACKEND="cutlass")
    assert named() == ["--query-gpu=name --format=csv,noheader -i 4"]
    assert p.fp8_reason == "FP8_GEMM_BACKEND=cutlass" and "Fake GPU 4" in p.moe_reason
    # your MoE runner and an explicit FP8 backend: nothing needs the name
    (Path(smi).parent / "calls.log").unlink()
    p = plan(tmp_path, NVIDIA_SMI=smi, FP8_GEMM_BACKEND="cutlass", SERVER_EXTRA_ARGS="--moe-runner-backend marlin")
    assert named() == []
    assert p.moe_reason == "your --moe-runner-backend in SERVER_EXTRA_ARGS wins"
    assert p.procs[0].argv.count("--moe-runner-backend") == 1 and p.procs[0].argv[-2:] == ["--moe-runner-backend",
                                                                                           "marlin"]
    # your MoE runner, FP8 auto: the FP8 choice needs it
    p = plan(tmp_path, NVIDIA_SMI=smi, DECODE_EXTRA_ARGS="--moe-runner-backend=marlin")
    assert named() == ["--query-gpu=name --format=csv,noheader -i 4"]
    assert p.moe_reason == "your --moe-runner-backend in DECODE_EXTRA_ARGS wins"
    assert p.fp8_reason == "SGLang default: no FP8 tuning summary for Fake_GPU_4 (run `make tune-fp8`)"
    # a router-only host asks nothing
    (Path(smi).parent / "calls.log").unlink()
    plan(tmp_path, NVIDIA_SMI=smi, NODE_ROLE="router")
    assert named() == []


def test_an_nvfp4_checkpoint_with_an_explicit_backend_asks_no_gpu_name(tmp_path):
    smi = naming_smi(tmp_path)
    ck = tmp_path / "nvfp4"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({"model_type": "deepseek_v4",
                                                "quantization_config": {"moe_quant_algo": "NVFP4"}}))
    p = plan(tmp_path, NVIDIA_SMI=smi, FP8_GEMM_BACKEND="triton", MODEL_PATH=str(ck))
    assert [c for c in smi_calls(smi) if c.startswith("--query-gpu=name ")] == []
    assert p.moe_reason.startswith("not added: NVFP4 routed experts")
    assert "--moe-runner-backend" not in p.procs[1].argv and flag(p.procs[1].argv, "--fp8-gemm-backend") == "triton"


def test_a_profile_winner_reaches_both_servers(tmp_path):
    smi = naming_smi(tmp_path)
    gpu = "Fake GPU 4"
    buckets = {"1": {"winner": "marlin", "candidates": {
        "marlin": {"status": "ok", "us": 1.0, "err": 0.0, "tol": 0.08},
        "flashinfer_mxfp4": {"status": "ok", "us": 5.0, "err": 0.0, "tol": 0.08}}}}
    prof = {"schema": mp.SCHEMA, "gpu": gpu, "created_at": mp.now_iso(), "versions": mp.running_versions(),
            "deployment": {"moe_format": "mxfp4"},
            "decisions": {"moe.mxfp4": {"bucket_kind": "tokens", "default": "flashinfer_mxfp4", "buckets": buckets}}}
    mp.save(prof, mp.profile_path(gpu, Path(os.environ["DSV4_SM120_PROFILE_DIR"])))
    mp.clear_cache()
    p = plan(tmp_path, NVIDIA_SMI=smi, FP8_GEMM_BACKEND="cutlass", IB_DEVICE="mlx5_0", SERVED_MODEL_NAME="m")
    for x in p.procs[:2]:
        assert x.argv[9:17] == ["--served-model-name", "m", "--fp8-gemm-backend", "cutlass",
                                "--moe-runner-backend", "marlin", "--disaggregation-ib-device", "mlx5_0"]
    assert "--moe-runner-backend" not in p.procs[2].argv
    assert p.moe_reason.startswith("marlin")


# ---------------------------------------------------------------- NUMA placement


def test_numa_binding_from_the_box(tmp_path):
    smi = tmp_path / "box" / "nvidia-smi"
    smi.parent.mkdir()
    make_smi(smi)
    sysfs = make_sysfs(tmp_path / "sys", {i: (0 if i < 4 else 1) for i in range(8)}, {0: "0-1", 1: "2-3"})
    kv = dict(NVIDIA_SMI=str(smi), DSV4_SM120_SERVE_SYSFS_ROOT=str(sysfs))
    pre, dec, rou = plan(tmp_path, **kv).procs
    assert pre.numa["node"] == 0 and dec.numa["node"] == 1 and rou.numa == {}
    assert pre.numa["text"] and "node 0" in pre.numa["text"]
    assert pre.argv[-5:] == ["--numa-node", "0", "0", "0", "0"] and dec.argv[-5:] == ["--numa-node", "1", "1", "1", "1"]
    assert "SGLANG_AUTO_NUMA_BIND" not in pre.env
    pre, dec, rou = plan(tmp_path, DECODE_EXTRA_ARGS="--numa-node 0 0 0 0", **kv).procs
    assert dec.argv.count("--numa-node") == 1 and dec.argv[-5:] == ["--numa-node", "0", "0", "0", "0"]
    assert pre.argv[-5:] == ["--numa-node", "0", "0", "0", "0"]
    pre, dec, rou = plan(tmp_path, NUMA_BIND="0", **kv).procs
    assert "--numa-node" not in pre.argv and "--numa-node" not in dec.argv
    assert pre.env["SGLANG_AUTO_NUMA_BIND"] == "0" and dec.env["SGLANG_AUTO_NUMA_BIND"] == "0"
    assert "SGLANG_AUTO_NUMA_BIND" not in rou.env and pre.numa["node"] is None
    assert [x.name for x in plan(tmp_path, NODE_ROLE="router", **kv).procs] == ["router"]


# ---------------------------------------------------------------- the recorded serving shape


def test_the_recorded_shape_is_asked_with_the_plans_concurrency(tmp_path, monkeypatch):
    calls = []

    def fake(variant, environ, s, standin, smi, concurrency, conc_var):
        calls.append((variant, standin, smi, concurrency, conc_var, s["NODE_ROLE"]))
        return {"PREFILL_GPUS": "0,1", "DECODE_GPUS": "2,3;4,5"}, "recorded: 2 + 2x2"

    monkeypatch.setattr(profile_choices, "recorded_shape", fake)
    p = plan(tmp_path, MAX_RUNNING="48")
    assert calls == [("base", False, "/nonexistent/nvidia-smi", 48, "MAX_RUNNING", "all")]
    assert p.shape_reason == "recorded: 2 + 2x2"
    assert [x.name for x in p.procs] == ["prefill", "decode1", "decode2", "router"]
    assert p.procs[0].gpus == [0, 1] and p.procs[2].gpus == [4, 5] and flag(p.procs[1].argv, "--tp") == "2"
    assert p.settings["DECODE_GPUS"] == "2,3;4,5" and p.value("PREFILL_GPUS") == [[0, 1]]
    calls.clear()
    plan(tmp_path, "mtp", SHAPE_CONCURRENCY="7", DSV4_SM120_SERVE_STANDIN="1", NVIDIA_SMI="/x/smi")
    assert calls == [("mtp", True, "/x/smi", 7, "SHAPE_CONCURRENCY", "all")]
    calls.clear()
    plan(tmp_path, NODE_ROLE="decode,router")
    assert calls == []


# ---------------------------------------------------------------- another checkout (DSV4_SM120_REPO_ROOT)


def fake_repo(tmp_path, env_files=None) -> Path:
    """A checkout of our own: serve/env/*.env (``env_files``: {name: text}; default: one NCCL line)."""
    repo = tmp_path / "repo"
    (repo / "serve" / "env").mkdir(parents=True)
    for name, text in (env_files or {"10-a.env": "NCCL_DEBUG=TRACE\n"}).items():
        (repo / "serve" / "env" / name).write_text(text)
    return repo


def test_the_checkout_supplies_env_files_venv_logs_and_fp8_summaries(tmp_path, monkeypatch):
    repo = fake_repo(tmp_path, {"10-a.env": "NCCL_DEBUG=TRACE\nSGLANG_X=1\n", "20-b.env": "SGLANG_X=2\n"})
    write_summary(repo, "Fake GPU 4", "triton", reason="triton wins everywhere")
    monkeypatch.setenv("DSV4_SM120_REPO_ROOT", str(repo))
    smi = naming_smi(tmp_path)
    p = plan(tmp_path, NVIDIA_SMI=smi, VENV=".venv", RUN_DIR="", LOG_DIR="logs")
    assert p.repo == str(repo) and p.python == str(repo / ".venv" / "bin" / "python")
    assert p.run_dir == str(repo / "logs" / f"serve-base-19700101-000000-{os.getpid()}")
    assert p.common_env == [("NCCL_DEBUG", "TRACE", "10-a.env"), ("SGLANG_X", "2", "20-b.env")]
    assert p.fp8_reason == "triton: triton wins everywhere"
    for x in p.procs[:2]:
        assert x.argv[9:11] == ["--fp8-gemm-backend", "triton"]
        assert x.argv[0] == str(repo / ".venv" / "bin" / "python")


def test_env_file_problems_are_config_errors(tmp_path, monkeypatch):
    repo = fake_repo(tmp_path, {"10-a.env": "NCCL_DEBUG=TRACE\nnot a line\n"})
    monkeypatch.setenv("DSV4_SM120_REPO_ROOT", str(repo))
    env_dir = repo / "serve" / "env"
    assert refused(tmp_path) == f"{env_dir / '10-a.env'}:2: expected KEY=VALUE, got 'not a line'"
    (env_dir / "10-a.env").unlink()
    env_dir.rmdir()
    assert refused(tmp_path) == f"env directory {env_dir} does not exist"


def test_url_host():
    assert P._url_host("0.0.0.0") == "127.0.0.1" and P._url_host("::") == "127.0.0.1"
    assert P._url_host("") == "127.0.0.1"                      # an empty bind address is every address too
    assert P._url_host("::1") == "[::1]" and P._url_host("fe80::1%eth0") == "[fe80::1%eth0]"
    assert P._url_host("10.1.2.3") == "10.1.2.3" and P._url_host("box.local") == "box.local"


def test_a_lookup_value_error_is_one_config_error(tmp_path, monkeypatch):
    from dsv4_sm120 import fp8_configs

    def broken(device, config_dir, profile_dir=None):
        raise ValueError(f"summary for {device} in {config_dir} is broken")

    monkeypatch.setattr(fp8_configs, "recommended_fp8_gemm_backend", broken)
    with pytest.raises(ConfigError) as e:
        P.fp8_gemm_backend("auto", tmp_path, "Fake GPU")
    assert str(e.value) == f"summary for Fake GPU in {tmp_path / 'configs' / 'fp8'} is broken"


def test_the_callers_hugging_face_cache_decides_the_draft_and_the_moe_format(tmp_path):
    from test_model_config import hf_cache

    hub = tmp_path / "hf" / "hub"
    hf_cache(hub, "org/dspark", {"model_type": "deepseek_v4", "dspark_block_size": 5, "dspark_noise_token_id": 128799,
                                 "dspark_target_layer_ids": [40, 41, 42]})
    hf_cache(hub, "org/nv", {"model_type": "deepseek_v4", "quantization_config": {"moe_quant_algo": "NVFP4"}})
    smi = naming_smi(tmp_path)
    p = plan(tmp_path, "mtp", MODEL_PATH="org/dspark", HF_HOME=str(tmp_path / "hf"), NVIDIA_SMI=smi)
    for x in p.procs[:2]:
        assert flag(x.argv, "--speculative-algorithm") == "DSPARK"
        assert flag(x.argv, "--speculative-dspark-block-size") == "5" and x.argv[-1] == "--enable-metrics"
    assert p.spec_reason.startswith("DSPARK chosen from config.json in the local Hugging Face cache (")
    # MXFP4 experts (no NVFP4 marker) known from that cache: the machine profile is asked for the decode GPU
    assert p.moe_reason.startswith("SGLang default (no matching machine profile for Fake GPU 4: ")
    p = plan(tmp_path, MODEL_PATH="org/nv", HF_HOME=str(tmp_path / "hf"), FP8_GEMM_BACKEND="cutlass")
    assert p.moe_reason.startswith("not added: NVFP4 routed experts (config.json in the local Hugging Face cache (")
    assert all("--moe-runner-backend" not in x.argv for x in p.procs)
    # the same ids without that cache: unknown here
    p = plan(tmp_path, "mtp", MODEL_PATH="org/dspark", SPEC_ALGORITHM="eagle")
    assert p.moe_reason == ("not added: the MoE format of MODEL_PATH=org/dspark is unknown here (a Hub id not in the "
                            "local Hugging Face cache); SGLang picks the runner from the checkpoint it loads")


def test_a_decode_only_host_still_chooses_runners(tmp_path):
    smi = naming_smi(tmp_path)
    p = plan(tmp_path, NODE_ROLE="decode", NVIDIA_SMI=smi, DECODE_GPUS="5,6")
    assert p.moe_reason.startswith("SGLang default (no matching machine profile for Fake GPU 5: ")
    assert p.fp8_reason == "SGLang default: no FP8 tuning summary for Fake_GPU_5 (run `make tune-fp8`)"
    p = plan(tmp_path, NODE_ROLE="decode,router", NVIDIA_SMI=smi)
    assert p.moe_reason.startswith("SGLang default (no matching machine profile for Fake GPU 4: ")


def test_build_plan_defaults_to_the_base_variant(tmp_path):
    p = build_plan(env_for(tmp_path))
    assert p.variant == "base" and p.spec_reason == "" and "--enable-metrics" not in p.procs[1].argv


def test_the_all_reduce_choice_asks_the_plans_nvidia_smi(tmp_path):
    smi = naming_smi(tmp_path, table=True)
    pre, dec, _ = plan(tmp_path, NVIDIA_SMI=smi, PREFILL_GPUS="1,0", DECODE_GPUS="6,7").procs
    assert "Fake_GPU_1.json" in pre.allreduce and "Fake_GPU_6.json" in dec.allreduce
    assert "no GPU name" not in pre.allreduce


def test_gpu_name_waits_a_bounded_time(monkeypatch):
    import subprocess

    seen = {}

    def hanging(argv, **kw):
        seen.update(kw)
        raise subprocess.TimeoutExpired(argv, kw.get("timeout"))

    monkeypatch.setattr(subprocess, "run", hanging)
    assert P.gpu_name("/bin/nvidia-smi", 0) is None
    assert isinstance(seen.get("timeout"), (int, float)) and 0 < seen["timeout"] <= 60


def test_only_the_profile_lookup_is_quieted(tmp_path, monkeypatch, caplog):
    """The FP8 choice quiets the machine-profile logger (the preflight's profile check reports it), nothing else."""
    from dsv4_sm120 import fp8_configs

    levels = []

    def lookup(device, config_dir, profile_dir=None):
        levels.append((logging.getLogger("dsv4_sm120.machine_profile").level, logging.getLogger().level))
        logging.getLogger("dsv4_sm120.other").warning("unrelated warning")
        return "triton", "looked up"

    monkeypatch.setattr(fp8_configs, "recommended_fp8_gemm_backend", lookup)
    with caplog.at_level(logging.INFO):
        assert P.fp8_gemm_backend("auto", tmp_path, "Fake GPU") == ("triton", "triton: looked up")
    assert levels == [(logging.ERROR, logging.INFO)]
    assert [r.getMessage() for r in caplog.records if r.name == "dsv4_sm120.other"] == ["unrelated warning"]


def test_a_blank_fp8_backend_plans_as_auto(tmp_path, monkeypatch):
    """FP8_GEMM_BACKEND set but blank is the settings table's default (auto), not an unknown backend: the tuner's
    summary for the serving GPU chooses, as with auto."""
    repo = fake_repo(tmp_path)
    write_summary(repo, "Fake GPU 4", "triton", reason="triton wins everywhere")
    monkeypatch.setenv("DSV4_SM120_REPO_ROOT", str(repo))
    for blank in ("", "  ", "auto"):
        p = plan(tmp_path, FP8_GEMM_BACKEND=blank, NVIDIA_SMI=naming_smi(tmp_path))
        assert p.fp8_reason == "triton: triton wins everywhere", blank
        assert [x.argv[9:11] for x in p.procs[:2]] == [["--fp8-gemm-backend", "triton"]] * 2
        # the MoE runner named by the user: the GPU name is asked for the FP8 choice alone
        p = plan(tmp_path, FP8_GEMM_BACKEND=blank, NVIDIA_SMI=naming_smi(tmp_path),
                 SERVER_EXTRA_ARGS="--moe-runner-backend triton")
        assert p.fp8_reason == "triton: triton wins everywhere", blank


def test_port_clashes_whatever_the_host_spelling(tmp_path):
    """The same address spelled two ways (localhost / 127.0.0.1, letter case, IPv6 in brackets, a wildcard and a
    loopback address) is one address: the plan stops before a server fails with "address in use"."""
    def clash(**kv):
        return refused(tmp_path, **kv)
    assert clash(PREFILL_HOST="localhost", DECODE_HOST="127.0.0.1", DECODE_PORT="30100") == \
        "port 30100 is configured twice on 127.0.0.1: prefill HTTP (PREFILL_PORT) and decode HTTP (DECODE_PORT): set " \
        "one of them to another port"
    assert clash(PREFILL_HOST="LocalHost", DECODE_HOST="localhost", DECODE_PORT="30100").startswith(
        "port 30100 is configured twice on localhost: prefill HTTP (PREFILL_PORT) and decode HTTP (DECODE_PORT)")
    # (prefill host, decode host): the line names the decode bind's spelling
    for pre, dec in (("Node-A", "node-a"), ("[::1]", "::1"), ("::", "::1"), ("127.0.0.2", "0.0.0.0"),
                     ("[FD00::1]", "fd00::1")):
        assert clash(PREFILL_HOST=pre, DECODE_HOST=dec, DECODE_PORT="30100").startswith(
            f"port 30100 is configured twice on {dec}: prefill HTTP"), (pre, dec)
    # distinct addresses, or a wildcard on one node and another node's address: no clash; a host with one bracket
    # is not an IPv6 literal in brackets
    for pre, dec in (("[fd00::12", "fd00::1"), ("fd00::1]", "d00::1")):
        p = plan(tmp_path, PREFILL_HOST=pre, DECODE_HOST=dec, DECODE_PORT="30100")
        assert [x.name for x in p.procs] == ["prefill", "decode", "router"], (pre, dec)
    for pre, dec in (("127.0.0.1", "127.0.0.2"), ("0.0.0.0", "10.0.0.2"), ("node-a", "node-b"), ("::1", "10.0.0.2")):
        p = plan(tmp_path, PREFILL_HOST=pre, DECODE_HOST=dec, DECODE_PORT="30100")
        assert [x.name for x in p.procs] == ["prefill", "decode", "router"], (pre, dec)


def test_the_port_past_65535_is_the_one_named(tmp_path):
    assert refused(tmp_path, PREFILL_GPUS="0;1", BOOTSTRAP_PORT="65535") == \
        "prefill replica 2 would listen past port 65535 (BOOTSTRAP_PORT + 1): set PREFILL_PORT / BOOTSTRAP_PORT lower"
    assert refused(tmp_path, PREFILL_GPUS="0;1", PREFILL_PORT="65534", BOOTSTRAP_PORT="65535") == \
        "prefill replica 2 would listen past port 65535 (BOOTSTRAP_PORT + 1): set PREFILL_PORT / BOOTSTRAP_PORT lower"
    assert refused(tmp_path, PREFILL_GPUS="0;1", PREFILL_PORT="65535", BOOTSTRAP_PORT="8998") == \
        "prefill replica 2 would listen past port 65535 (PREFILL_PORT + 1): set PREFILL_PORT / BOOTSTRAP_PORT lower"
