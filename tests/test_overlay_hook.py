"""Patch 0001 in the real pinned SGLang: the overlay hook reaches only dsv4_sm120.sglang_glue, logs once, never
raises for a missing or disabled overlay, and stops the start for an invalid setting; the patches name no other
part of the overlay."""

import re
from pathlib import Path

import pytest

from dsv4_sm120 import __version__, sglang_glue

REPO = Path(__file__).resolve().parents[1]

CODE = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
from sglang.srt import dsv4_sm120_hook as h
print("AVAILABLE", h.overlay_available(), h.overlay_available())
print("ERROR", h.overlay_error())
m = h.import_glue("attention")
print("SUB", m is not None and m.__name__)
print("MISSING_SUB", h.import_glue("no_such_module") is None)
print("OUTSIDE_GLUE", h.import_glue("..patching") is None)
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
    assert "SUB dsv4_sm120.sglang_glue.attention" in r.stdout and "MISSING_SUB True" in r.stdout
    assert "OUTSIDE_GLUE True" in r.stdout  # the hook hands out the glue, nothing else of the overlay


def test_hook_without_overlay_falls_back(run_patched):
    r = run_patched(CODE, overlay=False)
    assert r.returncode == 0, r.stderr
    assert "AVAILABLE False False" in r.stdout
    assert "not importable" in r.stdout and "SUB False" in r.stdout


def test_hook_disabled_by_env(run_patched):
    # disabled: the overlay is not imported, so not even an invalid setting of it stops SGLang
    r = run_patched(CODE, env={"DSV4_SM120_DISABLE": "1", "DSV4_SM120_ATTN_BACKEND": "nope"})
    assert r.returncode == 0, r.stderr
    assert "AVAILABLE False False" in r.stdout and "disabled by DSV4_SM120_DISABLE" in r.stdout


def test_invalid_setting_stops_the_start_with_one_line(run_patched):
    r = run_patched(MODEL, env={"DSV4_SM120_ATTN_BACKEND": "flashinfr", "DSV4_SM120_MOE_APRE": "2",
                                "DSV4_SM120_ATTN_QK": "bf16"})
    assert r.returncode != 0 and "MODEL_OK" not in r.stdout
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    err = r.stderr
    assert "DSV4_SM120_ATTN_BACKEND='flashinfr' is not valid: expected one of dsv4, flashinfer, triton, torch" in err
    assert "DSV4_SM120_MOE_APRE='2' is not valid: expected one of 0, 1" in err
    assert "DSV4_SM120_ATTN_QK" not in err  # a valid one is not reported
    # a misspelled name is caught too, and the hook keeps refusing on every later call
    code = ("from sglang.srt import dsv4_sm120_hook as h\n"
            "for _ in range(2):\n"
            "    try:\n        h.overlay_available()\n    except SystemExit as e:\n        print('EXIT', e.code)\n")
    typo = "DSV4_SM120_" + "ATN_BACKEND"  # spelled out, tests/test_settings.py's tree check would flag it
    r = run_patched(code, env={typo: "dsv4"})
    assert r.stdout.count("EXIT") == 2 and f"{typo} is not a dsv4_sm120 setting" in r.stdout


def test_patched_model_module_imports_and_logs(overlay_on):
    r = overlay_on
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.splitlines()
    model_ok = [i for i, l in enumerate(out) if l.startswith("MODEL_OK")]
    assert model_ok, r.stdout
    # the active-overlay line comes from loading the model module, before the hook is asked directly
    logged = [i for i, l in enumerate(out) if "dsv4_sm120 overlay" in l and "active" in l]
    assert logged and logged[0] < model_ok[0], r.stdout


def test_patches_name_only_the_glue():
    glue_dir = Path(sglang_glue.__file__).parent
    parts = {p.stem for p in glue_dir.glob("*.py") if p.stem != "__init__"}
    seen = set()
    for patch in sorted((REPO / "patches").glob("*.patch")):
        text = patch.read_text()
        for mod in re.findall(r"\bdsv4_sm120\.[A-Za-z_][\w.]*", text):
            assert mod.startswith("dsv4_sm120.sglang_glue"), (patch.name, mod)
        for part in re.findall(r"import_glue\(\"([^\"]+)\"\)", text):
            assert part in parts, (patch.name, part)
            seen.add(part)
        assert "import_module(" not in text or patch.name.startswith("0001"), patch.name
    assert seen == parts - {"startup"}, seen  # every glue module is called by a patch; nothing else is in it
