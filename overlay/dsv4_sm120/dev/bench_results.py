"""Benchmark results files: one CSV per subject (``bench/results/attention.csv``, ``moe.csv``, ``fp8.csv``, ``kv.csv``,
``allreduce.csv``).

Every benchmark run appends one row per measured point; nothing is ever rewritten. The committed tables
(``bench/results/<subject>_<gpu>.md``) are generated from these files: :func:`latest_rows` keeps the newest row
per (case, impl, variant, shape) and :func:`render_table` prints them. Columns: ``subject, case, variant, impl``,
the subject's shape fields (:data:`SHAPE_FIELDS`), then ``gpu, torch, triton, cuda, driver, commit, date, command,
us, gbps, rel_err, notes`` (``rel_err``: relative Frobenius error against a float64 reference; ``notes``: ``;``-
separated ``key=value`` extras such as a failure message).

Appending is safe from several processes at once: each call takes an exclusive ``flock`` on the file, writes the
header only when the file is empty, and writes all its lines with one ``write``.

``python -m dsv4_sm120.dev.bench_results table attention --results bench/results/attention.csv --gpu "NVIDIA H200"``
prints a table; ``check FILE`` validates a file; ``launch attention|moe`` generates a GPU's launch tables from
the file's launch-sweep rows (:mod:`dsv4_sm120.dev.launch_sweep`).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

from dsv4_sm120.dev.bench_rows import SHAPE_FIELDS, latest_rows, number, parse_date
from dsv4_sm120.fileio import atomic_write_text

HEAD = ("subject", "case", "variant", "impl")
TAIL = ("gpu", "torch", "triton", "cuda", "driver", "commit", "date", "command", "us", "gbps", "rel_err", "notes")
NUMERIC = ("us", "gbps", "rel_err")
# the shape field that becomes the table's columns
# shape fields that follow from the others (the kv bytes and descriptors of a prompt length): recorded, not
# a table of their own
DERIVED = {"kv": ("bytes", "descs"), "allreduce": ("bytes",)}
X_FIELD = {"attention": "batch", "moe": "tokens", "fp8": "m", "kv": "prompt", "allreduce": "rows"}
X_LABEL = {"attention": "B", "moe": "M", "fp8": "M", "kv": "N", "allreduce": "rows"}
# (numerator impl, denominator impl, label) of each ratio row printed under a table where both are measured: the
# attention baseline is FlashMLA on sm_90 / sm_100 and FlashInfer on sm_120 (neither runs on the other's GPUs)
RATIO = {"attention": (("ours-bf16", "flashmla", "ours-bf16 / flashmla"),
                       ("ours-bf16", "flashinfer", "ours-bf16 / flashinfer")),
         "moe": (("nvfp4-bf16", "fp8-baseline", "nvfp4-bf16 / fp8-baseline"),),
         "fp8": (("triton-sglang-default-cfg", "triton-tuned", "speedup (default cfg / tuned)"),),
         "kv": (("nixl-ucx", "memcpy-peer", "nixl-ucx / memcpy-peer"),),
         "allreduce": (("pcie_ipc", "nccl", "pcie_ipc / nccl"),
                       ("pcie_ipc", "nccl_LL_Ring", "pcie_ipc / nccl_LL_Ring"))}
# impls listed first (in this order) in a table; others follow by name
IMPL_ORDER = {"attention": ("ours-bf16", "ours-fp8", "flashmla", "flashinfer", "upstream-triton", "torch-eager"),
              "moe": ("nvfp4-bf16", "nvfp4-fp4", "fp8-baseline", "bf16-baseline"),
              "fp8": ("triton-tuned", "triton-sglang-default-cfg", "triton-sglang-shipped-cfg"),
              "kv": ("nixl-ucx", "memcpy-peer"),
              "allreduce": ("pcie_ipc", "nccl", "nccl_LL", "nccl_LL128", "nccl_Simple", "nccl_LL_Ring")}
TITLE = {"attention": "Sparse MLA decode", "moe": "NVFP4 fused MoE", "fp8": "FP8 block GEMM (SGLang's Triton kernel)",
         "kv": "PD KV transfer (one TP4 rank's DSv4 pages, NIXL/UCX vs a plain peer copy)",
         "allreduce": "TP all-reduce per server (FlashInfer PCIe-IPC vs NCCL protocols), bf16 rows x hidden"}
DEFAULT_VARIANT = "default"


class ResultsError(ValueError):
    """A results file or row is malformed (the message names the file and line)."""


def columns(subject: str) -> List[str]:
    if subject not in SHAPE_FIELDS:
        raise ResultsError(f"unknown subject {subject!r}; known: {', '.join(SHAPE_FIELDS)}")
    return [*HEAD, *SHAPE_FIELDS[subject], *TAIL]


def _clean(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        value = f"{value:.6g}" if abs(value) < 1e-2 else repr(round(value, 4))
    return " ".join(str(value).split())  # one row = one line: no newlines inside a field


def make_row(subject: str, **fields) -> Dict[str, str]:
    """A complete row of ``subject`` from keyword fields (missing ones empty, ``variant`` ``default``).
    Unknown field names, a missing case / impl, or a non-numeric us / gbps / rel_err raise :class:`ResultsError`."""
    cols = columns(subject)
    unknown = sorted(set(fields) - set(cols))
    if unknown:
        raise ResultsError(f"{subject} row: unknown field(s) {', '.join(unknown)}; columns are {', '.join(cols)}")
    row = {c: _clean(fields.get(c)) for c in cols}
    row["subject"] = subject
    row["variant"] = row["variant"] or DEFAULT_VARIANT
    for c in ("case", "impl", "date"):
        if not row[c]:
            raise ResultsError(f"{subject} row: {c} is empty")
    _check_values(row, f"{subject} row")
    return row


def _check_values(row: Dict[str, str], where: str) -> None:
    for c in NUMERIC:
        if row[c]:
            try:
                float(row[c])
            except ValueError:
                raise ResultsError(f"{where}: {c} must be a number or empty, got {row[c]!r}") from None
    try:
        parse_date(row["date"])
    except ValueError:
        raise ResultsError(f"{where}: date must be ISO 8601 (e.g. 2026-11-30T07:43:21+00:00), "
                           f"got {row['date']!r}") from None


def _line(values: Sequence[str]) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(values)
    return buf.getvalue()


def csv_line(subject: str, row: Dict[str, str]) -> str:
    """One row as the results file would hold it (no newline)."""
    return _line([row.get(c, "") for c in columns(subject)]).rstrip("\n")


def user_results(subject: str) -> Path:
    """Where a bench driver appends its rows by default: ``DSV4_SM120_CACHE/bench/<subject>.csv``, outside the
    tracked tree. The project's own recorded rows (``bench/results/<subject>.csv``) are written by passing them
    (``--results bench/results/<subject>.csv``, ``make bench-<subject> BENCH_OUT=bench/results``)."""
    from dsv4_sm120 import settings

    return Path(settings.get("DSV4_SM120_CACHE")) / "bench" / f"{subject}.csv"


def append_rows(path, subject: str, rows: Iterable[Dict[str, object]]) -> int:
    """Append ``rows`` (dicts of :func:`make_row` fields) to the results file ``path``, creating it (with its
    header) if needed; returns the number of rows written. A file whose header is not ``subject``'s raises
    :class:`ResultsError` and is left untouched."""
    cols = columns(subject)
    done = [r if set(r) == set(cols) and r.get("subject") == subject else make_row(
        subject, **{k: v for k, v in r.items() if k != "subject"}) for r in rows]
    for r in done:
        _check_values(r, f"{subject} row")
    body = "".join(_line([r[c] for c in cols]) for r in done)
    if not body:
        return 0
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if size == 0:
            data = _line(cols) + body
        else:
            head = os.pread(fd, min(size, 4096), 0).decode("utf-8", "replace").split("\n", 1)[0]
            if next(csv.reader([head]), []) != cols:
                raise ResultsError(f"{path}: header is not the {subject} header ({','.join(cols)}); "
                                   "append to the right subject's file or move this one away")
            # a line cut short by a crash must not swallow the first new row
            data = ("\n" if os.pread(fd, 1, size - 1) != b"\n" else "") + body
        raw = data.encode()
        while raw:
            raw = raw[os.write(fd, raw):]
    finally:
        os.close(fd)  # releases the lock
    return len(done)


def read_rows(path, subject: Optional[str] = None) -> List[Dict[str, str]]:
    """All rows of a results file, each with ``_line`` (its line number). The subject is ``subject`` or the
    file's own; a wrong header, a row with the wrong number of fields, a wrong subject, a non-numeric us / gbps
    / rel_err or an unreadable date raise :class:`ResultsError` naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ResultsError(f"{path}: no such results file (run the subject's benchmark to create it)")
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines:
        return []
    header = next(csv.reader([lines[0]]), [])
    if subject is None:
        subject = next((s for s in SHAPE_FIELDS if header == columns(s)), None)
        if subject is None:
            raise ResultsError(f"{path}:1: not a results header: {lines[0][:120]!r}")
    cols = columns(subject)
    if header != cols:
        raise ResultsError(f"{path}:1: header is not the {subject} header ({','.join(cols)})")
    out = []
    for n, text in enumerate(lines[1:], start=2):
        if not text.strip():
            continue
        vals = next(csv.reader([text]), [])
        where = f"{path}:{n}"
        if len(vals) != len(cols):
            raise ResultsError(f"{where}: expected {len(cols)} fields, got {len(vals)}; fix or delete that line")
        row = dict(zip(cols, vals))
        if row["subject"] != subject:
            raise ResultsError(f"{where}: subject {row['subject']!r} in the {subject} file")
        _check_values(row, where)
        row["_line"] = n
        out.append(row)
    return out


