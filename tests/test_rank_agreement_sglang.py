"""The ranks agree, through the patched pinned SGLang's own groups on a CPU gloo world (2 and 4 ranks, each a forked
process, every rank killed at the end whatever happens; tests/rank_harness.py, the ranks' code in
tests/rank_scenarios.py). A fault on ONE rank only; every rank takes the same decision, nothing hangs, and the
log names the rank:

* the self-check before capture (patch 0006's hook in ``DecodeCudaGraphRunner._capture_one_stream``):
  ``DSV4_SM120_TEST_SELFCHECK_FAULT=attention-raise`` on rank 2 only (``DSV4_SM120_TEST_FAULT_RANKS``) disables our
  attention kernel on every rank; a launch failing on rank 1 only steps aside on every rank;
* a capture of one size that raises on rank 2 after our kernel stepped aside (the decode loop; the prefill loop on
  2 ranks): every rank captures that size again, together (every all-reduce of the stand-in capture sums the same
  step on every rank). Without the agreement (each rank deciding alone, as before) the same fault makes the other ranks' all-reduces silently sum other steps
  and rank 2 time out: the test guards something. A capture that raised without a fallback of ours, or raised
  again, stops every rank with one line naming the rank;
* a rank that never reaches an agreement: the others stop within ``DSV4_SM120_RANK_AGREE_TIMEOUT_S`` naming it;
* the MoE self-check: path 1 failing on rank 1 switches every rank; both paths failing on rank 1 stops every rank;
* the PCIe-IPC all-reduce (patch 0007): the communicator's set-up raising on rank 1 leaves every rank on NCCL (the
  sums are right); without the agreement rank 1 all-reduces on another group than the others and no sum is right;
  the workspace build or tune failing on rank 1 keeps every rank off PCIe IPC.
"""

from __future__ import annotations

import json

import pytest

CODE = ("import json, sys; sys.path.insert(0, 'tests'); import rank_harness as H; "
        "print('RESULT' + json.dumps(H.run(json.loads(sys.argv[1]))))")
PRELOAD = ["sglang.srt.model_executor.runner.decode_cuda_graph_runner",
           "sglang.srt.model_executor.runner.prefill_cuda_graph_runner", "sglang.srt.distributed.parallel_state",
           "sglang.srt.distributed.device_communicators.pcie_ipc_ar", "sglang.kernels.ops.attention.flash_mla_sm120",
           "dsv4_sm120.sglang_glue.graphs", "dsv4_sm120.moe.testing", "dsv4_sm120.moe.reference"]
