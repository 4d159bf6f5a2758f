"""The overlay's import graph: no cycle among dsv4_sm120 modules (imports inside functions count), no import from
a lower layer to a higher one (the layers of docs/DEVELOPING.md, "Layers"), and the patched SGLang's start-up
modules (the glue, the settings) import nothing of the serve planner."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
import re
from typing import Dict, List, Optional, Set, Tuple

from conftest import OVERLAY

PACKAGE = "dsv4_sm120"
DEVELOPING = Path(__file__).resolve().parents[1] / "docs" / "DEVELOPING.md"


def overlay_modules(root: Path = OVERLAY) -> Dict[str, Path]:
    """{dotted module name: file} of every module of the package under ``root``."""
    out = {}
    for p in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _target(name: str, modules: Dict[str, Path]) -> Optional[str]:
    """The module ``name`` denotes: itself, else its longest prefix that is a module (``pkg.mod.attr`` -> ``pkg.mod``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path = OVERLAY) -> Dict[str, Set[str]]:
    """{module: the package modules it imports}, from every ``import`` / ``from`` statement anywhere in its file
    (module level, functions, branches), relative imports resolved. ``from pkg import name`` counts the submodule
    ``pkg.name`` where there is one, else ``pkg``."""
    modules = overlay_modules(root)
    graph: Dict[str, Set[str]] = {}
    for mod, path in modules.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        deps: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[:len(package) - node.level + 1]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin for a in node.names]
            else:
                continue
            for name in names:
                if name == PACKAGE or name.startswith(PACKAGE + "."):
                    t = _target(name, modules)
                    if t is not None and t != mod:
                        deps.add(t)
        graph[mod] = deps
    return graph


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import cycle as ``[a, b, ..., a]``, or None when the graph is acyclic."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(m: str) -> Optional[List[str]]:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_overlay_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and any(graph.values())  # the parse found the package and its imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_names_a_cycle_through_function_level_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (pkg / "c.py").write_text("import os\n\ndef g():\n    from dsv4_sm120 import a\n")
    assert find_cycle(import_graph(tmp_path)) == ["dsv4_sm120.a", "dsv4_sm120.sub.b", "dsv4_sm120.c", "dsv4_sm120.a"]
    (pkg / "c.py").write_text("def g():\n    pass\n")
    assert find_cycle(import_graph(tmp_path)) is None


def layers_of_doc(text: str) -> Tuple[List[Tuple[str, List[str]]], Set[Tuple[str, str]]]:
    """The layer rule written in docs/DEVELOPING.md: the rows of the table between ``<!-- layers: begin -->`` and
    ``<!-- layers: end -->``, lowest layer first, as ``[(layer, [module names without the package prefix])]``
    (``dsv4_sm120`` itself written as such), and the upward imports it allows, the lines `` `a` -> `b`: why``
    between ``<!-- upward imports: begin -->`` and ``<!-- upward imports: end -->``."""
    def block(tag: str) -> str:
        m = re.search(rf"<!-- {tag}: begin -->(.*?)<!-- {tag}: end -->", text, re.S)
        assert m, f"docs/DEVELOPING.md has no {tag} block"
        return m.group(1)

    layers = []
    for line in block("layers").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[1].startswith("`"):
            continue                                   # header, rule line, prose
        layers.append((cells[0], re.findall(r"`([A-Za-z0-9_.]+)`", cells[1])))
    allowed = set()
    for a, b in re.findall(r"`([A-Za-z0-9_.]+)` -> `([A-Za-z0-9_.]+)`:", block("upward imports")):
        allowed.add((a, b))
    return layers, allowed


def _full(name: str) -> str:
    return name if name == PACKAGE else f"{PACKAGE}.{name}"


def layer_index(mod: str, layers: List[Tuple[str, List[str]]]) -> Optional[int]:
    """The layer of module ``mod``: that of the longest listed name equal to it or a package above it."""
    best, index = -1, None
    for i, (_, names) in enumerate(layers):
        for n in map(_full, names):
            if (mod == n or mod.startswith(n + ".")) and len(n) > best:
                best, index = len(n), i
    return index


def upward_imports(graph: Dict[str, Set[str]], layers) -> Set[Tuple[str, str]]:
    """Every import (short names) whose target sits in a higher layer than the importer."""
    short = lambda m: m if m == PACKAGE else m[len(PACKAGE) + 1:]   # noqa: E731
    return {(short(a), short(b)) for a, deps in graph.items() for b in deps
            if layer_index(b, layers) > layer_index(a, layers)}


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    layers, allowed = layers_of_doc(DEVELOPING.read_text())
    assert [name for name, _ in layers][:1] == ["0 floor"] and len(layers) >= 5, layers
    graph = import_graph()
    listed = [n for _, names in layers for n in names]
    assert len(listed) == len(set(listed)), "a module listed in two layers"
    missing = sorted(n for n in listed if _full(n) not in graph)
    assert not missing, f"docs/DEVELOPING.md's layers name modules that do not exist: {missing}"
    unplaced = sorted(m for m in graph if layer_index(m, layers) is None)
    assert not unplaced, f"modules in no layer of docs/DEVELOPING.md (add them to its table): {unplaced}"
    up = upward_imports(graph, layers)
    assert up - allowed == set(), "imports from a lower layer to a higher one: " + ", ".join(
        f"{a} -> {b}" for a, b in sorted(up - allowed))
    assert allowed - up == set(), f"docs/DEVELOPING.md allows upward imports that no longer exist: {allowed - up}"


