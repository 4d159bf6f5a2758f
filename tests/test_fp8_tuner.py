"""The FP8 tuner's search, resume and output logic (fake timer), its CLI, and one real run of SGLang's kernel
in Triton's CPU interpreter."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_sm120 import fp8_configs as fc
from dsv4_sm120 import fp8_configs as cf
from dsv4_sm120.fp8 import summary
from dsv4_sm120.fp8.errors import EXIT_INCOMPLETE, CandidateError, UsageError
from dsv4_sm120.fp8.gpu import GpuBench
from dsv4_sm120.fp8.search import Bench, candidate_configs, config_id, sglang_default_config
from dsv4_sm120.fp8.shapes import DEFAULT_MS, Shape, parse_ms, parse_shapes, shapes_for_tp
from dsv4_sm120.fp8.tuner import Tuner

REPO = Path(__file__).resolve().parents[1]


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class FakeBench(Bench):
    """Deterministic pseudo-random 'timings'; some configs fail their correctness check."""

    def __init__(self, clock: FakeClock, salt: str, sm90=False, fail_frac=0.2, step=1.0):
        self.clock, self.salt, self.sm90, self.fail_frac, self.step = clock, salt, sm90, fail_frac, step
        self.device_name_raw = "Fake GPU 9000"
        self.num_sms = 132
        self.kernel_tag = "fake"
        self.kernel_source = "fake"
        self.versions = {"fake": "1"}
        self.default_backend = {"name": "cutlass", "available": True, "reason": "fake"}
        self.calls = []

    def _h(self, *parts) -> float:
        d = hashlib.sha256(("|".join(map(str, parts)) + self.salt).encode()).digest()
        return int.from_bytes(d[:8], "little") / 2 ** 64

    def time_config(self, shape, M, cfg):
        self.clock.t += self.step
        self.calls.append((shape.key, M, None if cfg is None else config_id(cfg)))
        if cfg is None:
            return 100.0 + M
        if self._h("fail", shape.key, M, config_id(cfg)) < self.fail_frac:
            raise CandidateError("relative error 1.0 > 0.01")
        return 10.0 + 80.0 * self._h("t", shape.key, M, config_id(cfg))

    def time_linear(self, shape, M, cfg):
        return 50.0

    def time_default_backend(self, shape, M):
        return 60.0 if M <= 64 else 45.0


SHAPES = [Shape(1536, 4096, "a"), Shape(4096, 512, "b")]
MS = [1, 4, 24, 64, 300]


def expected_best(bench: FakeBench, shape, M, quick=True):
    best, best_t = None, math.inf
    for c in candidate_configs(M, shape.N, shape.K, sm90=bench.sm90, quick=quick):
        if bench._h("fail", shape.key, M, config_id(c)) < bench.fail_frac:
            continue
        t = 10.0 + 80.0 * bench._h("t", shape.key, M, config_id(c))
        if t < best_t:
            best, best_t = c, t
    return best


def _tuner(bench, out, clock, **kw):
    return Tuner(bench, SHAPES, MS, out, quick=True, clock=clock, progress=False, log=lambda s: None, **kw)


@pytest.mark.parametrize("sm90", [False, True])
def test_search_picks_fastest_passing_config(tmp_path, sm90):
    clock = FakeClock()
    b = FakeBench(clock, salt=str(random.random()), sm90=sm90)
    assert _tuner(b, tmp_path, clock).run() == 0
    for sh in SHAPES:
        table = json.loads((tmp_path / cf.config_file_name(sh.N, sh.K, b.device_name_raw)).read_text())
        assert set(table) == {str(m) for m in MS}
        cf.validate_config_table(table)
        for m in MS:
            assert table[str(m)] == expected_best(b, sh, m)
    s = json.loads((tmp_path / "summary_Fake_GPU_9000.json").read_text())
    row = s["shapes"][SHAPES[0].key]["rows"]["4"]
    assert row["sglang_default_cfg_us"] == 104.0
    for sh in SHAPES:
        for m in MS:
            want = sum(b._h("fail", sh.key, m, config_id(c)) < b.fail_frac
                       for c in candidate_configs(m, sh.N, sh.K, sm90=sm90, quick=True))
            assert s["shapes"][sh.key]["rows"][str(m)]["failed"] == want
    assert row["winner"] == "triton"
    # decision: 60/50 = 1.2x at M<=64, 45/50 = 0.9x at M>=256 -> triton
    assert s["decision"]["recommended_backend"] == "triton"
    assert fc.recommended_fp8_gemm_backend("Fake GPU 9000", tmp_path)[0] == "triton"
    md = (tmp_path / "summary_Fake_GPU_9000.md").read_text()
    assert "| 300 |" in md and "recommendation" in md


def test_resume_after_time_budget_matches_uninterrupted(tmp_path):
    salt = str(random.random())
    clock = FakeClock()
    full = FakeBench(clock, salt)
    assert _tuner(full, tmp_path / "full", clock).run() == 0
    n_full = len(full.calls)

    # stop part-way through the second shape (the time budget is counted in fake seconds = calls)
    clock2 = FakeClock()
    b1 = FakeBench(clock2, salt)
    per_shape = len(full.calls) // 2
    budget = per_shape + per_shape // 2
    rc = _tuner(b1, tmp_path / "res", clock2, time_budget=budget).run()
    assert rc == EXIT_INCOMPLETE
    out = tmp_path / "res"
    assert (out / cf.config_file_name(SHAPES[0].N, SHAPES[0].K, b1.device_name_raw)).is_file()
    assert not (out / cf.config_file_name(SHAPES[1].N, SHAPES[1].K, b1.device_name_raw)).exists()
    partial = json.loads(next(out.glob(".*.partial")).read_text())
    done_ms = set(partial["rows"])
    assert done_ms and done_ms != {str(m) for m in MS}
    s = json.loads((out / "summary_Fake_GPU_9000.json").read_text())
    assert s["decision"]["recommended_backend"] is None      # incomplete tuning never recommends

    clock3 = FakeClock()
    b2 = FakeBench(clock3, salt)
    assert _tuner(b2, out, clock3).run() == 0
    # nothing finished was timed again: first shape skipped, finished M values of the second skipped
    assert not any(k == SHAPES[0].key for k, _, _ in b2.calls)
    assert not any(k == SHAPES[1].key and str(m) in done_ms for k, m, _ in b2.calls)
    worst_m = max(len(candidate_configs(m, sh.N, sh.K, sm90=False, quick=True)) for m in MS for sh in SHAPES)
    assert n_full <= len(b1.calls) + len(b2.calls) <= n_full + worst_m + 2   # at most one M's work redone
    for sh in SHAPES:
        name = cf.config_file_name(sh.N, sh.K, b2.device_name_raw)
        assert json.loads((out / name).read_text()) == json.loads((tmp_path / "full" / name).read_text())
    assert not list(out.glob(".*.partial"))

    # third run: everything done -> no timing at all
    clock4 = FakeClock()
    b3 = FakeBench(clock4, salt)
    assert _tuner(b3, out, clock4).run() == 0 and b3.calls == []
    # --force, or a different search space (fingerprint), retunes
    assert _tuner(b3, out, clock4, force=True).run() == 0 and b3.calls
    b4 = FakeBench(FakeClock(), salt)
    t = Tuner(b4, SHAPES, MS + [2048], out, quick=True, clock=b4.clock, progress=False, log=lambda s: None)
    assert t.run() == 0 and {k for k, _, _ in b4.calls} == {s.key for s in SHAPES}


def test_all_candidates_fail_is_an_error(tmp_path):
    clock = FakeClock()
    b = FakeBench(clock, "x", fail_frac=1.1)
    with pytest.raises(RuntimeError, match="no candidate"):
        _tuner(b, tmp_path, clock).run()


def test_candidate_space_is_valid_for_sglang():
    for sm90 in (False, True):
        for quick in (True, False):
            for m in DEFAULT_MS:
                for sh in shapes_for_tp(4):
                    cands = candidate_configs(m, sh.N, sh.K, sm90=sm90, quick=quick)
                    assert sglang_default_config() in cands
                    ids = [config_id(c) for c in cands]
                    assert len(ids) == len(set(ids))
                    for c in cands:
                        cf.validate_config_table({str(m): c})
                        if not sm90:
                            assert "SWAP_AB" not in c and "SPLIT_K" not in c   # ignored by SGLang off sm_90
                        assert c.get("SPLIT_K", 1) <= -(-sh.K // c["BLOCK_SIZE_K"])
                if quick:
                    break


def test_shapes_for_tp():
    four = [(s.N, s.K) for s in shapes_for_tp(4)]
    assert four == [(1536, 4096), (8192, 1024), (4096, 2048), (1024, 4096), (4096, 512), (4096, 4096)]
    eight = [(s.N, s.K) for s in shapes_for_tp(8)]
    assert (4096, 1024) in eight and (512, 4096) in eight and (1536, 4096) in eight
    with pytest.raises(UsageError):
        shapes_for_tp(3)
    with pytest.raises(UsageError):
        parse_shapes("100,4096")
    with pytest.raises(UsageError):
        parse_ms("1,x")


def _cli(*args, env=None):
    e = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    e.update({"PYTHONPATH": str(REPO / "overlay"), "CUDA_VISIBLE_DEVICES": ""})
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "dsv4_sm120.tune_fp8", *args], capture_output=True, text=True,
                          env=e, timeout=300)


def test_cli_help_dry_run_and_errors(tmp_path):
    r = _cli("--help")
    assert r.returncode == 0 and "--quick" in r.stdout and "--dry-run" in r.stdout
    r = _cli("--dry-run", "--quick", "--device-name", "NVIDIA RTX PRO 6000 Blackwell Server Edition",
             "--out-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert cf.config_file_name(8192, 1024, "NVIDIA RTX PRO 6000 Blackwell Server Edition") in r.stdout
    assert not list(tmp_path.iterdir())                          # dry run writes nothing
    for bad in (["--ms", "0,1"], ["--shapes", "1,2"], ["--tp", "3"], ["--time-budget", "-1"]):
        r = _cli("--dry-run", *bad)
        assert r.returncode == 2 and r.stderr.startswith("error:") and "Traceback" not in r.stderr, bad
    r = _cli("--quick", "--out-dir", str(tmp_path))               # no GPU here
    assert r.returncode == 2 and "no CUDA GPU" in r.stderr and "Traceback" not in r.stderr


def test_dry_run_lists_per_m_candidate_counts(tmp_path):
    dev = "Fake GPU " + str(random.randrange(10 ** 6))
    ms = sorted({random.randint(1, 64)} | set(random.sample(range(65, 5000), 4)))   # a decode M and larger ones
    counts = {}
    for sm90 in ("yes", "no"):
        r = _cli("--dry-run", "--tp", "8", "--ms", ",".join(map(str, ms)), "--sm90", sm90, "--device-name", dev,
                 "--out-dir", str(tmp_path))
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        shapes = shapes_for_tp(8)
        per_m_lines = [l for l in lines if "candidates per M:" in l]
        assert len(per_m_lines) == len(shapes)
        total = 0
        for sh, line in zip(shapes, per_m_lines):
            got = dict(tuple(map(int, kv.split(":"))) for kv in line.split("candidates per M:")[1].split())
            want = {m: len(candidate_configs(m, sh.N, sh.K, sm90=sm90 == "yes", quick=False)) for m in ms}
            assert got == want, (sh, line)
            assert any(cf.config_file_name(sh.N, sh.K, dev) in l and f" {sum(want.values())} candidates" in l
                       for l in lines)
            total += sum(want.values())
        assert f"total {total} candidate timings" in r.stdout
        counts[sm90] = total
    assert counts["yes"] > counts["no"]          # SWAP_AB / SPLIT_K are searched on sm_90 only
    assert not list(tmp_path.iterdir())


def test_real_run_refuses_dry_run_flags_and_missing_torch(tmp_path):
    r = _cli("--device-name", "X", "--out-dir", str(tmp_path))
    assert r.returncode == 2 and "--dry-run only" in r.stderr and "Traceback" not in r.stderr
    # an environment without torch: a one-line error, nothing written
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("raise ImportError('no torch in this test')\n")
    out = tmp_path / "out"
    r = _cli("--quick", "--out-dir", str(out), env={"PYTHONPATH": f"{fake}{os.pathsep}{REPO / 'overlay'}"})
    assert r.returncode == 2 and "needs torch and triton" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not out.exists()


def test_config_for_m_matches_nearest_m_rule():
    rnd = random.Random()
    for _ in range(200):
        keys = rnd.sample(range(1, 5000), rnd.randint(1, 8))
        table = {str(k): {"BLOCK_SIZE_K": rnd.choice([16, 32, 48, 64, 96, 128, 256]), "tag": k} for k in keys}
        M = rnd.randint(1, 6000)
        # reference: smallest distance, ties to the first key in file order
        best = None
        for k in keys:
            if best is None or abs(k - M) < abs(best - M):
                best = k
        got = cf.config_for_m(table, M)
        assert got["tag"] == best
        bk = table[str(best)]["BLOCK_SIZE_K"]
        assert got["BLOCK_SIZE_K"] == (128 if bk in (48, 96) else bk)
        assert table[str(best)]["BLOCK_SIZE_K"] == bk                 # the loaded table is not modified


@pytest.mark.parametrize("decode,prefill,want", [
    (1.06, 0.81, "triton"), (1.06, None, "triton"), (1.04, 2.0, None), (1.5, 0.79, None)])
def test_backend_decision_rule(decode, prefill, want):
    rows = {"1": {"triton_linear_us": 10.0, "default_backend_linear_us": 10.0 * decode}}
    if prefill is not None:
        rows["512"] = {"triton_linear_us": 10.0, "default_backend_linear_us": 10.0 * prefill}
    s = {"default_backend": {"name": "cutlass", "available": True},
         "shapes": {"N=128,K=128": {"complete": True, "rows": rows}}, "pending_shapes": []}
    s["comparison"] = summary.compare_rows(s)
    assert s["comparison"]["tuned_vs_default_backend_geomean_m_le_64"] == pytest.approx(decode, abs=1e-4)
    assert summary.decide_backend(s)["recommended_backend"] == want
    s["shapes"]["N=128,K=128"]["complete"] = False                      # incomplete tuning never recommends
    s["comparison"] = summary.compare_rows(s)
    assert summary.decide_backend(s)["recommended_backend"] is None


# --------------------------------------------------------------------------- SGLang's real kernel, interpreted

@pytest.fixture(scope="module")
def interp_bench():
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"   # read when SGLang's kernel module is loaded (decorated)
    try:
        yield GpuBench(source="installed-file", device="cpu", seed=random.randrange(1 << 30))
    finally:
        if prev is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = prev


def test_real_kernel_check_rejects_wrong_and_unwritten_output(interp_bench):
    b = interp_bench
    sh = Shape(256, 256, "t")
    b.setup_shape(sh, [5])
    b.setup_m(sh, 5)
    good = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
            "num_stages": 2}
    assert b.time_config(sh, 5, good) > 0
    assert b.time_config(sh, 5, None) > 0                          # SGLang's own default config
    # a K tile spanning two scale blocks computes the wrong product: must be rejected
    with pytest.raises(CandidateError, match="relative error"):
        b.time_config(sh, 5, dict(good, BLOCK_SIZE_K=256))
    # a launcher that returns its output without writing it: the NaN poison must catch it
    orig = b.mod.w8a8_block_fp8_matmul_triton

    def lazy(A, B, As, Bs, block_size, output_dtype):
        return b.mod.prepare_block_fp8_matmul_inputs(A, B, As, Bs, block_size, output_dtype)[3]

    b.mod.w8a8_block_fp8_matmul_triton = lazy
    try:
        with pytest.raises(CandidateError, match="non-finite"):
            b.time_config(sh, 5, good)
    finally:
        b.mod.w8a8_block_fp8_matmul_triton = orig
    # the lookup is restored after each candidate
    assert b.mod.get_w8a8_block_fp8_configs is b._orig_lookup
    b.release_shape()


def test_real_kernel_end_to_end_tuning(interp_bench, tmp_path):
    b = interp_bench
    t = Tuner(b, [Shape(256, 256, "t")], [3], tmp_path, quick=True, progress=False, log=lambda s: None)
    assert t.run() == 0
    name = cf.config_file_name(256, 256, b.device_name_raw)
    table = json.loads((tmp_path / name).read_text())
    cf.validate_config_table(table)
    s = json.loads((tmp_path / cf.summary_file_stem(b.device_name_raw)).with_suffix(".json").read_text())
    row = s["shapes"]["N=256,K=256"]["rows"]["3"]
    assert row["failed"] == 0 and row["best_config"] == table["3"]
