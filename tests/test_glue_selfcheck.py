"""The startup self-check of dsv4_sm120.sglang_glue.selfcheck on the CPU (Triton interpreter), without SGLang:

* MoE: the first ``dsv4_triton_nvfp4`` layer's ``prepare_layer`` checks our runner on that layer's own weights
  against the float64 reference; with ``DSV4_SM120_TEST_SELFCHECK_FAULT=moe`` its first path is wrong, the check
  catches it and the process serves on the kernel's other path (its output then matches the reference); when no
  path passes the server stops with one line naming the CUTLASS runner;
* attention: an exception in our kernel at every launch the check runs disables it (every route goes to SGLang's
  stock dispatcher), logged with the kernel, the shape and the error; ``DSV4_SM120_SELFCHECK=0`` skips the check
  (per-launch fallbacks: tests/test_glue_fallback.py).
The same check with a wrong attention kernel through the patched SGLang: tests/test_glue_selfcheck_sglang.py."""

from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover
    pytest.skip("CPU MoE tests need TRITON_INTERPRET=1 (set before triton is imported)", allow_module_level=True)

import torch  # noqa: E402

from dsv4_sm120.moe.reference import moe_reference, rel_err  # noqa: E402
from dsv4_sm120.moe.testing import make_layer, random_routing  # noqa: E402
from dsv4_sm120.sglang_glue import attention as D  # noqa: E402
from dsv4_sm120.sglang_glue import moe as M  # noqa: E402
from dsv4_sm120.rank_agreement import StopServer  # noqa: E402
from dsv4_sm120.sglang_glue import selfcheck as S  # noqa: E402

E, H, I, K = 6, 64, 32, 2


def layer(seed):
    return make_layer(E, H, I, K, seed)


@pytest.fixture
def fresh(monkeypatch):
    for k in ("DSV4_SM120_TEST_SELFCHECK_FAULT", "DSV4_SM120_SELFCHECK", "DSV4_SM120_ATTN_BACKEND"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("DSV4_SM120_MOE_PATH", "auto")   # restored after the test, whatever the check sets
    monkeypatch.setenv("DSV4_SM120_PROFILE_DIR", "")     # profiles off: default decisions
    S.reset()
    D.reset()
    S._state.pop("moe_fallback", None)
    yield monkeypatch
    S.reset()
    D.reset()
    S._state.pop("moe_fallback", None)


def test_moe_self_check_passes_on_the_clean_kernel(fresh, caplog):
    lay, _ = layer(3)
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        M.prepare_layer(lay)
    res = S.results()["moe"]
    assert res["ok"] and res["err"] < S.MOE_TOL and res["fallback"] is None, res
    assert res["shape"] == f"M=2 E={E} H={H} I={I}"
    assert any("self-check: MoE ok" in x for x in caplog.messages)
    assert os.environ["DSV4_SM120_MOE_PATH"] == "auto"
    M.prepare_layer(layer(4)[0])                        # once per process
    assert S.results()["moe"] is res


def test_moe_fault_is_caught_and_the_other_path_serves(fresh, caplog):
    fresh.setenv("DSV4_SM120_TEST_SELFCHECK_FAULT", "moe")
    lay, W = layer(5)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    tw, ids = random_routing(3, E, K, 11)
    ref = moe_reference(x, **W, topk_weights=tw, topk_ids=ids, swiglu_limit=1.5)
    lay._dsv4_w13_scale_2 = W["w13_scale_2"].float()
    lay._dsv4_w2_scale_2 = W["w2_scale_2"].float()
    assert 0.8 < rel_err(M.run_experts(lay, x, tw, ids), ref) < 1.3     # the fault is live before the check
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        M.prepare_layer(lay)
    res = S.results()["moe"]
    assert not res["ok"] and "relative error" in res["error"] and res["err"] > 0.5, res
    other = "bf16" if res["path"] == "fp4" else "fp4"
    assert res["fallback"] == other and res["fallback_error"] is None and res["fallback_err"] < S.MOE_TOL
    assert os.environ["DSV4_SM120_MOE_PATH"] == other
    assert rel_err(M.run_experts(lay, x, tw, ids), ref) < S.MOE_TOL   # serving now gets a right answer
    failed = [x for x in caplog.messages if "FAILED" in x]
    assert len(failed) == 1 and f"MoE kernel (path {res['path']}) FAILED at M=2 E={E} H={H} I={I}" in failed[0]


def test_moe_fails_on_every_path_stops_with_one_line(fresh):
    import dsv4_sm120.moe as moe_pkg

    def broken(*a, **k):
        raise RuntimeError("illegal instruction")

    fresh.setattr(moe_pkg, "nvfp4_fused_moe", broken)
    with pytest.raises(StopServer) as e:
        M.prepare_layer(layer(6)[0])
    msg = str(e.value)
    assert "RuntimeError: illegal instruction" in msg and "DSV4_SM120_MOE_BACKEND=flashinfer_cutlass" in msg
    assert "\n" not in msg


def test_attention_exception_disables_our_kernel(fresh, caplog):
    from dsv4_sm120.sglang_glue import attention as A

    def broken(q, num_heads, kw, launch=None, qk=None):
        raise RuntimeError("out of resources: shared memory")

    fresh.setattr(A, "run_dsv4_kernel", broken)
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        cases = S.run([16], torch.device("cpu"))
    # every layout's launch runs and fails: the whole kernel is disabled (what the evidence says)
    assert [c["shape"].split(" K=")[0] for c in cases] == ["swa T=2 H=16", "swa_c4 T=2 H=16", "swa_c128 T=2 H=16"]
    assert all(not c["ok"] and "RuntimeError: out of resources" in c["error"] for c in cases)
    assert D.disabled("attention").startswith("swa T=2 H=16")
    assert {D.attention_route(t, lay).backend for t in (1, 64) for lay in D.LAYOUTS} == {D.STOCK}
    assert any("attention kernel FAILED at swa T=2 H=16" in x and "out of resources" in x for x in caplog.messages)
    assert any("every launch of our attention kernel failed; disabled" in x for x in caplog.messages)
    assert S.run([16], torch.device("cpu")) is cases      # once per process


def test_self_check_off_and_nothing_to_check(fresh):
    fresh.setenv("DSV4_SM120_SELFCHECK", "0")
    assert S.run([16], torch.device("cpu")) == [] and S.done()
    fresh.setenv("DSV4_SM120_SELFCHECK", "1")
    fresh.setenv("DSV4_SM120_ATTN_BACKEND", "flashinfer")      # ours never serves: nothing runs
    D.reset()
    assert not S.done()
    assert S.run([16], torch.device("cpu")) == [] and D.disabled("attention") is None
