"""Patch 0001 in the real pinned SGLang: the overlay hook logs once and never raises."""

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


def test_hook_logs_active_overlay_once(run_patched):
    r = run_patched(CODE)
    assert r.returncode == 0, r.stderr
    assert "AVAILABLE True True" in r.stdout
    lines = [l for l in r.stdout.splitlines() if "overlay" in l and "active" in l]
    assert len(lines) == 1, r.stdout  # logged once
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


def test_patched_model_module_imports_and_logs(run_patched):
    code = ("import logging, sys\n"
            "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(name)s %(message)s')\n"
            "import sglang.srt.models.deepseek_v4 as m\n"
            "print('MODEL_OK', m.__file__)\n")
    r = run_patched(code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MODEL_OK" in r.stdout
    assert "dsv4_sm120 overlay" in r.stdout and "active" in r.stdout
