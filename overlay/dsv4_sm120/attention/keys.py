"""The launch keys a user may set for the sparse MLA decode and the parser that validates them.

``parse_config`` reads ``DSV4_SM120_ATTN_CONFIG`` and ``bench --variants`` texts; :mod:`.config` resolves the
parsed keys into a launch and :mod:`dsv4_sm120.settings` validates the setting with it. Imports only
:mod:`.key_aliases`.
"""

from __future__ import annotations

from typing import Dict

from .key_aliases import canonical

IMPLS = ("tiled", "flat", "reg", "wspec", "wgmma", "wgmma_t")
BF16_ONLY_IMPLS = ("reg", "wspec", "wgmma", "wgmma_t")
# bodies written in Gluon: GPU launches only (Triton's CPU interpreter does not run them)
GPU_ONLY_IMPLS = ("wspec", "wgmma", "wgmma_t")
# bodies that take the impl=reg launch table and its spanning splits
REG_TABLE_IMPLS = ("reg", "wspec", "wgmma", "wgmma_t")
# the warp-specialized body's fixed launch (kernels/wspec.py: spanning splits, 4 producer warps); its BLOCK_H (heads per
# program: 16, 32 or 64) sets the rest (WSPEC_SHAPES)
WSPEC_LAUNCH = {"num_stages": 1, "spanning_splits": 1}
# per BLOCK_H: candidates per block, consumer warps (the MMA tiles' rows over BLOCK_H / 16 of them), the register cap
# (0: none) and the producer warps' registers. 16 heads: 32-candidate blocks, 4 consumers, no cap off Hopper
# (config.WSPEC_MAXNREG) and 96 / 128 producer registers (producer_regs). 32 heads: 8 consumers with 200 registers
# (the [32, 512] fp32 accumulator is 64 of them), producers 104 (at 96 ptxas spills in the producer loop). 64
# heads: 8 consumers with 208 registers (accumulator 128), producers 88, 16-candidate blocks: Q (64 KB) and a
# two-slot ring of 16-candidate blocks (32 KB) fill sm_120's 99 KB (a ring of 32-candidate blocks does not fit,
# and one slot of them spills). 12 warps x 168 registers fill an SM's register file: one CTA per SM.
WSPEC_SHAPES = {16: {"BLOCK_N": 32, "num_warps": 4}, 32: {"BLOCK_N": 32, "num_warps": 8, "maxnreg": 168},
                64: {"BLOCK_N": 16, "num_warps": 8, "maxnreg": 168}}
WSPEC_PRODUCER_REGS = {32: 104, 64: 88}
# the Hopper warpgroup-MMA body's (kernels/wgmma.py: 64 heads, 64-candidate blocks, 8 consumer warps + 4 producer
# warps, spanning splits; 168 registers x 384 threads fill an SM's register file, one CTA per SM)
WGMMA_LAUNCH = {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "spanning_splits": 1, "maxnreg": 168}
# the candidates-as-M warpgroup-MMA body's (kernels/wgmma_t.py: 64-candidate blocks, 4 consumer warps + two
# partitions of 4 producer warps, spanning splits, one CTA of 384 threads per SM); its BLOCK_H, the MMA's N, is 16
# or 32 (WGMMA_T_BLOCK_H)
WGMMA_T_LAUNCH = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 1, "spanning_splits": 1, "maxnreg": 168}
WGMMA_T_BLOCK_H = (16, 32)
# the bodies with a fixed launch: a launch naming one of them with another value of these keys is refused
# (check_fixed_keys)
FIXED_LAUNCHES = {"wspec": WSPEC_LAUNCH, "wgmma": WGMMA_LAUNCH, "wgmma_t": WGMMA_T_LAUNCH}
# the warpgroup-MMA bodies (one CTA per SM; a row in one split writes its output itself)
WGMMA_IMPLS = ("wgmma", "wgmma_t")
# the architectures (capability major) a body runs on, where it is not all of them (runs_on)
IMPL_ARCHS = {"wgmma": (9,), "wgmma_t": (9,)}


