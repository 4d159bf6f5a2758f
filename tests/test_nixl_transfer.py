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


# ---- PD with speculative decoding: the draft's state travels with the target's KV (docs/speculative.md)
#
# What SGLang 0.5.23 registers for a DeepSeek-V4 pair (disaggregation/utils.py setup_state_kv_args, the
# memory pool's *_buf_infos), one buffer per layer, items addressed by index:
#   target KV       c4 pages (64 tokens) and c128 pages (2 tokens) of the compressed layers
#   target SWA      StateType.SWA: 256-token SWA pages of every target layer
#   draft SWA       a second StateType.SWA component: the draft pool's SWA pages (3 DSpark stages / 1 MTP
#                   layer), at the same SWA page indices as the target's (shared full_to_swa mapping)
#   DSpark          StateType.REQUEST_ROW: the draft pool's swa_valid_from, one int64 per request slot
#   EAGLE           metadata rows of the request slot: output_topk_p [16] f32, output_topk_index [16] i64,
#                   output_hidden_states [4096] bf16 (the first draft step's input on the decode side)

SLOTS, SWA_PAGES = 16, 8


def _speculative_components(algo: str, seed: int):
    """name -> (source pools [items, item_bytes] per layer, source indices, destination indices)."""
    rng = np.random.default_rng(seed)

    def pools(n_layers, n_items, item_bytes, page_tokens=None):
        if page_tokens is not None:
            return [nc.make_kv_pages(n_items, page_tokens, int(rng.integers(1 << 30))) for _ in range(n_layers)]
        return [rng.integers(0, 256, (n_items, item_bytes), dtype=np.uint8) for _ in range(n_layers)]

    def pick(n_items, k):
        return [int(x) for x in rng.choice(n_items, k, replace=False)], [int(x) for x in rng.choice(n_items, k, replace=False)]

    c4_src, c4_dst = pick(12, 4)
    c128_src, c128_dst = pick(12, 5)
    swa_src, swa_dst = pick(SWA_PAGES, 2)           # the request's window pages (128 tokens over <= 2 pages)
    slot_src, slot_dst = pick(SLOTS, 1)             # the request's slot on each side
    comps = {
        "target_kv_c4": (pools(2, 12, 0, page_tokens=64), c4_src, c4_dst),
        "target_kv_c128": (pools(2, 12, 0, page_tokens=2), c128_src, c128_dst),
        "target_swa": (pools(2, SWA_PAGES, 0, page_tokens=256), swa_src, swa_dst),
        "draft_swa": (pools(3 if algo == "dspark" else 1, SWA_PAGES, 0, page_tokens=256), swa_src, swa_dst),
    }
    if algo == "dspark":
        valid_from = rng.integers(0, 1 << 20, SLOTS, dtype=np.int64)
        comps["draft_swa_valid_from"] = ([valid_from.view(np.uint8).reshape(SLOTS, 8)], slot_src, slot_dst)
    else:
        comps["eagle_topk_p"] = (pools(1, SLOTS, 16 * 4), slot_src, slot_dst)
        comps["eagle_topk_index"] = (pools(1, SLOTS, 16 * 8), slot_src, slot_dst)
        comps["eagle_hidden_states"] = (pools(1, SLOTS, 4096 * 2), slot_src, slot_dst)
    return comps


def _move_speculative_state(algo: str, seed: int, corrupt: str = ""):
    """Prefill agent WRITEs every component (one transfer each, as SGLang's NIXL connector does) into a
    poisoned decode-side copy; returns {component: verification counts}."""
    comps = _speculative_components(algo, seed)
    prefill = nc._make_agent(f"dsv4-spec-prefill-{seed}", "UCX")
    decode = nc._make_agent(f"dsv4-spec-decode-{seed}", "UCX")
    dst = {k: [np.full_like(p, nc.POISON) for p in src] for k, (src, _, _) in comps.items()}
    for k, (src, _, _) in comps.items():
        nc._register(prefill, src)
        nc._register(decode, dst[k])
    name = prefill.add_remote_agent(decode.get_agent_metadata())
    name = name.decode() if isinstance(name, bytes) else name
    decode.add_remote_agent(prefill.get_agent_metadata())
    for k, (src, si, di) in comps.items():
        notif = f"room={seed}:{k}".encode()
        nc._initiator_write(prefill, name, src, si, nc._page_descs(dst[k], di), notif, 30.0)
        nc._wait(lambda: decode.check_remote_xfer_done(f"dsv4-spec-prefill-{seed}", notif), 30.0, f"{k} notification")
    if corrupt:
        dst[corrupt][-1][comps[corrupt][2][-1], -1] ^= 0x10
    return {k: nc._verify(src, si, dst[k], di, src[0].shape[0]) for k, (src, si, di) in comps.items()}, comps


@pytest.mark.parametrize("algo", ["dspark", "eagle"])
def test_pd_moves_the_draft_state_with_the_target_kv(algo):
    seed = int.from_bytes(os.urandom(3), "little")
    res, comps = _move_speculative_state(algo, seed)
    assert all(v == {"bad_moved_pages": 0, "bad_untouched_pages": 0} for v in res.values()), (seed, res)
    # the draft's state is really part of it: its SWA pages per draft layer, and the per-algorithm rows
    src, si, _ = comps["draft_swa"]
    assert len(src) == (3 if algo == "dspark" else 1) and src[0].shape[1] == nc.kv_page_bytes(256) == 149760
    assert si == comps["target_swa"][1]               # same SWA page indices as the target's window
    want = {"draft_swa_valid_from"} if algo == "dspark" else {"eagle_topk_p", "eagle_topk_index", "eagle_hidden_states"}
    assert want <= set(res)


@pytest.mark.parametrize("algo,corrupt", [("dspark", "draft_swa"), ("dspark", "draft_swa_valid_from"),
                                          ("eagle", "eagle_hidden_states")])
def test_pd_speculative_verification_catches_a_flipped_draft_byte(algo, corrupt):
    res, _ = _move_speculative_state(algo, int.from_bytes(os.urandom(3), "little"), corrupt=corrupt)
    assert res[corrupt]["bad_moved_pages"] == 1, res
    assert all(v["bad_moved_pages"] == 0 for k, v in res.items() if k != corrupt), res
