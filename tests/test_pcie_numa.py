"""NUMA placement on a PCIe box: topology read from a fake nvidia-smi + sysfs tree, the plan's binding
(dry run, SGLang's --numa-node, NUMA_BIND=0, boxes without NUMA information), the binding applied to a
real process, and the DSv4 KV bytes a PD transfer moves."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "overlay"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from pcie_box import TOPO_M, make_smi, make_sysfs  # noqa: E402

from dsv4_sm120.serving import kv_bytes as kb  # noqa: E402
from dsv4_sm120.serving import topology as tp  # noqa: E402
from dsv4_sm120.serving.plan import ConfigError, build_plan, render_dry_run  # noqa: E402

VENV = str(Path(sys.executable).parent.parent)
TWO_NODES = {i: (0 if i < 4 else 1) for i in range(8)}


def plan(tmp_path, sysfs, smi, **kv):
    env = {"VENV": VENV, "RUN_DIR": str(tmp_path / "run"), "NVIDIA_SMI": smi, "DSV4_SM120_SERVE_SYSFS_ROOT": str(sysfs)}
    env.update(kv)
    return build_plan(env, "base")


def test_parsers():
    assert tp.sysfs_bdf("00000000:1A:00.0") == "0000:1a:00.0"
    assert tp.sysfs_bdf("0001:C3:1f.7") == "0001:c3:1f.7"
    with pytest.raises(tp.TopologyError):
        tp.sysfs_bdf("GPU-1234")
    assert tp.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert tp.format_cpus([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    cpus = sorted(set(int(x) for x in os.urandom(40)))
    assert tp.parse_cpulist(tp.format_cpus(cpus)) == cpus          # round trip on random sets
    m = tp.parse_topo_matrix(TOPO_M)
    assert len(m) == 64 and m[(0, 1)] == "PIX" and m[(0, 4)] == "SYS" and m[(5, 5)] == "X" and m[(7, 6)] == "PIX"
    p2p = tp.parse_topo_matrix(" \tGPU0\tGPU1\t\n GPU0\tX\tCNS\t\n GPU1\tCNS\tX\t\n\nLegend:\n  X = Self\n")
    assert p2p == {(0, 0): "X", (0, 1): "CNS", (1, 0): "CNS", (1, 1): "X"}


def test_bindings_follow_the_topology_not_an_assumption(tmp_path):
    smi = make_smi(tmp_path / "nvidia-smi")
    # prefill's GPUs on node 1, decode's on node 0: the reverse of the usual layout
    sysfs = make_sysfs(tmp_path / "sys", {i: (1 if i < 4 else 0) for i in range(8)}, {0: "0-15,32-47", 1: "16-31,48-63"})
    b = tp.numa_bindings({"prefill": [0, 1, 2, 3], "decode": [4, 5, 6, 7]}, smi, sysfs)
    assert (b["prefill"].node, b["decode"].node) == (1, 0)
    assert b["prefill"].cpus == list(range(16, 32)) + list(range(48, 64))
    assert tp.sglang_numa_args(b["prefill"]) == ["--numa-node", "1", "1", "1", "1"]
    assert "NUMA node 1, CPUs 16-31,48-63" in b["prefill"].describe()


@pytest.mark.parametrize("case", ["no-smi", "minus-one", "missing-file", "one-node", "span", "off"])
def test_unbound_cases_say_why(tmp_path, case):
    smi = make_smi(tmp_path / "nvidia-smi")
    nodes = dict(TWO_NODES)
    cpus = {0: "0-7", 1: "8-15"}
    if case == "minus-one":
        nodes[2] = -1
    if case == "one-node":
        nodes, cpus = {i: 0 for i in range(8)}, {0: "0-15"}
    if case == "span":
        nodes[3] = 1
    sysfs = make_sysfs(tmp_path / "sys", nodes, cpus)
    if case == "missing-file":
        (sysfs / "bus/pci/devices" / "0000:28:00.0" / "numa_node").unlink()
    b = tp.numa_bindings({"prefill": [0, 1, 2, 3]}, "/nonexistent/smi" if case == "no-smi" else smi, sysfs,
                         enabled=case != "off")["prefill"]
    assert b.node is None and b.cpus == []
    want = {"no-smi": "no NUMA information: nvidia-smi not found", "minus-one": "no NUMA information for GPU 2",
            "missing-file": "no NUMA information for GPU 1", "one-node": "one NUMA node",
            "span": "NUMA nodes 0,1", "off": "NUMA_BIND=0"}[case]
    assert want in b.note, b.note
    # a server spanning nodes still binds each TP worker to its own GPU's node through SGLang
    assert tp.sglang_numa_args(b) == (["--numa-node", "0", "0", "0", "1"] if case == "span" else [])


def test_plan_and_dry_run_carry_the_binding(tmp_path):
    smi = make_smi(tmp_path / "nvidia-smi")
    sysfs = make_sysfs(tmp_path / "sys", TWO_NODES, {0: "0-7", 1: "8-15"})
    p = plan(tmp_path, sysfs, smi)
    pre, dec = [x for x in p.procs if x.role != "router"]
    assert pre.numa["node"] == 0 and dec.numa["node"] == 1 and dec.numa["cpus"] == list(range(8, 16))
    assert pre.argv[-5:] == ["--numa-node", "0", "0", "0", "0"] and dec.argv[-5:] == ["--numa-node", "1", "1", "1", "1"]
    text = render_dry_run(p)
    assert "numa prefill: NUMA node 0, CPUs 0-7 [GPU 0: node 0, GPU 1: node 0, GPU 2: node 0, GPU 3: node 0]" in text
    assert "numa decode: NUMA node 1, CPUs 8-15" in text
    # the plan survives the JSON round trip the detached supervisor reads
    from dsv4_sm120.serving.plan import Plan
    assert Plan.from_json(p.to_json()).procs[1].numa["node"] == 1
    # a --numa-node the user passes is kept, not overridden
    user = plan(tmp_path, sysfs, smi, PREFILL_EXTRA_ARGS="--numa-node 1 1 0 0")
    uargv = user.procs[0].argv
    assert uargv.count("--numa-node") == 1 and uargv[-5:] == ["--numa-node", "1", "1", "0", "0"]
    # NUMA_BIND=0: no binding, no --numa-node, SGLang's own auto-binding off
    off = plan(tmp_path, sysfs, smi, NUMA_BIND="0")
    for x in off.procs[:2]:
        assert "--numa-node" not in x.argv and x.env["SGLANG_AUTO_NUMA_BIND"] == "0" and x.numa["node"] is None
    assert "numa prefill: unbound (NUMA_BIND=0)" in render_dry_run(off)
    # a yes/no switch: the usual words are taken, anything else is refused (the settings registry's bool kind)
    assert plan(tmp_path, sysfs, smi, NUMA_BIND="no").procs[0].numa["node"] is None
    with pytest.raises(ConfigError, match="NUMA_BIND='sometimes'"):
        plan(tmp_path, sysfs, smi, NUMA_BIND="sometimes")
    # a box without NUMA information runs unbound, with the note in the dry run
    bare = plan(tmp_path, tmp_path / "empty-sys", smi)
    assert all("--numa-node" not in x.argv for x in bare.procs)
    assert "numa decode: unbound (no NUMA information for GPU 4" in render_dry_run(bare)


def test_sglang_parses_the_numa_flag(python_child):
    code = ("from sglang.srt.server_args import prepare_server_args\n"
            "a = prepare_server_args(['--model-path', 'x', '--tp', '4', '--numa-node', '1', '1', '0', '1'])\n"
            "print(a.numa_node)")
    r = python_child(code, timeout=300, cwd=os.getcwd())
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[1, 1, 0, 1]"


def test_apply_binding_pins_a_real_process(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    target = allowed[-1:]
    code = ("import os, sys, subprocess; sys.path.insert(0, sys.argv[1])\n"
            "from dsv4_sm120.serving.topology import apply_binding, allowed_cpus\n"
            f"print(apply_binding({target!r}, 0))\n"
            "child = subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'],"
            " capture_output=True, text=True)\n"
            "print(allowed_cpus(os.getpid())); print(child.stdout.strip())")
    r = subprocess.run([sys.executable, "-c", code, str(REPO / "overlay")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert f"CPUs {tp.format_cpus(target)}" in lines[0]
    assert lines[1] == str(target) and lines[2] == str(target)     # inherited by what the server starts
    assert sorted(os.sched_getaffinity(0)) == allowed                # the caller is untouched
    # CPUs the process may not use are skipped, not forced
    assert "skipped" in subprocess.run(
        [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]);"
         "from dsv4_sm120.serving.topology import apply_binding; print(apply_binding([100000], None))",
         str(REPO / "overlay")], capture_output=True, text=True, timeout=60).stdout


def test_kv_bytes_match_an_independent_count():
    # independent recount from the layout rules (rows of 576 B + 8 B scales, padded to 576)
    def page(p):
        logical = p * 584
        return (logical + 575) // 576 * 576

    assert (page(256), page(64), page(2)) == (149760, 37440, 1728)
    assert kb.kv_page_bytes(256) == 149760 and kb.indexer_bytes_per_token() == 132
    r = kb.FLASH_COMPRESS_RATIOS
    assert len(r) == 43 and r[:3] == [0, 0, 4] and r.count(4) == 21 and r.count(128) == 20
    for n in (1, 127, 128, 129, 255, 256, 257, 1000, 1024, 1100, 8192, 32768, 131072):
        pages = -(-n // 256)
        last_window = set(range(max(0, n - 128), n))
        swa = len({t // 256 for t in last_window})                   # pages touched by the last 128 tokens
        want = 43 * swa * 149760 + 21 * pages * (37440 + 64 * 132) + 20 * pages * 1728
        assert kb.transfer_bytes(n) == want, n
        assert kb.summary(n)["total"] == want
    assert kb.summary(1024)["descriptors"] == 43 + 21 * 4 * 2 + 20 * 4
    with pytest.raises(ValueError):
        kb.transfer_bytes(0)


def test_kv_bytes_from_a_checkpoint_config(tmp_path):
    import json
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 4, "compress_ratios": [0, 4, 4, 128, 0]}))
    ratios = kb.compress_ratios_from_config(cfg)
    assert ratios == [0, 4, 4, 128]
    # 512 tokens: the last 128 sit in one SWA page; 2 full pages for each of 2 c4 layers and 1 c128 layer
    assert kb.transfer_bytes(512, ratios) == 4 * 1 * 149760 + 2 * 2 * (37440 + 8448) + 1 * 2 * 1728
    cfg.write_text(json.dumps({"num_hidden_layers": 2, "compress_ratios": [0, 8]}))
    with pytest.raises(ValueError, match=r"\[8\]"):
        kb.compress_ratios_from_config(cfg)
