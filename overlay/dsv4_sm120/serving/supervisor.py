"""Start the parts of a plan, wait for health, supervise, tear down, stop.

All-or-nothing: if any part dies or does not become healthy in time (during start or later),
everything is torn down (SIGTERM to each part's process group and descendants, SIGKILL after
``STOP_GRACE_S``) and the supervisor exits non-zero. Each part runs in its own session /
process group with PDEATHSIG=SIGTERM, so even a SIGKILLed supervisor leaves no orphans.

State lives in ``RUN_DIR/state.json`` (written atomically): supervisor pid, status
(starting | ready | failed | stopping | stopped), and each part's pid, pgid and start time.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .. import settings
from ..fileio import atomic_write_text
from ..paths import caller_environ
from .plan import Plan
from .topology import apply_binding

POLL_S = settings.get("DSV4_SM120_SERVE_POLL_S")


LOG_FILE: Optional[str] = None   # foreground runs also keep their messages in RUN_DIR/supervisor.log


def say(msg: str) -> None:
    line = f"[serve] {msg}"
    print(line, flush=True)
    if LOG_FILE:
        try:
            with open(LOG_FILE, "a") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
        except OSError:
            pass


def read_state(run_dir: Path) -> Optional[dict]:
    try:
        return json.loads((run_dir / "state.json").read_text())
    except (OSError, ValueError):
        return None


def proc_start_time(pid: int) -> Optional[str]:
    """Field 22 of /proc/PID/stat (start time in clock ticks): identifies a pid across reuse."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rfind(")") + 2:].split()
    return rest[19] if len(rest) > 19 else None


def is_alive(pid: int, start: Optional[str] = None) -> bool:
    st = proc_start_time(pid)
    if st is None:
        return False
    if start is not None and st != start:
        return False
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        if raw[raw.rfind(")") + 2:].split()[0] == "Z":
            return False
    except OSError:
        return False
    return True


