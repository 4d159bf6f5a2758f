"""The all-reduce decision's rule and its profile fields (pure: no torch, no SGLang).

What a server can be told (SGLang 0.5.23, ``srt/distributed/parallel_state.py``): its TP all-reduce goes to
FlashInfer's PCIe-IPC kernels (``SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1``) for every tensor of at most
``SGLANG_PCIE_IPC_MAX_NUMEL`` elements the workspace admits, and to NCCL above, with one ``NCCL_PROTO`` /
``NCCL_ALGO`` for the whole communicator (NCCL reads them when the communicator is created). So a server's
choice is one pair (IPC bound ``b``, NCCL method ``P``): sizes ``<= b`` run IPC, the rest run ``P``.

:func:`choose` picks that pair from the measured sizes of one server:

* ``P`` ranges over the NCCL methods that passed verification at *every* measured size (a protocol that returned
  a wrong sum anywhere is never chosen: it also serves whatever IPC does not admit);
* ``b`` ranges over 0 (no IPC) and the measured sizes up to the first size where IPC did not pass (failed,
  wrong sum, not admitted): IPC must be verified at every size it would serve;
* the pair with the least cost wins, cost = sum over the measured sizes of (time of the method the pair runs
  there) / (fastest verified time there): 1.0 per size is ideal, and every size counts alike whatever its
  bytes; equal costs go to the smaller ``b`` (NCCL where IPC only ties), then to the NCCL method that forces the
  least (:func:`nccl_preference`: NCCL's own choice, then Simple, LL, LL128; without ``NCCL_ALGO`` before with).

The same rule with ``b = 0`` gives ``nccl_only``: the protocol for a server whose IPC path is off (the user's
``SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=0``, or a box where the preflight finds no peer access).

``ipc_max_numel`` is ``b`` rows x hidden rounded up to FlashInfer's 16-byte pack (8 bf16 elements): the
workspace refuses other capacities, and rounding up keeps the last chosen row count admitted.
"""

from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Tuple

from .fields import keyed_problem

IPC = "pcie_ipc"
GLOO = "gloo"                      # the CPU stand-in (tests, --device cpu): plays NCCL's part
PROTOS = ("LL", "LL128", "Simple")
ALGOS = ("Ring", "Tree")
STATUSES = ("ok", "failed", "unavailable", "rejected")
ROLES = ("prefill", "decode")
PACK_ELEMS = 8                     # FlashInfer's 16-byte pack in bf16 elements
DEFAULT_METHODS = (IPC, "nccl", "nccl_LL", "nccl_LL128", "nccl_Simple", "nccl_LL_Ring")
_PROTO_PREF = (None, "Simple", "LL", "LL128")


class MethodError(ValueError):
    """A method name that is not one of ours (one line)."""


def parse_method(name: str) -> Dict[str, Optional[str]]:
    """``pcie_ipc`` | ``gloo`` | ``nccl`` (NCCL's own choice) | ``nccl_<PROTO>`` | ``nccl_<PROTO>_<ALGO>`` |
    ``nccl__<ALGO>`` -> ``{"kind", "proto", "algo"}``."""
    if name in (IPC, GLOO):
        return {"kind": name, "proto": None, "algo": None}
    parts = name.split("_")
    if parts[0] != "nccl" or len(parts) > 3:
        raise MethodError(f"unknown all-reduce method {name!r}: expected {IPC}, nccl, nccl_<{'|'.join(PROTOS)}>"
                          f" or nccl_<PROTO>_<{'|'.join(ALGOS)}>")
    proto = parts[1] if len(parts) > 1 and parts[1] else None
    algo = parts[2] if len(parts) > 2 else None
    if (len(parts) > 1 and proto is None and algo is None) or (proto and proto not in PROTOS) or \
            (len(parts) > 2 and algo not in ALGOS):
        raise MethodError(f"unknown all-reduce method {name!r}: protocols {', '.join(PROTOS)}, algorithms "
                          f"{', '.join(ALGOS)} (e.g. nccl_LL, nccl_Simple_Ring)")
    return {"kind": "nccl", "proto": proto, "algo": algo}


