"""The kernels' source check for Triton 3.6's dropped loop carries (dsv4_sm120.dev.jit_lint): the product's
and the benchmarks' kernels are clean, and the check flags the reduced kernels that Triton 3.6 compiles wrongly
(read off their sm_90 TTGIR: the outer ``scf.for`` has no carry for ``nb``) and passes the ones it compiles right."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from dsv4_sm120.dev.jit_lint import bound_params, carry_hazards, jit_functions, package_sources

ROOT = Path(__file__).resolve().parents[1]

HEAD = """
import triton
import triton.language as tl

@triton.jit
def _inner(acc, nb):
    for _ in range(nb):
        acc += 1
    return acc

@triton.jit
def _via(acc, lo, n):
    return _inner(acc, n - lo)

@triton.jit
def _arith(acc, nb):
    return acc + nb
"""

# body of the outer loop of a kernel ``k(lens, out, n)`` with ``nb = tl.load(lens)`` and ``acc = 0`` before it;
# True: under Triton 3.6 the body reads nb's value from before the loop (its sm_90 TTGIR: the outer scf.for carries
# no nb), False: it compiles right (nb carried, or, assigned_first, never read from the previous iteration). Triton
# 3.8 carries nb in all of them.
BODIES = {
    "inner_bound": ("for _ in range(nb):\n    acc += 1\nnb = tl.load(lens + r + 1)", True),
    "through_alias": ("m = nb\nfor _ in range(m):\n    acc += 1\nnb = tl.load(lens + r + 1)", True),
    "through_arith": ("m = nb + 1\nfor _ in range(0, tl.minimum(m, 8)):\n    acc += 1\nnb = tl.load(lens + r + 1)",
                      True),
    "callee_bound": ("acc = _inner(acc, nb)\nnb = tl.load(lens + r + 1)", True),
    "callee_of_callee": ("acc = _via(acc, 0, nb)\nnb = tl.load(lens + r + 1)", True),
    "read_ahead_keyword": ("nb2 = tl.load(lens + r + 1)\nacc = _inner(acc=acc, nb=nb)\nnb = nb2", True),
    "assigned_first": ("nb = tl.load(lens + r)\nfor _ in range(nb):\n    acc += 1", False),
    "arith_only": ("acc = _arith(acc, nb)\nacc += nb\nnb = tl.load(lens + r + 1)", False),
    "while_bound": ("j = 0\nwhile j < nb:\n    acc += 1\n    j += 1\nnb = tl.load(lens + r + 1)", False),
    "inner_const": ("for _ in range(0, 4):\n    acc += nb\nnb = tl.load(lens + r + 1)", False),
    "builtin_call": ("acc = tl.maximum(acc, nb)\nnb = tl.load(lens + r + 1)", False),
}


def kernel(body: str) -> str:
    return HEAD + "\n@triton.jit\ndef k(lens, out, n):\n    nb = tl.load(lens)\n    acc = 0\n" \
        "    for r in range(0, n):\n" + textwrap.indent(body, " " * 8) + "\n    tl.store(out, acc)\n"


@pytest.mark.parametrize("name", sorted(BODIES))
def test_flags_exactly_the_dropped_carries(name):
    body, dropped = BODIES[name]
    hazards = carry_hazards([(name, kernel(body))])
    assert [(f, v) for _, f, _, v in hazards] == ([("k", "nb")] if dropped else []), hazards


def test_bound_parameters_reach_through_callees():
    funcs = jit_functions([("m", kernel("pass"))])
    bounds = bound_params(funcs)
    assert bounds[("m", "_inner")] == {1} and bounds[("m", "_via")] == {1, 2} and bounds[("m", "_arith")] == set()


def test_callees_resolve_in_the_callers_file_first_then_by_a_unique_name():
    caller = kernel("acc = _inner(acc, nb)\nnb = tl.load(lens + r + 1)").replace(HEAD, "import triton\n"
                                                                             "import triton.language as tl\n")
    loops = HEAD                                              # _inner loops to its nb
    counts = HEAD.replace("for _ in range(nb):", "for _ in range(3):")   # _inner does not
    # the one _inner of another file decides
    assert [(o, v) for o, _, _, v in carry_hazards([("a", caller), ("b", loops)])] == [("a", "nb")]
    assert carry_hazards([("a", caller), ("c", counts)]) == []
    # two files define it: neither decides; the caller's own file does
    assert carry_hazards([("a", caller), ("b", loops), ("c", counts)]) == []
    assert carry_hazards([("a", caller + counts.split("import triton.language as tl", 1)[1]), ("b", loops)]) == []


def test_the_product_and_benchmark_kernels_keep_their_carries():
    sources = package_sources(ROOT / "overlay" / "dsv4_sm120") + package_sources(ROOT / "bench")
    assert len(jit_functions(sources)) > 50, "the check found too few kernels to mean anything"
    assert carry_hazards(sources) == []
