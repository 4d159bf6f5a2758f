"""serve/serve_dsv4_mtp.sh picks the draft the checkpoint carries (DSpark head or MTP layer).

Checkpoint fixtures are config.json files only (the dry run needs no weights). The printed
prefill/decode commands are parsed and resolved by SGLang 0.5.23's own ``prepare_server_args`` /
``resolve_once``, and the classification is checked against SGLang's own detection functions
(``checkpoint_bundles_dspark_draft``, ``_target_checkpoint_dspark_subfolder``).
"""

from __future__ import annotations

import json
import random
import re
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_serve_dryrun import commands, dry_run, server_argv, validate, write_dsv4_config  # noqa: E402

DSPARK_0731 = {"dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [40, 41, 42],
               "dspark_markov_rank": 64, "num_nextn_predict_layers": 0}
BLOCK = random.Random().randint(2, 9)          # a fresh block size each run: the flags must follow the config


def config_dir(d: Path, text: str) -> Path:
    d.mkdir()
    (d / "config.json").write_text(text)
    return d


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    sub = write_dsv4_config(root / "dspark_sub", num_nextn_predict_layers=0)
    (sub / "dspark").mkdir()
    (sub / "dspark" / "config.json").write_text(json.dumps({"architectures": ["DSparkDraftModel"],
                                                             "dspark_config": {"block_size": 4}}))
    return {
        "mtp": write_dsv4_config(root / "mtp"),                                      # V4-Flash: 1 MTP layer
        "dspark": write_dsv4_config(root / "dspark", **dict(DSPARK_0731, dspark_block_size=BLOCK)),
        "both": write_dsv4_config(root / "both", **dict(DSPARK_0731, num_nextn_predict_layers=1)),
        "dspark_sub": sub,
        "none": write_dsv4_config(root / "none", num_nextn_predict_layers=0),
        "empty_dir": (root / "empty_dir").mkdir() or root / "empty_dir",
        "hf_home": (root / "hf").mkdir() or root / "hf",
        "garbage": config_dir(root / "garbage", "{not json"),
        "llama": config_dir(root / "llama", json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})),
        "missing": root / "no" / "such" / "checkpoint",
    }


def run(ckpts, model, extra=None, check=True):
    # config.json-only checkpoints: the model check (which reads the shards) has its own tests
    env = {"MODEL_PATH": str(model), "HF_HOME": str(ckpts["hf_home"]), "HF_HUB_OFFLINE": "1",
           "PREFLIGHT_SKIP": "patches,model"}
    env.update(extra or {})
    return dry_run("serve_dsv4_mtp.sh", env, check=check)


def spec_of(out: str):
    cmds = commands(out)
    p, d = cmds["prefill"][1], cmds["decode"][1]
    i, j = p.index("--speculative-algorithm"), d.index("--speculative-algorithm")
    assert p[i:] == d[j:j + len(p) - i], (p[i:], d[j:])       # identical flags on both sides of PD
    return p[i:]


SGLANG_DETECT = textwrap.dedent(r"""
    import json, sys
    from sglang.srt.speculative.dspark_components.dspark_config import checkpoint_bundles_dspark_draft
    from sglang.srt.arg_groups.speculative_hook import _target_checkpoint_dspark_subfolder
    out = {}
    for name, path in json.load(sys.stdin).items():
        cfg = json.load(open(path + "/config.json"))
        out[name] = {"bundled": checkpoint_bundles_dspark_draft(cfg),
                     "subfolder": _target_checkpoint_dspark_subfolder(path, None, None) is not None,
                     "nextn": int(cfg.get("num_nextn_predict_layers") or 0)}
    print("RESULT" + json.dumps(out))
""")


def test_classification_agrees_with_sglangs_own_detection(ckpts, python_child):
    names = ("mtp", "dspark", "both", "dspark_sub", "none")
    r = python_child(SGLANG_DETECT, input=json.dumps({n: str(ckpts[n]) for n in names}), timeout=300, cwd="/tmp")
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert line, r.stderr[-3000:]
    ref = json.loads(line[-1][len("RESULT"):])
    for n in names:
        want = "DSPARK" if ref[n]["bundled"] or ref[n]["subfolder"] else "EAGLE" if ref[n]["nextn"] > 0 else None
        res = run(ckpts, ckpts[n], check=False)
        if want is None:
            assert res.returncode == 2 and "carries no draft model" in res.stderr, (n, res.stderr)
            assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
        else:
            assert res.returncode == 0, (n, res.stderr)
            assert spec_of(res.stdout)[1] == want, (n, spec_of(res.stdout))


