"""Launch-configuration text (``DSV4_SM120_ATTN_CONFIG``, bench ``--variants``) -> validated overrides.

Torch-free, so the serving preflight can check the variable before any server starts; the kernel
(``kernel.parse_config``) uses the same rules and raises its ``DecodeInputError``.
"""

from __future__ import annotations

from typing import Dict, Type

IMPLS = ("tiled", "flat", "reg")
QK_MODES = ("auto", "bf16", "fp8")
# launch keys a user may set and how each value is read
KEYS = {
    "impl": "impl", "waves": "float", "combine_waves": "float",
    **{k: "int" for k in ("BLOCK_H", "BLOCK_N", "num_warps", "num_stages", "min_blocks", "PREFETCH",
                          "KCVT", "QPRE", "Q_RES", "DEC_LATE", "SPAN", "PART_BF16", "QK_SWAP",
                          "Q_RELOAD", "DEQ_BF16")},
    **{k: "int_or_auto" for k in ("maxnreg", "BLOCK_D", "BLOCK_S", "BLOCK_HC", "combine_warps",
                              "combine_maxnreg")},
}
POW2_KEYS = ("BLOCK_H", "BLOCK_N", "num_warps", "BLOCK_D", "BLOCK_HC")
BF16_ONLY_IMPLS = ("reg",)
# flags: 0/1; PREFETCH 2 = the next block's tile scales too (tiled body)
MAX_VALUE = {"PREFETCH": 2, "KCVT": 1, "QPRE": 1, "Q_RES": 1, "DEC_LATE": 1, "SPAN": 1, "PART_BF16": 1, "QK_SWAP": 1,
             "Q_RELOAD": 1, "DEQ_BF16": 1}


def parse_config(text: str, source: str = "config", error: Type[Exception] = ValueError) -> Dict[str, object]:
    """``"KCVT=1,maxnreg=0,impl=reg"`` -> ``{"KCVT": 1, "maxnreg": 0, "impl": "reg"}``, validated: unknown keys,
    malformed items and out-of-range values raise ``error`` naming ``source`` and the valid keys (a typo must
    not silently leave the default in place)."""
    out: Dict[str, object] = {}
    for item in (x.strip() for x in str(text).split(",")):
        if not item:
            continue
        key, sep, val = (x.strip() for x in item.partition("="))
        if not sep or not key or not val:
            raise error(f"{source}: expected key=value items separated by commas, got {item!r}")
        kind = KEYS.get(key)
        if kind is None:
            raise error(f"{source}: unknown key {key!r}; valid keys: {', '.join(sorted(KEYS))}")
        if kind == "impl":
            if val not in IMPLS:
                raise error(f"{source}: impl must be one of {', '.join(IMPLS)}, got {val!r}")
            out[key] = val
            continue
        if kind == "int_or_auto" and val == "auto":
            out[key] = val
            continue
        try:
            num = float(val) if kind == "float" else int(val)
        except ValueError:
            raise error(f"{source}: {key} needs {'a number' if kind == 'float' else 'an integer'}, "
                        f"got {val!r}") from None
        if key in MAX_VALUE and num > MAX_VALUE[key]:
            raise error(f"{source}: {key}={val} is out of range (0..{MAX_VALUE[key]})")
        if num < 0 or (kind == "float" and not num > 0) or (key in POW2_KEYS and (num < 1 or num & (num - 1))):
            raise error(f"{source}: {key}={val} is out of range" + (" (a power of two)" if key in POW2_KEYS else ""))
        out[key] = num
    return out


def check_env(env: Dict[str, str]) -> list:
    """Problems (one line each) with the attention variables in ``env``: an invalid DSV4_SM120_ATTN_CONFIG or
    DSV4_SM120_ATTN_QK, or an fp8 QK request combined with a bf16-only body."""
    problems = []
    qk = env.get("DSV4_SM120_ATTN_QK", "auto") or "auto"
    if qk not in QK_MODES:
        problems.append(f"DSV4_SM120_ATTN_QK must be one of {', '.join(QK_MODES)}, got {qk!r}")
    try:
        cfg = parse_config(env.get("DSV4_SM120_ATTN_CONFIG", ""), "DSV4_SM120_ATTN_CONFIG")
    except ValueError as exc:
        problems.append(str(exc))
    else:
        if qk == "fp8" and cfg.get("impl") in BF16_ONLY_IMPLS:
            problems.append(f"DSV4_SM120_ATTN_CONFIG impl={cfg['impl']} has no fp8 QK path but DSV4_SM120_ATTN_QK=fp8")
    return problems
