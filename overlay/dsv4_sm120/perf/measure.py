#!/usr/bin/env python3
"""Decode throughput of a running deployment at fixed concurrencies (default 1, 8, 16).

    python bench/measure.py [--concurrency 1,8,16] [--input-len 1024] [--output-len 512] [--router URL]

For each concurrency C it runs SGLang's own load generator,
``python -m sglang.benchmark.serving --dataset-name random-ids --random-range-ratio 1
--max-concurrency C`` (fixed input/output lengths, EOS ignored), against the router, then
writes ``results.json`` (every run's metrics plus the deployment it measured), prints a table
(output tok/s, per-user tok/s, TPOT, TTFT p50/p99) and draws ``throughput.png``.
With speculative decoding (serve/serve_dsv4_mtp.sh) the table adds, per run, the mean accepted
tokens per verify step and the accept rate, from the decode server's own counters
(``/metrics``, see dsv4_sm120.perf.spec_metrics), so one sees whether speculation pays.

Against stand-in servers (``DSV4_SM120_SERVE_STANDIN=1``: the deployment's record, or the servers' own
``/server_info``) every output says so in its title (printed table, ``table.txt``, the plot, ``results.json``'s
``standin``): the numbers measure the harness, not the model. There, without ``--model`` and without a loadable
tokenizer for the deployment's model, a small word-level tokenizer is written into the results directory (offline).

It refuses to run without a healthy router (``/health`` and an end-to-end ``/health_generate``).
Defaults come from the newest serving run (``LOG_DIR/latest``: router URL, model path for the
tokenizer) when there is one. ``--dataset random`` samples ShareGPT text instead of random ids
(upstream's usual choice; downloads the ShareGPT file once).
Exit codes: 0 all runs ok, 1 a run failed, 2 no healthy router / bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import List, Optional

from .. import hints, settings
from ..fileio import atomic_write_text
from ..model_config import absolute_if_local, hub_cache_dir
from ..paths import CHECKOUT_DIR
from ..serve_variables import DEFAULT_MODEL
from . import spec_metrics

# the checkout this runs from (overlay/dsv4_sm120/perf/ -> repository root): relative log / venv paths and the
# default output directory are taken from there; bench/measure.py sets it to its own checkout
REPO = CHECKOUT_DIR
METRICS = ("completed", "duration", "total_output_tokens", "output_throughput", "request_throughput",
           "median_tpot_ms", "p99_tpot_ms", "mean_tpot_ms", "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms",
           "median_itl_ms", "median_e2e_latency_ms", "accept_length", "concurrency")


class MeasureError(Exception):
    pass


def latest_run(log_dir: Optional[str], prog: str = "measure") -> Optional[Path]:
    """The deployment to measure: LOG_DIR/latest when it is running, else the one running deployment started from
    this checkout with another LOG_DIR (``dsv4_sm120.serving.runs``; a line on stderr says so), else
    LOG_DIR/latest as it is (None when there is none)."""
    from ..serving import runs

    d = Path(os.path.expanduser(log_dir or settings.get("LOG_DIR") or "logs"))
    d = d if d.is_absolute() else REPO / d
    run_dir, note = runs.find(d)
    if note:
        print(f"{prog}: {note}", file=sys.stderr)
    return run_dir


def read_json(p: Path) -> Optional[dict]:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def deployment_info(run_dir: Optional[Path]) -> dict:
    """What the newest serving run says about itself (empty when there is none)."""
    if run_dir is None:
        return {}
    st = read_json(run_dir / "state.json") or {}
    plan = read_json(run_dir / "plan.json") or {}
    s = plan.get("settings", {})
    return {"run_dir": str(run_dir), "status": st.get("status"), "variant": st.get("variant"),
            "router_url": (st.get("urls") or {}).get("router"), "standin": st.get("standin"),
            "settings": {k: s.get(k) for k in ("MODEL_PATH", "PREFILL_GPUS", "DECODE_GPUS", "MAX_RUNNING",
                                              "CONTEXT_LEN", "MEM_FRACTION", "SPEC_ALGORITHM", "SPEC_NUM_STEPS",
                                              "SPEC_NUM_DRAFT_TOKENS", "SPEC_DSPARK_BLOCK_SIZE",
                                              "FP8_GEMM_BACKEND") if k in s},
            "fp8_gemm_backend": plan.get("fp8_reason"), "speculative": plan.get("spec_reason") or None,
            "decode_url": ",".join(x["health_url"].rsplit("/health", 1)[0] for x in plan.get("procs", [])
                                   if x.get("role") == "decode") or (plan.get("urls") or {}).get("decode"),
            "env": {k: v for k, v, _ in plan.get("common_env", [])}}


def http_status(url: str, timeout: float) -> Optional[int]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError, ValueError):
        return None


def require_healthy_router(url: str, timeout: float = 120.0) -> None:
    st = http_status(url + "/health", 5)
    if st != 200:
        raise MeasureError(f"no healthy router at {url} (/health: {st or 'no answer'}); start the deployment first "
                           f"(make serve, or serve/serve_dsv4_tp4.sh) or name its router ({hints.args('--router URL')})")
    st = http_status(url + "/health_generate", timeout)
    if st != 200:
        raise MeasureError(f"router at {url} is up but a generation through it failed (/health_generate: "
                           f"{st or 'no answer within %gs' % timeout}); check the servers' logs")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
HF_ID = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")


def tokenizer_problem(model: str, environ=None, timeout: float = 10.0) -> Optional[str]:
    """Why SGLang's load generator could not load ``model``'s tokenizer here (None: it can): a local directory
    must hold the tokenizer files; a Hugging Face id must be in the local hub cache, or the hub must answer
    (not with HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE set)."""
    env = os.environ if environ is None else environ
    local = Path(os.path.expanduser(model))
    if local.exists() or model.startswith(("/", ".", "~")) or not HF_ID.match(model):
        if not local.is_dir():
            return f"{model} is not a directory" if local.exists() else f"{model} does not exist"
        if not any((local / f).is_file() for f in TOKENIZER_FILES):
            return f"{model} holds none of {', '.join(TOKENIZER_FILES)}"
        return None
    cache = hub_cache_dir(env)
    snaps = cache / ("models--" + model.replace("/", "--")) / "snapshots"
    if any((d / f).exists() for d in (snaps.iterdir() if snaps.is_dir() else []) for f in TOKENIZER_FILES):
        return None
    where = f"not in the Hugging Face cache ({cache})"
    offline = [k for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
               if (env.get(k) or "").strip().lower() in ("1", "true", "yes", "on")]
    if offline:
        return f"{model} is {where} and {offline[0]}={env[offline[0]]} forbids downloading it"
    endpoint = (env.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    try:
        with urllib.request.urlopen(f"{endpoint}/api/models/{model}", timeout=timeout):
            return None
    except urllib.error.HTTPError as e:
        return f"{model} is {where} and {endpoint} answered HTTP {e.code} for it"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return f"{model} is {where} and {endpoint} cannot be reached ({getattr(e, 'reason', e)})"


STANDIN_TITLE = ("STAND-IN servers (no model, no GPU): a rehearsal of the harness, not a measurement of "
                 "DeepSeek-V4-Flash")


def server_info(url: str) -> dict:
    for path in ("/server_info", "/get_server_info"):
        try:
            with urllib.request.urlopen(url + path, timeout=5) as r:
                info = json.loads(r.read().decode())
            if isinstance(info, dict):
                return info
        except (urllib.error.URLError, OSError, ValueError):
            continue
    return {}


def is_standin(dep: dict, decode_url: Optional[str], router: str) -> bool:
    """Whether the deployment measured is stand-in servers: its run record says so, else the servers do."""
    if dep.get("standin") is not None and (dep.get("router_url") or "").rstrip("/") == router:
        return bool(dep["standin"])
    return bool(server_info((decode_url or router).split(",")[0]).get("standin"))


def write_standin_tokenizer(d: Path) -> Path:
    """A word-level tokenizer (2000 words, no download) the load generator can load, for stand-in servers."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
    except ImportError as e:
        raise MeasureError(f"cannot write a stand-in tokenizer here ({e}); name a tokenizer directory "
                           f"({hints.args('--model DIR')})")
    vocab = {f"w{i}": i for i in range(2000)}
    vocab.update({"[UNK]": 2000, "<s>": 2001, "</s>": 2002})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(d))
    return d


