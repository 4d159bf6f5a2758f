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
