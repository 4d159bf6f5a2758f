"""``make verify``'s comparisons and report: greedy token streams side by side, accuracy within noise, speed,
decode-time share by kernel group, and the verdict per decision (``verify.py`` runs the stages).

Pure functions over the JSON the stages write; no I/O except :func:`write_report`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Optional

from ..fileio import atomic_write_text

# A throughput difference below this fraction counts as "the same" (run-to-run noise of the load generator).
SPEED_NOISE = 0.02
# Accuracy difference within this many standard errors of the difference counts as noise (about 95 %).
ACC_SIGMAS = 2.0


def first_divergence(a: dict, b: dict) -> dict:
    """Compare one prompt's greedy answers. Token ids when both have them, else the text (characters).
    ``first_divergence`` is the first position that differs (an answer that ended counts as differing
    where it ended), None when identical."""
    out = {"id": a.get("id") or b.get("id")}
    if a.get("error") or b.get("error"):
        out.update(identical=None, first_divergence=None, basis=None,
                   error=a.get("error") or b.get("error"))
        return out
    if a.get("output_ids") is not None and b.get("output_ids") is not None:
        x, y, basis = list(a["output_ids"]), list(b["output_ids"]), "token ids"
    else:
        x, y, basis = a.get("text") or "", b.get("text") or "", "text (characters)"
    k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
    if k is None and len(x) != len(y):
        k = min(len(x), len(y))
    out.update(identical=k is None, first_divergence=k, basis=basis, len_a=len(x), len_b=len(y))
    if k is not None:
        out["a_at"] = x[k] if k < len(x) else None
        out["b_at"] = y[k] if k < len(y) else None
    return out


def compare_greedy(a: List[dict], b: List[dict], first_tokens: int) -> dict:
    """Per prompt (matched by id) and in total. ``first_tokens_identical``: every prompt agrees on its
    first ``first_tokens`` positions (the speculative variant's target)."""
    bi = {r["id"]: r for r in b}
    rows = [first_divergence(r, bi.get(r["id"], {"id": r["id"], "error": "missing in the other variant"}))
            for r in a]
    compared = [r for r in rows if r["identical"] is not None]
    div = [r for r in compared if not r["identical"]]
    return {"prompts": rows, "compared": len(compared), "identical": len(compared) - len(div),
            "all_identical": bool(compared) and not div and len(compared) == len(rows),
            "first_divergence_min": min((r["first_divergence"] for r in div), default=None),
            "first_tokens": first_tokens,
            "first_tokens_identical": bool(compared) and len(compared) == len(rows)
            and all(r["first_divergence"] is None or r["first_divergence"] >= first_tokens for r in compared)}


def compare_accuracy(a: Optional[dict], b: Optional[dict]) -> Optional[dict]:
    """ours (a) vs the other (b): the difference and whether it is within ACC_SIGMAS standard errors of a
    difference of two binomial proportions (at least one question's worth)."""
    if not a or not b or a.get("accuracy") is None or b.get("accuracy") is None:
        return None
    pa, pb = float(a["accuracy"]), float(b["accuracy"])
    na, nb = int(a.get("questions") or 1), int(b.get("questions") or 1)
    se = math.sqrt(pa * (1 - pa) / na + pb * (1 - pb) / nb)
    tol = max(ACC_SIGMAS * se, 1.0 / min(na, nb))
    return {"ours": pa, "other": pb, "diff": pa - pb, "tolerance": tol, "within_noise": abs(pa - pb) <= tol,
            "ours_worse": pa < pb - tol}


def measure_rows(measure: Optional[dict]) -> Dict[int, dict]:
    """{concurrency: metrics} of the measure stage's successful runs."""
    out = {}
    for r in (measure or {}).get("runs") or []:
        if not r.get("error") and r.get("metrics"):
            out[int(r["concurrency"])] = r["metrics"]
    return out


def compare_speed(a: Optional[dict], b: Optional[dict]) -> Optional[dict]:
    """Output tok/s of ours (a) vs the other (b) at each concurrency both measured."""
    ra, rb = measure_rows(a), measure_rows(b)
    cs = sorted(set(ra) & set(rb))
    if not cs:
        return None
    per = []
    for c in cs:
        x, y = ra[c].get("output_throughput"), rb[c].get("output_throughput")
        if not x or not y:
            continue
        ratio = x / y
        per.append({"concurrency": c, "ours_tok_s": x, "other_tok_s": y, "ratio": ratio,
                    "call": "faster" if ratio > 1 + SPEED_NOISE else "slower" if ratio < 1 - SPEED_NOISE else "same"})
    return {"per_concurrency": per} if per else None


def verdict(greedy: Optional[dict], acc: Optional[dict], speed: Optional[dict], accuracy_note: str = "",
            lead: str = "") -> str:
    """One line: equal greedy tokens? accuracy within noise? faster? and which side to keep. ``lead`` goes first
    (the MTP variant's first-tokens target); it also stands for the greedy part when greedy did not run."""
    parts = [lead] if lead else []
    if greedy is None:
        if not lead:
            parts.append("greedy: not run")
    elif greedy["all_identical"]:
        parts.append("greedy tokens identical")
    else:
        parts.append(f"greedy tokens differ on {greedy['compared'] - greedy['identical']}/{greedy['compared']} "
                     f"prompts (first divergence at token {greedy['first_divergence_min']})"
                     if greedy["compared"] else "greedy: no comparable answers")
    if acc is None:
        parts.append(f"accuracy: {accuracy_note or 'not measured'}")
    else:
        parts.append(f"accuracy {'within noise' if acc['within_noise'] else 'DIFFERS'} "
                     f"({100 * acc['ours']:.1f}% vs {100 * acc['other']:.1f}%, tolerance ±{100 * acc['tolerance']:.1f}%)")
    calls = {p["concurrency"]: p for p in (speed or {}).get("per_concurrency", [])}
    if not calls:
        parts.append("speed: not measured")
    else:
        parts.append("speed: " + ", ".join(f"C={c} {p['call']} ({100 * (p['ratio'] - 1):+.1f}%)"
                                           for c, p in calls.items()))
    faster = [c for c, p in calls.items() if p["call"] == "faster"]
    slower = [c for c, p in calls.items() if p["call"] == "slower"]
    if acc is not None and acc["ours_worse"]:
        keep = "keep stock: ours loses accuracy"
    elif not calls:
        keep = "no speed verdict"
    elif slower and not faster:
        keep = "keep stock: ours is slower"
    elif faster and not slower:
        keep = "keep ours"
    elif faster and slower:
        keep = f"mixed: ours faster at C={','.join(map(str, faster))}, slower at C={','.join(map(str, slower))}"
    else:
        keep = "no difference beyond noise"
    return "; ".join(parts) + f" => {keep}"


def build_comparisons(variants: Dict[str, dict], descriptions: Dict[str, str], first_tokens: int,
                      accuracy_note: str = "") -> List[dict]:
    """ours vs each other variant that ran (stock, stock-<decision>, mtp)."""
    ours = variants.get("ours")
    if not ours:
        return []
    out = []
    for name, v in variants.items():
        if name == "ours":
            continue
        so, sv = ours.get("stages", {}), v.get("stages", {})
        ga, gb = (so.get("greedy") or {}).get("results"), (sv.get("greedy") or {}).get("results")
        greedy = compare_greedy(ga, gb, first_tokens) if ga is not None and gb is not None else None
        acc = compare_accuracy(so.get("accuracy"), sv.get("accuracy"))
        speed = compare_speed(so.get("measure"), sv.get("measure"))
        row = {"variant": name, "decision": descriptions.get(name, name), "greedy": greedy, "accuracy": acc,
               "speed": speed}
        if name == "mtp":
            # speculative decoding: the target is the non-speculative path's first tokens, exactly
            target = None if greedy is None else greedy["first_tokens_identical"]
            row["target_met"] = target
            head = ("greedy: not run" if greedy is None else
                    f"first {first_tokens} tokens {'identical' if target else 'DIFFER'} on "
                    f"{'all' if target else 'some'} prompts")
            row["verdict"] = verdict(greedy, acc, speed, accuracy_note, lead=head + " (vs the non-speculative path)")
        else:
            row["verdict"] = verdict(greedy, acc, speed, accuracy_note)
        out.append(row)
    return out


# ---- markdown

def _f(x, nd=1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def render_markdown(rep: dict) -> str:
    names = list(rep["variants"])
    L = [f"# make verify — {rep.get('model', '')}", "",
         f"{rep.get('date_utc', '')}, git {rep.get('git') or '?'}, run directory `{rep.get('run_dir', '')}`"
         + (" (STAND-IN servers: rehearsal, not measurements)" if rep.get("standin") else ""), ""]
    L.append(f"**Result: {'all stages passed' if rep.get('ok') else 'FAILED'}**"
             + ("" if rep.get("ok") else f" ({'; '.join(rep.get('failures', []))})"))
    L += ["", "## Variants", "", "| variant | what runs | start | stages |", "| --- | --- | --- | --- |"]
    for n, v in rep["variants"].items():
        st = v.get("start") or {}
        stages = ", ".join(f"{s} {x.get('status')}" for s, x in (v.get("stages") or {}).items())
        L.append(f"| {n} | {rep['descriptions'].get(n, n)} | "
                 f"{'ok (%.0f s)' % st['seconds'] if st.get('ok') else 'FAILED: ' + str(st.get('error', 'not started'))} "
                 f"| {stages or '-'} |")
    L += ["", "## Verdict per decision", ""]
    if rep.get("comparisons"):
        L += ["| ours vs | decision | verdict |", "| --- | --- | --- |"]
        L += [f"| {c['variant']} | {c['decision']} | {c['verdict']} |" for c in rep["comparisons"]]
    else:
        L.append("No comparison: `ours` and another variant must both run.")
    L += ["", "## Correctness: greedy outputs", ""]
    for c in rep.get("comparisons", []):
        g = c.get("greedy")
        if not g:
            continue
        L += [f"ours vs {c['variant']}: {g['identical']}/{g['compared']} prompts identical ({g['prompts'][0]['basis'] if g['prompts'] else '-'}).", "",
              "| prompt | identical | first divergence | ours there | theirs there | lengths |",
              "| --- | --- | --- | --- | --- | --- |"]
        for r in g["prompts"]:
            if r["identical"] is None:
                L.append(f"| {r['id']} | - | {r.get('error')} | | | |")
            else:
                L.append(f"| {r['id']} | {'yes' if r['identical'] else 'no'} | "
                         f"{'-' if r['first_divergence'] is None else 'token %d' % r['first_divergence']} | "
                         f"{r.get('a_at', '') if not r['identical'] else ''} | "
                         f"{r.get('b_at', '') if not r['identical'] else ''} | {r['len_a']} / {r['len_b']} |")
        L.append("")
    L += ["## Accuracy (GSM8K few-shot, SGLang's helper)", ""]
    if rep.get("accuracy_note"):
        L += [f"accuracy: {rep['accuracy_note']}", ""]
    rows = [(n, (v.get("stages") or {}).get("accuracy")) for n, v in rep["variants"].items()]
    rows = [(n, a) for n, a in rows if a and a.get("accuracy") is not None]
    if rows:
        L += ["| variant | accuracy | invalid | questions |", "| --- | --- | --- | --- |"]
        L += [f"| {n} | {100 * a['accuracy']:.1f}% | {100 * (a.get('invalid') or 0):.1f}% | {a.get('questions')} |"
              for n, a in rows]
        L.append("")
    L += ["## Performance (`make measure`)", ""]
    per = {n: measure_rows((v.get("stages") or {}).get("measure")) for n, v in rep["variants"].items()}
    cs = sorted({c for m in per.values() for c in m})
    if cs:
        L += ["| C | " + " | ".join(f"{n} tok/s | {n} TPOT p50 ms | {n} TTFT p50 ms" for n in names) + " |",
              "| --- |" + " --- | --- | --- |" * len(names)]
        for c in cs:
            cells = []
            for n in names:
                m = per[n].get(c) or {}
                cells += [_f(m.get("output_throughput")), _f(m.get("median_tpot_ms"), 2), _f(m.get("median_ttft_ms"))]
            L.append(f"| {c} | " + " | ".join(cells) + " |")
        L.append("")
    else:
        L += ["not measured", ""]
    L += ["## Decode-time share by kernel group (`make profile`)", ""]
    prof = {n: (v.get("stages") or {}).get("profile") or {} for n, v in rep["variants"].items()}
    groups = []
    for p in prof.values():
        for g in p.get("groups") or []:
            if g["group"] not in groups:
                groups.append(g["group"])
    if groups:
        L += ["| group | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
        for g in groups:
            cells = []
            for n in names:
                hit = next((x for x in prof[n].get("groups") or [] if x["group"] == g), None)
                cells.append("-" if hit is None else f"{100 * hit['share']:.1f}%")
            L.append(f"| {g} | " + " | ".join(cells) + " |")
        L.append("| GPU idle (of window) | " + " | ".join(
            "-" if prof[n].get("idle_share_of_window") is None else f"{100 * prof[n]['idle_share_of_window']:.1f}%"
            for n in names) + " |")
        L += ["", *[f"- {n}: {prof[n]['bottleneck']}" for n in names if prof[n].get("bottleneck")], ""]
    else:
        L += ["not profiled", ""]
    if rep.get("shape"):
        from .shape_report import markdown as shape_markdown
        L += shape_markdown(rep["shape"])
    L += ["## Teardown", "", rep.get("teardown", "-"), ""]
    return "\n".join(L)


def write_report(rep: dict, run_dir: Path) -> None:
    atomic_write_text(run_dir / "report.json", json.dumps(rep, indent=2, default=str) + "\n")
    atomic_write_text(run_dir / "report.md", render_markdown(rep) + "\n")
