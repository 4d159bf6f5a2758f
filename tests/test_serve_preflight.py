"""Preflight checks of the serving scripts: one clear line per failure, on real inputs where possible
(a fake nvidia-smi, real model directories, the real patch-status command, the real NIXL check)."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "overlay"))
from dsv4_sm120.serving import preflight as pf  # noqa: E402
from dsv4_sm120.serving.plan import build_plan  # noqa: E402
from dsv4_sm120.serving.envfiles import EnvFileError, load_env_dir, parse_env_text  # noqa: E402

VENV = str(Path(sys.executable).parent.parent)

SMI_8 = "\n".join(f"{i}, NVIDIA RTX PRO 6000 Blackwell Server Edition, 12.0, 97887, {97000 - i}" for i in range(8))


def plan_for(**kv):
    env = {"VENV": VENV, "RUN_DIR": "/tmp/dsv4-preflight-run", "NVIDIA_SMI": "/nonexistent/nvidia-smi"}
    env.update(kv)
    return build_plan(env, "base")


def fake_smi(tmp_path, text, rc=0):
    p = tmp_path / "nvidia-smi"
    p.write_text(f"#!/bin/sh\ncat <<'EOF'\n{text}\nEOF\nexit {rc}\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(p)


def test_parse_nvidia_smi_and_gpu_table():
    gpus = pf.parse_nvidia_smi(SMI_8)
    assert len(gpus) == 8 and gpus[3]["cc"] == "12.0" and gpus[3]["free_mib"] == 96997
    assert gpus[0]["name"] == "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    ok = pf.check_gpus_table(gpus, [("prefill", [0, 1, 2, 3], 0.85), ("decode", [4, 5, 6, 7], 0.85)])
    assert ok == []
    h200 = pf.parse_nvidia_smi("0, NVIDIA H200, 9.0, 143771, 143000")
    out = pf.check_gpus_table(h200, [("decode", [0, 1], 0.85)])
    assert len(out) == 2
    assert "compute capability 9.0, need 12.x" in out[0] and "GPU 1 not found" in out[1]
    busy = pf.parse_nvidia_smi("0, NVIDIA RTX PRO 6000 Blackwell Server Edition, 12.0, 97887, 20000")
    out = pf.check_gpus_table(busy, [("prefill", [0], 0.85)])
    assert len(out) == 1 and "19.5 GiB free" in out[0] and "needs 81.3 GiB" in out[0]
    with pytest.raises(ValueError):
        pf.parse_nvidia_smi("garbage")


def test_gpu_check_runs_nvidia_smi(tmp_path):
    p = plan_for(NVIDIA_SMI=fake_smi(tmp_path, SMI_8))
    assert pf.check_gpu(p) == []
    p = plan_for(NVIDIA_SMI=fake_smi(tmp_path, SMI_8.replace("12.0", "8.9")))
    assert len(pf.check_gpu(p)) == 8
    p = plan_for(NVIDIA_SMI=fake_smi(tmp_path, "NVIDIA-SMI has failed because it couldn't communicate", rc=9))
    out = pf.check_gpu(p)   # the tool's last line, as text (not a Python list)
    assert out == ["nvidia-smi failed (exit 9): NVIDIA-SMI has failed because it couldn't communicate"], out
    p = plan_for(NVIDIA_SMI=fake_smi(tmp_path, "", rc=3))
    assert pf.check_gpu(p) == ["nvidia-smi failed (exit 3): no output"]
    out = pf.check_gpu(plan_for())
    assert len(out) == 1 and "nvidia-smi not found" in out[0]
    assert pf.check_gpu(plan_for(NODE_ROLE="router")) == []   # no GPUs needed on a router-only host


def test_busy_and_doubled_ports_name_their_variable():
    """A busy port's line names the variable that moves it; every port the plan binds has one."""
    import socket

    from dsv4_sm120.serving.plan import PORT_VARIABLES, VARIABLES, ConfigError

    binds = {what for p in plan_for().procs for _, _, what in p.binds}
    assert binds == set(PORT_VARIABLES) and set(PORT_VARIABLES.values()) <= set(VARIABLES), binds
    for var in ("ROUTER_PORT", "BOOTSTRAP_PORT", "ROUTER_PROMETHEUS_PORT"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            out = pf.check_ports(plan_for(**{var: str(port)}))
        assert len(out) == 1 and out[0].startswith(f"port {port} on 127.0.0.1 (") and "is already in use" in out[0]
        assert out[0].endswith(f"or set {var} to a free port"), out
    with pytest.raises(ConfigError) as e:
        plan_for(ROUTER_PROMETHEUS_PORT="30000")
    assert "router HTTP (ROUTER_PORT) and router metrics (ROUTER_PROMETHEUS_PORT)" in str(e.value), e.value


def test_model_check(tmp_path):
    assert pf.check_model(plan_for()) == []                          # the default HF id
    out = pf.check_model(plan_for(MODEL_PATH=str(tmp_path / "missing")))
    assert len(out) == 1 and "does not exist" in out[0]
    out = pf.check_model(plan_for(MODEL_PATH="not an id"))
    assert len(out) == 1 and "not a Hugging Face id" in out[0]
    d = tmp_path / "ckpt"
    d.mkdir()
    assert "no readable config.json" in pf.check_model(plan_for(MODEL_PATH=str(d)))[0]
    (d / "config.json").write_text("{oops")
    assert "not valid JSON" in pf.check_model(plan_for(MODEL_PATH=str(d)))[0]
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "expected deepseek_v4" in pf.check_model(plan_for(MODEL_PATH=str(d)))[0]
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    assert "no *.safetensors" in pf.check_model(plan_for(MODEL_PATH=str(d)))[0]
    write_tiny_checkpoint(d, index=False)
    assert pf.check_model(plan_for(MODEL_PATH=str(d))) == []


def write_tiny_checkpoint(d: Path, index: bool = True) -> dict:
    """Two shards written by the official safetensors library, with (or without) the index."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    shards = {
        "model-00001-of-00002.safetensors": {"embed.weight": torch.randn(8, 4).to(torch.bfloat16),
                                             "layers.0.attn.wq_a.weight": torch.zeros(4, 4, dtype=torch.uint8),
                                             "norm.weight": torch.ones(4)},
        "model-00002-of-00002.safetensors": {"layers.0.ffn.experts.0.w1.weight": torch.randint(0, 9, (4, 16)).to(torch.int8),
                                             "layers.0.ffn.experts.0.w1.scale": torch.full((4, 1), 127, dtype=torch.uint8),
                                             "head.weight": torch.randn(8, 4)},
    }
    wm = {}
    for fn, ts in shards.items():
        save_file(ts, str(d / fn), metadata={"format": "pt"})
        wm.update({k: fn for k in ts})
    if index:
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    return wm


def rewrite_header(path: Path, edit) -> None:
    """Rewrite a shard's JSON header through ``edit(header dict)``, keeping its data bytes."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    hdr = json.loads(raw[8:8 + n])
    edit(hdr)
    new = json.dumps(hdr).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])


