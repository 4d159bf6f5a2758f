"""The overlay's import graph: no cycle among dsv4_sm120 modules (imports inside functions count), and the
patched SGLang's start-up modules (the glue, the settings) import nothing of the serve planner."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set

from conftest import OVERLAY

PACKAGE = "dsv4_sm120"


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
from dsv4_sm120.calibrate import machine_profile
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

    from dsv4_sm120.calibrate import machine_profile as mp

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
