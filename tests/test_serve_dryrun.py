"""Dry runs of serve/serve_dsv4_tp4.sh and serve/serve_dsv4_mtp.sh.

The printed server commands are parsed by SGLang 0.5.23's own ``prepare_server_args`` and
resolved (``resolve_once``, ``--device cuda``: resolution needs no GPU) against a minimal DeepSeek-V4 config.json, so a renamed or
removed flag (e.g. the bare ``--cuda-graph-max-bs``) fails here. The router command is
parsed by sglang_router's own argument parser.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVE = REPO / "serve"
VENV = str(Path(sys.executable).parent.parent)


def dry_run(script: str, extra_env: dict | None = None, args=("--dry-run",), check=True, cwd=None):
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith(("PREFILL_", "DECODE_", "ROUTER_", "SPEC_", "NCCL_")) or k in
                   ("MODEL_PATH", "NODE_ROLE", "DRY_RUN", "DETACH", "FP8_GEMM_BACKEND", "DSV4_SM120_SERVE_STANDIN",
                    "RUN_DIR", "LOG_DIR", "MAX_RUNNING", "CONTEXT_LEN", "PREFLIGHT_SKIP", "HF_HUB_CACHE",
                    "HUGGINGFACE_HUB_CACHE", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))}
    env["VENV"] = VENV
    env["RUN_DIR"] = "/tmp/dsv4-dry-run-dir"
    env["HF_HOME"] = "/nonexistent/dsv4-hf-home"     # no Hugging Face cache unless a test brings one
    env["NVIDIA_SMI"] = "/nonexistent/nvidia-smi"    # no GPUs unless a test brings a fake nvidia-smi
    env["PREFLIGHT_SKIP"] = "patches"                # the test environment's SGLang is not patched (its own test)
    env.update(extra_env or {})
    r = subprocess.run(["bash", str(SERVE / script), *args], capture_output=True, text=True, env=env, timeout=60,
                       cwd=cwd)
    if check:
        assert r.returncode == 0, r.stderr + r.stdout
    return r


def commands(out: str) -> dict:
    """role -> (env dict, argv) from the `cmd ROLE: ...` lines."""
    res = {}
    for line in out.splitlines():
        if line.startswith("cmd "):
            role, _, rest = line[4:].partition(": ")
            toks = shlex.split(rest)
            env = {}
            while "=" in toks[0] and not toks[0].startswith("/"):
                k, _, v = toks.pop(0).partition("=")
                env[k] = v
            res[role] = (env, toks)
    return res


def server_argv(argv):
    i = argv.index("sglang.launch_server")
    assert argv[i - 1] == "-m"
    return argv[i + 1:]


def write_dsv4_config(d: Path, **overrides) -> Path:
    n = 43
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 4096,
        "num_hidden_layers": n, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 448, "v_head_dim": 512, "q_lora_rank": 1024,
        "o_lora_rank": 1024, "o_groups": 8, "kv_lora_rank": 512, "n_routed_experts": 256,
        "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 2048, "index_topk": 512,
        "index_head_dim": 128, "index_n_heads": 64, "window_size": 128, "sliding_window": 128,
        "vocab_size": 129280, "max_position_embeddings": 1048576, "num_nextn_predict_layers": 1,
        "compress_ratios": [0 if i < 2 else (4 if i % 2 else 128) for i in range(n)] + [0],
        "torch_dtype": "bfloat16", "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
    }
    cfg.update(overrides)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


# Runs in the test environment's python with the real sglang: parse each argv with
# prepare_server_args; with "resolve", also resolve it on CPU against the config dir.
VALIDATOR = textwrap.dedent(r"""
    import json, sys, io, contextlib
    from sglang.srt.server_args import prepare_server_args
    jobs = json.load(sys.stdin)
    out = []
    for job in jobs:
        argv = job["argv"]
        if job.get("profile_req"):
            import msgspec
            from pydantic import TypeAdapter
            from sglang.srt.managers.io_struct import ProfileReq
            # FastAPI validates /start_profile bodies this way and silently drops unknown keys
            unknown = sorted(set(argv) - {f.name for f in msgspec.structs.fields(ProfileReq)})
            r = TypeAdapter(ProfileReq).validate_python(argv)
            out.append({"ok": not unknown, "unknown": unknown, "output_dir": r.output_dir, "num_steps": r.num_steps,
                        "activities": r.activities, "profile_id": r.profile_id})
            continue
        if job.get("router"):
            from sglang_router.launch_router import parse_router_args
            args = parse_router_args(argv)
            out.append({"ok": True, "pd": args.pd_disaggregation, "prefill": [list(x) for x in args.prefill_urls],
                        "decode": args.decode_urls, "port": args.port, "prometheus_port": args.prometheus_port,
                        "shutdown_grace_period_secs": args.shutdown_grace_period_secs,
                        "decode_policy": args.decode_policy})
            continue
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                a = prepare_server_args(argv)
        except SystemExit as e:
            out.append({"ok": False, "stage": "parse", "error": err.getvalue()[-400:]})
            continue
        rec = {"ok": True, "tp": a.tp_size, "mode": a.disaggregation_mode,
               "backend": a.disaggregation_transfer_backend}
        if job.get("resolve"):
            argv2 = list(argv)
            argv2[argv2.index("--model-path") + 1] = job["resolve"]
            # --device cuda resolves without a GPU here and takes the CUDA branches (graph sizes etc.)
            b = prepare_server_args(argv2 + ["--device", "cuda"])
            try:
                b.resolve_once()
            except Exception as e:
                out.append({"ok": False, "stage": "resolve", "error": f"{type(e).__name__}: {e}"})
                continue
            d = b.resolved_dict()
            rec.update(resolved=True, page_size=d["page_size"], kv_cache_dtype=str(d["kv_cache_dtype"]),
                       max_running=d["max_running_requests"], context_length=d["context_length"],
                       decode_graph_max_bs=d["cuda_graph_config"]["decode"]["max_bs"],
                       decode_graph_bs=d["cuda_graph_config"]["decode"]["bs"],
                       decode_graph_backend=str(d["cuda_graph_config"]["decode"]["backend"]),
                       spec=d["speculative_algorithm"], spec_steps=d["speculative_num_steps"],
                       spec_topk=d["speculative_eagle_topk"], spec_draft=d["speculative_num_draft_tokens"],
                       spec_draft_path=d["speculative_draft_model_path"],
                       dspark_block=d.get("speculative_dspark_block_size"), metrics=d["enable_metrics"],
                       fp8=str(d.get("fp8_gemm_runner_backend")), mem=d["mem_fraction_static"])
        out.append(rec)
    print("RESULT" + json.dumps(out))
