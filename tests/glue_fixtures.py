"""Set-up shared by the glue's unit tests (tests/test_glue_*.py) and the FP8 config tests: a clean glue state with
none of the user's switches set, a toy model of attention layers, and a fake SGLang install whose patch manifest
points at a checkout. Imported by the test files (tests/ is on sys.path); nothing here is a test."""

from __future__ import annotations

import json

import torch

# the switches a user may have set that change what the glue decides; every glue unit test starts without them
GLUE_SWITCHES = ("DSV4_SM120_TEST_SELFCHECK_FAULT", "DSV4_SM120_SELFCHECK", "DSV4_SM120_ATTN_BACKEND",
                 "DSV4_SM120_ATTN_CONFIG", "DSV4_SM120_ATTN_QK")


def fresh_glue(monkeypatch, also_unset=(), moe_path="auto"):
    """Generator for a pytest fixture: the glue's switches unset (and ``also_unset``), no machine profile, the MoE
    path ``moe_path`` (None: left as it is), the self-check's and the attention glue's state reset before and
    after. Yields ``monkeypatch``. Use as ``yield from fresh_glue(monkeypatch)``."""
    from dsv4_sm120.sglang_glue import attention as A
    from dsv4_sm120.sglang_glue import selfcheck as S

    for k in GLUE_SWITCHES + tuple(also_unset):
        monkeypatch.delenv(k, raising=False)
    if moe_path is not None:
        monkeypatch.setenv("DSV4_SM120_MOE_PATH", moe_path)
    monkeypatch.setenv("DSV4_SM120_PROFILE_DIR", "")
    S.reset()
    A.reset()
    yield monkeypatch
    S.reset()
    A.reset()


class AttnLayer(torch.nn.Module):
    """An attention layer as the glue finds it in SGLang's model: its local head count and compression ratio."""

    def __init__(self, heads, ratio):
        super().__init__()
        self.n_local_heads, self.compress_ratio = heads, ratio


def toy_model(*layers, other=False):
    """A model whose ``layers`` are ``layers``; ``other``: also a module with a head count but no compression
    ratio (not an attention layer)."""
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList(layers)
    if other:
        m.other = torch.nn.Linear(1, 1)
        m.other.n_local_heads = 99
    return m


def sglang_with_manifest(tmp_path):
    """A checkout ``repo`` with an empty configs/fp8/ and an SGLang ``root`` whose patch manifest names it as the
    checkout the patches came from. Returns (repo, root)."""
    repo = tmp_path / "repo"
    (repo / "configs" / "fp8").mkdir(parents=True)
    root = tmp_path / "site" / "sglang"
    (root / ".dsv4_sm120").mkdir(parents=True)
    (root / ".dsv4_sm120" / "manifest.json").write_text(json.dumps({"repo_root": str(repo)}))
    return repo, root