def log_tail(path: Path, n: int = 5) -> List[str]:
    """The last ``n`` non-empty lines of a log (empty when unreadable)."""
    try:
        lines = [x.rstrip() for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return []
    return lines[-n:]


def bench_cmd(python: str, router: str, model: str, c: int, input_len: int, output_len: int, num_prompts: int,
              out_file: str, dataset: str, seed: int, warmup: int) -> List[str]:
    """The load generator's command; it runs in its output directory, so a local tokenizer path goes absolute."""
    model = absolute_if_local(model)
    return [python, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", router,
            "--model", model, "--tokenizer", model, "--dataset-name", dataset,
            "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--random-range-ratio", "1", "--num-prompts", str(num_prompts), "--max-concurrency", str(c),
            "--request-rate", "inf", "--seed", str(seed), "--warmup-requests", str(warmup),
            "--output-file", out_file, "--disable-tqdm"]


def parse_bench_output(path: Path) -> dict:
    try:
        lines = [x for x in path.read_text().splitlines() if x.strip()]
        res = json.loads(lines[-1])
    except (OSError, ValueError, IndexError) as e:
        raise MeasureError(f"no benchmark result in {path} ({type(e).__name__})")
    missing = [k for k in ("completed", "output_throughput", "median_tpot_ms", "median_ttft_ms", "p99_ttft_ms")
               if res.get(k) is None]
    if missing:
        raise MeasureError(f"benchmark result lacks {', '.join(missing)}")
    out = {k: res.get(k) for k in METRICS}
    tpot = out["median_tpot_ms"]
    out["per_user_tok_s"] = 1000.0 / tpot if tpot and tpot > 0 else None
    return out


def render_table(runs: List[dict]) -> str:
    hdr = f"{'C':>4} {'ok':>5} {'out tok/s':>10} {'tok/s/user':>11} {'TPOT p50 ms':>12} {'TPOT p99 ms':>12} " \
          f"{'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'acc/step':>8} {'acc rate':>8}"
    lines = [hdr, "-" * len(hdr)]

    def f(x, nd=1):
        return "-" if x is None else f"{x:.{nd}f}"

    for r in runs:
        m = r.get("metrics") or {}
        if r.get("error"):
            lines.append(f"{r['concurrency']:>4} {'FAIL':>5}  {r['error']}")
            continue
        spec = r.get("speculative") or {}
        # accepted tokens per step: this run's counter deltas; else the load generator's windowed server average
        acc = spec.get("accept_length", m.get("accept_length"))
        rate = spec.get("accept_rate")
        lines.append(f"{r['concurrency']:>4} {m['completed']:>5} {f(m['output_throughput']):>10} "
                     f"{f(m['per_user_tok_s']):>11} {f(m['median_tpot_ms'], 2):>12} {f(m.get('p99_tpot_ms'), 2):>12} "
                     f"{f(m['median_ttft_ms']):>12} {f(m['p99_ttft_ms']):>12} {f(acc, 2):>8} "
                     f"{'-' if rate is None else f'{100 * rate:.0f}%':>8}")
    return "\n".join(lines)


def plot(runs: List[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in runs if not r.get("error")]
    cs = [r["concurrency"] for r in ok]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    xs = list(range(len(cs)))
    ax.bar(xs, [r["metrics"]["output_throughput"] for r in ok], color="#3a7bd5", label="output tok/s (total)")
    ax.set_xticks(xs, [str(c) for c in cs])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens / s")
    ax2 = ax.twinx()
    ax2.plot(xs, [r["metrics"]["median_tpot_ms"] for r in ok], "o-", color="#d5533a", label="TPOT p50 (ms)")
    ax2.set_ylabel("TPOT p50 (ms)")
    ax2.set_ylim(bottom=0)
    for x, r in zip(xs, ok):
        ax.annotate(f"{r['metrics']['output_throughput']:.0f}", (x, r["metrics"]["output_throughput"]),
                    ha="center", va="bottom", fontsize=8)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


def git_rev() -> Optional[str]:
    try:
        r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=10)
        return r.stdout.strip() or None
    except OSError:
        return None


def environment(python: str) -> dict:
    """GPUs (nvidia-smi) and package versions of the serving environment, for the record."""
    env: dict = {"gpus": None, "driver": None, "packages": {}}
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if r.returncode == 0:
            rows = [[x.strip() for x in line.split(",")] for line in r.stdout.strip().splitlines()]
            env["gpus"] = [f"{row[0]}: {row[1]} ({row[2]})" for row in rows if len(row) >= 4]
            env["driver"] = rows[0][3] if rows and len(rows[0]) >= 4 else None
    except (OSError, subprocess.SubprocessError):
        pass
    code = ("import importlib.metadata as m, json\nout = {}\n"
            "for p in ('sglang', 'sglang-router', 'nixl-cu13', 'torch', 'triton', 'flashinfer-python', 'dsv4_sm120'):\n"
            "    try: out[p] = m.version(p)\n"
            "    except Exception: out[p] = None\n"
            "print(json.dumps(out))")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
        env["packages"] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    return env


def parse_concurrency(text: str) -> List[int]:
    try:
        cs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise MeasureError(f"--concurrency {text!r}: expected a comma list of integers")
    if not cs or any(c < 1 for c in cs):
        raise MeasureError(f"--concurrency {text!r}: expected positive integers")
    return cs


def serving_python(explicit=None):
    """The python that runs the benchmark client: explicit, else $VENV (default .venv) if present, else this one."""
    if explicit:
        return explicit
    venv = Path(os.path.expanduser(settings.get("VENV") or ".venv"))
    venv = venv if venv.is_absolute() else REPO / venv
    return str(venv / "bin" / "python") if (venv / "bin" / "python").exists() else sys.executable


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Results: OUT_DIR/results.json, OUT_DIR/table.txt, OUT_DIR/throughput.png.")
    ap.add_argument("--router", help="router URL (default: the newest run's, else http://127.0.0.1:$ROUTER_PORT)")
    ap.add_argument("--concurrency", default="1,8,16", help="comma list (default 1,8,16)")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--prompts-per-level", type=int, default=4,
                    help="requests per run = max(this x C, --min-prompts) (default 4)")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--warmup-requests", type=int, default=1)
    ap.add_argument("--dataset", choices=("random-ids", "random"), default="random-ids")
    ap.add_argument("--model", help="tokenizer / model path for the load generator (default: the run's MODEL_PATH)")
    ap.add_argument("--python", default=None, help="python with sglang (default: VENV's, else this one)")
    ap.add_argument("--out-dir", type=Path, help="default bench/results/measure-<UTC time>")
    ap.add_argument("--label", default="", help="free text stored with the results (e.g. 'mtp, fp8 triton')")
    ap.add_argument("--log-dir", default=None, help="serving LOG_DIR (default $LOG_DIR or logs)")
    ap.add_argument("--decode-url", default=None,
                    help="decode server URL (a comma list for decode replicas, summed) whose /metrics give the "
                         "accepted tokens per speculative step (default: the newest run's decode servers; none = no "
                         "acceptance columns)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    return ap


def _run_level(a, python: str, router: str, model: str, c: int, out_dir: Path, decode_url: Optional[str],
               spec_info: dict) -> tuple:
    """One concurrency level through the load generator: (its run record, the generator's exit code or None
    when it timed out)."""
    n = max(a.prompts_per_level * c, a.min_prompts)
    raw = out_dir / f"bench_c{c}.jsonl"
    if raw.exists():
        raw.unlink()
    cmd = bench_cmd(python, router, model, c, a.input_len, a.output_len, n, str(raw), a.dataset, a.seed,
                    a.warmup_requests)
    t0 = time.time()
    print(f"measure: C={c}: {n} requests ...", flush=True)
    before = spec_metrics.snapshot(decode_url) if decode_url else None
    with open(out_dir / f"bench_c{c}.log", "w") as log:
        try:
            r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout, cwd=str(out_dir))
            rc = r.returncode
        except subprocess.TimeoutExpired:
            rc = None
    run = {"concurrency": c, "num_prompts": n, "command": cmd, "wall_s": round(time.time() - t0, 1)}
    try:
        if rc != 0:
            raise MeasureError(f"load generator {'timed out' if rc is None else 'exited ' + str(rc)}; "
                               f"see {out_dir / f'bench_c{c}.log'}")
        run["metrics"] = parse_bench_output(raw)
        spec = spec_metrics.summarize(before, spec_metrics.snapshot(decode_url) if before else None,
                                      spec_info.get("num_draft_tokens"))
        if spec is not None:
            run["speculative"] = spec
        if run["metrics"]["completed"] < n:
            raise MeasureError(f"only {run['metrics']['completed']} of {n} requests completed")
    except MeasureError as e:
        run["error"] = str(e)
    return run, rc


