#!/usr/bin/env python3
"""Mutation testing of the overlay with mutmut (`make mutate`, a maintainer target; docs/DEVELOPING.md, "Mutation
testing").

For each item of MODULES (default: every line of scripts/mutate_targets.txt, one after the other) it mutates the
item's files and runs only the test files that line maps them to, then reports per file how many mutants the
tests killed and lists the ones they did not (file:line, the change, mutmut's name). mutmut mutates function and
method bodies; a line marked `+constants` also gets one mutant per module-level literal (mutate_lib), each run
against the same test files. Nothing here is part of `make test`.

Where things go (outside the checkout): the tool in ${DSV4_SM120_CACHE}/tools/mutmut-<hash of
requirements/mutate.txt>/ (installed once with --no-deps; the test environment, created on demand like `make
test` does, supplies pytest and the rest), one scratch tree per item in ${DSV4_SM120_CACHE}/mutate/work/<item>/,
the reports in ${DSV4_SM120_CACHE}/mutate/ (--out): <item>.txt and <item>.json per item, report.txt for the
whole invocation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import mutate_lib as L  # noqa: E402

CACHE = Path(os.environ.get("DSV4_SM120_CACHE") or Path.home() / ".cache" / "dsv4_sm120")
MUTMUT_MAIN = "import sys; sys.argv[0] = 'mutmut'; from mutmut.__main__ import cli; cli()"


def say(msg: str) -> None:
    print(f"[mutate] {msg}", flush=True)


def test_venv() -> Path:
    venv = Path(os.environ.get("TEST_VENV") or CACHE / "test-venv")
    r = subprocess.run([str(ROOT / "scripts" / "setup_env.sh"), str(venv)], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        sys.stdout.write(r.stdout[-3000:])
        raise L.MutateError("could not set up the test environment (scripts/setup_env.sh, above)")
    return venv


def tool_dir(python: Path) -> Path:
    """mutmut and its missing dependencies, installed once per content of requirements/mutate.txt."""
    req = ROOT / "requirements" / "mutate.txt"
    stamp = hashlib.sha256(req.read_bytes()).hexdigest()[:12]
    d = CACHE / "tools" / f"mutmut-{stamp}"
    if (d / ".complete").is_file():
        return d
    say(f"installing requirements/mutate.txt into {d} (once)")
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(d) + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    r = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                        "--no-warn-script-location", "--target", str(tmp), "-r", str(req)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        sys.stdout.write(r.stdout[-3000:])
        raise L.MutateError("could not install requirements/mutate.txt (pip's output above)")
    (tmp / ".complete").write_text(stamp + "\n")
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)
    return d


def checkout_files() -> List[str]:
    """The checkout's files as git sees them (tracked, and new files not ignored), as they are on disk."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=True).stdout
        files = [f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "__pycache__", ".pytest_cache"}
        files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
                 if p.is_file() and not skip.intersection(p.relative_to(ROOT).parts)]
    return sorted(f for f in files if (ROOT / f).is_file())


def copy_tree(dest: Path, package_at_top: bool) -> None:
    """The checkout into dest; with package_at_top, overlay/dsv4_sm120/ becomes dest/dsv4_sm120/ (mutmut names a
    mutant by its path, which must then be the module's import name)."""
    for f in checkout_files():
        rel = f[len("overlay/"):] if package_at_top and f.startswith(L.PACKAGE_DIR) else f
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / rel)


def mutmut_config(run: L.Run, top_level: List[str]) -> str:
    def block(key, items):
        return f"{key} =\n" + "".join(f"    {x}\n" for x in items)
    return ("[mutmut]\nsource_paths = dsv4_sm120\n"
            + block("only_mutate", [f[len("overlay/"):] for f in run.files])
            + block("also_copy", top_level)
            + "pytest_add_cli_args = -p no:cacheprovider -p no:randomly\n"
            + block("pytest_add_cli_args_test_selection", run.tests))


def run_bounded(cmd, cwd: Path, env: dict, log: Path, timeout: float) -> int:
    """cmd in its own process group, output to log; the whole group is killed past timeout (returns 124)."""
    with open(log, "ab") as out:
        p = subprocess.Popen(cmd, cwd=str(cwd), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return 124
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def base_env(work: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MUTANT_UNDER_TEST", "PYTEST_ADDOPTS",
                                                                "MUTATE_FIRST_PYTHON_PID")}
    # OMP_NUM_THREADS=1: mutmut forks each mutant's run from a process whose tests already ran torch's OpenMP
    # thread pool, and GNU OpenMP is not fork-safe (the child hangs at its next parallel op until mutmut's time
    # limit, a false "timeout"); one thread per job also fits the 2-core box
    # no DSV4_SM120_* variable of the tool's own: the serve scripts' dry runs pass DSV4_SM120_* through to the
    # servers and list each one (tests/test_serve_dryrun.py counts those lines); nothing here runs pytest-xdist,
    # whose controller alone writes DSV4_SM120_TEST_DURATIONS
    env.update(PYTHONDONTWRITEBYTECODE="1", TEST_FORK_SERVER="0", OMP_NUM_THREADS="1")
    return env