def gpus(rows: Iterable[Dict[str, str]]) -> List[str]:
    return sorted({r["gpu"] for r in rows if r["gpu"]})


def _sort_key(v: str):
    try:
        return (0, float(v), "")
    except ValueError:
        return (1, 0.0, v)


def _cell(r: Optional[Dict[str, str]], newest=None) -> str:
    if r is None:
        return "-"
    if newest is not None and parse_date(r["date"]) < newest:
        return _cell(r) + " *"
    us, gbps, err = number(r["us"]), number(r["gbps"]), number(r["rel_err"])
    if us is None:
        if "error=" in r["notes"]:
            return "failed"
        return f"err {err:.1e}" if err is not None else "-"
    extra = [(f"{gbps:.0f} GB/s" if gbps >= 10 else f"{gbps:.2g} GB/s") if gbps is not None else "", f"{err:.1e}" if err is not None else ""]
    extra = [e for e in extra if e]
    return f"{us:.1f}" + (f" ({', '.join(extra)})" if extra else "")


def _when(rs: List[Dict[str, str]]) -> str:
    ds = sorted({parse_date(r["date"]).strftime("%Y-%m-%d %H:%M") for r in rs})
    return ds[0] if len(ds) == 1 else f"{ds[0]} .. {ds[-1]}"


