"""The settings registry (dsv4_sm120.settings): typed accessors, validation, the listing, and the tree:
every DSV4_* / SGLANG_DSV4* name anywhere in the repository is a registered setting (no renamed name left
outside CHANGELOG.md), every module reads registered variables through the registry, and README.md's table is
the registry's."""

from __future__ import annotations

import json
import random
import re
import string
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_sm120 import settings as S
from dsv4_sm120.serving.plan import VARIABLES

REPO = Path(__file__).resolve().parents[1]
OVERLAY = REPO / "overlay"
NAME = re.compile(r"\b(?:SGLANG_DSV4|DSV4)_[A-Z0-9_]+")
# Python constants of the converter that share the spelling (not environment variables)
CONSTANTS = {"DSV4_ARCHS", "DSV4_MODEL_TYPES"}


def renames():
    """(old, new) pairs of CHANGELOG.md's rename table."""
    text = (REPO / "CHANGELOG.md").read_text()
    pairs = re.findall(r"^\| `([A-Z0-9_]+)` \| `([A-Z0-9_]+)`", text, re.M)
    assert len(pairs) >= 20, "CHANGELOG.md lost its rename table"
    return pairs


def tree_files():
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.split("\n")
    for rel in out:
        p = REPO / rel
        if not rel or rel == "CHANGELOG.md" or not p.is_file():
            continue
        try:
            yield rel, p.read_text()
        except UnicodeDecodeError:
            continue


# ---- accessors


def test_every_setting_is_declared_completely():
    reg = S.registry()
    for name, s in reg.items():
        assert s.name == name and s.kind in S.KINDS and s.reader in S.READERS and s.meaning.strip(), name
        if s.kind == "choice":
            assert s.choices and (s.default is None or s.default.lower() in s.choices), name
        S.get(name, {})  # the default itself is valid
        if s.reader != "serve" and name != "SGLANG_ROOT":
            assert name.startswith(S.PREFIX), name
    # the serve scripts' parameters are declared once, in serving.plan.VARIABLES, and all registered
    for name, (default, help_) in VARIABLES.items():
        assert reg[name].reader == "serve" or name.startswith(S.PREFIX)
        assert reg[name].meaning == help_ or name in S._BY_NAME_OURS


def test_typed_values_and_defaults():
    env = {"DSV4_SM120_DISABLE": "TRUE", "DSV4_SM120_ATTN_BACKEND": " Triton ", "DSV4_SM120_ATTN_WS_MB": "0.5",
           "DSV4_SM120_STANDIN_TRACE_TP": "4", "DSV4_SM120_CACHE": "~/x"}
    assert S.get("DSV4_SM120_DISABLE", env) is True and S.get("DSV4_SM120_DISABLE", {}) is False
    assert S.get("DSV4_SM120_ATTN_BACKEND", env) == "triton" and S.get("DSV4_SM120_ATTN_BACKEND", {}) == "dsv4"
    assert S.get("DSV4_SM120_ATTN_WS_MB", env) == 0.5 and S.get("DSV4_SM120_ATTN_WS_MB", {}) == 256.0
    assert S.get("DSV4_SM120_STANDIN_TRACE_TP", env) == 4
    assert S.get("DSV4_SM120_CACHE", env) == str(Path.home() / "x")
    assert S.get("DSV4_SM120_MOE_SCALED_DOT", {}) is None  # unset has its own meaning
    # unset and empty differ where it matters
    assert S.raw("DSV4_SM120_FP8_CONFIG_DIR", {}) is None and S.raw("DSV4_SM120_FP8_CONFIG_DIR", {
        "DSV4_SM120_FP8_CONFIG_DIR": ""}) == ""
    with pytest.raises(KeyError):
        S.get(S.PREFIX + "NO_SUCH")


TYPED = [n for n, s in S.registry().items() if s.kind in ("choice", "bool", "autobool", "int", "float")]


