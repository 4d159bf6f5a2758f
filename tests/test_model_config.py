"""dsv4_sm120.model_config: MODEL_PATH's config.json from a local directory, from the local Hugging Face cache
(found where huggingface_hub itself looks, checked against the library), or the published fields of a known
Hub id; and the problems the serve preflight refuses with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "overlay"))
from dsv4_sm120 import model_config as M  # noqa: E402

NVFP4 = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
         "quantization_config": {"quant_method": "fp8", "moe_quant_algo": "NVFP4"}}
MXFP4 = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "num_nextn_predict_layers": 1,
         "quantization_config": {"quant_method": "fp8"}}


def hf_cache(hub: Path, repo_id: str, config, rev: str = "0123456789abcdef", files: dict | None = None) -> Path:
    """A Hugging Face hub cache (``hub`` is the ``.../hub`` directory) holding ``repo_id``'s ``main`` revision with
    this config.json (a dict, or text written as is) and ``files`` ({relative path: text}); the snapshot dir."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    (snap / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    for rel, text in (files or {}).items():
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        (snap / rel).write_text(text)
    return snap


# huggingface_hub's own answer: where try_to_load_from_cache finds the file under this environment (its constants
# are read at import, hence a child process per environment).
HUB_LOOKUP = "import sys; from huggingface_hub import try_to_load_from_cache as f; print(f(sys.argv[1], 'config.json'))"


@pytest.mark.parametrize("var", ["HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "HOME"])
def test_cache_is_where_huggingface_hub_looks(tmp_path, var):
    repo_id = "someone/DeepSeek-V4-Flash-NVFP4"
    root = tmp_path / "root"
    hub = {"HF_HUB_CACHE": root, "HUGGINGFACE_HUB_CACHE": root, "HF_HOME": root / "hub",
           "XDG_CACHE_HOME": root / "huggingface" / "hub", "HOME": root / ".cache" / "huggingface" / "hub"}[var]
    snap = hf_cache(hub, repo_id, NVFP4)
    env = {k: v for k, v in os.environ.items() if k not in
           ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "HF_HUB_OFFLINE")}
    env["HOME"] = str(tmp_path / "home")
    env[var] = str(root)
    r = subprocess.run([sys.executable, "-c", HUB_LOOKUP, repo_id], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(snap / "config.json"), (var, r.stdout)
    mc = M.read(repo_id, env)
    assert mc.where == "hub-cache" and str(snap / "config.json") in mc.source, mc
    assert mc.config == NVFP4 and mc.moe_format == "nvfp4" and mc.problems() == []


def test_local_directories_and_their_problems(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    assert M.read(str(d)).problems() == [f"MODEL_PATH={d} has no readable config.json"]
    (d / "config.json").write_text("{oops")
    (p,) = M.read(str(d)).problems()
    assert p.startswith(f"MODEL_PATH={d}: config.json is not valid JSON (")
    (d / "config.json").write_text("[1, 2]")
    assert M.read(str(d)).problems() == [f"MODEL_PATH={d}: config.json is not a JSON object"]
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (p,) = M.read(str(d)).problems()
    assert "model_type is 'llama', expected deepseek_v4" in p and M.read(str(d)).moe_format is None
    (d / "config.json").write_text(json.dumps(NVFP4))
    mc = M.read(str(d))
    assert mc.where == "local" and mc.problems() == [] and mc.moe_format == "nvfp4" and not mc.has_dspark_subfolder
    (d / "config.json").write_text(json.dumps(MXFP4))
    (d / "dspark").mkdir()
    (d / "dspark" / "config.json").write_text("{}")
    mc = M.read(str(d))
    assert mc.moe_format == "mxfp4" and mc.has_dspark_subfolder
    f = tmp_path / "file"
    f.write_text("x")
    assert M.read(str(f)).problems() == [f"MODEL_PATH={f} is not a directory"]
    for bad in (str(tmp_path / "missing"), "./rel/missing", "~/nope-dsv4", "not an id", "a/b/c"):
        mc = M.read(bad)
        assert mc.where == "invalid" and mc.problems() == [
            f"MODEL_PATH={bad} does not exist and is not a Hugging Face id (org/name)"], bad


def test_hub_ids_cached_published_or_unknown(tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    unknown = M.read("someone/unknown-v4", env)
    assert unknown.where == "hub" and unknown.config is None and unknown.problems() == []
    assert unknown.moe_format is None                                    # not MXFP4 by default
    flash = M.read("deepseek-ai/DeepSeek-V4-Flash", env)
    assert flash.where == "published" and flash.moe_format == "mxfp4" and flash.problems() == []
    dspark = M.read("deepseek-ai/DeepSeek-V4-Flash-0731", env)
    assert dspark.where == "published" and dspark.config["dspark_block_size"] == 5 and dspark.moe_format is None
    # the cache wins over the published fields, and its problems are the model check's
    hf_cache(tmp_path / "hub", "deepseek-ai/DeepSeek-V4-Flash", NVFP4)
    assert M.read("deepseek-ai/DeepSeek-V4-Flash", env).moe_format == "nvfp4"
    hf_cache(tmp_path / "hub", "someone/llama", {"model_type": "llama"})
    (p,) = M.read("someone/llama", env).problems()
    assert "model_type is 'llama'" in p and "in the local Hugging Face cache" in p
    hf_cache(tmp_path / "hub", "someone/garbage", "not json", files={"dspark/config.json": "{}"})
    (p,) = M.read("someone/garbage", env).problems()
    assert "is not valid JSON" in p and "Hugging Face cache" in p
    # refs/main naming a revision that is not there: not cached
    snap = hf_cache(tmp_path / "hub", "someone/moved", MXFP4)
    (snap.parent.parent / "refs" / "main").write_text("feedface")
    assert M.read("someone/moved", env).where == "hub"
    sub = hf_cache(tmp_path / "hub", "someone/dspark-sub", MXFP4, files={"dspark/config.json": "{}"})
    mc = M.read("someone/dspark-sub", env)
    assert mc.has_dspark_subfolder and mc.directory == sub