def render_table(subject: str, rows: List[Dict[str, str]], gpu: str, all_variants: bool = False,
                 command: str = "") -> str:
    """Markdown of the latest rows of ``subject`` on ``gpu``: one table per case and shape (columns: the batch /
    token count), a row per (impl, variant), cells ``us (GB/s, rel_err)``. Variant rows are shown when they are at
    least as new as the newest default row of their table (measured with the current defaults), or all of them
    with ``all_variants``."""
    sel = latest_rows(rows, subject, gpu)
    if not sel:
        raise ResultsError(f"no {subject} rows for GPU {gpu!r}; GPUs in the file: {', '.join(gpus(rows)) or 'none'}")
    x = X_FIELD[subject]
    others = [f for f in SHAPE_FIELDS[subject] if f != x and f not in DERIVED.get(subject, ())]
    case_order = list(dict.fromkeys(r["case"] for r in sorted(sel, key=lambda r: r.get("_line", 0))))
    out = [f"# {TITLE[subject]}: {sel[0]['gpu']}", "",
           f"Generated{f' by `{command}`' if command else ''} from `bench/results/{subject}.csv`: the latest row per "
           "(case, impl, variant, shape); do not edit by hand. Cells: us per call (GB/s, rel. error vs float64). "
           "`measured`: when the row's run started (UTC). Each row's command is in the results file.", ""]
    for case in case_order:
        in_case = [r for r in sel if r["case"] == case]
        for shape in sorted({tuple(r[f] for f in others) for r in in_case}, key=lambda t: [_sort_key(v) for v in t]):
            rs = [r for r in in_case if tuple(r[f] for f in others) == shape]
            defaults = [r for r in rs if r["variant"] == DEFAULT_VARIANT]
            newest = max((parse_date(r["date"]) for r in defaults), default=None)
            if not all_variants and newest is not None:
                keep = {(r["impl"], r["variant"]) for r in rs
                        if r["variant"] == DEFAULT_VARIANT or parse_date(r["date"]) >= newest}
                rs = [r for r in rs if (r["impl"], r["variant"]) in keep]
            xs = sorted({r[x] for r in rs}, key=_sort_key)
            order = IMPL_ORDER[subject]
            lines = sorted({(r["impl"], r["variant"]) for r in rs}, key=lambda iv: (
                iv[1] != DEFAULT_VARIANT, order.index(iv[0]) if iv[0] in order else len(order), iv[0],
                min(r.get("_line", 0) for r in rs if (r["impl"], r["variant"]) == iv)))
            desc = ", ".join(f"{f} {v}" for f, v in zip(others, shape) if v)
            out += [f"## {case}" + (f": {desc}" if desc else ""), "",
                    "| impl | variant | " + " | ".join(f"{X_LABEL[subject]}={v}" for v in xs) + " | measured |",
                    "| --- | --- | " + " | ".join("---:" for _ in xs) + " | --- |"]
            for impl, variant in lines:
                mine = [r for r in rs if r["impl"] == impl and r["variant"] == variant]
                by_x = {r[x]: r for r in mine}
                out.append(f"| {impl} | {variant} | " + " | ".join(_cell(by_x.get(v), newest) for v in xs)
                           + f" | {_when(mine)} |")
            for num, den, label in RATIO[subject]:
                a = {r[x]: number(r["us"]) for r in rs if r["impl"] == num and r["variant"] == DEFAULT_VARIANT}
                b = {r[x]: number(r["us"]) for r in rs if r["impl"] == den and r["variant"] == DEFAULT_VARIANT}
                if any(a.get(v) and b.get(v) for v in xs):
                    out.append(f"| {label} | default | " + " | ".join(
                        f"{a[v] / b[v]:.2f}" if a.get(v) and b.get(v) else "-" for v in xs) + " | |")
            out.append("")
            remarks = sorted({n.strip()[5:] for r in rs for n in r["notes"].split(";")
                              if n.strip().startswith("note=")})
            if any(newest is not None and parse_date(r["date"]) < newest for r in rs):
                remarks.insert(0, "`*`: from a run older than the newest default rows of this table (the code may "
                                  "have changed since)")
            out += [f"- {n}" for n in remarks] + ([""] if remarks else [])
    runs = sorted({(parse_date(r["date"]).strftime("%Y-%m-%d %H:%M"), r["commit"], r["torch"], r["triton"],
                    r["cuda"], r["driver"]) for r in sel})
    out += ["Versions per run (date UTC, commit, torch, triton, CUDA, driver):", ""]
    out += [f"- {d}: commit {c or 'unknown'}, torch {t or '?'}, triton {tr or '?'}, CUDA {cu or '?'}, "
            f"driver {dr or '?'}" for d, c, t, tr, cu, dr in runs]
    return "\n".join(out) + "\n"