# mutmut's coverage pass ("stats") runs the tests in its own process with MUTANT_UNDER_TEST=stats in the
# environment, which a test's child process (a serve script's dry run, `python -m dsv4_sm120...`) inherits: there a
# mutated function's trampoline records the hit for a process nobody reads and first loads mutmut's config from the
# child's working directory, where there is none, so the child fails where the tests expect it to work (and the
# coverage pass stops). This sitecustomize (mutants/overlay, on every such child's PYTHONPATH) lets the first Python
# process (mutmut's) mark the environment, and turns the marker "stats" off in any later Python process: a child runs
# the original code then, as it does in the test run without mutmut. A child of a mutant's run keeps the mutant.
CHILD_STATS_GUARD = """import os
if "MUTATE_FIRST_PYTHON_PID" not in os.environ:
    os.environ["MUTATE_FIRST_PYTHON_PID"] = str(os.getpid())
elif os.environ.get("MUTANT_UNDER_TEST") in ("stats", "list_all_tests"):
    os.environ["MUTANT_UNDER_TEST"] = ""
"""


def prepare_tree(run: L.Run, work: Path, tool: Path) -> Path:
    """The scratch tree mutmut runs in: the checkout with the package at the top (mutmut names a mutant by its path,
    which must be the import name), and mutants/, where the tests run, laid out beforehand as the checkout itself
    (mutmut copies only what is missing there, then mutates the package's files in place)."""
    tree = work / "tree"
    copy_tree(tree, package_at_top=True)
    top = sorted(p.name for p in tree.iterdir() if p.name not in ("dsv4_sm120", "mutants", "setup.cfg"))
    (tree / "setup.cfg").write_text(mutmut_config(run, top))
    # mutants/dsv4_sm120 (what mutmut mutates) is a link to mutants/overlay/dsv4_sm120: the package's idea of its
    # checkout (dsv4_sm120.paths: the resolved file's ../..) is mutants/, the copy the tests run in, and a child
    # given <repo>/overlay as PYTHONPATH imports the mutated copy too; mutmut (which the mutated files import)
    # sits beside it for such children
    mutants = tree / "mutants"
    copy_tree(mutants, package_at_top=False)
    (mutants / "dsv4_sm120").symlink_to(Path("overlay") / "dsv4_sm120")
    ov = mutants / "overlay"
    for p in tool.iterdir():
        if p.name == "mutmut" or (p.name.startswith("mutmut-") and p.name.endswith(".dist-info")):
            (ov / p.name).symlink_to(p)
    (ov / "sitecustomize.py").write_text(CHILD_STATS_GUARD)
    # a git work tree, for the tests that list the checkout's files (git ls-files -co); mutmut's own files unlisted
    if subprocess.run(["git", "init", "-q", str(mutants)], stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL).returncode == 0:
        excl = mutants / ".git" / "info" / "exclude"
        excl.parent.mkdir(parents=True, exist_ok=True)
        excl.write_text("*.meta\n*.spans\nmutmut-*.json\nmutmut-*.log\n/dsv4_sm120\n/overlay/mutmut*\n"
                        "/overlay/sitecustomize.py\n")
    return tree


NO_TEST_REACHED = "could not find any test case for any mutant"


def run_mutmut(run: L.Run, work: Path, python: Path, tool: Path, jobs: int, timeout: float) -> Dict[str, list]:
    if not any(L.has_functions((ROOT / f).read_text()) for f in run.files):
        return {}                                      # nothing for mutmut (module-level constants only)
    tree = prepare_tree(run, work, tool)
    ov = tree / "mutants" / "overlay"
    env = base_env(work)
    env["PYTHONPATH"] = os.pathsep.join([str(ov), str(tool)])
    log = work / "mutmut.log"
    rc = run_bounded([str(python), "-c", MUTMUT_MAIN, "run", "--max-children", str(jobs)], tree, env, log, timeout)
    # mutmut stops before testing anything when no selected test reaches a mutated function: all "no tests"
    unreached = rc == 1 and NO_TEST_REACHED in log.read_text(errors="replace")
    results = {}
    for f in run.files:
        mutated = tree / "mutants" / f[len("overlay/"):]
        if not Path(str(mutated) + ".meta").is_file():
            continue                                   # no function in this file
        results[f] = L.read_mutmut_results(mutated, (ROOT / f).read_text(), f, unchecked=L.NO_TESTS if unreached
                                           else L.OTHER)
    if rc != 0 and not unreached:
        tail = log.read_text(errors="replace")[-2500:].replace("\r", "\n")
        raise L.MutateError(f"mutmut exited with {rc} on {run.name} ({'time limit' if rc == 124 else 'see below'}); "
                            f"log: {log}\n{tail}")
    return results


