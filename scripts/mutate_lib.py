"""The parts of `make mutate` (scripts/mutate.py) that need no tool and no subprocess, so that
tests/test_mutate_tool.py checks them on the CPU in milliseconds: the module -> test files map
(scripts/mutate_targets.txt), the selection of what a MODULES= list names, the module-level constant mutants
(mutmut mutates only function and method bodies), the reading of mutmut's per-file results, and the report.

Standard library only.
"""

from __future__ import annotations

import ast
import difflib
import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

PACKAGE_DIR = "overlay/dsv4_sm120/"   # the only tree mutated: mutmut sees it as the top-level package dsv4_sm120
TARGETS_FILE = "scripts/mutate_targets.txt"


class MutateError(Exception):
    """A one-line user error (bad MODULES=, a malformed targets file)."""


# ---------------------------------------------------------------------------------------------------------------
# scripts/mutate_targets.txt: `PATTERN: TEST_FILE ... [+constants]`, `#` comments
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Target:
    pattern: str                 # a file, a directory ending in /, or a glob, relative to the repository root
    tests: List[str]             # test files, relative to the repository root
    constants: bool = False      # also mutate module-level literals (mutate_lib.constant_mutants)
    line: int = 0


def parse_targets(text: str, where: str = TARGETS_FILE) -> List[Target]:
    out: List[Target] = []
    seen = set()
    for n, raw in enumerate(text.splitlines(), 1):
        s = raw.split("#", 1)[0].strip()
        if not s:
            continue
        pattern, colon, rest = s.partition(":")
        pattern = pattern.strip()
        if not colon or not pattern:
            raise MutateError(f"{where}:{n}: expected `MODULE: TEST_FILE ...`, got {raw.strip()!r}")
        if not pattern.startswith(PACKAGE_DIR):
            raise MutateError(f"{where}:{n}: {pattern} is not under {PACKAGE_DIR} (the only tree `make mutate` mutates)")
        if pattern in seen:
            raise MutateError(f"{where}:{n}: {pattern} is listed twice")
        seen.add(pattern)
        words = rest.split()
        flags = [w for w in words if w.startswith("+")]
        tests = [w for w in words if not w.startswith("+")]
        unknown = [f for f in flags if f != "+constants"]
        if unknown:
            raise MutateError(f"{where}:{n}: unknown option {unknown[0]} (the one option is +constants)")
        if not tests:
            raise MutateError(f"{where}:{n}: {pattern} names no test file")
        bad = [t for t in tests if not (t.startswith("tests/") and t.endswith(".py"))]
        if bad:
            raise MutateError(f"{where}:{n}: {bad[0]} is not a test file under tests/")
        out.append(Target(pattern, tests, bool(flags), n))
    if not out:
        raise MutateError(f"{where}: no module is listed")
    return out


def expand(pattern: str, root: Path) -> List[str]:
    """The .py files (repository-relative, sorted) that a pattern names: a file, every .py under a directory
    given with a trailing /, or a glob."""
    if pattern.endswith("/"):
        files = sorted(p for p in (root / pattern).rglob("*.py") if "__pycache__" not in p.parts)
    elif any(c in pattern for c in "*?["):
        files = sorted(root.glob(pattern))
    else:
        files = [root / pattern] if (root / pattern).is_file() else []
    return [p.relative_to(root).as_posix() for p in files if p.is_file() and p.suffix == ".py"]


def covers(pattern: str, rel: str) -> bool:
    if pattern.endswith("/"):
        return rel.startswith(pattern)
    return fnmatch.fnmatchcase(rel, pattern)


@dataclass
class Run:
    """One mutmut run: a MODULES= item, its files, the union of the tests that cover them."""
    name: str
    files: List[str]
    tests: List[str]
    constants: List[str] = field(default_factory=list)   # the files whose module-level literals are mutated too

    @property
    def slug(self) -> str:
        s = self.name[len(PACKAGE_DIR):] if self.name.startswith(PACKAGE_DIR) else self.name
        return "".join(c if c.isalnum() or c in "._-" else "_" for c in s.rstrip("/")) or "all"


def split_modules(arg: str) -> List[str]:
    return [w for w in arg.replace(",", " ").split() if w]