def descendants(pid: int) -> List[int]:
    """All live descendants of pid (by walking /proc ppid links)."""
    children: Dict[int, List[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            raw = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        ppid = int(raw[raw.rfind(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _pdeathsig() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _child_setup(numa: Optional[dict]) -> Callable[[], None]:
    """preexec_fn of a part: PDEATHSIG, and for a server with a NUMA node its CPU / memory binding
    (inherited by every process the server starts; see topology.apply_binding)."""
    def setup() -> None:
        _pdeathsig()
        if numa and numa.get("node") is not None:
            apply_binding(numa.get("cpus") or [], numa["node"])
    return setup


WARMUP_PROMPT = ("Warm-up request of the dsv4_sm120 deployment: it moves this prompt's KV pages from the "
                 "prefill server to the decode server once, so the transport's cold start is paid here. ") * 12


def warmup_request(router_url: str, timeout_s: float) -> Tuple[bool, float, str]:
    """One real /generate through the router (prefill, KV transfer, one decode step).
    Returns (ok, seconds, detail)."""
    body = json.dumps({"text": WARMUP_PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
                       "rid": f"dsv4-warmup-{os.getpid()}-{int(time.time())}"}).encode()
    req = urllib.request.Request(router_url.rstrip("/") + "/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read()
            code = r.status
    except urllib.error.HTTPError as e:
        detail = e.read()[:300].decode(errors="replace").strip()
        return False, time.monotonic() - t0, f"HTTP {e.code}: {detail}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return False, time.monotonic() - t0, f"{type(reason).__name__}: {reason}"
    dt = time.monotonic() - t0
    try:
        out = json.loads(raw)
    except ValueError:
        return False, dt, f"HTTP {code} with a body that is not JSON: {raw[:120]!r}"
    if not isinstance(out, dict) or "text" not in out:
        return False, dt, f"HTTP {code} without generated text: {raw[:200]!r}"
    return True, dt, ""


def http_ok(url: str, timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= r.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def tail(path: str, n: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + x for x in lines[-n:])


def kill_tree(targets: List[Tuple], grace_s: float, log: Callable[[str], None] = say) -> bool:
    """SIGTERM each target with its process group and descendants; SIGKILL what is left after grace_s.

    A target is ``(pid, start)`` or ``(pid, start, pgid)``; with a recorded pgid the group's members
    are stopped even when the target itself already exited (its children were re-parented).
    Returns True when nothing is left alive."""
    victims: Dict[int, Optional[str]] = {}
    groups = set()
    for t in targets:
        pid, start = t[0], t[1]
        pgid = t[2] if len(t) > 2 else None
        if pgid:
            groups.add(pgid)
        if not is_alive(pid, start):
            continue
        victims[pid] = start
        for d in descendants(pid):
            victims.setdefault(d, proc_start_time(d))
        try:
            groups.add(os.getpgid(pid))
        except OSError:
            pass
    me = os.getpgid(0)
    groups.discard(me)
    # Members of the groups that are not descendants (re-parented to init) are victims too.
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getpgid(int(d)) in groups:
                    victims.setdefault(int(d), proc_start_time(int(d)))
            except OSError:
                pass
    victims.pop(os.getpid(), None)
    if not victims:
        return True
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for g in groups:
            try:
                os.killpg(g, sig)
            except OSError:
                pass
        for pid, start in victims.items():
            if is_alive(pid, start):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 10.0)
        while time.monotonic() < deadline:
            _reap()
            if not any(is_alive(p, s) for p, s in victims.items()):
                return True
            time.sleep(0.1)
        if sig == signal.SIGTERM:
            left = [p for p, s in victims.items() if is_alive(p, s)]
            log(f"{len(left)} process(es) still alive {grace_s:g} s after SIGTERM: SIGKILL {left[:8]}")
    _reap()
    return not any(is_alive(p, s) for p, s in victims.items())


def group_members(pgid: int) -> List[int]:
    """Live processes whose process group is pgid."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getpgid(int(d)) == pgid and is_alive(int(d)):
                    out.append(int(d))
            except OSError:
                pass
    return out


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class Supervisor:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.run_dir = Path(plan.run_dir)
        self.children: Dict[str, subprocess.Popen] = {}
        self.starts: Dict[str, Optional[str]] = {}
        self.status = "starting"
        self.stop_requested: Optional[int] = None
        self.grace = float(plan.settings["STOP_GRACE_S"])
        self.message = ""
        self.warmup_s: Optional[float] = None

    # -- state --------------------------------------------------------------
    def write_state(self) -> None:
        st = {"supervisor_pid": os.getpid(), "supervisor_start": proc_start_time(os.getpid()),
              "status": self.status, "message": self.message, "variant": self.plan.variant,
              "roles": self.plan.roles, "urls": self.plan.urls, "run_dir": str(self.run_dir),
              "updated": time.time(), "standin": self.plan.standin, "warmup_s": self.warmup_s,
              "procs": [{"role": self.part(r).role, "name": r, "pid": p.pid, "pgid": p.pid,
                         "start": self.starts.get(r), "log": self.part(r).log, "health_url": self.part(r).health_url}
                        for r, p in self.children.items()]}
        atomic_write_text(self.run_dir / "state.json", json.dumps(st, indent=2) + "\n")

    def part(self, label: str):
        """The plan's part named ``label`` (``Proc.label``: its role, or decode2 etc. for replicas)."""
        return next(x for x in self.plan.procs if x.label == label)

    def _signal(self, signum, _frame) -> None:
        self.stop_requested = signum

    # -- lifecycle ----------------------------------------------------------
    def child_env(self, extra: Dict[str, str], unset: Sequence[str] = ()) -> Dict[str, str]:
        """A part's environment: the caller's, serve/env/*.env, then the part's own (``extra``); the names in
        ``unset`` removed (a server whose all-reduce choice forces no NCCL protocol drops an inherited one)."""
        # the launcher's own PYTHONPATH addition (the repo overlay) does not leak into SGLang
        env = caller_environ()
        if self.plan.standin:
            ov = str(Path(self.plan.repo) / "overlay")
            env["PYTHONPATH"] = ov + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        for k, v, _ in self.plan.common_env:
            env[k] = v
        env.update(extra)
        for k in ("DSV4_SM120_ORIG_PYTHONPATH", "DRY_RUN", "DETACH", *unset):
            env.pop(k, None)
        return env

    def start(self, role: str) -> None:
        """Start the part named ``role`` (its label)."""
        p = self.part(role)
        if p.env.get("SGLANG_TORCH_PROFILER_DIR"):
            Path(p.env["SGLANG_TORCH_PROFILER_DIR"]).mkdir(parents=True, exist_ok=True)
        logf = open(p.log, "ab", buffering=0)
        logf.write(f"[serve] {time.strftime('%Y-%m-%d %H:%M:%S')} starting {role}: {' '.join(p.argv)}\n".encode())
        child = subprocess.Popen(p.argv, env=self.child_env(p.env, p.unset), stdin=subprocess.DEVNULL, stdout=logf,
                                 stderr=subprocess.STDOUT, cwd=str(self.run_dir), start_new_session=True,
                                 preexec_fn=_child_setup(p.numa))
        logf.close()
        self.children[role] = child
        self.starts[role] = proc_start_time(child.pid)
        self.write_state()
        say(f"started {role} (pid {child.pid}), log {p.log}")
        if p.numa:
            say(f"{role} NUMA placement: {p.numa.get('text', '')}")

    def dead_child(self) -> Optional[Tuple[str, int]]:
        for role, c in self.children.items():
            rc = c.poll()
            if rc is not None:
                return role, rc
        return None

    def wait_healthy(self, urls: Dict[str, str], timeout_s: float) -> Optional[str]:
        """None when every url answers 2xx; else the failure line."""
        pending = dict(urls)
        t0 = time.monotonic()
        last_note = t0
        while pending:
            if self.stop_requested:
                return "stop requested during startup"
            dead = self.dead_child()
            if dead:
                return f"{dead[0]} exited with code {dead[1]} during startup"
            for role, url in list(pending.items()):
                if http_ok(url):
                    say(f"{role} healthy after {time.monotonic() - t0:.0f} s ({url})")
                    pending.pop(role)
            if not pending:
                break
            now = time.monotonic()
            if now - t0 > timeout_s:
                return f"{', '.join(pending)} not healthy after {timeout_s:g} s (HEALTH_TIMEOUT_S)"
            if now - last_note > 60:
                say(f"waiting for {', '.join(pending)} ({now - t0:.0f} s)")
                last_note = now
            time.sleep(POLL_S)
        return None

    def fail(self, line: str, role: Optional[str] = None) -> int:
        self.status = "failed"
        self.message = line
        self.write_state()
        say(f"FAILED: {line}")
        roles = [role] if role else [r for r in self.children]
        for r in roles:
            log = next((x.log for x in self.plan.procs if x.label == r), None)
            if log:
                say(f"last lines of {log}:\n{tail(log)}")
        self.teardown()
        self.status = "failed"
        self.write_state()
        return 1

    def teardown(self) -> None:
        if not self.children:
            return
        say(f"tearing down {', '.join(reversed(list(self.children)))}")
        targets = [(c.pid, self.starts.get(r), c.pid) for r, c in reversed(list(self.children.items()))]
        clean = kill_tree(targets, self.grace)
        for c in self.children.values():
            try:
                c.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        say("all parts stopped" if clean else "WARNING: some processes survived SIGKILL")

    def run(self) -> int:
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, self._signal)
        self.write_state()
        timeout = float(self.plan.settings["HEALTH_TIMEOUT_S"])
        servers = [p.label for p in self.plan.procs if p.role != "router"]
        try:
            for r in servers:
                self.start(r)
            urls = {p.label: p.health_url for p in self.plan.procs if p.label in servers}
            if "router" in self.plan.roles:
                urls.update(self.plan.remote_health)   # multi-node: the router waits for the other host's parts
            err = self.wait_healthy(urls, timeout)
            if err:
                return self._startup_failure(err)
            if "router" in self.plan.roles:
                self.start("router")
                err = self.wait_healthy({"router": next(p.health_url for p in self.plan.procs
                                                        if p.role == "router")}, timeout)
                if err:
                    return self._startup_failure(err)
                err = self.warmup()
                if err:
                    return self._startup_failure(err)
        except OSError as e:
            return self.fail(f"could not start a part: {e}")
        self.status = "ready"
        self.write_state()
        say(f"READY: {', '.join(self.plan.roles)}"
            + (f"; router at {self.plan.urls['router']}" if "router" in self.plan.roles else "")
            + f"; run dir {self.run_dir}; stop with serve/stop.sh")
        return self.supervise()

    def warmup(self) -> Optional[str]:
        """One real prefill-to-decode request through the router before READY (``WARMUP``), so no user
        request pays the KV transport's cold start (UCX endpoint and memory-handle setup). Its time goes
        to the log and to state.json (``warmup_s``). None = done or off; else the failure line."""
        setting = self.plan.value("WARMUP")           # "auto", True or False
        if setting is False or (setting == "auto" and self.plan.standin):
            return None
        timeout = float(self.plan.settings.get("WARMUP_TIMEOUT_S") or 600)
        self.message = "warm-up request in flight"
        self.write_state()
        say(f"warm-up: one request through the router (prefill -> KV transfer -> decode), up to {timeout:g} s")
        result: Dict[str, object] = {}

        def go() -> None:
            result["r"] = warmup_request(self.plan.urls["router"], timeout)

        t = threading.Thread(target=go, daemon=True)
        t.start()
        while t.is_alive():
            t.join(POLL_S)
            if self.stop_requested:
                return "stop requested during the warm-up"
            dead = self.dead_child()
            if dead:
                return f"{dead[0]} exited with code {dead[1]} during the warm-up request"
        ok, dt, detail = result["r"]
        if not ok:
            return (f"warm-up request through the router failed after {dt:.1f} s ({detail}): the prefill-to-decode "
                    f"KV transfer does not work; see the prefill and decode logs (UCX_NET_DEVICES, UCX_TLS, "
                    f"docs/pcie.md); WARMUP=0 starts without it")
        self.warmup_s = round(dt, 2)  # the log line and state.json say the same number
        self.message = ""
        say(f"warm-up: first prefill-to-decode request through the router took {self.warmup_s:.2f} s")
        return None

    def _startup_failure(self, err: str) -> int:
        if self.stop_requested:
            return self._stop()
        dead = self.dead_child()
        return self.fail(err, dead[0] if dead else None)

    def supervise(self) -> int:
        fails_allowed = int(self.plan.settings["SUPERVISE_HEALTH_FAILS"])
        every = float(self.plan.settings["SUPERVISE_HEALTH_EVERY_S"])
        fails: Dict[str, int] = {}
        next_check = time.monotonic() + every
        while True:
            if self.stop_requested:
                return self._stop()
            dead = self.dead_child()
            if dead:
                return self.fail(f"{dead[0]} (pid {self.children[dead[0]].pid}) exited with code {dead[1]}", dead[0])
            if fails_allowed and time.monotonic() >= next_check:
                next_check = time.monotonic() + every
                for p in self.plan.procs:
                    fails[p.label] = 0 if http_ok(p.health_url, timeout=10) else fails.get(p.label, 0) + 1
                    if fails[p.label] >= fails_allowed:
                        return self.fail(f"{p.label} failed {fails[p.label]} health checks in a row ({p.health_url})",
                                         p.label)
            time.sleep(POLL_S)

    def _stop(self) -> int:
        self.status = "stopping"
        self.message = f"signal {self.stop_requested}"
        self.write_state()
        say(f"stop requested (signal {self.stop_requested})")
        self.teardown()
        self.status = "stopped"
        self.write_state()
        return 0


def stop_run(run_dir: Path, grace_s: float) -> int:
    """serve/stop.sh: stop the supervisor (it tears down), then make sure every recorded part is gone."""
    st = read_state(run_dir)
    if st is None:
        say(f"no deployment state in {run_dir} (nothing to stop)")
        return 0
    sup, sup_start = st.get("supervisor_pid"), st.get("supervisor_start")
    parts = [(p["pid"], p.get("start"), p.get("pgid")) for p in st.get("procs", [])]
    alive_parts = [p for p in parts if is_alive(p[0], p[1]) or (p[2] and group_members(p[2]))]
    if sup and is_alive(sup, sup_start):
        say(f"stopping the deployment in {run_dir} (supervisor pid {sup})")
        os.kill(sup, signal.SIGTERM)
        deadline = time.monotonic() + grace_s + 20
        while time.monotonic() < deadline and is_alive(sup, sup_start):
            time.sleep(0.1)
        if is_alive(sup, sup_start):
            say(f"supervisor {sup} did not exit: SIGKILL")
            kill_tree([(sup, sup_start)], 0.5)
    elif not alive_parts:
        say(f"nothing running in {run_dir} (last status: {st.get('status')})")
        return 0
    left = [p for p in parts if is_alive(p[0], p[1]) or (p[2] and group_members(p[2]))]
    if left:
        say(f"{len(left)} part(s) still running: stopping them directly")
    ok = kill_tree(left, grace_s)
    if not ok:
        say("ERROR: some processes survived SIGKILL")
        return 1
    say("stopped")
    return 0