def main(argv: Optional[List[str]] = None) -> int:
    a = _parser().parse_args(argv)
    try:
        cs = parse_concurrency(a.concurrency)
        if a.input_len < 1 or a.output_len < 2:
            raise MeasureError("--input-len must be >= 1 and --output-len >= 2 (TPOT needs two tokens)")
        run_dir = latest_run(a.log_dir)
        dep = deployment_info(run_dir)
        router = (a.router or dep.get("router_url")
                  or f"http://127.0.0.1:{settings.get('ROUTER_PORT') or '30000'}").rstrip("/")
        require_healthy_router(router)
        decode_url = ",".join(spec_metrics.urls(a.decode_url or dep.get("decode_url") or "")) or None
        standin = is_standin(dep, decode_url, router)
        model = a.model or (dep.get("settings") or {}).get("MODEL_PATH") or settings.get("MODEL_PATH") \
            or DEFAULT_MODEL
        problem = tokenizer_problem(model)
        if problem and not (standin and not a.model):
            raise MeasureError(f"the load generator needs the tokenizer of {model}: {problem}; name a directory "
                               f"that holds it ({hints.args('--model DIR')}) or make it reachable")
        python = serving_python(a.python)
        out_dir = a.out_dir or REPO / "bench" / "results" / time.strftime("measure-%Y%m%d-%H%M%S", time.gmtime())
        out_dir.mkdir(parents=True, exist_ok=True)
        if standin:
            print(f"measure: {STANDIN_TITLE}", flush=True)
        if problem:     # stand-ins: any tokenizer will do, and none needs the network
            model = str(write_standin_tokenizer(out_dir / "standin-tokenizer"))
            print(f"measure: stand-in servers and no tokenizer for the deployment's model ({problem}): using a "
                  f"word-level stand-in tokenizer written to {model}", flush=True)
    except (MeasureError, settings.SettingsError) as e:
        print(f"measure: {e}", file=sys.stderr)
        return 2
    print(f"measure: router {router}, model/tokenizer {model}, input {a.input_len}, output {a.output_len}, "
          f"concurrency {cs}, results in {out_dir}", flush=True)
    spec_info = spec_metrics.server_spec(decode_url) if decode_url else {}
    if spec_info.get("algorithm"):
        print(f"measure: speculative decoding {spec_info['algorithm']}, {spec_info.get('num_draft_tokens')} tokens "
              f"verified per step; acceptance from /metrics of {decode_url.replace(',', ', ')}", flush=True)
    runs = []
    for i, c in enumerate(cs):
        run, rc = _run_level(a, python, router, model, c, out_dir, decode_url, spec_info)
        runs.append(run)
        if rc not in (0, None):
            # the load generator itself failed (not a slow or partial run): the next levels run the same command
            # against the same deployment and would fail the same way
            log = out_dir / f"bench_c{c}.log"
            print(f"measure: C={c}: the load generator exited {rc}; the end of {log}:", file=sys.stderr)
            for line in log_tail(log):
                print(f"    {line}", file=sys.stderr)
            rest = cs[i + 1:]
            if rest:
                print(f"measure: not running C={','.join(map(str, rest))}: the same command would fail the same way",
                      file=sys.stderr)
                runs += [{"concurrency": x, "error": f"not run: the load generator failed at C={c}"} for x in rest]
            break
    result = {"schema": 1, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git": git_rev(),
              "router": router, "model": model, "input_len": a.input_len, "output_len": a.output_len,
              "dataset": a.dataset, "label": a.label, "standin": standin, "environment": environment(python),
              "deployment": dep,
              "speculative": spec_info or None, "runs": runs}
    atomic_write_text(out_dir / "results.json", json.dumps(result, indent=2) + "\n")
    table = (STANDIN_TITLE + "\n" if standin else "") + render_table(runs)
    atomic_write_text(out_dir / "table.txt", table + "\n")
    print(table)
    rc = 0 if all(not r.get("error") for r in runs) else 1
    if any(not r.get("error") for r in runs):
        title = (f"{'STAND-IN servers (no model, no GPU) ' if standin else 'DeepSeek-V4-Flash '}"
                 f"{dep.get('variant') or ''} in={a.input_len} out={a.output_len} {a.label}").strip()
        try:
            plot(runs, out_dir / "throughput.png", title)
        except ImportError:
            print("measure: matplotlib is not installed in this python: no plot (pip install matplotlib)",
                  file=sys.stderr)
            rc = 1
    print(f"measure: wrote {out_dir / 'results.json'}" + (" (with failures)" if rc else "")
          + (" (stand-in servers: a rehearsal, not a measurement)" if standin else ""))
    return rc


if __name__ == "__main__":
    sys.exit(main())