@pytest.mark.parametrize("name", TYPED)
def test_bad_value_is_one_line_naming_variable_and_valid_values(name):
    s = S.setting(name)
    rnd = random.Random(name)
    bad = "x" + "".join(rnd.choice(string.ascii_lowercase) for _ in range(5))
    with pytest.raises(S.SettingsError) as e:
        S.get(name, {name: bad})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{name}={bad!r}")
    if s.kind == "choice":
        assert all(c in msg for c in s.choices if c)
    if s.minimum is not None:
        low = s.minimum if s.above else s.minimum - 1
        with pytest.raises(S.SettingsError, match="out of range"):
            S.get(name, {name: str(int(low) if s.kind == "int" else low)})
    if s.maximum is not None:
        high = int(s.maximum) + 1 if s.kind == "int" else s.maximum + 0.005
        with pytest.raises(S.SettingsError, match="out of range"):
            S.get(name, {name: str(high)})
        assert S.get(name, {name: str(int(s.maximum) if s.kind == "int" else s.maximum)}) == s.maximum


def test_serve_variables_are_typed_with_the_ranges_the_plan_enforces():
    """The serve parameters the plan reads as numbers, switches or lists are declared so, with their ranges (the table
    shows them); the plan reads them through the registry and refuses what it refuses."""
    from dsv4_sm120.serving.plan import ConfigError, build_plan

    kinds = {n: S.setting(n).kind for n in VARIABLES}
    for n in ("PREFILL_PORT", "BOOTSTRAP_PORT", "DECODE_PORT", "ROUTER_PORT", "ROUTER_PROMETHEUS_PORT"):
        s = S.setting(n)
        assert (s.kind, s.minimum, s.maximum) == ("int", 1, 65535) and s.describe_values() == "integer 1..65535", n
    assert S.setting("CONTEXT_LEN").describe_values() == "integer 256..2097152"
    assert S.setting("MEM_FRACTION").describe_values() == "number > 0, <= 0.99"
    assert S.setting("MAX_RUNNING").describe_values() == "integer 1..4096"
    for n in ("DETACH", "DRY_RUN", "CALIBRATE", "NUMA_BIND", "DSV4_SM120_SERVE_STANDIN"):
        assert kinds[n] == "bool", n
    assert kinds["WARMUP"] == "autobool" and kinds["FP8_GEMM_BACKEND"] == "choice"
    base = {"VENV": sys.executable.rsplit("/bin/", 1)[0], "RUN_DIR": "/tmp/dsv4-settings-plan",
            "NVIDIA_SMI": "/nonexistent/nvidia-smi"}
    for name, bad in (("PREFILL_PORT", "0"), ("ROUTER_PORT", "65536"), ("CONTEXT_LEN", "255"), ("MEM_FRACTION", "0"),
                      ("DECODE_MEM_FRACTION", "1.5"), ("MAX_RUNNING", "4097"), ("PREFILL_MAX_RUNNING", "0"),
                      ("DETACH", "no thanks"), ("DRY_RUN", "2"), ("WARMUP", "sometimes"), ("NUMA_BIND", "yes please"),
                      ("HEALTH_TIMEOUT_S", "0"), ("SUPERVISE_HEALTH_FAILS", "-1"), ("TRANSFER_BACKEND", "carrier-pigeon"),
                      ("SPEC_NUM_STEPS", "17"), ("MODEL_PATH", "")):
        with pytest.raises(ConfigError) as e:
            build_plan(dict(base, **{name: bad}))
        msg = str(e.value)
        s = S.setting(name)
        assert "\n" not in msg and msg.startswith(f"{name}"), msg
        assert (s._range() if s.kind in ("int", "float") else "") in msg, msg
    assert str(pytest.raises(ConfigError, build_plan, dict(base, MODEL_PATH="")).value).startswith(
        "MODEL_PATH is set but empty")
    p = build_plan(dict(base, PREFILL_PORT="65535", DECODE_MEM_FRACTION="0.99", WARMUP="yes", NUMA_BIND="off"))
    assert p.value("WARMUP") is True and p.value("NUMA_BIND") is False and p.urls["prefill"].endswith(":65535")
    dec = next(x for x in p.procs if x.role == "decode").argv
    assert dec[dec.index("--mem-fraction-static") + 1] == "0.99"