def test_both_checkpoints_resolve_with_sglang(ckpts, python_child):
    outs = {n: run(ckpts, ckpts[n]).stdout for n in ("mtp", "dspark")}
    jobs, names = [], []
    for n, out in outs.items():
        for role in ("prefill", "decode"):
            jobs.append({"argv": server_argv(commands(out)[role][1]), "resolve": str(ckpts[n])})
            names.append((n, role))
    res = dict(zip(names, validate(python_child, jobs)))
    for (n, role), r in res.items():
        assert r["ok"] and r.get("resolved") and r["mode"] == role and r["metrics"] is True, (n, role, r)
        if n == "mtp":
            assert (r["spec"], r["spec_steps"], r["spec_topk"], r["spec_draft"]) == ("EAGLE", 3, 1, 4), r
        else:
            # the draft is bundled: SGLang points the draft path at the target; one step, block + 1 verified
            assert (r["spec"], r["spec_steps"], r["spec_topk"]) == ("DSPARK", 1, 1), r
            assert r["dspark_block"] == BLOCK and r["spec_draft"] == BLOCK + 1, (BLOCK, r)
            assert r["spec_draft_path"] == str(ckpts[n]), r
    assert f"block size {BLOCK} (the checkpoint's dspark_block_size)" in outs["dspark"]
    assert "# speculative decoding: EAGLE chosen from " in outs["mtp"]


def test_dspark_wins_when_the_checkpoint_also_has_nextn_layers(ckpts):
    assert spec_of(run(ckpts, ckpts["both"]).stdout)[:4] == ["--speculative-algorithm", "DSPARK",
                                                             "--speculative-dspark-block-size", "5"]
    # a dspark/ subfolder without prefixed keys: no block size to read, SGLang resolves it from the draft config
    assert spec_of(run(ckpts, ckpts["dspark_sub"]).stdout) == ["--speculative-algorithm", "DSPARK", "--enable-metrics"]


def test_knobs_override_the_defaults(ckpts):
    s = spec_of(run(ckpts, ckpts["dspark"], {"SPEC_DSPARK_BLOCK_SIZE": "3"}).stdout)
    assert s[s.index("--speculative-dspark-block-size") + 1] == "3"
    s = spec_of(run(ckpts, ckpts["dspark"], {"SPEC_NUM_DRAFT_TOKENS": "4"}).stdout)
    assert s[s.index("--speculative-dspark-block-size") + 1] == "3"
    s = spec_of(run(ckpts, ckpts["mtp"], {"SPEC_NUM_STEPS": "2"}).stdout)
    assert s[s.index("--speculative-num-draft-tokens") + 1] == "3" and s[s.index("--speculative-num-steps") + 1] == "2"
    s = spec_of(run(ckpts, ckpts["mtp"], {"SPEC_NUM_DRAFT_TOKENS": "6"}).stdout)
    assert s[s.index("--speculative-num-steps") + 1] == "5"
    # Hub ids: no download in a dry run; the two published checkpoints are known
    s = spec_of(run(ckpts, "deepseek-ai/DeepSeek-V4-Flash-0731").stdout)
    assert s[:4] == ["--speculative-algorithm", "DSPARK", "--speculative-dspark-block-size", "5"]
    assert spec_of(run(ckpts, "deepseek-ai/DeepSeek-V4-Flash").stdout)[1] == "EAGLE"
    s = spec_of(run(ckpts, "someone/unknown-v4", {"SPEC_ALGORITHM": "dspark"}).stdout)
    assert s == ["--speculative-algorithm", "DSPARK", "--enable-metrics"]


@pytest.mark.parametrize("model,env,needle", [
    ("none", {}, "carries no draft model"),
    ("empty_dir", {}, "no readable config.json"),
    ("dspark", {"SPEC_ALGORITHM": "EAGLE"}, "carries a DSpark head"),
    ("mtp", {"SPEC_ALGORITHM": "DSPARK"}, "carries no DSpark head"),
    ("none", {"SPEC_ALGORITHM": "NEXTN"}, "has no MTP layer"),
    ("dspark", {"SPEC_NUM_STEPS": "3"}, "SPEC_NUM_STEPS=3"),
    ("dspark", {"SPEC_NUM_DRAFT_TOKENS": "4", "SPEC_DSPARK_BLOCK_SIZE": "5"}, "block + 1 = 6"),
    ("mtp", {"SPEC_DSPARK_BLOCK_SIZE": "5"}, "DSpark only"),
    ("mtp", {"SPEC_ALGORITHM": "medusa"}, "SPEC_ALGORITHM='medusa'"),
    ("mtp", {"SPEC_DSPARK_BLOCK_SIZE": "x"}, "expected an integer"),
    ("hub", {}, "cannot read its config.json"),
    ("garbage", {}, "config.json is not valid JSON"),
    ("llama", {}, "model_type is 'llama', expected deepseek_v4"),
    ("missing", {}, "does not exist and is not a Hugging Face id"),
    ("garbage", {"SPEC_ALGORITHM": "EAGLE"}, "config.json is not valid JSON"),
])
def test_bad_settings_are_one_line_errors(ckpts, model, env, needle):
    r = run(ckpts, "someone/unknown-v4" if model == "hub" else ckpts[model], env, check=False)
    assert r.returncode == 2, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("model,misleading", [
    ("garbage", "no readable config.json"),                  # it is readable, just not JSON
    ("llama", "carries no draft model"),                     # it is not DeepSeek-V4 at all
    ("missing", "Hugging Face cache"),                       # an absolute path is no Hub id to download
])
def test_bad_model_directories_get_the_base_preflights_line(ckpts, model, misleading):
    """The MTP script refuses a checkpoint its base script's preflight refuses, with the preflight's own line."""
    from dsv4_sm120.serving import preflight as pf
    from dsv4_sm120.serving.plan import build_plan

    r = run(ckpts, ckpts[model], check=False)
    (line,) = r.stderr.strip().splitlines()
    plan = build_plan({"MODEL_PATH": str(ckpts[model]), "RUN_DIR": "/tmp/x", "NVIDIA_SMI": "/nonexistent"}, "base")
    (want,) = pf.check_model(plan)
    assert r.returncode == 2 and line == f"[serve] configuration error: {want}", (line, want)
    assert misleading not in line and "download" not in line, line