""")


def validate(python_child, jobs):
    r = python_child(VALIDATOR, input=json.dumps(jobs), timeout=300, cwd="/tmp")
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert line, f"validator crashed (sglang missing from the test environment?)\n{r.stderr[-3000:]}"
    return json.loads(line[-1][len("RESULT"):])


@pytest.fixture(scope="module")
def outputs():
    base = dry_run("serve_dsv4_tp4.sh").stdout
    mtp = dry_run("serve_dsv4_mtp.sh").stdout
    # the multi-node plans bind addresses of other hosts: their ports check runs there
    mn_prefill = dry_run("serve_dsv4_tp4.sh", {"NODE_ROLE": "prefill", "PREFILL_HOST": "10.1.0.1",
                                               "DECODE_HOST": "10.1.0.2", "PREFILL_GPUS": "0,1,2,3",
                                               "IB_DEVICE": "mlx5_0", "PREFLIGHT_SKIP": "patches,ports"}).stdout
    mn_decode = dry_run("serve_dsv4_mtp.sh", {"NODE_ROLE": "decode,router", "PREFILL_HOST": "10.1.0.1",
                                              "DECODE_HOST": "10.1.0.2", "DECODE_GPUS": "0,1,2,3",
                                              "ROUTER_HOST": "0.0.0.0", "IB_DEVICE": "mlx5_0",
                                              "PREFLIGHT_SKIP": "patches,ports"}).stdout
    fp8 = dry_run("serve_dsv4_tp4.sh", {"FP8_GEMM_BACKEND": "triton", "MAX_RUNNING": "8",
                                        "DECODE_EXTRA_ARGS": "--chunked-prefill-size 4096"}).stdout
    explicit = dry_run("serve_dsv4_tp4.sh", {"DECODE_EXTRA_ARGS": "--cuda-graph-bs-decode 1 2 3 5 16"}).stdout
    # replicas behind the router: two TP2 prefill and two TP2 decode servers
    replicas = dry_run("serve_dsv4_mtp.sh", {"PREFILL_GPUS": "0,1;2,3", "DECODE_GPUS": "4,5;6,7"}).stdout
    return {"base": base, "mtp": mtp, "mn_prefill": mn_prefill, "mn_decode": mn_decode, "fp8": fp8,
            "explicit": explicit, "replicas": replicas}


@pytest.fixture(scope="module")
def validated(outputs, tmp_path_factory, python_child):
    """One subprocess (one sglang import) parses/resolves every server command and parses the routers'."""
    cfg = str(write_dsv4_config(tmp_path_factory.mktemp("dsv4") / "cfg"))
    jobs, expect = [], []
    for name in ("base", "mtp", "fp8", "explicit"):
        cmds = commands(outputs[name])
        assert set(cmds) == {"prefill", "decode", "router"}, outputs[name]
        for role in ("prefill", "decode"):
            jobs.append({"argv": server_argv(cmds[role][1]), "resolve": cfg})
            expect.append(("server", name, role))
    for name in ("mn_prefill", "mn_decode"):
        for role, (_, argv) in commands(outputs[name]).items():
            if role != "router":
                jobs.append({"argv": server_argv(argv)})
                expect.append(("server", name, role))
    cmds = commands(outputs["replicas"])
    assert list(cmds) == ["prefill1", "prefill2", "decode1", "decode2", "router"], outputs["replicas"]
    for role in ("prefill1", "prefill2", "decode1", "decode2"):
        jobs.append({"argv": server_argv(cmds[role][1]), **({"resolve": cfg} if role == "decode2" else {})})
        expect.append(("replica", "replicas", role))
    for name in ("base", "mn_decode", "replicas"):
        argv = commands(outputs[name])["router"][1]
        jobs.append({"router": True, "argv": argv[argv.index("sglang_router.launch_router") + 1:]})
        expect.append(("router", name, "router"))
    # bench/profile_capture.py's /start_profile body, and one with a misspelt field (must be flagged)
    sys.path.insert(0, str(REPO / "bench"))
    import profile_capture
    body = profile_capture.start_profile_body("/tmp/traces", 7, "pid-x")
    jobs.append({"profile_req": True, "argv": body})
    expect.append(("profile", "start_profile", "decode"))
    jobs.append({"profile_req": True, "argv": dict(body, num_stepz=7)})
    expect.append(("profile", "misspelt", "decode"))
    # A removed flag must be caught by the same machinery (shows the check can fail).
    # (appended here: the plan itself refuses it in DECODE_EXTRA_ARGS, as a prefix of --cuda-graph-max-bs-decode)
    jobs.append({"argv": server_argv(commands(outputs["base"])["decode"][1]) + ["--cuda-graph-max-bs", "16"]})
    expect.append(("negative", "bad", "decode"))
    res = validate(python_child, jobs)
    assert len(res) == len(jobs)
    return list(zip(expect, res))


# Decode CUDA-graph batch sizes SGLang 0.5.23 captures for each dry run: without speculation 1, 2, 4, 8, 12, then
# every 8th; with it 1-8, then every 2nd; an explicit --cuda-graph-bs-decode list as given.
DECODE_GRAPH_BS = {"base": [1, 2, 4, 8, 12, 16], "mtp": [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16],
                   "fp8": [1, 2, 4, 8], "explicit": [1, 2, 3, 5, 16]}


def test_dry_run_commands_parse_and_resolve_with_sglang(validated):
    neg = [r for (kind, _, _), r in validated if kind == "negative"][0]
    assert not neg["ok"] and neg["stage"] == "parse" and "cuda-graph-max-bs" in neg["error"], neg
    good = [(name, role, r) for (kind, name, role), r in validated if kind == "server"]
    assert sum(1 for *_, r in good if r.get("resolved")) == 8, good
    for name, role, r in good:
        assert r["ok"], (name, role, r)
        assert r["tp"] == 4 and r["mode"] == role and r["backend"] == "nixl", (name, role, r)
        if not r.get("resolved"):
            continue
        assert r["page_size"] == 256 and "fp8_e4m3" in r["kv_cache_dtype"], r
        assert r["context_length"] == 65536 and abs(r["mem"] - 0.85) < 1e-9, r
        if role == "decode":
            want = 8 if name == "fp8" else 16
            assert r["max_running"] == want, r
            assert r["decode_graph_max_bs"] == want and r["decode_graph_backend"] != "disabled", r
            # SGLang captures its own list of sizes up to MAX_RUNNING, not every size (docs/serving.md)
            assert r["decode_graph_bs"] == DECODE_GRAPH_BS[name], (name, r["decode_graph_bs"])
        if name == "mtp":
            assert (r["spec"], r["spec_steps"], r["spec_topk"], r["spec_draft"]) == ("EAGLE", 3, 1, 4), r
        else:
            assert r["spec"] is None, r
        if name == "fp8":
            assert r["fp8"] == "triton", r


