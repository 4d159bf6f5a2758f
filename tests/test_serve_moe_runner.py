"""The serve plan passes the machine profile's MXFP4 MoE runner to SGLang: ``--moe-runner-backend <winner>`` on
both servers when MODEL_PATH has MXFP4 routed experts (its config.json, local or in the local Hugging Face cache,
or the published DeepSeek-V4-Flash; a Hub id whose format is unknown here gets no flag), a
profile matches the decode GPU's nvidia-smi name and the serving python's versions, it has a ``moe.mxfp4``
winner that is a valid SGLang choice, and no ``*_EXTRA_ARGS`` already carries the flag. Otherwise nothing is
added. The dry run says which and why (``# moe runner: ...``); the commands parse with SGLang's own parser."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "overlay"))
sys.path.insert(0, str(REPO / "tests"))
from dsv4_sm120 import moe_runner  # noqa: E402
from dsv4_sm120 import machine_profile as P  # noqa: E402
from dsv4_sm120.serving import plan as C  # noqa: E402
from pcie_box import make_smi  # noqa: E402
from test_model_config import MXFP4, NVFP4, hf_cache  # noqa: E402
from test_serve_dryrun import commands, dry_run, server_argv  # noqa: E402

GPU = "NVIDIA RTX PRO 6000 Blackwell Server Edition"    # what pcie_box's fake nvidia-smi names every GPU
RUNNERS = ("flashinfer_mxfp4", "deep_gemm", "marlin")   # calibrate.moe.MXFP4_RUNNERS

# In the test environment's python with the real sglang: each argv's --moe-runner-backend as
# prepare_server_args parses it, or "error: <its message>".
PARSE = """
import contextlib, io, json, sys
from sglang.srt.server_args import prepare_server_args
out = []
for argv in json.load(sys.stdin):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            out.append(str(prepare_server_args(argv).moe_runner_backend))
    except SystemExit:
        out.append("error: " + err.getvalue()[-600:])
print("RESULT" + json.dumps(out))
"""


def save_profile(directory: Path, winners: dict, versions: dict, gpu: str = GPU) -> Path:
    """A profile whose ``moe.mxfp4`` buckets are won by ``winners`` ({tokens: runner})."""
    buckets = {}
    for b, w in winners.items():
        cands = {r: {"status": "ok", "us": 10.0 + i, "err": 0.0, "tol": 0.08} for i, r in enumerate(RUNNERS)}
        cands.setdefault(w, {"status": "ok", "us": 1.0, "err": 0.0, "tol": 0.08})
        buckets[str(b)] = {"winner": w, "candidates": cands}
    return P.save({"schema": P.SCHEMA, "gpu": gpu, "created_at": P.now_iso(), "versions": versions,
                   "deployment": {"moe_format": "mxfp4"},
                   "decisions": {"moe.mxfp4": {"bucket_kind": "tokens", "default": "flashinfer_mxfp4",
                                               "buckets": buckets}}},
                  P.profile_path(gpu, directory))


def plan_text(tmp_path, profile_dir, **kv):
    smi = tmp_path / "smi" / "nvidia-smi"
    if not smi.exists():
        smi.parent.mkdir()
        make_smi(smi)
    # config.json-only checkpoints (their shard headers are the model check's own tests)
    env = {"NVIDIA_SMI": str(smi), "DSV4_SM120_PROFILE_DIR": str(profile_dir), "FP8_GEMM_BACKEND": "cutlass", "NUMA_BIND": "0",
           "DSV4_SM120_SERVE_SYSFS_ROOT": str(tmp_path / "nosysfs"), "PREFLIGHT_SKIP": "patches,model"}
    env.update(kv)
    return dry_run("serve_dsv4_tp4.sh", env).stdout


def moe_args(out):
    """role -> the values of --moe-runner-backend in that server's argv."""
    res = {}
    for role, (_, argv) in commands(out).items():
        if role in ("prefill", "decode"):
            res[role] = [argv[i + 1] for i, t in enumerate(argv) if t == "--moe-runner-backend"]
    return res


def moe_line(out):
    (line,) = [x for x in out.splitlines() if x.startswith("# moe runner: ")]
    return line


def nvfp4_checkpoint(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
                                               "quantization_config": {"moe_quant_algo": "NVFP4"}}))
    return d


