"""What a new user reads: `make help`, README.md and docs/serving.md, checked against the Makefile and the code.

`make help` lists user targets first and maintainer targets in their own section, with no unexpanded
placeholder; every target, environment variable and default the README names exists in the Makefile / the
code; neither text refers to internal development history.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAKEFILE = (REPO / "Makefile").read_text()
README = (REPO / "README.md").read_text()
SERVING = (REPO / "docs" / "serving.md").read_text()
HISTORY = re.compile(r"\b(sessions?|calls?|rounds?)\s+\d+|\b(session|call|round)\s+\d+'s", re.I)


def _targets(marker: str):
    """Targets whose rule line carries `marker` (e.g. '## ' or '##m '), in file order."""
    return [m.group(1) for m in re.finditer(rf"^([a-zA-Z0-9_-]+):[^\n]*{re.escape(marker)}", MAKEFILE, re.M)]


def _phony():
    text = re.search(r"^\.PHONY:(.*?)(?<!\\)\n", MAKEFILE, re.M | re.S).group(1)
    return set(text.replace("\\\n", " ").split())


def _all_rule_targets():
    return set(re.findall(r"^([a-zA-Z0-9_-]+):(?!=)", MAKEFILE, re.M))


@pytest.fixture(scope="module")
def help_text():
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make on this machine")
    r = subprocess.run([make, "-s", "--no-print-directory", "help"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_make_help_puts_maintainer_targets_in_their_own_section(help_text):
    lines = help_text.splitlines()
    listed = [(i, m.group(1)) for i, x in enumerate(lines) if (m := re.match(r"\s+make (\S+)\s", x))]
    heads = [i for i, x in enumerate(lines) if x.lower().startswith("maintainer targets")]
    assert len(heads) == 1, help_text
    user = [t for i, t in listed if i < heads[0]]
    maint = [t for i, t in listed if i > heads[0]]
    assert user == _targets("## ") and maint == _targets("##m "), (user, maint)
    assert {"lock-patches", "freeze"} <= set(maint), maint
    assert {"setup", "apply-patches", "serve", "test"} <= set(user), user
    # every phony target is described in exactly one of the two sections
    assert sorted(user + maint) == sorted(_phony()), sorted(_phony() ^ set(user + maint))


def test_make_help_has_no_placeholder(help_text):
    variables = re.findall(r"^([A-Z][A-Z0-9_]*)\s*[?:]?=", MAKEFILE, re.M)
    assert "BENCH_OUT" in variables
    for v in variables:
        # a variable name glued to more text (BENCH_OUT_attention.md) reads as a literal file name
        assert not re.search(rf"\b{v}_[A-Za-z0-9]", help_text), (v, help_text)
    assert "$(" not in help_text and "$$" not in help_text


def test_history_is_not_in_user_texts(help_text):
    for name, text in (("README.md", README), ("docs/serving.md", SERVING), ("make help", help_text)):
        hits = [m.group(0) for m in HISTORY.finditer(text)]
        assert not hits, (name, hits)


def test_readme_targets_exist():
    targets = _all_rule_targets()
    named = set(re.findall(r"`make ([a-z0-9-]*[a-z0-9])\b(?!-)", README))    # not `make bench-*`
    named |= set(re.findall(r"^make ([a-z0-9-]+)", README, re.M))       # code blocks
    for row in re.findall(r"^\| (`[a-z0-9-]+`(?:, `[a-z0-9-]+`)*) \|", README, re.M):
        named |= set(re.findall(r"`([a-z0-9-]+)`", row))
    assert {"setup", "apply-patches", "test", "serve", "bench-attention"} <= named, named
    assert not named - targets, sorted(named - targets)


def _code_text():
    parts = [MAKEFILE]
    for d, pat in (("overlay", "*.py"), ("serve", "*"), ("patches", "*.patch"), ("scripts", "*")):
        parts += [p.read_text(errors="replace") for p in (REPO / d).rglob(pat) if p.is_file()]
    return "\n".join(parts)


def _env_names(text: str):
    """Upper-case names in backticks (`NAME` or `NAME=...`) that look like environment variables."""
    names = set()
    for tok in re.findall(r"`([^`\n]+)`", text):
        for m in re.finditer(r"(?<![A-Za-z0-9_*<])([A-Z][A-Z0-9]*_[A-Z0-9_]*[A-Z0-9])(?![A-Za-z0-9_*>])", tok):
            names.add(m.group(1))
    return names


@pytest.mark.parametrize("doc", ["README.md", "docs/serving.md"])
def test_documented_variables_exist_in_the_code(doc):
    code = _code_text()
    names = _env_names((REPO / doc).read_text())
    assert {"MODEL_PATH", "DSV4_SM120_DISABLE"} & names, names
    missing = sorted(n for n in names if not re.search(rf"\b{n}\b", code))
    assert not missing, f"{doc} names variables no code reads: {missing}"


def test_readme_defaults_match_the_code():
    sys.path.insert(0, str(REPO / "overlay"))
    from dsv4_sm120.serving.plan import VARIABLES

    assert re.search(r"^VENV \?= \.venv$", MAKEFILE, re.M) and VARIABLES["VENV"][0] == ".venv"
    assert "in `.venv/`" in README
    assert f"router on :{VARIABLES['ROUTER_PORT'][0]}" in README
    pg, dg = VARIABLES["PREFILL_GPUS"][0], VARIABLES["DECODE_GPUS"][0]
    assert f"prefill (GPU{pg[0]}-{pg[-1]})" in README and f"decode (GPU{dg[0]}-{dg[-1]})" in README
    # the variables the README lists as knobs are serve variables
    for k in ("MODEL_PATH", "PREFILL_GPUS", "DECODE_GPUS", "CONTEXT_LEN", "MEM_FRACTION", "MAX_RUNNING",
              "LOG_DIR", "NODE_ROLE", "DETACH", "DRY_RUN"):
        assert k in VARIABLES and f"`{k}" in README, k


# ---- set-up times, stale names, commands that only work inside the environment

DOCS = {"README.md": README, **{f"docs/{p.name}": p.read_text() for p in sorted((REPO / "docs").glob("*.md"))},
        "configs/README.md": (REPO / "configs" / "README.md").read_text()}
FIXED_TIME = re.compile(r"(?:\babout|~|\btook)\s*\d+(?:\.\d+)?\s*(?:s|seconds?|minutes?)\b", re.I)


def test_set_up_times_are_a_range_and_measured():
    """A single set-up time ("took 113 s", "about 100 s") is wrong on most boxes: the texts state a range and what it
    depends on, and `make setup` ends with the time it measured."""
    setup = (REPO / "scripts" / "setup_env.sh").read_text()
    texts = {"scripts/setup_env.sh": setup, "docs/setup.md": DOCS["docs/setup.md"],
             "README.md": "\n\n".join(p for p in README.split("\n\n") if re.search(r"make setup|\.pyc|set-up", p))}
    for name, text in texts.items():
        hits = FIXED_TIME.findall(text)
        assert not hits, (name, hits)
    assert 'say "environment $venv ready in $(elapsed)' in setup
    for text in (texts["README.md"], DOCS["docs/setup.md"]):
        assert "depends on the CPU" in text or "depending on the CPU" in text, text[:400]


def test_docs_run_our_modules_the_way_that_works():
    """`python -m dsv4_sm120...` fails outside the environment: docs write `.venv/bin/python -m ...` (or
    `$VENV/bin/python`, or, for developers, `PYTHONPATH=overlay python3 -m ...`)."""
    ok = re.compile(r"(?:\.venv/bin/python|\$VENV/bin/python|PYTHONPATH=overlay python3) -m dsv4_sm120")
    for name, text in DOCS.items():
        for m in re.finditer(r"[^\s`(]*\s?python3? -m dsv4_sm120", text):
            line = text[:m.end()].rsplit("\n", 1)[-1]
            assert ok.search(line[-60:]), (name, line)


def test_developer_docs_and_scripts_name_files_that_exist():
    dev = DOCS["docs/DEVELOPING.md"]
    assert "`convert_nvfp4/`" in dev and "convert_nvfp4.py" not in dev
    assert "declared in `serving/plan.py`" not in dev and "`serve_variables.py`" in dev
    for name in re.findall(r"\b([a-z_]+\.py)\b", (REPO / "serve" / "lib.sh").read_text()):
        assert (REPO / "overlay" / "dsv4_sm120" / "serving" / name).is_file(), f"serve/lib.sh names {name}"


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
@pytest.mark.parametrize("target", ["patch-status", "apply-patches", "revert-patches"])
def test_patch_targets_without_an_environment_name_the_make_variable(target, tmp_path):
    r = subprocess.run(["make", "-s", "--no-print-directory", target, f"VENV={tmp_path}/none"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and f"no environment at {tmp_path}/none" in out and "make setup" in out, out
    assert "--python" not in out and "Traceback" not in out, out
