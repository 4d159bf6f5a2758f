"""make test's pytest-xdist scheduling (tests/xdist_groups.py): a file's module-scoped fixture is built once even
with two workers, and without the grouping it would be built on both (so the check is able to fail)."""

from __future__ import annotations

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
import time, pytest

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    time.sleep(0.05)
'''


def _project(tmp_path: Path) -> Path:
    (tmp_path / "tests").mkdir()
    (tmp_path / "pytest.ini").write_text("[pytest]\ntestpaths = tests\n")
    (tmp_path / "tests" / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nfrom xdist_groups import pytest_xdist_make_scheduler\n")
    (tmp_path / "tests" / "test_a_shared.py").write_text(SHARED)
    (tmp_path / "tests" / "test_b_free.py").write_text(FREE)
    return tmp_path


def _builds(project: Path, dist: str) -> list:
    log = project / f"builds-{dist}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["BUILD_LOG"] = str(log)
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
