"""make verify (python -m dsv4_sm120.serving.verify) with stand-in servers and the real router.

The decode stand-in answers greedy /generate requests with a token stream derived from the prompt; with
DSV4_SM120_STANDIN_DIVERGE_AT=k the "ours" deployments (overlay on) differ from stock from token k on. End
to end: both variants, the report says where they first diverge; the MTP variant (a checkpoint with an MTP
layer) matches the non-speculative answers; a stage that kills the deployment is reported and everything is
torn down; SIGINT during a start and during a stage tears everything down; --dry-run starts nothing.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_serve_measure import make_tokenizer  # noqa: E402
from test_serve_orchestration import env, free_ports, port_free, start_time, tree, wait_gone  # noqa: E402,F401

from dsv4_sm120.serving import verify_report as vr  # noqa: E402

PROMPTS = json.loads((Path(__file__).resolve().parents[1] / "overlay" / "dsv4_sm120" / "serving" /
                      "verify_prompts.json").read_text())["prompts"]
PROGRESS = re.compile(r"^\[verify \+\s*\d+\.\d+s\] ", re.M)


# A quick stand-in for ``python -m sglang.benchmark.serving`` (make measure's and make profile's load generator;
# the real one, 10-20 s of imports per run, is exercised by tests/test_serve_measure.py): real streamed requests
# through the router, one at a time, and a result line with the fields measure reads.
FAKE_LOADGEN = r'''
import json, sys, time, urllib.request
argv = sys.argv[1:]
if argv[:1] == ["-c"]:
    print("{}")
    sys.exit(0)
assert argv[:2] == ["-m", "sglang.benchmark.serving"], argv
opt = lambda k: argv[argv.index(k) + 1]
n, out_len = int(opt("--num-prompts")), int(opt("--random-output-len"))
t0, tpots, ttfts, toks = time.time(), [], [], 0
for i in range(n):
    body = {"text": f"load {i}", "stream": True, "sampling_params": {"max_new_tokens": out_len, "temperature": 0}}
    req = urllib.request.Request(opt("--base-url") + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    s, first, got = time.time(), None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                got += 1
                first = first or time.time()
    toks += got
    ttfts.append(1000 * (first - s))
    tpots.append(1000 * (time.time() - first) / max(got - 1, 1))
dur = time.time() - t0
res = {"completed": n, "duration": dur, "total_output_tokens": toks, "output_throughput": toks / dur,
       "median_tpot_ms": sorted(tpots)[n // 2], "median_ttft_ms": sorted(ttfts)[n // 2], "p99_ttft_ms": max(ttfts),
       "p99_tpot_ms": max(tpots), "concurrency": int(opt("--max-concurrency"))}
open(opt("--output-file"), "w").write(json.dumps(res) + "\n")
'''


def fake_loadgen(tmp_path):
    p = tmp_path / "loadgen-python"
    p.write_text(f"#!{sys.executable}\n" + FAKE_LOADGEN)
    p.chmod(0o755)
    return str(p)


def model_dir(tmp_path, mtp=False):
    tok = make_tokenizer(tmp_path / "model")
    cfg = {"model_type": "deepseek_v4"}
    if mtp:
        cfg["num_nextn_predict_layers"] = 1
    (tok / "config.json").write_text(json.dumps(cfg))
    return tok


@pytest.fixture
def venv(env, tmp_path):
    """The deployment's environment (its ports held for the whole test: tests/test_serve_orchestration.py's env)."""
    e = dict(env, DSV4_SM120_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    e["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "overlay") + os.pathsep + e.get("PYTHONPATH", "")
    return e


def verify(e, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "dsv4_sm120.serving.verify", *args], capture_output=True,
                          text=True, env=e, timeout=timeout)


def deployment_processes(run_dir):
    """Every process a variant's deployment recorded (supervisor, parts, their descendants)."""
    procs = {}
    for st_file in Path(run_dir).glob("**/serve/state.json"):
        st = json.loads(st_file.read_text())
        for pid, start in [(st["supervisor_pid"], st.get("supervisor_start"))] + \
                [(p["pid"], p.get("start")) for p in st["procs"]]:
            if start_time(pid) == start:
                procs.update(tree(pid))
            procs.setdefault(pid, start)
    return procs


