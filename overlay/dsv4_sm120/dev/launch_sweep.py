"""Per-GPU launch tables generated from launch-sweep rows of the benchmark results files.

A launch sweep times every candidate launch of a kernel at a list of sizes on one GPU:
``bench/bench_attention.py --cases launch`` and ``bench/bench_moe.py --cases launch``. Each (candidate, size)
becomes one row of the subject's results file (``bench/results/attention.csv``, ``moe.csv``): case
``launch...``, the candidate's complete launch text in ``variant`` (every key of its body spelled out, so the
row does not depend on the table it was measured under). :func:`build` turns the newest of those rows into the
``device_name=<GPU>`` tables of :mod:`dsv4_sm120.launch_tables`:

* table shape and size from the row: attention ``H=<heads>,qk=<bf16|fp8>`` (``impl`` ``ours-bf16`` /
  ``ours-fp8``) keyed by grid rows ``batch x ceil(heads / 16)``; MoE ``E=<experts>,topk=<k>,path=<path>``
  (``impl`` ``nvfp4-<path>``) keyed by tokens;
* a size counts only where every candidate measured for its shape has a row there (a sweep cut short leaves
  its last sizes out, with a note, rather than letting them be won by the candidates that happened to run);
* per shape and size, the fastest candidate whose row has a time and a relative error within the gate
  (:data:`GATE`, :data:`REL_GATE`) wins; the winner of the next smaller size keeps winning while it is within :data:`TIE` of the
  fastest, so measurement noise does not cut a table into many buckets;
* each run of sizes with one winner is written as its first and last size; the lookup takes the nearest size,
  so a boundary falls halfway between the last size of one run and the first of the next.

The output is deterministic (same rows, same bytes), so a test can check that the committed tables are what the
committed results file generates: ``python bench/results_table.py launch attention --gpu "NVIDIA H200" --check``.
Torch-free.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from . import bench_rows as R
from .. import launch_tables as LT
from .. import tolerances

SUBJECTS = ("attention", "moe")
CASE_PREFIX = "launch"
# largest relative error (vs float64) a candidate's row may show and still win, per impl; impls whose error is
# mostly their inputs' quantization pass when within REL_GATE's fraction of the smallest error among the size's
# candidates (the values and their basis: dsv4_sm120.tolerances)
GATE = tolerances.LAUNCH_SWEEP
REL_GATE = tolerances.LAUNCH_SWEEP_REL
TIE = 0.02  # the previous size's winner stays while within 2% of the fastest


class SweepError(ValueError):
    """Launch-sweep rows that cannot make a table (an incomplete or invalid candidate text, no usable rows)."""


def attention_entry(text: str) -> Dict[str, object]:
    from ..attention import config as AC

    try:
        entry = AC.parse_config(text, f"launch candidate {text!r}")
    except AC.DecodeInputError as exc:
        raise SweepError(str(exc)) from None
    impl = entry.get("impl")
    need = [k for k in AC.COMMON_KEYS + AC.BODY_KEYS.get(impl, ()) if k not in AC.OPTIONAL_ENTRY_KEYS]
    missing = [k for k in need if k not in entry]
    if impl not in AC.IMPLS or missing:
        raise SweepError(f"launch candidate {text!r} is incomplete: it must name impl and every key of its body "
                         f"({', '.join(missing) or 'impl'} missing)")
    return entry


def moe_entry(text: str) -> Dict[str, object]:
    from ..moe import config as MC

    try:
        return MC.parse_entry(text, f"launch candidate {text!r}")
    except LT.TableError as exc:
        raise SweepError(str(exc)) from None


def _shape_and_size(subject: str, row: Dict[str, str]) -> Tuple[str, int]:
    if subject == "attention":
        qk = row["impl"].split("-", 1)[1]
        heads = int(row["heads"])
        if heads not in (16, 32, 64):
            raise SweepError(f"line {row.get('_line', '?')}: a launch sweep measures 16, 32 or 64 heads (the "
                             f"table shapes), got {heads}")
        return f"H={heads},qk={qk}", int(row["batch"]) * -(-heads // 16)
    return f"E={int(row['experts'])},topk={int(row['topk'])},path={row['impl'].split('-', 1)[1]}", int(row["tokens"])


def sweep_rows(subject: str, rows: Iterable[Dict[str, str]], gpu: str) -> List[Dict[str, str]]:
    """The newest launch-sweep row per (case, impl, candidate, shape) on ``gpu``."""
    if subject not in SUBJECTS:
        raise SweepError(f"no launch tables for subject {subject!r}; subjects: {', '.join(SUBJECTS)}")
    return [r for r in R.latest_rows(rows, subject, gpu)
            if r["case"].startswith(CASE_PREFIX) and r["impl"] in GATE]


def winners(subject: str, rows: List[Dict[str, str]],
            notes: Optional[List[str]] = None) -> Dict[str, List[Tuple[int, str, float]]]:
    """shape -> [(size, winning candidate text, its us)] in size order, from :func:`sweep_rows` rows. Sizes
    where a candidate of the shape has no row are left out and named in ``notes``."""
    measured: Dict[str, Dict[int, List[Tuple[Optional[float], Optional[float], str, str]]]] = \
        defaultdict(lambda: defaultdict(list))
    parse = attention_entry if subject == "attention" else moe_entry
    for r in rows:
        parse(r["variant"])  # refuse an incomplete candidate even when it never wins
        shape, size = _shape_and_size(subject, r)
        us, err = R.number(r["us"]), R.number(r["rel_err"])
        if "error=" in r["notes"]:
            us = None
        measured[shape][size].append((us, err, r["variant"], r["impl"]))
    by: Dict[str, Dict[int, List[Tuple[float, str]]]] = defaultdict(dict)
    for shape, sizes in measured.items():
        everyone = {v for pts in sizes.values() for _, _, v, _ in pts}
        for size, pts in sizes.items():
            missing = everyone - {v for _, _, v, _ in pts}
            if missing:
                if notes is not None:
                    notes.append(f"{shape} size {size}: left out, {len(missing)} of {len(everyone)} candidates "
                                 f"have no row there (e.g. {sorted(missing)[0]})")
                continue
            errs = [e for u, e, _, _ in pts if u is not None and e is not None]
            ok = []
            for us, err, text, impl in pts:
                if us is None or err is None or not err <= GATE[impl]:
                    continue
                if impl in REL_GATE and not err <= min(errs) * (1 + REL_GATE[impl]):
                    continue
                ok.append((us, text))
            if ok:
                by[shape][size] = ok
    out = {}
    for shape in sorted(by):
        prev, seq = None, []
        for size in sorted(by[shape]):
            best_us, best = min(by[shape][size])
            kept = dict((v, u) for u, v in by[shape][size]).get(prev)
            if kept is not None and kept <= best_us * (1 + TIE):
                best, best_us = prev, kept
            seq.append((size, best, best_us))
            prev = best
        out[shape] = seq
    return out


def _entry_json(entry: Dict[str, object]) -> str:
    return json.dumps(entry, separators=(", ", ": "))


def render(subject: str, shape: str, seq: List[Tuple[int, str, float]], rows: List[Dict[str, str]], gpu: str,
           command: str) -> str:
    """The JSON text of one generated table (entries one per line, sizes in order)."""
    parse = attention_entry if subject == "attention" else moe_entry
    runs: List[Tuple[int, int, str]] = []
    for size, text, _ in seq:
        if runs and runs[-1][2] == text:
            runs[-1] = (runs[-1][0], size, text)
        else:
            runs.append((size, size, text))
    mine = [r for r in rows if _shape_and_size(subject, r)[0] == shape]
    when = sorted({(R.parse_date(r["date"]).strftime("%Y-%m-%d %H:%M"), r["commit"] or "unknown") for r in mine})
    key = "grid rows T x ceil(H/16)" if subject == "attention" else "tokens M"
    about = (f"{gpu}: keyed by {key}; each run of measured sizes with one winner as its first and last size. "
             f"Generated by `{command}` from bench/results/{subject}.csv (cases {CASE_PREFIX}*); do not edit by hand.")
    lines = ["{", f'  "_about": {json.dumps(about)},',
             f'  "_source": {json.dumps("rows of " + ", ".join(f"{d} (commit {c})" for d, c in when))},',
             f'  "_measured": {json.dumps({str(s): f"{u:.2f} us" for s, _, u in seq})},']
    entries = []
    for first, last, text in runs:
        for size in dict.fromkeys((first, last)):
            entries.append(f'  "{size}": {_entry_json(parse(text))}')
    return "\n".join(lines + [",\n".join(entries), "}"]) + "\n"


def build(subject: str, rows: Iterable[Dict[str, str]], gpu: str, command: str = "",
          notes: Optional[List[str]] = None) -> Dict[str, str]:
    """file name -> JSON text of every ``device_name=<gpu>`` table the launch-sweep rows of ``gpu`` make (sizes
    left out are named in ``notes``)."""
    sel = sweep_rows(subject, rows, gpu)
    if not sel:
        raise SweepError(f"no launch-sweep rows ({CASE_PREFIX}* cases) for GPU {gpu!r} in the {subject} results; "
                         f"run bench/bench_{subject}.py --cases launch on that GPU first")
    name = sel[0]["gpu"]
    command = command or f"python bench/results_table.py launch {subject} --gpu '{name}'"
    out = {}
    for shape, seq in winners(subject, sel, notes).items():
        fname = LT.table_path(subject, shape, LT.device_key(name), Path(".")).name
        out[fname] = render(subject, shape, seq, sel, name, command)
    if not out:
        raise SweepError(f"every launch-sweep row of GPU {gpu!r} in the {subject} results failed or missed the "
                         "error gate; no table can be made")
    return out


def write(subject: str, tables: Dict[str, str], root: Optional[Path] = None, check: bool = False) -> List[str]:
    """Write the tables under ``<root>/<subject>/`` (atomically) or, with ``check``, only compare them: the
    names of the files that were written / that differ or are missing."""
    from ..fileio import atomic_write_text

    d = Path(root or LT.TABLE_DIR) / subject
    changed = []
    for fname, text in sorted(tables.items()):
        path = d / fname
        if path.is_file() and path.read_text() == text:
            continue
        changed.append(str(path))
        if not check:
            atomic_write_text(path, text)
    return changed