def refresh_tree(run: L.Run, tree: Path) -> bool:
    """The last run's scratch tree brought up to the checkout (--retest): each file that differs is copied to the
    tree's own copy (mutmut copies the tree's top-level items into mutants/ at its start) and, but for the
    modules under test, into mutants/; a changed module under test is then newer than its mutated copy, and
    mutmut mutates again the functions whose text changed. Returns whether a module under test changed."""
    changed = False
    for f in checkout_files():
        src = ROOT / f
        top = tree / (f[len("overlay/"):] if f.startswith(L.PACKAGE_DIR) else f)
        dests = [top] if f in run.files else [top, tree / "mutants" / f]
        for dest in dests:
            if dest.is_file() and dest.read_bytes() == src.read_bytes():
                continue
            changed = changed or f in run.files
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)
            os.utime(dest)                             # newer than the mutated copy, whatever the checkout's mtime
    return changed


def retest_problem(run: L.Run, work: Path) -> str:
    """Why --retest cannot reuse the last run of ``run`` ("" when it can): no such run, or other test files (mutmut
    resets every result when its test selection changes)."""
    cfg = work / "tree" / "setup.cfg"
    if not (work / "tree" / "mutants").is_dir() or not cfg.is_file():
        return f"no earlier run of {run.name} in {work} (run it once without --retest)"
    text = cfg.read_text()
    block = text.split("pytest_add_cli_args_test_selection =", 1)[-1]
    last = [w.strip() for w in block.splitlines() if w.startswith("    ")]
    if last != list(run.tests):
        return (f"the test files of {run.name} changed since its last run ({' '.join(last)} -> {' '.join(run.tests)}): "
                "run it in full, without --retest")
    return ""


def retest_mutmut(run: L.Run, work: Path, previous: Path, python: Path, tool: Path, jobs: int, timeout: float,
                  equivalents) -> Dict[str, list]:
    """--retest: the last run's survivors (those not listed as equivalent) and the mutants no test reached, tested
    again against the checkout's tests, and the mutants of functions changed since; the other results (constant
    mutants included) stand. mutmut collects coverage for the tests that are new since its last run."""
    tree = work / "tree"
    old = read_results(run, work, work / "none.json")
    L.apply_equivalents(old, equivalents)
    names = sorted(m.name for ms in old.values() for m in ms if m.status in (L.SURVIVED, L.NO_TESTS)
                   and m.file in run.files and not m.name.startswith("const:"))
    env = base_env(work)
    env["PYTHONPATH"] = os.pathsep.join([str(tree / "mutants" / "overlay"), str(tool)])
    log = work / "mutmut.log"
    cmd = [str(python), "-c", MUTMUT_MAIN, "run", "--max-children", str(jobs)]
    t_end = time.time() + timeout
    if refresh_tree(run, tree):                        # mutants of changed functions: mutmut's plain run
        say(f"{run.name}: module changed; testing the mutants of its changed functions")
        rc = run_bounded(cmd, tree, env, log, timeout)
        if rc != 0:
            raise L.MutateError(f"mutmut exited with {rc} on {run.name}; log: {log}")
    if names:
        say(f"{run.name}: testing {len(names)} survivor(s) of the last run again")
        rc = run_bounded(cmd + names, tree, env, log, max(1.0, t_end - time.time()))
        if rc != 0:
            tail = log.read_text(errors="replace")[-2500:].replace("\r", "\n")
            raise L.MutateError(f"mutmut exited with {rc} on {run.name}; log: {log}\n{tail}")
    return read_results(run, work, previous)


def read_results(run: L.Run, work: Path, previous: Path) -> Dict[str, list]:
    """An item's last results again (--report-only): mutmut's files in its scratch tree, the constant mutants from
    its last JSON report."""
    res: Dict[str, list] = {}
    for f in run.files:
        mutated = work / "tree" / "mutants" / f[len("overlay/"):]
        if Path(str(mutated) + ".meta").is_file():
            res[f] = L.read_mutmut_results(mutated, (ROOT / f).read_text(), f)
    old = json.loads(previous.read_text()) if previous.is_file() else {}
    for f, entry in old.items():
        consts = [L.Mutant(**m) for m in entry.get("mutants", []) if m["name"].startswith("const:")]
        for m in consts:
            m.status = L.SURVIVED if m.status == L.EQUIVALENT else m.status   # decided again below
        if consts:
            res[f] = res.get(f, []) + consts
    if not res:
        raise L.MutateError(f"no results of {run.name} in {work} (run it first)")
    return res


