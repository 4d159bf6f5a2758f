"""The FP8 tuner's summary: comparisons, the backend decision, and the Markdown table.

``summary_<device>.json`` holds, per shape and M, the best config and its time, SGLang's default config's
time, the shipped config's time (if SGLang ships a JSON for the device), and the end-to-end linear times of the
tuned Triton path and SGLang's default backend.  :func:`decide_backend` turns these into the recommendation
:func:`dsv4_sm120.fp8_configs.recommended_fp8_gemm_backend` serves with.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

from dsv4_sm120.fp8.shapes import DECODE_MAX_M, PREFILL_MIN_M

# The backend rule: Triton must win by this much at decode sizes and may lose at most this much at prefill.
DECODE_MIN_SPEEDUP = 1.05
PREFILL_MIN_SPEEDUP = 0.8


def geomean(xs: Iterable[float]) -> Optional[float]:
    """Geometric mean of the positive finite values, or None when there are none."""
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    if not xs:
        return None
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _rows(summary: dict):
    """(shape key, M, row) of every complete shape."""
    for key, s in summary.get("shapes", {}).items():
        if not s.get("complete"):
            continue
        for m, r in s.get("rows", {}).items():
            yield key, int(m), r


def compare_rows(summary: dict) -> dict:
    """Geomean speedups: tuned vs SGLang's default Triton config (decode M, all M), and the tuned Triton linear
    vs the default backend (decode M, prefill M); None where nothing was timed."""
    def gm(pred, num, den):
        return geomean(r[num] / r[den] for _, m, r in _rows(summary)
                       if pred(m) and r.get(num) and r.get(den))

    out = {
        "tuned_vs_sglang_default_cfg_geomean_m_le_64": gm(lambda m: m <= DECODE_MAX_M, "sglang_default_cfg_us",
                                                          "best_us"),
        "tuned_vs_sglang_default_cfg_geomean_all": gm(lambda m: True, "sglang_default_cfg_us", "best_us"),
        "tuned_vs_default_backend_geomean_m_le_64": gm(lambda m: m <= DECODE_MAX_M, "default_backend_linear_us",
                                                       "triton_linear_us"),
        "tuned_vs_default_backend_geomean_m_ge_256": gm(lambda m: m >= PREFILL_MIN_M,
                                                        "default_backend_linear_us", "triton_linear_us"),
    }
    return {k: (None if v is None else round(v, 4)) for k, v in out.items()}


def decide_backend(summary: dict) -> dict:
    """Recommend ``--fp8-gemm-backend triton`` when the tuned Triton linear beats the device's default backend
    by >= 5% (geomean) over decode sizes (M <= 64) and loses no more than 20% (geomean) at M >= 256."""
    db = summary.get("default_backend") or {}
    c = summary.get("comparison") or {}
    incomplete = [k for k, s in summary.get("shapes", {}).items() if not s.get("complete")]
    incomplete += list(summary.get("pending_shapes") or [])
    if db.get("name") == "triton":
        return {"recommended_backend": None,
                "reason": "SGLang's default FP8 GEMM backend on this device is already Triton; "
                          "the tuned JSONs apply without a flag"}
    if not db.get("available"):
        return {"recommended_backend": None,
                "reason": f"default backend ({db.get('name') or 'unknown'}) was not timed: {db.get('reason')}"}
    if incomplete:
        return {"recommended_backend": None, "reason": f"tuning incomplete ({', '.join(sorted(set(incomplete)))})"}
    dec, pre = c.get("tuned_vs_default_backend_geomean_m_le_64"), c.get("tuned_vs_default_backend_geomean_m_ge_256")
    if dec is None:
        return {"recommended_backend": None, "reason": "no default-backend timings recorded"}
    ok = dec >= DECODE_MIN_SPEEDUP and (pre is None or pre >= PREFILL_MIN_SPEEDUP)
    reason = (f"tuned Triton vs {db.get('name')}: geomean speedup {dec:.3f}x at M<={DECODE_MAX_M}, "
              f"{'n/a' if pre is None else f'{pre:.3f}x'} at M>={PREFILL_MIN_M} "
              f"(rule: >={DECODE_MIN_SPEEDUP}x and >={PREFILL_MIN_SPEEDUP}x)")
    return {"recommended_backend": "triton" if ok else None, "reason": reason}


def _fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def _cfg_short(c: Optional[dict]) -> str:
    if not c:
        return "-"
    s = f"{c['BLOCK_SIZE_M']}x{c['BLOCK_SIZE_N']}x{c['BLOCK_SIZE_K']} g{c['GROUP_SIZE_M']} w{c['num_warps']} s{c['num_stages']}"
    if c.get("SWAP_AB"):
        s += " swap"
    if c.get("SPLIT_K", 1) > 1:
        s += f" sk{c['SPLIT_K']}"
    return s


def summary_markdown(summary: dict) -> str:
    db = summary.get("default_backend") or {}
    c = summary.get("comparison") or {}
    d = summary.get("decision") or {}
    v = summary.get("versions") or {}
    L = [f"# FP8 block-GEMM tuning: {summary.get('device_name_raw')}", "",
         f"- tool: {summary.get('tool')}, mode `{summary.get('mode')}`, TP {summary.get('tp')}, "
         f"updated {summary.get('updated_at')}",
         f"- kernel: SGLang {summary.get('sglang_version')} `w8a8_block_fp8_matmul_triton` "
         f"({summary.get('kernel_source')}); " + ", ".join(f"{k} {val}" for k, val in v.items()),
         f"- tuning time (sum over shapes): {summary.get('tuning_elapsed_s')} s",
         f"- default FP8 backend for this device: {db.get('name')} "
         f"({'timed' if db.get('available') else 'not timed: ' + str(db.get('reason'))})",
         f"- tuned vs SGLang's default Triton config, geomean speedup: M<=64 "
         f"**{_fmt(c.get('tuned_vs_sglang_default_cfg_geomean_m_le_64'), 3)}x**, all M "
         f"{_fmt(c.get('tuned_vs_sglang_default_cfg_geomean_all'), 3)}x",
         f"- tuned Triton linear vs default backend, geomean speedup: M<=64 "
         f"{_fmt(c.get('tuned_vs_default_backend_geomean_m_le_64'), 3)}x, M>=256 "
         f"{_fmt(c.get('tuned_vs_default_backend_geomean_m_ge_256'), 3)}x",
         f"- recommendation: `{('--fp8-gemm-backend ' + d['recommended_backend']) if d.get('recommended_backend') else 'keep SGLang default'}`"
         f" ({d.get('reason')})", "",
         "Times are microseconds per GEMM (CUDA-graph replay, weights rotated through more than L2). "
         "`default cfg`: SGLang's Triton config when no JSON exists; `shipped`: the JSON SGLang ships for "
         "this device, if any; `linear`: activation quantization + GEMM, tuned Triton vs the default backend.", ""]
    for key, s in summary.get("shapes", {}).items():
        L.append(f"## {key} ({s.get('name', '')}){'' if s.get('complete') else ' -- incomplete'}")
        L.append("")
        L.append("| M | tuned us | tuned config | default cfg us | speedup | shipped us | triton linear us "
                 "| default backend us | winner |")
        L.append("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |")
        for m, r in sorted(s.get("rows", {}).items(), key=lambda kv: int(kv[0])):
            sp = (r["sglang_default_cfg_us"] / r["best_us"]) if r.get("best_us") and r.get("sglang_default_cfg_us") else None
            L.append(f"| {m} | {_fmt(r.get('best_us'))} | {_cfg_short(r.get('best_config'))} | "
                     f"{_fmt(r.get('sglang_default_cfg_us'))} | {_fmt(sp, 2)} | {_fmt(r.get('sglang_shipped_cfg_us'))} | "
                     f"{_fmt(r.get('triton_linear_us'))} | {_fmt(r.get('default_backend_linear_us'))} | "
                     f"{r.get('winner', '-')} |")
        L.append("")
    return "\n".join(L)

