"""dsv4_sm120.fileio: atomic writes leave either the old file or the whole new one, and no temporary file."""
import json
import os
import stat
import uuid

import pytest

from dsv4_sm120 import fileio


def _listing(d):
    return sorted(p.name for p in d.iterdir())


def test_writes_text_bytes_json_and_creates_parents(tmp_path):
    payload = f"line {uuid.uuid4()}\nünïcode\n"
    p = fileio.atomic_write_text(str(tmp_path / "a" / "b" / "t.txt"), payload)
    assert p == tmp_path / "a" / "b" / "t.txt" and p.read_text(encoding="utf-8") == payload
    data = os.urandom(4096)
    fileio.atomic_write_bytes(tmp_path / "a" / "x.bin", data)
    assert (tmp_path / "a" / "x.bin").read_bytes() == data
    obj = {"k": [1, 2.5, None], "u": str(uuid.uuid4())}
    fileio.atomic_write_json(tmp_path / "o.json", obj, indent=1, sort_keys=True)
    text = (tmp_path / "o.json").read_text()
    assert text == json.dumps(obj, indent=1, sort_keys=True) + "\n"
    assert _listing(tmp_path) == ["a", "o.json"] and _listing(tmp_path / "a") == ["b", "x.bin"]


def test_mode_is_applied_and_default_is_private(tmp_path):
    fileio.atomic_write_text(tmp_path / "pub", "x", mode=0o644)
    fileio.atomic_write_text(tmp_path / "priv", "x")
    assert stat.S_IMODE((tmp_path / "pub").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "priv").stat().st_mode) == 0o600


@pytest.mark.parametrize("fail_at", ["fsync", "replace"])
def test_failure_keeps_old_content_and_removes_temp(tmp_path, monkeypatch, fail_at):
    target = tmp_path / "state.json"
    target.write_text("old\n")

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, fail_at, boom)
    with pytest.raises(OSError, match="No space"):
        fileio.atomic_write_text(target, "new contents that must not appear\n")
    monkeypatch.undo()
    assert target.read_text() == "old\n"
    assert _listing(tmp_path) == ["state.json"]