def run_constants(run: L.Run, work: Path, python: Path, timeout: float) -> Dict[str, list]:
    if not run.constants:
        return {}
    tree = work / "const"
    copy_tree(tree, package_at_top=False)
    env = base_env(work)
    env["PYTHONPATH"] = str(tree / "overlay")
    log = work / "constants.log"
    cmd = [str(python), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *run.tests]
    t0 = time.time()
    if run_bounded(cmd, tree, env, log, timeout) != 0:
        raise L.MutateError(f"the tests of {run.name} fail on the unmutated code (log: {log})")
    limit = max(30.0, 5 * (time.time() - t0))
    out: Dict[str, list] = {}
    for f in run.constants:
        original = (ROOT / f).read_text()
        ms = []
        for i, m in enumerate(L.constant_mutants(original), 1):
            (tree / f).write_text(m.source)
            rc = run_bounded(cmd, tree, env, log, limit)
            status = {0: L.SURVIVED, 124: L.TIMEOUT, 5: L.NO_TESTS}.get(rc, L.KILLED)
            ms.append(L.Mutant(f, m.line, f"const:{m.line}:{i}", status, m.old, m.new))
        (tree / f).write_text(original)
        out[f] = ms
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="make mutate", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modules", default=os.environ.get("MODULES", ""),
                    help="files, directories (trailing /) or globs under overlay/dsv4_sm120/, space- or comma-"
                         "separated (default: every line of scripts/mutate_targets.txt)")
    ap.add_argument("--jobs", type=int, default=2, help="mutants tested at once (default 2)")
    ap.add_argument("--out", default=str(CACHE / "mutate"), help="where the reports and scratch trees go")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds one item may take (default 3600)")
    ap.add_argument("--dry-run", action="store_true", help="list each item's files and test files; run nothing")
    ap.add_argument("--report-only", action="store_true",
                    help="report the last run's results again (after editing scripts/mutate_equivalent.txt)")
    ap.add_argument("--retest", action="store_true",
                    help="test again only the last run's survivors (and mutants no test reached), and the mutants of "
                         "functions changed since "
                         "(after adding tests; the scratch tree of the last run is reused)")
    a = ap.parse_args(argv)
    try:
        targets = L.parse_targets((ROOT / L.TARGETS_FILE).read_text())
        eq_file = ROOT / L.EQUIVALENT_FILE
        equivalents = L.parse_equivalents(eq_file.read_text()) if eq_file.is_file() else []
        runs = L.select(L.split_modules(a.modules), targets, ROOT)
        if a.dry_run:
            for r in runs:
                print(f"{r.name}\n  files: {' '.join(r.files)}\n  tests: {' '.join(r.tests)}"
                      + (f"\n  constants: {' '.join(r.constants)}" if r.constants else ""))
            return 0
        out = Path(a.out)
        for r in runs if a.retest else []:
            why = retest_problem(r, out / "work" / r.slug)
            if why:
                raise L.MutateError(f"--retest: {why}")
        if not a.report_only:
            python = test_venv() / "bin" / "python"
            tool = tool_dir(python)
        everything: Dict[str, list] = {}
        all_stale: list = []
        timing = []
        for r in runs:
            work = out / "work" / r.slug
            t0 = time.time()
            if a.report_only:
                res = read_results(r, work, out / f"{r.slug}.json")
            elif a.retest:
                res = retest_mutmut(r, work, out / f"{r.slug}.json", python, tool, a.jobs, a.timeout, equivalents)
            else:
                say(f"{r.name}: {len(r.files)} file(s), tests: {' '.join(r.tests)}")
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir(parents=True)
                res = run_mutmut(r, work, python, tool, a.jobs, a.timeout)
                for f, ms in run_constants(r, work, python, a.timeout).items():
                    res[f] = res.get(f, []) + ms
            secs = time.time() - t0
            took = ("reported again from the last run" if a.report_only
                    else f"{secs:.0f} s, survivors retested" if a.retest else f"{secs:.0f} s")
            timing.append(f"{r.name}: {took}")
            stale = L.apply_equivalents(res, equivalents)
            all_stale += stale
            text = L.report(res, [f"# make mutate MODULES={r.name}  ({took}, {a.jobs} jobs; tests: "
                                  f"{' '.join(r.tests)})"], stale)
            (out / f"{r.slug}.txt").write_text(text)
            (out / f"{r.slug}.json").write_text(json.dumps(L.to_json(res), indent=1))
            say(f"{r.name}: {took}; report {out / (r.slug + '.txt')}")
            everything.update(res)
        text = L.report(everything, ["# make mutate: " + "; ".join(timing)], all_stale)
        (out / "report.txt").write_text(text)
        print(text, end="")
        say(f"report: {out / 'report.txt'}")
        return 0
    except L.MutateError as e:
        print(f"[mutate] error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
