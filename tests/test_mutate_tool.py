"""`make mutate`'s own plumbing (scripts/mutate.py, scripts/mutate_lib.py), on the CPU without mutmut: the module ->
tests map and what a MODULES= list selects, the module-level constant mutants, the reading of mutmut's result
files (a hand-made .meta / .spans pair in mutmut 3.8's layout), equivalent-mutant entries, the report, and the
committed map, equivalents file and requirements themselves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import mutate_lib as L  # noqa: E402

PKG = "overlay/dsv4_sm120/"


def fake_repo(tmp_path: Path) -> Path:
    for rel in ("overlay/dsv4_sm120/a.py", "overlay/dsv4_sm120/sub/b.py", "overlay/dsv4_sm120/sub/c.py",
                "overlay/dsv4_sm120/sub/notes.txt", "tests/test_a.py", "tests/test_b.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    return tmp_path


def test_targets_parse_and_refuse_malformed_lines():
    t = L.parse_targets(f"# comment\n\n{PKG}a.py: tests/test_a.py tests/test_b.py +constants  # why\n"
                        f"{PKG}sub/: tests/test_b.py\n")
    assert [(x.pattern, x.tests, x.constants, x.line) for x in t] == [
        (f"{PKG}a.py", ["tests/test_a.py", "tests/test_b.py"], True, 3), (f"{PKG}sub/", ["tests/test_b.py"], False, 4)]
    bad = {f"{PKG}a.py tests/test_a.py": "expected `MODULE: TEST_FILE",
           "other/a.py: tests/test_a.py": "is not under overlay/dsv4_sm120/",
           f"{PKG}a.py:": "names no test file",
           f"{PKG}a.py: test_a.py": "is not a test file under tests/",
           f"{PKG}a.py: tests/test_a.py +fast": "unknown option +fast",
           f"{PKG}a.py: tests/test_a.py\n{PKG}a.py: tests/test_b.py": "is listed twice",
           "# nothing\n": "no module is listed"}
    for text, msg in bad.items():
        with pytest.raises(L.MutateError, match=msg.replace("+", r"\+").replace("(", r"\(")):
            L.parse_targets(text)


def test_selection_of_files_directories_and_globs(tmp_path):
    root = fake_repo(tmp_path)
    targets = L.parse_targets(f"{PKG}a.py: tests/test_a.py +constants\n{PKG}sub/*.py: tests/test_b.py tests/test_a.py\n")
    runs = L.select([], targets, root)                  # default: every line, in order
    assert [(r.name, r.files, r.tests, r.constants) for r in runs] == [
        (f"{PKG}a.py", [f"{PKG}a.py"], ["tests/test_a.py"], [f"{PKG}a.py"]),
        (f"{PKG}sub/*.py", [f"{PKG}sub/b.py", f"{PKG}sub/c.py"], ["tests/test_b.py", "tests/test_a.py"], [])]
    # a file inside a line's glob takes that line's tests; a directory without its slash is a directory
    (r,) = L.select([f"./{PKG}sub/c.py"], targets, root)
    assert (r.name, r.files, r.tests) == (f"{PKG}sub/c.py", [f"{PKG}sub/c.py"], ["tests/test_b.py", "tests/test_a.py"])
    (r,) = L.select([f"{PKG}sub"], targets, root)
    assert r.files == [f"{PKG}sub/b.py", f"{PKG}sub/c.py"] and r.slug == "sub"
    assert L.split_modules(f" {PKG}a.py,{PKG}sub/  ") == [f"{PKG}a.py", f"{PKG}sub/"]
    with pytest.raises(L.MutateError, match="names no .py file"):
        L.select([f"{PKG}nope.py"], targets, root)
    with pytest.raises(L.MutateError, match="no line of scripts/mutate_targets.txt covers"):
        L.select([f"{PKG}sub/"], L.parse_targets(f"{PKG}sub/b.py: tests/test_b.py\n"), root)
    with pytest.raises(L.MutateError, match="test file tests/test_gone.py .* does not exist"):
        L.select([], L.parse_targets(f"{PKG}a.py: tests/test_gone.py\n"), root)


def test_constant_mutants_cover_module_and_class_literals_only():
    src = ('"""doc"""\nA = 2e-2\nB = {"k": 0.3, "n": 7}\nFLAG = True\nSKIP = 5  # pragma: no mutate\n'
           'class C:\n    """doc"""\n    x: int = 3\n    def f(self):\n        return 99\n'
           'def g():\n    y = 0.5\n    return y\n')
    ms = L.constant_mutants(src)
    assert [(m.line, m.old, m.new) for m in ms] == [
        (2, "2e-2", "0.2"), (2, "2e-2", "0.002"),
        (3, '"k"', "'XXkXX'"), (3, "0.3", "3.0"), (3, "0.3", "0.03"), (3, '"n"', "'XXnXX'"), (3, "7", "8"),
        (4, "True", "False"), (8, "3", "4")]
    for m in ms:                                         # each mutant is the source with that one literal changed
        assert m.source.count("\n") == src.count("\n") and m.source != src
        ns = {}
        exec(compile(m.source, "m", "exec"), ns)
    ns = {}
    exec(compile(ms[1].source, "m", "exec"), ns)
    assert ns["A"] == pytest.approx(0.002) and ns["B"] == {"k": 0.3, "n": 7}
    assert L.has_functions(src) and not L.has_functions("A = 1\nclass C:\n    x = 1\n")


def test_mutmut_results_with_lines_and_changes(tmp_path):
    original = ("import os\n\n\ndef f(a):\n    b = a + 1\n    return b\n\n\nclass K:\n    def m(self):\n"
                "        return 'x'\n")
    # mutmut's mutated copy: each function's original and mutants, spans from the blank lines before them
    mutated = ("import os\n\n\ndef x_f__mutmut_orig(a):\n    b = a + 1\n    return b\n\n\n"
               "def x_f__mutmut_1(a):\n    b = a - 1\n    return b\n\n\n"
               "def x_f__mutmut_2(a):\n    b = a + 1\n    return None\n\n\n"
               "class K:\n    def xǁKǁm__mutmut_orig(self):\n        return 'x'\n"
               "    def xǁKǁm__mutmut_1(self):\n        return 'XXxXX'\n")
    f = tmp_path / "mod.py"
    f.write_text(mutated)
    Path(str(f) + ".meta").write_text(json.dumps({"exit_code_by_key": {
        "pkg.mod.x_f__mutmut_1": 1, "pkg.mod.x_f__mutmut_2": 0, "pkg.mod.xǁKǁm__mutmut_1": 33}}))
    Path(str(f) + ".spans").write_text(json.dumps({"version": 1, "spans": {
        "x_f__mutmut_orig": [2, 6], "x_f__mutmut_1": [7, 11], "x_f__mutmut_2": [12, 16],
        "xǁKǁm__mutmut_orig": [20, 21], "xǁKǁm__mutmut_1": [22, 23]}}))
    ms = L.read_mutmut_results(f, original, "overlay/dsv4_sm120/mod.py")
    got = [(m.line, m.status, m.old, m.new) for m in ms]
    assert got == [(5, "killed", "b = a + 1", "b = a - 1"), (6, "survived", "return b", "return None"),
                   (11, "no tests", "return 'x'", "return 'XXxXX'")]
    assert original.splitlines()[4] == "    b = a + 1" and original.splitlines()[10] == "        return 'x'"
    codes = {None: "other", 0: "survived", 1: "killed", 3: "killed", 5: "no tests", 33: "no tests", 36: "timeout",
             -24: "timeout", 34: "other", 37: "killed"}
    assert {c: L.status_of(c) for c in codes} == codes


def test_equivalents_and_the_report():
    F = "overlay/dsv4_sm120/mod.py"
    ms = [L.Mutant(F, 5, "n1", L.KILLED, "b = a + 1", "b = a - 1"),
          L.Mutant(F, 6, "n2", L.SURVIVED, "return b", "return None"),
          L.Mutant(F, 9, "n3", L.SURVIVED, "x = 1", "x = 2"),
          L.Mutant(F, 9, "n4", L.TIMEOUT, "while a:", "while True:")]
    entries = L.parse_equivalents(f"# c\n{F}: x = 1  ->  x = 2  ||  x is never read\n"
                                  f"{F}: gone  ->  away  ||  stale one\n")
    stale = L.apply_equivalents({F: ms}, entries)
    assert [m.status for m in ms] == [L.KILLED, L.SURVIVED, L.EQUIVALENT, L.TIMEOUT]
    assert [e.line for e in stale] == [3]
    c = L.tally(ms)
    assert (c["mutants"], c[L.KILLED], c[L.SURVIVED], c[L.TIMEOUT], c[L.EQUIVALENT]) == (4, 1, 1, 1, 1)
    assert c["score"] == pytest.approx(2 / 3)            # (killed + timeout) / (mutants - equivalent)
    text = L.report({F: ms}, ["# head"], stale)
    lines = text.splitlines()
    assert lines[0] == "# head" and lines[2].split() == [F, "4", "1", "1", "1", "0", "0", "1", "66.7%"]
    assert f"  {F}:6  survived  return b  ->  return None  (n2)" in lines
    assert "not killed: 1" in lines and not any("n3" in x or "n1" in x for x in lines)
    assert lines[-1] == f"stale: {L.EQUIVALENT_FILE}:3 matches no surviving mutant of {F} (remove it)"
    assert L.tally([])["score"] == 1.0
    for bad in (f"{F}: a -> b  ||  r", f"{F}: a  ->  b", f"other.py: a  ->  b  ||  r", f"{F}: a  ->  b  ||  "):
        with pytest.raises(L.MutateError):
            L.parse_equivalents(bad)


def test_the_committed_map_equivalents_and_requirements():
    targets = L.parse_targets((REPO / L.TARGETS_FILE).read_text())
    runs = L.select([], targets, REPO)
    for want in ("sglang_glue/", "dev/sm120_*.py", "serving/preflight.py", "serving/plan.py", "model_config.py",
                 "machine_profile/__init__.py", "tolerances.py"):
        assert PKG + want in [r.name for r in runs], want
    assert L.parse_equivalents((REPO / L.EQUIVALENT_FILE).read_text())
    # mutate.txt names only what the test environment lacks: nothing that requirements/constraints.txt pins
    def names(path):
        return {ln.split("==")[0].strip().lower().replace("_", "-") for ln in path.read_text().splitlines()
                if "==" in ln and not ln.startswith("#")}
    mine = names(REPO / "requirements" / "mutate.txt")
    assert "mutmut" in mine and not mine & names(REPO / "requirements" / "constraints.txt")


def test_the_command_lists_without_running_and_refuses_in_one_line():
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "mutate.py"), "--dry-run", "--modules",
                        f"{PKG}model_config.py"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"{PKG}model_config.py\n  files: {PKG}model_config.py\n  tests: tests/" in r.stdout
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "mutate.py"), "--dry-run", "--modules",
                        f"{PKG}fileio.py"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no line of scripts/mutate_targets.txt" in r.stderr


def test_children_of_the_coverage_pass_run_the_original_code(tmp_path):
    """The sitecustomize the scratch tree gets: the first Python process (mutmut's) keeps MUTANT_UNDER_TEST, a
    later one (a test's child) drops "stats" but keeps a mutant's name."""
    import mutate as M

    (tmp_path / "sitecustomize.py").write_text(M.CHILD_STATS_GUARD)
    child = "import os; print(repr(os.environ.get('MUTANT_UNDER_TEST')))"
    parent = ("import os, subprocess, sys; print(repr(os.environ.get('MUTANT_UNDER_TEST')), flush=True); "
              f"subprocess.run([sys.executable, '-c', {child!r}])")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("MUTATE_FIRST_PYTHON_PID",)}
    env["PYTHONPATH"] = str(tmp_path)
    for marker, in_child in (("stats", "''"), ("list_all_tests", "''"), ("dsv4_sm120.x.x_f__mutmut_3",
                                                                          "'dsv4_sm120.x.x_f__mutmut_3'")):
        r = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60,
                           env=dict(env, MUTANT_UNDER_TEST=marker))
        assert r.stdout.split() == [repr(marker), in_child], (marker, r.stdout, r.stderr)


def test_retest_needs_an_earlier_run(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "mutate.py"), "--retest", "--out", str(tmp_path),
                        "--modules", f"{PKG}tolerances.py"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
        "[mutate] error: --retest: no earlier run of overlay/dsv4_sm120/tolerances.py"), r.stderr
