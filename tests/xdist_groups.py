"""pytest-xdist scheduling for ``make test`` (``--dist loadgroup``), imported by tests/conftest.py.

Grouping: the tests of a file that defines a module-scoped fixture (a converted checkpoint, one SGLang probe for
several tests) stay on one worker, so the fixture is built once; every other test goes to whichever worker is
free.  The grouping is done here, by file, in the controller's scheduler: xdist 3.8 marks a group by renaming the
node id (``item._nodeid``), which pytest 9 no longer reads, so ``xdist_group`` marks have no effect here.

Order: longest first (a long test started last runs alone while the other workers idle).  A unit of work (a
grouped file, else one test) is ranked by what its tests took in the last run on this machine, kept in
``test-durations.json`` in the cache directory (``DSV4_SM120_TEST_DURATIONS`` names another file); the controller
writes it at the end of every run.  Without that record the files of ``SLOW_FIRST`` go first, the rest in
collection order.  xdist's own reordering (by the number of tests in a unit) is turned off.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import pytest

# the cold-cache order: files whose tests take longest on a 2-core box (SGLang in a subprocess, the Triton
# interpreter at verify shapes: tens of seconds each)
SLOW_FIRST = ("test_calibrate_harness.py", "test_readme_commands.py", "test_attention_speculative.py",
              "test_verify.py", "test_serve_measure.py", "test_convert_nvfp4.py", "test_serve_dryrun.py",
              "test_attention_integration.py", "test_attention.py", "test_moe.py", "test_attention_spec_shapes.py",
              "test_glue_selfcheck_sglang.py", "test_serve_orchestration.py")
UNKNOWN_S = 1.0    # a test without a recorded duration (new, or renamed)


def files_with_module_fixtures(root: Path) -> set:
    """``tests/test_*.py`` files under ``root`` (as node-id paths) that define a module-scoped fixture."""
    return {p.relative_to(root).as_posix() for p in (root / "tests").glob("test_*.py")
            if 'scope="module"' in p.read_text()}


def unit_of(nodeid: str, grouped: set) -> str:
    path = nodeid.split("::", 1)[0]
    return path if path in grouped else nodeid


def durations_path() -> Path:
    from dsv4_sm120 import patching, settings

    override = settings.get("DSV4_SM120_TEST_DURATIONS")
    return Path(override) if override else patching.cache_dir() / "test-durations.json"


def load_durations(path: Path) -> Dict[str, float]:
    """``{node id: seconds}`` of the last run; empty when the file is missing or unreadable (a hint only)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(k, str) and isinstance(v, (int, float))}


def ordered(nodeids: Iterable[str], grouped: set, durations: Dict[str, float],
            slow_first: Iterable[str] = SLOW_FIRST) -> List[str]:
    """``nodeids`` with the units of work in descending recorded time (a unit's tests stay together, in their
    order); ties, and every unit when nothing is recorded, by the ``slow_first`` file rank, then collection
    order."""
    ids = list(nodeids)
    rank = {name: i for i, name in enumerate(slow_first)}
    cost: Dict[str, float] = {}
    first: Dict[str, int] = {}
    for i, nid in enumerate(ids):
        u = unit_of(nid, grouped)
        cost[u] = cost.get(u, 0.0) + (durations.get(nid, UNKNOWN_S) if durations else 0.0)
        first.setdefault(u, i)

    def key(i_nid):
        i, nid = i_nid
        u = unit_of(nid, grouped)
        return (-cost[u], rank.get(Path(u.split("::", 1)[0]).name, len(rank)), first[u], i)

    return [nid for _, nid in sorted(enumerate(ids), key=key)]


def save_durations(path: Path, new: Dict[str, float], root: Optional[Path] = None) -> None:
    """Merge ``new`` into the record at ``path`` (tests not run this time keep theirs; those whose file is gone
    are dropped) and replace it atomically; a cache that cannot be written is left as it was."""
    from dsv4_sm120.fileio import atomic_write_json

    merged = load_durations(path)
    merged.update({k: round(v, 3) for k, v in new.items()})
    if root is not None:
        merged = {k: v for k, v in merged.items() if (root / k.split("::", 1)[0]).is_file()}
    try:
        atomic_write_json(path, merged, indent=0, sort_keys=True)
    except OSError:
        pass


# ---- hooks (conftest.py imports them)

_RUN: Dict[str, float] = {}
_SNAPSHOT: Optional[Dict[str, float]] = None


def _durations(config) -> Dict[str, float]:
    """The record as the controller read it once: every worker must order the same way (xdist aborts a run whose
    workers collected differently), even if another run replaces the file meanwhile."""
    global _SNAPSHOT
    sent = getattr(config, "workerinput", {}).get("dsv4_test_durations")
    if sent is not None:
        return sent
    if _SNAPSHOT is None:
        _SNAPSHOT = load_durations(durations_path())
    return _SNAPSHOT


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["dsv4_test_durations"] = _durations(node.config)


def pytest_collection_modifyitems(config, items):
    root = Path(str(config.rootpath))
    by_id = {it.nodeid: it for it in items}
    order = ordered(by_id, files_with_module_fixtures(root), _durations(config))
    items[:] = [by_id[n] for n in order]


def pytest_runtest_logreport(report):
    _RUN[report.nodeid] = _RUN.get(report.nodeid, 0.0) + float(getattr(report, "duration", 0.0) or 0.0)


def pytest_sessionfinish(session):
    # the controller (or a run without workers) records; a worker's reports reach the controller too
    if hasattr(session.config, "workerinput") or not _RUN:
        return
    save_durations(durations_path(), _RUN, Path(str(session.config.rootpath)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    grouped = files_with_module_fixtures(Path(str(config.rootpath)))
    config.option.loadscopereorder = False   # keep the collection order chosen above

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid, grouped)

    return FileGroups(config, log)
