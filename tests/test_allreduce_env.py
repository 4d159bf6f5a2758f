"""The environment that selects each server's all-reduce (dsv4_sm120.serving.allreduce_env): per server with and
without a profile, the user's explicit settings winning, a profile measured at another TP size, the preflight's
verdict on the IPC path; SGLang's own environment reader and eligibility gate accepting what it emits."""

from __future__ import annotations

import json

import pytest

from dsv4_sm120.machine_profile.allreduce_choice import IPC, choose
from dsv4_sm120.serving.allreduce_env import (ALGO, ENABLE, MAX_NUMEL, PROTO, ipc_blocker, preflight_ipc,
                                                server_env)

H = 4096
SRC = "configs/profiles/NVIDIA_RTX_PRO_6000_Blackwell_Server_Edition.json"


def ok(us):
    return {"status": "ok", "us": us}


def measured(cols, rows=(1, 4, 16, 64), tp=4):
    t = {r: {m: ok(v[i]) for m, v in cols.items()} for i, r in enumerate(rows)}
    return {"status": "ok", "tp": tp, "hidden": H, "gpus": list(range(tp)),
            "sizes": {str(r): {"candidates": t[r]} for r in rows}, "choice": choose(t, H)}


def prof(**servers):
    return {"decisions": {"allreduce": {"servers": servers}}}


DECODE = measured({IPC: [4, 5, 7, 20], "nccl_LL": [8, 9, 10, 12], "nccl_Simple": [20, 21, 22, 14]})
PREFILL = measured({IPC: [9, 9, 9, 90], "nccl": [8, 8, 8, 20], "nccl_LL": [7, 7, 7, 60]}, rows=(1, 16, 256, 8192))


def test_defaults_without_a_profile():
    d = server_env("decode", 4, {})
    assert d.env == {PROTO: "LL", ALGO: "Ring"} and set(d.unset) == {ENABLE, MAX_NUMEL}
    assert d.source.startswith("default: NCCL_PROTO=LL NCCL_ALGO=Ring") and "pcie_ipc off" in d.source
    assert "no matching machine profile" in d.source and "\n" not in d.source
    p = server_env("prefill", 4, {}, None, "no profile configs/profiles/X.json (run `make calibrate`)")
    # no decode-size protocol forced on the prefill server: the env files' NCCL_PROTO / NCCL_ALGO are dropped
    assert p.env == {} and set(p.unset) == {ENABLE, MAX_NUMEL, PROTO, ALGO}
    assert "no profile configs/profiles/X.json" in p.source and p.line().startswith("all-reduce prefill: default:")
    with pytest.raises(ValueError):
        server_env("router", 4, {})


def test_profile_choice_per_server():
    pr = prof(decode=DECODE, prefill=PREFILL)
    d = server_env("decode", 4, {}, pr, SRC)
    # decode, by hand: IPC the fastest up to 16 rows, NCCL LL at 64 (12 against Simple's 14)
    assert DECODE["choice"]["ipc_max_rows"] == 16 and DECODE["choice"]["nccl"] == "nccl_LL"
    assert d.env == {ENABLE: "1", MAX_NUMEL: str(16 * H), PROTO: "LL"} and d.unset == (ALGO,)
    assert d.source == f"profile {SRC}: pcie_ipc up to {16 * H} elements (16 rows x {H}), NCCL LL above"
    p = server_env("prefill", 4, {}, pr, SRC)
    # prefill: IPC never the fastest; NCCL's own choice costs 8/7*3 + 1, LL 3 + 60/20: nccl
    assert p.env == {} and set(p.unset) == {ENABLE, MAX_NUMEL, PROTO, ALGO}
    assert p.source.startswith(f"profile {SRC}: NCCL (its own protocol per size) at every size")


def test_an_explicit_setting_wins():
    pr = prof(decode=DECODE)
    d = server_env("decode", 4, {PROTO: "Simple"}, pr, SRC)
    assert PROTO not in d.env and PROTO not in d.unset and d.env[MAX_NUMEL] == str(16 * H)
    assert d.source.startswith("env NCCL_PROTO=Simple (yours); profile")
    # IPC turned off by the user: the protocol measured for NCCL alone, no bound
    d = server_env("decode", 4, {ENABLE: "0"}, pr, SRC)
    assert d.env == {PROTO: DECODE["choice"]["nccl_only"]["nccl_proto"]} and ENABLE not in d.unset
    assert "pcie_ipc turned off" in d.source
    # the user's own bound is kept; the rest from the profile
    d = server_env("decode", 4, {MAX_NUMEL: "8192"}, pr, SRC)
    assert d.env == {ENABLE: "1", PROTO: "LL"} and MAX_NUMEL not in d.unset
    # an empty value asks for the variable not to be set (NCCL would read an empty list): the decode default yields
    d = server_env("decode", 4, {ALGO: ""}, None, "")
    assert d.env == {PROTO: "LL"} and ALGO in d.unset and d.source.startswith("env NCCL_ALGO unset (yours)")
    # IPC on by hand without a profile: kept, SGLang sizes its workspace; the default protocol stays
    d = server_env("decode", 4, {ENABLE: "1"}, None, "")
    assert d.env == {PROTO: "LL", ALGO: "Ring"} and ENABLE not in d.unset