def test_runner_names_are_sglang_choices():
    from sglang.srt.arg_groups.choices import MOE_RUNNER_BACKEND_CHOICES

    assert set(moe_runner.MXFP4_RUNNER_FLAGS) == set(RUNNERS)
    assert set(moe_runner.MXFP4_RUNNER_FLAGS.values()) <= set(MOE_RUNNER_BACKEND_CHOICES)


def test_profile_winner_reaches_both_servers_and_parses(tmp_path, python_child):
    d = tmp_path / "profiles"
    versions = P.running_versions()
    rng = random.Random()
    win = rng.choice(["deep_gemm", "marlin"])            # not SGLang's default: the flag must come from the profile
    other = "flashinfer_mxfp4"
    # win takes 3 of 5 buckets, in random positions
    keys = [1, 4, 16, 64, 256]
    won = set(rng.sample(keys, 3))
    path = save_profile(d, {b: (win if b in won else other) for b in keys}, versions)
    out = plan_text(tmp_path, d)
    assert moe_args(out) == {"prefill": [win], "decode": [win]}, out
    line = moe_line(out)
    assert line.startswith(f"# moe runner: {win}: profile {path}") and f"{win} won M=" in line, line

    # the user's flag wins: nothing added, whichever *_EXTRA_ARGS carries it
    for key in ("SERVER_EXTRA_ARGS", "PREFILL_EXTRA_ARGS", "DECODE_EXTRA_ARGS"):
        user = plan_text(tmp_path, d, **{key: "--moe-runner-backend=triton"})
        got = moe_args(user)
        assert got["prefill"] == [] and got["decode"] == [], user
        assert moe_line(user) == f"# moe runner: your --moe-runner-backend in {key} wins", user
    user = plan_text(tmp_path, d, DECODE_EXTRA_ARGS="--moe-runner-backend triton")
    assert moe_args(user) == {"prefill": [], "decode": ["triton"]}, user

    # SGLang 0.5.23's own parser takes the commands, and the flag lands in its server arguments; a value it
    # does not know is refused by the same parser (the check can fail)
    bad = plan_text(tmp_path, d, DECODE_EXTRA_ARGS="--moe-runner-backend no_such_runner")
    argvs = [server_argv(commands(x)[role][1]) for x, role in
             ((out, "prefill"), (out, "decode"), (user, "prefill"), (user, "decode"), (bad, "decode"))]
    r = python_child(PARSE, input=json.dumps(argvs), timeout=300, cwd="/tmp")
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert line, r.stderr[-3000:]
    got = json.loads(line[-1][len("RESULT"):])
    assert got[:4] == [win, win, "auto", "triton"], got
    assert got[4].startswith("error") and "no_such_runner" in got[4], got[4]


def test_no_flag_without_a_usable_profile_or_with_nvfp4(tmp_path):
    d = tmp_path / "profiles"
    versions = P.running_versions()

    # no profile file
    out = plan_text(tmp_path, d)
    assert moe_args(out) == {"prefill": [], "decode": []}, out
    assert "SGLang default (no matching machine profile" in moe_line(out) and "make calibrate" in moe_line(out)

    # a profile measured with another torch: not used
    path = save_profile(d, {1: "marlin", 16: "marlin"}, dict(versions, torch="0.0.1"))
    out = plan_text(tmp_path, d)
    assert moe_args(out) == {"prefill": [], "decode": []}, out
    assert "torch 0.0.1 in profile" in moe_line(out), moe_line(out)

    # a profile for another GPU model only
    path.unlink()
    save_profile(d, {1: "marlin"}, versions, gpu="NVIDIA H200")
    out = plan_text(tmp_path, d)
    assert moe_args(out) == {"prefill": [], "decode": []} and "no matching machine profile" in moe_line(out)

    # a matching profile whose winner is not an SGLang runner: skipped with a note
    save_profile(d, {1: "dsv4_kernel", 4: "dsv4_kernel"}, versions)
    out = plan_text(tmp_path, d)
    assert moe_args(out) == {"prefill": [], "decode": []}, out
    assert "'dsv4_kernel'" in moe_line(out) and "skipped" in moe_line(out), moe_line(out)

    # a matching profile with a valid winner, but an NVFP4 checkpoint: the patched SGLang decides, no flag
    save_profile(d, {1: "marlin", 4: "marlin"}, versions)
    assert moe_args(plan_text(tmp_path, d)) == {"prefill": ["marlin"], "decode": ["marlin"]}
    out = plan_text(tmp_path, d, MODEL_PATH=str(nvfp4_checkpoint(tmp_path / "nvfp4")))
    assert moe_args(out) == {"prefill": [], "decode": []}, out
    assert "not added: NVFP4 routed experts" in moe_line(out), moe_line(out)

    # no nvidia-smi: no GPU name, no profile
    out = plan_text(tmp_path, d, NVIDIA_SMI="/nonexistent/nvidia-smi")
    assert moe_args(out) == {"prefill": [], "decode": []}, out
    assert moe_line(out) == "# moe runner: SGLang default (no GPU name from nvidia-smi, so no machine profile applies)"


