"""Two real NIXL agents (UCX backend, DRAM) move buffers laid out like DeepSeek-V4 KV pages.

This is the transfer the serving preflight's NIXL check runs (dsv4_sm120.serving.nixl_check).
nixl must be installed in the test environment (nixl-cu13==1.5.1 + nixl==1.5.1 --no-deps):
a missing package is a failure, not a skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "overlay"))
from dsv4_sm120.serving import nixl_check as nc  # noqa: E402


def test_nixl_is_installed():
    import importlib.util
    assert importlib.util.find_spec("nixl"), "nixl is missing from the test environment (requirements/nodeps.txt)"
    from nixl._api import nixl_agent  # noqa: F401


@pytest.mark.parametrize("p,expected", [(256, 149760), (64, 37440), (2, 1728)])
def test_page_bytes_match_sglang_layout(p, expected):
    # independent: rows of 576 B + 8 B/token of scales, padded to a multiple of 576
    assert nc.kv_page_bytes(p) == expected
    assert expected % 576 == 0 and expected >= p * 584 > expected - 576


def test_page_content_layout():
    pool = nc.make_kv_pages(3, 64, seed=1)
    assert pool.shape == (3, 37440) and pool.dtype == np.uint8
    scales = pool[:, 64 * 576:64 * 584].reshape(3, 64, 8)
    assert (scales[:, :, 7] == 0).all() and (scales[:, :, :7] >= 100).all()
    assert (pool[:, 64 * 584:] == 0).all()                       # tail padding
    assert not (nc.make_kv_pages(3, 64, seed=2) == pool).all()   # fresh content per seed


@pytest.mark.parametrize("page_tokens,two_process", [(64, False), (256, False), (2, False), (256, True)])
def test_two_agents_move_kv_pages_intact(page_tokens, two_process):
    rep = nc.run_check(page_tokens=page_tokens, num_pages=10, num_layers=3, n_xfer=4, two_process=two_process,
                       timeout_s=30)
    assert rep["ok"], rep
    assert rep["bad_moved_pages"] == 0 and rep["bad_untouched_pages"] == 0
    assert rep["bytes_moved"] == 4 * 3 * nc.kv_page_bytes(page_tokens)


@pytest.mark.parametrize("two_process", [False, True])
def test_verification_catches_a_flipped_byte(two_process):
    rep = nc.run_check(page_tokens=64, num_pages=8, num_layers=2, n_xfer=3, two_process=two_process,
                       corrupt_after=True, timeout_s=30)
    assert not rep["ok"] and rep["bad_moved_pages"] == 1, rep


def test_cli_json_and_exit_codes():
    env = dict(os.environ, PYTHONPATH=str(REPO / "overlay"))
    r = subprocess.run([sys.executable, "-m", "dsv4_sm120.serving.nixl_check", "--json", "--page-tokens", "256"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["ok"] and rep["page_bytes"] == 149760
    r = subprocess.run([sys.executable, "-m", "dsv4_sm120.serving.nixl_check", "--backend", "NOSUCH"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "no NOSUCH backend" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "dsv4_sm120.serving.nixl_check", "--moved", "50"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "bad arguments" in r.stderr


def test_report_names_the_ucx_version_and_proto_info_parses():
    """The UCX version comes from the libucp NIXL loaded; with UCX_PROTO_INFO=y the real UCX prints its
    protocol tables, which ucx_info reads (host memory here: no GPU-to-GPU put to judge)."""
    from dsv4_sm120.serving import ucx_info
    rep = nc.run_check(page_tokens=64, num_pages=6, num_layers=2, n_xfer=2, timeout_s=30)
    assert rep["ok"] and ucx_info.parse_version(rep["ucx_version"]) >= (1, 15, 0), rep
    env = dict(os.environ, PYTHONPATH=str(REPO / "overlay"), UCX_PROTO_INFO="y")
    r = subprocess.run([sys.executable, "-m", "dsv4_sm120.serving.nixl_check", "--json", "--two-process"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    tables = ucx_info.parse_proto_info(r.stdout + r.stderr)
    puts = [t for t in tables if t["op"].startswith("remote memory write by ucp_put")]
    assert puts and all(t["src"] == "host" and t["dst"] == "host" and t["rows"] for t in puts)
    assert "host->host" in ucx_info.transports(tables)
    assert ucx_info.judge_cuda_put(tables)[0] is None


def test_vram_without_gpus_is_a_clear_error():
    import importlib.util
    if importlib.util.find_spec("torch"):
        import torch
        if torch.cuda.is_available():
            pytest.skip("this box has CUDA")
    env = dict(os.environ, PYTHONPATH=str(REPO / "overlay"))
    r = subprocess.run([sys.executable, "-m", "dsv4_sm120.serving.nixl_check", "--mem", "vram", "--src-gpu", "0",
                        "--dst-gpu", "1"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    want = "VRAM check needs GPUs 0 and 1" if importlib.util.find_spec("torch") else "VRAM check needs torch"
    assert want in r.stderr, r.stderr
