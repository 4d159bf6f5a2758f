"""dsv4_sm120.model_config at its edges: several Hugging Face cache variables set at once (huggingface_hub itself is
the reference), the process environment and HOME as the fallbacks, a refs/main that names no usable snapshot, a
config.json that is a directory, the NVFP4 marker's spelling (SGLang's own rule is case-insensitive), and every
field of each kind of answer (what was read, from where), including the published Hub configs' fields.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_model_config import HUB_LOOKUP, M, MXFP4, NVFP4, hf_cache  # noqa: E402

HF_VARS = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


def clean_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in HF_VARS + ("HF_HUB_OFFLINE",)}
    env["HOME"] = str(home)
    return env


def hub_answer(env: dict, repo_id: str) -> str:
    """Where huggingface_hub finds repo_id's config.json under env (its constants are read at import)."""
    r = subprocess.run([sys.executable, "-c", HUB_LOOKUP, repo_id], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.parametrize("names", [("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"), ("HUGGINGFACE_HUB_CACHE", "HF_HOME"),
                                   ("HF_HOME", "XDG_CACHE_HOME"), HF_VARS])
def test_several_cache_variables_at_once_resolve_as_huggingface_hub_does(tmp_path, names):
    """Each variable points at its own cache holding the repo with a config that names the variable: the one
    read must be the one huggingface_hub finds, for every combination of variables set together."""
    repo_id = "someone/DeepSeek-V4-Flash-NVFP4"
    env = clean_env(tmp_path / "home")
    hub_of = {"HF_HUB_CACHE": lambda r: r, "HUGGINGFACE_HUB_CACHE": lambda r: r, "HF_HOME": lambda r: r / "hub",
              "XDG_CACHE_HOME": lambda r: r / "huggingface" / "hub"}
    for name in names:
        root = tmp_path / name
        hf_cache(hub_of[name](root), repo_id, dict(NVFP4, which=name))
        env[name] = str(root)
    found = hub_answer(env, repo_id)
    assert found.startswith(str(tmp_path)), found
    mc = M.read(repo_id, env)
    assert mc.where == "hub-cache" and mc.source.endswith(f"({found})"), (mc.source, found)
    assert mc.config == json.loads(Path(found).read_text())
    # and the first variable of huggingface_hub's order among those set is the one that won
    assert mc.config["which"] == next(v for v in HF_VARS if v in names)


def test_the_process_environment_is_the_default(tmp_path, monkeypatch):
    """Without an explicit environment, read() and hub_cache_dir() look where os.environ says."""
    repo_id = "someone/from-the-process-env"
    snap = hf_cache(tmp_path / "hub", repo_id, MXFP4)
    for k in HF_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert M.hub_cache_dir() == tmp_path / "hub"
    mc = M.read(repo_id)
    assert mc.where == "hub-cache" and mc.directory == snap and mc.moe_format == "mxfp4"


def test_an_environment_without_home_falls_back_to_this_users_home(tmp_path, monkeypatch):
    """An explicit environment with none of the variables and no HOME: ~/.cache/huggingface/hub of the process's
    own HOME, where huggingface_hub looks with that HOME."""
    home = tmp_path / "home"
    repo_id = "someone/in-home"
    hf_cache(home / ".cache" / "huggingface" / "hub", repo_id, MXFP4)
    monkeypatch.setenv("HOME", str(home))
    found = hub_answer(clean_env(home), repo_id)
    assert M.hub_cache_dir({}) == Path(found).parents[3]
    assert M.read(repo_id, {}).source.endswith(f"({found})")


def test_variables_with_user_and_environment_references_are_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MC_TEST_CACHE_ROOT", str(tmp_path / "r"))
    assert M.hub_cache_dir({"HF_HUB_CACHE": "~/hubdir"}) == tmp_path / "hubdir"
    assert M.hub_cache_dir({"HF_HOME": "$MC_TEST_CACHE_ROOT/hf"}) == tmp_path / "r" / "hf" / "hub"


@pytest.mark.parametrize("ref, make", [
    ("feedface", False),          # refs/main names a revision whose snapshot is not there
    ("", True),                   # an empty ref (snapshots/ itself is a directory)
    ("a/b", True),                # a ref with a slash, even where that path exists
    ("../../elsewhere", True),    # a ref that climbs out of snapshots/
])
def test_a_ref_naming_no_usable_snapshot_is_not_cached(tmp_path, ref, make):
    hub = tmp_path / "hub"
    snap = hf_cache(hub, "someone/odd-ref", MXFP4)
    snapshots = snap.parent
    (snapshots.parent / "refs" / "main").write_text(ref + "\n")
    if make and ref:
        (snapshots / ref).mkdir(parents=True, exist_ok=True)
        (snapshots / ref / "config.json").write_text(json.dumps(MXFP4))
    assert M.hub_snapshot("someone/odd-ref", {"HF_HUB_CACHE": str(hub)}) is None
    assert M.read("someone/odd-ref", {"HF_HUB_CACHE": str(hub)}).where == "hub"


def test_a_ref_with_a_trailing_newline_is_the_revision(tmp_path):
    snap = hf_cache(tmp_path / "hub", "someone/nl", MXFP4, rev="abc123")
    (snap.parent.parent / "refs" / "main").write_text("abc123\n")
    assert M.hub_snapshot("someone/nl", {"HF_HUB_CACHE": str(tmp_path / "hub")}) == snap


def test_a_config_json_that_is_a_directory_is_not_readable(tmp_path):
    d = tmp_path / "ckpt"
    (d / "config.json").mkdir(parents=True)
    mc = M.read(str(d))
    assert mc.problems() == [f"MODEL_PATH={d} has no readable config.json"] and mc.config is None


@pytest.mark.parametrize("qc, fmt", [
    ({"moe_quant_algo": "NVFP4"}, "nvfp4"),
    ({"moe_quant_algo": "nvfp4"}, "nvfp4"),       # SGLang compares str(...).upper() == "NVFP4" (configs/model_config.py)
    ({"moe_quant_algo": "NvFp4"}, "nvfp4"),
    ({"moe_quant_algo": "NVFP4 "}, "mxfp4"),      # not the marker: SGLang does not strip either
    ({"moe_quant_algo": "FP8"}, "mxfp4"),
    ({"quant_method": "fp8"}, "mxfp4"),
    (None, "mxfp4"),
    (["NVFP4"], "mxfp4"),                         # not a mapping: nothing to read the marker from
    ("NVFP4", "mxfp4"),
])
def test_the_nvfp4_marker(tmp_path, qc, fmt):
    assert M.moe_format_of({"quantization_config": qc}) == fmt
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "quantization_config": qc}))
    assert M.read(str(d)).moe_format == fmt