def test_hub_id_format_comes_from_the_hugging_face_cache_or_gets_no_flag(tmp_path):
    """An NVFP4 checkpoint named by its Hub id must not get the MXFP4 winner: its config.json is read from the local
    Hugging Face cache, and a Hub id whose format is not known here gets no flag."""
    d = tmp_path / "profiles"
    save_profile(d, {1: "marlin", 4: "marlin"}, P.running_versions())
    hub = tmp_path / "hf" / "hub"
    repo = "someone/DeepSeek-V4-Flash-NVFP4"
    kv = {"HF_HOME": str(tmp_path / "hf"), "MODEL_PATH": repo, "PREFLIGHT_SKIP": "patches"}   # a Hub id: no shards read

    out = plan_text(tmp_path, d, **kv)                                   # not downloaded: format unknown
    assert moe_args(out) == {"prefill": [], "decode": []}, out
    assert moe_line(out) == (f"# moe runner: not added: the MoE format of MODEL_PATH={repo} is unknown here (a Hub id "
                             f"not in the local Hugging Face cache); SGLang picks the runner from the checkpoint it "
                             f"loads"), moe_line(out)

    snap = hf_cache(hub, repo, NVFP4)                                     # downloaded: NVFP4, no flag
    out = plan_text(tmp_path, d, **kv)
    assert moe_args(out) == {"prefill": [], "decode": []}, out
    assert f"not added: NVFP4 routed experts (config.json in the local Hugging Face cache ({snap}/config.json))" \
        in moe_line(out), moe_line(out)
    assert "preflight model: ok (config.json in the local Hugging Face cache" in out, out

    (snap / "config.json").write_text(json.dumps(MXFP4))     # the cached config decides: MXFP4
    out = plan_text(tmp_path, d, **kv)
    assert moe_args(out) == {"prefill": ["marlin"], "decode": ["marlin"]}, out

    # HF_HUB_CACHE names the hub directory itself and wins over HF_HOME
    other = tmp_path / "other-hub"
    hf_cache(other, repo, NVFP4)
    out = plan_text(tmp_path, d, HF_HUB_CACHE=str(other), **kv)
    assert moe_args(out) == {"prefill": [], "decode": []} and str(other) in moe_line(out), moe_line(out)

    # the published DeepSeek-V4-Flash, not downloaded: its experts are MXFP4
    out = plan_text(tmp_path, d, HF_HOME=str(tmp_path / "empty"), MODEL_PATH="deepseek-ai/DeepSeek-V4-Flash")
    assert moe_args(out) == {"prefill": ["marlin"], "decode": ["marlin"]}, out


def test_unusable_config_concludes_nothing(tmp_path):
    """A config.json that is not JSON gets no conclusion about its experts; the dry run fails on it."""
    d = tmp_path / "profiles"
    save_profile(d, {1: "marlin"}, P.running_versions())
    ck = tmp_path / "garbage"
    ck.mkdir()
    (ck / "config.json").write_text("<html>")
    smi = tmp_path / "smi" / "nvidia-smi"
    smi.parent.mkdir()
    make_smi(smi)
    r = dry_run("serve_dsv4_tp4.sh", {"NVIDIA_SMI": str(smi), "DSV4_SM120_PROFILE_DIR": str(d), "NUMA_BIND": "0",
                                      "FP8_GEMM_BACKEND": "cutlass", "MODEL_PATH": str(ck)}, check=False)
    assert r.returncode == 1 and "config.json is not valid JSON" in r.stderr, r.stderr
    assert moe_args(r.stdout) == {"prefill": [], "decode": []}, r.stdout
    assert moe_line(r.stdout) == "# moe runner: not added: MODEL_PATH's config.json cannot be used (the model check " \
        "says why)", moe_line(r.stdout)