def test_profile_that_does_not_apply_falls_back_to_the_default():
    d = server_env("decode", 2, {}, prof(decode=DECODE), SRC)
    assert d.env == {PROTO: "LL", ALGO: "Ring"} and "measured decode at TP4, this decode server runs TP2" in d.source
    d = server_env("prefill", 4, {}, prof(decode=DECODE), SRC)
    assert d.env == {} and "no prefill measurement" in d.source
    d = server_env("decode", 4, {}, {"decisions": {"moe.mxfp4": {}}}, SRC)
    assert "no allreduce decision" in d.source
    broken = dict(DECODE, choice={"status": "none", "reason": "no NCCL method passed at every measured size"})
    assert "has no choice" in server_env("decode", 4, {}, prof(decode=broken), SRC).source
    one = server_env("decode", 1, {}, prof(decode=DECODE), SRC)
    assert one.env == {} and one.unset == () and "no all-reduce" in one.source


def test_preflight_verdict_turns_ipc_off():
    why = "no CUDA peer access GPU 4 -> GPU 5"
    d = server_env("decode", 4, {}, prof(decode=DECODE), SRC, ipc_blocked=why)
    assert ENABLE not in d.env and d.env.get(PROTO) == DECODE["choice"]["nccl_only"]["nccl_proto"]
    assert why in d.source and f"would serve up to {16 * H}" in d.source
    d = server_env("decode", 4, {ENABLE: "1"}, prof(decode=DECODE), SRC, ipc_blocked=why)
    assert "WARNING" in d.source and d.env[MAX_NUMEL] == str(16 * H)   # the user's choice stands, with a warning


def pairs(gpus, broken=None, **kw):
    ev = [{"event": "start"}]
    for a in gpus:
        for b in gpus:
            if a != b:
                e = {"event": "pair", "src": a, "dst": b, "can_access": True, "ok": True, "error": None, "gbps": 50}
                if (a, b) == broken:
                    e.update(kw)
                ev.append(e)
    return ev + [{"event": "done"}]


def test_what_the_ipc_path_needs_from_the_box():
    g = [4, 5, 6, 7]
    assert ipc_blocker(g, pairs(g), {}) is None
    assert "no CUDA peer access GPU 6 -> GPU 5" in ipc_blocker(g, pairs(g, (6, 5), can_access=False), {})
    assert "GPU 5 -> GPU 4 failed (wrong bytes)" in ipc_blocker(g, pairs(g, (5, 4), ok=False), {})
    assert "failed (CUDA error" in ipc_blocker(g, pairs(g, (4, 7), error="CUDA error: x"), {})
    assert "no p2p probe result for GPU 4 -> GPU 5" in ipc_blocker(g, pairs([4, 6, 7]), {})
    assert "NCCL_P2P_DISABLE=1" in ipc_blocker(g, pairs(g), {"NCCL_P2P_DISABLE": "1"})
    assert "could not run" in ipc_blocker(g, [{"event": "error", "error": "no CUDA device"}], {})
    assert "TP3" in ipc_blocker([0, 1, 2], pairs([0, 1, 2]), {})
    servers = {"prefill": ([0, 1, 2, 3], {}), "decode": (g, {ENABLE: "1"})}
    ev = pairs([0, 1, 2, 3], (1, 2), can_access=False) + pairs(g)
    fails, notes = preflight_ipc(servers, ev, {})
    assert fails == [] and any("decode (GPUs 4,5,6,7): PCIe-IPC all-reduce on, peer access on all 12" in n
                               for n in notes)
    assert any("prefill" in n and "it could not run here: no CUDA peer access GPU 1 -> GPU 2" in n for n in notes)
    fails, _ = preflight_ipc({"decode": (g, {ENABLE: "true"})}, pairs(g, (7, 4), can_access=False), {})
    assert len(fails) == 1 and f"Start with {ENABLE}=0" in fails[0] and "GPU 7 -> GPU 4" in fails[0]


SGLANG_READS = r"""
import json, os, sys, warnings
warnings.simplefilter("error")
from sglang.srt.environ import envs
from sglang.srt.distributed.device_communicators import pcie_ipc_ar
out = []
for env in json.loads(sys.argv[1]):
    for k in ("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", "SGLANG_PCIE_IPC_MAX_NUMEL"):
        os.environ.pop(k, None)
    os.environ.update(env)   # SGLang's EnvField reads os.environ at each get()
    out.append({"names": [envs.SGLANG_ENABLE_PCIE_IPC_ALLREDUCE.name, envs.SGLANG_PCIE_IPC_MAX_NUMEL.name],
                "enable": envs.SGLANG_ENABLE_PCIE_IPC_ALLREDUCE.get(), "max": envs.SGLANG_PCIE_IPC_MAX_NUMEL.get(),
                "eligible": pcie_ipc_ar.eligible_group(group_name="tp", world_size=4, deterministic=False)})
print(json.dumps(out))
"""


def test_sglang_reads_what_the_plan_emits():
    """SGLang 0.5.23's own environment reader (srt/environ.py, warnings as errors: a value it cannot parse
    warns) and its eligibility gate take the emitted variables as meant (one child: ~6 CPU-seconds of imports)."""
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k not in (ENABLE, MAX_NUMEL)}
    on = server_env("decode", 4, {}, prof(decode=DECODE), SRC)
    off = server_env("decode", 4, {}, None, "")
    r = subprocess.run([sys.executable, "-c", SGLANG_READS, json.dumps([on.env, off.env])], env=base,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got[0] == {"names": [ENABLE, MAX_NUMEL], "enable": True, "max": 16 * H, "eligible": True}
    assert got[1]["enable"] is False and got[1]["max"] == 0 and got[1]["eligible"] is False
    # NCCL's own names for what it parses (src/graph/tuning.cc: ncclProtoStr, ncclAlgoStr)
    assert on.env[PROTO] in ("LL", "LL128", "Simple") and off.env[ALGO] in ("Ring", "Tree")