def assert_all_gone(e, run_dir):
    procs = deployment_processes(run_dir)
    assert list(Path(run_dir).glob("**/serve/state.json")), "no deployment was recorded"
    left = {p: s for p, s in procs.items() if s is not None and start_time(p) == s}
    assert not left, f"processes left behind: {left}"
    for k in ("PREFILL_PORT", "BOOTSTRAP_PORT", "DECODE_PORT", "ROUTER_PORT"):
        assert port_free(int(e[k])), k


# ---- comparisons (pure)

def test_first_divergence_and_verdicts():
    rng = random.Random()
    base = [rng.randrange(1000) for _ in range(20)]
    k = rng.randrange(1, 19)
    other = base[:k] + [base[k] + 1] + base[k + 1:]
    d = vr.first_divergence({"id": "p", "output_ids": base}, {"id": "p", "output_ids": other})
    assert d["identical"] is False and d["first_divergence"] == k and d["a_at"] == base[k] and d["b_at"] == base[k] + 1
    assert vr.first_divergence({"id": "p", "output_ids": base}, {"id": "p", "output_ids": list(base)})["identical"]
    short = vr.first_divergence({"id": "p", "output_ids": base}, {"id": "p", "output_ids": base[:k]})
    assert short["first_divergence"] == k and short["b_at"] is None          # one answer ended (EOS) earlier
    first = vr.first_divergence({"id": "p", "output_ids": [5] + base}, {"id": "p", "output_ids": [6] + base})
    assert first["first_divergence"] == 0
    text = vr.first_divergence({"id": "p", "text": "abcdef"}, {"id": "p", "text": "abcxef", "output_ids": [1]})
    assert text["basis"].startswith("text") and text["first_divergence"] == 3
    g = vr.compare_greedy([{"id": "a", "output_ids": base}, {"id": "b", "output_ids": base}],
                          [{"id": "a", "output_ids": base}, {"id": "b", "output_ids": other}], first_tokens=k)
    assert g["identical"] == 1 and g["first_divergence_min"] == k and not g["all_identical"]
    assert g["first_tokens_identical"]          # the divergence is at k, after the first k tokens
    assert not vr.compare_greedy([{"id": "a", "output_ids": base}], [{"id": "a", "output_ids": other}],
                                 first_tokens=k + 1)["first_tokens_identical"]
    missing = vr.compare_greedy([{"id": "a", "output_ids": base}], [], first_tokens=1)
    assert missing["compared"] == 0 and not missing["all_identical"]

    # accuracy: 200 questions, 0.95 vs 0.94 is noise, 0.95 vs 0.80 is not
    assert vr.compare_accuracy({"accuracy": 0.95, "questions": 200}, {"accuracy": 0.94, "questions": 200})["within_noise"]
    worse = vr.compare_accuracy({"accuracy": 0.80, "questions": 200}, {"accuracy": 0.95, "questions": 200})
    assert not worse["within_noise"] and worse["ours_worse"]
    meas = lambda *tps: {"runs": [{"concurrency": c, "metrics": {"output_throughput": t}}  # noqa: E731
                                  for c, t in zip((1, 8, 16), tps)]}
    sp = vr.compare_speed(meas(110, 100, 100.5), meas(100, 100, 100))
    assert [p["call"] for p in sp["per_concurrency"]] == ["faster", "same", "same"]
    assert vr.verdict(None, None, sp).endswith("=> keep ours")
    assert vr.verdict(None, worse, sp).endswith("=> keep stock: ours loses accuracy")
    assert vr.verdict(None, None, vr.compare_speed(meas(90, 100), meas(100, 100))).endswith("ours is slower")
    assert "mixed" in vr.verdict(None, None, vr.compare_speed(meas(90, 120), meas(100, 100)))
    assert vr.compare_speed({"runs": [{"concurrency": 1, "error": "boom"}]}, meas(100)) is None



