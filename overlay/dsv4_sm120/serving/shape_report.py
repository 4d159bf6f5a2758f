"""The shape stage's table and plot (``make verify ARGS='--stages shape'``): pure rendering of the study's record
(``serving/shapes.py`` runs it; ``machine_profile/shape_decision.py`` holds the fields and the winner rule)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Mapping, Optional

from ..machine_profile.shape_decision import shape_text, spec_text


def _f(x, nd=1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def candidate_lines(rec: Mapping) -> List[str]:
    """One variant's candidates: a row per candidate and concurrency, the winner marked."""
    wins = rec.get("winners") or {}
    out = ["| candidate | shape | draft | MAX_RUNNING | agrees | C | out tok/s | tok/s per decode GPU | TPOT p50 ms | "
           "TPOT p99 ms | TTFT p50 ms | TTFT p99 ms | accepted / step |",
           "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for x in rec.get("candidates") or []:
        head = (f"| {x['name']} | {shape_text(x['prefill_gpus'], x['decode_gpus'])} | {spec_text(x.get('spec'))} | "
                f"{x.get('max_running', '-')} | "
                f"{'-' if x.get('agrees') is None else 'yes' if x['agrees'] else 'NO'} |")
        per = x.get("per_concurrency") or {}
        if x.get("status") != "ok" or not per:
            out.append(f"{head} - | FAILED: {x.get('error') or 'no measurement'} | | | | | | |")
            continue
        gpus = len([g for grp in x["decode_gpus"].split(";") for g in grp.split(",")])
        for c in sorted(per, key=int):
            m = per[c]
            won = wins.get(c) == x["name"]
            tok = m.get("output_tok_s")
            cell = f"**{_f(tok)}**" if won else _f(tok)
            out.append(f"{head} {c} | {cell} | {_f(tok / gpus if tok else None)} | {_f(m.get('tpot_p50_ms'), 2)} | "
                       f"{_f(m.get('tpot_p99_ms'), 2)} | {_f(m.get('ttft_p50_ms'))} | {_f(m.get('ttft_p99_ms'))} | "
                       f"{_f(m.get('accept_length'), 2)} |")
    return out


def markdown(study: Mapping) -> List[str]:
    """The report's section: per variant the table, the winner per concurrency and where it was recorded."""
    L = ["## Serving shape (`--stages shape`)", ""]
    if study.get("standin"):
        L += ["STAND-IN servers: a rehearsal of the bookkeeping, not measurements.", ""]
    for variant, rec in (study.get("variants") or {}).items():
        L += [f"### {variant}", "", f"Greedy agreement: the first {rec.get('first_tokens')} tokens of every prompt "
              f"against `{rec.get('reference')}`; a candidate that disagrees cannot win. Bold: the winner at that "
              f"concurrency (the fastest; one within 2% of it listed earlier wins).", ""]
        L += candidate_lines(rec) + [""]
        wins = rec.get("winners") or {}
        L.append("Winners: " + (", ".join(f"C={c} {n}" for c, n in sorted(wins.items(), key=lambda kv: int(kv[0])))
                                or "none (no candidate agreed and measured)") + ".")
        L += ["", f"Recorded: {(study.get('recorded') or {}).get(variant, 'no')}", ""]
    return L


def plot(study: Mapping, path: Path) -> Optional[str]:
    """Output tok/s per concurrency, one line per candidate, per variant; None when written, else why not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return f"matplotlib is not importable ({type(e).__name__})"
    recs = [(v, r) for v, r in (study.get("variants") or {}).items()
            if any(x.get("per_concurrency") for x in r.get("candidates") or [])]
    if not recs:
        return "no candidate was measured"
    fig, axes = plt.subplots(1, len(recs), figsize=(6.5 * len(recs), 4.2), dpi=110, squeeze=False)
    for ax, (variant, rec) in zip(axes.flat, recs):
        for x in rec["candidates"]:
            per = x.get("per_concurrency") or {}
            cs = sorted(per, key=int)
            if cs:
                ax.plot([int(c) for c in cs], [per[c].get("output_tok_s") or 0 for c in cs], "o-",
                        label=f"{x['name']}" + ("" if x.get("agrees") is not False else " (disagrees)"))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens / s")
        ax.set_title(f"{variant}" + (" (STAND-IN)" if study.get("standin") else ""), fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
    return None