NO_AGREEMENT = "rank_scenarios:_no_agreement"
IPC = {"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "1", "RANK_HARNESS_IPC_FAIL": "1"}


def _spec(name, fn, ranks, **kw):
    return {"name": name, "fn": f"rank_scenarios:{fn}", "ranks": ranks, "init": "sglang", **kw}


SPECS = [
    _spec("check_disable", "capture", 4, args={"capture_bs": [4, 8]},
          env={"DSV4_SM120_TEST_SELFCHECK_FAULT": "attention-raise", "DSV4_SM120_TEST_FAULT_RANKS": "2"}),
    _spec("check_launch", "capture", 4, args={"capture_bs": [4, 8], "check_fail_rank": 1}),
    _spec("capture_again", "capture", 4, args={"fail_rank": 2, "fail_size": 8}),
    _spec("capture_alone", "capture", 4, args={"fail_rank": 2, "fail_size": 8, "no_agreement": True},
          gloo_timeout=3, deadline=12),
    _spec("prefill_again", "capture", 2, args={"fail_rank": 1, "fail_size": 8, "prefill": True}),
    _spec("capture_not_ours", "capture", 2, args={"fail_rank": 1, "fail_size": 8, "step_aside": False}),
    _spec("capture_fails_twice", "capture", 2, args={"fail_rank": 1, "fail_size": 8, "fail_times": 2}),
    _spec("silent_rank", "capture", 4, args={"stall_rank": 3}, env={"DSV4_SM120_RANK_AGREE_TIMEOUT_S": "2"},
          wait_for=[0, 1, 2], deadline=15),
    _spec("moe_switch", "moe", 2, env={"DSV4_SM120_TEST_SELFCHECK_FAULT": "moe-raise",
                                       "DSV4_SM120_TEST_FAULT_RANKS": "1"}),
    _spec("moe_both", "moe", 2, args={"fail_rank": 1, "both": True}),
    _spec("moe_alone", "moe", 2, args={"no_agreement": True}, env={"DSV4_SM120_TEST_SELFCHECK_FAULT": "moe-raise",
                                                                   "DSV4_SM120_TEST_FAULT_RANKS": "1"}),
    _spec("ipc_setup", "ipc_setup", 4, env=IPC, ipc="rank_scenarios:StandInIpc"),
    _spec("ipc_setup_alone", "ipc_setup", 4, env=IPC, ipc="rank_scenarios:StandInIpc", before=NO_AGREEMENT,
          gloo_timeout=3, deadline=12),
    _spec("ws_clean", "ipc_workspace", 2),
    _spec("ws_build", "ipc_workspace", 2, env={"RANK_HARNESS_WS_FAIL": "build:1"}),
    _spec("ws_tune", "ipc_workspace", 2, env={"RANK_HARNESS_WS_FAIL": "tune:1"}),
    _spec("ws_alone", "ipc_workspace", 2, args={"no_agreement": True}, env={"RANK_HARNESS_WS_FAIL": "build:1"}),
]


@pytest.fixture(scope="module")
def out(run_patched):
    """Every scenario, in one child of the patched SGLang (its modules imported once, before the ranks fork)."""
    specs = [dict(s, preload=PRELOAD if i == 0 else []) for i, s in enumerate(SPECS)]
    code = CODE.replace("sys.argv[1]", repr(json.dumps(specs)))
    r = run_patched(code, env={"TRITON_INTERPRET": "1", "DSV4_SM120_PROFILE_DIR": ""}, timeout=400)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert lines, r.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT"):])


def _results(o):
    assert o["unfinished"] == [], o
    assert all(r["error"] is None for r in o["ranks"]), [r.get("trace") or r["error"] for r in o["ranks"]]
    return [r["result"] for r in o["ranks"]]


def _lines(o, text):
    return [[x for x in r.get("logs", []) if text in x] for r in o["ranks"]]


def test_a_self_check_fault_on_one_rank_disables_our_kernel_on_every_rank(out):
    res = _results(out["check_disable"])
    assert all(r["disabled"].startswith("rank 2: swa T=4 H=8") for i, r in enumerate(res) if i != 2), res
    assert res[2]["disabled"].startswith("swa T=4 H=8") and "planted test fault attention-raise" in res[2]["disabled"]
    assert all(set(r["routes"].values()) == {"stock"} for r in res), res
    assert all(r["captured"] == [8, 4] and r["sums_ok"] for r in res), res      # captured once, together
    lines = _lines(out["check_disable"], "failed its self-check on rank 2")
    assert all(len(x) == 1 for x in lines), lines
    assert lines[0][0].startswith("dsv4_sm120 decode self-check: every launch of our attention kernel failed its "
                                  "self-check on rank 2 (") and "planted test fault attention-raise" in lines[0][0]
    assert lines[0][0].endswith("(agreed by all 4 ranks)") and "stock dispatcher" in lines[0][0]
    assert all(x == lines[0] for x in lines)
    assert not any(_lines(out["check_disable"], "FAILED")[r] for r in (0, 1, 3))   # only rank 2 ran the fault


def test_a_launch_failing_on_one_rank_steps_aside_on_every_rank(out):
    res = _results(out["check_launch"])
    for r in res:
        assert r["disabled"] is None, r
        assert {k: v for k, v in r["routes"].items()} == {"swa:4": "dsv4", "swa:8": "dsv4", "swa_c4:4": "stock",
                                                          "swa_c4:8": "stock"}, r
    lines = _lines(out["check_launch"], "(agreed by all 4 ranks)")
    assert all(len(x) == 1 and x == lines[0] for x in lines), lines
    assert lines[0][0].startswith("dsv4_sm120 decode self-check: our attention kernel failed on rank 1 (self-check "
                                  "T=4: RuntimeError: out of resources"), lines[0][0]
    assert "rows 4,8 of swa_c4 H=8 run SGLang's stock dispatcher" in lines[0][0]


def test_a_capture_raising_on_one_rank_is_captured_again_by_every_rank_together(out):
    res = _results(out["capture_again"])
    for r in res:
        assert r["captured"] == [16, 8, 8, 4] and r["sums_ok"] and r["n_sums"] == 12, r
        assert r["routes"]["swa:8"] == "stock" and r["routes"]["swa_c4:8"] == "dsv4", r
    for text in ("decode: CUDA-graph capture of size 8 raised on rank 2 (RuntimeError: operation failed due to a "
                 "previous error during capture) after our kernel stepped aside there; agreed by all 4 ranks: every "
                 "rank captures that size again",
                 "dsv4_sm120 decode: CUDA-graph capture of size 8 again succeeded on all 4 ranks",
                 "dsv4_sm120 decode capture of size 8: our attention kernel failed on rank 2 (serving T=8: "
                 "RuntimeError: illegal instruction (planted on this rank)) at launch swa H=8"):
        assert all(len(x) == 1 for x in _lines(out["capture_again"], text)), (text, out["capture_again"])


def test_the_prefill_runner_captures_again_together_too(out):
    res = _results(out["prefill_again"])
    assert all(r["captured"] == [16, 8, 8, 4] and r["sums_ok"] for r in res), res
    assert all(len(x) == 1 for x in _lines(out["prefill_again"], "dsv4_sm120 prefill: CUDA-graph capture of size 8 "
                                                                   "again succeeded on all 2 ranks")), out
    # the prefill loop ran no attention self-check: our kernel does not serve prefill rows by default
    assert not any(_lines(out["prefill_again"], "self-check (prefill)")[r] for r in (0, 1))


def test_without_agreement_the_same_fault_mispairs_the_all_reduces(out):
    o = out["capture_alone"]
    ranks = o["ranks"]
    # rank 2 captured size 8 again alone: the others' all-reduces summed other steps, and rank 2 waited in vain
    others = [r["result"] for r in ranks if r["rank"] != 2 and r.get("result")]
    assert others and all(not r["sums_ok"] and r["captured"] == [16, 8, 4] for r in others), o
    assert ranks[2].get("killed") or "Timed out" in (ranks[2].get("error") or ""), ranks[2]


def test_a_capture_error_not_ours_or_raised_again_stops_every_rank_naming_it(out):
    for name, text in (("capture_not_ours", "dsv4_sm120 decode: CUDA-graph capture of size 8 raised on rank 1 "
                        "(RuntimeError: operation failed due to a previous error during capture), not after a "
                        "fallback of ours; every rank stops (agreed by all 2 ranks)"),
                       ("capture_fails_twice", "dsv4_sm120 decode: CUDA-graph capture of size 8 raised again on "
                        "rank 1 (RuntimeError: operation failed due to a previous error during capture) after every "
                        "rank took the fallbacks; every rank stops (agreed by all 2 ranks)")):
        o = out[name]
        assert o["unfinished"] == [], o
        assert [r["error"] for r in o["ranks"]] == [f"StopServer: {text}"] * 2, o
        assert all(r["stop"] for r in o["ranks"])


def test_a_rank_that_never_answers_stops_the_others_naming_it(out):
    o = out["silent_rank"]
    assert o["unfinished"] == [3], o
    for r in o["ranks"][:3]:
        assert r["stop"] and r["error"] == (
            "RankTimeout: dsv4_sm120: rank 3 of group tp:0 (4 ranks) did not reach agreement 'decode self-check "
            "before capture' (step 0) within 2 s (DSV4_SM120_RANK_AGREE_TIMEOUT_S); the server stops instead of "
            "hanging"), r
        assert r["seconds"] < 10, r


def test_the_moe_path_switch_is_agreed(out):
    res = _results(out["moe_switch"])
    first = res[0]["first"]
    other = "fp4" if first == "bf16" else "bf16"
    assert all(r["path"] == other and r["fallback"] == other and r["fallback_active"] for r in res), res
    assert [r["ok"] for r in res] == [True, False]          # the first path failed on rank 1 only
    lines = _lines(out["moe_switch"], "agreed by all 2 ranks: every rank tries its")
    assert all(len(x) == 1 for x in lines) and "failed at M=2 E=6 H=64 I=32 on rank 1 (RuntimeError: planted " \
        "test fault moe-raise" in lines[0][0], lines
    # deciding alone, the ranks would serve the MoE on different paths
    alone = _results(out["moe_alone"])
    assert [r["path"] for r in alone] == [None, other], alone


def test_the_moe_failing_on_every_path_on_one_rank_stops_every_rank(out):
    o = out["moe_both"]
    assert o["unfinished"] == [] and all(r["stop"] for r in o["ranks"]), o
    msgs = {r["error"] for r in o["ranks"]}
    assert len(msgs) == 1, msgs
    msg = msgs.pop()
    assert msg.startswith("StopServer: dsv4_sm120 self-check: our MoE kernel fails at M=2 E=6 H=64 I=32 (path ")
    assert "rank 1 (RuntimeError: illegal instruction (planted on this rank))" in msg
    assert msg.endswith("), every rank stops (agreed by all 2 ranks); restart with "
                        "DSV4_SM120_MOE_BACKEND=flashinfer_cutlass")


def test_a_pcie_ipc_setup_failing_on_one_rank_leaves_every_rank_on_nccl(out):
    res = _results(out["ipc_setup"])
    assert [(r["path"], r["sum_ok"]) for r in res] == [("nccl", True)] * 4, res
    lines = _lines(out["ipc_setup"], "PCIe-IPC")
    assert all(len(x) == 1 and x == lines[0] for x in lines), lines
    assert lines[0][0] == ("dsv4_sm120: FlashInfer PCIe-IPC all-reduce set-up failed on rank 1 (RuntimeError: "
                           "cudaIpcOpenMemHandle failed: invalid device context (planted on this rank)); agreed by "
                           "all 4 ranks: every rank of group tp:0 all-reduces with NCCL")
    # without the agreement: rank 1 on NCCL, the others on "PCIe IPC" (another group): no rank gets a right sum
    alone = out["ipc_setup_alone"]["ranks"]
    assert not any(r.get("result", {}).get("sum_ok") for r in alone), alone
    assert [r.get("result", {}).get("path") for r in alone if r.get("result")] != ["nccl"] * 4


def test_a_pcie_ipc_workspace_failing_on_one_rank_keeps_every_rank_off_it(out):
    assert [r["uses_ipc"] for r in _results(out["ws_clean"])] == [True, True]
    build = _results(out["ws_build"])
    assert [(r["uses_ipc"], r["disabled"], r["workspace"]) for r in build] == [(False, True, False)] * 2, build
    line = _lines(out["ws_build"], "workspace build failed")[0]
    assert line == ["dsv4_sm120: FlashInfer PCIe-IPC all-reduce workspace build failed on rank 1 (RuntimeError: "
                    "create_shared_buffer: cudaIpcGetMemHandle failed (planted on this rank)); agreed by all 2 ranks: "
                    "every rank of group tp:0 all-reduces with NCCL"], line
    tune = _results(out["ws_tune"])
    assert [(r["uses_ipc"], r["workspace"]) for r in tune] == [(False, True)] * 2, tune   # joint destroy at exit
    assert "workspace tune failed on rank 1 (OSError: cannot write the tune cache" in \
        _lines(out["ws_tune"], "tune failed")[0][0]
    assert [r["uses_ipc"] for r in _results(out["ws_alone"])] == [True, False]           # alone: they differ