def test_mtp_verdict_says_each_part_once():
    comps = vr.build_comparisons({"ours": {"stages": {}}, "mtp": {"stages": {}}}, {}, 16)
    (mtp,) = comps
    assert mtp["verdict"].count("greedy: not run") == 1, mtp["verdict"]
    assert mtp["verdict"].startswith("greedy: not run (vs the non-speculative path); accuracy: not measured")


# ---- command line

def test_dry_run_starts_nothing_and_prints_every_stage(venv, tmp_path):
    venv["MODEL_PATH"] = str(model_dir(tmp_path, mtp=True))
    out = tmp_path / "v"
    r = verify(venv, "--dry-run", "--out-dir", str(out), "--concurrency", "1,2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mtp included" in r.stdout
    variants = re.findall(r"^variant (\S+):", r.stdout, re.M)
    assert variants == ["ours", "stock", "mtp"]
    starts = re.findall(r"^  start: (.*)$", r.stdout, re.M)
    assert starts[0].endswith("serve_dsv4_tp4.sh --detach") and "DSV4_SM120_DISABLE" not in starts[0]
    assert "DSV4_SM120_DISABLE=1" in starts[1] and starts[1].endswith("serve_dsv4_tp4.sh --detach")
    assert starts[2].endswith("serve_dsv4_mtp.sh --detach")
    for stage in ("greedy", "accuracy", "measure", "profile", "stop"):
        assert len(re.findall(rf"^  {stage}: ", r.stdout, re.M)) == 3, stage
    assert f"POST http://127.0.0.1:{venv['ROUTER_PORT']}/generate x {len(PROMPTS)} prompts" in r.stdout
    assert "sglang.test.few_shot_gsm8k" in r.stdout and "--concurrency 1,2" in r.stdout
    assert not out.exists() and not Path(venv["DSV4_SM120_STANDIN_RECORD"]).exists()

    r = verify(venv, "--dry-run", "--stages", "greedy,measure", "--variants", "stock,ours")
    assert r.returncode == 0 and re.findall(r"^variant (\S+):", r.stdout, re.M) == ["ours", "stock"]
    assert "accuracy:" not in r.stdout and "profile:" not in r.stdout

    venv["MODEL_PATH"] = str(model_dir(tmp_path / "nodraft"))
    r = verify(venv, "--dry-run")
    assert r.returncode == 0 and re.findall(r"^variant (\S+):", r.stdout, re.M) == ["ours", "stock"]
    assert "no mtp variant" in r.stdout
    for args, word in ((["--variants", "ours,mtp"], "carries no draft"), (["--stages", "greedy,speed"], "--stages"),
                       (["--variants", "ours,fast"], "--variants")):
        r = verify(venv, "--dry-run", *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and word in lines[0] and "Traceback" not in r.stderr, r.stderr


# ---- end to end with stand-ins

def test_full_run_ours_vs_stock_reports_first_divergence(venv, tmp_path):
    k = random.randint(2, 6)
    n_tok, n_prompts = 10, 3
    (closed,) = free_ports(1)
    venv.update(MODEL_PATH=str(model_dir(tmp_path)), DSV4_SM120_STANDIN_DIVERGE_AT=str(k),
                DSV4_SM120_STANDIN_TRACE_TP="4")
    out = tmp_path / "verify"
    r = verify(venv, "--variants", "ours,stock", "--out-dir", str(out), "--greedy-tokens", str(n_tok),
               "--prompts", str(n_prompts), "--gsm8k-url", f"http://127.0.0.1:{closed}/test.jsonl",
               "--concurrency", "2", "--input-len", "16", "--output-len", "6", "--prompts-per-level", "1",
               "--min-prompts", "2", "--profile-concurrency", "2", "--profile-warmup-s", "1", "--profile-steps", "3",
               "--profile-output-len", "64", "--python", fake_loadgen(tmp_path))
    text = r.stdout + r.stderr
    assert r.returncode == 0, text
    assert len(PROGRESS.findall(r.stdout)) >= 10, r.stdout
    assert "accuracy: GSM8K not reachable (" in r.stdout
    assert_all_gone(venv, out)

    # greedy answers as the router returned them: ours and stock agree on exactly the first k tokens
    ours, stock = (json.loads((out / v / "greedy.json").read_text()) for v in ("ours", "stock"))
    assert [x["id"] for x in ours] == [p["id"] for p in PROMPTS[:n_prompts]]
    for a, b in zip(ours, stock):
        assert len(a["output_ids"]) == len(b["output_ids"]) == n_tok
        assert a["output_ids"][:k] == b["output_ids"][:k] and a["output_ids"][k] != b["output_ids"][k]
    rec = [json.loads(x) for x in Path(venv["DSV4_SM120_STANDIN_RECORD"]).read_text().splitlines()]
    greedy_posts = [x for x in rec if x["role"] == "decode" and x["path"] == "/generate" and not x["body"].get("stream")]
    assert sorted(x["body"]["text"] for x in greedy_posts) == sorted([p["text"] for p in PROMPTS[:n_prompts]] * 2)
    assert all(x["body"]["sampling_params"] == {"temperature": 0, "max_new_tokens": n_tok} for x in greedy_posts)

    rep = json.loads((out / "report.json").read_text())
    assert rep["ok"] and rep["standin"] and list(rep["variants"]) == ["ours", "stock"]
    (cmp_,) = rep["comparisons"]
    assert cmp_["variant"] == "stock" and cmp_["greedy"]["first_divergence_min"] == k
    assert [p["first_divergence"] for p in cmp_["greedy"]["prompts"]] == [k] * n_prompts
    assert f"greedy tokens differ on {n_prompts}/{n_prompts} prompts (first divergence at token {k})" in cmp_["verdict"]
    assert "accuracy: GSM8K not reachable" in cmp_["verdict"]
    for v in ("ours", "stock"):
        st = rep["variants"][v]["stages"]
        assert [st[s]["status"] for s in ("greedy", "accuracy", "measure", "profile")] == \
            ["ok", "skipped", "ok", "ok"], st
        # the stand-in load generator at one level (SGLang's real one runs in test_serve_measure, as do the
        # level loop; the per-level comparison is test_first_divergence_and_verdicts)
        assert [x["concurrency"] for x in st["measure"]["runs"]] == [2]
        assert all(x["metrics"]["completed"] == 2 and x["metrics"]["output_throughput"] > 0
                   for x in st["measure"]["runs"])
        assert {g["group"] for g in st["profile"]["groups"]} >= {"sparse attention", "MoE", "communication"}
    md = (out / "report.md").read_text()
    assert md.count(f"| no | token {k} |") == n_prompts
    assert re.search(r"^\| 2 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|$", md, re.M), md
    assert "| sparse attention |" in md and "GSM8K not reachable" in md
    assert "ours: stopped, no process left" in md and "stock: stopped, no process left" in md


def test_mtp_variant_matches_the_non_speculative_first_tokens(venv, tmp_path):
    k = random.randint(2, 5)
    venv.update(MODEL_PATH=str(model_dir(tmp_path, mtp=True)), DSV4_SM120_STANDIN_DIVERGE_AT=str(k))
    out = tmp_path / "verify"
    r = verify(venv, "--stages", "greedy", "--out-dir", str(out), "--greedy-tokens", "8", "--prompts", "2",
               "--first-tokens", "8")
    assert r.returncode == 0, r.stdout + r.stderr
    assert_all_gone(venv, out)
    rep = json.loads((out / "report.json").read_text())
    assert list(rep["variants"]) == ["ours", "stock", "mtp"]
    plan = json.loads((out / "mtp" / "serve" / "plan.json").read_text())
    dec = next(p for p in plan["procs"] if p["role"] == "decode")["argv"]
    assert dec[dec.index("--speculative-algorithm") + 1] == "EAGLE"         # it really ran the MTP variant
    by = {c["variant"]: c for c in rep["comparisons"]}
    assert by["mtp"]["target_met"] is True and by["mtp"]["greedy"]["all_identical"]
    assert by["mtp"]["verdict"].startswith("first 8 tokens identical on all prompts")
    assert by["stock"]["greedy"]["first_divergence_min"] == k


def test_a_stage_that_kills_the_deployment_is_reported_and_everything_torn_down(venv, tmp_path):
    venv.update(MODEL_PATH=str(model_dir(tmp_path)), DSV4_SM120_STANDIN_ROLE="decode",
                DSV4_SM120_STANDIN_EXIT_ON_STREAM="1")
    out = tmp_path / "verify"
    r = verify(venv, "--variants", "ours,stock", "--stages", "greedy,measure,profile", "--out-dir", str(out),
               "--greedy-tokens", "4", "--prompts", "1", "--concurrency", "1", "--input-len", "8",
               "--output-len", "4", "--min-prompts", "1", "--prompts-per-level", "1", "--python", fake_loadgen(tmp_path))
    assert r.returncode == 1, r.stdout + r.stderr
    assert_all_gone(venv, out)
    rep = json.loads((out / "report.json").read_text())
    assert not rep["ok"]
    for v in ("ours", "stock"):
        st = rep["variants"][v]["stages"]
        assert st["greedy"]["status"] == "ok"
        assert st["measure"]["status"] == "failed" and "the deployment died" in st["measure"]["error"], st
        assert st["profile"]["status"] == "skipped", st
        assert any(f.startswith(f"{v}: measure failed") for f in rep["failures"])
    assert re.search(r"ours: measure failed after \d+ s: make measure exited", r.stdout), r.stdout
    assert "FAILED: ours: measure failed" in r.stdout
    md = (out / "report.md").read_text()
    assert "**Result: FAILED**" in md and "measure failed" in md


@pytest.mark.parametrize("when", ["start", "measure"])
def test_sigint_tears_everything_down(venv, tmp_path, when):
    venv.update(MODEL_PATH=str(model_dir(tmp_path)))
    if when == "start":
        venv.update(DSV4_SM120_STANDIN_STARTUP_S="60")            # health stays 503: verify waits in the start
        marker = re.compile(r"ours: starting the deployment")
    else:
        venv.update(DSV4_SM120_STANDIN_TOKEN_S="0.05")            # each measured request streams for seconds
        marker = re.compile(r"ours: measure \.\.\.")
    out = tmp_path / "verify"
    log = open(tmp_path / "out.txt", "w")
    p = subprocess.Popen([sys.executable, "-m", "dsv4_sm120.serving.verify", "--variants", "ours,stock",
                          "--stages", "greedy,measure", "--out-dir", str(out), "--greedy-tokens", "4", "--prompts", "1",
                          "--concurrency", "1", "--input-len", "8", "--output-len", "200", "--min-prompts", "2",
                          "--python", fake_loadgen(tmp_path)],
                         stdout=log, stderr=subprocess.STDOUT, env=venv)
    try:
        t0 = time.monotonic()
        while not marker.search((tmp_path / "out.txt").read_text()):
            assert p.poll() is None and time.monotonic() - t0 < 120, (tmp_path / "out.txt").read_text()
            time.sleep(0.2)
        # wait until the deployment's supervisor runs its parts (start) and verify's own child (the serve script,
        # or the load generator) is running; then a moment for it to get going
        t1 = time.monotonic()
        while time.monotonic() - t1 < 60:
            try:
                if len(deployment_processes(out)) >= 3 and len(tree(p.pid)) > 1:
                    break
            except (OSError, ValueError, KeyError):
                pass                           # state.json being written
            time.sleep(0.2)
        time.sleep(0.5)
        children = tree(p.pid)                 # verify's own children: the serve script or the load generator
        others = deployment_processes(out)
        assert len(others) >= 3, others
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    text = (tmp_path / "out.txt").read_text()
    assert rc == 130, text
    assert "interrupted by signal 2: tearing down" in text and "ours: stopped, no process left" in text
    assert not (out / "stock").exists()                          # nothing after the interruption
    left = wait_gone({q: s for q, s in children.items() if q != p.pid}, 10)
    assert not left, f"verify's children left behind: {left}"
    assert not wait_gone(others, 10)
    assert_all_gone(venv, out)
    rep = json.loads((out / "report.json").read_text())
    assert rep["interrupted"] == 2 and not rep["ok"]


def test_accuracy_through_sglangs_gsm8k_helper(venv, tmp_path):
    """SGLang's own few_shot_gsm8k against the router: a 1-shot set whose labels are chosen from the stand-in's
    greedy answers (the last number of the answer is what the helper grades), so one of the two graded
    questions is right and one wrong, plus the shot itself (its label is not the stand-in's answer)."""
    from dsv4_sm120.serving.standin import greedy_ids

    n_tok = 8
    q = [f"What is {random.randint(10, 99)} plus {random.randint(10, 99)}?" for _ in range(3)]
    label = 7
    while True:                 # a shot label the stand-in does not happen to answer for question 0 itself
        shot = f"Question: {q[0]}\nAnswer: It is {label}.\n#### {label}\n\n"
        if greedy_ids(shot + f"Question: {q[0]}\nAnswer:", n_tok)[-1] != label:
            break
        label += 1
    last = [greedy_ids(shot + f"Question: {q[i]}\nAnswer:", n_tok)[-1] for i in (1, 2)]
    answers = [f"It is {label}.\n#### {label}", f"#### {last[0]}", f"#### {last[1] + 1}"]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": x, "answer": y}) + "\n" for x, y in zip(q, answers)))
    venv.update(MODEL_PATH=str(model_dir(tmp_path)))
    out = tmp_path / "verify"
    r = verify(venv, "--variants", "ours", "--stages", "accuracy", "--out-dir", str(out), "--gsm8k-data", str(data),
               "--gsm8k-questions", "3", "--gsm8k-shots", "1", "--gsm8k-max-new-tokens", str(n_tok))
    assert r.returncode == 0, r.stdout + r.stderr
    assert_all_gone(venv, out)
    acc = json.loads((out / "report.json").read_text())["variants"]["ours"]["stages"]["accuracy"]
    assert acc["status"] == "ok" and acc["questions"] == 3
    assert acc["accuracy"] == pytest.approx(1 / 3, abs=1e-3), acc
    md = (out / "report.md").read_text()
    assert "| ours | 33.3% |" in md


def test_a_box_wide_preflight_refusal_stops_before_the_other_variants(venv, tmp_path):
    """Without a GPU (here: an nvidia-smi that fails) the first variant's preflight refuses the start; the
    variants after it are not tried (they would be refused the same way), and the run says so in one line."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver'\n"
                   "exit 9\n")
    smi.chmod(0o755)
    venv.update(MODEL_PATH=str(model_dir(tmp_path, mtp=True)), NVIDIA_SMI=str(smi),
                PREFLIGHT_SKIP="patches,nixl,p2p,ucx")      # the stand-ins' default skips the GPU check
    out = tmp_path / "verify"
    t0 = time.monotonic()
    r = verify(venv, "--stages", "greedy", "--out-dir", str(out))
    assert r.returncode == 1, r.stdout + r.stderr
    assert time.monotonic() - t0 < 120
    assert re.findall(r"not starting .*", r.stdout) == [
        "not starting stock, mtp: the preflight refused ours on this box's own check (gpu), which no variant changes"]
    assert "ours: the deployment did not start (preflight: nvidia-smi failed (exit 9)" in r.stdout, r.stdout
    assert "stock: starting" not in r.stdout and not (out / "stock").exists() and not (out / "mtp").exists()
    rep = json.loads((out / "report.json").read_text())
    assert list(rep["variants"]) == ["ours"] and rep["not_started"] == ["stock", "mtp"]
    assert rep["variants"]["ours"]["start"]["preflight_checks"] == ["gpu"]
    assert "ours: nothing to stop (no deployment was started)" in r.stdout and "stopping the deployment" not in r.stdout
    assert "Traceback" not in r.stdout + r.stderr