def test_structured_serve_variables_are_parsed_by_the_registry():
    """GPU groups, roles, check names and extra flags come out of the registry parsed (the serve plan reads them so);
    a bad value is the one line the plan reports, and unset gives the parse of the default."""
    env = {"PREFILL_GPUS": " 0,1 ; 2,3", "NODE_ROLE": "decode, prefill", "PREFLIGHT_SKIP": "gpu, nixl",
           "SERVER_EXTRA_ARGS": "--a 'b c'"}
    assert S.get("PREFILL_GPUS", env) == [[0, 1], [2, 3]] and S.get("DECODE_GPUS", {}) == [[4, 5, 6, 7]]
    assert S.get("NODE_ROLE", env) == ["prefill", "decode"] and S.get("NODE_ROLE", {}) == ["prefill", "decode", "router"]
    assert S.get("PREFLIGHT_SKIP", env) == ["gpu", "nixl"] and S.get("PREFLIGHT_SKIP", {}) == []
    assert S.get("SERVER_EXTRA_ARGS", env) == ["--a", "b c"] and S.get("ROUTER_EXTRA_ARGS", {"ROUTER_EXTRA_ARGS": " "}) == []
    assert S.get("SERVED_MODEL_NAME", {"SERVED_MODEL_NAME": "m"}) == "m"        # a plain text stays text
    for name, text, tail in (("PREFILL_GPUS", "0,0", "it lists a GPU twice"),
                             ("DECODE_GPUS", "4,5;6", "the groups have different sizes (2, 1 GPUs): replicas of one "
                              "server run one TP size"),
                             ("NODE_ROLE", "router,x", "unknown role 'x' (use all, or a comma list of prefill, decode, "
                              "router)"),
                             ("PREFLIGHT_SKIP", "gpu,nope", "unknown check(s) nope (known: ports, gpu, model, memory, "
                              "patches, nixl, numa, p2p, ucx, router, profile)"),
                             ("DECODE_EXTRA_ARGS", "--x 'a", "cannot split it as shell words (No closing quotation)")):
        with pytest.raises(S.SettingsError) as e:
            S.get(name, {name: text})
        assert str(e.value) == f"{name}={text!r} is not valid: {tail}"
        from dsv4_sm120.serving.plan import ConfigError, build_plan
        with pytest.raises(ConfigError) as e2:
            build_plan({name: text, "NVIDIA_SMI": "/nonexistent/nvidia-smi"})
        assert str(e2.value) == str(e.value)
    assert {n for n, v in S.registry().items() if v.convert} == {"PREFILL_GPUS", "DECODE_GPUS", "NODE_ROLE",
                                                                 "PREFLIGHT_SKIP", "SERVER_EXTRA_ARGS",
                                                                 "PREFILL_EXTRA_ARGS", "DECODE_EXTRA_ARGS",
                                                                 "ROUTER_EXTRA_ARGS"}


def test_the_plan_lists_the_callers_switches_but_not_ours():
    from dsv4_sm120.serving.plan import not_listed

    ours = ("DSV4_SM120_STANDIN_ROLE", "DSV4_SM120_REPO_ROOT", "DSV4_SM120_SERVE_STANDIN", "DSV4_SM120_SERVE_POLL_S",
            "DSV4_SM120_CACHE", "DSV4_SM120_VARIANT", "DSV4_SM120_ORIG_PYTHONPATH", "DSV4_SM120_TEST_GPU_NAME",
            "SGLANG_HOST_IP", "SGLANG_TORCH_PROFILER_DIR")
    theirs = ("DSV4_SM120_ATTN_QK", "DSV4_SM120_MOE_BACKEND", "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", "NCCL_PROTO",
              "SGLANG_DSV4_FP4_EXPERTS")
    assert [n for n in ours if not not_listed(n)] == [] and [n for n in theirs if not_listed(n)] == []


def test_free_form_values_are_checked():
    assert S.get("DSV4_SM120_ATTN_CONFIG", {"DSV4_SM120_ATTN_CONFIG": "impl=reg,KCVT=0"}) == "impl=reg,KCVT=0"
    with pytest.raises(S.SettingsError, match=r"DSV4_SM120_ATTN_CONFIG='QPRE=1'.*unknown key 'QPRE'"):
        S.get("DSV4_SM120_ATTN_CONFIG", {"DSV4_SM120_ATTN_CONFIG": "QPRE=1"})
    with pytest.raises(S.SettingsError, match="DSV4_SM120_TEST_ATTN_CONFIG"):
        S.get("DSV4_SM120_TEST_ATTN_CONFIG", {"DSV4_SM120_TEST_ATTN_CONFIG": "BLOCK_H=3"})
    for ok in ("", "auto", "none", "triton"):
        S.get("DSV4_SM120_FP8_GEMM_BACKEND", {"DSV4_SM120_FP8_GEMM_BACKEND": ok})
    with pytest.raises(S.SettingsError, match="DSV4_SM120_FP8_GEMM_BACKEND"):
        S.get("DSV4_SM120_FP8_GEMM_BACKEND", {"DSV4_SM120_FP8_GEMM_BACKEND": "triton; rm -rf /"})