def test_the_layer_rule_finds_an_upward_import_inside_a_function(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "tools").mkdir(parents=True)
    for f, text in {"__init__.py": "", "settings.py": "", "tools/__init__.py": "",
                    "tools/keys.py": "from .. import settings\n",
                    "tools/run.py": "from ..settings import x\n",
                    "kernels.py": "from . import settings\n\ndef f():\n    from .tools import keys\n"}.items():
        (pkg / f).write_text(text)
    doc = ("<!-- layers: begin -->\n| layer | modules |\n| --- | --- |\n"
           "| 0 floor | `dsv4_sm120`, `settings`, `tools.keys` |\n| 1 kernels | `kernels` |\n| 2 tools | `tools` |\n"
           "<!-- layers: end -->\n<!-- upward imports: begin -->\nnone\n<!-- upward imports: end -->\n")
    layers, allowed = layers_of_doc(doc)
    graph = import_graph(tmp_path)
    assert [layer_index(m, layers) for m in sorted(graph)] == [0, 1, 0, 2, 0, 2]   # the longest name places keys
    assert upward_imports(graph, layers) == set() and allowed == set()   # kernels -> tools.keys: the floor
    (pkg / "settings.py").write_text("def g():\n    from dsv4_sm120.tools import run\n")
    assert upward_imports(import_graph(tmp_path), layers) == {("settings", "tools.run")}
    layers, allowed = layers_of_doc(doc.replace("none", "- `settings` -> `tools.run`: a reason"))
    assert allowed == {("settings", "tools.run")}


def serving_modules_after_startup(overlay: Path = OVERLAY) -> List[str]:
    """The dsv4_sm120.serving modules loaded once every glue module and the settings are imported and the
    settings check of the patched SGLang's start-up has run (a fresh interpreter)."""
    glue = sorted(m for m in overlay_modules(overlay) if m.startswith(PACKAGE + ".sglang_glue"))
    code = ("import importlib, json, sys\n"
            f"for m in {glue + [PACKAGE + '.settings']!r}:\n"
            "    importlib.import_module(m)\n"
            f"importlib.import_module('{PACKAGE}.settings').validate({{}})\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m.startswith('{PACKAGE}.serving'))))\n")
    env = dict(os.environ, PYTHONPATH=str(overlay))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_sglang_startup_modules_import_nothing_of_the_serve_planner():
    assert serving_modules_after_startup() == []


PLAN_WITH_PROFILE = r"""
import json, os, sys
from dsv4_sm120.serving.plan import build_plan
p = build_plan(dict(os.environ), "base")
dec = next(x for x in p.procs if x.role == "decode")
out = {"heavy": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "sglang", "triton")),
       "allreduce": dec.allreduce, "enable": dec.env.get("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE")}
from dsv4_sm120 import machine_profile
out["cuda_read"] = machine_profile.running_versions()["cuda"]   # read from torch's version.py, torch not imported
import torch
out["cuda_torch"] = torch.version.cuda
print(json.dumps(out))
"""


def test_the_serve_plan_reads_the_machine_profile_without_torch_or_sglang(tmp_path):
    """The serve plan runs in the launcher's python: with a matching machine profile present (its all-reduce choice
    read per server, its versions matched), it imports neither torch nor SGLang (a torch import costs seconds and
    the launcher needs neither)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_allreduce_env import DECODE
    from test_serve_dryrun import fake_smi

    from dsv4_sm120 import machine_profile as mp

    gpu = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    prof = {"schema": mp.SCHEMA, "gpu": gpu, "created_at": mp.now_iso(), "versions": mp.running_versions(),
            "deployment": {}, "decisions": {"allreduce": {"servers": {"decode": DECODE}}}}
    path = mp.save(prof, tmp_path / "prof" / f"{mp.file_stem(gpu)}.json")
    env = dict(os.environ, PYTHONPATH=str(OVERLAY), DSV4_SM120_PROFILE_DIR=str(path.parent),
               NVIDIA_SMI=fake_smi(tmp_path / "smi"), RUN_DIR=str(tmp_path / "run"), VENV=sys.prefix,
               MODEL_PATH="deepseek-ai/DeepSeek-V4-Flash")
    r = subprocess.run([sys.executable, "-c", PLAN_WITH_PROFILE], capture_output=True, text=True, env=env, cwd="/",
                       timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["allreduce"].startswith(f"profile {path}") and got["enable"] == "1", got   # the profile was read
    assert got["heavy"] == [], got["heavy"][:10]
    assert got["cuda_read"] == got["cuda_torch"], got       # the profile's cuda version, as torch itself says it