def best_variants(rows: List[Dict[str, str]]) -> List[str]:
    """Closing lines of an attention run: per (case, ours impl) the fastest of the default and its variants at each
    B, and the DSV4_SM120_ATTN_CONFIG line that picks a variant which is never slower than the default by more
    than 2% and faster by more than 3% somewhere (so the user's box can adopt what won there)."""
    ours = [r for r in rows if r["impl"].startswith("ours-") and r["us"] not in ("", None)]
    lines = []
    for case, impl in sorted({(r["case"], r["impl"]) for r in ours}):
        sel = [r for r in ours if r["case"] == case and r["impl"] == impl]
        variants = sorted({r["variant"] for r in sel} - {"default"})
        if not variants:
            continue
        bs = sorted({int(r["batch"]) for r in sel})
        us = {(r["variant"], int(r["batch"])): float(r["us"]) for r in sel}
        cells, candidates = [], []
        for b in bs:
            name, t = min(((v, us[(v, b)]) for v in ["default"] + variants if (v, b) in us), key=lambda x: x[1])
            ref = us.get(("default", b))
            cells.append(f"B={b}: {name} {t:.1f} us" + (f" ({ref / t:.2f}x)" if ref else ""))
        for v in variants:
            if all((v, b) in us and ("default", b) in us for b in bs):
                ratios = [us[("default", b)] / us[(v, b)] for b in bs]
                if min(ratios) >= 0.98 and max(ratios) > 1.03:
                    candidates.append((sum(ratios) / len(ratios), v))
        lines.append(f"Best of {impl} at {case}: " + "; ".join(cells) + ".")
        if candidates:
            gain, v = max(candidates)
            qk = " DSV4_SM120_ATTN_QK=fp8" if impl == "ours-fp8" else ""
            lines.append(f"Variant never >2% slower and >3% faster somewhere (mean {gain:.2f}x): "
                         f"`DSV4_SM120_ATTN_CONFIG='{v}'{qk}` (serve scripts pass the environment through).")
        else:
            lines.append("No variant beats the default across these batch sizes: keep the default.")
    return lines


