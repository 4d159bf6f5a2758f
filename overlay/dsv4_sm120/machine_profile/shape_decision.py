"""The serving-shape decision (``make verify ARGS='--stages shape'``): its machine-profile fields, the winner rule and
the lookup the serve plan makes (pure: no torch, no SGLang; the serve planner and the profile loader import it).

A *candidate* is one deployment of the box: the prefill and decode GPU groups (``PREFILL_GPUS`` / ``DECODE_GPUS``
text, ``;`` between replicas) and, for the MTP variant, the draft length (``{"algorithm": "DSPARK", "block_size":
3}`` or ``{"algorithm": "EAGLE", "steps": 2}``). The shape stage measures each with SGLang's load generator at the
user's concurrencies and compares its greedy tokens with the first candidate's. :func:`winners` picks, per
concurrency, among the candidates that agree with the first one and measured there, the one with the most output
tokens per second; a candidate within :data:`NOISE` of the fastest that comes earlier in the list wins (the list
starts with the default layout and the checkpoint's own draft length, so a tie within noise keeps them).

Profile fields (``decisions["shape"]``)::

    {"variants": {"base" | "mtp": {
        "measured_at": "<UTC ISO>", "standin": bool, "model": "<MODEL_PATH>", "input_len": int, "output_len": int,
        "concurrency": [1, 8, 16], "reference": "<first candidate>", "first_tokens": int,
        "candidates": [{"name", "prefill_gpus", "decode_gpus", "spec": null | {...}, "max_running": int,
                        "status": "ok" | "failed", "error": str, "agrees": bool | null,
                        "per_concurrency": {"<C>": {"output_tok_s", "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms",
                                                    "ttft_p99_ms", "accept_length"}}}],
        "winners": {"<C>": "<candidate name>"}}}}

:func:`validate_entry` refuses a winner that did not agree, did not measure at its concurrency or is not a
candidate; :func:`pick` is the serve plan's lookup: the winner at the smallest measured concurrency at or above the
asked one (the largest when it is beyond them).
"""

from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..serve_variables import gpu_groups
from .fields import keyed_problem

