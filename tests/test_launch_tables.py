"""dsv4_sm120.launch_tables: nearest-size lookup and the device -> architecture -> default fallback."""

import json
import random

import pytest

from dsv4_sm120 import launch_tables as lt


def _write(root, kernel, shape, device, table):
    p = lt.table_path(kernel, shape, device, root)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(table))
    return p


def test_nearest_size_wins_with_ties_to_the_smaller(tmp_path):
    sizes = sorted(random.sample(range(1, 400), 7))
    table = {str(s): {"BLOCK_N": s} for s in sizes}
    table["_source"] = "metadata, never a config"
    _write(tmp_path, "k", "H=16", "NVIDIA_X", table)
    for ask in [1, 2, 3, 17, 100, 255, 256, 257, 1000] + [random.randint(1, 500) for _ in range(20)]:
        got = lt.lookup("k", "H=16", ask, "NVIDIA X", root=tmp_path)
        want = min(sizes, key=lambda s: (abs(s - ask), s))
        assert got.size == want and got.config == {"BLOCK_N": want} and got.level == "device"
    # a tie: 4 is as near to 2 as to 6 -> 2
    _write(tmp_path, "k", "tie", "default", {"2": {"a": 1}, "6": {"a": 2}})
    assert lt.lookup("k", "tie", 4, root=tmp_path).config == {"a": 1}


def test_fallback_order_device_arch_default(tmp_path):
    _write(tmp_path, "k", "s", "default", {"1": {"v": "default"}})
    assert lt.lookup("k", "s", 8, "NVIDIA Other", (12, 0), root=tmp_path).level == "default"
    _write(tmp_path, "k", "s", "arch_sm_120", {"1": {"v": "arch"}})
    got = lt.lookup("k", "s", 8, "NVIDIA Other", (12, 0), root=tmp_path)
    assert (got.level, got.config["v"]) == ("arch", "arch")
    # another architecture does not take sm_120's table
    assert lt.lookup("k", "s", 8, "NVIDIA Other", (9, 0), root=tmp_path).level == "default"
    _write(tmp_path, "k", "s", "NVIDIA_Other", {"1": {"v": "dev"}})
    assert lt.lookup("k", "s", 8, "NVIDIA Other", (12, 0), root=tmp_path).config["v"] == "dev"
    assert lt.lookup("k", "missing-shape", 8, "NVIDIA Other", (12, 0), root=tmp_path) is None


@pytest.mark.parametrize("body", ["[1, 2]", "{\"x\": {}}", "{\"4\": 3}", "{}", "{\"_only\": 1}", "not json"])
def test_bad_tables_are_refused_with_the_path(tmp_path, body):
    p = lt.table_path("k", "s", "default", tmp_path)
    p.parent.mkdir(parents=True)
    p.write_text(body)
    with pytest.raises(lt.TableError, match="launch table .*s,device_name=default.json"):
        lt.lookup("k", "s", 1, root=tmp_path)
