"""The real sglang-router (0.3.2) in PD mode, started by the serving script exactly as in production
(DETACH=1), in front of two stand-in workers: each request reaches both the prefill and the decode
worker with the same bootstrap host/port/room, the prefill's bootstrap port is the configured one, and
the client gets the decode worker's answer. Then serve/stop.sh leaves no process and no bound port."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_serve_orchestration import (SERVE, all_run_processes, env, port_free, state,  # noqa: E402,F401
                                      wait_gone)


def post(url, body, timeout=30):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def test_router_pd_forwards_bootstrap_fields_to_both_workers(env):
    import importlib.util
    assert importlib.util.find_spec("sglang_router"), "sglang-router==0.3.2 must be installed in the test env"
    r = subprocess.run(["bash", str(SERVE / "serve_dsv4_tp4.sh")], capture_output=True, text=True,
                       env=dict(env, DETACH="1"), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "READY" in r.stdout and "NCCL_PROTO=LL" in r.stdout      # env files printed at start
    st = state(env)
    assert st["status"] == "ready" and [p["role"] for p in st["procs"]] == ["prefill", "decode", "router"]
    procs = all_run_processes(st)
    assert len(procs) >= 4
    # each server's own all-reduce environment, as its process holds it (no machine profile: the defaults)
    nccl = {}
    for p in st["procs"][:2]:
        raw = Path(f"/proc/{p['pid']}/environ").read_bytes().split(b"\0")
        penv = dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)
        nccl[p["role"]] = {k: penv.get(k) for k in ("NCCL_PROTO", "NCCL_ALGO", "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE")}
    assert nccl == {"prefill": dict.fromkeys(("NCCL_PROTO", "NCCL_ALGO", "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE")),
                    "decode": {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": None}}, nccl
    try:
        base = f"http://127.0.0.1:{env['ROUTER_PORT']}"
        rec = Path(env["DSV4_SM120_STANDIN_RECORD"])
        prompts = [f"prompt-{i}-{os.urandom(4).hex()}" for i in range(3)]
        g = post(base + "/generate", {"text": prompts[0], "sampling_params": {"max_new_tokens": 4}})
        assert g["text"] == "standin decode output"
        c = post(base + "/v1/completions", {"model": "m", "prompt": prompts[1], "max_tokens": 4})
        assert c["choices"][0]["text"] == "standin decode output"
        ch = post(base + "/v1/chat/completions", {"model": "m", "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": prompts[2]}]})
        assert ch["choices"][0]["message"]["content"] == "standin decode output"
        time.sleep(0.3)
        entries = [json.loads(x) for x in rec.read_text().splitlines()]
        posts = [e for e in entries if e["method"] == "POST"]
        for prompt, path in zip(prompts, ("/generate", "/v1/completions", "/v1/chat/completions")):
            hits = [e for e in posts if e["path"] == path and prompt in json.dumps(e["body"])]
            roles = sorted(e["role"] for e in hits)
            assert roles == ["decode", "prefill"], (path, hits)
            for e in hits:
                b = e["body"]
                assert b["bootstrap_host"] == "127.0.0.1", b
                assert b["bootstrap_port"] == int(env["BOOTSTRAP_PORT"]), b
                assert isinstance(b["bootstrap_room"], int), b
            assert hits[0]["body"]["bootstrap_room"] == hits[1]["body"]["bootstrap_room"]
        rooms = {e["body"]["bootstrap_room"] for e in posts}
        assert len(rooms) == 3      # a fresh room per request
    finally:
        s = subprocess.run(["bash", str(SERVE / "stop.sh")], capture_output=True, text=True, env=env, timeout=90)
        assert s.returncode == 0, s.stdout + s.stderr
    assert state(env)["status"] == "stopped"
    left = wait_gone(procs, 5)
    assert not left, f"stop.sh left processes behind: {left}"
    for k in ("PREFILL_PORT", "BOOTSTRAP_PORT", "DECODE_PORT", "ROUTER_PORT"):
        assert port_free(int(env[k])), k
    again = subprocess.run(["bash", str(SERVE / "stop.sh")], capture_output=True, text=True, env=env, timeout=30)
    assert again.returncode == 0 and "nothing running" in again.stdout
