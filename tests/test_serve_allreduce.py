"""The TP all-reduce chosen per server by the serve plan (calibrate/allreduce_env through serving/profile_choices):
each server's environment with and without a machine profile, your settings winning, the dry run's one line per
server, the environment a started server really gets, and the preflight's verdict on the PCIe-IPC path from the p2p
probe's facts (a server the profile put on IPC runs NCCL where peer access is missing; yours is refused). What a
started server's process really holds: tests/test_router_pd.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "overlay"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_allreduce_env import DECODE, PREFILL, H  # noqa: E402
from test_serve_dryrun import commands, dry_run, fake_smi  # noqa: E402

from dsv4_sm120 import machine_profile as mp  # noqa: E402
from dsv4_sm120.serving.allreduce_env import ALGO, ENABLE, MAX_NUMEL, PROTO  # noqa: E402
from dsv4_sm120.serving import pcie_checks as pc  # noqa: E402
from dsv4_sm120.serving.plan import Plan, build_plan, render_dry_run  # noqa: E402

VENV = str(Path(sys.executable).parent.parent)
GPU = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
NAMES = (ENABLE, MAX_NUMEL, PROTO, ALGO)


def write_profile(d: Path, servers: dict, versions=None) -> Path:
    """A machine profile for the fake box's GPU with this environment's versions and an allreduce decision."""
    prof = {"schema": mp.SCHEMA, "gpu": GPU, "created_at": mp.now_iso(),
            "versions": versions or mp.running_versions(), "deployment": {},
            "decisions": {"allreduce": {"servers": servers}}}
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{mp.file_stem(GPU)}.json"
    mp.save(prof, path)
    return path


@pytest.fixture
def box(tmp_path, monkeypatch):
    """A fake 8-GPU nvidia-smi and an empty profile directory (DSV4_SM120_PROFILE_DIR, read from the process)."""
    mp.clear_cache()
    prof = tmp_path / "profiles"
    prof.mkdir()
    monkeypatch.setenv("DSV4_SM120_PROFILE_DIR", str(prof))
    for k in NAMES + ("NCCL_P2P_DISABLE",):
        monkeypatch.delenv(k, raising=False)
    yield {"smi": fake_smi(tmp_path / "smi"), "profiles": prof, "run": str(tmp_path / "run")}
    mp.clear_cache()


def plan(box, **kv):
    env = {"VENV": VENV, "RUN_DIR": box["run"], "NVIDIA_SMI": box["smi"], "MODEL_PATH": "deepseek-ai/DeepSeek-V4-Flash"}
    env.update(kv)
    return build_plan(env, "base")


def servers(p):
    return {x.role: x for x in p.procs if x.role != "router"}


def test_without_a_profile_decode_keeps_ll_ring_and_prefill_gets_no_forced_protocol(box):
    s = servers(plan(box))
    pre, dec = s["prefill"], s["decode"]
    assert {k: dec.env[k] for k in NAMES if k in dec.env} == {PROTO: "LL", ALGO: "Ring"}
    assert not any(k in pre.env for k in NAMES)
    # the prefill server must not inherit a protocol from serve/env or elsewhere: the names are dropped
    assert set(pre.unset) == set(NAMES) and set(dec.unset) == {ENABLE, MAX_NUMEL}
    assert pre.allreduce.startswith("default: no NCCL_PROTO / NCCL_ALGO") and "no profile" in pre.allreduce
    assert dec.allreduce.startswith("default: NCCL_PROTO=LL NCCL_ALGO=Ring")
    # serve/env no longer forces a protocol on both servers
    text = (REPO / "serve" / "env" / "10-nccl.env").read_text()
    assert not any(line.startswith(("NCCL_PROTO=", "NCCL_ALGO=")) for line in text.splitlines())


def test_the_profile_choice_per_server_and_the_plan_json_round_trip(box):
    path = write_profile(box["profiles"], {"decode": DECODE, "prefill": PREFILL})
    p = plan(box)
    pre, dec = servers(p)["prefill"], servers(p)["decode"]
    # by hand from the measured times (tests/test_allreduce_env.py): decode IPC up to 16 rows then NCCL LL;
    # prefill NCCL's own choice at every size
    assert {k: dec.env.get(k) for k in NAMES} == {ENABLE: "1", MAX_NUMEL: str(16 * H), PROTO: "LL", ALGO: None}
    assert dec.unset == [ALGO] and set(pre.unset) == set(NAMES) and not any(k in pre.env for k in NAMES)
    assert dec.allreduce == f"profile {path}: pcie_ipc up to {16 * H} elements (16 rows x {H}), NCCL LL above"
    assert pre.allreduce.startswith(f"profile {path}: NCCL (its own protocol per size) at every size")
    back = servers(Plan.from_json(p.to_json()))
    assert back["decode"].env == dec.env and back["decode"].unset == dec.unset
    assert back["decode"].allreduce == dec.allreduce
    # measured at another TP: that server keeps the defaults, saying why
    two = servers(plan(box, DECODE_GPUS="4,5"))["decode"]
    assert two.env[PROTO] == "LL" and ENABLE not in two.env
    assert "the profile measured decode at TP4, this decode server runs TP2" in two.allreduce
    # a profile of other versions does not apply
    mp.clear_cache()
    write_profile(box["profiles"], {"decode": DECODE}, versions=dict(mp.running_versions(), sglang="0.0.1"))
    old = servers(plan(box))["decode"]
    assert ENABLE not in old.env and "sglang 0.0.1 in profile" in old.allreduce


def test_your_settings_win(box, monkeypatch):
    write_profile(box["profiles"], {"decode": DECODE, "prefill": PREFILL})
    s = servers(plan(box, NCCL_PROTO="Simple", SGLANG_ENABLE_PCIE_IPC_ALLREDUCE="0"))
    dec, pre = s["decode"], s["prefill"]
    # yours are inherited, not set again: neither server sets or drops them
    for x in (dec, pre):
        assert PROTO not in x.env and ENABLE not in x.env and PROTO not in x.unset and ENABLE not in x.unset
    assert dec.allreduce.startswith("env SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=0 NCCL_PROTO=Simple (yours); profile")
    assert "pcie_ipc turned off" in dec.allreduce and MAX_NUMEL not in dec.env
    # NCCL_PROTO= (empty) means "not set": dropped from every server, whatever the files or the plan say
    s = servers(plan(box, NCCL_PROTO=""))
    assert all(PROTO in x.unset and PROTO not in x.env for x in s.values())
    # what a started server really gets (the supervisor's child environment)
    from dsv4_sm120.serving.supervisor import Supervisor
    monkeypatch.setenv("NCCL_PROTO", "")
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    p = plan(box, NCCL_PROTO="", NCCL_ALGO="Tree")
    sup = Supervisor(p)
    for x in servers(p).values():
        env = sup.child_env(x.env, x.unset)
        assert PROTO not in env and env[ALGO] == "Tree", x.role
    dec = servers(p)["decode"]
    assert sup.child_env(dec.env, dec.unset)[ENABLE] == "1"          # the profile's IPC choice still applies


def test_dry_run_prints_one_all_reduce_line_per_server(tmp_path, monkeypatch):
    smi = fake_smi(tmp_path / "smi")
    base = {"NVIDIA_SMI": smi, "DSV4_SM120_PROFILE_DIR": str(tmp_path / "none")}
    out = dry_run("serve_dsv4_tp4.sh", base).stdout
    lines = [x for x in out.splitlines() if x.startswith("all-reduce ")]
    assert [x.split(":")[0] for x in lines] == ["all-reduce prefill", "all-reduce decode"], out
    assert lines[1].startswith("all-reduce decode: default: NCCL_PROTO=LL NCCL_ALGO=Ring")
    cmds = commands(out)
    assert cmds["decode"][0][PROTO] == "LL" and PROTO not in cmds["prefill"][0]
    path = write_profile(tmp_path / "prof", {"decode": DECODE, "prefill": PREFILL})
    r = dry_run("serve_dsv4_tp4.sh", dict(base, DSV4_SM120_PROFILE_DIR=str(tmp_path / "prof")))
    lines = [x for x in r.stdout.splitlines() if x.startswith("all-reduce ")]
    assert lines == [f"all-reduce prefill: {servers_line(path, 'prefill')}",
                     f"all-reduce decode: profile {path}: pcie_ipc up to {16 * H} elements (16 rows x {H}), NCCL LL "
                     f"above"], r.stdout
    assert commands(r.stdout)["decode"][0][ENABLE] == "1"
    # the dry run cannot copy between GPUs: it says what the start will verify for the IPC path
    assert ("preflight p2p: decode (GPUs 4,5,6,7) starts with the PCIe-IPC all-reduce, which needs CUDA peer access "
            "between every pair of its GPUs: a start's p2p check verifies it") in r.stdout, r.stdout


def servers_line(path, role):
    from dsv4_sm120.serving.allreduce_env import server_env
    return server_env(role, 4, {}, {"decisions": {"allreduce": {"servers": {role: PREFILL}}}}, str(path)).source


def fake_probe(no_access=()):
    def probe(plan, pairs, timeout_s):
        ev = []
        for a, b in pairs:
            ev.append({"event": "pair", "src": a, "dst": b, "ok": True, "error": None, "gbps": 45.0,
                       "can_access": (a, b) not in no_access})
        return ev, False
    return probe


def test_preflight_falls_back_to_nccl_where_peer_access_is_missing(box, tmp_path):
    write_profile(box["profiles"], {"decode": DECODE, "prefill": PREFILL})
    kw = dict(sysfs=tmp_path / "nosys", cmdline="", topo="", env={})
    # every pair has peer access: the decode server keeps the IPC path, the note counts its pairs
    p = plan(box)
    fails, notes = pc.check_p2p(p, probe=fake_probe(), **kw)
    assert fails == [] and servers(p)["decode"].env[ENABLE] == "1"
    assert "decode (GPUs 4,5,6,7): PCIe-IPC all-reduce on, peer access on all 12 ordered pairs" in notes
    # GPU 6 cannot reach GPU 5: the decode server runs the profile's NCCL-only choice, said in one line
    p = plan(box)
    fails, notes = pc.check_p2p(p, probe=fake_probe({(6, 5)}), **kw)
    dec = servers(p)["decode"]
    assert fails == [] and ENABLE not in dec.env and MAX_NUMEL not in dec.env and ENABLE in dec.unset
    assert dec.env[PROTO] == DECODE["choice"]["nccl_only"]["nccl_proto"]
    mine = [n for n in notes if n.startswith("decode (GPUs 4,5,6,7) runs NCCL")]
    assert len(mine) == 1 and "no CUDA peer access GPU 6 -> GPU 5" in mine[0], notes
    assert "cannot run here: no CUDA peer access GPU 6 -> GPU 5" in dec.allreduce
    assert Plan.from_json(p.to_json()).procs[1].env == dec.env       # what the supervisor starts it with
    # your SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 on that box: refused before anything starts
    p = plan(box, SGLANG_ENABLE_PCIE_IPC_ALLREDUCE="1")
    fails, _ = pc.check_p2p(p, probe=fake_probe({(6, 5)}), **dict(kw, env={ENABLE: "1"}))
    assert len(fails) == 1 and fails[0].startswith("decode (GPUs 4,5,6,7) turns the PCIe-IPC all-reduce on") and \
        f"Start with {ENABLE}=0" in fails[0], fails
    # NCCL_P2P_DISABLE=1 rules IPC out already at plan time
    p = plan(box, NCCL_P2P_DISABLE="1")
    dec = servers(p)["decode"]
    assert ENABLE not in dec.env and "NCCL_P2P_DISABLE=1 is set" in dec.allreduce
    assert "all-reduce decode: profile" in render_dry_run(p)
