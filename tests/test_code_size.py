"""Long code: no overlay file over 700 lines and no function over 100 lines (Triton kernels, functions decorated
``@triton.jit``, are excepted: a kernel body is one compiled unit); no test file defines a test twice."""

from __future__ import annotations

import ast

from conftest import OVERLAY

MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 100


def _is_kernel(fn: ast.AST) -> bool:
    return any("jit" in ast.unparse(d) for d in getattr(fn, "decorator_list", ()))


def test_no_long_file_or_function():
    long = []
    for p in sorted((OVERLAY / "dsv4_sm120").rglob("*.py")):
        text = p.read_text()
        rel = p.relative_to(OVERLAY)
        if text.count("\n") > MAX_FILE_LINES:
            long.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_kernel(node):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    assert not long, "over the limits (file 700, function 100 lines): " + "; ".join(long)


def test_no_test_is_shadowed_by_another_of_its_name():
    """Two module-level ``test_*`` functions of one name in a file: pytest collects the last only, and the first
    (its asserts, its coverage) silently never runs."""
    tests_dir = OVERLAY.parent / "tests"
    twice = []
    for p in sorted(tests_dir.rglob("test_*.py")):
        seen = set()
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name.startswith(
                    ("test_", "Test")):
                if node.name in seen:
                    twice.append(f"{p.relative_to(tests_dir.parent)}:{node.lineno} {node.name}")
                seen.add(node.name)
    assert not twice, "defined again (the first never runs): " + "; ".join(twice)
