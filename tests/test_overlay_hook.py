"""Patch 0001 in the real pinned SGLang: the overlay hook logs once and never raises."""

import pytest

from dsv4_sm120 import __version__

CODE = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
from sglang.srt import dsv4_sm120_hook as h
print("AVAILABLE", h.overlay_available(), h.overlay_available())
print("ERROR", h.overlay_error())
m = h.import_overlay("patching")
print("SUB", m is not None)
print("MISSING_SUB", h.import_overlay("no_such_module") is None)
"""


MODEL = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
import sglang.srt.models.deepseek_v4 as m
print("MODEL_OK", m.__file__)
"""


@pytest.fixture(scope="module")
def overlay_on(run_patched):
    """One process (one SGLang import) for both overlay-on checks: the patched model module is imported first
    (its load must log the active overlay), then the hook is asked twice (nothing more may be logged)."""
    return run_patched(MODEL + CODE)  # CODE's own basicConfig is then a no-op


def _active_lines(stdout):
    return [l for l in stdout.splitlines() if "overlay" in l and "active" in l]


def test_hook_logs_active_overlay_once(overlay_on):
    r = overlay_on
    assert r.returncode == 0, r.stderr
    assert "AVAILABLE True True" in r.stdout
    lines = _active_lines(r.stdout)
    assert len(lines) == 1, r.stdout  # logged once per process, however often the hook is asked
    assert __version__ in lines[0] and "patch series" in lines[0]
    assert "SUB True" in r.stdout and "MISSING_SUB True" in r.stdout


def test_hook_without_overlay_falls_back(run_patched):
    r = run_patched(CODE, overlay=False)
    assert r.returncode == 0, r.stderr
    assert "AVAILABLE False False" in r.stdout
    assert "not importable" in r.stdout and "SUB False" in r.stdout


def test_hook_disabled_by_env(run_patched):
    r = run_patched(CODE, env={"SGLANG_DSV4_SM120_DISABLE": "1"})
    assert r.returncode == 0, r.stderr
    assert "AVAILABLE False False" in r.stdout and "disabled by SGLANG_DSV4_SM120_DISABLE" in r.stdout


def test_patched_model_module_imports_and_logs(overlay_on):
    r = overlay_on
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.splitlines()
    model_ok = [i for i, l in enumerate(out) if l.startswith("MODEL_OK")]
    assert model_ok, r.stdout
    # the active-overlay line comes from loading the model module, before the hook is asked directly
    logged = [i for i, l in enumerate(out) if "dsv4_sm120 overlay" in l and "active" in l]
    assert logged and logged[0] < model_ok[0], r.stdout
