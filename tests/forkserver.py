"""A fork server for the tests' ``python -c`` children that import SGLang.

Such a child spends most of its life importing third-party packages (torch, transformers, flashinfer, ...):
~12 s of the ~15 s on a 2-core box. The server is a Python process that has already imported them; each
request forks it, and the fork runs the code with the request's environment, working directory, argv,
PYTHONPATH, stdin and output files, so only the modules of the code under test (SGLang from the patched
tree, the overlay) are imported afresh.

What is preloaded is learned: when a child ends it lists the modules it imported from the standard library
or the environment's site-packages (never `sglang*`, `dsv4_sm120*`, `sglang_router*` or anything under the
request's own PYTHONPATH), and the server imports those before its next fork. With a ``remember`` file
(conftest keeps one per interpreter in the cache directory) what servers preloaded is kept for the next run's
servers, which import it before their first fork; without the file each server learns afresh. A preload that
drags in an SGLang or overlay module taints the server: it quits and deletes the remembered list. A request
whose environment differs from the server's in a variable a preloaded package may read (anything but
``DSV4_SM120_*``, ``SGLANG_*``, ``PYTEST_*`` and new variables outside the known third-party prefixes) goes to a
server started with that environment (`signature`); beyond three such servers, or when a server cannot start,
`ForkClient.run` returns None and the caller starts a plain subprocess.

The child is set up as ``python -c`` would be: ``sys.argv == ["-c", *args]``, ``sys.path == ["", *PYTHONPATH,
<the interpreter's own paths>]``, a ``sitecustomize`` that PYTHONPATH holds imported, a fresh ``__main__``,
reseeded ``random`` / NumPy state, default signal handlers, its own process group (killed whole on timeout).
Exit status is SystemExit's code, 1 with a traceback for an uncaught exception, -N for a signal. atexit
handlers run before it exits.

``TEST_FORK_SERVER=0`` (scripts/run_tests.sh passes it through) turns it off: every child is a plain
subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

UNDER_TEST = ("sglang", "dsv4_sm120", "sglang_router")      # top-level packages a preload must never bring in
NEVER_PRELOAD = UNDER_TEST + ("__main__", "forkserver")
# variables a child may set or change without a fork being unfaithful: read by the code under test only
FREE_PREFIXES = ("DSV4_SM120_", "SGLANG_", "PYTEST_")
# prefixes of variables third-party packages read at import: a new one makes the request ineligible
THIRD_PARTY_PREFIXES = ("TORCH", "PYTORCH", "CUDA", "TRITON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS",
                        "OMP_", "MKL", "KMP_", "OPENBLAS", "NUMPY", "NCCL", "FLASHINFER", "CUTLASS", "NVIDIA",
                        "CUBLAS", "CUDNN", "PYTHON", "LD_", "XLA", "TF_", "JAX", "OUTLINES", "VLLM", "NUMBA")


def _third_party(k: str) -> bool:
    return k.upper().startswith(THIRD_PARTY_PREFIXES)


_SGLANG_ENVIRON = None


def sglang_cache_defaults() -> Dict[str, str]:
    """The third-party cache variables (TRITON_CACHE_DIR, FLASHINFER_WORKSPACE_BASE, ...) that `import sglang`
    sets first thing, before torch or FlashInfer are imported, as SGLang's own `sglang/srt/environ.py`
    computes them for this process (the file has only standard-library imports; it is loaded on its own, so
    the package is not imported). A fresh child that imports SGLang has them from its start, so the server
    sets them before preloading, and a request that lacks them matches one that carries these values.
    Empty when SGLang is not installed."""
    global _SGLANG_ENVIRON
    if _SGLANG_ENVIRON is None:
        import importlib.util
        try:
            spec = importlib.util.find_spec("sglang")
            path = Path(spec.origin).parent / "srt" / "environ.py"
            mspec = importlib.util.spec_from_file_location("_forkserver_sglang_environ", path)
            mod = importlib.util.module_from_spec(mspec)
            mspec.loader.exec_module(mod)
            _SGLANG_ENVIRON = mod
        except Exception:                # noqa: BLE001 (no SGLang here: nothing to match)
            _SGLANG_ENVIRON = False
    return dict(_SGLANG_ENVIRON.third_party_cache_defaults()) if _SGLANG_ENVIRON else {}


def signature(base: Dict[str, str], env: Dict[str, str]) -> tuple:
    """The part of a child's environment a preloaded package may have read: the variables that are not free
    and either exist in `base` (the test process's environment) or carry a third-party prefix. Children
    with equal signatures fork from one server, started with that environment."""
    defaults = sglang_cache_defaults()
    env = dict(defaults, **env)
    keys = {k for k in set(base) | set(env) if k != "PYTHONPATH" and not k.startswith(FREE_PREFIXES)
            and (k in base or k in defaults or _third_party(k))}
    return tuple(sorted((k, env.get(k)) for k in keys))


class _Server:
    def __init__(self, workdir: Path, env: Dict[str, str], remember: Optional[Path] = None):
        self.sock = workdir / "s"
        log = open(workdir / "server.log", "ab")
        self.proc = subprocess.Popen([sys.executable, __file__, str(self.sock), str(os.getpid()),
                                      str(remember or "")],
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     env={k: v for k, v in env.items() if k != "PYTHONPATH"})
        log.close()
        self.broken = False

    def ready(self) -> bool:
        t0 = time.monotonic()
        while not self.broken and not self.sock.exists():
            if self.proc.poll() is not None or time.monotonic() - t0 > 60:
                self.broken = True
            time.sleep(0.02)
        return not self.broken and self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# --------------------------------------------------------------------------- client (the pytest worker)

class ForkClient:
    """One server per environment signature, started on first use (at most MAX_SERVERS; children of
    further signatures run plain). ``remember``: the file that carries what servers preloaded to the next
    run's (module docstring)."""
    MAX_SERVERS = 3

    def __init__(self, workdir: Path, remember: Optional[Path] = None):
        self.workdir = workdir
        self.remember = remember
        self.base = dict(os.environ)
        self.servers: Dict[tuple, _Server] = {}

    def _server(self, env: Dict[str, str]) -> Optional[_Server]:
        sig = signature(self.base, env)
        srv = self.servers.get(sig)
        if srv is None:
            if len(self.servers) >= self.MAX_SERVERS:
                return None
            srv = self.servers[sig] = _Server(Path(tempfile.mkdtemp(prefix="fs", dir=self.workdir)), env,
                                              self.remember)
            base_sig = dict(signature(self.base, self.base))
            with open(self.workdir / "client.log", "a") as f:
                f.write(f"server {len(self.servers)} for {os.environ.get('PYTEST_CURRENT_TEST')}: "
                        f"{ {k: v for k, v in sig if base_sig.get(k) != v} }\n")
        return srv if srv.ready() else None

    def run(self, code: str, args: List[str], env: Dict[str, str], cwd: str, timeout: Optional[float],
            input: Optional[str] = None) -> Optional[subprocess.CompletedProcess]:
        """The CompletedProcess `subprocess.run([python, "-c", code, *args], capture_output=True, text=True,
        env=env, cwd=cwd, timeout=timeout, input=input)` would give; None when it cannot be forked."""
        if os.environ.get("TEST_FORK_SERVER", "1") == "0":
            return None
        srv = self._server(env)
        if srv is None:
            with open(self.workdir / "client.log", "a") as f:
                f.write(f"plain child: {os.environ.get('PYTEST_CURRENT_TEST')}\n")
            return None
        io = tempfile.mkdtemp(dir=self.workdir)
        out, err, inp = (os.path.join(io, n) for n in ("out", "err", "in"))
        if input is not None:
            Path(inp).write_text(input)
        req = {"code": code, "args": list(args), "env": env, "cwd": cwd, "timeout": timeout,
               "stdout": out, "stderr": err, "stdin": inp if input is not None else os.devnull,
               "pythonpath": [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]}
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(srv.sock))
                s.sendall(json.dumps(req).encode() + b"\n")
                reply = b""
                while not reply.endswith(b"\n"):
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    reply += chunk
            res = json.loads(reply)
        except (OSError, ValueError):
            srv.broken = True           # a server that quit (tainted) or died: its later children run plain
            return None
        stdout = Path(out).read_text(errors="replace")
        stderr = Path(err).read_text(errors="replace")
        shutil.rmtree(io, ignore_errors=True)
        argv = [sys.executable, "-c", code, *args]
        if res.get("timeout"):
            raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(argv, res["rc"], stdout, stderr)

    def close(self) -> None:
        for srv in self.servers.values():
            srv.close()


