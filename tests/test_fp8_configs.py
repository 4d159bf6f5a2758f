"""Tuned FP8 block-GEMM configs: shipped files, the lookup patch 0004 adds, and the serve-side backend choice."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_sm120 import fp8_configs as fc
from dsv4_sm120.sglang_glue import fp8 as glue_fp8
from glue_fixtures import sglang_with_manifest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
H200 = "NVIDIA H200"


def _sglang_kernel_source() -> str:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin, "sglang is not installed in the test environment"
    return (Path(spec.origin).parent / "kernels" / "ops" / "gemm" / "fp8_kernel.py").read_text()


def _sglang_name_template() -> str:
    """The f-string SGLang 0.5.23 itself builds the block-FP8 config file name with (read from its source)."""
    src = _sglang_kernel_source()
    body = src[src.index("def get_w8a8_block_fp8_configs("):]
    body = body[: body.index("\ndef ", 10)]
    m = re.search(r'json_file_name = f"([^"]+)"', body)
    assert m, "could not find SGLang's config file name template"
    assert 'device_name = get_device_name().replace(" ", "_")' in body
    return m.group(1)


def _sglang_name(N, K, dev_raw, bn=128, bk=128) -> str:
    t = _sglang_name_template()
    return eval("f" + repr(t), {}, {"N": N, "K": K, "device_name": dev_raw.replace(" ", "_"),
                                    "block_n": bn, "block_k": bk})


def _tuned_files():
    return sorted(p for p in (CONFIGS / "fp8").rglob("*.json") if not p.name.startswith("summary_"))


# --------------------------------------------------------------------------- shipped files

def test_configs_dir_has_tuned_h200_files():
    files = _tuned_files()
    names = {p.name for p in files}
    for N, K in [(1536, 4096), (8192, 1024), (4096, 2048), (1024, 4096), (4096, 512), (4096, 4096)]:
        assert _sglang_name(N, K, H200) in names, (N, K)
    assert (CONFIGS / "fp8" / "summary_NVIDIA_H200.json").is_file()
    assert (CONFIGS / "fp8" / "summary_NVIDIA_H200.md").is_file()


@pytest.mark.parametrize("path", _tuned_files(), ids=lambda p: p.name[:40])
def test_every_config_has_sglang_name_and_schema(path: Path):
    info = fc.parse_config_file_name(path.name)
    assert info is not None, f"{path.name} is not a block-FP8 config name"
    # the name SGLang's own code would build for this shape/device is exactly this file's name
    assert _sglang_name(info["N"], info["K"], str(info["device_name"]), info["block_n"], info["block_k"]) == path.name
    assert " " not in path.name.split("device_name=")[1].split(",")[0]
    table = json.loads(path.read_text())
    fc.validate_config_table(table, block_k=int(info["block_k"]))
    # SGLang reads keys with int(key) and picks the nearest M: keys must be distinct ints
    assert len({int(k) for k in table}) == len(table)
    for cfg in table.values():
        for k in fc.REQUIRED_KEYS:
            assert type(cfg[k]) is int


def test_summary_consistent_with_jsons():
    s = json.loads((CONFIGS / "fp8" / "summary_NVIDIA_H200.json").read_text())
    assert s["device_name"] == "NVIDIA_H200" and s["schema"] == 1
    ratios_small = []
    for key, sh in s["shapes"].items():
        assert sh["complete"]
        table = json.loads((CONFIGS / "fp8" / sh["config_file"]).read_text())
        assert set(table) == set(sh["rows"])
        for m, row in sh["rows"].items():
            assert table[m] == row["best_config"], (key, m)
            assert row["best_us"] > 0 and row["sglang_default_cfg_us"] > 0
            if int(m) <= 64:
                ratios_small.append(row["sglang_default_cfg_us"] / row["best_us"])
    gm = math.exp(sum(map(math.log, ratios_small)) / len(ratios_small))
    assert gm == pytest.approx(s["comparison"]["tuned_vs_sglang_default_cfg_geomean_m_le_64"], rel=2e-3)


# --------------------------------------------------------------------------- pure helpers

def test_config_file_name_matches_sglang_template():
    for dev in [H200, "NVIDIA RTX PRO 6000 Blackwell Server Edition", "NVIDIA H100 80GB HBM3"]:
        for N, K in [(1536, 4096), (4096, 512)]:
            assert fc.config_file_name(N, K, dev) == _sglang_name(N, K, dev)
            assert fc.parse_config_file_name(fc.config_file_name(N, K, dev))["N"] == N
    assert fc.parse_config_file_name("N=1,K=2,device_name=X,dtype=fp8_w8a8,block_shape=[128,128].json") is None
    assert fc.parse_config_file_name("N=1,K=2,device_name=X,dtype=int8_w8a8,block_shape=[128, 128].json") is None
    # the tuner writes with the same implementation the lookup reads with
    from dsv4_sm120 import fp8_configs as cf

    for name in ("config_file_name", "parse_config_file_name", "validate_config_table", "summary_file_stem"):
        assert getattr(fc, name) is getattr(cf, name), name


GOOD = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
        "num_stages": 3}


@pytest.mark.parametrize("bad", [
    {},
    {"1": dict(GOOD, BLOCK_SIZE_K=256)},          # K tile straddles two scale blocks: wrong results
    {"1": dict(GOOD, BLOCK_SIZE_K=96)},
    {"1": {k: v for k, v in GOOD.items() if k != "num_stages"}},
    {"1": dict(GOOD, num_warps=True)},
    {"1": dict(GOOD, BLOCK_SIZE_N=48)},
    {"1": dict(GOOD, BLOCK_SIZE_M=8)},
    {"0": GOOD},
    {"x": GOOD},
    {"1": dict(GOOD, SPLIT_K=3)},
    {"1": dict(GOOD, SWAP_AB=1)},
    {"1": dict(GOOD, EXTRA=1)},
    {"1": [GOOD]},
])
def test_validate_rejects_adversarial_tables(bad):
    with pytest.raises(ValueError):
        fc.validate_config_table(bad)


def test_validate_accepts_hopper_keys():
    fc.validate_config_table({"1": dict(GOOD, SWAP_AB=True, SPLIT_K=4), "64": dict(GOOD, BLOCK_SIZE_K=64)})


def test_project_dir_order(tmp_path, monkeypatch):
    repo, root = sglang_with_manifest(tmp_path)
    monkeypatch.delenv(fc.ENV_CONFIG_DIR, raising=False)
    # fixed at apply time: the manifest's repo_root wins over the overlay's own checkout
    assert fc.project_config_dir(root) == repo / "configs" / "fp8"
    # env var overrides; empty switches the project dir off; a missing dir falls back to SGLang's own
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setenv(fc.ENV_CONFIG_DIR, str(other))
    assert fc.project_config_dir(root) == other
    monkeypatch.setenv(fc.ENV_CONFIG_DIR, "")
    assert fc.project_config_dir(root) is None
    monkeypatch.setenv(fc.ENV_CONFIG_DIR, str(tmp_path / "nope"))
    assert fc.project_config_dir(root) is None
    # no manifest: the overlay's checkout (this repo) is used
    monkeypatch.delenv(fc.ENV_CONFIG_DIR)
    assert fc.project_config_dir(tmp_path / "nosite") == REPO / "configs" / "fp8"


def test_project_config_path_skips_invalid_and_path_tricks(tmp_path, monkeypatch):
    monkeypatch.setenv(fc.ENV_CONFIG_DIR, str(tmp_path))
    name = fc.config_file_name(1024, 4096, "Fake GPU")
    assert glue_fp8.project_config_path(name) is None                       # absent
    (tmp_path / name).write_text(json.dumps({"1": GOOD}))
    assert glue_fp8.project_config_path(name) == str(tmp_path / name)
    (tmp_path / name).write_text(json.dumps({"1": dict(GOOD, BLOCK_SIZE_K=256)}))
    assert glue_fp8.project_config_path(name) is None                       # invalid -> SGLang's own
    (tmp_path / name).write_text("{not json")
    assert glue_fp8.project_config_path(name) is None
    assert glue_fp8.project_config_path("../" + name) is None


def test_a_config_dir_setting_that_cannot_be_expanded_never_reaches_sglang(tmp_path, monkeypatch, caplog):
    from dsv4_sm120 import settings

    bad = "~nosuchuser_dsv4/x"
    problems = settings.validate({fc.ENV_CONFIG_DIR: bad})      # refused at start-up, as it would be used
    assert len(problems) == 1 and problems[0].startswith(f"{fc.ENV_CONFIG_DIR}='{bad}' is not valid: "
                                                         "~nosuchuser_dsv4 is not a user's home directory"), problems
    monkeypatch.setenv(fc.ENV_CONFIG_DIR, bad)
    monkeypatch.setattr(glue_fp8, "_warned", set())            # warned once per process: a fresh process here
    name = fc.config_file_name(1024, 4096, "Fake GPU")
    with caplog.at_level("WARNING"):
        assert glue_fp8.project_config_path(name) is None       # SGLang's own configs; no RuntimeError
        assert glue_fp8.project_config_path(name) is None
    assert len([x for x in caplog.messages if "FP8 GEMM config lookup failed" in x]) == 1, caplog.messages
    with pytest.raises(ValueError, match=fc.ENV_CONFIG_DIR):   # tools get the setting's one line
        fc.project_config_dir()
    # any other failure of the lookup keeps SGLang's own configs too
    monkeypatch.setenv(fc.ENV_CONFIG_DIR, str(tmp_path))
    monkeypatch.setattr(fc, "project_config_dir", lambda root=None: (_ for _ in ()).throw(OSError(5, "EIO")))
    assert glue_fp8.project_config_path(name) is None


# --------------------------------------------------------------------------- backend recommendation

def _summary(tmp_path, decision, complete=True, dev="Fake GPU"):
    d = tmp_path / "cfg"
    d.mkdir(exist_ok=True)
    s = {"schema": 1, "device_name": fc.sglang_device_name(dev), "decision": decision,
         "shapes": {"N=1,K=1": {"complete": complete}}}
    (d / (fc.summary_file_stem(dev) + ".json")).write_text(json.dumps(s))
    return d


def test_recommendation(tmp_path, monkeypatch):
    monkeypatch.delenv(fc.ENV_BACKEND, raising=False)
    d = _summary(tmp_path, {"recommended_backend": "triton", "reason": "faster"})
    assert fc.recommended_fp8_gemm_backend("Fake GPU", d) == ("triton", "faster")
    assert fc.recommended_fp8_gemm_backend("Other GPU", d)[0] is None          # no summary for that device
    d = _summary(tmp_path, {"recommended_backend": "triton", "reason": "faster"}, complete=False)
    assert fc.recommended_fp8_gemm_backend("Fake GPU", d)[0] is None          # incomplete tuning
    d = _summary(tmp_path, {"recommended_backend": None, "reason": "cutlass wins"})
    assert fc.recommended_fp8_gemm_backend("Fake GPU", d) == (None, "cutlass wins")
    monkeypatch.setenv(fc.ENV_BACKEND, "triton")
    assert fc.recommended_fp8_gemm_backend("Fake GPU", d)[0] == "triton"      # override
    monkeypatch.setenv(fc.ENV_BACKEND, "auto")
    assert fc.recommended_fp8_gemm_backend("Fake GPU", d)[0] is None
    monkeypatch.setenv(fc.ENV_BACKEND, "triton; rm -rf /")
    with pytest.raises(ValueError):
        fc.recommended_fp8_gemm_backend("Fake GPU", d)


def test_h200_summary_recommends_default_since_deepgemm_untimed(monkeypatch):
    monkeypatch.delenv(fc.ENV_BACKEND, raising=False)
    b, reason = fc.recommended_fp8_gemm_backend(H200, CONFIGS / "fp8")
    assert b is None and "not timed" in reason


def test_backend_args_cli(tmp_path):
    d = _summary(tmp_path, {"recommended_backend": "triton", "reason": "faster"})
    env = {"PYTHONPATH": str(REPO / "overlay"), "PATH": "/usr/bin:/bin"}
    run = lambda *a, **kw: subprocess.run([sys.executable, "-m", "dsv4_sm120.fp8_configs", *a], capture_output=True,
                                          text=True, env={**env, **kw.get("extra", {})})
    r = run("backend-args", "--device-name", "Fake GPU", "--config-dir", str(d), "--explain")
    assert r.returncode == 0 and r.stdout.strip() == "--fp8-gemm-backend triton" and "faster" in r.stderr
    r = run("backend-args", "--device-name", "Other GPU", "--config-dir", str(d))
    assert r.returncode == 0 and r.stdout.strip() == ""
    r = run("backend-args", "--device-name", "Fake GPU", extra={"DSV4_SM120_FP8_GEMM_BACKEND": "bad name!"})
    assert r.returncode == 2 and "error:" in r.stderr and "Traceback" not in r.stderr
    assert run("--help").returncode == 0


# --------------------------------------------------------------------------- patched SGLang (patch 0004)

LOOKUP = r"""
import json, os, sys
import sglang.kernels.ops.gemm.fp8_kernel as fk
out = {}
def look(tag, dev, N, K, env=None):
    if env is None:
        os.environ.pop("DSV4_SM120_FP8_CONFIG_DIR", None)
    else:
        os.environ["DSV4_SM120_FP8_CONFIG_DIR"] = env
    fk.get_device_name = lambda device_id=0: dev
    fk.get_w8a8_block_fp8_configs.cache_clear()
    r = fk.get_w8a8_block_fp8_configs(N, K, 128, 128)
    out[tag] = None if r is None else {str(k): v for k, v in r.items()}