def test_router_command_parses_with_sglang_router(validated):
    routers = {name: r for (kind, name, _), r in validated if kind == "router"}
    base, mn = routers["base"], routers["mn_decode"]
    assert base["pd"] is True and mn["pd"] is True
    assert base["prefill"] == [["http://127.0.0.1:30100", 8998]], base
    assert base["decode"] == ["http://127.0.0.1:30200"] and base["port"] == 30000, base
    assert base["prometheus_port"] == 29000
    # the router gives in-flight requests less time than the teardown waits before SIGKILL
    assert base["shutdown_grace_period_secs"] == 5 < 30
    assert mn["prefill"] == [["http://10.1.0.1:30100", 8998]], mn
    assert mn["decode"] == ["http://10.1.0.2:30200"], mn


def test_replica_commands_parse_with_sglang_and_the_router(validated, outputs):
    """PREFILL_GPUS=0,1;2,3 DECODE_GPUS=4,5;6,7: four servers SGLang's parser takes (one resolved), each on its own
    ports, and a router command the router's parser takes with every prefill (its own bootstrap port) and every
    decode server."""
    reps = {role: r for (kind, _, role), r in validated if kind == "replica"}
    assert set(reps) == {"prefill1", "prefill2", "decode1", "decode2"}
    for role, r in reps.items():
        assert r["ok"] and r["tp"] == 2 and r["mode"] == role.rstrip("12"), (role, r)
    assert reps["decode2"]["resolved"] and reps["decode2"]["spec"] == "EAGLE", reps["decode2"]
    router = next(r for (kind, name, _), r in validated if kind == "router" and name == "replicas")
    assert router["prefill"] == [["http://127.0.0.1:30100", 8998], ["http://127.0.0.1:30101", 8999]], router
    assert router["decode"] == ["http://127.0.0.1:30200", "http://127.0.0.1:30201"], router
    assert router["decode_policy"] == "round_robin"
    base = next(r for (kind, name, _), r in validated if kind == "router" and name == "base")
    assert base["decode_policy"] is None            # one decode server: the router's own default
    cmds = commands(outputs["replicas"])
    ports = [a[a.index("--port") + 1] for _, a in cmds.values()]
    boots = [a[a.index("--disaggregation-bootstrap-port") + 1] for r, (_, a) in cmds.items() if r.startswith("prefill")]
    assert ports == ["30100", "30101", "30200", "30201", "30000"] and boots == ["8998", "8999"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e, _ in list(cmds.values())[:4]] == ["0,1", "2,3", "4,5", "6,7"]
    for role in ("prefill1", "decode2"):
        assert f"log {role}: /tmp/dsv4-dry-run-dir/{role}.log" in outputs["replicas"]
        assert f"all-reduce {role}: " in outputs["replicas"]


def test_base_and_mtp_share_everything_but_speculation(outputs):
    b, m = commands(outputs["base"]), commands(outputs["mtp"])
    spec = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", "4", "--enable-metrics"]
    for role in ("prefill", "decode"):
        mb = m[role][1]
        i = mb.index("--speculative-algorithm")
        assert mb[i:i + len(spec)] == spec
        assert mb[:i] + mb[i + len(spec):] == b[role][1], role
        assert m[role][0] == b[role][0]
    assert m["router"] == b["router"]
    # the MTP script holds no launch logic of its own
    text = (SERVE / "serve_dsv4_mtp.sh").read_text()
    assert "serve_dsv4_tp4.sh" in text
    assert "launch_server" not in text and "--disaggregation" not in text and "sglang_router" not in text


