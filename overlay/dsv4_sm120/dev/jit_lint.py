"""A source check of this package's Triton / Gluon kernels for a pattern Triton 3.6 compiles wrongly, silently.

Triton 3.6's front end does not carry a loop variable into the next iteration when the loop body derives the
bound of an inner ``for`` from it (``range(n)``, ``m = n + 1; range(m)``, or a callee's ``range(param)``) and then
assigns it: the inner loop keeps the value from before the outer loop. Triton 3.8 carries it (checked by compiling
reduced kernels for sm_90 with both and reading the ``scf.for`` carries of the TTGIR). Seen on the H200 (Triton
3.6): a balanced wgmma_t launch that read the next piece's block count a piece ahead ran every piece with the first
piece's count (wrong output, then a hang). Reduced::

    nb = tl.load(lens)
    for r in range(0, n):
        for _ in range(nb):      # always the first nb under 3.6
            acc += 1
        nb = tl.load(lens + r + 1)

:func:`carry_hazards` finds such a name in every ``@*.jit`` function of the given files: a name a loop body reads
into an inner ``for``'s range arguments (directly, through assignments in that body, or as an argument at a
parameter of a jit function of those files that reaches a range bound there) before the body assigns it. It
over-approximates (every name of an assignment's right side flows into its targets); the product's kernels have
none. Torch-free.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterable, List, Set, Tuple


def _is_jit(fn: ast.FunctionDef) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if (isinstance(target, ast.Attribute) and target.attr == "jit") or (isinstance(target, ast.Name)
                                                                            and target.id == "jit"):
            return True
    return False


def jit_functions(sources: Iterable[Tuple[str, str]]) -> Dict[Tuple[str, str], ast.FunctionDef]:
    """``{(origin, name): FunctionDef}`` of the jit-decorated functions of ``(origin, source text)`` pairs."""
    out = {}
    for origin, text in sources:
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and _is_jit(node):
                out[(origin, node.name)] = node
    return out


def _resolver(funcs):
    # a call's jit callee: the function of that name in the caller's file, else the one function of that name
    by_name: Dict[str, List[Tuple[str, str]]] = {}
    for key in funcs:
        by_name.setdefault(key[1], []).append(key)

    def resolve(origin: str, name: str):
        if (origin, name) in funcs:
            return (origin, name)
        keys = by_name.get(name, [])
        return keys[0] if len(keys) == 1 else None
    return resolve


def _names(node) -> Set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else (f.attr if isinstance(f, ast.Attribute) else "")


def _direct_bound_uses(node, callee_bounds):
    """(lineno, col, name) of every name ``node`` reads as a loop bound: in a ``for``'s range arguments, or as an
    argument at a bound parameter of a jit callee (``callee_bounds(call)``: its bound parameter indices and names)."""
    for sub in ast.walk(node):
        exprs = []
        if isinstance(sub, ast.For) and isinstance(sub.iter, ast.Call):
            exprs = list(sub.iter.args) + [k.value for k in sub.iter.keywords]
        elif isinstance(sub, ast.Call):
            idx, names = callee_bounds(sub)
            exprs = [a for i, a in enumerate(sub.args) if i in idx] + [k.value for k in sub.keywords if k.arg in names]
        for e in exprs:
            for n in ast.walk(e):
                if isinstance(n, ast.Name):
                    yield n.lineno, n.col_offset, n.id


def _bound_uses(stmts, callee_bounds) -> Dict[str, Tuple[int, int]]:
    """``{name: (lineno, col)}``: where ``stmts`` first read each name into a loop bound, directly or through their
    assignments (an assignment whose target reaches a bound reads every name of its right side into it)."""
    uses: Dict[str, Tuple[int, int]] = {}
    for stmt in stmts:
        for line, col, name in _direct_bound_uses(stmt, callee_bounds):
            uses[name] = min(uses.get(name, (line, col)), (line, col))
    assigns = [sub for stmt in stmts for sub in ast.walk(stmt) if isinstance(sub, (ast.Assign, ast.AugAssign))]
    changed = True
    while changed:
        changed = False
        for sub in assigns:
            targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
            if any(n in uses for t in targets for n in _names(t)):
                for n in ast.walk(sub.value):
                    if isinstance(n, ast.Name) and uses.get(n.id, (1 << 30, 0)) > (n.lineno, n.col_offset):
                        uses[n.id] = (n.lineno, n.col_offset)
                        changed = True
    return uses


def _assignments(node):
    """(lineno, col, name) of every name assigned inside ``node`` (assignments, augmented ones, for targets)."""
    for sub in ast.walk(node):
        targets = []
        if isinstance(sub, ast.Assign):
            targets = sub.targets
        elif isinstance(sub, (ast.AugAssign, ast.AnnAssign)):
            targets = [sub.target]
        elif isinstance(sub, ast.For):
            targets = [sub.target]
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    yield n.lineno, n.col_offset, n.id


def _callee_bounds(funcs, bounds, resolve, origin):
    # a call's bound parameters (indices, names) where its callee is a jit function (``resolve``: _resolver)
    def callee_bounds(call: ast.Call):
        key = resolve(origin, _callee(call))
        if key is None:
            return set(), set()
        params = [a.arg for a in funcs[key].args.args]
        return bounds[key], {params[i] for i in bounds[key]}
    return callee_bounds


def bound_params(funcs: Dict[Tuple[str, str], ast.FunctionDef]) -> Dict[Tuple[str, str], Set[int]]:
    """Per jit function, the indices of its parameters that reach a ``for`` range bound, in it or (transitively)
    in a jit callee."""
    bounds: Dict[Tuple[str, str], Set[int]] = {key: set() for key in funcs}
    resolve = _resolver(funcs)
    changed = True
    while changed:
        changed = False
        for key, fn in funcs.items():
            used = set(_bound_uses(fn.body, _callee_bounds(funcs, bounds, resolve, key[0])))
            new = {i for i, a in enumerate(fn.args.args) if a.arg in used}
            if not new <= bounds[key]:
                bounds[key] |= new
                changed = True
    return bounds


def carry_hazards(sources: Iterable[Tuple[str, str]]) -> List[Tuple[str, str, int, str]]:
    """``(origin, function, line, name)`` for every loop of a jit function whose body reads ``name`` into an inner
    loop bound before assigning it (the value Triton 3.6 does not carry)."""
    funcs = jit_functions(sources)
    bounds = bound_params(funcs)
    resolve = _resolver(funcs)
    out = []
    for (origin, name), fn in funcs.items():
        callee_bounds = _callee_bounds(funcs, bounds, resolve, origin)
        for loop in ast.walk(fn):
            if not isinstance(loop, (ast.For, ast.While)):
                continue
            uses = _bound_uses(loop.body, callee_bounds)
            firsts: Dict[str, Tuple[int, int]] = {}
            for stmt in loop.body:
                for line, col, var in _assignments(stmt):
                    firsts[var] = min(firsts.get(var, (line, col)), (line, col))
            for var, at in sorted(uses.items()):
                if var in firsts and at <= firsts[var]:
                    out.append((origin, name, at[0], var))
    return sorted(set(out))


def package_sources(root: Path) -> List[Tuple[str, str]]:
    """``(path, text)`` of the Python files under ``root`` that hold a jit function."""
    out = []
    for p in sorted(Path(root).rglob("*.py")):
        text = p.read_text()
        if ".jit" in text:
            out.append((str(p), text))
    return out