def select(modules: Sequence[str], targets: Sequence[Target], root: Path) -> List[Run]:
    """The runs for a MODULES= list (default: one per target, in file order). An item is a target's own pattern, or
    a file / directory / glob under the package whose every file some target covers."""
    if not modules:
        modules = [t.pattern for t in targets]
    runs: List[Run] = []
    for item in modules:
        item = item[2:] if item.startswith("./") else item
        if (root / item).is_dir() and not item.endswith("/"):
            item += "/"
        own = [t for t in targets if t.pattern == item]
        files = expand(item, root)
        if not files:
            raise MutateError(f"MODULES: {item} names no .py file (paths are relative to the repository root, "
                              f"e.g. {targets[0].pattern})")
        tests: List[str] = []
        constants: List[str] = []
        for f in files:
            if not f.startswith(PACKAGE_DIR):
                raise MutateError(f"MODULES: {f} is not under {PACKAGE_DIR}")
            t = own[0] if own else next((t for t in targets if covers(t.pattern, f)), None)
            if t is None:
                raise MutateError(f"MODULES: no line of {TARGETS_FILE} covers {f}: add `{f}: tests/test_....py` "
                                  f"naming the test files that exercise it")
            tests += [x for x in t.tests if x not in tests]
            if t.constants:
                constants.append(f)
        missing = [x for x in tests if not (root / x).is_file()]
        if missing:
            raise MutateError(f"{TARGETS_FILE}: test file {missing[0]} (for {item}) does not exist")
        runs.append(Run(item, files, tests, constants))
    return runs


# ---------------------------------------------------------------------------------------------------------------
# Module-level constant mutants (mutmut 3 mutates only inside functions: tolerance tables and the like are ours)
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class ConstantMutant:
    line: int
    old: str          # the literal as written
    new: str          # its replacement
    source: str       # the whole mutated file


def _module_level_assignments(body) -> Iterable[ast.stmt]:
    for st in body:
        if isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            yield st
        elif isinstance(st, ast.ClassDef):
            yield from _module_level_assignments(st.body)
        elif isinstance(st, (ast.If, ast.Try)):
            yield from _module_level_assignments(st.body)


def _replacements(value) -> List[str]:
    """What a literal becomes: bools flip, ints +1, floats x10 and /10 (a bound widened or narrowed ten times),
    strings gain XX on both sides (mutmut's own string operator)."""
    if isinstance(value, bool):
        return [repr(not value)]
    if isinstance(value, int):
        return [repr(value + 1)]
    if isinstance(value, float):
        return [repr(value * 10), repr(value / 10)] if value else [repr(1.0)]
    if isinstance(value, str):
        return [repr("XX" + value + "XX")]
    return []