def test_default_plan_matches_the_issue(outputs):
    out = outputs["base"]
    cmds = commands(out)
    penv, pargv = cmds["prefill"]
    denv, dargv = cmds["decode"]
    assert penv["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and denv["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert pargv[0] == f"{VENV}/bin/python" and dargv[0] == f"{VENV}/bin/python"
    assert pargv[pargv.index("--model-path") + 1] == "deepseek-ai/DeepSeek-V4-Flash"
    assert "--cuda-graph-max-bs-decode" in dargv and "--cuda-graph-max-bs" not in dargv
    assert pargv[pargv.index("--disaggregation-bootstrap-port") + 1] == "8998"
    assert penv["SGLANG_TORCH_PROFILER_DIR"] == "/tmp/dsv4-dry-run-dir/profile"
    # the all-reduce is per server: decode's latency protocol is not forced on the prefill server (docs/pcie.md)
    assert (denv["NCCL_PROTO"], denv["NCCL_ALGO"]) == ("LL", "Ring") and "NCCL_PROTO" not in penv
    for needle in ("all-reduce prefill: default: no NCCL_PROTO", "env SGLANG_DISAGGREGATION_NIXL_BACKEND=UCX",
                   "env CUDA_DEVICE_ORDER=PCI_BUS_ID", "health router: http://127.0.0.1:30000/health",
                   "log decode: /tmp/dsv4-dry-run-dir/decode.log"):
        assert needle in out, needle
    # nothing is single-host specific in a loopback plan
    assert "SGLANG_HOST_IP" not in out


def test_multi_node_plans(outputs):
    p = commands(outputs["mn_prefill"])
    assert set(p) == {"prefill"}
    env, argv = p["prefill"]
    assert env["SGLANG_HOST_IP"] == "10.1.0.1" and argv[argv.index("--host") + 1] == "10.1.0.1"
    assert argv[argv.index("--disaggregation-ib-device") + 1] == "mlx5_0"
    d = commands(outputs["mn_decode"])
    assert set(d) == {"decode", "router"}
    env, argv = d["decode"]
    assert env["SGLANG_HOST_IP"] == "10.1.0.2" and env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    r = d["router"][1]
    i = r.index("--prefill")
    assert r[i + 1:i + 3] == ["http://10.1.0.1:30100", "8998"]
    assert r[r.index("--decode") + 1] == "http://10.1.0.2:30200"
    assert "health prefill (other host): http://10.1.0.1:30100/health" in outputs["mn_decode"]


def test_dry_run_flag_equals_variable_and_prints_the_plan_without_the_env():
    a = dry_run("serve_dsv4_tp4.sh").stdout
    b = dry_run("serve_dsv4_tp4.sh", {"DRY_RUN": "1"}, args=()).stdout
    assert a == b
    # without the serving environment the plan is still printed, and the python check refuses as a start would
    c = dry_run("serve_dsv4_mtp.sh", {"VENV": "/nonexistent-venv"}, check=False)
    assert "/nonexistent-venv/bin/python -m sglang.launch_server" in c.stdout
    st = preflight_status(c.stdout)
    assert c.returncode == 1 and st["python"] == "FAILED", c.stdout + c.stderr
    assert st["router"] == st["profile"] == "not run (needs the python check, which failed)", st
    assert c.stderr.splitlines()[0] == ("[serve] preflight: no python at /nonexistent-venv/bin/python: run `make setup` "
                                        "or set VENV to the serving environment"), c.stderr


@pytest.mark.parametrize("env,needle", [
    ({"PREFILL_GPUS": "0,1,2"}, "PREFILL_GPUS"),
    ({"DECODE_GPUS": "3,4,5,6"}, "share GPUs"),
    ({"DECODE_PORT": "30100"}, "configured twice"),
    ({"MAX_RUNNING": "lots"}, "MAX_RUNNING"),
    ({"NODE_ROLE": "prefil"}, "unknown role"),
    ({"FP8_GEMM_BACKEND": "fastest"}, "FP8_GEMM_BACKEND"),
    ({"DECODE_EXTRA_ARGS": "--foo 'unterminated"}, "DECODE_EXTRA_ARGS"),
])
def test_config_errors_are_one_line(env, needle):
    r = dry_run("serve_dsv4_tp4.sh", env, check=False)
    assert r.returncode == 2, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_mtp_config_errors():
    r = dry_run("serve_dsv4_mtp.sh", {"SPEC_EAGLE_TOPK": "2"}, check=False)
    assert r.returncode == 2 and "topk 1" in r.stderr
    r = dry_run("serve_dsv4_mtp.sh", {"SPEC_NUM_STEPS": "2", "SPEC_NUM_DRAFT_TOKENS": "4"}, check=False)
    assert r.returncode == 2 and "steps + 1" in r.stderr
    r = dry_run("serve_dsv4_mtp.sh", {"SPEC_NUM_STEPS": "2", "SPEC_NUM_DRAFT_TOKENS": "3"})
    argv = commands(r.stdout)["decode"][1]
    assert argv[argv.index("--speculative-num-steps") + 1] == "2"


def test_caller_environment_wins_over_env_files():
    out = dry_run("serve_dsv4_tp4.sh", {"NCCL_PROTO": "Simple", "DSV4_SM120_ATTN_BACKEND": "torch"}).stdout
    assert "env NCCL_PROTO=Simple  # environment" in out
    # yours reaches both servers; decode keeps its default algorithm, the prefill server none
    cmds = commands(out)
    assert "NCCL_PROTO" not in cmds["decode"][0] and cmds["decode"][0]["NCCL_ALGO"] == "Ring"
    assert "NCCL_ALGO" not in cmds["prefill"][0]
    assert "all-reduce decode: env NCCL_PROTO=Simple (yours); default: NCCL_PROTO=LL NCCL_ALGO=Ring" in out
    assert "env DSV4_SM120_ATTN_BACKEND=torch  # environment" in out
    out = dry_run("serve_dsv4_tp4.sh", {"DSV4_SM120_MOE_BACKEND": "stock", "UCX_TLS": "tcp",
                                        "DSV4_SM120_STANDIN_ROLE": "decode", "UNRELATED_VAR": "x"}).stdout
    assert "env DSV4_SM120_MOE_BACKEND=stock  # environment" in out
    assert "env UCX_TLS=tcp  # environment" in out
    assert "DSV4_SM120_STANDIN_ROLE" not in out and "UNRELATED_VAR" not in out


def test_fp8_backend_hook(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "overlay"))
    from dsv4_sm120.serving.plan import ConfigError, fp8_gemm_backend

    monkeypatch.delenv("DSV4_SM120_FP8_GEMM_BACKEND", raising=False)
    dev = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    assert fp8_gemm_backend("auto", tmp_path, dev)[0] is None          # no summary
    assert fp8_gemm_backend("auto", tmp_path, None)[0] is None         # no GPU
    d = tmp_path / "configs" / "fp8"
    d.mkdir(parents=True)
    summ = d / "summary_NVIDIA_RTX_PRO_6000_Blackwell_Server_Edition.json"
    summ.write_text(json.dumps({"shapes": {"N=1,K=1": {"complete": True}},
                                "decision": {"recommended_backend": "triton", "reason": "tuned wins"}}))
    b, why = fp8_gemm_backend("auto", tmp_path, dev)
    assert b == "triton" and "tuned wins" in why
    assert fp8_gemm_backend("auto", tmp_path, "NVIDIA H200")[0] is None   # other GPU: its own summary
    assert fp8_gemm_backend("cutlass", tmp_path, dev)[0] == "cutlass"     # explicit wins over the summary
    summ.write_text(json.dumps({"shapes": {"N=1,K=1": {"complete": False}},
                                "decision": {"recommended_backend": "triton", "reason": "x"}}))
    assert fp8_gemm_backend("auto", tmp_path, dev)[0] is None             # incomplete tuning
    summ.write_text(json.dumps({"shapes": {}, "decision": {"recommended_backend": None, "reason": "cutlass wins"}}))
    assert fp8_gemm_backend("auto", tmp_path, dev)[0] is None
    with pytest.raises(ConfigError):
        fp8_gemm_backend("warp-drive", tmp_path, dev)
    monkeypatch.setenv("DSV4_SM120_FP8_GEMM_BACKEND", "triton")
    assert fp8_gemm_backend("auto", tmp_path, None)[0] == "triton"


def test_docs_list_every_variable():
    sys.path.insert(0, str(REPO / "overlay"))
    from dsv4_sm120.serving.plan import VARIABLES

    doc = (REPO / "docs" / "serving.md").read_text()
    missing = [k for k in VARIABLES if f"`{k}`" not in doc]
    assert not missing, f"docs/serving.md does not document {missing}"


def test_start_profile_body_is_an_sglang_profile_request(validated):
    prof = {name: r for (kind, name, _), r in validated if kind == "profile"}
    good, bad = prof["start_profile"], prof["misspelt"]
    assert good["ok"] and good["num_steps"] == 7 and good["output_dir"] == "/tmp/traces", good
    assert good["activities"] == ["GPU", "CPU"] and good["profile_id"] == "pid-x"
    assert not bad["ok"] and bad["unknown"] == ["num_stepz"], bad


def test_docs_state_the_resolved_decode_graph_batch_sizes(validated):
    """docs/serving.md names, for the default MAX_RUNNING, the batch sizes SGLang really resolves."""
    doc = (REPO / "docs" / "serving.md").read_text()
    for (kind, name, role), r in validated:
        if kind == "server" and role == "decode" and name in ("base", "mtp"):
            listed = ", ".join(map(str, r["decode_graph_bs"]))
            assert f"batch sizes {listed} (" in doc, (name, listed)
    assert "1..MAX_RUNNING" not in doc


def _sections(out: str):
    """Kinds of the dry run's lines, in order: cmd, env, setting, comment, other."""
    kinds = []
    for line in out.splitlines():
        word = line.split(" ", 1)[0]
        kinds.append(word if word in ("cmd", "env", "setting") else "comment" if word == "#" else "other")
    return kinds


