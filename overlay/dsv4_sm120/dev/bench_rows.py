"""The rows of a benchmark results file as every reader selects them: the subjects' shape fields, the row
date, the newest row per point (:func:`latest_rows`) and the numeric cells. :mod:`dsv4_sm120.dev.bench_results`
reads and writes the files; :mod:`dsv4_sm120.dev.launch_sweep` makes launch tables of their rows.
"""

from __future__ import annotations

import datetime
from typing import Dict, Iterable, List, Optional

SHAPE_FIELDS = {
    "attention": ("layout", "heads", "batch", "context"),
    "moe": ("tokens", "hidden", "inter", "experts", "topk", "routing"),
    "fp8": ("n", "k", "m"),
    # prompt tokens, bytes one TP rank's KV pages of that prompt take, descriptors (pages) moved, GPU pair
    "kv": ("prompt", "bytes", "descs", "src", "dst"),
    # TP size, the group's GPUs, hidden size, dtype, rows reduced, bytes per rank (rows x hidden x element size)
    "allreduce": ("tp", "gpus", "hidden", "dtype", "rows", "bytes"),
}


def parse_date(text: str) -> datetime.datetime:
    d = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    return d if d.tzinfo else d.replace(tzinfo=datetime.timezone.utc)


def norm_gpu(name: str) -> str:
    return " ".join(name.replace("_", " ").lower().split())


def latest_rows(rows: Iterable[Dict[str, str]], subject: str, gpu: Optional[str] = None) -> List[Dict[str, str]]:
    """The newest row per (case, impl, variant, shape fields) on ``gpu`` (spaces and underscores alike, any
    case; None = every GPU, then the GPU is part of the key). Newest = latest ``date``, then the later line."""
    key_fields = ["case", "impl", "variant", *SHAPE_FIELDS[subject]] + ([] if gpu else ["gpu"])
    best: Dict[tuple, Dict[str, str]] = {}
    for r in rows:
        if gpu and norm_gpu(r["gpu"]) != norm_gpu(gpu):
            continue
        k = tuple(r[f] for f in key_fields)
        if k not in best or (parse_date(r["date"]), r.get("_line", 0)) >= (
                parse_date(best[k]["date"]), best[k].get("_line", 0)):
            best[k] = r
    return list(best.values())


def number(text: str) -> Optional[float]:
    return float(text) if text else None