def runs_on(impl, major: int) -> bool:
    """Whether split body ``impl`` runs on GPUs of capability major ``major`` (``IMPL_ARCHS``; any other body runs
    everywhere). A body that does not is refused by the launch with an error."""
    return major in IMPL_ARCHS.get(impl, (major,))


def arch_names(impl) -> str:
    """The architectures ``impl`` runs on, as text (``sm_90``), for messages."""
    return ", ".join(f"sm_{a}0" for a in IMPL_ARCHS[impl])


# launch keys a user may set (DSV4_SM120_ATTN_CONFIG, bench --variants) and how each value is read
# ("auto": resolved per launch as :mod:`.config`'s docstring describes, as a table entry's "auto" is; a launch
# sweep's candidates spell out every key, some of them "auto")
KEYS = {
    "impl": "impl", "waves": "float_or_auto",
    **{k: "int" for k in ("BLOCK_H", "BLOCK_N", "num_warps", "e4m3_int_decode", "late_decode", "spanning_splits",
                           "PART_BF16", "balanced")},
    **{k: "int_or_auto" for k in ("num_stages", "PREFETCH", "maxnreg", "BLOCK_D", "BLOCK_S", "combine_warps",
                                  "combine_maxnreg")},
}
POW2_KEYS = ("BLOCK_H", "BLOCK_N", "num_warps", "BLOCK_D")
# flags: 0/1; PREFETCH 1 = the next block's indices early, 2 = its tile scales too (tiled body)
MAX_VALUE = {"PREFETCH": 2, "e4m3_int_decode": 1, "late_decode": 1, "spanning_splits": 1, "PART_BF16": 1,
             "balanced": 1}


class DecodeInputError(ValueError):
    """Bad arguments to ``sparse_mla_decode`` (shape, dtype, layout) or a bad launch configuration."""


def check_fixed_keys(keys: Dict[str, object], source: str) -> None:
    """Raise ``DecodeInputError`` when ``keys`` (parsed launch keys) name a body with a fixed launch
    (``FIXED_LAUNCHES``) with a value of that launch other than its own."""
    impl = keys.get("impl")
    fixed = FIXED_LAUNCHES.get(impl)
    if not fixed:
        return
    if impl == "wspec":
        if keys.get("BLOCK_H", 16) not in WSPEC_SHAPES:
            raise DecodeInputError(f"{source}: impl=wspec runs BLOCK_H {' or '.join(map(str, WSPEC_SHAPES))} only, "
                                   f"got BLOCK_H={keys['BLOCK_H']}")
        fixed = dict(fixed, **WSPEC_SHAPES[keys.get("BLOCK_H", 16)])   # (at 16 heads the cap is free)
    clash = {k: v for k, v in keys.items() if k in fixed and v not in (fixed[k], "auto")}
    if impl == "wgmma_t" and keys.get("BLOCK_H", 16) not in WGMMA_T_BLOCK_H:
        clash["BLOCK_H"] = keys["BLOCK_H"]
        fixed = dict(fixed, BLOCK_H=" or ".join(map(str, WGMMA_T_BLOCK_H)))
    if clash:
        raise DecodeInputError(f"{source}: impl={impl} runs {fixed} only, got {clash}")


# keys only the wgmma_t body reads, and what each asks for (a launch naming another impl with one set is refused)
WGMMA_T_ONLY_KEYS = {"balanced": "the balanced plan, plan.plan_balanced"}


def check_wgmma_t_keys(keys: Dict[str, object], source: str) -> None:
    """Raise ``DecodeInputError`` when ``keys`` (parsed launch keys) set a key of the wgmma_t body only
    (``WGMMA_T_ONLY_KEYS``) with another body, or ask for the balanced plan (``balanced=1``) with other than 16
    heads per program (at 32 it spilled and ran slower on the H200). Without ``impl`` the keys apply where the
    resolved body is wgmma_t, as the other bodies' keys do."""
    impl = keys.get("impl", "wgmma_t")
    for key, what in WGMMA_T_ONLY_KEYS.items():
        if int(keys.get(key, 0)) and impl != "wgmma_t":
            raise DecodeInputError(f"{source}: {key}=1 is a launch of impl=wgmma_t only ({what}), got impl={impl}")
    if int(keys.get("balanced", 0)) and int(keys.get("BLOCK_H", 16)) != 16:
        raise DecodeInputError(f"{source}: balanced=1 runs 16 heads per program (BLOCK_H=16); "
                               f"got BLOCK_H={keys['BLOCK_H']}")