def test_dry_run_prints_commands_first_then_a_compact_environment(outputs):
    base = outputs["base"].splitlines()
    kinds = _sections(outputs["base"])
    # the header, then the three commands, before any environment or setting line
    assert kinds[:4] == ["comment", "cmd", "cmd", "cmd"], base[:5]
    assert kinds.count("cmd") == 3
    # settings: only those that differ from their defaults (the test sets VENV, RUN_DIR, PREFLIGHT_SKIP, NVIDIA_SMI)
    settings = [x for x in base if x.startswith("setting ")]
    assert settings == [f"setting VENV={VENV}", "setting RUN_DIR=/tmp/dsv4-dry-run-dir",
                        "setting PREFLIGHT_SKIP=patches", "setting NVIDIA_SMI=/nonexistent/nvidia-smi"], settings
    fp8 = [x for x in outputs["fp8"].splitlines() if x.startswith("setting ")]
    assert "setting MAX_RUNNING=8" in fp8 and "setting FP8_GEMM_BACKEND=triton" in fp8, fp8
    assert "setting DECODE_EXTRA_ARGS='--chunked-prefill-size 4096'" in fp8, fp8
    assert not any(x.startswith(("setting CONTEXT_LEN", "setting PREFILL_PORT")) for x in fp8), fp8
    # one line per environment variable, none twice
    env_keys = [x.split(" ", 2)[1].split("=", 1)[0] for x in base if x.startswith("env ")]
    assert len(env_keys) == len(set(env_keys)) and "CUDA_DEVICE_ORDER" in env_keys, env_keys
    # the plan is compact; the preflight's lines follow it
    first = next(i for i, x in enumerate(base) if x.startswith(("preflight ", "# preflight")))
    assert first < 32 and all(x.startswith(("preflight ", "# preflight")) for x in base[first:]), base


def test_internal_variables_are_not_shown_as_settings(outputs):
    """serve_dsv4_mtp.sh selects the variant through an internal variable: the user never set it."""
    for name in ("mtp", "mn_decode"):
        assert "DSV4_SM120_VARIANT" not in outputs[name], outputs[name]
    assert "variant=mtp" in outputs["mtp"].splitlines()[0]
    # a DSV4_* variable the user did set is still listed as theirs
    out = dry_run("serve_dsv4_mtp.sh", {"DSV4_SM120_ATTN_QK": "bf16"}).stdout
    assert "env DSV4_SM120_ATTN_QK=bf16  # environment" in out and "DSV4_SM120_VARIANT" not in out


@pytest.mark.parametrize("script", ["serve_dsv4_tp4.sh", "serve_dsv4_mtp.sh"])
@pytest.mark.parametrize("args", [("--bogus",), ("--dry-run", "--detatch"), ("MAX_RUNNING=8",)])
def test_unknown_argument_gets_the_scripts_usage(script, args):
    r = dry_run(script, args=args, check=False)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "" and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert f"unknown argument '{args[-1]}'" in lines[0], lines
    assert lines[-1].startswith("usage: ") and f"serve/{script}" in lines[-1] and "--dry-run" in lines[-1], lines
    # not the inner python module's argparse usage
    assert "{start,stop" not in r.stderr and "dsv4_sm120.serving.deploy" not in r.stderr


@pytest.mark.parametrize("script", ["serve_dsv4_tp4.sh", "serve_dsv4_mtp.sh"])
def test_help_lists_the_options(script):
    r = dry_run(script, args=("--help",))
    for opt in ("--dry-run", "--detach", "--help-vars"):
        assert opt in r.stdout, (opt, r.stdout)
    assert ("MTP" in r.stdout) == (script == "serve_dsv4_mtp.sh")
    r = dry_run(script, args=("--detach", "--help"))   # --help anywhere wins: nothing starts
    assert "--help-vars" in r.stdout


def test_stop_refuses_unknown_options(tmp_path):
    r = subprocess.run(["bash", str(SERVE / "stop.sh"), "--bogus"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, LOG_DIR=str(tmp_path)))
    assert r.returncode == 2 and "usage: serve/stop.sh" in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---------------------------------------------------------------------------- the dry run's preflight

sys.path.insert(0, str(REPO / "overlay"))
from dsv4_sm120.serving import preflight as pf  # noqa: E402
from dsv4_sm120.serving.plan import build_plan  # noqa: E402


def preflight_status(out: str) -> dict:
    """check name -> the rest of its `preflight NAME: ...` line."""
    return dict(x[len("preflight "):].split(": ", 1) for x in out.splitlines() if x.startswith("preflight "))


def test_dry_run_runs_the_checks_that_need_no_gpu_and_lists_the_rest(outputs):
    for name in ("base", "mtp", "fp8"):
        st = preflight_status(outputs[name])
        assert set(st) == {"env", "python", *pf.CHECKS}, st
        assert st["env"] == "ok" and st["model"].startswith("ok (the published config.json"), st
        assert st["python"] == st["ports"] == st["router"] == "ok" and st["patches"] == "skipped", st
        not_run = {k for k, v in st.items() if v.startswith("not run (dry run: ")}
        # nvidia-smi does not answer here: gpu, memory and profile wait for the start, as do the checks that move data
        assert not_run == {"gpu", "memory", "nixl", "p2p", "ucx", "profile"}, st
        assert st["gpu"] == ("not run (dry run: needs nvidia-smi, which does not answer here: /nonexistent/nvidia-smi "
                             "not found)"), st
    assert "the preflight's checks that need no GPU, NIXL or running server follow the plan" in \
        outputs["base"].splitlines()[0]
    # a router-only host runs no server: nothing to read
    assert preflight_status(outputs["mn_decode"])["model"].startswith("ok (the published")
    r = dry_run("serve_dsv4_tp4.sh", {"NODE_ROLE": "router", "MODEL_PATH": "/nonexistent/ckpt"})
    assert preflight_status(r.stdout)["model"] == "ok (no server on this host)", r.stdout
    # PREFLIGHT_SKIP applies as at start; an unknown name is the start's configuration error
    r = dry_run("serve_dsv4_tp4.sh", {"PREFLIGHT_SKIP": "model,patches", "MODEL_PATH": "/nonexistent/ckpt"})
    assert preflight_status(r.stdout)["model"] == "skipped"
    r = dry_run("serve_dsv4_tp4.sh", {"PREFLIGHT_SKIP": "gpus"}, check=False)
    assert r.returncode == 2 and "PREFLIGHT_SKIP='gpus' is not valid: unknown check(s) gpus" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def _model_dir(root: Path, kind: str) -> str:
    d = root / kind
    if kind == "llama":
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    elif kind == "garbage":
        d.mkdir()
        (d / "config.json").write_text("<html>not json</html>")
    elif kind == "no_config":
        d.mkdir()
    return str(d)      # "missing": never created


