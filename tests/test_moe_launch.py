"""Launch configurations of the NVFP4 fused MoE come from the JSON launch tables (dsv4_sm120.moe.config).

The shipped hand-written tables (``default``, and so every GPU without a table of its own) must reproduce, at every
token count, the tile rule the launcher computed in code before the tables existed; ``_rule_before_tables`` below
is a frozen copy of that rule (tiles by pairs per expert, grouping by pairs), the independent expectation. The
H200's own table is generated from its launch sweep (tests/test_launch_sweep.py checks it against the results
file). Pure Python: no torch, no Triton.
"""

from __future__ import annotations

import json
import random

import pytest

from dsv4_sm120 import launch_tables as LT
from dsv4_sm120.moe import config as C

H200 = "NVIDIA H200"
H100 = ("NVIDIA H100 80GB HBM3", (9, 0))  # a Hopper GPU without a table of its own
SM120 = ("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0))


def _pick_bk(K, want):
    bk = want
    while bk > 32 and K % bk:
        bk //= 2
    return bk


def _rule_before_tables(M, topk, E, H, I):
    """(BM, BN1, BK1, BN2, BK2, warps1, warps2, stages, align) as the launcher chose them in code."""
    P = M * topk
    per_expert = P / max(1, min(E, P))
    if per_expert <= 16 and P < 256:
        BM, BN1, BN2, w1, w2, bk = 16, (64 if P >= 64 else 32), 64, 4, 4, 256
    elif per_expert <= 16:
        BM, BN1, BN2, w1, w2, bk = 16, 64, 128, 4, 4, 128
    elif per_expert <= 48:
        BM, BN1, BN2, w1, w2, bk = 32, 64, 64, 4, 4, 128
    else:
        BM, BN1, BN2, w1, w2, bk = 64, 64, 128, 8, 8, 128
    align = "inkernel" if P <= 32 else ("triton" if P <= 2048 else "torch")
    return (BM, BN1, _pick_bk(H, bk), BN2, _pick_bk(I, bk), w1, w2, 3, align)


def _as_tuple(cfg):
    return (cfg.BM, cfg.BN1, cfg.BK1, cfg.BN2, cfg.BK2, cfg.warps1, cfg.warps2, cfg.stages, cfg.align)


MS = sorted(set(list(range(1, 300)) + [341, 342, 343, 682, 683, 684, 1000, 2047, 2048, 2049, 4096, 8192, 20000,
                                       65536, 200000] + random.sample(range(300, 50000), 40)))


@pytest.mark.parametrize("E", [8, 16, 32, 64, 128, 256])
@pytest.mark.parametrize("topk", [6, 8])
@pytest.mark.parametrize("path", ["fp4", "bf16"])
def test_tables_reproduce_the_rule_they_replace(E, topk, path):
    HI = [(4096, 512), (4096, 256), (4096, 2048), (7168, 384), (64, 32), (96, 160)]
    for device, cap in (("default", None), H100, SM120):
        for M in MS:
            H, I = random.choice(HI)
            cfg = C.choose_config(M, topk, E, H, I, path, device_name=device, capability=cap)
            assert _as_tuple(cfg) == _rule_before_tables(M, topk, E, H, I), (M, topk, E, H, I, path, device)
            assert cfg.deq == 3
            assert H % cfg.BK1 == 0 and I % cfg.BK2 == 0


def test_h200_has_its_own_table_and_sm120_falls_back_to_default():
    _, hit = C.lookup_table(1, 6, 256, "bf16", H200, (9, 0))
    assert hit.level == "device" and hit.path.name == "E=256,topk=6,path=bf16,device_name=NVIDIA_H200.json"
    _, hit = C.lookup_table(1, 6, 256, "fp4", *SM120)
    assert hit.level in ("arch", "default")


def test_interpreter_and_portable_decode():
    cfg = C.choose_config(1, 6, 256, 64, 32, "fp4", interpreting=True)
    assert (cfg.BM, cfg.BN1, cfg.BK1, cfg.BN2, cfg.BK2, cfg.stages, cfg.deq) == (16, 16, 32, 16, 32, 1, 0)
    assert [C.choose_config(M, 6, 8, 64, 32, "bf16", interpreting=True).align for M in (5, 6, 341, 342)] == \
        ["inkernel", "triton", "triton", "torch"]
    assert C.choose_config(64, 6, 256, 4096, 512, "bf16", portable_decode=True).deq == 0


def _write(root, shape, device, table):
    p = LT.table_path("moe", shape, device, root)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(table))


def _entry(**kw):
    e = dict(BM=16, BN1=32, BK1=256, BN2=64, BK2=256, warps1=4, warps2=4, stages=3, align="triton")
    e.update(kw)
    return e


def test_a_shape_without_a_table_takes_the_nearest_shipped_one(tmp_path):
    for E, bn in ((8, 16), (64, 32), (256, 64)):
        _write(tmp_path, C.shape_key(E, 6, "fp4"), "default", {"1": _entry(BN1=bn)})
    _write(tmp_path, C.shape_key(48, 8, "fp4"), "default", {"1": _entry(BN1=128)})
    _write(tmp_path, C.shape_key(48, 6, "bf16"), "default", {"1": _entry(BN1=256)})
    near = {E: C.choose_config(3, 6, E, 4096, 512, "fp4", root=tmp_path).BN1 for E in (5, 12, 40, 100, 180, 512)}
    assert near == {5: 16, 12: 16, 40: 32, 100: 32, 180: 64, 512: 64}
    assert C.choose_config(3, 8, 256, 4096, 512, "fp4", root=tmp_path).BN1 == 128  # same topk first
    # a device table of this exact shape wins over a default of another shape
    _write(tmp_path, C.shape_key(100, 6, "fp4"), "NVIDIA_X", {"1": _entry(BN1=512)})
    assert C.choose_config(3, 6, 100, 4096, 512, "fp4", device_name="NVIDIA X", root=tmp_path).BN1 == 512
    with pytest.raises(LT.TableError, match="no MoE launch table for path fp4"):
        C.choose_config(3, 6, 8, 4096, 512, "fp4", root=tmp_path / "empty")


@pytest.mark.parametrize("bad,needle", [(dict(align="sort"), "align 'sort'"), (dict(BM=0), "BM must be"),
                                        (dict(BN2="64"), "BN2 must be"), (dict(stages=None), "stages must be")])
def test_bad_entries_are_refused_with_the_file(tmp_path, bad, needle):
    _write(tmp_path, C.shape_key(8, 6, "fp4"), "default", {"1": _entry(**bad)})
    with pytest.raises(LT.TableError, match=f"E=8,topk=6,path=fp4,device_name=default.json.*{needle}"):
        C.choose_config(1, 6, 8, 4096, 512, "fp4", root=tmp_path)
    entry = _entry()
    del entry["warps2"]
    _write(tmp_path, C.shape_key(16, 6, "fp4"), "default", {"1": entry})
    with pytest.raises(LT.TableError, match="lacks warps2"):
        C.choose_config(1, 6, 16, 4096, 512, "fp4", root=tmp_path)


def test_every_shipped_table_is_complete():
    files = sorted((LT.TABLE_DIR / "moe").glob("*.json"))
    assert len(files) >= 2
    for f in files:
        shape, dev = f.stem.rsplit(",device_name=", 1)
        for size, entry in LT.read_table(f).items():
            C.parse_entry(",".join(f"{k}={v}" for k, v in entry.items()), f"{f.name}[{size}]")
        assert LT.lookup("moe", shape, 1, dev.replace("_", " ")) is not None