def test_path_settings_are_checked_as_they_will_be_used():
    # os.path leaves an unknown ~user as it is; pathlib.Path.expanduser (what the readers use) raises on it
    for name in [n for n, s in S.registry().items() if s.kind == "path" and n.startswith("DSV4_SM120_")]:
        with pytest.raises(S.SettingsError, match=rf"{name}='~nosuchuser_dsv4/x' is not valid: ~nosuchuser_dsv4 "):
            S.get(name, {name: "~nosuchuser_dsv4/x"})
    home = S.get("DSV4_SM120_CACHE", {"DSV4_SM120_CACHE": "~/c"})
    assert not home.startswith("~") and home.endswith("/c")


# ---- validation


def test_validate_reports_each_problem():
    assert S.validate({}) == []
    assert S.validate({"DSV4_SM120_ATTN_QK": "fp8", "MODEL_PATH": "/m", "PATH": "/bin", "SGLANG_SOMETHING": "1"}) == []
    typo = S.PREFIX + "ATN_BACKEND"  # spelled out, the tree test below would (rightly) flag it
    probs = S.validate({"DSV4_SM120_ATTN_QK": "fp16", typo: "dsv4",
                        "DSV4_SM120_MOE_ALIGN": "sorted", "DSV4_SM120_ATTN_BACKEND": "dsv4"})
    assert len(probs) == 3, probs
    assert any(p.startswith("DSV4_SM120_ATTN_QK='fp16'") for p in probs)
    assert any(p.startswith(f"{typo} is not a dsv4_sm120 setting") for p in probs)
    assert any(p.startswith("DSV4_SM120_MOE_ALIGN='sorted'") for p in probs)
    # settings that are fine alone but not together
    probs = S.validate({"DSV4_SM120_ATTN_QK": "fp8", "DSV4_SM120_ATTN_CONFIG": "impl=reg"})
    assert probs == ["DSV4_SM120_ATTN_CONFIG impl=reg has no fp8 QK path but DSV4_SM120_ATTN_QK=fp8"]
    assert S.validate({"DSV4_SM120_ATTN_QK": "bf16", "DSV4_SM120_ATTN_CONFIG": "impl=reg"}) == []


def test_renamed_names_are_refused_and_the_new_ones_registered():
    reg = S.registry()
    for old, new in renames():
        assert new in reg, new
        probs = S.validate({old: "1"})
        assert probs == [f"{old} was renamed to {new} (CHANGELOG.md lists the renamed settings)"], probs
    # the registry's list of retired names is exactly CHANGELOG's
    assert S.RENAMED == dict(renames())
    # SGLang's own SGLANG_DSV4_* variables are not ours: never refused (they exist in the pinned SGLang)
    assert S.validate({n: "1" for n in S.SGLANG_OWN}) == []
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is not None:
        environ_py = (Path(spec.origin).parent / "srt" / "environ.py").read_text()
        assert all(n in environ_py for n in S.SGLANG_OWN)


# ---- the tree


def test_no_unregistered_or_renamed_name_in_the_tree():
    reg = S.registry()
    old = {o for o, _ in renames()}
    bad = []
    for rel, text in tree_files():
        if rel == "overlay/dsv4_sm120/settings.py":
            continue  # declares the retired names (RENAMED), like CHANGELOG.md
        if rel.startswith("bench/results/") and rel.endswith(".csv"):
            continue  # append-only records: a row's command names the variables of the commit it ran at
        for m in NAME.finditer(text):
            name = m.group(0)
            after = text[m.end():m.end() + 1]
            if name in old:
                bad.append(f"{rel}: renamed {name} (CHANGELOG.md)")
            elif name in reg or name in CONSTANTS or name in S.SGLANG_OWN:
                continue
            elif (name.endswith("_") or after == "*") and any(r.startswith(name) for r in reg):
                continue  # a prefix, e.g. DSV4_SM120_STANDIN_*
            else:
                bad.append(f"{rel}: {name} is not in dsv4_sm120/settings.py")
    assert not bad, "\n".join(sorted(set(bad)))
    from dsv4_sm120 import convert_nvfp4

    assert all(hasattr(convert_nvfp4, c) for c in CONSTANTS)