# The settings a start refuses that a dry run must refuse too: (environment, text of the one failure line).
# MODEL_PATH values naming a kind are directories made by _model_dir. The retired name and the typo are spelled in
# two parts (tests/test_settings.py flags every retired or unknown name written out in the tree).
RETIRED = "SGLANG_" + "DSV4_SM120_DISABLE"
TYPO = "DSV4_SM120_" + "ATTN_BAKEND"
REFUSED = {
    "missing": ({"MODEL_PATH": "missing"}, "does not exist and is not a Hugging Face id"),
    "no_config": ({"MODEL_PATH": "no_config"}, "has no readable config.json"),
    "llama": ({"MODEL_PATH": "llama"}, "model_type is 'llama', expected deepseek_v4"),
    "garbage": ({"MODEL_PATH": "garbage"}, "config.json is not valid JSON"),
    "invalid_value": ({"DSV4_SM120_ATTN_BACKEND": "bogus"}, "DSV4_SM120_ATTN_BACKEND='bogus' is not valid"),
    "retired_name": ({RETIRED: "1"}, f"{RETIRED} was renamed to DSV4_SM120_DISABLE"),
    "typo": ({TYPO: "dsv4"}, f"{TYPO} is not a dsv4_sm120 setting"),
    "expandable": ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True"},
                   "PYTORCH_CUDA_ALLOC_CONF='max_split_size_mb:512,expandable_segments:True' turns on "
                   "expandable_segments"),
    "expandable_new_name": ({"PYTORCH_ALLOC_CONF": "expandable_segments:true"}, "PYTORCH_ALLOC_CONF="),
}


@pytest.mark.parametrize("script", ["serve_dsv4_tp4.sh", "serve_dsv4_mtp.sh"])
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_dry_run_refuses_what_the_preflight_refuses(case, script, tmp_path, monkeypatch):
    env, needle = REFUSED[case]
    env = {k: (_model_dir(tmp_path, v) if k == "MODEL_PATH" else v) for k, v in env.items()}
    r = dry_run(script, env, check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr, (r.returncode, r.stdout, r.stderr)
    failure = [x for x in r.stderr.splitlines() if needle in x]
    assert len(failure) == 1, r.stderr
    # the line the real start's preflight refuses with, from the same check functions
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    for k, v in env.items():
        if k != "MODEL_PATH":
            monkeypatch.setenv(k, v)
    plan = build_plan({"VENV": VENV, "RUN_DIR": str(tmp_path / "run"), "NVIDIA_SMI": "/nonexistent/nvidia-smi",
                       "PREFLIGHT_SKIP": "ports,gpu,patches,nixl,numa,p2p,ucx,router,profile",
                       "MODEL_PATH": env.get("MODEL_PATH", "deepseek-ai/DeepSeek-V4-Flash")}, "base")
    lines = pf.run_preflight(plan, say=lambda _: None)
    assert len(lines) == 1 and needle in lines[0], lines
    if script == "serve_dsv4_tp4.sh":
        # the plan is still printed (cmd lines for external checks), then the failing check and why
        assert set(commands(r.stdout)) == {"prefill", "decode", "router"}, r.stdout
        assert r.returncode == 1 and failure == [f"[serve] preflight: {lines[0]}"], r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("[serve] dry run: 1 preflight failure(s)"), r.stderr
        st = preflight_status(r.stdout)
        assert st["model" if "MODEL_PATH" in env else "env"] == "FAILED", st
    elif "MODEL_PATH" in env:
        # the MTP plan needs the config to choose its flags: the same line, as a configuration error
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"[serve] configuration error: {lines[0]}"], \
            r.stderr
    else:
        assert r.returncode == 1 and failure == [f"[serve] preflight: {lines[0]}"], r.stderr


def test_dry_run_passes_an_allocator_setting_without_expandable_segments():
    for v in ("expandable_segments:False", "max_split_size_mb:512"):
        r = dry_run("serve_dsv4_tp4.sh", {"PYTORCH_CUDA_ALLOC_CONF": v})
        assert preflight_status(r.stdout)["env"] == "ok"
    # only NIXL registers the KV cache this way
    r = dry_run("serve_dsv4_tp4.sh", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                                      "TRANSFER_BACKEND": "mooncake"})
    assert preflight_status(r.stdout)["env"] == "ok", r.stdout + r.stderr


@pytest.mark.parametrize("script", ["serve_dsv4_tp4.sh", "serve_dsv4_mtp.sh"])
def test_a_local_model_path_reaches_every_command_absolute(script, tmp_path):
    """MODEL_PATH=out/nvfp4 (relative to where the command runs) or a quoted "~/..." would reach the servers, which
    run in their run directory, unchanged: a path that does not exist there and reads as a Hub id. The plan passes
    it on absolute: to both servers, the draft detection and the calibration command."""
    work = tmp_path / "work"
    ckpt = write_dsv4_config(work / "out" / "nvfp4")
    for value, env in (("out/nvfp4", {}), ("./out/nvfp4", {}), ("~/out/nvfp4", {"HOME": str(work)})):
        # (a config.json without weights: the dry run's model check would refuse it, rightly)
        r = dry_run(script, {"MODEL_PATH": value, "CALIBRATE": "1", "PREFLIGHT_SKIP": "patches,model", **env},
                    cwd=work)
        cmds = commands(r.stdout)
        for role in ("prefill", "decode"):
            argv = cmds[role][1]
            assert argv[argv.index("--model-path") + 1] == str(ckpt), (value, argv)
        assert cmds["calibrate"][0]["MODEL_PATH"] == str(ckpt), (value, cmds["calibrate"])
        assert f"setting MODEL_PATH={ckpt}" in r.stdout
        if script == "serve_dsv4_mtp.sh":   # the draft was read from the checkout's config.json
            assert f"# speculative decoding: EAGLE chosen from {ckpt}/config.json" in r.stdout, r.stdout
    # a Hub id stays a Hub id
    r = dry_run(script, {"MODEL_PATH": "deepseek-ai/DeepSeek-V4-Flash"}, cwd=work)
    argv = commands(r.stdout)["decode"][1]
    assert argv[argv.index("--model-path") + 1] == "deepseek-ai/DeepSeek-V4-Flash"


def test_measure_gives_the_load_generator_an_absolute_tokenizer_path(tmp_path, monkeypatch):
    """The load generator runs in the results directory: a relative --model / MODEL_PATH must reach it absolute."""
    from dsv4_sm120.perf import measure

    (tmp_path / "tok").mkdir()
    monkeypatch.chdir(tmp_path)
    cmd = measure.bench_cmd("py", "http://r", "tok", 1, 8, 8, 4, "/o.jsonl", "random-ids", 1, 0)
    assert cmd[cmd.index("--model") + 1] == cmd[cmd.index("--tokenizer") + 1] == str(tmp_path / "tok")
    cmd = measure.bench_cmd("py", "http://r", "deepseek-ai/DeepSeek-V4-Flash", 1, 8, 8, 4, "/o", "random-ids", 1, 0)
    assert cmd[cmd.index("--tokenizer") + 1] == "deepseek-ai/DeepSeek-V4-Flash"