args = json.loads(sys.argv[1]) if len(sys.argv) > 1 else json.loads(os.environ["LOOKUP_ARGS"])
for a in args:
    look(*a)
print("RESULT " + json.dumps(out))
"""


def _lookup(run_patched, cases, overlay=True):
    r = run_patched(LOOKUP, env={"LOOKUP_ARGS": json.dumps(cases)}, overlay=overlay)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert line, r.stdout + r.stderr[-2000:]
    return json.loads(line[-1][7:]), r


def _shipped(N, K, dev):
    spec = importlib.util.find_spec("sglang")
    p = Path(spec.origin).parent / "kernels" / "ops" / "gemm" / "configs" / fc.config_file_name(N, K, dev)
    return json.loads(p.read_text()) if p.is_file() else None


def test_patched_lookup_prefers_project_then_falls_back(run_patched, tmp_path):
    ours = json.loads((CONFIGS / "fp8" / fc.config_file_name(4096, 512, H200)).read_text())
    sglang_own = _shipped(4096, 512, H200)
    assert sglang_own is not None and sglang_own != ours   # SGLang ships an H200 file for this shape too
    assert _shipped(7168, 2048, H200) is not None and not (CONFIGS / "fp8" / fc.config_file_name(7168, 2048, H200)).exists()
    # a fresh random config for a device only a custom directory knows
    rnd = random.Random()
    custom = {str(m): dict(GOOD, BLOCK_SIZE_N=rnd.choice([32, 64, 128]), num_stages=rnd.randint(2, 5),
                           GROUP_SIZE_M=rnd.randint(1, 64)) for m in (1, rnd.randint(2, 4000))}
    cdir = tmp_path / "custom"
    cdir.mkdir()
    rtx = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    (cdir / fc.config_file_name(1536, 4096, rtx)).write_text(json.dumps(custom))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / fc.config_file_name(4096, 512, H200)).write_text(json.dumps({"1": dict(GOOD, BLOCK_SIZE_K=256)}))
    res, r = _lookup(run_patched, [
        ["project", H200, 4096, 512],
        ["sglang_only_shape", H200, 7168, 2048],
        ["other_device", "NVIDIA H100 80GB HBM3", 4096, 512],
        ["nowhere", "Fake GPU", 4096, 512],
        ["env_off", H200, 4096, 512, ""],
        ["env_custom", rtx, 1536, 4096, str(cdir)],
        ["env_custom_miss", H200, 4096, 512, str(cdir)],
        ["env_bad_file", H200, 4096, 512, str(bad)],
    ])
    assert res["project"] == ours
    assert res["sglang_only_shape"] == _shipped(7168, 2048, H200)
    h100 = _shipped(4096, 512, "NVIDIA H100 80GB HBM3")
    assert h100 is not None and h100 != ours and res["other_device"] == h100
    assert res["nowhere"] is None
    assert res["env_off"] == sglang_own
    assert res["env_custom"] == custom
    assert res["env_custom_miss"] == sglang_own
    assert res["env_bad_file"] == sglang_own


def test_patched_lookup_without_overlay_is_stock(run_patched):
    res, _ = _lookup(run_patched, [["project", H200, 4096, 512]], overlay=False)
    assert res["project"] == _shipped(4096, 512, H200)
