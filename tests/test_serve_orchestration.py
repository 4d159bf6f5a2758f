"""Orchestration of serve/serve_dsv4_tp4.sh with stand-in servers (DSV4_SM120_SERVE_STANDIN=1) and the real router.

All-or-nothing start, teardown when a part dies at start or later (non-zero exit), a busy
port refused before anything starts, a killed supervisor leaving no orphans. (A detached start,
serving through the router and stop.sh leaving nothing behind: tests/test_router_pd.py.)
Loopback only; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVE = REPO / "serve"
VENV = str(Path(sys.executable).parent.parent)
SITE = Path(__file__).resolve().parent / "site"     # tests/site/sitecustomize.py: the router skips an import


def free_ports(n):
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


REPLICAS = 2     # ports held per server port variable: replica i of a server listens on the variable's port + i


def hold_ports(socks, n, k=1):
    """``n`` blocks of ``k`` consecutive ports, each port held by a socket that never listens (appended to ``socks``,
    which the caller closes); the blocks' first ports. Each is bound first without SO_REUSEADDR (which fails on a
    port anything else holds, another test's held ports included), then given SO_REUSEADDR: the stand-ins, the router
    and the preflight's port check bind with SO_REUSEADDR too, so they take a held port, while nothing else on the box
    does in between (bind(0) and outgoing connections skip a bound port), as it could a port found free and
    released. Blocks are picked below the ephemeral range."""
    import random

    firsts = []
    while len(firsts) < n:
        base = random.randrange(20000, 32000 - k)
        mine = []
        try:
            for port in range(base, base + k):
                sk = socket.socket()
                mine.append(sk)
                sk.bind(("127.0.0.1", port))
                sk.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        except OSError:
            for sk in mine:
                sk.close()
            continue
        socks.extend(mine)
        firsts.append(base)
    return firsts


@pytest.fixture
def env(tmp_path):
    socks = []
    pp, bp, dp = hold_ports(socks, 3, REPLICAS)
    rp, mp = hold_ports(socks, 2)
    e = {k: v for k, v in os.environ.items() if not k.startswith(("DSV4_SM120_STANDIN_", "PREFILL_", "DECODE_", "ROUTER_"))}
    e.update({
        "VENV": VENV, "DSV4_SM120_SERVE_STANDIN": "1", "LOG_DIR": str(tmp_path / "logs"),
        "PREFILL_PORT": str(pp), "BOOTSTRAP_PORT": str(bp), "DECODE_PORT": str(dp),
        "ROUTER_PORT": str(rp), "ROUTER_PROMETHEUS_PORT": str(mp),
        "STOP_GRACE_S": "5", "HEALTH_TIMEOUT_S": "90", "DSV4_SM120_SERVE_POLL_S": "0.2",
        "DSV4_SM120_STANDIN_RECORD": str(tmp_path / "requests.jsonl"),
        # this test's own record of running deployments (serving/runs.py): a stop without a run directory
        # never finds another test's deployment
        "DSV4_SM120_CACHE": str(tmp_path / "cache"),
    })
    for k in ("DRY_RUN", "DETACH", "RUN_DIR", "NODE_ROLE", "PREFLIGHT_SKIP"):
        e.pop(k, None)
    # every Python process of the deployment starts with tests/site's hook: the router launcher skips importing
    # SGLang for a module the pinned SGLang lacks (~8 s of CPU per start; tests/test_site_hooks.py)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (e.get("PYTHONPATH", ""), str(SITE)) if p)
    try:
        yield e
    finally:
        for sk in socks:
            sk.close()


def state(env):
    latest = Path(env["LOG_DIR"]) / "latest"
    return json.loads((latest / "state.json").read_text())


def start_time(pid):
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2:].split()
    return None if fields[0] == "Z" else fields[19]


def tree(pid):
    """pid and its live descendants, with start times."""
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                raw = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            kids.setdefault(int(raw[raw.rfind(")") + 2:].split()[1]), []).append(int(d))
    out, todo = [pid], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return {p: start_time(p) for p in out if start_time(p)}


def all_run_processes(st):
    procs = {}
    procs.update(tree(st["supervisor_pid"]))
    for p in st["procs"]:
        procs.update(tree(p["pid"]))
    return procs


def wait_gone(procs, timeout=20.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        alive = {p: s for p, s in procs.items() if start_time(p) == s}
        if not alive:
            return {}
        time.sleep(0.1)
    return alive


def port_free(port):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # TIME_WAIT is not "in use"
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@contextlib.contextmanager
def serving(env, out_path, wait_s=90, **extra):
    """serve_dsv4_tp4.sh started with ``env`` and ``extra`` (its output in ``out_path``), given as ``(process, state)``
    once the run's state says ready (within ``wait_s``); killed on the way out if it still runs."""
    out = open(out_path, "w")
    proc = subprocess.Popen(["bash", str(SERVE / "serve_dsv4_tp4.sh")], stdout=out, stderr=subprocess.STDOUT,
                            env=dict(env, **extra))
    try:
        t0, st = time.monotonic(), None
        while time.monotonic() - t0 < wait_s:
            try:
                st = state(env)
                if st["status"] == "ready":
                    break
            except (OSError, ValueError):
                pass
            assert proc.poll() is None, Path(out_path).read_text()
            time.sleep(0.2)
        assert st and st["status"] == "ready", Path(out_path).read_text()
        yield proc, st
    finally:
        if proc.poll() is None:
            proc.kill()
        out.close()