@pytest.mark.parametrize("kind", ["proc", "file", "under_file", "run_dir_proc"])
def test_an_unwritable_log_dir_is_one_line_at_plan_time(kind, tmp_path):
    """LOG_DIR=/proc/x/logs or a LOG_DIR that is a file: one line naming the path, exit 2, in the dry run and at a
    start (which used to run every check and then die with a traceback from deploy.py)."""
    f = tmp_path / "a-file"
    f.write_text("x")
    var, value = {"proc": ("LOG_DIR", "/proc/dsv4-nonexistent/logs"), "file": ("LOG_DIR", str(f)),
                  "under_file": ("LOG_DIR", str(f / "logs")),
                  "run_dir_proc": ("RUN_DIR", "/proc/dsv4-nonexistent/run")}[kind]
    for args in (("--dry-run",), ()):
        env = {var: value, "DSV4_SM120_SERVE_STANDIN": "1"}
        if var == "LOG_DIR":
            env["RUN_DIR"] = ""
        r = dry_run("serve_dsv4_tp4.sh", env, args=args, check=False)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (args, r.stdout, r.stderr)
        assert lines[0].startswith(f"[serve] configuration error: {var}={value}: the run directory cannot go there"), lines
        assert f"set {var} to a writable directory" in lines[0]
        assert r.stdout == "", r.stdout        # nothing ran: not the plan, not a check
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]    # the probe left nothing


OWNED_CASES = [  # (variable, extra args, variant, the variable the refusal names)
    ("SERVER_EXTRA_ARGS", "--tp=2 --context-length 1024", "base", "PREFILL_GPUS / DECODE_GPUS"),
    ("SERVER_EXTRA_ARGS", "--tp-size 2", "base", "PREFILL_GPUS / DECODE_GPUS"),
    ("PREFILL_EXTRA_ARGS", "--tensor-parallel-size=8", "base", "PREFILL_GPUS / DECODE_GPUS"),
    ("DECODE_EXTRA_ARGS", "--enable-metrics --context-length=1024", "base", "CONTEXT_LEN"),
    ("SERVER_EXTRA_ARGS", "--context-len 1024", "base", "CONTEXT_LEN"),
    ("DECODE_EXTRA_ARGS", "--mem-fraction-static 0.95", "base", "MEM_FRACTION"),
    ("SERVER_EXTRA_ARGS", "--model-path /x", "base", "MODEL_PATH"),
    ("PREFILL_EXTRA_ARGS", "--model=/x", "base", "MODEL_PATH"),
    ("DECODE_EXTRA_ARGS", "--port 1234", "base", "PREFILL_PORT / DECODE_PORT"),
    ("SERVER_EXTRA_ARGS", "--host=0.0.0.0", "base", "PREFILL_HOST / DECODE_HOST"),
    ("DECODE_EXTRA_ARGS", "--base-gpu-id 2", "base", "PREFILL_GPUS / DECODE_GPUS"),
    ("PREFILL_EXTRA_ARGS", "--disaggregation-mode decode", "base", "NODE_ROLE"),
    ("PREFILL_EXTRA_ARGS", "--disaggregation-bootstrap-port=9000", "base", "BOOTSTRAP_PORT"),
    ("SERVER_EXTRA_ARGS", "--disaggregation-transfer-backend mooncake", "base", "TRANSFER_BACKEND"),
    ("DECODE_EXTRA_ARGS", "--max-running-requests 64", "base", "MAX_RUNNING"),
    ("DECODE_EXTRA_ARGS", "--cuda-graph-max-bs-decode=64", "base", "MAX_RUNNING"),
    ("PREFILL_EXTRA_ARGS", "--max-running-requests 64", "base", "PREFILL_MAX_RUNNING"),
    ("PREFILL_EXTRA_ARGS", "--chunked-prefill-size 4096", "base", "CHUNKED_PREFILL_SIZE"),
    ("SERVER_EXTRA_ARGS", "--served-model-name x", "base", "SERVED_MODEL_NAME"),
    ("SERVER_EXTRA_ARGS", "--fp8-gemm-backend=triton", "base", "FP8_GEMM_BACKEND"),
    ("SERVER_EXTRA_ARGS", "--speculative-num-steps 5", "mtp", "SPEC_NUM_STEPS"),
    ("DECODE_EXTRA_ARGS", "--speculative-algorithm=DSPARK", "mtp", "SPEC_ALGORITHM"),
    ("ROUTER_EXTRA_ARGS", "--port=1", "base", "ROUTER_PORT"),
    ("ROUTER_EXTRA_ARGS", "--prometheus-port 1", "base", "ROUTER_PROMETHEUS_PORT"),
    ("ROUTER_EXTRA_ARGS", "--decode http://x:1", "base", "DECODE_HOST / DECODE_PORT"),
]