# -- the environment a driver records ---------------------------------------------------------------------------

def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


COMMIT_ENV = "DSV4_SM120_COMMIT"   # the commit a run records where the checkout's .git is not the tree's own


def _commit_override() -> Optional[str]:
    # DSV4_SM120_COMMIT's value; None when unset or empty; SettingsError when not a commit id
    from dsv4_sm120 import settings

    return (settings.get(COMMIT_ENV) or "").strip() or None


def commit_env_error(prog: str) -> Optional[str]:
    """The one-line error a driver stops with when ``DSV4_SM120_COMMIT`` is set but is not a commit id."""
    from dsv4_sm120 import settings

    try:
        _commit_override()
    except settings.SettingsError as e:
        return f"{prog}: error: {e}"
    return None


def git_commit(repo) -> str:
    """``DSV4_SM120_COMMIT`` where set (a valid id), else the short HEAD of ``repo`` with ``-dirty`` when tracked
    files differ from it; ``unknown`` outside git."""
    try:
        value = _commit_override()
    except ValueError:
        value = None   # drivers stop on it first (commit_env_error)
    if value:
        return value
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(repo, command: str) -> Dict[str, str]:
    """gpu, torch, triton, cuda, driver, commit, date and command fields for the rows of one run."""
    env = {"gpu": "", "torch": "", "triton": "", "cuda": "", "driver": "", "commit": git_commit(repo),
           "date": now(), "command": command}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda or ""
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        env["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        pass
    return env


def missing_gpu(prog: str, modules: Sequence[str] = ("torch", "triton")) -> Optional[str]:
    """The one-line error a driver stops with when it cannot measure here (a module of ``modules`` not
    installed, or no CUDA GPU visible to torch) or would record a bad commit (``commit_env_error``); ``None`` when
    it can."""
    import importlib

    from dsv4_sm120 import hints

    bad = commit_env_error(prog)
    if bad:
        return bad
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            return (f"{prog}: error: {name} is not installed; this benchmark needs {', '.join(modules)} and a CUDA "
                    f"GPU ({hints.args('--dry-run')} lists the rows without them)")
    import torch

    if not torch.cuda.is_available():
        return (f"{prog}: error: no CUDA GPU visible; nothing to measure ({hints.args('--dry-run')} lists the rows "
                "without one)")
    return None


def gpu_slug(gpu: str) -> str:
    """``NVIDIA H200`` -> ``h200`` (the committed tables' file-name part)."""
    s = re.sub(r"^nvidia\s+", "", gpu.strip().replace("_", " "), flags=re.I)
    return re.sub(r"[^a-z0-9]+", "_", s.lower()).strip("_") or "gpu"


def _subject_rows(a, results_dir: Optional[Path], what: str, keep=lambda r: True):
    """``(path, rows, gpu)`` of a ``table`` / ``launch`` command: the subject's results file (``--results``, else
    ``<results_dir>/<subject>.csv``), its rows, and ``--gpu`` or else the one GPU among the rows ``keep`` accepts
    (``what`` names them in the error when there is not exactly one)."""
    path = a.results or ((results_dir / f"{a.subject}.csv") if results_dir else None)
    if path is None:
        raise ResultsError("--results FILE is needed")
    rows = read_rows(path, a.subject)
    gpu = a.gpu
    if not gpu:
        found = gpus(r for r in rows if keep(r))
        if len(found) != 1:
            raise ResultsError(f"{path} holds {what} of {len(found)} GPUs ({', '.join(found) or 'none'}); "
                               "pick one with --gpu")
        gpu = found[0]
    return path, rows, gpu


def _launch(a, results_dir: Optional[Path]) -> int:
    from dsv4_sm120.dev import launch_sweep as S

    path, rows, gpu = _subject_rows(a, results_dir, "launch-sweep rows",
                                    lambda r: r["case"].startswith(S.CASE_PREFIX))
    notes: List[str] = []
    try:
        tables = S.build(a.subject, rows, gpu, notes=notes)
    except S.SweepError as exc:
        raise ResultsError(f"{path}: {exc}") from None
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    changed = S.write(a.subject, tables, a.tables, check=a.check)
    for f in changed:
        print(f"{'differs' if a.check else 'wrote'} {f}")
    print(f"{len(tables)} {a.subject} launch tables for {gpu}: {len(changed)} "
          f"{'differ from the rows' if a.check else 'written'}, {len(tables) - len(changed)} already up to date")
    if a.check and changed:
        print(f"regenerate with: python bench/results_table.py launch {a.subject} --gpu '{gpu}'", file=sys.stderr)
        return 1
    return 0


def _table(a, results_dir: Optional[Path], gpu: Optional[str], out: Optional[str]) -> None:
    """Render one GPU's table of ``a.subject`` (``gpu`` None: the file's only GPU) to ``out`` (None: the results
    dir's ``<subject>_<gpu>.md``, else stdout; ``-``: stdout)."""
    path, rows, gpu = _subject_rows(argparse.Namespace(results=a.results, subject=a.subject, gpu=gpu),
                                    results_dir, "rows")
    cmd = (f"python bench/results_table.py table {a.subject} --gpu '{gpu}'"
           + (" --all-variants" if a.all_variants else ""))
    text = render_table(a.subject, rows, gpu, all_variants=a.all_variants, command=cmd)
    out = out or (str(results_dir / f"{a.subject}_{gpu_slug(gpu)}.md") if results_dir else "-")
    if out == "-":
        sys.stdout.write(text)
    else:
        atomic_write_text(out, text)
        print(f"wrote {out}")


def main(argv=None, results_dir: Optional[Path] = None, prog: Optional[str] = None) -> int:
    """``table SUBJECT`` / ``check FILE``. ``results_dir``: where ``<subject>.csv`` and the generated tables live
    by default (the bench/ wrapper passes the repository's bench/results)."""
    p = argparse.ArgumentParser(prog=prog, description="Generate a committed table from a benchmark results "
                                "file, or validate a results file.")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="print / write the table of one subject's latest rows on one GPU")
    t.add_argument("subject", choices=sorted(SHAPE_FIELDS))
    t.add_argument("--results", type=Path, help="results file (default: <results dir>/<subject>.csv)")
    t.add_argument("--gpu", help="GPU name as recorded, spaces or underscores (default: the file's only GPU)")
    t.add_argument("--out", help="write the table here (default: <results dir>/<subject>_<gpu>.md when a results "
                   "dir is known, else stdout; '-' = stdout)")
    t.add_argument("--all-variants", action="store_true", help="also variant rows older than the newest defaults")
    c = sub.add_parser("check", help="validate a results file (header, field counts, numbers, dates)")
    c.add_argument("file", type=Path)
    g = sub.add_parser("launch", help="generate one GPU's launch tables (dsv4_sm120/launch_tables/<subject>/) from "
                       "the launch-sweep rows of a results file (dsv4_sm120.dev.launch_sweep)")
    g.add_argument("subject", choices=("attention", "moe"))
    g.add_argument("--results", type=Path, help="results file (default: <results dir>/<subject>.csv)")
    g.add_argument("--gpu", help="GPU name as recorded (default: the only GPU with launch-sweep rows)")
    g.add_argument("--tables", type=Path, help="launch tables root (default: the package's launch_tables/)")
    g.add_argument("--check", action="store_true", help="write nothing; exit 1 when a table differs from what the "
                   "rows generate")
    a = p.parse_args(argv)
    try:
        if a.cmd == "launch":
            return _launch(a, results_dir)
        if a.cmd == "check":
            rows = read_rows(a.file)
            print(f"{a.file}: {len(rows)} rows, GPUs: {', '.join(gpus(rows)) or 'none'}")
            return 0
        if not a.gpu and not a.out and results_dir:   # the committed tables: one per GPU the file holds
            path = a.results or results_dir / f"{a.subject}.csv"
            found = gpus(read_rows(path, a.subject))
            if len(found) > 1:
                for gpu in found:
                    _table(a, results_dir, gpu, None)
                return 0
        _table(a, results_dir, a.gpu, a.out)
        return 0
    except ResultsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