def parse_methods(text: str) -> List[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise MethodError(f"--methods {text!r}: expected a comma list, e.g. {','.join(DEFAULT_METHODS)}")
    for n in names:
        parse_method(n)
    return list(dict.fromkeys(names))


def nccl_preference(name: str) -> tuple:
    """Tie order among fallback methods: the one that forces the least first."""
    m = parse_method(name)
    p = _PROTO_PREF.index(m["proto"]) if m["proto"] in _PROTO_PREF else len(_PROTO_PREF)
    return (m["kind"] != "nccl", m["algo"] is not None, p, name)


def describe_nccl(name: str) -> str:
    """``nccl_LL_Ring`` -> ``NCCL LL (Ring)``; ``nccl`` -> ``NCCL (its own protocol per size)``."""
    m = parse_method(name)
    if m["kind"] == GLOO:
        return "gloo (CPU stand-in)"
    if m["proto"] is None and m["algo"] is None:
        return "NCCL (its own protocol per size)"
    return "NCCL " + (m["proto"] or "own protocol") + (f" ({m['algo']})" if m["algo"] else "")


def ipc_numel(rows: int, hidden: int) -> int:
    """The workspace capacity admitting ``rows`` x ``hidden``: rounded up to whole 16-byte packs."""
    n = rows * hidden
    return 0 if n <= 0 else -(-n // PACK_ELEMS) * PACK_ELEMS


def _us(o: Optional[Mapping]) -> Optional[float]:
    if not isinstance(o, Mapping) or o.get("status") != "ok":
        return None
    us = o.get("us")
    return float(us) if isinstance(us, (int, float)) and not isinstance(us, bool) and math.isfinite(us) \
        and us > 0 else None


def _fallback(name: str) -> bool:
    try:
        return parse_method(name)["kind"] in ("nccl", GLOO)
    except MethodError:
        return False


def _pick(sizes: List[int], times: Dict[int, Dict[str, float]], bounds: List[int],
          fallbacks: List[str]) -> Tuple[float, int, str]:
    best = {r: min(times[r].values()) for r in sizes}
    pick = None
    for p in sorted(fallbacks, key=nccl_preference):
        for b in bounds:
            cost = sum((times[r][IPC] if r <= b else times[r][p]) / best[r] for r in sizes)
            key = (round(cost, 9), b, nccl_preference(p))
            if pick is None or key < pick[0]:
                pick = (key, cost, b, p)
    return pick[1], pick[2], pick[3]


def _env_fields(p: str) -> dict:
    m = parse_method(p)
    return {"nccl": p, "nccl_proto": m["proto"], "nccl_algo": m["algo"]}


def choose(candidates: Mapping[int, Mapping[str, Mapping]], hidden: int) -> dict:
    """The server's choice from ``{rows: {method: outcome}}`` (module doc). Always returns a dict: ``status``
    ``ok`` with ``nccl``, ``nccl_proto``, ``nccl_algo``, ``ipc_max_rows``, ``ipc_max_numel``, ``ranges``,
    ``per_size`` (rows -> method run), ``cost`` (``sizes`` is ideal), ``nccl_only`` and ``reason``; or
    ``status`` ``none`` with the reason no choice can be made."""
    sizes = sorted(int(r) for r in candidates)
    if not sizes:
        return {"status": "none", "reason": "no size was measured"}
    times = {r: {m: t for m, o in candidates[r].items() if (t := _us(o)) is not None} for r in sizes}
    methods = sorted({m for r in sizes for m in candidates[r]})
    fallbacks = [m for m in methods if _fallback(m) and all(m in times[r] for r in sizes)]
    if not fallbacks:
        bad = [f"{m} at rows {next(r for r in sizes if m not in times[r])}" for m in methods if _fallback(m)]
        return {"status": "none", "reason": "no NCCL method passed at every measured size"
                + (f" ({'; '.join(bad)} did not)" if bad else " (none measured)")}
    prefix = []
    for r in sizes:
        if IPC not in times[r]:
            break
        prefix.append(r)
    cost, b, p = _pick(sizes, times, [0] + prefix, fallbacks)
    cost0, _, p0 = _pick(sizes, times, [0], fallbacks)
    ranges = ([{"from_rows": sizes[0], "to_rows": b, "method": IPC}] if b else []) + \
        ([{"from_rows": next((r for r in sizes if r > b), None), "to_rows": None, "method": p}]
         if any(r > b for r in sizes) else [])
    if b and b == sizes[-1]:
        ranges.append({"from_rows": None, "to_rows": None, "method": p, "note": "beyond the measured sizes"})
    if b:
        reason = f"{IPC} up to {b} rows, {describe_nccl(p)} above"
    elif prefix:
        reason = f"{describe_nccl(p)} at every size ({IPC} verified up to {prefix[-1]} rows but never cheaper)"
    else:
        first = candidates[sizes[0]].get(IPC)
        why = (f"{first.get('status')}: {first.get('reason', '')}".rstrip(": ") if isinstance(first, Mapping)
               else "not measured")
        reason = f"{describe_nccl(p)} at every size ({IPC} {why})"
    return {"status": "ok", **_env_fields(p), "ipc_max_rows": b, "ipc_max_numel": ipc_numel(b, hidden),
            "ranges": ranges, "per_size": {str(r): (IPC if r <= b else p) for r in sizes},
            "cost": round(cost, 4), "sizes": len(sizes), "reason": reason,
            "nccl_only": {**_env_fields(p0), "cost": round(cost0, 4)}}


def fastest(row: Mapping[str, Mapping]) -> Optional[str]:
    """The fastest verified method of one size (any kind), None when none passed."""
    ok = [(t, m) for m, o in row.items() if (t := _us(o)) is not None]
    return min(ok)[1] if ok else None


# ----------------------------------------------------------------------------- profile fields

def _server_problem(s: object) -> Optional[str]:
    if not isinstance(s, Mapping):
        return "not an object"
    for k in ("tp", "hidden"):
        if not (isinstance(s.get(k), int) and not isinstance(s.get(k), bool) and s[k] > 0):
            return f"{k} must be a positive integer, got {s.get(k)!r}"
    sizes = s.get("sizes", {})
    if not isinstance(sizes, Mapping):
        return "sizes must be an object"
    for r, row in sizes.items():
        if not (isinstance(r, str) and r.isdigit() and int(r) > 0):
            return f"size {r!r} is not a positive row count"
        cands = row.get("candidates") if isinstance(row, Mapping) else None
        if not isinstance(cands, Mapping):
            return f"rows {r}: no candidates"
        for m, o in cands.items():
            if not isinstance(o, Mapping) or o.get("status") not in STATUSES:
                return f"rows {r}: method {m!r} has no valid status"
            if o.get("status") == "ok" and _us(o) is None:
                return f"rows {r}: method {m!r} is ok without a positive time"
    c = s.get("choice")
    if c is None or (isinstance(c, Mapping) and c.get("status") == "none"):
        return None
    return _choice_problem(c, s, {int(r): row["candidates"] for r, row in sizes.items()})


def _choice_problem(c: object, s: Mapping, cands: Dict[int, Mapping]) -> Optional[str]:
    if not isinstance(c, Mapping) or c.get("status") != "ok":
        return "choice must be an object with status ok or none"
    p = c.get("nccl")
    try:
        m = parse_method(p) if isinstance(p, str) else None
    except MethodError as e:
        return str(e)
    if m is None or m["kind"] == IPC:
        return f"choice: nccl {p!r} is not an NCCL method"
    if c.get("nccl_proto") != m["proto"] or c.get("nccl_algo") != m["algo"]:
        return f"choice: nccl_proto / nccl_algo {c.get('nccl_proto')!r} / {c.get('nccl_algo')!r} do not match {p}"
    for r, row in cands.items():
        if _us(row.get(p)) is None:
            return f"choice: {p} did not pass at rows {r}"
    n = c.get("ipc_max_numel")
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0 and n % PACK_ELEMS == 0):
        return f"choice: ipc_max_numel must be a non-negative multiple of {PACK_ELEMS}, got {n!r}"
    for r, row in cands.items():
        if r * s["hidden"] <= n and _us(row.get(IPC)) is None:
            return f"choice: {IPC} serves up to {n} elements but did not pass at rows {r}"
    only = c.get("nccl_only")
    if not isinstance(only, Mapping) or not isinstance(only.get("nccl"), str) or \
            any(_us(row.get(only["nccl"])) is None for row in cands.values()):
        return "choice: nccl_only must name an NCCL method that passed at every size"
    return None


def validate_entry(d: object) -> Optional[str]:
    """None when the ``allreduce`` decision follows the schema (docs/pcie.md), else what is wrong (one line)."""
    return keyed_problem(d, "servers", "server", ROLES, _server_problem)
