"""bench/measure.py: refuses without a healthy router; end to end through the real
``sglang.benchmark.serving`` and the real router in front of stand-in servers (which stream one
token per chunk), with a small local tokenizer (no download). The same deployment then serves the
bench/profile_capture.py end-to-end check (assertions in tests/test_profile_capture.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(2000)}
    vocab.update({"[UNK]": 2000, "<s>": 2001, "</s>": 2002})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(d))
    return d


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
                       env=dict(env, DETACH="1", MODEL_PATH=str(tok), DSV4_STANDIN_TRACE_TP="4"), timeout=120)
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
    assert "TTFT p99 ms" in table and len(table.strip().splitlines()) == 3
    assert "tok/s/user" in m.stdout
    assert c.returncode == 0, c.stdout + c.stderr
    check_capture(env, prof, c.stdout)