def constant_mutants(source: str) -> List[ConstantMutant]:
    """One mutant per replacement of each literal in a module- or class-level assignment (docstrings, type
    annotations and lines marked `# pragma: no mutate` left alone), in source order."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for ln in lines:
        offsets.append(offsets[-1] + len(ln.encode()))
    data = source.encode()
    out: List[Tuple[int, int, ConstantMutant]] = []
    for st in _module_level_assignments(tree.body):
        value = st.value
        if value is None:
            continue
        for node in ast.walk(value):
            if not isinstance(node, ast.Constant) or node.end_lineno is None:
                continue
            if "pragma: no mutate" in lines[node.lineno - 1]:
                continue
            a = offsets[node.lineno - 1] + node.col_offset
            b = offsets[node.end_lineno - 1] + node.end_col_offset
            old = data[a:b].decode()
            for k, new in enumerate(_replacements(node.value)):
                out.append((a, k, ConstantMutant(node.lineno, " ".join(old.split()), new,
                                                 (data[:a] + new.encode() + data[b:]).decode())))
    return [m for _, _, m in sorted(out, key=lambda x: x[:2])]


# ---------------------------------------------------------------------------------------------------------------
# mutmut's results (version pinned in requirements/mutate.txt): <file>.meta (exit code per mutant) and
# <file>.spans (line span of each function copy in the mutated file)
# ---------------------------------------------------------------------------------------------------------------

KILLED, SURVIVED, TIMEOUT, NO_TESTS, OTHER = "killed", "survived", "timeout", "no tests", "other"
EQUIVALENT = "equivalent"
EQUIVALENT_FILE = "scripts/mutate_equivalent.txt"


def has_functions(source: str) -> bool:
    """Whether mutmut has anything to mutate: a function, or a method of a top-level class."""
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return True
        if isinstance(node, ast.ClassDef) and any(isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
                                                  for s in node.body):
            return True
    return False


def status_of(exit_code: Optional[int]) -> str:
    """mutmut 3.8's exit codes (its stats.status_by_exit_code) folded into the report's five columns."""
    if exit_code in (1, 3, 37, -11, -9):       # a test failed / pytest internal error / type check / crashed
        return KILLED
    if exit_code == 0:
        return SURVIVED
    if exit_code in (36, 24, -24, 152, 255):
        return TIMEOUT
    if exit_code in (5, 33):                   # no test reaches the function in the pytest process
        return NO_TESTS
    return OTHER                               # not checked, skipped, suspicious


@dataclass
class Mutant:
    file: str             # repository-relative source file
    line: int             # 1-based line in that file of the first changed line (0: unknown)
    name: str             # mutmut's mutant name, or `const:<line>:<n>` for a constant mutant
    status: str
    old: str = ""         # the changed line(s) before
    new: str = ""         # and after


def _function_line(source: str, key: str) -> int:
    """The `def` line in the original source of mutmut's function key (`x_f`, `xǁClassǁf`)."""
    if key.startswith("xǁ"):
        cls, _, fn = key[2:].partition("ǁ")
    else:
        cls, fn = None, key[2:]
    for node in ast.parse(source).body:
        if cls is None and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == fn:
            return node.lineno
        if cls is not None and isinstance(node, ast.ClassDef) and node.name == cls:
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name == fn:
                    return sub.lineno
    return 0


def _shown(lines: Sequence[str]) -> str:
    s = " / ".join(" ".join(x.split()) for x in lines)
    return s if len(s) <= 160 else s[:157] + "..."


def read_mutmut_results(mutated_file: Path, original_source: str, rel: str, unchecked: str = OTHER) -> List[Mutant]:
    """The mutants of one file from mutmut's `.meta` / `.spans` next to the mutated copy; each with the source line
    and the change (a diff of the mutant's function against the original copy, both in the mutated file). A mutant
    mutmut did not get to (exit code null) counts as ``unchecked``."""
    meta = json.loads(Path(str(mutated_file) + ".meta").read_text())
    spans_path = Path(str(mutated_file) + ".spans")
    spans = json.loads(spans_path.read_text()).get("spans", {}) if spans_path.is_file() else {}
    mlines = mutated_file.read_text().splitlines()
    def_lines: Dict[str, int] = {}
    out = []
    for name, code in meta.get("exit_code_by_key", {}).items():
        key, _, _ = name.rpartition(".")[2].partition("__mutmut_")
        line, old, new = 0, "", ""
        orig_span, mut_span = spans.get(f"{key}__mutmut_orig"), spans.get(name.rpartition(".")[2])
        if orig_span and mut_span:
            a = mlines[orig_span[0] - 1:orig_span[1]]
            b = mlines[mut_span[0] - 1:mut_span[1]]
            # the two copies' names differ: the same placeholder for both before comparing
            a = [x.replace(f"{key}__mutmut_orig", key) for x in a]
            b = [x.replace(name.rpartition(".")[2], key) for x in b]
            for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
                if tag == "equal":
                    continue
                if key not in def_lines:
                    def_lines[key] = _function_line(original_source, key)
                # the span may start with blank lines: count from the copy's own def line
                d = next((k for k, x in enumerate(a) if x.lstrip().startswith(("def ", "async def "))), 0)
                line = def_lines[key] + i1 - d if def_lines[key] else 0
                old, new = _shown(a[i1:i2]), _shown(b[j1:j2])
                break
        out.append(Mutant(rel, line, name, unchecked if code is None else status_of(code), old, new))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Equivalent mutants (scripts/mutate_equivalent.txt): `FILE: OLD  ->  NEW  ||  REASON`, OLD and NEW as the report