VARIANTS = ("base", "mtp")
ALGORITHMS = {"DSPARK": "block_size", "EAGLE": "steps"}
NOISE = 0.02
METRICS = ("output_tok_s", "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "accept_length")


def shape_text(prefill: str, decode: str) -> str:
    """``0,1,2,3`` / ``4,5;6,7`` -> ``prefill TP4, decode 2 x TP2``."""
    def one(role: str, text: str) -> str:
        g = gpu_groups(text)
        return f"{role} {len(g)} x TP{len(g[0])}" if len(g) > 1 else f"{role} TP{len(g[0])}"
    return f"{one('prefill', prefill)}, {one('decode', decode)}"


def spec_text(spec: Optional[Mapping]) -> str:
    if not spec:
        return "no speculation"
    if spec["algorithm"] == "DSPARK":
        return f"DSpark block {spec['block_size']}"
    return f"EAGLE {spec['steps']} step{'' if spec['steps'] == 1 else 's'}"


def candidate_name(prefill: str, decode: str, spec: Optional[Mapping] = None) -> str:
    """A short file-system-safe name: ``p4-d4``, ``p4-d2x2``, ``p4-d2x2-dspark3``, ``p4-d4-eagle2``."""
    def one(text: str) -> str:
        g = gpu_groups(text)
        return f"{len(g[0])}" + (f"x{len(g)}" if len(g) > 1 else "")
    name = f"p{one(prefill)}-d{one(decode)}"
    if spec:
        name += f"-{spec['algorithm'].lower()}{spec[ALGORITHMS[spec['algorithm']]]}"
    return name


def _number(x: object) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def winners(candidates: Sequence[Mapping], noise: float = NOISE) -> Dict[str, str]:
    """{concurrency (text): candidate name} (module doc)."""
    out: Dict[str, str] = {}
    levels = sorted({int(c) for x in candidates for c in (x.get("per_concurrency") or {})})
    for c in levels:
        ok = []
        for i, x in enumerate(candidates):
            t = _number(((x.get("per_concurrency") or {}).get(str(c)) or {}).get("output_tok_s"))
            if x.get("status") == "ok" and x.get("agrees") and t is not None and t > 0:
                ok.append((i, t, x["name"]))
        if ok:
            best = max(t for _, t, _ in ok)
            out[str(c)] = min((i, n) for i, t, n in ok if t >= best * (1 - noise))[1]
    return out


def _spec_problem(spec: object) -> Optional[str]:
    if spec is None:
        return None
    if not isinstance(spec, Mapping) or spec.get("algorithm") not in ALGORITHMS:
        return f"spec {spec!r} must be null or name an algorithm of {', '.join(ALGORITHMS)}"
    key = ALGORITHMS[spec["algorithm"]]
    n = spec.get(key)
    if not (isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 63):
        return f"spec {spec['algorithm']} needs an integer {key} 1..63, got {n!r}"
    return None


def _candidate_problem(x: object) -> Optional[str]:
    if not isinstance(x, Mapping) or not isinstance(x.get("name"), str) or not x["name"]:
        return "a candidate without a name"
    for k in ("prefill_gpus", "decode_gpus"):
        try:
            gpu_groups(x.get(k) if isinstance(x.get(k), str) else "")
        except ValueError as e:
            return f"candidate {x['name']}: {k} {x.get(k)!r}: {e}"
    why = _spec_problem(x.get("spec"))
    if why:
        return f"candidate {x['name']}: {why}"
    if x.get("status") not in ("ok", "failed"):
        return f"candidate {x['name']}: status must be ok or failed"
    per = x.get("per_concurrency") or {}
    if not isinstance(per, Mapping):
        return f"candidate {x['name']}: per_concurrency must be an object"
    for c, m in per.items():
        if not (isinstance(c, str) and c.isdigit() and int(c) > 0 and str(int(c)) == c) or not isinstance(m, Mapping):
            return f"candidate {x['name']}: concurrency {c!r} is not a positive integer written plainly"
        bad = [k for k in METRICS if m.get(k) is not None and _number(m.get(k)) is None]
        if bad:
            return f"candidate {x['name']} at C={c}: {', '.join(bad)} must be numbers"
    return None


def _variant_problem(rec: object) -> Optional[str]:
    if not isinstance(rec, Mapping) or not isinstance(rec.get("candidates"), list) or not rec["candidates"]:
        return "no candidates"
    if not isinstance(rec.get("standin"), bool):
        return "standin must be true or false"
    names: List[str] = []
    for x in rec["candidates"]:
        why = _candidate_problem(x)
        if why:
            return why
        names.append(x["name"])
    if len(set(names)) != len(names):
        return "candidate names repeat"
    by = {x["name"]: x for x in rec["candidates"]}
    w = rec.get("winners")
    if not isinstance(w, Mapping):
        return "no winners object"
    for c, name in w.items():
        x = by.get(name) if isinstance(name, str) else None
        if x is None:
            return f"winner at C={c} {name!r} is not a candidate"
        t = _number(((x.get("per_concurrency") or {}).get(c) or {}).get("output_tok_s"))
        if x["status"] != "ok" or x.get("agrees") is not True or t is None or t <= 0:
            return f"winner at C={c} {name!r} did not agree with the first candidate or measure there"
    return None


def validate_entry(d: object) -> Optional[str]:
    """None when the ``shape`` decision follows the schema (module doc), else what is wrong (one line)."""
    return keyed_problem(d, "variants", "variant", VARIANTS, _variant_problem, nonempty=True)


def pick(entry: Optional[Mapping], variant: str, concurrency: int) -> Tuple[Optional[Mapping], Optional[int], str]:
    """(the winning candidate for ``concurrency`` requests, the measured concurrency it won at, "") or
    (None, None, why there is none)."""
    rec = ((entry or {}).get("variants") or {}).get(variant)
    if not rec:
        return None, None, f"no shape recorded for the {variant} variant"
    w = {int(c): n for c, n in (rec.get("winners") or {}).items()}
    if not w:
        return None, None, f"the recorded {variant} shapes have no winner (none agreed and measured)"
    levels = sorted(w)
    c = next((x for x in levels if x >= concurrency), levels[-1])
    x = next((y for y in rec["candidates"] if y["name"] == w[c]), None)
    return (x, c, "") if x is not None else (None, None, f"winner {w[c]!r} is not among the candidates")