# --------------------------------------------------------------------------- server

def _learnable(name: str, mod, roots: List[str], excluded: List[str]) -> bool:
    if name.split(".")[0] in NEVER_PRELOAD:
        return False
    f = getattr(mod, "__file__", None)
    if not f:
        return False
    raw, real = os.path.abspath(f), os.path.realpath(f)    # the patched tree's files are links into site-packages
    return any(real.startswith(r) for r in roots) and not any(p.startswith(x) for x in excluded for p in (raw, real))


def _runner(req: dict, learn_path: str) -> None:
    """In the forked child: become `python -c code args` and never return."""
    import importlib
    import random
    import sysconfig
    import types
    rc = 1
    try:
        os.setsid()
        for s in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for f in (sys.stdout, sys.stderr):
            f.flush()
        fds = (os.open(req["stdin"], os.O_RDONLY), os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
               os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            os.close(fd)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.argv = ["-c", *req["args"]]
        # PYTHONPATH goes where the interpreter puts it: after the entries .pth files push to the front,
        # before the standard library
        base = sys.path[1:]
        stdlib = [i for i, p in enumerate(base) if p.endswith(".zip") or p == sysconfig.get_paths()["stdlib"]]
        k = stdlib[0] if stdlib else 0
        sys.path[:] = ["", *base[:k], *req["pythonpath"], *base[k:]]
        sys.path_importer_cache.clear()
        importlib.invalidate_caches()
        # start-up imports `sitecustomize` from the first sys.path entry that has one; the server started
        # without PYTHONPATH, so one that the request's PYTHONPATH brings is imported here, where it would be
        if any(os.path.isfile(os.path.join(p, "sitecustomize.py")) for p in req["pythonpath"]):
            sys.modules.pop("sitecustomize", None)
            try:
                importlib.import_module("sitecustomize")
            except Exception as e:  # noqa: BLE001 - start-up reports it and goes on
                print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(e).__name__}: {e}",
                      file=sys.stderr)
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        try:
            exec(compile(req["code"], "<string>", "exec"), main.__dict__)
            rc = 0
        except SystemExit as e:
            if e.code is None:
                rc = 0
            elif isinstance(e.code, int):
                rc = e.code
            else:
                print(e.code, file=sys.stderr)
                rc = 1
        except BaseException as e:     # noqa: BLE001 (what `python -c` prints: the traceback from <string> on)
            import traceback
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
            rc = 1
        if "threading" in sys.modules:
            try:
                sys.modules["threading"]._shutdown()     # wait for non-daemon threads, as interpreter exit does
            except Exception:
                pass
        import atexit
        atexit._run_exitfuncs()
        try:
            paths = sysconfig.get_paths()
            roots = sorted({os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")})
            excluded = [os.path.abspath(p) for p in req["pythonpath"]] + [os.path.realpath(p) for p in req["pythonpath"]]
            names = [n for n, m in list(sys.modules.items()) if _learnable(n, m, roots, excluded)]
            with open(learn_path + ".tmp", "w") as f:
                f.write("\n".join(names))
            os.replace(learn_path + ".tmp", learn_path)
        except Exception:
            pass
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:
                pass
    finally:
        os._exit(rc & 0xFF)


def _handle(conn: socket.socket, workdir: str) -> None:
    """In a child of the server: fork the runner, wait for it (or its timeout), reply, exit."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1 << 20)
        if not chunk:
            os._exit(0)
        data += chunk
    req = json.loads(data)
    learn = os.path.join(workdir, f"learn-{os.getpid()}")
    pid = os.fork()
    if pid == 0:
        conn.close()
        _runner(req, learn)
    t0 = time.monotonic()
    deadline = None if req.get("timeout") is None else t0 + float(req["timeout"])
    reply: dict = {}
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            reply = {"rc": os.waitstatus_to_exitcode(status)}
            break
        if deadline is not None and time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
            os.waitpid(pid, 0)
            reply = {"timeout": True}
            break
        time.sleep(0.01)
    print(f"child {pid}: {reply} after {time.monotonic() - t0:.1f} s", flush=True)
    try:
        conn.sendall(json.dumps(reply).encode() + b"\n")
    finally:
        os._exit(0)


def _read_names(path: str) -> List[str]:
    try:
        return [n for n in Path(path).read_text().splitlines() if n and n.split(".")[0] not in NEVER_PRELOAD]
    except OSError:
        return []


def _write_names(path: str, names: List[str]) -> None:
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        Path(tmp).write_text("\n".join(names) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass


def _preload(workdir: str, tried: set, loaded: List[str], remember: str = "") -> bool:
    """Import what finished children reported (and, before the first fork, the remembered list); False once a
    preload pulled in code under test. ``loaded`` collects what imported, in order, for ``remember``."""
    import importlib
    t0, n0, k0 = time.monotonic(), len(sys.modules), len(loaded)
    for p in sorted(Path(workdir).glob("learn-*")):
        if p.name.endswith(".tmp"):
            continue
        names = [n for n in p.read_text().splitlines() if n and n not in tried]
        p.unlink()
        for n in names:
            tried.add(n)
            if n in sys.modules:
                loaded.append(n)
                continue
            try:
                importlib.import_module(n)
            except BaseException:       # noqa: BLE001 (a module that only imports in context: left to the child)
                continue
            if any(m.split(".")[0] in UNDER_TEST for m in sys.modules):
                print(f"preloading {n} imported code under test: the fork server stops", flush=True)
                if remember:
                    try:
                        os.unlink(remember)
                    except OSError:
                        pass
                return False
            loaded.append(n)
    if len(sys.modules) > n0:
        print(f"preloaded {len(sys.modules) - n0} modules in {time.monotonic() - t0:.1f} s", flush=True)
    if remember and len(loaded) > k0:
        known = _read_names(remember)
        seen = set(known)
        _write_names(remember, known + [n for n in loaded if n not in seen])
    return True


def serve(sock_path: str, parent: int, remember: str = "") -> None:
    workdir = os.path.dirname(sock_path)
    for k, v in sglang_cache_defaults().items():
        os.environ.setdefault(k, v)       # what `import sglang` does before anything else in a fresh child
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)     # handlers are reaped by the kernel
    tried: set = set()
    loaded: List[str] = []
    if remember:
        # what earlier runs' servers preloaded: imported before the first fork, like a child's report
        _write_names(os.path.join(workdir, "learn-0-remembered"), _read_names(remember))
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path + ".tmp")
    os.replace(sock_path + ".tmp", sock_path)
    srv.listen(16)
    srv.settimeout(0.5)
    while True:
        if os.getppid() != parent:
            return
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            continue
        # what the children that ended since the last fork reported: imported here, before this fork (and
        # only once another child is asked for, so a server that is not used again costs nothing more)
        if not _preload(workdir, tried, loaded, remember):
            os.unlink(sock_path)
            conn.close()                # its client sees no reply and runs a plain child
            return
        conn.settimeout(None)
        if os.fork() == 0:
            srv.close()
            _handle(conn, workdir)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "")