def loader_refuses(path: Path) -> bool:
    """What the real safetensors loader says about the file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                f.get_tensor(k)
    except Exception:
        return True
    return False


def test_model_check_reads_every_shard_header(tmp_path):
    """0-byte, truncated and lying shards, and index entries the files do not back, fail the model
    check with one line naming the shard; a good tiny checkpoint (with and without index) passes.
    Each damaged file is also refused by the real safetensors loader (the check is not stricter)."""
    good = tmp_path / "good"
    wm = write_tiny_checkpoint(good)
    assert pf.check_model(plan_for(MODEL_PATH=str(good))) == []
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"

    def damaged(tag, damage, needle, shard=s2):
        d = tmp_path / tag
        write_tiny_checkpoint(d)
        damage(d / shard, d)
        out = pf.check_model(plan_for(MODEL_PATH=str(d)))
        assert len(out) == 1, (tag, out)
        assert out[0].startswith(f"MODEL_PATH={d}: ") and shard in out[0] and needle in out[0], (tag, out)
        if (d / shard).exists() and tag != "absent":
            assert loader_refuses(d / shard), tag
        return out[0]

    damaged("empty", lambda p, d: p.write_bytes(b""), "0 bytes")
    damaged("trunc", lambda p, d: p.write_bytes(p.read_bytes()[:-10]), "truncated")
    damaged("trunc_header", lambda p, d: p.write_bytes(p.read_bytes()[:20]), "truncated")
    damaged("missing", lambda p, d: p.unlink(), "is missing")

    def overlap(h):  # the second tensor's range slides onto the first (same sizes, same file)
        a, b = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])[:2]
        size = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
        h[b]["data_offsets"] = [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + size]

    damaged("overlap", lambda p, d: rewrite_header(p, overlap), "overlaps")

    def grow(h):  # the last tensor claims more rows than the file holds
        k = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])
        b, e = h[k]["data_offsets"]
        h[k]["shape"] = [h[k]["shape"][0] * 4] + h[k]["shape"][1:]
        h[k]["data_offsets"] = [b, b + (e - b) * 4]

    damaged("grow", lambda p, d: rewrite_header(p, grow), "truncated")

    def drop_tensor(p, d):  # the index lists a tensor the shard no longer holds
        from safetensors.torch import load_file, save_file

        ts = load_file(str(p))
        ts.pop("head.weight")
        save_file(ts, str(p))

    line = damaged("absent", drop_tensor, "'head.weight'")
    assert "does not hold it" in line
    # several problems: one line each (a 0-byte and a missing shard)
    d = tmp_path / "two"
    write_tiny_checkpoint(d)
    (d / s1).write_bytes(b"")
    (d / s2).unlink()
    out = pf.check_model(plan_for(MODEL_PATH=str(d)))
    assert len(out) == 2 and any(s1 in x and "0 bytes" in x for x in out) and any(s2 in x and "missing" in x for x in out)
    # without an index every *.safetensors header is read
    d = tmp_path / "noindex"
    write_tiny_checkpoint(d, index=False)
    assert pf.check_model(plan_for(MODEL_PATH=str(d))) == []
    (d / s1).write_bytes(b"")
    out = pf.check_model(plan_for(MODEL_PATH=str(d)))
    assert len(out) == 1 and s1 in out[0] and "0 bytes" in out[0]
    assert set(wm.values()) == {s1, s2}


def test_patch_status_interpretation():
    good = {"sglang_root": "/x", "patched": True, "matches_repo": True, "state": "applied",
            "series_hash": "a" * 64, "repo_series_hash": "a" * 64, "modified_files": []}
    assert pf.interpret_patch_status(good) == []
    out = pf.interpret_patch_status(dict(good, patched=False, matches_repo=False, state=None))
    assert out == ["SGLang at /x is not patched: run `make apply-patches`"]
    out = pf.interpret_patch_status(dict(good, matches_repo=False, series_hash="b" * 64))
    assert "series bbbbbbbbbbbb but this repo's series is aaaaaaaaaaaa" in out[0]
    out = pf.interpret_patch_status(dict(good, patched=False, matches_repo=False, state="applying"))
    assert "state 'applying'" in out[0]
    out = pf.interpret_patch_status(dict(good, patched=False, matches_repo=False, modified_files=["srt/a.py"]))
    assert "modified since apply: srt/a.py" in out[0]


def test_patch_check_asks_the_real_tree(patched_sglang_site, monkeypatch):
    # the test environment's own SGLang is pristine: refused with the fix in the line
    monkeypatch.delenv("SGLANG_ROOT", raising=False)
    out = pf.check_patches(plan_for())
    assert len(out) == 1 and "is not patched: run `make apply-patches`" in out[0], out
    # a tree patched with this repo's series passes (SGLANG_ROOT points patching at it)
    monkeypatch.setenv("SGLANG_ROOT", str(patched_sglang_site / "sglang"))
    assert pf.check_patches(plan_for()) == []


def test_nixl_check_through_preflight():
    assert pf.check_nixl(plan_for()) == []
    out = pf.check_nixl(build_plan({"VENV": VENV, "RUN_DIR": "/tmp/x", "NVIDIA_SMI": "/nonexistent",
                                    "SGLANG_DISAGGREGATION_NIXL_BACKEND": "NOSUCH"}))
    assert len(out) == 1 and "no NOSUCH backend plugin" in out[0], out


def test_router_and_python_checks():
    assert pf.check_router(plan_for()) == []
    assert pf.check_python(plan_for()) == []
    out = pf.check_python(plan_for(VENV="/nonexistent-venv"))
    assert out == ["no python at /nonexistent-venv/bin/python: run `make setup` or set VENV to the serving environment"]


def test_preflight_skip_and_standin_defaults():
    assert pf.skipped_checks(plan_for()) == []
    assert pf.skipped_checks(plan_for(DSV4_SM120_SERVE_STANDIN="1")) == ["gpu", "memory", "patches", "nixl", "p2p",
                                                                         "ucx"]
    assert pf.skipped_checks(plan_for(PREFLIGHT_SKIP="p2p,ucx,numa")) == ["p2p", "ucx", "numa"]
    assert pf.skipped_checks(plan_for(PREFLIGHT_SKIP="gpu, nixl")) == ["gpu", "nixl"]
    from dsv4_sm120.serving.plan import ConfigError

    with pytest.raises(ConfigError, match="PREFLIGHT_SKIP='gpus' is not valid: unknown check"):
        plan_for(PREFLIGHT_SKIP="gpus")


def test_run_preflight_collects_one_line_per_failure(tmp_path):
    p = plan_for(NVIDIA_SMI=fake_smi(tmp_path, SMI_8.replace("12.0", "9.0")), PREFLIGHT_SKIP="patches,nixl,p2p,ucx",
                 MODEL_PATH=str(tmp_path / "nope"))
    said = []
    out = pf.run_preflight(p, say=said.append)
    assert len(out) == 9 and sum("compute capability 9.0" in x for x in out) == 8
    assert any("does not exist" in x for x in out)
    assert "preflight patches: skipped" in said and "preflight gpu: FAILED" in said
    # each reason right under its check's status line, indented (the status line itself stays as readers parse it)
    i = said.index("preflight gpu: FAILED")
    under = said[i + 1:i + 9]
    assert all(x.startswith("  ") and "compute capability 9.0" in x for x in under), said
    assert not said[i + 9].startswith("  ") and said[i + 9] == "preflight model: FAILED", said
    assert said[i + 10].startswith("  ") and "does not exist" in said[i + 10], said


def test_env_files(tmp_path):
    assert parse_env_text("# c\nA=1\nexport B='two words'\nC=x # note\n\n") == \
        [("A", "1"), ("B", "two words"), ("C", "x")]
    for bad in ("NOEQUALS", "1A=2", "A=$HOME", "A=`id`"):
        with pytest.raises(EnvFileError):
            parse_env_text(bad)
    (tmp_path / "10-a.env").write_text("X=1\nY=1\n")
    (tmp_path / "20-b.env").write_text("Y=2\n")
    got = load_env_dir(tmp_path, {"X": "from-caller"})
    assert got == [("X", "from-caller", "environment"), ("Y", "2", "20-b.env")]
    # the shipped files parse and hold the settings the issue asks for
    shipped = dict((k, v) for k, v, _ in load_env_dir(REPO / "serve" / "env", {}))
    # no NCCL protocol for every server: the plan sets it per server (tests/test_serve_allreduce.py)
    assert "NCCL_PROTO" not in shipped and "NCCL_ALGO" not in shipped and shipped["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert shipped["SGLANG_DISAGGREGATION_NIXL_BACKEND"] == "UCX"


def test_overlay_env_check_catches_attention_typos_before_start(tmp_path):
    """A typo in DSV4_SM120_ATTN_CONFIG / DSV4_SM120_ATTN_QK fails the preflight (never skippable) instead of
    surfacing at the first decode after the model has loaded; valid settings pass."""
    assert pf.check_overlay_env(plan_for(DSV4_SM120_ATTN_CONFIG="KCVT=1,maxnreg=0"), base={}) == []
    bad = pf.check_overlay_env(plan_for(DSV4_SM120_ATTN_CONFIG="KCVT=1,BLOCKN=32"), base={})
    assert len(bad) == 1 and "unknown key 'BLOCKN'" in bad[0] and "DSV4_SM120_ATTN_CONFIG" in bad[0]
    bad = pf.check_overlay_env(plan_for(DSV4_SM120_ATTN_QK="fp16"), base={})
    assert len(bad) == 1 and "DSV4_SM120_ATTN_QK" in bad[0]
    bad = pf.check_overlay_env(plan_for(DSV4_SM120_ATTN_QK="fp8", DSV4_SM120_ATTN_CONFIG="impl=reg"), base={})
    assert len(bad) == 1 and "no fp8 QK path" in bad[0]
    # the caller's environment counts too (it reaches the servers)
    assert pf.check_overlay_env(plan_for(), base={"DSV4_SM120_ATTN_CONFIG": "impl=fast"})
    # a body the servers' sm_120 GPUs do not run (Hopper's warpgroup MMA), named alone or with its own keys
    for text in ("impl=wgmma", "waves=1,impl=wgmma,BLOCK_N=64"):
        bad = pf.check_overlay_env(plan_for(DSV4_SM120_ATTN_CONFIG=text), base={})
        assert len(bad) == 1 and "impl=wgmma" in bad[0] and "sm_90 only" in bad[0] and "sm_120" in bad[0], bad
        assert "\n" not in bad[0] and "reg" in bad[0] and "wgmma, " not in bad[0].split("one of")[1], bad
    assert pf.check_overlay_env(plan_for(DSV4_SM120_ATTN_CONFIG="impl=wspec"), base={}) == []
    # every registered setting, the lines the patched SGLang's startup would stop at (dsv4_sm120.settings)
    from dsv4_sm120.settings import validate

    base = {"DSV4_SM120_MOE_BACKEND": "triton", "DSV4_SM120_" + "ATTN_BACKNED": "dsv4"}
    bad = pf.check_overlay_env(plan_for(), base=base)
    assert len(bad) == 2 and bad == validate(base), bad
    p = plan_for(DSV4_SM120_ATTN_CONFIG="BLOCK_N=48", PREFLIGHT_SKIP="patches,nixl,gpu,model,ports,router,p2p,ucx")
    said = []
    out = pf.run_preflight(p, say=said.append)
    assert "preflight env: FAILED" in said and any("power of two" in x for x in out)


# ---------------------------------------------------------------------------- PCIe box: numa, p2p, ucx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pcie_box import TOPO_M, make_smi, make_sysfs  # noqa: E402

from dsv4_sm120.serving import pcie_checks as pc  # noqa: E402
from dsv4_sm120.serving import ucx_info  # noqa: E402


def fake_probe(behaviour, hang_at=None):
    """A P2P probe: behaviour(src, dst) -> dict of pair fields (can_access, gbps, ok, error) or None;
    hang_at: the pair whose copy never returns (the probe then times out)."""
    import random
    asked = []

    def probe(plan, pairs, timeout_s):
        asked.extend(pairs)
        ev = []
        for a, b in pairs:
            ev.append({"event": "start", "src": a, "dst": b})
            if (a, b) == hang_at:
                return ev, True
            f = {"can_access": True, "gbps": round(random.uniform(40, 55), 2), "ok": True, "error": None}
            f.update(behaviour(a, b) or {})
            ev.append(dict(f, event="pair", src=a, dst=b))
            ev.append({"event": "staged", "src": a, "dst": b, "gbps": round(random.uniform(11, 13), 2)})
        return ev, False
    return probe, asked


def pcie_plan(tmp_path, **kv):
    smi = make_smi(tmp_path / "nvidia-smi")
    sysfs = make_sysfs(tmp_path / "sys", {i: (0 if i < 4 else 1) for i in range(8)}, {0: "0-7", 1: "8-15"})
    return plan_for(NVIDIA_SMI=smi, DSV4_SM120_SERVE_SYSFS_ROOT=str(sysfs), **kv), sysfs


def test_p2p_healthy_box_and_a_needless_fallback(tmp_path):
    p, sysfs = pcie_plan(tmp_path)
    probe, asked = fake_probe(lambda a, b: None)
    fails, notes = pc.check_p2p(p, probe=probe, sysfs=sysfs, cmdline="BOOT_IMAGE=/vmlinuz ro", topo=TOPO_M, env={})
    assert fails == [], fails
    assert len(asked) == 12 + 12 + 16 and len(set(asked)) == 40
    assert all((a, b) in asked for a in range(4) for b in range(4, 8))          # every prefill GPU -> every decode GPU
    assert not any(a >= 4 and b < 4 for a, b in asked)                           # KV only flows prefill -> decode
    assert notes[0].startswith("peer copies prefill TP: median") and "prefill->decode: median" in notes[0]
    assert "through host memory: 1" in notes[0] and not any("WARNING" in n for n in notes)
    fails, notes = pc.check_p2p(p, probe=probe, sysfs=sysfs, cmdline="", topo="", env={"NCCL_P2P_DISABLE": "1"})
    assert fails == [] and any("NCCL_P2P_DISABLE=1 is set but peer copies work" in n for n in notes)


def test_p2p_hang_is_diagnosed_with_iommu_acs_and_the_fallback(tmp_path):
    p, _ = pcie_plan(tmp_path)
    sysfs = make_sysfs(tmp_path / "sys-iommu", {i: 0 for i in range(8)}, {0: "0-3"}, iommu_groups=37)
    probe, _ = fake_probe(lambda a, b: None, hang_at=(1, 5))
    fails, notes = pc.check_p2p(p, probe=probe, sysfs=sysfs, cmdline="ro intel_iommu=on quiet", topo=TOPO_M,
                                env={}, timeout_s=77)
    assert len(fails) == 1, fails
    f = fails[0]
    assert "peer copy GPU 1 -> GPU 5 did not finish within 77 s, path SYS" in f
    assert "IOMMU is on (37 iommu groups; kernel command line: intel_iommu=on)" in f and "iommu=pt" in f
    assert "ACS" in f and "NCCL_P2P_DISABLE=1 UCX_TLS=^cuda_ipc" in f and "host-memory bounce measured at 1" in f
    # started with the fallback: the same finding is a warning, the start goes on
    fails, notes = pc.check_p2p(p, probe=probe, sysfs=sysfs, cmdline="ro intel_iommu=on", topo=TOPO_M,
                                env={"NCCL_P2P_DISABLE": "1", "UCX_TLS": "^cuda_ipc"}, timeout_s=77)
    assert fails == [] and any(n.startswith("WARNING (running with NCCL_P2P_DISABLE=1") for n in notes)
    # passthrough IOMMU: the hint points at ACS instead
    fails, _ = pc.check_p2p(p, probe=probe, sysfs=sysfs, cmdline="iommu=pt", topo="", env={}, timeout_s=5)
    assert "passthrough mode (iommu=pt), so look at ACS first" in fails[0]


def test_p2p_corrupt_failed_missing_and_slow_pairs(tmp_path):
    p, sysfs = pcie_plan(tmp_path)

    def behaviour(a, b):
        if (a, b) == (2, 6):
            return {"ok": False}
        if (a, b) == (3, 7):
            return {"ok": False, "error": "cudaErrorPeerAccessUnsupported", "gbps": None}
        if a < 4 and b >= 4:
            return {"can_access": False, "gbps": 12.0}
        if (a, b) == (5, 6):
            return {"gbps": 6.5}
        return None
    probe, _ = fake_probe(behaviour)
    fails, notes = pc.check_p2p(p, probe=probe, sysfs=sysfs, cmdline="", topo=TOPO_M, env={})
    assert len(fails) == 2
    assert any("GPU 2 -> GPU 6 delivered wrong bytes, path SYS" in f for f in fails)
    assert any("GPU 3 -> GPU 7 failed, path SYS: cudaErrorPeerAccessUnsupported" in f for f in fails)
    warn = [n for n in notes if n.startswith("WARNING")]
    assert any("no CUDA peer access for 14 GPU pair(s) (0->4, 0->5" in n for n in warn), warn
    assert any("GPU 5 -> GPU 6 runs at 6.5 GB/s, path PXB" in n and "link width" in n for n in warn), warn


def test_p2p_probe_that_cannot_run_and_the_real_probe_without_cuda(tmp_path):
    p, sysfs = pcie_plan(tmp_path)
    fails, _ = pc.check_p2p(p, probe=lambda *a: ([{"event": "error", "error": "no CUDA device"}], False),
                            sysfs=sysfs, cmdline="", topo="")
    assert fails == ["P2P probe could not run: no CUDA device"]
    # the real probe, run the way the preflight runs it (serving python, JSON lines)
    fails, _ = pc.check_p2p(p, sysfs=sysfs, cmdline="", topo="", timeout_s=120)
    assert len(fails) == 1 and fails[0].startswith("P2P probe could not run: ") and \
        ("no CUDA device" in fails[0] or "torch" in fails[0]), fails
    one = plan_for(PREFILL_GPUS="0", DECODE_GPUS="1", NODE_ROLE="prefill")
    assert pc.check_p2p(one, probe=lambda *a: pytest.fail("no pair to probe")) == \
        ([], ["one GPU per server on this host: no GPU pair to probe"])


def proto_table(src, dst, rows, header="dsv4-check-prefill intra-node cfg#1"):
    w = "[1796102273.1] [box:1:0]   "
    out = [w + "+--------+", f"{w}| {header} |", f"{w}| remote memory write by ucp_put* from {src} to {dst} |",
           w + "+--------+", f"{w}| Range | Description | Config |", w + "+--------+"]
    out += [f"{w}| {r} | {d} | {c} |" for r, d, c in rows]
    return "\n".join(out + [w + "+--------+"])


def fake_runner(version, first_rows, override_rows=None, rc=0, ok=True):
    calls = []

    def run(plan, src, dst, extra, timeout_s):
        calls.append(dict(extra))
        rows = override_rows if extra.get("UCX_CUDA_IPC_BW") and override_rows else first_rows
        rep = json.dumps({"ok": ok, "ucx_version": version, "bad_moved_pages": 0 if ok else 3})
        text = "\n".join([proto_table("host memory", "host", [("0..inf", "zero-copy", "cma/memory")]),
                          proto_table("cuda/GPU0", "cuda", rows), rep])
        return rc, text
    return run, calls


def test_ucx_direct_path_staging_pipeline_and_the_override(tmp_path):
    p, _ = pcie_plan(tmp_path)
    run, calls = fake_runner("1.24.0", [("0..inf", "zero-copy", "cuda_ipc/cuda")])
    fails, notes = pc.check_ucx(p, runner=run)
    assert fails == [] and len(calls) == 1
    assert "GPU 0 -> GPU 4 KV writes take the direct path: 0..inf: zero-copy via cuda_ipc/cuda" in notes
    assert any("host->host cma" in n and "cuda->cuda cuda_ipc" in n for n in notes)
    staged = [("0..8191", "zero-copy", "cuda_ipc/cuda"), ("8192..inf", "pipeline cuda_copy", "cuda_copy/cuda, tcp/lo")]
    run, calls = fake_runner("1.20.0", staged, override_rows=[("0..inf", "zero-copy", "cuda_ipc/cuda")])
    fails, notes = pc.check_ucx(p, runner=run)
    assert fails == [] and calls == [{}, {"UCX_CUDA_IPC_BW": "50GBs"}]
    assert any(n.startswith("WARNING: UCX 1.20.0 predates UCX PR #11865") for n in notes)
    w = [n for n in notes if "do not take cuda_ipc zero-copy" in n]
    assert len(w) == 1 and "8192..inf: pipeline cuda_copy via cuda_copy/cuda, tcp/lo" in w[0]
    assert "set UCX_CUDA_IPC_BW=50GBs" in w[0]
    run, _ = fake_runner("1.23.0", staged)
    fails, notes = pc.check_ucx(p, runner=run)
    assert any("UCX 1.23.0: UCX PR #11865 reached the v1.23.x branch" in n for n in notes)
    assert any("UCX_CUDA_IPC_BW=50GBs does not change it here" in n for n in notes)


def test_ucx_hang_and_failed_transfer_fail_the_preflight(tmp_path):
    p, _ = pcie_plan(tmp_path)
    run, _ = fake_runner("1.24.0", [], rc=124)
    fails, _ = pc.check_ucx(p, runner=run, timeout_s=33)
    assert len(fails) == 1 and "did not finish within 33 s" in fails[0] and "UCX_NET_DEVICES" in fails[0]
    run, _ = fake_runner("1.24.0", [], ok=False, rc=1)
    fails, _ = pc.check_ucx(p, runner=run)
    assert fails == ["NIXL/UCX GPU 0 -> GPU 4 KV write failed: 3 moved pages differ"]
    split = plan_for(NODE_ROLE="decode,router")
    assert pc.check_ucx(split, runner=lambda *a: pytest.fail("nothing to probe"))[1][0].startswith(
        "prefill and decode are not both on this host")


def test_ucx_version_states():
    assert ucx_info.version_note("1.19.1")[0] == "old"
    assert ucx_info.version_note("1.23.0")[0] == "backport"
    assert ucx_info.version_note("1.24.2")[0] == "fixed"
    assert ucx_info.version_note(None)[0] == "unknown"


def test_numa_note_and_single_host_ucx_pinning_in_the_run(tmp_path):
    p, _ = pcie_plan(tmp_path, PREFLIGHT_SKIP="gpu,model,patches,nixl,ports,router,p2p,ucx")
    said = []
    assert pf.run_preflight(p, say=said.append) == []
    assert "preflight numa: prefill (GPUs 0,1,2,3): NUMA node 0, CPUs 0-7 [GPU 0: node 0, GPU 1: node 0, " \
           "GPU 2: node 0, GPU 3: node 0]" in said
    assert any(x.startswith("preflight numa: decode (GPUs 4,5,6,7): NUMA node 1, CPUs 8-15") for x in said)
    # one host: UCX network devices pinned to loopback (the unpinned hang); not over a user's choice or across hosts
    assert all(x.env.get("UCX_NET_DEVICES") == "lo" for x in p.procs if x.role != "router")
    mine = plan_for(UCX_NET_DEVICES="mlx5_0:1")
    assert all("UCX_NET_DEVICES" not in x.env for x in mine.procs)
    multi = plan_for(PREFILL_HOST="10.0.0.1", DECODE_HOST="10.0.0.2")
    assert all("UCX_NET_DEVICES" not in x.env for x in multi.procs)
    assert pc.server_env(p, {})["UCX_NET_DEVICES"] == "lo" and "CUDA_VISIBLE_DEVICES" not in pc.server_env(p, {})


def test_checks_that_need_the_gpu_check_wait_for_it(tmp_path):
    """A box with no NVIDIA driver: one cause, one failure. p2p, ucx and profile say they need the gpu check instead
    of failing on their own (they used to report three failures for it)."""
    p = plan_for(PREFLIGHT_SKIP="patches,nixl,model,ports,router")
    said = []
    out = pf.run_preflight(p, say=said.append)
    assert out == ["nvidia-smi not found (/nonexistent/nvidia-smi): no NVIDIA driver on this host?"], out
    for name in ("p2p", "ucx", "profile"):
        assert f"preflight {name}: not run (needs the gpu check, which failed)" in said, said
    # skipping the gpu check is the user's call: the checks that need it then run (here: profile, which warns)
    said.clear()
    p = plan_for(PREFLIGHT_SKIP="gpu,patches,nixl,model,ports,router,ucx,p2p")
    assert pf.run_preflight(p, say=said.append) == [] and "preflight profile: ok" in said, said


@pytest.mark.parametrize("model,want", [
    ("deepseek-ai/DeepSeek-V4-Flsh", "did you mean deepseek-ai/DeepSeek-V4-Flash?"),
    ("deepseek-ai/deepseek-v4-flash", "did you mean deepseek-ai/DeepSeek-V4-Flash?"),
    ("deepseek-ai/DeepSeek-V4-Flash-0730", "did you mean deepseek-ai/DeepSeek-V4-Flash-0731?"),
    ("deepseek-ai/DeepSek-V4-Flash-0731", "did you mean deepseek-ai/DeepSeek-V4-Flash-0731?"),
    ("someorg/DeepSeek-V4-Flash-finetune", None),
    ("deepseek-ai/DeepSeek-V4-Pro", None),
])
def test_a_hub_id_nothing_knows_is_named_and_a_typo_refused(model, want, tmp_path, monkeypatch):
    """A Hub id that is neither cached nor published: within two edits (or a case change) of a published one it is
    almost surely a typo and refused, naming the closest id; otherwise a download is plausible and the model check
    warns (the start goes on)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    p = plan_for(MODEL_PATH=model, PREFLIGHT_SKIP="ports,gpu,patches,nixl,numa,p2p,ucx,router,profile")
    said = []
    out = pf.run_preflight(p, say=said.append)
    if want:
        assert out == [f"MODEL_PATH={model} is not in the local Hugging Face cache nor a published checkpoint: {want}"]
        assert "preflight model: FAILED" in said
    else:
        assert out == [] and "preflight model: ok" in said, (out, said)
        (warning,) = [x for x in said if x.startswith("preflight model: WARNING: ")]
        assert f"MODEL_PATH={model} is neither in the local Hugging Face cache nor a published checkpoint" in warning
        assert "SGLang downloads it at start" in warning


def test_a_missing_local_path_that_reads_as_a_hub_id_is_refused(tmp_path, monkeypatch):
    """MODEL_PATH=out/nvfp4 run from a directory where out/ exists but out/nvfp4 does not: a local path, not a Hub id."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    out = pf.check_model(plan_for(MODEL_PATH="out/nvfp4"))
    assert out == [f"MODEL_PATH=out/nvfp4 does not exist here ({tmp_path / 'out'} does: a local path?) and is not a "
                   f"Hugging Face id in the local cache nor a published checkpoint"], out