# prints them; a surviving mutant of FILE with that change counts as equivalent, not as a survivor
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Equivalent:
    file: str
    old: str
    new: str
    reason: str
    line: int


def parse_equivalents(text: str, where: str = EQUIVALENT_FILE) -> List[Equivalent]:
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        s = raw.strip()
        if not s or s.startswith("#"):
            continue
        change, sep, reason = s.partition("  ||  ")
        f, colon, change = change.partition(": ")
        old, arrow, new = change.partition("  ->  ")
        if not (sep and colon and arrow and reason.strip() and f.startswith(PACKAGE_DIR)):
            raise MutateError(f"{where}:{n}: expected `FILE: OLD  ->  NEW  ||  WHY IT IS EQUIVALENT`, got {s[:80]!r}")
        out.append(Equivalent(f.strip(), old.strip(), new.strip(), reason.strip(), n))
    return out


def apply_equivalents(results: Dict[str, List[Mutant]], entries: Sequence[Equivalent]) -> List[Equivalent]:
    """Marks the surviving mutants an entry describes as equivalent; returns the entries of these files that
    matched no survivor (stale: the code changed, or the tests now kill the mutant)."""
    used = set()
    for f, ms in results.items():
        for m in ms:
            if m.status not in (SURVIVED, NO_TESTS):
                continue
            for i, e in enumerate(entries):
                if e.file == f and e.old == m.old and e.new == m.new:
                    m.status = EQUIVALENT
                    used.add(i)
    return [e for i, e in enumerate(entries) if e.file in results and i not in used]


# ---------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------

def tally(mutants: Sequence[Mutant]) -> Dict[str, float]:
    c = {k: sum(m.status == k for m in mutants) for k in (KILLED, SURVIVED, TIMEOUT, NO_TESTS, OTHER, EQUIVALENT)}
    n = len(mutants)
    c["mutants"] = n
    real = n - c[EQUIVALENT]
    c["score"] = (c[KILLED] + c[TIMEOUT]) / real if real else 1.0
    return c


def report(results: Dict[str, List[Mutant]], header: Sequence[str] = (), stale: Sequence[Equivalent] = ()) -> str:
    """Per file: mutants, killed, survived, timeout, no tests, other, equivalent, and the score (killed + timeout)
    / (mutants - equivalent); then every mutant neither killed nor equivalent, as `file:line  status  OLD  ->  NEW
    (name)`; then the entries of the equivalents file that matched nothing."""
    lines = list(header)
    w = max([len(f) for f in results] + [6])
    lines.append(f"{'module':<{w}}  mutants  killed  survived  timeout  no-tests  other  equiv   score")
    for f, ms in results.items():
        c = tally(ms)
        lines.append(f"{f:<{w}}  {c['mutants']:7d}  {c[KILLED]:6d}  {c[SURVIVED]:8d}  {c[TIMEOUT]:7d}  "
                     f"{c[NO_TESTS]:8d}  {c[OTHER]:5d}  {c[EQUIVALENT]:5d}  {100 * c['score']:5.1f}%")
    left = [m for ms in results.values() for m in ms if m.status not in (KILLED, TIMEOUT, EQUIVALENT)]
    lines.append("")
    lines.append(f"not killed: {len(left)}" + (" (none)" if not left else ""))
    for m in sorted(left, key=lambda m: (m.file, m.line, m.name)):
        change = f"{m.old}  ->  {m.new}" if (m.old or m.new) else "(change not located)"
        lines.append(f"  {m.file}:{m.line}  {m.status}  {change}  ({m.name})")
    for e in stale:
        lines.append(f"stale: {EQUIVALENT_FILE}:{e.line} matches no surviving mutant of {e.file} (remove it)")
    return "\n".join(lines) + "\n"


def to_json(results: Dict[str, List[Mutant]]) -> dict:
    return {f: {"tally": tally(ms), "mutants": [m.__dict__ for m in ms]} for f, ms in results.items()}


def summary_rows(results: Dict[str, List[Mutant]]) -> List[Tuple[str, Dict[str, float]]]:
    return [(f, tally(ms)) for f, ms in results.items()]
