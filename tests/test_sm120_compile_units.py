"""dsv4_sm120.devtools.sm120_compile's own steps in this process, against written-out expectations: what it reads
of a compile (a stand-in compiler answers a known kernel, SASS and resource line), where the toolchain and cache
live, the family run's bookkeeping (launches met twice, the cache file's layout, a read-only cache, the clock),
each problem line word for word, and the command's help. The compiles themselves: tests/test_sm120_compile.py."""

from __future__ import annotations

import json
import types

import pytest

from dsv4_sm120.devtools import sass
from dsv4_sm120.devtools import sm120_compile as SC
from dsv4_sm120.devtools import sm120_launches as SL

SASS = """
        /*0010*/  LDL.64 R2, [R1+0x8] ;
        /*0020*/  STL [R1], R4 ;
        /*0030*/  LDL R5, [R1+0x4] ;
        /*0040*/  LDLX R6 ;
        /*0050*/  OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X R8, R12, R16, R8 ;
        /*0060*/  HMMA.16816.F32.BF16 R20, R24, R28, R20 ;
        /*0070*/  OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X R8, R12, R16, R8 ;
"""
PTX = ("setmaxnreg.dec.sync.aligned.u32 24;\n setmaxnreg.inc.sync.aligned.u32   240;\n"
       "setmaxnreg.dec.sync.aligned.u32 24;\n")


def _launch(origins=("attention/t.json[4]",), **need):
    return SL.Launch("attention", "attention.split_kernel_reg", {"BLOCK_N": 32}, {"num_warps": 4, "num_stages": 1},
                     {}, dict(need), list(origins))


def test_what_is_read_of_a_compile(monkeypatch):
    seen = []

    def fake(src, cap, options):
        seen.append((src, cap, options))
        k = types.SimpleNamespace(metadata=types.SimpleNamespace(shared="4096"), asm={"ptx": PTX})
        return k, SASS, {"regs": 96, "stack": 16, "static_shared": 1024, "local": 8}

    monkeypatch.setattr(sass, "compile_inspect", fake)
    la = _launch()
    r = SC.inspect(la, "SRC")
    assert seen == [("SRC", 120, {"num_warps": 4, "num_stages": 1})] and seen[0][2] is not la.options
    assert r == {"shared": 4096, "static_shared": 1024, "regs": 96, "stack": 16, "local": 8, "local_ops": 3,
                 "sass_lines": 8, "mma": ["HMMA.16816.F32.BF16", "OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X"],
                 "setmaxnreg": [24, 240]}
    # a compile that reports no resources: registers unknown, no stack or local memory; no PTX: no setmaxnreg
    monkeypatch.setattr(sass, "compile_inspect", lambda src, cap, options: (
        types.SimpleNamespace(metadata=types.SimpleNamespace(shared=0), asm={}), "", {}))
    assert SC.inspect(la, "SRC") == {"shared": 0, "static_shared": 0, "regs": None, "stack": 0, "local": 0,
                                     "local_ops": 0, "sass_lines": 0, "mma": [], "setmaxnreg": []}

    def broken(src, cap, options):
        raise RuntimeError("ptxas error:\n   too   many\tresources " + "y" * 500)

    monkeypatch.setattr(sass, "compile_inspect", broken)
    err = SC.inspect(la, "SRC")["error"]
    want = "ptxas error: too many resources " + "y" * 500
    assert err == "RuntimeError: " + want[:400]


def test_the_toolchain_and_the_cache_file(monkeypatch, tmp_path):
    import triton

    assert SC.toolchain_problem() == ""                   # the test environment's Triton has its ptxas
    monkeypatch.setattr(triton, "__file__", str(tmp_path / "triton" / "__init__.py"))
    ptxas = tmp_path / "triton" / "backends" / "nvidia" / "bin" / "ptxas"
    assert SC.toolchain_problem() == f"no ptxas in the Triton wheel ({ptxas})"
    ptxas.parent.mkdir(parents=True)
    ptxas.write_text("")
    assert SC.toolchain_problem() == ""
    monkeypatch.setattr(SC, "cache_dir", lambda: tmp_path / "c")
    assert SC.cache_file("moe_fp4") == tmp_path / "c" / "sm120-compile" / "moe_fp4.json"


def _family(monkeypatch, tmp_path, launches, results):
    monkeypatch.setattr(SC, "cache_file", lambda family: tmp_path / f"{family}.json")
    monkeypatch.setattr(SL, "enumerate_launches", lambda fams: {fams[0]: launches})
    monkeypatch.setattr(SC, "source", lambda la: f"src:{la.origins[0]}")
    monkeypatch.setattr(SC, "compile_key", lambda la, src: "key:" + la.kernel)
    got = []

    def inspect(la, src):
        got.append(src)
        return results[len(got) - 1]

    monkeypatch.setattr(SC, "inspect", inspect)
    return got


