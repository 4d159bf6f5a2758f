"""make test's pytest-xdist scheduling (tests/xdist_groups.py): a file's module-scoped fixture is built once even
with two workers, and without the grouping it would be built on both (so the check is able to fail); the longest
recorded work starts first, and every run records what its tests took."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")
TESTS = Path(__file__).resolve().parent

SHARED = '''
import os, time, pytest
LOG = os.environ["BUILD_LOG"]

@pytest.fixture(scope="module")
def expensive():
    with open(LOG, "a") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "main") + "\\n")
    time.sleep(0.3)
    return 1

@pytest.mark.parametrize("i", range(6))
def test_uses_it(expensive, i):
    time.sleep(0.05)
    assert expensive == 1
'''
FREE = '''
import os, time, pytest

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    with open(os.environ["BUILD_LOG"] + "." + os.environ.get("PYTEST_XDIST_WORKER", "main"), "a") as f:
        f.write(f"free{i}\\n")
    time.sleep(0.05)
'''


def _project(tmp_path: Path) -> Path:
    (tmp_path / "tests").mkdir()
    (tmp_path / "pytest.ini").write_text("[pytest]\ntestpaths = tests\n")
    (tmp_path / "tests" / "conftest.py").write_text(
        f"import sys\nsys.path[:0] = [{str(TESTS)!r}, {str(TESTS.parent / 'overlay')!r}]\n"
        "from xdist_groups import *\n")
    (tmp_path / "tests" / "test_a_shared.py").write_text(SHARED)
    (tmp_path / "tests" / "test_b_free.py").write_text(FREE)
    return tmp_path


def _builds(project: Path, dist: str) -> list:
    log = project / f"builds-{dist}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["BUILD_LOG"] = str(log)
    env["DSV4_SM120_TEST_DURATIONS"] = str(project / "durations.json")
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "2", "--dist", dist],
                       cwd=project, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "12 passed" in r.stdout, r.stdout[-2000:]
    return log.read_text().split()


def test_module_fixture_file_stays_on_one_worker(tmp_path):
    project = _project(tmp_path)
    assert len(_builds(project, "loadgroup")) == 1
    # plain load balancing spreads the file's tests over both workers: the fixture is built twice
    assert len(_builds(project, "load")) == 2


def test_longest_recorded_unit_first():
    from xdist_groups import ordered

    ids = ["tests/test_g.py::a", "tests/test_x.py::t1", "tests/test_g.py::b", "tests/test_x.py::t2",
           "tests/test_y.py::t3"]
    grouped = {"tests/test_g.py"}
    # nothing recorded: the slow files first, then collection order; a grouped file's tests stay together
    assert ordered(ids, grouped, {}, slow_first=("test_y.py",)) == [
        "tests/test_y.py::t3", "tests/test_g.py::a", "tests/test_g.py::b", "tests/test_x.py::t1", "tests/test_x.py::t2"]
    # recorded: a grouped file ranks by its tests' sum (2 + 2 > 3.5), an unrecorded test by UNKNOWN_S (1 s)
    rec = {"tests/test_g.py::a": 2.0, "tests/test_g.py::b": 2.0, "tests/test_x.py::t1": 0.1, "tests/test_x.py::t2": 3.5}
    assert ordered(ids, grouped, rec, slow_first=("test_x.py",)) == [
        "tests/test_g.py::a", "tests/test_g.py::b", "tests/test_x.py::t2", "tests/test_y.py::t3", "tests/test_x.py::t1"]


def test_durations_are_recorded_and_order_the_next_run(tmp_path):
    project = _project(tmp_path)
    (project / "durations.json").write_text("{not json")     # an unreadable record is only a missing hint
    _builds(project, "loadgroup")
    rec = json.loads((project / "durations.json").read_text())
    assert len(rec) == 12 and all(v >= 0.04 for v in rec.values()), rec
    assert rec["tests/test_a_shared.py::test_uses_it[0]"] >= 0.3    # the fixture's setup counts
    # make two free tests the longest work: each worker starts with one of them (collection order would start
    # with the shared file, which has the most tests too)
    rec["tests/test_b_free.py::test_free[4]"] = 30.0
    rec["tests/test_b_free.py::test_free[2]"] = 20.0
    rec["tests/test_gone.py::test_x"] = 5.0          # a file that no longer exists: dropped at the next write
    (project / "durations.json").write_text(json.dumps(rec))
    for f in project.glob("builds-*"):
        f.unlink()
    _builds(project, "loadgroup")
    firsts = sorted(f.read_text().split()[0] for f in project.glob("builds-loadgroup.log.gw*"))
    assert firsts == ["free2", "free4"], firsts
    after = json.loads((project / "durations.json").read_text())
    assert after["tests/test_b_free.py::test_free[4]"] < 5 and "tests/test_gone.py::test_x" not in after, after