def test_every_field_of_each_kind_of_answer(tmp_path):
    """What each answer says it read and where, field by field (messages quote ``source``)."""
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    f = tmp_path / "file"
    f.write_text("x")
    got = M.read(str(f), env)
    assert (got.model_path, got.where, got.config, got.source, got.directory, got.has_dspark_subfolder) == \
        (str(f), "local", None, "", None, False)

    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(NVFP4))
    got = M.read(str(d), env)
    assert (got.model_path, got.where, got.config, got.source, got.problem, got.directory,
            got.has_dspark_subfolder) == (str(d), "local", NVFP4, str(d / "config.json"), None, d, False)

    got = M.read("not an id", env)
    assert (got.model_path, got.where, got.config, got.source, got.directory, got.has_dspark_subfolder) == \
        ("not an id", "invalid", None, "", None, False)

    snap = hf_cache(tmp_path / "hub", "someone/cached", "{broken")
    got = M.read("someone/cached", env)
    cfg = snap / "config.json"
    assert (got.model_path, got.where, got.config, got.directory, got.has_dspark_subfolder) == \
        ("someone/cached", "hub-cache", None, snap, False)
    assert got.source == f"config.json in the local Hugging Face cache ({cfg})"
    assert got.problem.startswith(f"MODEL_PATH=someone/cached: config.json in the Hugging Face cache ({cfg}) "
                                  f"is not valid JSON (")

    got = M.read("deepseek-ai/DeepSeek-V4-Flash", env)
    assert (got.model_path, got.where, got.directory, got.has_dspark_subfolder, got.problem) == \
        ("deepseek-ai/DeepSeek-V4-Flash", "published", None, False, None)
    assert got.source == "the published config.json of this Hub id, not in the local Hugging Face cache"

    got = M.read("someone/unknown", env)
    assert (got.model_path, got.where, got.config, got.directory, got.has_dspark_subfolder, got.problem) == \
        ("someone/unknown", "hub", None, None, False, None)
    assert got.source == "a Hub id not in the local Hugging Face cache"


# The fields the serve plan reads from the published config.json of each known Hub checkpoint, as those files give
# them (docs/speculative.md quotes the DSpark block size and target layers): a dry run or a first start before the
# download must choose the flags the real config would.
PUBLISHED_CONFIGS = {
    "deepseek-ai/DeepSeek-V4-Flash": {"num_nextn_predict_layers": 1},
    "deepseek-ai/DeepSeek-V4-Flash-0731": {"dspark_block_size": 5, "dspark_noise_token_id": 128799,
                                           "dspark_target_layer_ids": [40, 41, 42]},
}


@pytest.mark.parametrize("repo_id", sorted(PUBLISHED_CONFIGS))
def test_published_ids_carry_their_published_fields(tmp_path, repo_id):
    got = M.read(repo_id, {"HF_HUB_CACHE": str(tmp_path / "empty")})
    assert got.where == "published" and got.config == PUBLISHED_CONFIGS[repo_id]
    got.config["scratch"] = 1                     # a copy: the next read is not affected
    assert "scratch" not in M.read(repo_id, {"HF_HUB_CACHE": str(tmp_path / "empty")}).config
