"""Launch configuration of the sparse MLA decode: table lookup, validation, resolution.

``resolve(H, T, K1, K2, device, qk=..., overrides=...)`` answers, from the shapes and the device facts
only (so the call stays CUDA-graph safe), the whole launch: which split body runs with which keys, the
split plan and the combine launch. Which launch keys and QK mode a call brings (settings, a machine profile, the
call's ``launch=``) is settled in ``launch_plan``, which calls ``resolve`` per row chunk. Torch-free: the serving
preflight checks ``DSV4_SM120_ATTN_CONFIG`` with ``check_env`` before any server starts, and the tests run every
rule on a CPU with injected device facts (``Device``).

Tables (``dsv4_sm120/launch_tables/attention/``, read through ``dsv4_sm120.launch_tables``):

* shape ``H=<16|32|64>,qk=<bf16|fp8>``: the launch used when no body is asked for. ``H`` is the head count
  rounded up to 16 or 32; every count above 32 reads the ``H=64`` tables.
* a request ``impl=tiled`` / ``impl=flat`` (``DSV4_SM120_ATTN_CONFIG``) takes the ``qk=fp8`` table's launch
  with the body replaced: those tables hold the tiled / flat launches, the bodies that have an fp8 QK path,
  and with bf16 QK the same keys apply. Where this GPU's own (generated) table has the other body at that size,
  the architecture's or default table answers instead. ``impl=reg`` takes the ``impl=reg`` table (the register body's
  launch at any shape; bf16 QK only). An entry naming ``impl=wgmma`` or ``impl=wgmma_t`` gives way to that launch
  for a call with too little work for its fixed cost (``plan.few_blocks``: rows x blocks of 64 candidates, for
  wgmma_t also x 16-head groups).
* ``device_name=<GPU>`` tables (e.g. ``NVIDIA_H200``) are keyed by grid rows ``T x ceil(H/16)`` and hold
  the exact row buckets of that GPU (each bucket written as its first and last row, so the nearest-size
  lookup is exact). ``arch_sm_<major>0`` and ``default`` tables serve GPUs of any SM count: they are keyed
  by ``ceil(rows / SMs)`` (rounds of grid rows per SM), which is exact for every rule at a whole number of
  rows per SM; the rules below one row per SM (the Hopper ``waves`` / ``PREFETCH`` thresholds) are written
  ``"auto"`` and resolved here from the rows and the SM count (``_auto_waves``, ``_auto_prefetch``).
  Architecture tables are per major version (an sm_121 GPU reads ``arch_sm_120``).

``"auto"`` values resolved per launch: ``waves`` / ``PREFETCH`` (above), ``num_stages`` (2 for the tiled body
when a program owns >= 2 candidate blocks, else 1), ``maxnreg`` (128 for a one-stage tiled or flat launch,
none otherwise), ``balanced`` where a wgmma_t launch does not set it (``plan.balanced_pays``), and the combine keys
(``plan.combine_plan``), which tables never set. Keys given by the user
keep their value and the "auto" ones are resolved around them. The numbers behind the table entries were
measured on the H200: see bench/results/attention.csv.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Dict, Mapping, NamedTuple, Optional, Tuple

from .. import launch_tables as lt
from .. import settings
from . import plan as P
from .key_aliases import canonical_entry
from .keys import (BF16_ONLY_IMPLS, FIXED_LAUNCHES, GPU_ONLY_IMPLS, IMPL_ARCHS, IMPLS, KEYS, REG_TABLE_IMPLS,
                   WGMMA_IMPLS, WGMMA_T_BLOCK_H, WSPEC_SHAPES, DecodeInputError, arch_names, check_fixed_keys,
                   check_wgmma_t_keys, parse_config, runs_on)

KERNEL = "attention"
QK_MODES = ("auto", "bf16", "fp8")

# the keys each body reads (the resolved launch holds exactly these; absent flags are 0)
COMMON_KEYS = ("impl", "BLOCK_H", "BLOCK_N", "num_warps", "num_stages", "maxnreg", "waves")
COMBINE_KEYS = ("BLOCK_D", "BLOCK_S", "combine_warps", "combine_maxnreg")
BODY_KEYS = {"tiled": ("PREFETCH", "e4m3_int_decode", "PART_BF16"),
             "reg": ("e4m3_int_decode", "late_decode", "spanning_splits", "PART_BF16"), "flat": (),
             "wspec": ("spanning_splits", "PART_BF16"), "wgmma": ("spanning_splits", "PART_BF16"),
             "wgmma_t": ("spanning_splits", "PART_BF16", "balanced")}
# body keys a table entry or a launch candidate may leave out (read as 0): ``balanced`` (wgmma_t), newer than the
# sweeps behind the tables
OPTIONAL_ENTRY_KEYS = ("balanced",)
# the warp-specialized body's default register cap by architecture major (its fixed launch: keys.WSPEC_LAUNCH): on
# Hopper 128 (two CTAs of 8 warps per SM in its 228 KB of shared memory; the producer warps then give registers to
# the consumers), elsewhere none (sm_120's 100 KB hold one CTA; a cap only spills); a user may set maxnreg
WSPEC_MAXNREG = {9: 128}

# Triton's CPU interpreter: a small tiled launch whatever the device (the interpreter's time grows with the
# block sizes; only correctness is measured there)
INTERPRETER_LAUNCH = {"impl": "tiled", "BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "maxnreg": 0,
                      "waves": 1.0}


class Device(NamedTuple):
    """What the launch depends on: ``torch.cuda.get_device_name()``, ``(major, minor)`` (None: no CUDA
    device) and the SM count."""
    name: str
    capability: Optional[Tuple[int, int]]
    num_sms: int


class Launch(NamedTuple):
    config: Dict[str, object]        # COMMON_KEYS + BODY_KEYS[impl] + COMBINE_KEYS, all resolved
    plan: Tuple[int, int, int, int]  # (s_main, chunk_main, s_extra, chunk_extra); a spanning plan is all main
    source: str                      # the table entry it came from (for logs and bench rows)


# ---- settings


def check_env(env: Mapping[str, str]) -> list:
    """Problems (one line each) with the attention settings in ``env`` (``dsv4_sm120.settings.validate`` of
    the ``DSV4_SM120_ATTN_*`` variables): an invalid DSV4_SM120_ATTN_CONFIG or DSV4_SM120_ATTN_QK, or an fp8 QK
    request combined with a bf16-only body."""
    return settings.validate({k: v for k, v in env.items() if k.startswith("DSV4_SM120_ATTN_")})


# ---- table lookup


def head_class(H: int) -> int:
    """16, 32 or 64: the ``H=`` of the table shapes (the head count rounded up; 64 for every count above 32)."""
    return 16 if H <= 16 else (32 if H <= 32 else 64)


def wgmma_t_block_h(H: int) -> int:
    """The candidates-as-M body's heads per program (its MMA N) where nobody names one: every head up to 32 in one
    program (16 up to 16 heads, else 32)."""
    return 16 if H <= 16 else 32


def table_entry(H: int, T: int, qk: str, device: Device, impl: Optional[str] = None,
                root=None) -> Tuple[Dict[str, object], str]:
    """The table entry for this shape and device (before overrides and "auto" resolution) and where it came
    from. ``impl``: a body asked for by name (see the module docstring)."""
    if impl in REG_TABLE_IMPLS:
        shape = "impl=reg"
    else:
        shape = f"H={head_class(H)},qk={'fp8' if impl in ('tiled', 'flat') else qk}"
    rows = T * P.cdiv(H, 16)
    cap = None if device.capability is None else (int(device.capability[0]), 0)
    found = lt.lookup(KERNEL, shape, rows, device.name or lt.DEFAULT_DEVICE, cap, root=root)
    if found is None:
        raise DecodeInputError(f"no attention launch table for shape {shape!r} (not even device_name=default) "
                               f"under {root or lt.TABLE_DIR}")
    if impl in ("tiled", "flat") and found.level == "device" and found.config.get("impl") != impl:
        # a device table generated from a launch sweep holds the winner of each size only, which may be the other
        # body: the body asked for takes the architecture's (or default) launch for it
        found = lt.lookup(KERNEL, shape, rows, lt.DEFAULT_DEVICE, cap, root=root) or found
    cfg, size = found.config, found.size
    if found.level != "device":
        # architecture / default tables serve any SM count: keyed by rounds of grid rows per SM
        table = lt.read_table(found.path)
        size = lt.nearest(table, P.cdiv(rows, max(1, device.num_sms)))
        cfg = table[size]
    if impl is not None:
        cfg = dict(cfg, impl=impl)
    return canonical_entry(cfg), f"{found.path.name}[{size}]"


# ---- resolution


def _auto_waves(rows: int, num_sms: int) -> float:
    # Hopper, H <= 16, tiled body: more splits while the grid is small, fewer once it is large (4 waves up to
    # 3/4 of the SMs in grid rows, 1 from 95%)
    return 4.0 if 4 * rows <= 3 * num_sms else (1.0 if 20 * rows >= 19 * num_sms else 2.0)


def _auto_prefetch(rows: int, num_sms: int) -> int:
    # Hopper, H <= 16, tiled body: the next block's indices and tile scales read early once programs own several
    # blocks (from a third of the SMs in grid rows)
    return 2 if 3 * rows >= num_sms else 0


# body keys by the bodies that read them (the register body's flags among them)
_ANY_BODY_KEYS = frozenset(k for keys in BODY_KEYS.values() for k in keys)


def _register_body_keys(user: Mapping[str, object], named: Optional[str], entry: Mapping[str, object]) -> bool:
    """Whether launch keys given without ``impl`` are the register body's rather than those of the warp-specialized
    body a table entry names (``named``; sm_120's tables above 16 heads): a body key it does not read (e.g.
    ``late_decode=0``), or a key its fixed launch sets (heads per program, block shape, warps, stages, spanning
    splits, register cap; e.g. ``BLOCK_N=16``, ``spanning_splits=0``, ``maxnreg=0``), to a value other than
    ``auto``. Such keys meant the register body where it was those tables' body, and still do. (The H200's
    warpgroup-MMA entries keep their own rules: a clashing key is refused there.)"""
    if named != "wspec":
        return False
    fixed = set(FIXED_LAUNCHES[named]) | {"BLOCK_H", "BLOCK_N", "num_warps", "num_stages", "maxnreg"}
    return any((k in _ANY_BODY_KEYS and k not in BODY_KEYS[named]) or (k in fixed and v != "auto")
               for k, v in user.items())


def _wspec_launch(cfg: Dict[str, object], user: Mapping[str, object], source_impl: Optional[str],
                  device: Device) -> None:
    """The warp-specialized body's launch keys in ``cfg``: its heads per program (the user's ``BLOCK_H``, else a
    table entry's that names this body, else 16), the block size and warps that go with them
    (``keys.WSPEC_SHAPES``), its register cap (at 16 heads ``WSPEC_MAXNREG`` by architecture) and, above 16 heads,
    one program slot per SM (``waves``; one CTA per SM), each unless the user set it."""
    bh = int(user.get("BLOCK_H", cfg.get("BLOCK_H", 16) if source_impl == "wspec" else 16))
    shape = WSPEC_SHAPES[bh]
    cfg.update(BLOCK_H=bh, BLOCK_N=shape["BLOCK_N"], num_warps=shape["num_warps"])
    if user.get("maxnreg", "auto") == "auto":
        cfg["maxnreg"] = shape.get("maxnreg", WSPEC_MAXNREG.get(device.capability[0] if device.capability else None, 0))
    if user.get("waves", "auto") == "auto" and (bh > 16 and source_impl != "wspec" or cfg.get("waves") == "auto"):
        cfg["waves"] = 1.0 if bh > 16 else 2.0


def resolve(H: int, T: int, K1: int, K2: int, device: Device, *, qk: str = "bf16",
            overrides: Optional[Mapping[str, object]] = None, interpret: bool = False, call_rows: Optional[int] = None,
            root=None) -> Launch:
    """The launch of ``T`` rows of ``H`` heads over ``K1`` main and ``K2`` extra candidates per row (``K2 = 0``:
    no extra cache) on ``device``: table entry (or the interpreter's launch), then ``overrides`` (parsed
    ``DSV4_SM120_ATTN_CONFIG`` keys; ``impl`` picks the table), then the "auto" values. ``call_rows``: the rows
    of the whole call when it is cut into row chunks (the table entry and the rows-per-SM rules follow the
    call, the split and combine plans the chunk); default ``T``. Cached: it depends on its arguments only."""
    ov = tuple(sorted((overrides or {}).items()))
    cap = None if device.capability is None else tuple(int(c) for c in device.capability)
    return _resolve(int(H), int(T), int(K1), int(K2), Device(str(device.name), cap, int(device.num_sms)), qk, ov,
                    bool(interpret), int(call_rows or T), None if root is None else str(root))


@lru_cache(maxsize=4096)
def _resolve(H, T, K1, K2, device, qk, overrides, interpret, call_rows, root) -> Launch:
    if qk not in ("bf16", "fp8"):
        raise DecodeInputError(f"qk must be bf16 or fp8, got {qk!r}")
    user = dict(overrides)
    bad = [k for k in user if k not in KEYS]
    if bad:
        raise DecodeInputError(f"unknown launch keys {bad}; valid keys: {', '.join(sorted(KEYS))}")
    impl = user.get("impl")
    if qk == "fp8" and impl in BF16_ONLY_IMPLS:
        raise DecodeInputError(f"impl={impl} has no fp8 QK path (use qk_mode='bf16')")
    check_wgmma_t_keys(user, "launch")
    if interpret and impl in GPU_ONLY_IMPLS:
        raise DecodeInputError(f"impl={impl} is a GPU launch (a Gluon kernel): Triton's interpreter cannot run it")
    if not interpret and device.capability and not runs_on(impl, device.capability[0]):
        raise DecodeInputError(f"impl={impl} runs on {arch_names(impl)} only "
                               f"(this device is sm_{device.capability[0]}{device.capability[1]}); use another impl")
    if interpret:
        cfg, source = dict(INTERPRETER_LAUNCH), "interpreter"
    else:
        cfg, source = table_entry(H, call_rows, qk, device, impl, root)
        named = cfg.get("impl")
        if impl is None and P.few_blocks(named, call_rows, P.cdiv(K1 + K2, 64), H):
            # too little work for a warpgroup-MMA body's fixed cost (plan.few_blocks): the register body
            cfg, source = table_entry(H, call_rows, qk, device, "reg", root)
            source += f" (few blocks for impl={named})"
        elif impl is None and _register_body_keys(user, named, cfg):
            # keys given without a body that the entry's fixed-launch body does not take: they are the register
            # body's (as they were where that body was the table's), so its launch takes them
            cfg, source = table_entry(H, call_rows, qk, device, "reg", root)
            source += f" (register-body keys over impl={named})"
    source_impl = None if impl is not None else cfg.get("impl")   # the body the table entry itself names
    entry_balanced = "balanced" in cfg and source_impl == "wgmma_t"   # a table entry of that body that sets it
    cfg.update(user)
    impl = cfg["impl"]
    if impl not in IMPLS:
        raise DecodeInputError(f"{source}: impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl in FIXED_LAUNCHES:
        # (wspec's fixed keys follow its heads per program: the user's, else those of an entry naming it)
        entry_bh = {"BLOCK_H": cfg["BLOCK_H"]} if impl == "wspec" and source_impl == "wspec" else {}
        check_fixed_keys(dict(entry_bh, **dict(user, impl=impl)), "launch")
        cfg.update(FIXED_LAUNCHES[impl])
    if impl == "wspec":
        _wspec_launch(cfg, user, source_impl, device)
    if impl == "wgmma_t" and "BLOCK_H" not in user and (source_impl != "wgmma_t"
                                                          or cfg.get("BLOCK_H") not in WGMMA_T_BLOCK_H):
        # the heads are the MMA's N: all of them up to 32 in one program, unless the user or an entry naming this
        # body says 16
        cfg["BLOCK_H"] = wgmma_t_block_h(H)
    if impl == "wgmma_t" and int(user.get("balanced", 0)):
        cfg["BLOCK_H"] = 16   # the balanced launch's heads per program (keys.check_wgmma_t_keys)
    if impl in WGMMA_IMPLS and "waves" not in user:
        cfg["waves"] = 1.0   # one CTA per SM
    rows, nsm = call_rows * P.cdiv(H, 16), max(1, device.num_sms)
    if cfg.get("waves") == "auto":
        cfg["waves"] = _auto_waves(rows, nsm)
    if cfg.get("PREFETCH") == "auto":
        cfg["PREFETCH"] = _auto_prefetch(rows, nsm)
    HG = P.cdiv(H, int(cfg["BLOCK_H"]))
    span = impl in REG_TABLE_IMPLS and bool(int(cfg.get("spanning_splits", 0)))
    wg = impl in WGMMA_IMPLS
    overhead = P.WGMMA_PROGRAM_OVERHEAD_BLOCKS if wg else P.PROGRAM_OVERHEAD_BLOCKS
    combine = P.WGMMA_COMBINE_BLOCKS * H / 64 if wg else 0.0
    plan = P.split_plan(span, T, HG, K1, K2, int(cfg["BLOCK_N"]), nsm, float(cfg["waves"]), overhead, combine)
    if impl == "wgmma_t":
        if "balanced" not in user and not entry_balanced:
            # set by neither the user nor the table: where the makespan model says the balanced plan is faster than
            # the classic one (plan.balanced_pays: the classic plan leaves SMs idle)
            cfg["balanced"] = int(P.balanced_pays(T, HG, K1 + K2, nsm, int(cfg["BLOCK_H"]), plan[0] + plan[2],
                                                  P.cdiv(plan[1], 64), combine))
        if int(cfg.get("balanced", 0)) and not P.balanced_fits(T, HG, K1 + K2, nsm):
            cfg["balanced"] = 0   # a call too large for the kernels' 32-bit run arithmetic: the classic plan
        if int(cfg.get("balanced", 0)):
            # one program per SM walking an equal run of the call's blocks (plan.plan_balanced): S = the most
            # pieces a row is cut into, the plan's chunk the whole row
            _, NB, S = P.plan_balanced(T, HG, K1 + K2, nsm)
            plan = (S, NB * 64, 0, 64)
    s1, c1, s2, c2 = plan
    if cfg.get("num_stages", "auto") == "auto":
        bn = int(cfg["BLOCK_N"])
        blocks = max(c1 // bn, (c2 // bn) if s2 else 0)
        cfg["num_stages"] = 2 if impl == "tiled" and blocks >= 2 else 1
    if cfg.get("maxnreg", "auto") == "auto":
        cfg["maxnreg"] = 0 if int(cfg["num_stages"]) >= 2 or impl in REG_TABLE_IMPLS else 128
    fixed = {k: (None if cfg.get(k, "auto") == "auto" else int(cfg[k])) for k in COMBINE_KEYS}
    bd, bs, w, mr = P.combine_plan(T, H, s1 + s2, nsm, fixed["BLOCK_D"], fixed["combine_warps"], fixed["BLOCK_S"],
                                   fixed["combine_maxnreg"])
    out = {k: cfg.get(k, 0) for k in COMMON_KEYS + BODY_KEYS[impl]}
    for k in out:
        if k not in ("impl", "waves"):
            out[k] = int(out[k])
    out["waves"] = float(out["waves"])
    out.update(BLOCK_D=bd, BLOCK_S=bs, combine_warps=w, combine_maxnreg=mr)
    return Launch(out, plan, source)