READ = re.compile(r"""(?:environ\.get|getenv|environ\.pop|environ\.setdefault)\(\s*["']([A-Z][A-Z0-9_]*)["']"""
                  r"""|environ\[\s*["']([A-Z][A-Z0-9_]*)["']\s*\]|["']([A-Z][A-Z0-9_]*)["']\s+in\s+os\.environ""")


def test_modules_read_registered_variables_only_through_the_registry():
    reg = S.registry()
    bad = []
    for p in sorted((OVERLAY / "dsv4_sm120").rglob("*.py")):
        if p.name == "settings.py":
            continue
        for m in READ.finditer(p.read_text()):
            name = next(g for g in m.groups() if g)
            if (name in reg or name.startswith(("DSV4_", "SGLANG_DSV4"))) and name not in S.SGLANG_OWN:
                bad.append(f"{p.relative_to(REPO)}: reads {name} directly")
    assert not bad, "\n".join(bad)


def test_generated_tables_are_the_registry_listing():
    """README.md, docs/serving.md and docs/DEVELOPING.md each carry their generated table, and every setting is in
    exactly one of them: what a user sets on the front page, the serve parameters (with kinds and ranges) beside
    the serve scripts, internal and test hooks in the developer's guide."""
    assert set(S.TABLES) == {"README.md", "docs/serving.md", "docs/DEVELOPING.md"}
    listed = []
    for rel, readers in S.TABLES.items():
        table = S.readme_table((REPO / rel).read_text())
        assert table is not None, f"{rel} lost its settings markers"
        assert table == S.markdown(readers), \
            f"{rel}'s settings table is stale: PYTHONPATH=overlay python3 -m dsv4_sm120.settings --write-readme"
        listed += re.findall(r"^\| `([A-Z][A-Z0-9_]*)` \|", table, re.M)
    assert sorted(listed) == sorted(S.registry()), sorted(set(S.registry()) ^ set(listed))
    readme = S.readme_table((REPO / "README.md").read_text())
    assert "DSV4_SM120_TEST_" not in readme and "DSV4_SM120_STANDIN_" not in readme and "`MODEL_PATH`" not in readme
    serving = S.readme_table((REPO / "docs" / "serving.md").read_text())
    assert "| `PREFILL_PORT` | integer 1..65535 | `30100` |" in serving
    assert "| `DETACH` | 0 \\| 1 | `0` |" in serving


# ---- the command


def _cli(*args, env=None):
    e = {"PYTHONPATH": str(OVERLAY), "PATH": "/usr/bin:/bin", **(env or {})}
    return subprocess.run([sys.executable, "-m", "dsv4_sm120.settings", *args], capture_output=True, text=True,
                          env=e, cwd=str(REPO))


def test_cli_lists_checks_and_writes(tmp_path):
    r = _cli()
    assert r.returncode == 0 and all(n in r.stdout for n in S.registry())
    r = _cli("--markdown")
    assert r.returncode == 0 and r.stdout == S.markdown()
    rows = json.loads(_cli("--json").stdout)
    assert [x["name"] for x in rows] == [s.name for s in S._rows()]
    assert {x["name"]: x["default"] for x in rows}["DSV4_SM120_ATTN_BACKEND"] == "dsv4"
    assert _cli("--check").returncode == 0
    r = _cli("--check", env={"DSV4_SM120_ATTN_PREFILL": "torch"})
    assert r.returncode == 1 and "DSV4_SM120_ATTN_PREFILL='torch'" in r.stderr and "Traceback" not in r.stderr
    assert _cli("--help").returncode == 0
    readme = tmp_path / "R.md"
    readme.write_text(f"# x\n{S.README_BEGIN}\n| stale |\n{S.README_END}\ntail\n")
    r = _cli("--write-readme", str(readme))
    assert r.returncode == 0 and S.readme_table(readme.read_text()) == S.markdown()
    # a file of the checkout gets its own table (docs/serving.md: the serve parameters)
    assert S.table_for(REPO / "docs" / "serving.md") == S.markdown(("serve",)) != S.markdown()
    assert readme.read_text().endswith("tail\n")
    (tmp_path / "plain.md").write_text("no markers\n")
    r = _cli("--write-readme", str(tmp_path / "plain.md"))
    assert r.returncode == 2 and "no settings markers" in r.stderr
