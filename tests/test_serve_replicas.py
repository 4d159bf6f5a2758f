"""Replicas behind the router (PREFILL_GPUS / DECODE_GPUS with `;` between groups), with stand-in servers and the real
sglang-router 0.3.2 in PD mode: every server its own ports, bootstrap port, log and run-directory entry; the router
sends requests to every prefill and every decode replica with the bootstrap host / port / room of the prefill it
chose; serve/stop.sh leaves no process and no port; a replica that dies tears the whole deployment down. The memory
check refuses a TP size whose weights cannot fit, with the numbers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_serve_dryrun import commands, dry_run, fake_smi, write_dsv4_config  # noqa: E402
from test_serve_orchestration import (SERVE, all_run_processes, env, port_free, serving, state,  # noqa: E402,F401
                                      wait_gone)

from dsv4_sm120.serving import memory_check  # noqa: E402

NAMES = ["prefill1", "prefill2", "decode1", "decode2", "router"]


def post(url, body, timeout=30):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def replica_ports(env):
    p, b, d = (int(env[k]) for k in ("PREFILL_PORT", "BOOTSTRAP_PORT", "DECODE_PORT"))
    return {"prefill1": p, "prefill2": p + 1, "decode1": d, "decode2": d + 1}, {p: b, p + 1: b + 1}


def test_the_router_reaches_every_replica_and_stop_leaves_nothing(env, tmp_path):
    e = dict(env, DETACH="1", PREFILL_GPUS="0,1;2,3", DECODE_GPUS="4,5;6,7",
             ROUTER_EXTRA_ARGS="--prefill-policy round_robin")
    r = subprocess.run(["bash", str(SERVE / "serve_dsv4_tp4.sh")], capture_output=True, text=True, env=e, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    st = state(env)
    procs = all_run_processes(st)
    try:
        assert [p["name"] for p in st["procs"]] == NAMES and st["status"] == "ready"
        assert [p["role"] for p in st["procs"]] == ["prefill", "prefill", "decode", "decode", "router"]
        logs = [p["log"] for p in st["procs"]]
        assert len(set(logs)) == 5 and all(Path(x).is_file() and Path(x).parent == Path(st["run_dir"]) for x in logs)
        ports, boot = replica_ports(env)
        plan = json.loads((Path(st["run_dir"]) / "plan.json").read_text())
        binds = [b[1] for p in plan["procs"] for b in p["binds"]]
        assert len(binds) == len(set(binds)) == 8, binds                     # 2 x (HTTP + bootstrap) + 2 + 2
        assert {p["name"]: p["env"]["CUDA_VISIBLE_DEVICES"] for p in plan["procs"][:4]} == \
            {"prefill1": "0,1", "prefill2": "2,3", "decode1": "4,5", "decode2": "6,7"}
        prompts = [f"replica-{i}-{os.urandom(3).hex()}" for i in range(4)]
        for text in prompts:
            assert post(f"http://127.0.0.1:{env['ROUTER_PORT']}/generate",
                        {"text": text, "sampling_params": {"max_new_tokens": 3}})["text"] == "standin decode output"
        time.sleep(0.3)
        rec = [json.loads(x) for x in Path(env["DSV4_SM120_STANDIN_RECORD"]).read_text().splitlines()]
        by_port = {v: k for k, v in ports.items()}
        seen = {"prefill": set(), "decode": set()}
        for text in prompts:
            hits = [x for x in rec if x["method"] == "POST" and x["path"] == "/generate" and x["body"].get("text") == text]
            assert sorted(x["role"] for x in hits) == ["decode", "prefill"], hits
            pre = next(x for x in hits if x["role"] == "prefill")
            dec = next(x for x in hits if x["role"] == "decode")
            for x in (pre, dec):       # the decode replica gets the bootstrap of the prefill replica that ran the prompt
                assert x["body"]["bootstrap_host"] == "127.0.0.1" and x["body"]["bootstrap_port"] == boot[pre["port"]]
            assert pre["body"]["bootstrap_room"] == dec["body"]["bootstrap_room"]
            seen["prefill"].add(by_port[pre["port"]])
            seen["decode"].add(by_port[dec["port"]])
        assert seen == {"prefill": {"prefill1", "prefill2"}, "decode": {"decode1", "decode2"}}, seen
    finally:
        s = subprocess.run(["bash", str(SERVE / "stop.sh")], capture_output=True, text=True, env=env, timeout=90)
    assert s.returncode == 0, s.stdout + s.stderr
    assert state(env)["status"] == "stopped"
    assert not wait_gone(procs, 10)
    ports, boot = replica_ports(env)
    for port in [*ports.values(), *boot.values(), int(env["ROUTER_PORT"]), int(env["ROUTER_PROMETHEUS_PORT"])]:
        assert port_free(port), port


def test_a_replica_that_dies_tears_the_deployment_down(env, tmp_path):
    with serving(env, tmp_path / "out.txt", DECODE_GPUS="4,5;6,7") as (proc, st):
        assert [p["name"] for p in st["procs"]] == ["prefill", "decode1", "decode2", "router"]
        procs = all_run_processes(st)
        victim = next(p for p in st["procs"] if p["name"] == "decode2")
        os.kill(victim["pid"], signal.SIGKILL)
        rc = proc.wait(timeout=60)
    text = (tmp_path / "out.txt").read_text()
    assert rc == 1 and f"decode2 (pid {victim['pid']}) exited with code -9" in text, text
    assert "tearing down router, decode2, decode1, prefill" in text
    assert not wait_gone(procs, 10)
    assert state(env)["status"] == "failed"
    ports, _ = replica_ports(env)
    assert port_free(ports["decode1"]) and port_free(ports["decode2"]) and port_free(int(env["ROUTER_PORT"]))


def test_a_tp_size_whose_weights_cannot_fit_is_refused_with_the_numbers(tmp_path):
    """A checkpoint index of 160 GB (total_size) on 95.6 GiB GPUs at MEM_FRACTION 0.85: TP1 cannot hold it and is
    refused in the dry run (exit 1) with the numbers; TP2 replicas fit and say what is left."""
    ckpt = write_dsv4_config(tmp_path / "ckpt")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 160 * 10 ** 9}, "weight_map": {}}))
    env = {"NVIDIA_SMI": fake_smi(tmp_path / "smi"), "MODEL_PATH": str(ckpt), "PREFLIGHT_SKIP": "patches,model"}
    r = dry_run("serve_dsv4_tp4.sh", dict(env, DECODE_GPUS="4;5;6;7"), check=False)
    assert r.returncode == 1 and "preflight memory: FAILED" in r.stdout.splitlines(), r.stdout + r.stderr
    assert set(commands(r.stdout)) == {"prefill", "decode1", "decode2", "decode3", "decode4", "router"}
    # by hand: 160e9 B = 149.0 GiB of weights on one GPU; 97887 MiB x 0.85 = 81.3 GiB
    lines = [x for x in r.stderr.splitlines() if "does not fit" in x]
    assert len(lines) == 4 and lines[0].startswith("[serve] preflight: decode1 (GPUs 4, TP1) does not fit: weights "
                                                   "149.0 GiB per GPU (149.0 GiB"), r.stderr
    assert lines[0].endswith("more than MEM_FRACTION 0.85 x 95.6 GiB = 81.3 GiB: give each decode server 2 GPUs "
                             "(DECODE_GPUS) (no MEM_FRACTION up to 0.99 fits TP1)"), lines[0]
    r = dry_run("serve_dsv4_tp4.sh", dict(env, DECODE_GPUS="4,5;6,7"))
    notes = [x for x in r.stdout.splitlines() if x.startswith("preflight memory: decode")]
    assert len(notes) == 2 and "weights 74.5 GiB per GPU" in notes[0] and "GiB left for more KV" in notes[0], notes
    # the KV term: one CONTEXT_LEN request's KV of one rank, as kv_bytes counts it
    kv = memory_check.transfer_bytes(65536, memory_check.ratios_of(json.loads((ckpt / "config.json").read_text())))
    assert f"KV {kv / 2 ** 30:.2f} GiB for one 65536-token request" in notes[0]
    # a server that fits at a higher fraction is told which: 60 GB of weights need 56.1 GiB of 95.6: 0.59 -> 0.50 fails
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 60 * 10 ** 9}}))
    r = dry_run("serve_dsv4_tp4.sh", dict(env, DECODE_GPUS="4", MEM_FRACTION="0.5"), check=False)
    (line,) = [x for x in r.stderr.splitlines() if "does not fit" in x]
    assert line.endswith("or raise MEM_FRACTION to 0.59"), line
