"""dsv4_sm120.model_config on a MODEL_PATH that is not a local checkpoint, in this process: the edit distance against
an independent reference, a Hub id nothing knows (a typo of a published id, a local path that does not exist, a
plausible download) and its warning, and a local path made absolute for the servers' run directory."""

from __future__ import annotations

import functools
import os
import random

import pytest

from dsv4_sm120 import model_config as MC

FLASH, FLASH_0731 = "deepseek-ai/DeepSeek-V4-Flash", "deepseek-ai/DeepSeek-V4-Flash-0731"


def _reference_distance(a: str, b: str) -> int:
    """Levenshtein distance by its recursive definition (the product computes it row by row)."""
    @functools.lru_cache(maxsize=None)
    def d(i: int, j: int) -> int:
        if i == 0 or j == 0:
            return i + j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))
    return d(len(a), len(b))


def test_the_edit_distance_matches_its_definition():
    for a, b, want in (("kitten", "sitting", 3), ("flaw", "lawn", 2), ("", "abc", 3), ("abc", "", 3), ("", "", 0),
                       ("ab", "ba", 2), ("same", "same", 0), ("a", "b", 1), ("abc", "abcd", 1)):
        assert MC._distance(a, b) == want == _reference_distance(a, b), (a, b)
    rng = random.Random(7)
    for _ in range(300):
        a = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 7)))
        b = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 7)))
        assert MC._distance(a, b) == _reference_distance(a, b), (a, b)


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A working directory with an out/ directory and no Hugging Face cache."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("model,meant", [
    ("DEEPSEEK-AI/deepseek-v4-flash", FLASH),          # letter case only (many edits)
    ("deepseek-ai/DeepSeek-V4-Flahs", FLASH),          # two edits: still a typo
    ("deepseek-ai/DeepSeek-V4-Flash-073", FLASH_0731),  # one edit from the second id
    ("deepseek-ai/DeepSeek-V4-Fl", None),              # three edits: a plausible other id
    ("someorg/DeepSeek-V4-Flash", None),
])
def test_a_typo_of_a_published_id_is_named(elsewhere, model, meant):
    got = MC.unknown_hub_id_problem(model)
    if meant:
        assert got == (f"MODEL_PATH={model} is not in the local Hugging Face cache nor a published checkpoint: did "
                       f"you mean {meant}?")
    else:
        assert got is None
    cfg = MC.read(model)
    assert (cfg.where, cfg.problem) == ("hub", got)
    assert cfg.problems() == ([got] if got else [])


def test_a_path_under_a_local_directory_is_not_taken_for_a_hub_id(elsewhere):
    want = (f"MODEL_PATH=out/nvfp4/v2 does not exist here ({elsewhere / 'out'} does: a local path?) and is not a "
            f"Hugging Face id in the local cache nor a published checkpoint")
    assert MC.unknown_hub_id_problem("out/nvfp4/v2") == want     # the first part names the directory
    assert MC.unknown_hub_id_problem("nvfp4/out") is None        # a directory elsewhere in the id does not


def test_only_a_plausible_download_warns(elsewhere, tmp_path):
    warning = (f"WARNING: MODEL_PATH=someorg/other is neither in the local Hugging Face cache nor a published "
               f"checkpoint this plan knows ({FLASH}, {FLASH_0731}): SGLang downloads it at start, and nothing here "
               f"checks that it is a DeepSeek-V4 checkpoint")
    assert MC.read("someorg/other").warnings() == [warning]
    assert MC.read("deepseek-ai/DeepSeek-V4-Flahs").warnings() == []   # refused instead
    assert MC.read(FLASH).warnings() == []                             # published: known
    assert MC.read(str(tmp_path / "out")).warnings() == []             # local (its problems say what is wrong)


def test_a_local_path_becomes_absolute_and_a_hub_id_stays(elsewhere, monkeypatch):
    monkeypatch.setenv("HOME", str(elsewhere / "home"))
    assert MC.absolute_if_local("out") == str(elsewhere / "out")                     # exists here
    assert MC.absolute_if_local("./not-yet") == str(elsewhere / "not-yet")           # written as a path
    assert MC.absolute_if_local("~/ckpt") == str(elsewhere / "home" / "ckpt")
    assert MC.absolute_if_local("/srv/../models/x") == "/models/x"
    assert MC.absolute_if_local(FLASH) == FLASH and MC.absolute_if_local("org/name") == "org/name"
    assert MC.absolute_if_local("") == ""
    assert os.path.isabs(MC.absolute_if_local("out/../out"))
