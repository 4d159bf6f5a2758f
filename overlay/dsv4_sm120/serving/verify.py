"""``make verify``: the whole deployment, ours against stock SGLang, in one command and one report.

    python -m dsv4_sm120.serving.verify [--variants ours,stock[,mtp]] [--stages greedy,accuracy,measure,profile]
                                        [--dry-run] [options]

For each variant it starts the deployment exactly as ``serve/serve_dsv4_tp4.sh --detach`` does (the MTP
variant: ``serve/serve_dsv4_mtp.sh``), with the variant's switches in the environment, runs the stages
against the router, and stops it before the next variant starts:

* ``ours``: the calibrated choices (the overlay on, the machine profile in ``configs/profiles``, your
  settings); ``stock``: ``DSV4_SM120_DISABLE=1`` (SGLang's own paths) and SGLang's FP8 GEMM backend;
  ``stock-attention`` / ``stock-moe`` / ``stock-fp8``: one decision back to SGLang's choice each;
  ``mtp``: speculative decoding with our choices, included by default when ``MODEL_PATH`` carries a draft
  (``speculative.detect_draft``); it is compared with ``ours``, the non-speculative path.
* stages: ``greedy`` (the fixed prompt set ``verify_prompts.json`` through the router's ``/generate``,
  temperature 0, token ids recorded and compared token by token), ``accuracy`` (GSM8K few-shot through
  SGLang's own ``sglang.test.few_shot_gsm8k``; when the dataset cannot be fetched the report says so and
  the run goes on), ``measure`` (``make measure``: ``dsv4_sm120.perf.measure``), ``profile``
  (``make profile``: ``dsv4_sm120.perf.profile_capture``).

Writes ``report.md`` and ``report.json`` (``verify_report``) in the run directory
(``LOG_DIR/verify-<UTC time>-<pid>``, or ``--out-dir``), one subdirectory per variant with each stage's
output and the deployment's own run directory (``<variant>/serve``). Every deployment is torn down on
every exit path: a failed stage, a failed start, an exception, SIGINT (Ctrl-C) or SIGTERM.
Exit codes: 0 every stage passed, 1 a start or a stage failed, 2 bad arguments or configuration,
130 / 143 interrupted by SIGINT / SIGTERM (after teardown).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from .. import settings
from ..fileio import atomic_write_text
from ..paths import OVERLAY_DIR, checkout_root
from . import supervisor as sv
from . import verify_report as vr
from .plan import VARIABLES, ConfigError, Plan, build_plan
from .verify_data import (GSM8K_URL, UsageError, client_failure, decode_urls, fetch_gsm8k, gsm8k_cache_path,
                          load_prompts, parse_list, preflight_refusal, read_json)

STAGES = ("greedy", "accuracy", "measure", "profile", "shape")
DEFAULT_STAGES = STAGES[:4]          # the shape stage starts a deployment per candidate: only when asked for

# name: (serve variant, environment switches, what it is)
VARIANTS: Dict[str, Tuple[str, Dict[str, str], str]] = {
    "ours": ("base", {}, "the calibrated choices: overlay on, machine profile, your settings"),
    "stock": ("base", {"DSV4_SM120_DISABLE": "1", "DSV4_SM120_FP8_GEMM_BACKEND": "default"},
              "every decision stock: DSV4_SM120_DISABLE=1 (SGLang's own paths), SGLang's FP8 GEMM backend"),
    "stock-attention": ("base", {"DSV4_SM120_ATTN_BACKEND": "flashinfer"},
                        "sparse-MLA decode by SGLang's sm_120 path (DSV4_SM120_ATTN_BACKEND=flashinfer)"),
    "stock-moe": ("base", {"DSV4_SM120_MOE_BACKEND": "stock"}, "MoE runner chosen by SGLang (DSV4_SM120_MOE_BACKEND=stock)"),
    "stock-fp8": ("base", {"DSV4_SM120_FP8_GEMM_BACKEND": "default", "DSV4_SM120_FP8_CONFIG_DIR": ""},
                  "FP8 GEMM backend and configs of SGLang (DSV4_SM120_FP8_GEMM_BACKEND=default, "
                  "DSV4_SM120_FP8_CONFIG_DIR=)"),
    "mtp": ("mtp", {}, "speculative decoding (serve/serve_dsv4_mtp.sh), our choices; vs the non-speculative ours"),
}
SCRIPTS = {"base": "serve/serve_dsv4_tp4.sh", "mtp": "serve/serve_dsv4_mtp.sh"}
# Preflight checks whose result does not depend on the variant's switches (the box, its GPUs, ports, NIXL, the
# checkout's patches, the model): when one of them refuses a start, every later variant would be refused too.
# "python" is the serving environment check, which the preflight runs before the named checks.
BOX_WIDE_CHECKS = ("python", "ports", "gpu", "model", "patches", "nixl", "numa", "p2p", "ucx", "router")


class Interrupted(BaseException):
    """SIGINT / SIGTERM arrived: unwind to the teardown."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class Verify:
    def __init__(self, a: argparse.Namespace, env: Dict[str, str], variants: List[str], stages: List[str],
                 plans: Dict[str, Plan], run_dir: Path, log_dir: Path):
        self.a, self.env, self.variants, self.stages, self.plans = a, env, variants, stages, plans
        self.run_dir, self.log_dir = run_dir, log_dir
        self.t0 = time.monotonic()
        self.child: Optional[subprocess.Popen] = None
        self.live: Optional[str] = None              # variant whose deployment may be running
        self.stopping = False
        self.results: Dict[str, dict] = {}
        self.failures: List[str] = []
        self.accuracy_note = ""
        self.gsm8k: Optional[Path] = None
        self.teardown_lines: List[str] = []
        self.skipped_variants: List[str] = []       # not started after a box-wide preflight refusal
        # what each deployment runs: (serve variant, switches, what it is); the shape stage adds its candidates
        self.table: Dict[str, Tuple[str, Dict[str, str], str]] = {v: VARIANTS[v] for v in variants}
        self.variant_stages = [x for x in stages if x != "shape"]
        self.study = None                           # shapes.Study with --stages shape

    # ---- output
    def say(self, msg: str) -> None:
        print(f"[verify +{time.monotonic() - self.t0:6.1f}s] {msg}", flush=True)

    # ---- signals
    def on_signal(self, signum, _frame) -> None:
        if self.stopping:
            self.say(f"signal {signum}: teardown already in progress")
            return
        raise Interrupted(signum)

    # ---- child processes
    def run_cmd(self, cmd: List[str], log: Path, env: Dict[str, str], timeout: float, cwd: Path,
                echo: Optional[Callable[[str], bool]] = None) -> Optional[int]:
        """Run cmd in its own session, output to log (lines passing ``echo`` also printed); its exit code,
        None on timeout. Interrupted: the child's group is stopped before the exception goes on."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:
            f.write(f"$ {' '.join(cmd)}\n".encode())
            f.flush()
            self.child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=env, cwd=str(cwd), start_new_session=True)
        pos = log.stat().st_size
        t0 = time.monotonic()
        try:
            while True:
                rc = self.child.poll()
                pos = self._echo(log, pos, echo)
                if rc is not None:
                    return rc
                if time.monotonic() - t0 > timeout:
                    self.say(f"timed out after {timeout:g} s: stopping {cmd[0]} ...")
                    self._stop_child()
                    return None
                time.sleep(0.2)
        finally:
            self._stop_child()
            self.child = None

    def _echo(self, log: Path, pos: int, echo) -> int:
        try:
            with open(log, "rb") as f:
                f.seek(pos)
                chunk = f.read()
        except OSError:
            return pos
        if not chunk or echo is None:
            return pos + len(chunk)
        cut = chunk.rfind(b"\n") + 1
        for line in chunk[:cut].decode(errors="replace").splitlines():
            if echo(line):
                print(f"    {line}", flush=True)
        return pos + cut

    def _stop_child(self) -> None:
        c = self.child
        if c is None or c.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(c.pid, sig)
            except OSError:
                pass
            try:
                c.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    # ---- deployments
    def serve_dir(self, v: str) -> Path:
        return self.run_dir / v / "serve"

    def variant_env(self, v: str) -> Dict[str, str]:
        env = dict(self.env)
        env.update(self.table[v][1])
        env["RUN_DIR"] = str(self.serve_dir(v))
        env["LOG_DIR"] = str(self.log_dir)
        for k in ("DETACH", "DRY_RUN"):
            env.pop(k, None)
        return env

    def start_cmd(self, v: str) -> List[str]:
        return ["bash", str(Path(self.plans[v].repo) / SCRIPTS[self.table[v][0]]), "--detach"]

    def start(self, v: str) -> Optional[str]:
        """Start variant v's deployment (detached, healthy); None or the failure line."""
        self.live = v
        vdir = self.run_dir / v
        t0 = time.monotonic()
        self.say(f"{v}: starting the deployment ({' '.join(self.start_cmd(v)[1:])}, "
                 f"{' '.join(f'{k}={x}' for k, x in self.table[v][1].items()) or 'no switches'})")
        important = re.compile(r"healthy|READY|FAILED|refused|error|preflight|warm-up")
        limit = float(self.plans[v].settings["HEALTH_TIMEOUT_S"]) * 2 + 300
        rc = self.run_cmd(self.start_cmd(v), vdir / "deploy.log", self.variant_env(v), limit, vdir,
                          echo=lambda line: bool(important.search(line)))
        res = self.results[v]
        if rc == 0 and self.deployment_problem(v) is None:
            res["start"] = {"ok": True, "seconds": round(time.monotonic() - t0, 1)}
            self.say(f"{v}: deployment ready after {time.monotonic() - t0:.0f} s")
            return None
        st = sv.read_state(self.serve_dir(v)) or {}
        refusal = preflight_refusal(vdir / "deploy.log") if rc is not None else None
        why = st.get("message") or (refusal["why"] if refusal else None) or \
            ("timed out" if rc is None else f"the serve script exited with code {rc}")
        res["start"] = {"ok": False, "seconds": round(time.monotonic() - t0, 1), "error": why,
                        "log": str(vdir / "deploy.log")}
        if refusal:
            res["start"]["preflight_checks"] = refusal["checks"]
        return f"{v}: the deployment did not start ({why}; see {vdir / 'deploy.log'})"

    def box_wide_refusal(self, v: str) -> Optional[str]:
        """The failed checks (text) when variant v's start was refused only by variant-independent preflight
        checks; None otherwise."""
        checks = ((self.results.get(v) or {}).get("start") or {}).get("preflight_checks")
        if checks is None or not set(checks) <= set(BOX_WIDE_CHECKS):
            return None
        return ", ".join(checks)

    def deployment_problem(self, v: str) -> Optional[str]:
        st = sv.read_state(self.serve_dir(v))
        if st is None:
            return "no deployment state"
        if st.get("status") != "ready" or not sv.is_alive(st.get("supervisor_pid") or 0, st.get("supervisor_start")):
            return f"deployment {st.get('status')}" + (f": {st['message']}" if st.get("message") else "")
        return None

    def stop(self, v: str) -> None:
        """Stop variant v's deployment, whatever state its start reached."""
        sdir = self.serve_dir(v)
        grace = float(self.plans[v].settings["STOP_GRACE_S"])
        # A supervisor that the start spawned but that has not yet written its state: stop it by its pid
        # (from the start's output), after which its state (if any) tells stop_run the rest.
        log = self.run_dir / v / "deploy.log"
        m = re.findall(r"supervisor detached \(pid (\d+)\)", log.read_text(errors="replace")) if log.exists() else []
        st = sv.read_state(sdir)
        if not m and st is None and not (sdir / "state.json").exists():
            line = f"{v}: nothing to stop (no deployment was started)"
            self.teardown_lines.append(line)
            self.say(line)
            if self.live == v:
                self.live = None
            return
        self.say(f"{v}: stopping the deployment ({sdir})")
        if m and not (st and st.get("supervisor_pid")):
            pid = int(m[-1])
            try:
                mine = str(sdir) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                mine = False
            if mine and sv.is_alive(pid):
                os.kill(pid, signal.SIGTERM)
                deadline = time.monotonic() + grace + 20
                while sv.is_alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.1)
        rc = sv.stop_run(sdir, grace)
        left = [p for p in (sv.read_state(sdir) or {}).get("procs", [])
                if sv.is_alive(p["pid"], p.get("start")) or (p.get("pgid") and sv.group_members(p["pgid"]))]
        line = f"{v}: " + ("stopped, no process left" if rc == 0 and not left else
                           f"stop returned {rc}, {len(left)} part(s) still alive: run serve/stop.sh {sdir}")
        self.teardown_lines.append(line)
        self.say(line)
        if self.live == v:
            self.live = None

    # ---- stages
    def client_env(self) -> Dict[str, str]:
        env = dict(self.env)
        env["PYTHONPATH"] = str(OVERLAY_DIR) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def run_client(self, v: str, stage: str, cmd: List[str],
                   echo: Callable[[str], bool]) -> Tuple[Optional[int], Path]:
        """Run a client stage's command against variant ``v`` (output in ``<run>/<v>/<stage>.log``, lines passing
        ``echo`` also printed, ``--stage-timeout`` applies): (exit code or None on timeout, the log)."""
        log = self.run_dir / v / f"{stage}.log"
        return self.run_cmd(cmd, log, self.client_env(), self.a.stage_timeout, self.run_dir / v, echo=echo), log

    def perf_tool_args(self) -> List[str]:
        """The ``--python`` / ``--model`` options that make measure and make profile take from verify's own."""
        a = self.a
        return (["--python", a.python] if a.python else []) + (["--model", a.model] if a.model else [])

    def client_python(self) -> str:
        from ..perf import measure
        return measure.serving_python(self.a.python)

    def prompts(self) -> List[dict]:
        return load_prompts(self.a.prompt_file)[: self.a.prompts or None]

    def stage_greedy(self, v: str) -> dict:
        url = self.plans[v].urls["router"] + "/generate"
        out, errors = [], 0
        for p in self.prompts():
            body = {"text": p["text"], "sampling_params": {"temperature": 0, "max_new_tokens": self.a.greedy_tokens}}
            t0 = time.monotonic()
            rec = {"id": p["id"]}
            try:
                req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=self.a.stage_timeout) as r:
                    ans = json.loads(r.read())
                meta = ans.get("meta_info") or {}
                rec.update(output_ids=ans.get("output_ids"), text=ans.get("text"),
                           finish_reason=meta.get("finish_reason"), completion_tokens=meta.get("completion_tokens"))
            except urllib.error.HTTPError as e:
                rec["error"] = f"HTTP {e.code}: {e.read()[:200].decode(errors='replace')}"
            except (urllib.error.URLError, OSError, ValueError) as e:
                rec["error"] = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            rec["seconds"] = round(time.monotonic() - t0, 3)
            errors += "error" in rec
            out.append(rec)
        atomic_write_text(self.run_dir / v / "greedy.json", json.dumps(out, indent=1) + "\n")
        res = {"results": out, "prompts": len(out), "max_new_tokens": self.a.greedy_tokens}
        if errors:
            res["error"] = f"{errors} of {len(out)} greedy requests failed (first: " \
                           f"{next(r['error'] for r in out if 'error' in r)})"
        return res

    def accuracy_cmd(self, v: str) -> List[str]:
        u = urllib.parse.urlsplit(self.plans[v].urls["router"])
        data = self.a.gsm8k_data or str(gsm8k_cache_path(self.a.gsm8k_url))
        return [self.client_python(), "-m", "sglang.test.few_shot_gsm8k", "--data-path", data,
                "--num-questions", str(self.a.gsm8k_questions), "--num-shots", str(self.a.gsm8k_shots),
                "--parallel", str(self.a.gsm8k_parallel), "--max-new-tokens", str(self.a.gsm8k_max_new_tokens),
                "--host", u.hostname or "127.0.0.1", "--port", str(u.port or 80)]

    def stage_accuracy(self, v: str) -> dict:
        if self.gsm8k is None:
            return {"skipped": self.accuracy_note}
        rc, log = self.run_client(v, "accuracy", self.accuracy_cmd(v),
                                  echo=lambda line: line.startswith(("Accuracy", "Invalid", "Latency")))
        text = log.read_text(errors="replace")
        acc = re.findall(r"^Accuracy: ([0-9.]+)", text, re.M)
        inv = re.findall(r"^Invalid: ([0-9.]+)", text, re.M)
        res = {"log": str(log), "questions": self.a.gsm8k_questions, "shots": self.a.gsm8k_shots}
        if rc != 0 or not acc:
            res["error"] = client_failure("SGLang's GSM8K helper", rc, log)
            return res
        res.update(accuracy=float(acc[-1]), invalid=float(inv[-1]) if inv else None)
        return res

    def measure_cmd(self, v: str) -> List[str]:
        a, plan = self.a, self.plans[v]
        cmd = [sys.executable, "-m", "dsv4_sm120.perf.measure", "--router", plan.urls["router"],
               "--decode-url", decode_urls(plan), "--concurrency", a.concurrency, "--input-len", str(a.input_len),
               "--output-len", str(a.output_len), "--prompts-per-level", str(a.prompts_per_level),
               "--min-prompts", str(a.min_prompts), "--out-dir", str(self.run_dir / v / "measure"),
               "--log-dir", str(self.log_dir), "--label", f"verify {v}"]
        return cmd + self.perf_tool_args()

    def stage_measure(self, v: str) -> dict:
        out = self.run_dir / v / "measure"
        rc, log = self.run_client(v, "measure", self.measure_cmd(v), echo=lambda line: line.startswith("measure:"))
        data = read_json(out / "results.json") or {}
        res = {"out_dir": str(out), "runs": data.get("runs") or [], "speculative": data.get("speculative")}
        if rc != 0:
            res["error"] = client_failure("make measure", rc, log)
        return res

    def profile_cmd(self, v: str) -> List[str]:
        a, plan = self.a, self.plans[v]
        dec = next(p for p in plan.procs if p.role == "decode")
        cmd = [sys.executable, "-m", "dsv4_sm120.perf.profile_capture", "--router", plan.urls["router"],
               "--decode-url", plan.urls["decode"], "--trace-dir", dec.env["SGLANG_TORCH_PROFILER_DIR"],
               "--decode-tp", str(len(dec.gpus)), "--concurrency", str(a.profile_concurrency),
               "--warmup-s", f"{a.profile_warmup_s:g}", "--num-steps", str(a.profile_steps),
               "--input-len", str(a.input_len), "--output-len", str(a.profile_output_len),
               "--out-dir", str(self.run_dir / v / "profile"), "--log-dir", str(self.log_dir)]
        return cmd + self.perf_tool_args()

    def stage_profile(self, v: str) -> dict:
        out = self.run_dir / v / "profile"
        rc, log = self.run_client(v, "profile", self.profile_cmd(v), echo=lambda line: line.startswith("profile:"))
        s = read_json(out / "summary.json") or {}
        res = {"out_dir": str(out), "groups": s.get("groups"), "idle_share_of_window": s.get("idle_share_of_window"),
               "bottleneck": s.get("bottleneck")}
        if rc != 0:
            res["error"] = client_failure("make profile", rc, log)
        return res

    # ---- the run
    def prepare_gsm8k(self) -> None:
        self.gsm8k, self.accuracy_note = fetch_gsm8k(self.a.gsm8k_data, self.a.gsm8k_url)
        if self.gsm8k is None:
            self.say(f"accuracy: {self.accuracy_note}; the other stages go on")

    def run_variant(self, v: str, stages: Optional[List[str]] = None) -> None:
        """Start deployment ``v``, run ``stages`` (default: the variant stages) against it, stop it."""
        self.results[v] = {"serve_variant": self.table[v][0], "switches": self.table[v][1],
                           "run_dir": str(self.serve_dir(v)), "stages": {}}
        try:
            err = self.start(v)
            if err:
                self.failures.append(err)
                self.say(f"FAILED: {err}")
                return
            for stage in self.variant_stages if stages is None else stages:
                problem = self.deployment_problem(v)
                if problem:
                    self.results[v]["stages"][stage] = {"status": "skipped", "error": problem}
                    continue
                self.say(f"{v}: {stage} ...")
                t0 = time.monotonic()
                res = getattr(self, f"stage_{stage}")(v)
                res["seconds"] = round(time.monotonic() - t0, 1)
                if "skipped" in res:
                    res["status"] = "skipped"
                elif res.get("error") is None and self.deployment_problem(v) is None:
                    res["status"] = "ok"
                else:
                    problem = self.deployment_problem(v)
                    res["status"] = "failed"
                    if problem:
                        res["error"] = (res.get("error") or "") + (f"; the deployment died: {problem}")
                    self.failures.append(f"{v}: {stage} failed ({res['error'].lstrip('; ')})")
                self.results[v]["stages"][stage] = res
                self.say(f"{v}: {stage} {res['status']} after {res['seconds']:.0f} s"
                         + (f": {res['error'].lstrip('; ')}" if res["status"] == "failed" else
                            f": {res['skipped']}" if res["status"] == "skipped" else ""))
        finally:
            self.stop(v)

    def report(self, interrupted: Optional[int]) -> dict:
        from ..perf import measure
        descriptions = {v: VARIANTS[v][2] for v in self.variants}
        first = self.plans[self.variants[0]]
        rep = {"schema": 1, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git": measure.git_rev(),
               "model": first.settings["MODEL_PATH"], "run_dir": str(self.run_dir), "standin": first.standin,
               "stages": self.stages, "variants": self.results, "descriptions": descriptions,
               "accuracy_note": self.accuracy_note, "first_tokens": self.a.first_tokens,
               "interrupted": interrupted, "failures": list(self.failures), "not_started": self.skipped_variants}
        if interrupted:
            rep["failures"].append(f"interrupted by signal {interrupted}")
        if self.study is not None:
            rep["shape"] = self.study.report()
        rep["comparisons"] = vr.build_comparisons(self.results, descriptions, self.a.first_tokens, self.accuracy_note)
        rep["ok"] = not rep["failures"]
        rep["teardown"] = "; ".join(self.teardown_lines) or "nothing was started"
        return rep

    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        old = {s: signal.signal(s, self.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        interrupted = None
        try:
            self.say(f"run directory {self.run_dir}; variants {', '.join(self.variants)}; "
                     f"stages {', '.join(self.stages)}")
            if "accuracy" in self.stages:
                self.prepare_gsm8k()
            for i, v in enumerate(self.variants if self.variant_stages else []):
                self.run_variant(v)
                checks = self.box_wide_refusal(v)
                rest = self.variants[i + 1:]
                if checks and rest:
                    self.say(f"not starting {', '.join(rest)}: the preflight refused {v} on this box's own "
                             f"check{'s' if ',' in checks else ''} ({checks}), which no variant changes")
                    self.skipped_variants = rest
                    break
            if self.study is not None and not self.skipped_variants:
                self.study.run(self)
        except Interrupted as e:
            self.stopping = True
            interrupted = e.signum
            self.say(f"interrupted by signal {e.signum}: tearing down")
            self._stop_child()
            if self.live:
                self.stop(self.live)
        except Exception as e:          # a bug must not leave a deployment behind; the traceback follows
            self.stopping = True
            self.say(f"internal error ({type(e).__name__}: {e}): tearing down")
            if self.live:
                self.stop(self.live)
            raise
        finally:
            self.stopping = True
            for s, h in old.items():
                signal.signal(s, h)
        rep = self.report(interrupted)
        vr.write_report(rep, self.run_dir)
        for c in rep["comparisons"]:
            self.say(f"verdict ours vs {c['variant']}: {c['verdict']}")
        self.say(f"{'all stages passed' if rep['ok'] else 'FAILED: ' + '; '.join(rep['failures'])}")
        self.say(f"report: {self.run_dir / 'report.md'} (+ report.json)")
        if interrupted:
            return 128 + interrupted
        return 0 if rep["ok"] else 1

    def dry_run(self) -> str:
        out = [f"# make verify plan (dry run: nothing started); run directory {self.run_dir}",
               f"# stages: {', '.join(self.stages)}"]
        if "accuracy" in self.stages:
            out.append(f"# accuracy data: {self.a.gsm8k_data or 'downloaded once from ' + self.a.gsm8k_url}")
        for v in self.variants if self.variant_stages else []:
            env = self.table[v][1]
            out.append(f"variant {v}: {self.table[v][2]}")
            sw = " ".join(f"{k}={shlex.quote(x)}" for k, x in env.items())
            out.append(f"  start: RUN_DIR={shlex.quote(str(self.serve_dir(v)))} {sw + ' ' if sw else ''}"
                       f"{shlex.join(self.start_cmd(v))}")
            for s in self.variant_stages:
                if s == "greedy":
                    out.append(f"  greedy: POST {self.plans[v].urls['router']}/generate x {len(self.prompts())} prompts "
                               f"(temperature 0, max_new_tokens {self.a.greedy_tokens}; token ids compared)")
                else:
                    cmd = getattr(self, f"{s}_cmd")(v)
                    out.append(f"  {s}: {shlex.join(cmd)}")
            out.append(f"  stop: serve/stop.sh {shlex.quote(str(self.serve_dir(v)))}")
        if self.study is not None:
            out += self.study.dry_run_lines(self)
        out.append(f"report: {self.run_dir / 'report.md'} and report.json")
        return "\n".join(out)


def default_variants(environ: Dict[str, str]) -> Tuple[List[str], str]:
    """ours, stock, and mtp when MODEL_PATH carries a draft (speculative.detect_draft)."""
    from .speculative import SpecError, detect_draft
    model = settings.get("MODEL_PATH", environ) or VARIABLES["MODEL_PATH"][0]
    try:
        kind = detect_draft(model).kind
    except SpecError as e:
        return ["ours", "stock"], f"no mtp variant: {e}"
    if kind:
        return ["ours", "stock", "mtp"], f"mtp included: {model} carries a draft ({kind})"
    return ["ours", "stock"], f"no mtp variant: {model} carries no draft (or its config.json is not readable here)"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dsv4_sm120.serving.verify",
                                 description=__doc__.split("\n\n")[0] + " Ours vs stock SGLang: greedy outputs, "
                                 "GSM8K accuracy, make measure, make profile; one report.",
                                 epilog="Variants: " + "; ".join(f"{k} = {v[2]}" for k, v in VARIANTS.items())
                                 + ". The deployment is configured by the serve variables (docs/serving.md).")
    ap.add_argument("--variants", help="comma list of " + ", ".join(VARIANTS) + " (default: ours,stock, plus mtp "
                    "when MODEL_PATH carries a draft); ours comes first, the others are compared with it")
    ap.add_argument("--stages", default=",".join(DEFAULT_STAGES),
                    help="comma list of %s (default: all but shape)" % ", ".join(STAGES))
    ap.add_argument("--dry-run", action="store_true", help="print the stages and the commands each runs; start nothing")
    ap.add_argument("--out-dir", type=Path, help="run directory (default LOG_DIR/verify-<UTC time>-<pid>)")
    g = ap.add_argument_group("greedy")
    g.add_argument("--greedy-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    g.add_argument("--prompts", type=int, default=0, help="use the first N prompts of the set (default: all)")
    g.add_argument("--prompt-file", help="another prompt set (JSON like dsv4_sm120/serving/verify_prompts.json)")
    g.add_argument("--first-tokens", type=int, default=16,
                   help="the mtp variant must match the non-speculative answers on this many first tokens (default 16)")
    g = ap.add_argument_group("accuracy (SGLang's sglang.test.few_shot_gsm8k)")
    g.add_argument("--gsm8k-questions", type=int, default=200)
    g.add_argument("--gsm8k-shots", type=int, default=5)
    g.add_argument("--gsm8k-parallel", type=int, default=64)
    g.add_argument("--gsm8k-max-new-tokens", type=int, default=512)
    g.add_argument("--gsm8k-data", help="local GSM8K test.jsonl (default: download --gsm8k-url once into the cache)")
    g.add_argument("--gsm8k-url", default=GSM8K_URL)
    g = ap.add_argument_group("measure / profile (make measure, make profile)")
    g.add_argument("--concurrency", default="1,8,16", help="make measure's levels (default 1,8,16)")
    g.add_argument("--input-len", type=int, default=1024)
    g.add_argument("--output-len", type=int, default=512)
    g.add_argument("--prompts-per-level", type=int, default=4)
    g.add_argument("--min-prompts", type=int, default=8)
    g.add_argument("--profile-concurrency", type=int, default=16)
    g.add_argument("--profile-warmup-s", type=float, default=30.0)
    g.add_argument("--profile-steps", type=int, default=30)
    g.add_argument("--profile-output-len", type=int, default=1024)
    g.add_argument("--python", help="python with sglang for the load generator and the GSM8K helper "
                   "(default: VENV's, else this one)")
    g.add_argument("--model", help="tokenizer path for the load generator (default: MODEL_PATH)")
    g = ap.add_argument_group("shape (the serving layout and draft length, measured and recorded: docs/verify.md)")
    g.add_argument("--shape", action="append", metavar="PREFILL/DECODE",
                   help="a candidate: PREFILL_GPUS/DECODE_GPUS with ';' between replicas, e.g. '0,1,2,3/4,5;6,7'; "
                        "repeatable (default: your prefill GPUs with the decode GPUs as one server, then as two halves)")
    g.add_argument("--draft-lengths", help="MTP: the DSpark block sizes or EAGLE steps to try (default 3,5,7 / 1,2,3)")
    ap.add_argument("--stage-timeout", type=float, default=3600.0, help="seconds one stage may take (default 3600)")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    env = dict(os.environ)
    try:
        stages = parse_list(a.stages, STAGES, "stages")
        stages = [s for s in STAGES if s in stages]
        if a.variants:
            variants = parse_list(a.variants, VARIANTS, "variants")
            note = ""
        else:
            variants, note = default_variants(env)
        if "ours" in variants:
            variants = ["ours"] + [v for v in variants if v != "ours"]
        if a.greedy_tokens < 1 or a.prompts < 0 or a.first_tokens < 1 or a.gsm8k_questions < 1:
            raise UsageError("--greedy-tokens, --first-tokens and --gsm8k-questions must be >= 1, --prompts >= 0")
        if "greedy" in stages:
            load_prompts(a.prompt_file)
        log_dir = Path(os.path.expanduser(settings.get("LOG_DIR", env) or VARIABLES["LOG_DIR"][0]))
        log_dir = log_dir if log_dir.is_absolute() else checkout_root() / log_dir
        run_dir = (a.out_dir or log_dir / time.strftime(f"verify-%Y%m%d-%H%M%S-{os.getpid()}", time.gmtime())).resolve()
        plans = {}
        for v in variants:
            venv = dict(env, **VARIANTS[v][1], RUN_DIR=str(run_dir / v / "serve"))
            venv.pop("DRY_RUN", None)
            try:
                plans[v] = build_plan(venv, VARIANTS[v][0])
            except ConfigError as e:
                raise UsageError(f"variant {v}: configuration error: {e}")
            if "router" not in plans[v].roles or "decode" not in plans[v].roles:
                raise UsageError(f"variant {v}: make verify runs the whole deployment on this host "
                                 f"(NODE_ROLE={plans[v].settings['NODE_ROLE']}): use NODE_ROLE=all")
        study = None
        if "shape" in stages:
            from .shapes import Study
            study = Study(a, env, variants, run_dir)
    except (UsageError, settings.SettingsError) as e:
        print(f"verify: {e}", file=sys.stderr)
        return 2
    ver = Verify(a, env, variants, stages, plans, run_dir, log_dir)
    ver.study = study
    if note:
        print(f"verify: {note}", flush=True)
    if a.dry_run:
        print(ver.dry_run())
        return 0
    return ver.run()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