@pytest.mark.parametrize("var,extra,variant,names", OWNED_CASES)
def test_extra_args_may_not_pass_flags_the_plan_sets(var, extra, variant, names):
    """*_EXTRA_ARGS come after the plan's flags and SGLang keeps the last value: TP2 on four GPUs, CONTEXT_LEN's
    range check bypassed. Refused, in both forms and abbreviated, naming the variable to set instead."""
    script = "serve_dsv4_mtp.sh" if variant == "mtp" else "serve_dsv4_tp4.sh"
    r = dry_run(script, {var: extra}, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    flag = next(t for t in shlex.split(extra) if t.startswith("--") and t != "--enable-metrics").split("=")[0]
    assert lines[0].startswith(f"[serve] configuration error: {var} passes {flag}, ") and names in lines[0], lines


def test_extra_args_the_plan_does_not_set_pass_through():
    out = dry_run("serve_dsv4_tp4.sh", {"SERVER_EXTRA_ARGS": "--moe-runner-backend=triton --enable-metrics",
                                        "DECODE_EXTRA_ARGS": "--numa-node 1 1 1 1 --chunked-prefill-size 4096",
                                        "PREFILL_EXTRA_ARGS": "--speculative-algorithm NGRAM",
                                        "ROUTER_EXTRA_ARGS": "--policy round_robin"}).stdout
    cmds = commands(out)
    dec = cmds["decode"][1]
    assert dec[-9:] == ["--moe-runner-backend=triton", "--enable-metrics", "--numa-node", "1", "1", "1", "1",
                        "--chunked-prefill-size", "4096"], dec
    assert dec.count("--numa-node") == 1           # the user's, not the plan's as well
    assert cmds["prefill"][1][-2:] == ["--speculative-algorithm", "NGRAM"]
    assert cmds["router"][1][-2:] == ["--policy", "round_robin"]


OWNED_VS_PARSERS = textwrap.dedent(r"""
    import argparse, json, sys
    from sglang.srt.server_args import ServerArgs
    from sglang_router.router_args import RouterArgs
    from dsv4_sm120.serving import extra_args as X
    server = argparse.ArgumentParser(); ServerArgs.add_cli_args(server)
    router = argparse.ArgumentParser(); RouterArgs.add_cli_args(router, use_router_prefix=False)
    out = {}
    for name, parser, owned in (("server", server, set(X.SERVER_BOTH) | set(X.SPECULATIVE)
                                 | {f for d in X.SERVER_ROLE.values() for f in d}),
                                ("router", router, set(X.ROUTER))):
        by_dest = {}
        for a in parser._actions:
            by_dest.setdefault(a.dest, set()).update(o for o in a.option_strings if o.startswith("--"))
        unknown = sorted(f for f in owned if not any(f in opts for opts in by_dest.values()))
        aliases = sorted(o for opts in by_dest.values() if opts & owned for o in opts - owned)
        # a full option the plan does not own that is a prefix of one it does would be refused by mistake
        shadowed = sorted(o for opts in by_dest.values() for o in opts - owned if any(f.startswith(o) for f in owned))
        out[name] = {"unknown": unknown, "aliases": aliases, "shadowed": shadowed}
    print("RESULT" + json.dumps(out))
""")


def test_owned_flags_are_every_alias_the_real_parsers_know(python_child):
    r = python_child(OWNED_VS_PARSERS, env=dict(os.environ, PYTHONPATH=str(REPO / "overlay")), cwd="/tmp")
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert line, r.stderr[-3000:]
    res = json.loads(line[-1][len("RESULT"):])
    for name in ("server", "router"):
        assert res[name] == {"unknown": [], "aliases": [], "shadowed": []}, (name, res[name])


def fake_smi(d: Path, n: int = 8) -> str:
    """An nvidia-smi that answers the serving code's queries for n RTX PRO 6000s (tests/pcie_box.py's table)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from pcie_box import BUS, SMI_TABLE

    d.mkdir(parents=True, exist_ok=True)
    (d / "table.txt").write_text("\n".join(SMI_TABLE.splitlines()[:n]) + "\n")
    (d / "names.txt").write_text("".join(f"{i}, NVIDIA RTX PRO 6000 Blackwell Server Edition\n" for i in range(n)))
    (d / "bus.txt").write_text("".join(f"{i}, {BUS[i]}\n" for i in range(n)))
    smi = d / "nvidia-smi"
    smi.write_text(f"""#!/bin/sh
case "$*" in
  *index,pci.bus_id*) cat "{d}/bus.txt" ;;
  *index,name,compute_cap*) cat "{d}/table.txt" ;;
  *query-gpu=index,name*) cat "{d}/names.txt" ;;
  *query-gpu=name*) echo "NVIDIA RTX PRO 6000 Blackwell Server Edition" ;;
  *) echo "unexpected: $*" >&2; exit 9 ;;
esac
""")
    smi.chmod(0o755)
    return str(smi)


def _listening_port():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("case", ["busy_port", "gpu_past_the_list", "no_weights", "unpatched"])
def test_dry_run_fails_on_what_it_can_see_without_a_gpu(case, tmp_path):
    """A busy port (a bind test), GPU 9 where nvidia-smi answers with 8, a checkpoint directory without
    *.safetensors, an unpatched SGLang (the test environment's own): each passed the dry run (exit 0) though a start
    refuses it. Now the dry run refuses them, with the start's own line."""
    sock = _listening_port() if case == "busy_port" else None
    try:
        env = {"busy_port": {"ROUTER_PORT": str(sock.getsockname()[1]) if sock else ""},
               "gpu_past_the_list": {"NVIDIA_SMI": fake_smi(tmp_path / "smi"), "DECODE_GPUS": "4,5,6,9"},
               "no_weights": {"MODEL_PATH": str(write_dsv4_config(tmp_path / "ckpt"))},
               "unpatched": {"PREFLIGHT_SKIP": ""}}[case]
        r = dry_run("serve_dsv4_tp4.sh", env, check=False)
        plan = build_plan({"VENV": VENV, "RUN_DIR": str(tmp_path / "run"), "NVIDIA_SMI": "/nonexistent/nvidia-smi",
                           **env}, "base")
        check = {"busy_port": "ports", "gpu_past_the_list": "gpu", "no_weights": "model", "unpatched": "patches"}[case]
        want = pf.RUNNERS[check](plan)
        want = want[0] if isinstance(want, tuple) else want
    finally:
        if sock:
            sock.close()
    assert len(want) == 1, want                    # the start's line, from the same check function
    needle = {"busy_port": "is already in use", "gpu_past_the_list": "decode: GPU 9 not found (nvidia-smi lists 8 "
              "GPU(s): 0,1,2,3,4,5,6,7)", "no_weights": "no *.safetensors weights",
              "unpatched": "is not patched: run `make apply-patches`"}[case]
    assert needle in want[0], want
    assert r.returncode == 1 and "Traceback" not in r.stderr, (r.returncode, r.stdout[-2000:], r.stderr)
    assert r.stderr.splitlines() == [f"[serve] preflight: {want[0]}",
                                     "[serve] dry run: 1 preflight failure(s); a start with these settings would refuse"]
    st = preflight_status(r.stdout)
    assert st[check] == "FAILED", st
    # "not run" is left for what needs the GPUs moving data, NIXL, or a failed check it depends on
    not_run = {k for k, v in st.items() if v.startswith("not run")}
    assert not_run <= {"gpu", "memory", "profile", "nixl", "p2p", "ucx"}, st
    if case == "gpu_past_the_list":
        assert st["p2p"] == st["ucx"] == st["profile"] == st["memory"] == "not run (needs the gpu check, which failed)", st


def test_dry_run_runs_the_gpu_and_profile_checks_where_nvidia_smi_answers(tmp_path):
    """With nvidia-smi answering, gpu and profile run in the dry run too, and nothing reaches stderr unprefixed
    (the machine profile lookup used to log "dsv4_sm120 profile: no profile ..." there)."""
    r = dry_run("serve_dsv4_tp4.sh", {"NVIDIA_SMI": fake_smi(tmp_path / "smi"),
                                      "DSV4_SM120_PROFILE_DIR": str(tmp_path / "no-profiles")})
    st = preflight_status(r.stdout)
    lines = r.stdout.splitlines()
    assert "preflight gpu: ok" in lines and "preflight profile: ok" in lines, r.stdout
    assert any(x.startswith("preflight profile: WARNING: no matching machine profile for NVIDIA RTX PRO 6000")
               for x in r.stdout.splitlines()), r.stdout
    assert {k for k, v in st.items() if v.startswith("not run")} == {"nixl", "p2p", "ucx"}, st
    assert r.stderr == "", r.stderr
    assert "needs nvidia-smi" not in r.stdout


def test_the_mtp_script_names_the_closest_published_id():
    r = dry_run("serve_dsv4_mtp.sh", {"MODEL_PATH": "deepseek-ai/DeepSeek-V4-Flsh"}, check=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "[serve] configuration error: MODEL_PATH=deepseek-ai/DeepSeek-V4-Flsh is not in the local Hugging Face cache "
        "nor a published checkpoint: did you mean deepseek-ai/DeepSeek-V4-Flash?"], r.stderr
