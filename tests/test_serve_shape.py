"""The serving shape (issue 51): the shape decision's rule and fields (machine_profile/shape_decision.py), the serve plan
using the recorded shape and draft length where you set none, and make verify's shape stage end to end with stand-in
servers, the real router and a stand-in load generator: start, measure, stop each candidate, compare, record."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_serve_dryrun import commands, dry_run, fake_smi  # noqa: E402
from test_verify import assert_all_gone, fake_loadgen, model_dir, venv, verify  # noqa: E402,F401
from test_serve_orchestration import env  # noqa: E402,F401

from dsv4_sm120 import machine_profile as mp  # noqa: E402
from dsv4_sm120.machine_profile import shape_decision as sd  # noqa: E402

GPU = "NVIDIA RTX PRO 6000 Blackwell Server Edition"


def cand(name, tok, agrees=True, status="ok", pre="0,1,2,3", dec="4,5,6,7", spec=None):
    return {"name": name, "prefill_gpus": pre, "decode_gpus": dec, "spec": spec, "max_running": 16, "status": status,
            "agrees": agrees, "per_concurrency": {str(c): {"output_tok_s": t} for c, t in tok.items()}}


def entry(cands, variant="base", standin=False):
    rec = {"standin": standin, "candidates": cands, "winners": sd.winners(cands), "measured_at": "2026-01-01T00:00:00Z"}
    return {"variants": {variant: rec}}


# ---- the decision (pure)

def test_winner_per_concurrency_ties_keep_the_earlier_candidate_and_disagreement_never_wins():
    base = 1000.0
    c = [cand("p4-d4", {1: base, 8: base, 32: base}, dec="4,5,6,7"),
         cand("p4-d2x2", {1: base * 0.99, 8: base * 1.05, 32: base * 1.3}, dec="4,5;6,7"),
         cand("p4-d1x4", {1: base * 9, 8: base * 9, 32: base * 9}, agrees=False, dec="4;5;6;7"),
         cand("p4-d4-x", {1: base * 9}, status="failed")]
    # C=1: 1% slower is within noise of the first; C=8: 5% faster wins; the faster ones disagree or failed
    assert sd.winners(c) == {"1": "p4-d4", "8": "p4-d2x2", "32": "p4-d2x2"}
    assert sd.validate_entry(entry(c)) is None
    # a winner that disagrees, did not measure there, or is not a candidate is refused by the profile loader
    for bad in ({"1": "p4-d1x4"}, {"16": "p4-d4"}, {"1": "nope"}):
        e = entry(c)
        e["variants"]["base"]["winners"] = bad
        assert "winner at C=" in sd.validate_entry(e), bad
    e = entry([cand("a", {1: 5}, dec="4,5;6")])            # replicas of two TP sizes
    assert "different sizes" in sd.validate_entry(e)
    e = entry([cand("a", {1: 5}, spec={"algorithm": "DSPARK", "block_size": 0})])
    assert "block_size 1..63" in sd.validate_entry(e)
    assert "variant 'fast'" in sd.validate_entry({"variants": {"fast": entry(c)["variants"]["base"]}})
    # the serve plan's lookup: the smallest measured concurrency at or above, the largest beyond them
    e = entry(c)
    assert [sd.pick(e, "base", n)[:2] for n in (1, 2, 8, 9, 64)] == [
        (c[0], 1), (c[1], 8), (c[1], 8), (c[1], 32), (c[1], 32)]
    assert sd.pick(e, "mtp", 1)[0] is None and "no shape recorded for the mtp" in sd.pick(e, "mtp", 1)[2]
    assert sd.candidate_name("0,1,2,3", "4,5;6,7", {"algorithm": "DSPARK", "block_size": 3}) == "p4-d2x2-dspark3"
    assert sd.shape_text("0,1,2,3", "4,5;6,7") == "prefill TP4, decode 2 x TP2"


def write_profile(d: Path, decisions: dict) -> Path:
    prof = {"schema": mp.SCHEMA, "gpu": GPU, "created_at": mp.now_iso(), "versions": mp.running_versions(),
            "deployment": {}, "decisions": decisions}
    return mp.save(prof, d / f"{mp.file_stem(GPU)}.json")


def test_the_profile_loader_validates_the_shape_decision(tmp_path):
    c = [cand("p4-d4", {16: 900.0}), cand("p4-d2x2", {16: 1200.0}, dec="4,5;6,7")]
    path = write_profile(tmp_path, {"shape": entry(c)})
    assert mp.load(path)["decisions"]["shape"]["variants"]["base"]["winners"] == {"16": "p4-d2x2"}
    bad = json.loads(path.read_text())
    bad["decisions"]["shape"]["variants"]["base"]["winners"] = {"16": "p4-d9"}
    path.write_text(json.dumps(bad))
    with pytest.raises(mp.ProfileError, match="decision 'shape': variant base: winner at C=16 'p4-d9'"):
        mp.load(path)


# ---- the serve plan takes the recorded shape

def shape_lines(out):
    return [x for x in out.splitlines() if x.startswith("# serving shape: ")]


def test_the_serve_scripts_use_the_recorded_shape_and_draft_length_unless_you_set_one(tmp_path):
    ckpt = model_dir(tmp_path, mtp=True)                 # an MTP layer: EAGLE steps
    dsp = {"algorithm": "EAGLE", "steps": 2}
    c = [cand("p4-d4", {1: 300.0, 16: 900.0}), cand("p4-d2x2", {1: 290.0, 16: 1200.0}, dec="4,5;6,7"),
         cand("p4-d2x2-eagle2", {1: 400.0, 16: 1500.0}, dec="4,5;6,7", spec=dsp)]
    prof_dir = tmp_path / "prof"
    e = entry(c[:2])
    e["variants"]["mtp"] = dict(entry([c[2]], "mtp")["variants"]["mtp"])
    path = write_profile(prof_dir, {"shape": e})
    base = {"NVIDIA_SMI": fake_smi(tmp_path / "smi"), "DSV4_SM120_PROFILE_DIR": str(prof_dir),
            "MODEL_PATH": str(ckpt), "PREFLIGHT_SKIP": "patches,model"}
    out = dry_run("serve_dsv4_tp4.sh", base).stdout
    cmds = commands(out)
    assert set(cmds) == {"prefill", "decode1", "decode2", "router"}, out        # MAX_RUNNING 16 -> C=16's winner
    assert cmds["decode2"][0]["CUDA_VISIBLE_DEVICES"] == "6,7"
    (line,) = shape_lines(out)
    assert line.startswith(f"# serving shape: the recorded winner at C=16 for MAX_RUNNING=16 (1200 output tok/s there; "
                           f"profile {path}") and "DECODE_GPUS=4,5;6,7 (prefill TP4, decode 2 x TP2)" in line, line
    # your concurrency picks another winner; your layout wins over the record
    out = dry_run("serve_dsv4_tp4.sh", dict(base, SHAPE_CONCURRENCY="1")).stdout
    assert set(commands(out)) == {"prefill", "decode", "router"} and "winner at C=1 for SHAPE_CONCURRENCY=1" in out
    out = dry_run("serve_dsv4_tp4.sh", dict(base, DECODE_GPUS="4,5,6,7")).stdout
    assert set(commands(out)) == {"prefill", "decode", "router"}
    assert shape_lines(out) == ["# serving shape: yours (DECODE_GPUS set)"]
    # the MTP script: the recorded layout and draft length (EAGLE 2 steps = 3 draft tokens)
    out = dry_run("serve_dsv4_mtp.sh", base).stdout
    argv = commands(out)["decode2"][1]
    assert argv[argv.index("--speculative-num-steps") + 1] == "2", argv
    assert "SPEC_NUM_STEPS=2 (EAGLE 2 steps)" in shape_lines(out)[0]
    out = dry_run("serve_dsv4_mtp.sh", dict(base, SPEC_NUM_STEPS="3")).stdout
    argv = commands(out)["decode2"][1]
    assert argv[argv.index("--speculative-num-steps") + 1] == "3" and "; yours: SPEC_NUM_STEPS" in out
    # a stand-in rehearsal's record is not used for real servers, only for stand-ins
    e["variants"]["base"]["standin"] = True
    write_profile(prof_dir, {"shape": e})
    out = dry_run("serve_dsv4_tp4.sh", base).stdout
    assert set(commands(out)) == {"prefill", "decode", "router"}
    assert "comes from a stand-in rehearsal, not a measurement" in shape_lines(out)[0]
    out = dry_run("serve_dsv4_tp4.sh", dict(base, DSV4_SM120_SERVE_STANDIN="1")).stdout
    assert "decode2" in commands(out)


# ---- make verify --stages shape, end to end with stand-ins

def test_shape_stage_starts_measures_stops_compares_and_records(venv, tmp_path):
    """Two candidates of the MTP variant (one decode server, then two replicas; EAGLE 1 step), each started,
    measured at C=2 through the router by the stand-in load generator, compared token by token with the first and
    stopped; the table, the plot and the winner (recomputed here from the table's numbers) land in the run directory
    and in the machine profile, and the serve script then takes the recorded layout and draft length."""
    prof_dir = tmp_path / "profiles"
    venv.update(MODEL_PATH=str(model_dir(tmp_path, mtp=True)), NVIDIA_SMI=fake_smi(tmp_path / "smi"),
                DSV4_SM120_PROFILE_DIR=str(prof_dir))
    out = tmp_path / "verify"
    r = verify(venv, "--stages", "shape", "--variants", "mtp", "--shape", "0/1", "--shape", "0/1;2",
               "--draft-lengths", "1", "--out-dir", str(out), "--greedy-tokens", "6", "--prompts", "2",
               "--first-tokens", "6", "--concurrency", "2", "--input-len", "8", "--output-len", "4",
               "--prompts-per-level", "1", "--min-prompts", "2", "--python", fake_loadgen(tmp_path))
    text = r.stdout + r.stderr
    assert r.returncode == 0, text
    assert_all_gone(venv, out)
    study = json.loads((out / "shape" / "shape.json").read_text())
    rec = study["variants"]["mtp"]
    names = [x["name"] for x in rec["candidates"]]
    assert names == ["p1-d1-eagle1", "p1-d1x2-eagle1"] and rec["standin"] is True
    assert all(x["status"] == "ok" and x["agrees"] is True for x in rec["candidates"]), rec
    # each candidate ran in its own run directory, one after the other, and was stopped
    states = [json.loads((out / "shape" / n / "serve" / "state.json").read_text()) for n in names]
    assert [x["status"] for x in states] == ["stopped", "stopped"] and states[0]["run_dir"] != states[1]["run_dir"]
    # each candidate really ran its own layout: the second had two decode servers behind the router
    plan = json.loads((out / "shape" / "p1-d1x2-eagle1" / "serve" / "plan.json").read_text())
    assert [p["name"] for p in plan["procs"]] == ["prefill", "decode1", "decode2", "router"]
    dec = plan["procs"][1]["argv"]
    assert dec[dec.index("--speculative-num-steps") + 1] == "1"
    # the winner, from the numbers the table holds
    tok = {x["name"]: x["per_concurrency"]["2"]["output_tok_s"] for x in rec["candidates"]}
    best = max(tok.values())
    want = next(n for n in names if tok[n] >= best * (1 - sd.NOISE))
    assert rec["winners"] == {"2": want}, (tok, rec["winners"])
    table = (out / "shape" / "table.md").read_text()
    assert f"| **{tok[want]:.1f}** |" in table and "Winners: C=2 " + want in table
    assert (out / "shape" / "shape.png").stat().st_size > 1000
    assert "## Serving shape" in (out / "report.md").read_text()
    saved = mp.load(prof_dir / f"{mp.file_stem(GPU)}.json")["decisions"]["shape"]["variants"]["mtp"]
    assert saved["winners"] == rec["winners"] and saved["candidates"] == rec["candidates"]
    # the serve script (stand-ins: the record is a rehearsal's) takes it where nothing is set
    d = dry_run("serve_dsv4_mtp.sh", {k: venv[k] for k in ("NVIDIA_SMI", "DSV4_SM120_PROFILE_DIR", "MODEL_PATH")}
                | {"DSV4_SM120_SERVE_STANDIN": "1", "SHAPE_CONCURRENCY": "2"})
    win = next(x for x in rec["candidates"] if x["name"] == want)
    cmds = commands(d.stdout)
    assert cmds["prefill"][0]["CUDA_VISIBLE_DEVICES"] == "0"
    assert [cmds[k][0]["CUDA_VISIBLE_DEVICES"] for k in cmds if k.startswith("decode")] == \
        win["decode_gpus"].split(";"), d.stdout


def test_shape_stage_dry_run_lists_the_candidates_and_refuses_bad_ones(venv, tmp_path):
    """The default candidates (one decode server, then two halves; for MTP each with EAGLE 3 / 1 / 2 steps, the
    checkpoint's own first), every start command, where the record goes; the shape stage only when asked for."""
    venv.update(MODEL_PATH=str(model_dir(tmp_path, mtp=True)), NVIDIA_SMI=fake_smi(tmp_path / "smi"),
                DSV4_SM120_PROFILE_DIR=str(tmp_path / "prof"))
    r = verify(venv, "--dry-run", "--stages", "shape", "--out-dir", str(tmp_path / "v"))
    assert r.returncode == 0, r.stdout + r.stderr
    names = re.findall(r"^shape (\S+): (?!the winner)", r.stdout, re.M)
    assert names == ["p4-d4", "p4-d2x2", "p4-d4-eagle3", "p4-d4-eagle1", "p4-d4-eagle2", "p4-d2x2-eagle3",
                     "p4-d2x2-eagle1", "p4-d2x2-eagle2"], r.stdout
    starts = re.findall(r"^  start: (.*)$", r.stdout, re.M)
    assert "DECODE_GPUS='4,5;6,7'" in starts[1] and starts[1].endswith("serve_dsv4_tp4.sh --detach")
    assert "SPEC_NUM_STEPS=1" in starts[3] and starts[3].endswith("serve_dsv4_mtp.sh --detach")
    assert "not for stock" in r.stdout and not re.search(r"^variant ", r.stdout, re.M)
    assert f"shape record: the winner per concurrency goes into {tmp_path / 'prof'}" in r.stdout
    assert not (tmp_path / "v").exists()
    # two layouts of one shape get distinct names (and run directories)
    r = verify(venv, "--dry-run", "--stages", "shape", "--variants", "ours", "--shape", "0,1/2,3", "--shape", "4,5/6,7")
    assert re.findall(r"^shape (p\S+): ", r.stdout, re.M) == ["p2-d2", "p2-d2-2"], r.stdout
    # the default stages leave the shape stage out
    assert "# stages: greedy, accuracy, measure, profile" in verify(venv, "--dry-run").stdout
    for args, word in ((["--shape", "0,1,2,3"], "expected PREFILL_GPUS/DECODE_GPUS"),
                       (["--shape", "0,1,2/4,5"], "TP size 3"), (["--variants", "stock"], "the ours and mtp variants"),
                       (["--draft-lengths", "3,x"], "--draft-lengths")):
        r = verify(venv, "--dry-run", "--stages", "shape", *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and word in lines[0] and "Traceback" not in r.stderr, (args, r.stderr)
