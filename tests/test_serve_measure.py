"""bench/measure.py: refuses without a healthy router; end to end through the real
``sglang.benchmark.serving`` and the real router in front of stand-in servers (which stream one
token per chunk), with a small local tokenizer (no download). The same deployment then serves the
bench/profile_capture.py end-to-end check (assertions in tests/test_profile_capture.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_profile_capture import check_capture  # noqa: E402
from test_serve_orchestration import SERVE, env, free_ports  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[1]
MEASURE = REPO / "bench" / "measure.py"
CAPTURE = REPO / "bench" / "profile_capture.py"
from dsv4_sm120.perf import measure  # noqa: E402


def make_tokenizer(d: Path) -> Path:
    """A small word-level tokenizer the load generator loads without a download: the one measure writes for
    stand-in servers."""
    return measure.write_standin_tokenizer(d)


def test_refuses_without_a_healthy_router(tmp_path):
    (port,) = free_ports(1)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(MEASURE), "--router", f"http://127.0.0.1:{port}", "--out-dir", str(out)],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, LOG_DIR=str(tmp_path)))
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no healthy router" in lines[0] and "Traceback" not in r.stderr
    assert not out.exists()
    r = subprocess.run([sys.executable, str(MEASURE), "--concurrency", "1,x"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--concurrency" in r.stderr


def test_parse_bench_output(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text(json.dumps({"completed": 3}) + "\n")
    with pytest.raises(measure.MeasureError, match="lacks"):
        measure.parse_bench_output(p)
    good = {"completed": 4, "output_throughput": 100.0, "median_tpot_ms": 20.0, "median_ttft_ms": 50.0,
            "p99_ttft_ms": 90.0}
    p.write_text("junk-from-an-earlier-run\n" * 0 + json.dumps(good) + "\n")
    m = measure.parse_bench_output(p)
    assert m["per_user_tok_s"] == pytest.approx(50.0) and m["p99_ttft_ms"] == 90.0
    t = measure.render_table([{"concurrency": 8, "metrics": m}, {"concurrency": 16, "error": "boom"}])
    assert "   8     4      100.0        50.0" in t and "FAIL  boom" in t


def test_measure_and_profile_end_to_end_through_router_and_standins(env, tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    (tok / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))   # passes the model preflight
    r = subprocess.run(["bash", str(SERVE / "serve_dsv4_tp4.sh")], capture_output=True, text=True,
                       env=dict(env, DETACH="1", MODEL_PATH=str(tok), DSV4_SM120_STANDIN_TRACE_TP="4"), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "results"
    try:
        m = subprocess.run([sys.executable, str(MEASURE), "--concurrency", "3", "--input-len", "16",
                            "--output-len", "6", "--prompts-per-level", "2", "--min-prompts", "4",
                            "--python", sys.executable, "--out-dir", str(out), "--label", "standin"],
                           capture_output=True, text=True, timeout=240,
                           env=dict(env, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
        prof = tmp_path / "prof"
        c = subprocess.run([sys.executable, str(CAPTURE), "--concurrency", "2", "--input-len", "16",
                            "--output-len", "64", "--num-steps", "3", "--warmup-s", "1", "--timeout", "60",
                            "--python", sys.executable, "--out-dir", str(prof)],
                           capture_output=True, text=True, timeout=200,
                           env=dict(env, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    finally:
        s = subprocess.run(["bash", str(SERVE / "stop.sh")], capture_output=True, text=True, env=env, timeout=90)
    assert s.returncode == 0
    assert m.returncode == 0, m.stdout + m.stderr + "".join(p.read_text()[-2000:] for p in out.glob("*.log"))
    res = json.loads((out / "results.json").read_text())
    assert res["model"] == str(tok)                          # taken from the running deployment
    assert res["environment"]["packages"]["sglang"] == "0.5.23"
    assert res["deployment"]["standin"] is True and res["deployment"]["variant"] == "base"
    assert res["router"] == f"http://127.0.0.1:{env['ROUTER_PORT']}"
    assert [r["concurrency"] for r in res["runs"]] == [3]      # one level keeps the test short; the loop is plain
    for run, n in zip(res["runs"], (6,)):
        assert "error" not in run, run
        mm = run["metrics"]
        assert run["num_prompts"] == n and mm["completed"] == n
        assert mm["total_output_tokens"] == n * 6             # the stand-in streams exactly max_new_tokens
        assert mm["output_throughput"] > 0 and mm["median_tpot_ms"] > 0 and mm["p99_ttft_ms"] >= mm["median_ttft_ms"]
        assert "--max-concurrency" in run["command"] and run["command"][run["command"].index("--max-concurrency") + 1] == str(run["concurrency"])
    assert (out / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "table.txt").read_text()
    assert "TTFT p99 ms" in table and len(table.strip().splitlines()) == 4
    # a rehearsal against stand-ins says so in every output's title, not only in results.json
    assert table.splitlines()[0] == measure.STANDIN_TITLE and res["standin"] is True
    assert f"measure: {measure.STANDIN_TITLE}" in m.stdout and "(stand-in servers: a rehearsal" in m.stdout
    assert "tok/s/user" in m.stdout
    assert c.returncode == 0, c.stdout + c.stderr
    check_capture(env, prof, c.stdout)


# --- speculative decoding: accepted tokens per step from the decode server's counters -------------------------

FAKE_LOADGEN = r'''
import json, os, sys, urllib.request
argv = sys.argv[1:]
if argv[:1] == ["-c"]:                     # measure's package-version probe
    print("{}")
    sys.exit(0)
assert argv[:2] == ["-m", "sglang.benchmark.serving"], argv
opt = lambda k: argv[argv.index(k) + 1]
c = opt("--max-concurrency")
plan = json.loads(os.environ["FAKE_SPEC_PLAN"])[c]          # this run's verify steps and output tokens
urllib.request.urlopen(f"{opt('--base-url')}/bump?verify={plan[0]}&gen={plan[1]}").read()
n = int(opt("--num-prompts"))
res = {"completed": n, "output_throughput": 100.0 * int(c), "median_tpot_ms": 10.0, "median_ttft_ms": 5.0,
       "p99_ttft_ms": 9.0, "accept_length": 9.0, "total_output_tokens": plan[1]}
open(opt("--output-file"), "w").write(json.dumps(res) + "\n")
'''


class _FakeDecode:
    """Router and decode server in one: health, /metrics (Prometheus text as 0.5.23 writes it), /server_info."""

    def __init__(self, draft_tokens):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import parse_qs, urlparse

        self.verify, self.gen = 7.0, 1234.0           # counters already non-zero from earlier traffic
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, body, ctype="text/plain"):
                data = body.encode()
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                u = urlparse(self.path)
                if u.path in ("/health", "/health_generate"):
                    return self._send("ok")
                if u.path == "/bump":
                    q = parse_qs(u.query)
                    fake.verify += float(q["verify"][0])
                    fake.gen += float(q["gen"][0])
                    return self._send("ok")
                if u.path == "/metrics":
                    half = fake.gen / 2
                    return self._send(
                        "# HELP sglang:spec_verify_calls_total Number of speculative decoding verification calls.\n"
                        "# TYPE sglang:spec_verify_calls_total counter\n"
                        f'sglang:spec_verify_calls_total{{model_name="m",tp_rank="0"}} {fake.verify}\n'
                        'sglang:spec_verify_calls_created{model_name="m",tp_rank="0"} 1.7e+09\n'
                        f'sglang:generation_tokens_total{{is_streaming="true",model_name="m"}} {half}\n'
                        f'sglang:generation_tokens_total{{is_streaming="false",model_name="m"}} {fake.gen - half}\n'
                        'sglang:spec_accept_length{model_name="m"} 9.5\n')
                if u.path == "/server_info":
                    return self._send(json.dumps({"speculative_algorithm": "DSPARK",
                                                  "speculative_num_draft_tokens": draft_tokens,
                                                  "internal_states": [{"avg_spec_accept_length": 9.5}]}),
                                      "application/json")
                self.send_response(404)
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_measure_reports_accepted_tokens_per_step_and_accept_rate(tmp_path, monkeypatch):
    import random

    rng = random.Random()
    draft_tokens = rng.randint(3, 8)
    # per concurrency: verify steps and output tokens of that run; C=2 ran no verify step (no speculation data)
    plan = {"1": [rng.randint(50, 400), 0], "2": [0, 640], "4": [rng.randint(50, 400), 0]}
    for c in ("1", "4"):
        plan[c][1] = plan[c][0] * rng.randint(10, draft_tokens * 10) // 10 + plan[c][0]
    fake_py = tmp_path / "fakepython"
    fake_py.write_text(f"#!{sys.executable}\n" + FAKE_LOADGEN)
    fake_py.chmod(0o755)
    srv = _FakeDecode(draft_tokens)
    monkeypatch.setenv("FAKE_SPEC_PLAN", json.dumps(plan))
    out = tmp_path / "out"
    try:
        rc = measure.main(["--router", srv.url, "--decode-url", srv.url, "--concurrency", "1,2,4", "--python",
                           str(fake_py), "--out-dir", str(out), "--log-dir", str(tmp_path / "nologs"),
                           "--model", str(make_tokenizer(tmp_path / "tok"))])
    finally:
        srv.close()
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["speculative"]["algorithm"] == "DSPARK" and res["speculative"]["num_draft_tokens"] == draft_tokens
    runs = {r["concurrency"]: r for r in res["runs"]}
    table = (out / "table.txt").read_text().splitlines()
    assert "acc/step" in table[0] and "acc rate" in table[0]
    for c in (1, 4):
        steps, toks = plan[str(c)]
        want = toks / steps
        spec = runs[c]["speculative"]
        assert spec["accept_length"] == pytest.approx(want) and spec["verify_steps"] == steps
        assert spec["accept_rate"] == pytest.approx((want - 1) / (draft_tokens - 1))
        row = [x for x in table if x.split()[0] == str(c)][0].split()
        assert row[-2] == f"{want:.2f}" and row[-1] == f"{100 * (want - 1) / (draft_tokens - 1):.0f}%", row
    # no verify step in the run: no per-run numbers; the column falls back to the load generator's server average
    assert "speculative" not in runs[2]
    row = [x for x in table if x.split()[0] == "2"][0].split()
    assert row[-2:] == ["9.00", "-"], row


def test_spec_metrics_without_counters():
    from dsv4_sm120.perf import spec_metrics

    assert spec_metrics.parse_prometheus('a{x="1"} 2\na{x="2"} 3.5\n# b 9\nb_total 1e3\n') == {"a": 5.5, "b_total": 1000.0}
    before = {"verify": 10.0, "generated": 100.0}
    assert spec_metrics.summarize(before, dict(before), 4) is None               # nothing ran
    assert spec_metrics.summarize(None, before, 4) is None
    s = spec_metrics.summarize(before, {"verify": 20.0, "generated": 130.0}, None)
    assert s["accept_length"] == pytest.approx(3.0) and s["accept_rate"] is None
    (port,) = free_ports(1)
    assert spec_metrics.snapshot(f"http://127.0.0.1:{port}", timeout=2) is None   # nobody there
    assert spec_metrics.server_spec(f"http://127.0.0.1:{port}", timeout=2) == {}


# --- what the load generator needs, and failing fast when it cannot run ------------------------------------------

def test_tokenizer_problem_local_cached_offline_and_unreachable(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    assert measure.tokenizer_problem(str(tok), {}) is None
    assert "does not exist" in measure.tokenizer_problem(str(tmp_path / "nope"), {})
    (tmp_path / "empty").mkdir()
    assert "holds none of tokenizer.json" in measure.tokenizer_problem(str(tmp_path / "empty"), {})
    hub = tmp_path / "hub"
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    p = measure.tokenizer_problem("org/model", env)
    assert p == f"org/model is not in the Hugging Face cache ({hub}) and HF_HUB_OFFLINE=1 forbids downloading it"
    snap = hub / "models--org--model" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "tokenizer_config.json").write_text("{}")
    assert measure.tokenizer_problem("org/model", env) is None
    (closed,) = free_ports(1)
    p = measure.tokenizer_problem("org/other", {"HF_HUB_CACHE": str(hub), "HF_ENDPOINT": f"http://127.0.0.1:{closed}"})
    assert p.startswith(f"org/other is not in the Hugging Face cache ({hub}) and http://127.0.0.1:{closed} cannot be "
                        "reached"), p


def test_measure_refuses_an_unloadable_tokenizer_before_running(tmp_path, monkeypatch, capsys):
    srv = _FakeDecode(4)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    try:
        rc = measure.main(["--router", srv.url, "--python", str(tmp_path / "never-run"), "--out-dir", str(out),
                           "--log-dir", str(tmp_path / "nologs"), "--model", "org/model"])
    finally:
        srv.close()
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists(), err
    assert err.count("\n") == 1 and err.startswith("measure: the load generator needs the tokenizer of org/model: ")
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in err and "--model DIR" in err


FAILING_LOADGEN = r'''
import sys
import time
argv = sys.argv[1:]
if argv[:1] == ["-c"]:
    print("{}")
    sys.exit(0)
open(CALLS, "a").write(argv[argv.index("--max-concurrency") + 1] + "\n")
print("Traceback (most recent call last):")
print('  File "serving.py", line 1, in <module>')
print("OSError: We couldn't connect to 'https://huggingface.co' to load the files")
sys.exit(1)
'''


def test_measure_stops_after_the_load_generator_fails_and_shows_why(tmp_path, capsys):
    calls = tmp_path / "calls"
    fake_py = tmp_path / "fakepython"
    fake_py.write_text(f"#!{sys.executable}\nCALLS = {str(calls)!r}\n" + FAILING_LOADGEN)
    fake_py.chmod(0o755)
    srv = _FakeDecode(4)
    out = tmp_path / "a-results-directory-with-a-long-name" / ("x" * 60)
    try:
        rc = measure.main(["--router", srv.url, "--concurrency", "1,8,16", "--python", str(fake_py),
                           "--out-dir", str(out), "--log-dir", str(tmp_path / "nologs"),
                           "--model", str(make_tokenizer(tmp_path / "tok"))])
    finally:
        srv.close()
    err = capsys.readouterr().err
    assert rc == 1
    assert calls.read_text().split() == ["1"]                      # C=8 and C=16 were not tried
    log = out / "bench_c1.log"
    assert f"measure: C=1: the load generator exited 1; the end of {log}:" in err
    assert "    OSError: We couldn't connect to 'https://huggingface.co' to load the files" in err
    assert "measure: not running C=8,16: the same command would fail the same way" in err
    table = (out / "table.txt").read_text()
    assert f"load generator exited 1; see {log}" in table           # the whole path, not cut
    res = json.loads((out / "results.json").read_text())
    assert [r["concurrency"] for r in res["runs"]] == [1, 8, 16]
    assert res["runs"][2]["error"] == "not run: the load generator failed at C=1"


def test_default_results_directories_are_ignored_by_git():
    for d in ("measure-20260101-000000", "profile-20260101-000000"):
        r = subprocess.run(["git", "check-ignore", "-q", f"bench/results/{d}/results.json"], cwd=REPO)
        assert r.returncode == 0, d
    r = subprocess.run(["git", "check-ignore", "-q", "bench/results/attention.csv"], cwd=REPO)
    assert r.returncode == 1


def test_stop_after_measure_is_quick(env, tmp_path):
    """After make measure (SGLang's real load generator through the router), every part of the stand-in deployment
    exits on SIGTERM: the stop takes seconds, not the SIGKILL grace period."""
    tok = make_tokenizer(tmp_path / "tok")
    (tok / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    e = dict(env, MODEL_PATH=str(tok), STOP_GRACE_S="30")
    r = subprocess.run(["bash", str(SERVE / "serve_dsv4_tp4.sh")], capture_output=True, text=True,
                       env=dict(e, DETACH="1"), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        m = subprocess.run([sys.executable, str(MEASURE), "--concurrency", "2", "--input-len", "16", "--output-len",
                            "6", "--prompts-per-level", "2", "--min-prompts", "4", "--python", sys.executable,
                            "--out-dir", str(tmp_path / "results")],
                           capture_output=True, text=True, timeout=240, env=dict(e, HF_HUB_OFFLINE="1"))
    finally:
        t0 = time.monotonic()
        s = subprocess.run(["bash", str(SERVE / "stop.sh")], capture_output=True, text=True, env=e, timeout=90)
        took = time.monotonic() - t0
    assert m.returncode == 0, m.stdout + m.stderr
    assert s.returncode == 0, s.stdout + s.stderr
    sup_log = "".join(p.read_text() for p in Path(env["LOG_DIR"]).glob("*/supervisor.log"))
    assert "SIGKILL" not in s.stdout + sup_log, s.stdout + sup_log[-3000:]
    assert took < 10, (took, s.stdout)


STANDIN_LOADGEN = r'''
import json, os, sys
argv = sys.argv[1:]
if argv[:1] == ["-c"]:
    print("{}")
    sys.exit(0)
opt = lambda k: argv[argv.index(k) + 1]
tok = opt("--tokenizer")
assert os.path.isabs(tok) and os.path.isfile(os.path.join(tok, "tokenizer.json")), tok
from transformers import AutoTokenizer
assert AutoTokenizer.from_pretrained(tok).encode("w1 w2", add_special_tokens=False) == [1, 2]
n = int(opt("--num-prompts"))
res = {"completed": n, "output_throughput": 6100.0, "median_tpot_ms": 1.0, "median_ttft_ms": 5.0, "p99_ttft_ms": 9.0}
open(opt("--output-file"), "w").write(json.dumps(res) + "\n")
'''


@pytest.mark.parametrize("standin", [True, False])
def test_a_standin_rehearsal_says_so_and_needs_no_tokenizer_download(tmp_path, monkeypatch, capsys, standin):
    """Against stand-ins (the servers say so in /server_info) the table, table.txt, the plot's title and
    results.json say "stand-in"; with the default MODEL_PATH not downloadable (offline) measure writes a word-level
    tokenizer of its own instead of refusing. Against real servers neither happens."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            body = json.dumps({"standin": standin} if self.path in ("/server_info", "/get_server_info") else {})
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    fake_py = tmp_path / "fakepython"
    fake_py.write_text(f"#!{sys.executable}\n" + STANDIN_LOADGEN)
    fake_py.chmod(0o755)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("MODEL_PATH", raising=False)
    out = tmp_path / "out"
    try:
        rc = measure.main(["--router", f"http://127.0.0.1:{httpd.server_address[1]}", "--concurrency", "2",
                           "--python", str(fake_py), "--out-dir", str(out), "--log-dir", str(tmp_path / "nologs")])
    finally:
        httpd.shutdown()
        httpd.server_close()
    cap = capsys.readouterr()
    if not standin:
        assert rc == 2 and "the load generator needs the tokenizer of deepseek-ai/DeepSeek-V4-Flash" in cap.err
        assert "STAND-IN" not in cap.out + cap.err
        return
    assert rc == 0, cap.out + cap.err
    res = json.loads((out / "results.json").read_text())
    assert res["standin"] is True and res["model"] == str(out / "standin-tokenizer")
    table = (out / "table.txt").read_text().splitlines()
    assert table[0] == measure.STANDIN_TITLE and "6100.0" in table[-1]
    printed = cap.out.splitlines()
    assert printed.index(measure.STANDIN_TITLE) < printed.index(table[1])     # the printed table's title
    assert "word-level stand-in tokenizer written to" in cap.out
    assert (out / "throughput.png").read_bytes()[:4] == b"\x89PNG"
