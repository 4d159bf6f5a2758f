"""pytest-xdist scheduling for ``make test`` (``--dist loadgroup``), imported by tests/conftest.py.

The tests of a file that defines a module-scoped fixture (a converted checkpoint, one SGLang probe for several
tests) stay on one worker, so the fixture is built once; every other test goes to whichever worker is free.  The
grouping is done here, by file, in the controller's scheduler: xdist 3.8 marks a group by renaming the node id
(``item._nodeid``), which pytest 9 no longer reads, so ``xdist_group`` marks have no effect in this environment.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def files_with_module_fixtures(root: Path) -> set:
    """``tests/test_*.py`` files under ``root`` (as node-id paths) that define a module-scoped fixture."""
    return {p.relative_to(root).as_posix() for p in (root / "tests").glob("test_*.py")
            if 'scope="module"' in p.read_text()}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    grouped = files_with_module_fixtures(Path(str(config.rootpath)))

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path in grouped else nodeid

    return FileGroups(config, log)
