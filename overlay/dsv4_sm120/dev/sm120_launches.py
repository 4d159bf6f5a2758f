"""Every distinct kernel launch the product can make on an sm_120 GPU, derived from the launch tables and the
launch variants ``make calibrate`` times (no hand list), each named by the table file and key it comes from.

:func:`enumerate_launches` walks:

* attention (``family="attention"``): for every head class (``H=16/32/64``) and QK mode, the table an sm_120 GPU
  reads (``attention.config.resolve`` with capability (12, 0) and no device table of its own: ``arch_sm_120``,
  else ``default``) at every key, plus the bodies asked for by name (``impl=tiled/flat/reg``) and the launch
  variants of :data:`dsv4_sm120.calibrate.attention.VARIANTS` over each entry (bf16 QK, as calibrate times
  them); at the deployment's candidate counts (SWA window alone, + the c4 pool, + the c128 pool at a long
  context) and SM counts of the sm_120 parts. The split kernel, and with fp8 QK the Q quantizer, of each.
* combine (``family="combine"``): the combine launches those same resolutions plan, over decode and verify
  row counts of every per-rank head count.
* MoE (``family="moe_fp4"``, ``"moe_bf16"``): every entry of each ``E=..,topk=..`` table an sm_120 GPU reads,
  at every token count up to past the last key (the in-kernel grouping's ``P_PAD`` follows the pairs), at the
  per-rank intermediate sizes of TP 1..8 (``legal_bk``), both GEMMs; fp4 with the native block-scaled MMA and
  the activations quantized in the GEMM or before it (``APRE`` 0 / 1, with the quantizer's launches); the align
  and reduce kernels of each.

What a launch must satisfy is carried with it (``Launch.need``): resident CTAs per SM (the spanning register
body's ``waves``: its split plan assumes ``waves`` programs per SM run at once; one elsewhere), where the
product relies on it a native block-scaled MMA in the SASS (``fp4`` for the MoE fp4 GEMMs, ``fp8`` for the
fp8 QK bodies), and the local loads / stores accepted of it (``spills``: none, but for the launches of
:data:`ACCEPTED_SPILLS`). Torch-free and Triton-free: :mod:`dsv4_sm120.dev.sm120_compile` compiles them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

FAMILIES = ("attention", "combine", "moe_fp4", "moe_bf16")
CAPABILITY = (12, 0)
SM120_SMS = (84, 170, 188)  # RTX 5080, RTX 5090, RTX PRO 6000 Blackwell: the bucket maps depend on the SM count
TP_SIZES = (1, 2, 4, 8)
LONG_CONTEXT = 1 << 20       # c128 candidates at the longest context: ceil64(2 * ceil(ctx / 256))


@dataclass
class Launch:
    """One distinct compile: ``kernel`` (module.function), its constexprs and compile options, what it needs
    (``ctas``: resident CTAs per SM; ``mma``: "fp4" / "fp8" block-scaled MMA in the SASS; ``spills``) and every
    place the product takes it from (``origins``: table file[key], variant, QK mode; the one asking most first)."""
    family: str
    kernel: str
    constexprs: Dict[str, object]
    options: Dict[str, int]
    sig: Dict[str, str] = field(default_factory=dict)   # argument types that differ from the helpers' defaults
    need: Dict[str, object] = field(default_factory=dict)
    origins: List[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        parts = [self.kernel] + [f"{k}={v}" for k, v in sorted(self.constexprs.items())]
        parts += [f"{k}={v}" for k, v in sorted(self.options.items())]
        parts += [f"{k}:{v}" for k, v in sorted(self.sig.items())]
        return ",".join(parts)


# Launches that spill on sm_120 with no table change that keeps their speed known, each with the most local loads
# and stores (LDL/STL in the SASS, Triton 3.8) accepted of it and why; a launch that spills more, or any other
# launch that spills, is a problem. Matched by kernel and the constexprs / options given.
ACCEPTED_SPILLS = (
    {"kernel": "attention.split_kernel_tiled", "match": {"BLOCK_H": 32}, "max_ldl_stl": 40,
     "why": "32-row head blocks with 8 warps need more than 255 registers per thread on sm_120 (the fp8 QK "
            "launch of the arch_sm_120 H=32/H=64 tables, and impl=tiled asked for by name); 16-row blocks do not "
            "spill but gather every candidate once per 16 heads: the choice waits for a timing on sm_120 "
            "hardware. How much ptxas spills moves with the schedule: the 3-op e4m3 decode took these launches "
            "from 48/22/21 to 40/17/12 local ops (Triton 3.8)"},
    {"kernel": "attention.split_kernel_flat", "match": {"BLOCK_H": 32}, "max_ldl_stl": 74,
     "why": "the flat body asked for by name (impl=flat) at the 32-row head blocks of the H=32/H=64 tables: as "
            "for the tiled body"},
    {"kernel": "moe._gemm1_kernel", "match": {"BM": 64, "PATH_FP4": True, "APRE": False}, "max_ldl_stl": 81,
     "why": "the in-loop activation quantizer (DSV4_SM120_MOE_APRE=0, not the default) at the 64-row prefill tile "
            "of the default MoE tables"},
    {"kernel": "moe._gemm2_kernel", "match": {"BM": 64, "BN": 128, "PATH_FP4": False}, "max_ldl_stl": 24,
     "why": "the bf16 path (DSV4_SM120_MOE_PATH=bf16, not the default on sm_120) at the 64 x 128 prefill tile of "
            "the default MoE tables"},
)


# Launches whose resources are pinned close to what they measure (Triton 3.8, sm_120), each bound with its reason: a
# build past one is a problem even where it would still fit the SM. ``max_shared`` (bytes per block), ``max_regs``
# (per thread, the launch's cap), ``partition_regs`` (the setmaxnreg values the warp-specialized partitions must get:
# consumers, producers). Matched as ACCEPTED_SPILLS.
RESOURCE_BOUNDS = (
    {"kernel": "attention.split_kernel_wspec", "match": {"BLOCK_H": 32}, "max_shared": 100388, "max_regs": 168,
     "partition_regs": (200, 104),
     "why": "32 heads per program: Q (32 KB) and two 32-candidate ring slots (64 KB) leave ~3 KB of sm_120's 99 KB "
            "for scratch and barriers; 12 warps x 168 registers fill the register file (consumers 200, producers "
            "104: at 96 the producer loop spills)"},
    {"kernel": "attention.split_kernel_wspec", "match": {"BLOCK_H": 64}, "max_shared": 100388, "max_regs": 168,
     "partition_regs": (208, 88),
     "why": "64 heads per program: Q (64 KB) and two 16-candidate ring slots (32 KB); consumers 208 registers (the "
            "[64, 512] fp32 accumulator is 128 of them; at 200 the consumer loop spills), producers 88"},
)


def resource_bounds(la: "Launch") -> Dict[str, object]:
    """The bounds :data:`RESOURCE_BOUNDS` pins ``la`` to (empty: only the SM's limits)."""
    for rule in RESOURCE_BOUNDS:
        have = dict(la.constexprs, **la.options)
        if rule["kernel"] == la.kernel and all(have.get(k) == v for k, v in rule["match"].items()):
            return {k: rule[k] for k in ("max_shared", "max_regs", "partition_regs")}
    return {}


def accepted_spills(la: "Launch") -> int:
    """The local loads / stores :data:`ACCEPTED_SPILLS` accepts of ``la`` (0: none)."""
    for rule in ACCEPTED_SPILLS:
        have = dict(la.constexprs, **la.options)
        if rule["kernel"] == la.kernel and all(have.get(k) == v for k, v in rule["match"].items()):
            return int(rule["max_ldl_stl"])
    return 0


class _Set:
    """Launches by key; a second origin of the same launch is added to its origins and the stricter need wins."""

    def __init__(self):
        self.by_key: Dict[str, Launch] = {}
        self.named: Dict[str, set] = {}

    def add(self, la: Launch) -> None:
        old = self.by_key.get(la.key)
        if old is None:
            self.by_key[la.key] = la
            self.named[la.key] = set(la.origins)
            return
        if la.origins[0] in self.named[la.key]:
            return
        self.named[la.key].add(la.origins[0])
        if la.need.get("ctas", 1) > old.need.get("ctas", 1):
            old.need["ctas"] = la.need["ctas"]
            old.origins.insert(0, la.origins[0])   # the origin that asks the most is named first
        else:
            old.origins.append(la.origins[0])
        for k, v in la.need.items():
            old.need.setdefault(k, v)


# ---- attention


def _attention_device(nsm: int):
    from ..attention.config import Device
    return Device("default", CAPABILITY, nsm)   # "default": no device table of its own, as every sm_120 part today


def _attention_requests():
    """(qk, launch overrides, label) of every way the product asks for a split launch on sm_120 (a body bound to other
    architectures, ``keys.runs_on``, is refused there with an error, not launched)."""
    from ..attention.config import IMPLS, BF16_ONLY_IMPLS, parse_config
    from ..attention.keys import runs_on
    from ..calibrate.attention import VARIANTS

    out = [("bf16", {}, ""), ("fp8", {}, "")]
    for impl in IMPLS:
        if not runs_on(impl, CAPABILITY[0]):
            continue
        for qk in ("bf16", "fp8"):
            if not (qk == "fp8" and impl in BF16_ONLY_IMPLS):
                out.append((qk, {"impl": impl}, f"impl={impl}"))
    out += [("bf16", parse_config(v, "calibrate variant"), v) for v in VARIANTS]
    return out


def _rows_for_keys(keys: Iterable[int], hg: int, nsm: int) -> List[int]:
    """Row counts T whose ``ceil(T * hg / nsm)`` is each key (the arch / default tables' key)."""
    return sorted({max(1, ((k - 1) * nsm) // hg + 1) for k in keys})


def _attention_shapes():
    from ..calibrate.deployment import FLASH

    c128 = 64 * -(-2 * -(-LONG_CONTEXT // 256) // 64)
    return (("swa", FLASH["sliding_window"], 0), ("c4", FLASH["sliding_window"], FLASH["index_topk"]),
            ("c128", FLASH["sliding_window"], c128))


def _split_launch(cfg: Dict[str, object], qk: str, has_extra: bool, origin: str) -> List[Launch]:
    from ..attention.config import BODY_KEYS
    from ..attention.key_aliases import CONSTEXPR
    from ..attention.keys import GPU_ONLY_IMPLS, producer_regs

    impl = cfg["impl"]
    fp8 = qk == "fp8"
    cst = dict(HAS_MAIN_LEN=True, HAS_EXTRA=has_extra, HAS_EXTRA_LEN=has_extra, BLOCK_H=cfg["BLOCK_H"],
               BLOCK_N=cfg["BLOCK_N"])
    if impl not in GPU_ONLY_IMPLS:   # the Gluon bodies: spanning splits, bf16 QK, never interpreted (no such flags)
        cst.update(FP8_QK=fp8, INTERP=False)
        for k in BODY_KEYS[impl]:
            if k != "PART_BF16":   # PART_BF16 is the workspace's dtype (the acc_ws pointer type), not a constexpr
                cst[CONSTEXPR.get(k, k)] = bool(cfg[k]) if k != "PREFETCH" else int(cfg[k])
    if impl == "tiled" and not fp8:
        cst.update(q8_ptr=None, qsc_ptr=None)   # the bf16 launch does not pass them
    if impl in GPU_ONLY_IMPLS:   # as attention.launch passes them (a required argument of the Gluon bodies)
        cst["PRODUCER_REGS"] = producer_regs(impl, cfg["maxnreg"], cfg["BLOCK_H"])
    if impl == "wspec":
        cst["CWARPS"] = cfg["num_warps"]
    opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    if cfg["maxnreg"]:
        opts["maxnreg"] = cfg["maxnreg"]
    # the register body's spanning plan counts on `waves` CTAs per SM; the warp-specialized body's ring takes
    # 83 KB of shared memory, one CTA per sm_120 SM (its plan then over-fills the slots, still correct)
    span = impl == "reg" and bool(cfg.get("spanning_splits"))
    need = {"ctas": max(1, int(cfg["waves"])) if span else 1}
    if fp8:
        need["mma"] = "fp8"
    acc = _partial_type(cfg)
    out = [Launch("attention", f"attention.split_kernel_{impl}", cst, opts, {"acc_ws": acc}, need, [origin])]
    if fp8 and impl == "tiled":
        out.append(Launch("attention", "attention.q_fp8_kernel", dict(BLOCK_H=cfg["BLOCK_H"], INTERP=False),
                          {"num_warps": 4}, {}, {}, [origin]))
    return out


def _attention_table(H: int, ov: Dict[str, object], qk: str):
    """The launch table a request (launch overrides ``ov``, QK mode ``qk``) at ``H`` heads reads on sm_120: the
    register table for the bodies that take it, else the head class's table in the QK mode (the fp8 one for tiled
    or flat asked for by name, whatever the mode)."""
    from .. import launch_tables as lt
    from ..attention import config as C

    impl = ov.get("impl")
    shape = "impl=reg" if impl in C.REG_TABLE_IMPLS else \
        f"H={C.head_class(H)},qk={'fp8' if impl in ('tiled', 'flat') else qk}"
    return lt.lookup(C.KERNEL, shape, 1, capability=CAPABILITY).path


def _attention_rows(H: int, ov: Dict[str, object], qk: str, nsm: int, batches: bool) -> List[int]:
    """The row counts at which the enumeration resolves a request: the first of each key of its table (keys count
    ``ceil(T * head groups of 16 / nsm)``), and with ``batches`` (the combine family) the decode and verify batches
    1..64 and 128..4096 between them."""
    from .. import launch_tables as lt

    rows = set(_rows_for_keys(lt.read_table(_attention_table(H, ov, qk)), -(-H // 16), nsm))
    if batches:
        rows |= set(range(1, 65)) | {1 << i for i in range(7, 13)}
    return sorted(rows)


def _attention(want: Tuple[str, ...], sets: Dict[str, _Set]) -> None:
    from ..attention import config as C
    from ..calibrate.deployment import FLASH

    heads = sorted({FLASH["num_attention_heads"] // tp for tp in TP_SIZES})
    for nsm in SM120_SMS:
        dev = _attention_device(nsm)
        for qk, ov, label in _attention_requests():
            for H in heads:
                rows = _attention_rows(H, ov, qk, nsm, "combine" in want)
                for name, K1, K2 in _attention_shapes():
                    for T in rows:
                        L = C.resolve(H, T, K1, K2, dev, qk=qk, overrides=ov)
                        origin = f"attention/{L.source}" + (f" with {label}" if label else "") + f" (qk={qk})"
                        if "attention" in want:
                            for la in _split_launch(L.config, qk, K2 > 0, origin):
                                sets["attention"].add(la)
                        if "combine" in want:
                            sets["combine"].add(_combine_launch(L.config, f"{origin}, combine of T={T} H={H} on "
                                                                          f"{nsm} SMs"))


def _partial_type(cfg: Dict[str, object]) -> str:
    """The workspace partial's pointer type of a resolved config (flat has no PART_BF16 key: fp32)."""
    from ..attention.plan import ws_words
    return "*bf16" if ws_words(cfg["impl"], cfg.get("PART_BF16")) == 258 else "*fp32"


def _combine_launch(cfg: Dict[str, object], origin: str) -> Launch:
    """The combine launch after the split launch of ``cfg``, as ``attention.launch.launch_combine`` makes it (the
    balanced launch is Hopper's: here its arguments keep their defaults)."""
    opts = {"num_warps": cfg["combine_warps"], "num_stages": 1}
    if cfg["combine_maxnreg"]:
        opts["maxnreg"] = cfg["combine_maxnreg"]
    return Launch("combine", "attention.combine_kernel",
                  dict(HAS_SINK=True, BLOCK_D=cfg["BLOCK_D"], BLOCK_S=cfg["BLOCK_S"], BALANCED=False, BH=16, NB=1,
                       W=1, C=1), opts, {"acc_ws": _partial_type(cfg)}, {}, [origin])


# ---- MoE


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _moe_shapes(path: str):
    """(E, topk, table file) of every MoE shape table an sm_120 GPU reads for ``path``."""
    from .. import launch_tables as lt
    from ..moe import config as MC

    for E, topk in MC._default_shapes(path, None):
        hit = lt.lookup(MC.KERNEL, MC.shape_key(E, topk, path), 1, capability=CAPABILITY)
        yield E, topk, hit.path


def _moe(path: str, s: _Set) -> None:
    from .. import launch_tables as lt
    from ..calibrate.deployment import FLASH
    from ..moe import config as MC

    fp4 = path == "fp4"
    H = FLASH["hidden_size"]
    inters = sorted({FLASH["moe_intermediate_size"] // tp for tp in TP_SIZES})
    for E, topk, tpath in _moe_shapes(path):
        table = lt.read_table(tpath)
        seen = set()
        for M in range(1, max(table) + 2):
            key = lt.nearest(table, M)
            grouped = table[key].get("align") == "inkernel"
            p_pad = max(16, _pow2(M * topk)) if grouped else 0
            if (key, p_pad) in seen:   # only the in-kernel grouping's P_PAD follows M within one entry
                continue
            seen.add((key, p_pad))
            for I in inters:
                cfg = MC.choose_config(M, topk, E, H, I, path, capability=CAPABILITY)
                origin = f"moe/{tpath.name}[{key}]"
                grp = dict(GROUPED=True, P_PAD=p_pad, E_PAD=max(16, _pow2(E))) if grouped else {}
                for apre in ((False, True) if fp4 else (False,)):
                    tag = f"{origin} (APRE={int(apre)})" if fp4 else origin
                    for which, bn, bk, w in ((1, cfg.BN1, cfg.BK1, cfg.warps1), (2, cfg.BN2, cfg.BK2, cfg.warps2)):
                        cst = dict(BM=cfg.BM, BN=bn, BK=bk, PATH_FP4=fp4, NATIVE=True, INTERP=False, DEQ=cfg.deq,
                                   APRE=apre, **grp)
                        if which == 1:
                            cst["HAS_LIMIT"] = FLASH["swiglu_limit"] is not None
                        s.add(Launch(f"moe_{path}", f"moe._gemm{which}_kernel", cst,
                                     {"num_warps": w, "num_stages": cfg.stages}, {},
                                     {"mma": "fp4"} if fp4 else {}, [tag]))
                        if apre:   # the quantizer before this GEMM: x (all rows) / h (the rows GEMM 1 wrote)
                            s.add(Launch(f"moe_{path}", "moe._quant_rows_kernel",
                                         dict(BR=16, BK=bk, HAS_SEL=which == 2), {"num_warps": 4},
                                         {} if which == 2 else {"sel_ptr": "*fp32"}, {}, [tag]))
                if not grouped and cfg.align == "triton":
                    e_pad = _pow2(E)
                    s.add(Launch(f"moe_{path}", "moe._align_kernel",
                                 dict(BM=cfg.BM, E_PAD=e_pad, CHUNK=max(16, min(128, 16384 // e_pad)), FILL=1024,
                                      BCHUNK=max(16, min(64, 8192 // e_pad))), {"num_warps": 8}, {}, {}, [origin]))
                s.add(Launch(f"moe_{path}", "moe._reduce_kernel",
                             dict(TOPK=topk, BLOCK=min(1024, _pow2(H)), INTERP=False), {"num_warps": 4}, {}, {},
                             [origin]))


def enumerate_launches(families: Optional[Iterable[str]] = None) -> Dict[str, List[Launch]]:
    """family -> its distinct launches (see the module docstring), in a stable order."""
    want = tuple(families or FAMILIES)
    bad = sorted(set(want) - set(FAMILIES))
    if bad:
        raise ValueError(f"unknown launch families {bad}; known: {', '.join(FAMILIES)}")
    sets = {f: _Set() for f in want}
    if "attention" in want or "combine" in want:
        _attention(want, sets)
    for path in ("fp4", "bf16"):
        if f"moe_{path}" in want:
            _moe(path, sets[f"moe_{path}"])
    out = {f: [s.by_key[k] for k in sorted(s.by_key)] for f, s in sets.items()}
    for ls in out.values():
        for la in ls:
            if accepted_spills(la):
                la.need["spills"] = accepted_spills(la)
            la.need.update(resource_bounds(la))
    return out