def test_a_family_run_compiles_a_launch_met_twice_once(monkeypatch, tmp_path):
    r = {"shared": 1000, "static_shared": 0, "regs": None, "stack": 0, "local": 0, "local_ops": 0, "mma": []}
    got = _family(monkeypatch, tmp_path, [_launch(["a"]), _launch(["b"])], [r])
    clock = iter([10.0, 12.36])
    monkeypatch.setattr(SC.time, "monotonic", lambda: next(clock))
    s = SC.check_family("attention")
    assert got == ["src:a"] and s["compiled"] == 1 and s["launches"] == 2 and s["seconds"] == 2.4
    assert s["max_regs"] == 0 and s["max_shared"] == 1000 and s["problems"] == []
    text = (tmp_path / "attention.json").read_text()     # one key per line, sorted: diffs of the cache stay small
    assert text.rstrip("\n") == json.dumps({"key:attention.split_kernel_reg": r}, indent=0, sort_keys=True)
    assert text.splitlines()[:3] == ["{", '"key:attention.split_kernel_reg": {', '"local": 0,']


def test_a_read_only_cache_still_checks_and_says_so(monkeypatch, tmp_path, capsys):
    from dsv4_sm120 import fileio

    r = {"shared": 10, "static_shared": 0, "regs": 40, "stack": 0, "local": 0, "local_ops": 0, "mma": []}
    _family(monkeypatch, tmp_path, [_launch(["a"])], [r])

    def ro(path, data, **kw):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(fileio, "atomic_write_json", ro)
    s = SC.check_family("attention")
    assert s["compiled"] == 1 and s["max_regs"] == 40
    io = capsys.readouterr()
    assert io.err == f"sm120_compile: cannot write {tmp_path / 'attention.json'}: Permission denied\n" and io.out == ""


GOOD = {"shared": 50176, "static_shared": 1024, "regs": 128, "stack": 0, "local": 0, "local_ops": 0, "mma": []}
HEAD = "attention/t.json[4]: attention.split_kernel_reg [num_stages=1, num_warps=4]"


def test_each_problem_line_word_for_word():
    assert SC.problems(_launch(["x", "y", "z"]), dict(GOOD, shared=99 * 1024 + 1))[0].startswith(
        "x (and 2 more): attention.split_kernel_reg [")
    assert SC.problems(_launch(["x", "y"]), dict(GOOD, shared=99 * 1024 + 1))[0].startswith("x (and 1 more): ")
    assert SC.problems(_launch(), dict(GOOD, shared=99 * 1024 + 1))[0] == (
        f"{HEAD} asks for 101377 B of shared memory per block; sm_120 allows 101376")
    assert SC.problems(_launch(max_shared=50000), GOOD) == [
        f"{HEAD} asks for 50176 B of shared memory per block, over the 50000 B it is pinned to "
        "(sm120_launches.RESOURCE_BOUNDS)"]
    assert SC.problems(_launch(max_regs=120), GOOD) == [
        f"{HEAD} takes 128 registers per thread, over the 120 it is pinned to (sm120_launches.RESOURCE_BOUNDS)"]
    assert SC.problems(_launch(max_regs=0), dict(GOOD, regs=None)) == []        # registers unknown: no claim
    assert SC.problems(_launch(partition_regs=[24, 240]), GOOD) == [           # no setmaxnreg recorded at all
        f"{HEAD} gives its warp-specialized partitions None registers (setmaxnreg), not the [24, 240] it is pinned "
        "to (sm120_launches.RESOURCE_BOUNDS)"]
    assert SC.problems(_launch(partition_regs=[24, 240]), dict(GOOD, setmaxnreg=[24, 232])) == [
        f"{HEAD} gives its warp-specialized partitions [24, 232] registers (setmaxnreg), not the [24, 240] it is "
        "pinned to (sm120_launches.RESOURCE_BOUNDS)"]
    assert SC.problems(_launch(mma="fp8"), dict(GOOD, mma=["HMMA.16816.F32.BF16", "IMMA.8816.S32"])) == [
        f"{HEAD} has no the native block-scaled FP8 MMA (QMMA.SF ... E4M3) in its SASS (MMA opcodes: "
        "HMMA.16816.F32.BF16, IMMA.8816.S32)"]


def test_the_command_help(capsys):
    with pytest.raises(SystemExit) as e:
        SC.main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: python -m dsv4_sm120.devtools.sm120_compile [-h] [--json] [families ...]")
    assert " ".join(SC.__doc__.split("\n")[0].split()) in out        # the module doc's first line
    assert "default: all (attention, combine, moe_fp4, moe_bf16)" in out
    assert "--json print the summary as RESULT<json>" in out


def test_the_cache_key_ignores_the_order_options_were_written_in():
    src = types.SimpleNamespace(hash=lambda: "h1")
    a = SL.Launch("attention", "attention.split_kernel_reg", {}, {"num_warps": 4, "num_stages": 1}, {}, {}, ["a"])
    b = SL.Launch("attention", "attention.split_kernel_reg", {}, {"num_stages": 1, "num_warps": 4}, {}, {}, ["b"])
    c = SL.Launch("attention", "attention.split_kernel_reg", {}, {"num_stages": 2, "num_warps": 4}, {}, {}, ["c"])
    assert SC.compile_key(a, src) == SC.compile_key(b, src) != SC.compile_key(c, src)
    assert SC.compile_key(a, types.SimpleNamespace(hash=lambda: "h2")) != SC.compile_key(a, src)
    assert len(SC.compile_key(a, src)) == 64
