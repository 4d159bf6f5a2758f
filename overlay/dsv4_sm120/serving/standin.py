"""A small HTTP server standing in for ``python -m sglang.launch_server`` (no GPU, no model).

Selected by ``DSV4_SM120_SERVE_STANDIN=1`` in the serving scripts: it takes the same command line
(only ``--host``, ``--port``, ``--disaggregation-mode``, ``--disaggregation-bootstrap-port``,
``--model-path``, ``--served-model-name`` matter), binds the same ports (prefill also its
bootstrap port), answers ``/health``, ``/health_generate``, ``/get_model_info``,
``/server_info``, ``/v1/models``, ``/generate``, ``/v1/completions``, ``/v1/chat/completions``,
``/start_profile``, ``/stop_profile``, and appends every request it receives (its role and port, the path, the JSON
body) to ``$DSV4_SM120_STANDIN_RECORD`` (JSONL) when set.

Failure injection (for orchestration tests), each applying to the role named in
``DSV4_SM120_STANDIN_ROLE`` (``prefill``/``decode``; empty = both):
  DSV4_SM120_STANDIN_FAIL_AT_START=1      exit 3 before binding anything
  DSV4_SM120_STANDIN_EXIT_AFTER_S=<s>     exit 4 after s seconds of serving
  DSV4_SM120_STANDIN_STARTUP_S=<s>        answer /health with 503 for the first s seconds
  DSV4_SM120_STANDIN_EXIT_WHEN_FILE=<path> exit 4 as soon as <path> exists
  DSV4_SM120_STANDIN_UNHEALTHY_WHEN_FILE=<path> answer /health with 503 while <path> exists (a hung server)
  DSV4_SM120_STANDIN_CHILD_PIDFILE=<path> start a `sleep 300` helper in our process group, its pid in <path>
                                    (it outlives a crashed stand-in: teardown must find it by group)
  DSV4_SM120_STANDIN_TRACE_TP=<n>         on /start_profile, write n synthetic per-rank trace files (rehearses
                                    the capture plumbing of bench/profile_capture.py; not measurements)
  DSV4_SM120_STANDIN_FIRST_GENERATE_S=<s> the first generation request waits s seconds (a transport cold start,
                                    what the supervisor's warm-up absorbs before READY)
  DSV4_SM120_STANDIN_FAIL_GENERATE=1      answer generation requests with HTTP 500 (a broken KV transfer)
  DSV4_SM120_STANDIN_EXIT_ON_STREAM=1     exit 4 on the first streamed generation request (a server dying
                                    under load, e.g. during `make measure`)

Greedy requests (``/generate``, not streamed, ``sampling_params.temperature`` 0) get a deterministic
token stream on the decode side: ``max_new_tokens`` ids derived from the prompt (``greedy_ids``), text
``w<id>`` words, so two deployments answer the same prompt identically. For ``make verify``'s tests:
  DSV4_SM120_STANDIN_DIVERGE_AT=<k>       when the overlay is on (DSV4_SM120_DISABLE unset or 0, i.e. "our"
                                    paths), the greedy stream differs from the stock one from token k on
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import List, Optional

from .. import settings

_lock = threading.Lock()
_first_generate = {"pending": True}


def _record(entry: dict) -> None:
    path = settings.get("DSV4_SM120_STANDIN_RECORD")
    if not path:
        return
    line = json.dumps(entry, sort_keys=True) + "\n"
    with _lock, open(path, "a") as f:
        f.write(line)
        f.flush()


def _write_synthetic_traces(body: dict, tp: int) -> None:
    """Rehearsal of SGLang's profiler output: ``<profile_id>-TP-<r>.trace.json.gz`` per rank, written
    after a short delay into the requested ``output_dir`` (else ``SGLANG_TORCH_PROFILER_DIR``). The
    kernels are a fixed synthetic decode step (names only; these are not measurements)."""
    import gzip

    out = body.get("output_dir") or os.environ.get("SGLANG_TORCH_PROFILER_DIR") or "."
    pid = body.get("profile_id") or str(int(time.time()))
    steps = int(body.get("num_steps") or 5)
    step = [("_dsv4_split_kernel", 30.0), ("_dsv4_combine_kernel", 4.0), ("_gemm1_kernel", 25.0),
            ("_gemm2_kernel", 15.0), ("_w8a8_block_fp8_matmul", 12.0),
            ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 9.0), ("FusedAddRMSNormKernel", 2.0)]
    time.sleep(0.5)
    os.makedirs(out, exist_ok=True)
    for r in range(tp):
        ev, t = [], 0.0
        for _ in range(steps):
            for name, dur in step:
                ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": t, "dur": dur, "pid": r, "tid": 7})
                t += dur + 1.0
        prefix = (body.get("profile_prefix") + "-") if body.get("profile_prefix") else ""
        final = os.path.join(out, f"{prefix}{pid}-TP-{r}.trace.json.gz")
        tmp = final + ".part"
        with open(tmp, "wb") as f:
            f.write(gzip.compress(json.dumps({"traceEvents": ev}).encode()))
        os.replace(tmp, final)


def greedy_ids(prompt: str, n: int, diverge_at: int = -1) -> List[int]:
    """The stand-in's greedy answer to ``prompt``: ``n`` ids in [0, 2000), each a hash of the prompt and its
    position; from position ``diverge_at`` on (when >= 0) the hash also takes a salt, so the stream differs."""
    out = []
    for i in range(n):
        salt = "ours" if 0 <= diverge_at <= i else ""
        h = hashlib.sha256(f"{prompt}\x00{i}\x00{salt}".encode()).digest()
        out.append(int.from_bytes(h[:4], "big") % 2000)
    return out


def _greedy_answer(body: dict) -> Optional[dict]:
    """Decode side of a greedy /generate (module doc), or None when the request is not greedy."""
    sp = body.get("sampling_params") or {}
    if body.get("stream") or sp.get("temperature") is None or float(sp.get("temperature")) != 0.0:
        return None
    prompt = body.get("text") if body.get("text") is not None else json.dumps(body.get("input_ids"))
    if isinstance(prompt, list):        # a batch: not used by the callers of this hook
        return None
    n = max(1, min(int(sp.get("max_new_tokens") or 16), 4096))
    diverge = settings.get("DSV4_SM120_STANDIN_DIVERGE_AT") if not settings.get("DSV4_SM120_DISABLE") else -1
    ids = greedy_ids(str(prompt), n, diverge)
    meta = {"id": str(body.get("bootstrap_room", "")), "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": len(str(prompt).split()), "completion_tokens": n, "cached_tokens": 0,
            "e2e_latency": 0.001}
    return {"text": "".join(f" w{i}" for i in ids), "output_ids": ids, "meta_info": meta}


class StandinHandler(BaseHTTPRequestHandler):
    """The stand-in's HTTP answers; :func:`make_handler` makes a subclass with the server's facts set."""
    role = "decode"
    model = served = unhealthy_file = ""
    ready_at = 0.0
    args: argparse.Namespace = argparse.Namespace()
    mine = True
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *a):  # one line per request on stderr -> the role's log
        sys.stderr.write(f"[standin {self.role}] {self.command} {self.path} -> {fmt % a}\n")

    def _send(self, code: int, obj=None, ctype="application/json", raw: Optional[bytes] = None):
        body = raw if raw is not None else json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self):
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            return {"_raw": raw.decode(errors="replace")}

    def do_GET(self):
        path = self.path.split("?")[0]
        _record({"role": self.role, "port": self.server.server_address[1], "method": "GET", "path": path,
                 "t": time.time()})
        if path in ("/health", "/health_generate", "/ping"):
            if time.time() < self.ready_at:
                return self._send(503, {"status": "starting"})
            if self.unhealthy_file and os.path.exists(self.unhealthy_file):
                return self._send(503, {"status": "unhealthy (standin, as asked)"})
            return self._send(200, raw=b"", ctype="text/plain")
        if path in ("/get_model_info", "/model_info"):
            return self._send(200, {"model_path": self.model, "tokenizer_path": self.model, "is_generation": True,
                                    "preferred_sampling_params": None, "weight_version": "standin",
                                    "has_image_understanding": False, "has_audio_understanding": False,
                                    "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"]})
        if path in ("/server_info", "/get_server_info"):
            return self._send(200, {"disaggregation_mode": self.role, "tp_size": self.args.tp,
                                    "disaggregation_bootstrap_port": self.args.disaggregation_bootstrap_port,
                                    "model_path": self.model, "standin": True, "internal_states": [{}]})
        if path == "/v1/models":
            return self._send(200, {"object": "list", "data": [{"id": self.served, "object": "model",
                                                                "owned_by": "standin", "root": self.model}]})
        if path == "/get_load":
            return self._send(200, [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}])
        return self._send(404, {"error": f"standin: no GET {path}"})

    def do_POST(self):
        path = self.path.split("?")[0]
        body = self._body()
        _record({"role": self.role, "port": self.server.server_address[1], "method": "POST", "path": path,
                 "body": body, "t": time.time()})
        if path == "/start_profile":
            tp = settings.get("DSV4_SM120_STANDIN_TRACE_TP")
            if tp:
                threading.Thread(target=_write_synthetic_traces, args=(body, tp), daemon=True).start()
            return self._send(200, raw=b"Start profiling.\n", ctype="text/plain")
        if path in ("/stop_profile", "/flush_cache"):
            return self._send(200, raw=b"OK", ctype="text/plain")
        if path not in ("/generate", "/v1/completions", "/v1/chat/completions"):
            return self._send(404, {"error": f"standin: no POST {path}"})
        if self.mine and settings.get("DSV4_SM120_STANDIN_FAIL_GENERATE"):
            return self._send(500, {"error": "standin: KV transfer failed (DSV4_SM120_STANDIN_FAIL_GENERATE=1)"})
        first_wait = settings.get("DSV4_SM120_STANDIN_FIRST_GENERATE_S") if self.mine else 0.0
        with _lock:
            first, _first_generate["pending"] = _first_generate["pending"], False
        if first and first_wait:
            time.sleep(first_wait)
        if (body.get("stream") and self.mine and self.role == "decode"
                and settings.get("DSV4_SM120_STANDIN_EXIT_ON_STREAM")):
            print(f"[standin {self.role}] exiting with code 4 on a streamed request as asked", file=sys.stderr,
                  flush=True)
            os._exit(4)
        if path == "/generate" and self.role == "decode":
            greedy = _greedy_answer(body)
            if greedy is not None:
                return self._send(200, greedy)
        text = "" if self.role == "prefill" else "standin decode output"
        meta = {"id": str(body.get("bootstrap_room", "")), "finish_reason": {"type": "length", "length": 4},
                "prompt_tokens": 4, "completion_tokens": 0 if self.role == "prefill" else 4, "cached_tokens": 0,
                "e2e_latency": 0.001}
        if path == "/generate":
            obj = {"text": text, "output_ids": [] if self.role == "prefill" else [1, 2, 3, 4], "meta_info": meta}
        elif path == "/v1/completions":
            obj = {"id": "cmpl-standin", "object": "text_completion", "created": int(time.time()), "model": self.served,
                   "choices": [{"index": 0, "text": text, "finish_reason": "length", "logprobs": None}],
                   "usage": {"prompt_tokens": 4, "completion_tokens": meta["completion_tokens"],
                             "total_tokens": 4 + meta["completion_tokens"]}}
        else:
            obj = {"id": "chatcmpl-standin", "object": "chat.completion", "created": int(time.time()),
                   "model": self.served, "choices": [{"index": 0, "finish_reason": "length",
                                                 "message": {"role": "assistant", "content": text}}],
                   "usage": {"prompt_tokens": 4, "completion_tokens": meta["completion_tokens"],
                             "total_tokens": 4 + meta["completion_tokens"]}}
        if body.get("stream") and path == "/generate" and self.role == "decode":
            return self._stream_generate(body, meta)
        if body.get("stream"):
            data = f"data: {json.dumps(obj)}\n\ndata: [DONE]\n\n".encode()
            return self._send(200, raw=data, ctype="text/event-stream")
        return self._send(200, obj)

    def _stream_generate(self, body, meta):
        """Decode side, streaming: one SSE chunk per token, DSV4_SM120_STANDIN_TOKEN_S apart (default 2 ms)."""
        n = int((body.get("sampling_params") or {}).get("max_new_tokens") or 16)
        n = max(1, min(n, 4096))
        gap = settings.get("DSV4_SM120_STANDIN_TOKEN_S")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(b: bytes) -> None:
            self.wfile.write(f"{len(b):x}\r\n".encode() + b + b"\r\n")
            self.wfile.flush()

        text = ""
        for i in range(1, n + 1):
            if gap:
                time.sleep(gap)
            text += " t"
            m = dict(meta, completion_tokens=i,
                     finish_reason={"type": "length", "length": n} if i == n else None)
            chunk(f"data: {json.dumps({'text': text, 'output_ids': [i], 'meta_info': m})}\n\n".encode())
        chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def make_handler(role: str, model: str, served: str, ready_at: float, args: argparse.Namespace,
                 unhealthy_file: str = "", mine: bool = True):
    return type("H", (StandinHandler,), {"role": role, "model": model, "served": served, "ready_at": ready_at,
                                         "args": args, "unhealthy_file": unhealthy_file, "mine": mine})


_stop_requested = 0     # the signal that asked the stand-in to stop (0: none yet)


def _on_stop_signal(signum, _frame) -> None:
    global _stop_requested
    _stop_requested = signum


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_sm120.serving.standin",
                                 description="Stand-in for an SGLang server: answers health checks and records requests.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--disaggregation-mode", default="null")
    ap.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    ap.add_argument("--model-path", default="standin")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--numa-node", type=int, nargs="+", default=None)
    args, _unknown = ap.parse_known_args(argv)
    role = args.disaggregation_mode

    target = settings.get("DSV4_SM120_STANDIN_ROLE")
    mine = target in ("", role)
    if mine and settings.get("DSV4_SM120_STANDIN_FAIL_AT_START"):
        print(f"[standin {role}] failing at start as asked (DSV4_SM120_STANDIN_FAIL_AT_START=1)", file=sys.stderr)
        return 3
    startup = settings.get("DSV4_SM120_STANDIN_STARTUP_S") if mine else 0.0
    exit_after = settings.get("DSV4_SM120_STANDIN_EXIT_AFTER_S") if mine else 0.0
    exit_file = settings.get("DSV4_SM120_STANDIN_EXIT_WHEN_FILE") if mine else ""

    child_pidfile = settings.get("DSV4_SM120_STANDIN_CHILD_PIDFILE") if mine else ""
    if child_pidfile:  # a helper process in our group that outlives us if we die (like a worker subprocess)
        import subprocess
        helper = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL)
        with open(child_pidfile, "w") as f:
            f.write(str(helper.pid))

    served = args.served_model_name or args.model_path
    unhealthy = settings.get("DSV4_SM120_STANDIN_UNHEALTHY_WHEN_FILE") if mine else ""
    handler = make_handler(role, args.model_path, served, time.time() + startup, args, unhealthy, mine)
    servers = [ThreadingHTTPServer((args.host, args.port), handler)]
    if role == "prefill":
        servers.append(ThreadingHTTPServer((args.host, args.disaggregation_bootstrap_port), handler))
    for s in servers:
        s.daemon_threads = True
        threading.Thread(target=s.serve_forever, daemon=True).start()
    print(f"[standin {role}] serving on {args.host}:{args.port}"
          f"{' + bootstrap ' + str(args.disaggregation_bootstrap_port) if role == 'prefill' else ''} (pid {os.getpid()})",
          file=sys.stderr, flush=True)

    # The handlers only set a flag: a signal handler that takes a lock (threading.Event.set) deadlocks when the
    # signal arrives while this thread holds that lock, and the process then ignores SIGTERM until SIGKILL.
    signal.signal(signal.SIGTERM, _on_stop_signal)
    signal.signal(signal.SIGINT, _on_stop_signal)
    t0 = time.time()
    while not _stop_requested:
        time.sleep(0.05)
        if exit_after and time.time() - t0 >= exit_after:
            print(f"[standin {role}] exiting with code 4 after {exit_after:g} s as asked", file=sys.stderr, flush=True)
            os._exit(4)
        if exit_file and os.path.exists(exit_file):
            print(f"[standin {role}] exiting with code 4: {exit_file} exists", file=sys.stderr, flush=True)
            os._exit(4)
    for s in servers:
        s.shutdown()
    print(f"[standin {role}] stopped", file=sys.stderr, flush=True)
    # handler threads may still be writing to clients: exit now rather than wait for them in the interpreter's
    # shutdown
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
