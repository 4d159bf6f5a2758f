"""The tests' fork server (tests/forkserver.py) must give what a plain `python -c` child gives: the same output,
exit status, argv, sys.path head, environment, working directory, stdin and timeout behaviour, fresh random
state, nothing of the code under test preloaded; and it must refuse (None: the caller runs a plain child)
where forking would not be faithful."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from forkserver import ForkClient, sglang_cache_defaults, signature  # noqa: E402

REPORT = textwrap.dedent("""
    import json, os, random, sys
    extra = os.environ.get("FS_EXTRA_MODULE")
    if extra:
        __import__(extra)
    print(json.dumps({"argv": sys.argv, "path": sys.path, "cwd": os.getcwd(), "name": __name__,
                      "env": os.environ.get("SGLANG_FS_PROBE"), "stdin": sys.stdin.read(),
                      "rand": random.random(), "sglang": [m for m in sys.modules if m.startswith("sglang")],
                      "preloaded_minidom": "xml.dom.minidom" in sys.modules,
                      "site": getattr(sys.modules.get("sitecustomize"), "MARK", None)}))
    sys.stderr.write("to stderr\\n")
    sys.exit(int(os.environ.get("SGLANG_FS_EXIT", "0")))
""")


@pytest.fixture
def client(tmp_path, monkeypatch):
    monkeypatch.delenv("TEST_FORK_SERVER", raising=False)    # these tests are of the server: on, whatever the run
    c = ForkClient(tmp_path)
    yield c
    c.close()


def plain(code, args, env, cwd, timeout=60, input=None):
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout, input=input)


def env_with(**kv):
    e = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    e.update(kv)
    return e


def test_a_forked_child_reports_what_a_plain_child_does(client, tmp_path):
    import json
    extra = tmp_path / "extra_path"
    extra.mkdir()
    (extra / "sitecustomize.py").write_text("import os\nMARK = os.environ.get('SGLANG_FS_PROBE')\n")
    env = env_with(PYTHONPATH=f"{extra}{os.pathsep}{tmp_path}", SGLANG_FS_PROBE="x1", SGLANG_FS_EXIT="3")
    f = client.run(REPORT, ["a", "b c"], env, str(tmp_path), 60, input="hello")
    p = plain(REPORT, ["a", "b c"], env, str(tmp_path), input="hello")
    assert f is not None, [p.read_text() for p in tmp_path.glob("fs*/server.log")]
    assert (f.returncode, p.returncode) == (3, 3)
    fo, po = json.loads(f.stdout), json.loads(p.stdout)
    for k in ("argv", "path", "cwd", "name", "env", "stdin", "sglang", "site"):
        assert fo[k] == po[k], k
    assert str(extra) in fo["path"] and fo["sglang"] == []
    assert fo["site"] == "x1"                                   # the sitecustomize on PYTHONPATH ran
    assert f.stderr == p.stderr == "to stderr\n"
    g = client.run(REPORT, [], env_with(SGLANG_FS_EXIT="0"), str(tmp_path), 60)
    assert g.returncode == 0 and json.loads(g.stdout)["rand"] != fo["rand"]     # reseeded per child


def test_exceptions_exit_codes_and_timeouts(client, tmp_path):
    env = env_with()
    r = client.run("def f():\n    raise ValueError('boom')\nf()", [], env, str(tmp_path), 60)
    assert r.returncode == 1 and r.stderr.startswith("Traceback") and "ValueError: boom" in r.stderr
    assert 'File "<string>", line 2, in f' in r.stderr and "forkserver" not in r.stderr
    assert client.run("import sys; sys.exit('bad input')", [], env, str(tmp_path), 60).stderr == "bad input\n"
    assert client.run("import os; os.kill(os.getpid(), 9)", [], env, str(tmp_path), 60).returncode == -9
    assert client.run("import atexit; atexit.register(print, 'at exit')", [], env, str(tmp_path), 60).stdout \
        == "at exit\n"
    with pytest.raises(subprocess.TimeoutExpired):
        client.run("import time; print('started', flush=True); time.sleep(30)", [], env, str(tmp_path), 1)


def test_modules_a_child_imported_are_preloaded_for_the_next(client, tmp_path):
    import json
    env = env_with(FS_EXTRA_MODULE="xml.dom.minidom")
    first = json.loads(client.run(REPORT, [], env, str(tmp_path), 60).stdout)
    assert first["preloaded_minidom"] is True        # imported by the probe itself
    second = client.run("import sys; print('xml.dom.minidom' in sys.modules)", [], env_with(), str(tmp_path), 60)
    assert second.stdout == "True\n"                   # now there before the code runs


def test_what_servers_preloaded_is_remembered_for_the_next_run(tmp_path, monkeypatch):
    import json
    monkeypatch.delenv("TEST_FORK_SERVER", raising=False)
    remember = tmp_path / "remember.txt"
    remember.write_text("sglang.srt\nxml.dom\n")     # code under test in the file is never imported
    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        c = ForkClient(tmp_path / name, remember)
        try:
            first = c.run("import sys; print(sorted(m for m in sys.modules if m.startswith(('xml.dom', 'sglang'))))",
                          [], env_with(FS_EXTRA_MODULE="xml.dom.minidom"), str(tmp_path), 60)
            c.run(REPORT, [], env_with(FS_EXTRA_MODULE="xml.dom.minidom"), str(tmp_path), 60)
            c.run("print(1)", [], env_with(), str(tmp_path), 60)     # its fork preloads what REPORT imported
        finally:
            c.close()
        runs.append(json.loads(first.stdout.replace("'", '"')))
    # the first run's first child had only the remembered xml.dom; the next run's first child has what the
    # first run's servers preloaded
    assert "xml.dom" in runs[0] and "xml.dom.minidom" not in runs[0] and "xml.dom.minidom" in runs[1], runs
    assert not any(m.startswith("sglang") for r in runs for m in r)
    names = remember.read_text().split()
    assert "xml.dom.minidom" in names and not any(n.startswith("sglang") for n in names)


def test_code_under_test_is_never_preloaded(client, tmp_path):
    pkg = tmp_path / "site" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("import xml.sax.saxutils\n")
    env = env_with(PYTHONPATH=str(tmp_path / "site"))
    assert client.run("import sglang", [], env, str(tmp_path), 60).returncode == 0
    r = client.run("import sys; print(sorted(m for m in sys.modules if m.startswith(('sglang', 'xml.sax'))))",
                   [], env_with(), str(tmp_path), 60)
    assert r.stdout == "['xml.sax', 'xml.sax._exceptions', 'xml.sax.handler', 'xml.sax.saxutils', " \
                       "'xml.sax.xmlreader']\n"   # its third-party imports are, the package itself is not


def test_environments_a_preloaded_package_may_read_get_their_own_server(client, tmp_path, monkeypatch):
    base = dict(client.base)
    same = signature(base, base)
    assert signature(base, dict(base, DSV4_SM120_ATTN_BACKEND="triton", SGLANG_X="1", PYTEST_CURRENT_TEST="t",
                                PYTHONPATH="/x", LOOKUP_ARGS="[]")) == same    # read by the code under test only
    assert signature(base, dict(base, TORCH_LOGS="+dynamo")) != same           # read by torch at import
    with_var = dict(base, TORCH_FS_PROBE="1")
    assert signature(with_var, base) != signature(with_var, with_var)           # removed
    assert signature(base, dict(base, HOME="/elsewhere")) != same
    # the cache variables `import sglang` sets first thing: absent or at SGLang's value is the same child
    cache = sglang_cache_defaults()
    assert "FLASHINFER_WORKSPACE_BASE" in cache and "TRITON_CACHE_DIR" in cache
    bare = {k: v for k, v in base.items() if k not in cache}
    assert signature(bare, bare) == signature(bare, dict(bare, **cache))
    assert signature(bare, bare) != signature(bare, dict(bare, TRITON_CACHE_DIR="/elsewhere"))
    code = "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'), os.environ.get('SGLANG_FS_PROBE'))"
    for i, cvd in enumerate(("7", "6", "7")):
        r = client.run(code, [], dict(base, CUDA_VISIBLE_DEVICES=cvd, SGLANG_FS_PROBE=str(i)), str(tmp_path), 60)
        assert r.stdout == f"{cvd} {i}\n"
    assert len(client.servers) == 2
    client.MAX_SERVERS = 2
    assert client.run(code, [], dict(base, CUDA_VISIBLE_DEVICES="5"), str(tmp_path), 60) is None
    monkeypatch.setenv("TEST_FORK_SERVER", "0")
    assert client.run("print(1)", [], base, str(tmp_path), 60) is None


def test_a_server_that_quits_leaves_its_requests_to_plain_children(client, tmp_path):
    base = dict(client.base)
    assert client.run("print(1)", [], base, str(tmp_path), 60).stdout == "1\n"
    (srv,) = client.servers.values()
    srv.proc.kill()
    srv.proc.wait()
    assert client.run("print(1)", [], base, str(tmp_path), 60) is None


def test_a_failing_sitecustomize_is_reported_and_the_code_still_runs(client, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("raise RuntimeError('boom in site')\n")
    env = env_with(PYTHONPATH=str(site))
    code = "print('ran')"
    f = client.run(code, [], env, str(tmp_path), 60)
    p = plain(code, [], env, str(tmp_path))
    assert f is not None
    assert (f.returncode, f.stdout, f.stderr) == (p.returncode, p.stdout, p.stderr) == (0, "ran\n", p.stderr)
    assert "Error in sitecustomize" in p.stderr and "RuntimeError: boom in site" in p.stderr