def run_script(env, script="serve_dsv4_tp4.sh", extra=None, timeout=120):
    e = dict(env, **(extra or {}))
    return subprocess.run(["bash", str(SERVE / script)], capture_output=True, text=True, env=e, timeout=timeout)


def test_child_dying_at_start_tears_everything_down(env):
    r = run_script(env, extra={"DSV4_SM120_STANDIN_ROLE": "decode", "DSV4_SM120_STANDIN_FAIL_AT_START": "1"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "decode exited with code 3 during startup" in r.stdout
    assert "failing at start as asked" in r.stdout          # the decode log's tail is shown
    st = state(env)
    assert st["status"] == "failed"
    assert [p["role"] for p in st["procs"]] == ["prefill", "decode"]   # router never started
    for p in st["procs"]:
        assert start_time(p["pid"]) != p["start"] or start_time(p["pid"]) is None, p
    assert port_free(int(env["PREFILL_PORT"])) and port_free(int(env["BOOTSTRAP_PORT"]))


def test_child_dying_later_tears_everything_down(env, tmp_path):
    trigger = tmp_path / "die-now"
    helper_pidfile = tmp_path / "helper.pid"
    with serving(env, tmp_path / "out.txt", DSV4_SM120_STANDIN_ROLE="prefill",
                 DSV4_SM120_STANDIN_EXIT_WHEN_FILE=str(trigger),
                 DSV4_SM120_STANDIN_CHILD_PIDFILE=str(helper_pidfile)) as (proc, st):
        procs = all_run_processes(st)
        helper = int(helper_pidfile.read_text())
        assert helper in procs                      # a worker-like helper in the prefill's process group
        trigger.touch()
        rc = proc.wait(timeout=60)
    text = (tmp_path / "out.txt").read_text()
    assert rc == 1, text
    assert "prefill (pid" in text and "exited with code 4" in text, text
    assert "tearing down router, decode" in text
    left = wait_gone(procs, 10)
    assert not left, f"processes left behind: {left}"   # includes the helper the dead prefill left behind
    assert state(env)["status"] == "failed"


def test_busy_port_is_refused_before_anything_starts(env):
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # beside the fixture's held, idle socket
    holder.bind(("127.0.0.1", int(env["DECODE_PORT"])))
    holder.listen(1)
    try:
        r = run_script(env, timeout=60)
    finally:
        holder.close()
    assert r.returncode == 1, r.stdout + r.stderr
    lines = [x for x in r.stderr.splitlines() if "preflight:" in x]
    assert len(lines) == 1 and f"port {env['DECODE_PORT']} on 127.0.0.1 (decode HTTP) is already in use" in lines[0]
    assert "nothing was started" in r.stderr and "Traceback" not in r.stderr
    assert not Path(env["LOG_DIR"]).exists() or not any(Path(env["LOG_DIR"]).glob("serve-*"))
    assert not Path(env["DSV4_SM120_STANDIN_RECORD"]).exists()    # no stand-in ever ran
    assert "started" not in r.stdout


def test_split_hosts_router_waits_for_remote_parts_and_killed_supervisor_leaves_no_orphans(env, tmp_path):
    """Multi-node on loopback: "host A" runs prefill+decode, "host B" (own LOG_DIR) only the router,
    which waits for A's parts, then serves through them. Killing A's supervisor (SIGKILL) takes its
    parts down (PDEATHSIG); stop.sh on both hosts leaves nothing."""
    env_b = dict(env, LOG_DIR=str(tmp_path / "host-b-logs"), NODE_ROLE="router", DETACH="1")
    # host B first: its router must wait until host A's servers answer
    b = subprocess.Popen(["bash", str(SERVE / "serve_dsv4_tp4.sh")], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env_b)
    try:
        a = run_script(env, extra={"DETACH": "1", "NODE_ROLE": "prefill,decode",
                                   "DSV4_SM120_STANDIN_STARTUP_S": "2"})
        assert a.returncode == 0, a.stdout + a.stderr
        out_b, _ = b.communicate(timeout=120)
        assert b.returncode == 0, out_b
        assert "prefill healthy" in out_b and "decode healthy" in out_b and "router healthy" in out_b, out_b
        st_a, st_b = state(env), state(env_b)
        assert [p["role"] for p in st_a["procs"]] == ["prefill", "decode"]
        assert [p["role"] for p in st_b["procs"]] == ["router"]
        req = urllib.request.Request(f"http://127.0.0.1:{env['ROUTER_PORT']}/generate",
                                     data=json.dumps({"text": "split", "sampling_params": {"max_new_tokens": 3}}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert json.loads(resp.read())["text"] == "standin decode output"
        procs_a = all_run_processes(st_a)
        procs_b = all_run_processes(st_b)
        os.kill(st_a["supervisor_pid"], signal.SIGKILL)
        left = wait_gone({p: s for p, s in procs_a.items() if p != st_a["supervisor_pid"]}, 10)
        assert not left, f"parts outlived their killed supervisor: {left}"
    finally:
        if b.poll() is None:
            b.kill()
        sa = subprocess.run(["bash", str(SERVE / "stop.sh")], capture_output=True, text=True, env=env, timeout=90)
        sb = subprocess.run(["bash", str(SERVE / "stop.sh")], capture_output=True, text=True, env=env_b, timeout=90)
    assert sa.returncode == 0 and sb.returncode == 0, sa.stdout + sb.stdout
    assert not wait_gone(procs_b, 10)


def test_failed_health_checks_tear_down(env, tmp_path):
    """SUPERVISE_HEALTH_FAILS: a server that stops answering /health (hung, not dead) is torn down."""
    flag = tmp_path / "unhealthy"
    with serving(env, tmp_path / "out.txt", wait_s=60, NODE_ROLE="prefill,decode", SUPERVISE_HEALTH_FAILS="2",
                 SUPERVISE_HEALTH_EVERY_S="1", DSV4_SM120_STANDIN_ROLE="decode",
                 DSV4_SM120_STANDIN_UNHEALTHY_WHEN_FILE=str(flag)) as (proc, st):
        procs = all_run_processes(st)
        time.sleep(2.5)
        assert proc.poll() is None           # healthy: supervision keeps it running
        flag.touch()
        rc = proc.wait(timeout=60)
    text = (tmp_path / "out.txt").read_text()
    assert rc == 1 and "decode failed 2 health checks in a row" in text, text
    assert not wait_gone(procs, 10)


def test_warmup_runs_through_the_router_before_ready_and_its_time_is_logged(env, tmp_path):
    """WARMUP=1 with stand-ins: after both servers and the router are healthy, one real request goes through
    the router (the decode stand-in makes its first generation wait, a transport cold start); READY only
    after it, its time in the log and in state.json."""
    e = dict(env, WARMUP="1", DETACH="1", DSV4_SM120_STANDIN_ROLE="decode", DSV4_SM120_STANDIN_FIRST_GENERATE_S="1.5")
    r = run_script(e, timeout=120)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        st = state(env)
        assert st["status"] == "ready" and st["warmup_s"] >= 1.5, st
        out = r.stdout
        assert "warm-up: one request through the router" in out
        assert out.index("router healthy") < out.index("warm-up: first prefill-to-decode request") < out.index("READY")
        assert f"took {st['warmup_s']:.2f} s" in out
        posts = [json.loads(x) for x in Path(env["DSV4_SM120_STANDIN_RECORD"]).read_text().splitlines()]
        posts = [p for p in posts if p["method"] == "POST" and p["path"] == "/generate"]
        assert sorted(p["role"] for p in posts) == ["decode", "prefill"]          # one request, through the router
        assert posts[0]["body"]["bootstrap_room"] == posts[1]["body"]["bootstrap_room"]
        assert str(posts[0]["body"]["rid"]).startswith("dsv4-warmup-")
        procs = all_run_processes(st)
    finally:
        s = subprocess.run(["bash", str(SERVE / "stop.sh")], capture_output=True, text=True, env=env, timeout=90)
    assert s.returncode == 0
    assert not wait_gone(procs, 10)


def test_failed_warmup_tears_everything_down(env):
    r = run_script(env, extra={"WARMUP": "1", "WARMUP_TIMEOUT_S": "20", "DSV4_SM120_STANDIN_ROLE": "decode",
                               "DSV4_SM120_STANDIN_FAIL_GENERATE": "1"}, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "warm-up request through the router failed" in r.stdout and "KV transfer does not work" in r.stdout
    assert "READY" not in r.stdout and "tearing down router, decode, prefill" in r.stdout
    st = state(env)
    assert st["status"] == "failed" and st["warmup_s"] is None
    for p in st["procs"]:
        assert start_time(p["pid"]) != p["start"] or start_time(p["pid"]) is None, p


def test_stand_ins_run_pinned_to_the_numa_node_of_their_gpus(env, tmp_path):
    """A fake box (nvidia-smi + sysfs) puts the prefill GPUs on a node whose CPU list is this machine's
    last CPU: the supervisor pins the prefill stand-in there; decode's GPUs report no node: unbound."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from pcie_box import make_smi, make_sysfs
    mine = sorted(os.sched_getaffinity(0))
    last = mine[-1]
    sysfs = make_sysfs(tmp_path / "sys", {0: 1, 1: 1, 2: 1, 3: 1, 4: -1, 5: -1, 6: -1, 7: -1},
                       {0: ",".join(map(str, mine[:-1])) or str(last), 1: str(last)})
    e = dict(env, DETACH="1", NODE_ROLE="prefill,decode", NVIDIA_SMI=make_smi(tmp_path / "nvidia-smi"),
             DSV4_SM120_SERVE_SYSFS_ROOT=str(sysfs))
    r = run_script(e, timeout=120)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"prefill NUMA placement: NUMA node 1, CPUs {last} [GPU 0: node 1" in r.stdout
        assert "decode NUMA placement: unbound (no NUMA information for GPU 4" in r.stdout
        st = state(env)
        pids = {p["role"]: p["pid"] for p in st["procs"]}
        sys.path.insert(0, str(REPO / "overlay"))
        from dsv4_sm120.serving.topology import allowed_cpus
        assert allowed_cpus(pids["prefill"]) == [last]
        assert allowed_cpus(pids["decode"]) == mine
        plan = json.loads((Path(st["run_dir"]) / "plan.json").read_text())
        pargv = next(p["argv"] for p in plan["procs"] if p["role"] == "prefill")
        assert pargv[-5:] == ["--numa-node", "1", "1", "1", "1"]
        procs = all_run_processes(st)
    finally:
        s = subprocess.run(["bash", str(SERVE / "stop.sh")], capture_output=True, text=True, env=env, timeout=90)
    assert s.returncode == 0
    assert not wait_gone(procs, 10)


def test_stop_and_measure_find_a_deployment_started_with_another_log_dir(env, tmp_path, monkeypatch):
    """`LOG_DIR=/x make serve`, then `make stop` with the default LOG_DIR: the start is recorded per checkout in
    the project's cache, so stop (and measure / profile) find it and say where it is."""
    other = dict(env, LOG_DIR=str(tmp_path / "elsewhere"), DETACH="1")
    r = run_script(other, timeout=120)
    procs = {}
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        st = state(other)
        procs = all_run_processes(st)
        run_dir = (Path(other["LOG_DIR"]) / "latest").resolve()
        from dsv4_sm120.perf import measure

        monkeypatch.setenv("DSV4_SM120_CACHE", env["DSV4_SM120_CACHE"])
        assert measure.latest_run(env["LOG_DIR"]) == run_dir
    finally:
        s = subprocess.run(["bash", str(SERVE / "stop.sh")], capture_output=True, text=True, env=env, timeout=90)
    assert s.returncode == 0, s.stdout + s.stderr
    assert f"{Path(env['LOG_DIR']) / 'latest'} is not running" not in s.stdout       # nothing was ever there
    assert f"the deployment running from this checkout is {run_dir}" in s.stdout, s.stdout
    assert "stopped" in s.stdout
    assert not wait_gone(procs, 10)
    for k in ("PREFILL_PORT", "DECODE_PORT", "ROUTER_PORT"):
        assert port_free(int(env[k])), k
    s = subprocess.run(["bash", str(SERVE / "stop.sh")], capture_output=True, text=True, env=env, timeout=90)
    assert s.returncode == 0 and "nothing to stop" in s.stdout, s.stdout + s.stderr


def test_runs_find_prefers_log_dir_then_the_one_running_and_names_several(tmp_path, monkeypatch):
    from dsv4_sm120.serving import runs

    monkeypatch.setenv("DSV4_SM120_CACHE", str(tmp_path / "cache"))
    me = {"supervisor_pid": os.getpid(), "supervisor_start": start_time(os.getpid()), "procs": []}
    dead = {"supervisor_pid": 2 ** 22 + 7, "supervisor_start": "1", "procs": []}

    def run(name, st):
        d = tmp_path / name
        d.mkdir()
        (d / "state.json").write_text(json.dumps(st))
        assert runs.record(d) is None
        return d

    logs = tmp_path / "logs"
    logs.mkdir()
    assert runs.find(logs) == (None, "")
    old = run("old", dead)
    os.symlink(old, logs / "latest")
    a = run("a", me)
    found, note = runs.find(logs)
    assert found == a and note == f"{logs / 'latest'} is not running; the deployment running from this checkout is {a}"
    assert not any(os.readlink(p) == str(old) for p in runs.record_dir().iterdir())   # the stopped run's record went
    b = run("b", me)
    found, note = runs.find(logs)
    assert found is None and "2 deployments are running from this checkout" in note and str(a) in note and str(b) in note
    (logs / "latest").unlink()
    os.symlink(b, logs / "latest")
    assert runs.find(logs) == (b, "")


# Makes every threading.Event.wait hold the event's lock while it sleeps: a signal handler that takes that lock
# (Event.set) then deadlocks, as it does when SIGTERM arrives in the moment the main thread holds the lock.
HOLD_EVENT_LOCK = '''
import threading, time
def _wait(self, timeout=None):
    with self._cond:
        time.sleep(0.2 if timeout is None else min(timeout, 0.2))
        return self._flag
threading.Event.wait = _wait
'''


def test_stand_in_exits_on_sigterm_whatever_its_main_thread_holds(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HOLD_EVENT_LOCK)
    (port,) = free_ports(1)
    e = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_SM120_STANDIN_")}
    e["PYTHONPATH"] = os.pathsep.join((str(site), str(Path(__file__).resolve().parents[1] / "overlay")))
    log = tmp_path / "standin.log"
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "dsv4_sm120.serving.standin", "--port", str(port),
                              "--disaggregation-mode", "decode"], stderr=f, env=e)
    try:
        t0 = time.monotonic()
        while "serving on" not in log.read_text() and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        time.sleep(0.3)
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        p.kill()
        p.wait()
    assert rc == 0, f"the stand-in did not exit within 5 s of SIGTERM (rc {rc}): {log.read_text()[-500:]}"
    assert "[standin decode] stopped" in log.read_text()