def test_hub_id_draft_is_read_from_the_hugging_face_cache(ckpts, tmp_path):
    from test_model_config import hf_cache

    cfg = json.loads((ckpts["dspark"] / "config.json").read_text())
    hf_cache(tmp_path / "hf" / "hub", "someone/dspark-v4", cfg)
    s = spec_of(run(ckpts, "someone/dspark-v4", {"HF_HOME": str(tmp_path / "hf")}).stdout)
    assert s[:4] == ["--speculative-algorithm", "DSPARK", "--speculative-dspark-block-size", str(BLOCK)], s


def test_base_script_ignores_the_draft(ckpts):
    r = dry_run("serve_dsv4_tp4.sh", {"MODEL_PATH": str(ckpts["none"]), "PREFLIGHT_SKIP": "patches,model"})
    assert "--speculative-algorithm" not in r.stdout and "speculative decoding" not in r.stdout


# (file in the sglang package, line, what that line defines or calls): the routing points docs/speculative.md
# cites; the pinned wheel must have them there, and the doc must cite them with that line.
DOC_ANCHORS = [
    ("srt/layers/attention/deepseek_v4_backend.py", 4132, "def forward("),
    ("srt/layers/attention/deepseek_v4_backend.py", 4143, "def _forward_attention("),
    ("srt/layers/attention/deepseek_v4_backend.py", 4335, "if get_platform().is_sm120:"),
    ("srt/layers/attention/deepseek_v4_backend.py", 2917, "def _use_sparse_prefill("),
    ("srt/layers/attention/deepseek_v4_backend.py", 4746, "def make_core_attn_metadata("),
    ("srt/layers/attention/deepseek_v4_backend.py", 4913, "def get_dspark_swa_page_indices("),
    ("srt/layers/attention/deepseek_v4_backend.py", 2204, "def init_forward_metadata_dspark_draft_block("),
    ("srt/layers/attention/deepseek_v4_backend.py", 2153, "def init_forward_metadata_target_verify("),
    ("srt/layers/attention/deepseek_v4_backend.py", 2398, "def init_forward_metadata_draft_extend("),
    ("srt/layers/attention/deepseek_v4_backend.py", 4966, "class DeepseekV4MultiStepBackend("),
    ("srt/models/deepseek_v4_dspark.py", 255, "def forward("),
    ("srt/models/deepseek_v4_dspark.py", 328, "o = attn_backend.forward("),
    ("srt/models/deepseek_v4.py", 1370, "class MQALayer("),
    ("srt/models/deepseek_v4.py", 2892, "o = attn_backend.forward("),
    ("srt/models/deepseek_v4.py", 1215, "def _kernel_num_heads("),
    ("srt/speculative/dspark_components/dspark_draft.py", 557, "def _run_forward("),
    ("srt/speculative/eagle_worker_v2.py", 742, "def draft_forward("),
    ("srt/speculative/eagle_worker_v2.py", 1110, "def _draft_extend_for_decode("),
    ("srt/speculative/eagle_worker_v2.py", 961, "def _draft_extend_for_prefill("),
    ("srt/speculative/eagle_worker_v2.py", 1979, "def verify("),
    ("kernels/ops/attention/flash_mla_sm120.py", 298, "def flash_mla_with_kvcache_sm120("),
    ("srt/disaggregation/utils.py", 1462, "def setup_state_kv_args("),
    ("srt/disaggregation/prefill.py", 257, "def _init_kv_manager("),
    ("srt/disaggregation/decode.py", 608, "def _init_kv_manager("),
]


def test_docs_cite_the_pinned_sources_and_every_variable():
    import sglang

    from dsv4_sm120.serving.plan import VARIABLES

    root = Path(sglang.__file__).parent
    doc = (Path(__file__).resolve().parents[1] / "docs" / "speculative.md").read_text()
    for rel, line, text in DOC_ANCHORS:
        src = (root / rel).read_text().splitlines()
        assert text in src[line - 1], (rel, line, src[line - 1])
        assert re.search(rf"\bl\. {line}\b", doc), (rel, line)
    missing = [k for k in VARIABLES if k.startswith("SPEC_") and f"`{k}`" not in doc]
    assert not missing, missing