def producer_regs(impl: str, maxnreg: int, block_h: int = 16) -> int:
    """The producer warps' registers of a warp-specialized body (its ``PRODUCER_REGS``). wspec at 16 heads: 96 under a
    register cap of 128 or less (two CTAs per Hopper SM; the consumers take the rest), else 128; at 32 / 64 heads
    ``WSPEC_PRODUCER_REGS`` (the consumers take the rest of 168 x 384). wgmma: 152, the most that
    leaves its two consumer warpgroups 176 of its 168 x 384; wgmma_t: 144 for each of its two producer partitions,
    which leaves its one consumer warpgroup 216. Fewer spill: at 128 ptxas spills a just-gathered word, whose store
    then waits for the load (H200: 9% slower at H = 64, c128 at 128k, 96 rows); at 136 the 3-op e4m3 decode's
    schedule spills in wgmma's producer loop (H200, H = 64, c4, 384 rows: 128.7 us against 111.7 at 144 and 109.3
    at 152) and, under Triton 3.8, in wgmma_t's (at 144 wgmma_t is within 1% of 136 on the H200)."""
    if impl == "wspec":
        if int(block_h) in WSPEC_PRODUCER_REGS:
            return WSPEC_PRODUCER_REGS[int(block_h)]
        return 96 if 0 < int(maxnreg) <= 128 else 128
    return 152 if impl == "wgmma" else 144


def parse_config(text: str, source: str = "config") -> Dict[str, object]:
    """``"e4m3_int_decode=1,maxnreg=0,impl=reg"`` -> ``{"e4m3_int_decode": 1, "maxnreg": 0, "impl": "reg"}``,
    validated: unknown keys, malformed items and out-of-range values raise ``DecodeInputError`` naming ``source``
    and the valid keys (a typo must not silently leave the default in place). An old spelling of a key
    (:data:`.key_aliases.ALIASES`, e.g. ``KCVT``) is read as its descriptive name."""
    out: Dict[str, object] = {}
    for item in (x.strip() for x in str(text).split(",")):
        if not item:
            continue
        key, sep, val = (x.strip() for x in item.partition("="))
        if not sep or not key or not val:
            raise DecodeInputError(f"{source}: expected key=value items separated by commas, got {item!r}")
        key = canonical(key)
        kind = KEYS.get(key)
        if kind is None:
            raise DecodeInputError(f"{source}: unknown key {key!r}; valid keys: {', '.join(sorted(KEYS))}")
        if kind == "impl":
            if val not in IMPLS:
                raise DecodeInputError(f"{source}: impl must be one of {', '.join(IMPLS)}, got {val!r}")
            out[key] = val
            continue
        if kind.endswith("_or_auto") and val == "auto":
            out[key] = val
            continue
        is_float = kind.startswith("float")
        try:
            num = float(val) if is_float else int(val)
        except ValueError:
            raise DecodeInputError(f"{source}: {key} needs {'a number' if is_float else 'an integer'}"
                                   f"{' or auto' if kind.endswith('_or_auto') else ''}, got {val!r}") from None
        if key in MAX_VALUE and num > MAX_VALUE[key]:
            raise DecodeInputError(f"{source}: {key}={val} is out of range (0..{MAX_VALUE[key]})")
        if num < 0 or (is_float and not num > 0) or (key in POW2_KEYS and (num < 1 or num & (num - 1))):
            raise DecodeInputError(f"{source}: {key}={val} is out of range"
                                   + (" (a power of two)" if key in POW2_KEYS else ""))
        if key == "BLOCK_D" and num > 512:
            raise DecodeInputError(f"{source}: BLOCK_D={val} is out of range (a power of two <= 512)")
        if key == "BLOCK_S" and num < 1:
            raise DecodeInputError(f"{source}: BLOCK_S={val} is out of range (>= 1)")
        out[key] = num
    check_fixed_keys(out, source)
    check_wgmma_t_keys(out, source)
    return out
