"""FP8 block GEMM: our tuned Triton configs vs SGLang's default FP8 backend, as ``make tune-fp8`` measures it.

Runs the tuner as a subprocess (``python -m dsv4_sm120.tune_fp8 --quick --tp <TP> --out-dir <configs/fp8>``;
resumable, it skips shapes already tuned with the same search) and turns its summary JSON into decision
``fp8_gemm`` over token counts M: per M the candidates ``triton`` (the tuned Triton linear, activation
quantization included) and ``default`` (SGLang's default backend for the device: CUTLASS on sm_120), each the
sum over the deployment's dense shapes of the tuner's µs. The tuner gates every config against its own
reference before timing it, so ``err`` is not repeated here. ``overall`` keeps the tuner's server-wide
recommendation (``--fp8-gemm-backend`` is one flag per server, what ``fp8_configs`` already serves with).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

from ..paths import OVERLAY_DIR
from .candidates import Outcome

CANDIDATES = ("triton", "default")


def summary_path(out_dir: Path, gpu: str) -> Path:
    from dsv4_sm120.fp8_configs import summary_file_stem

    return Path(out_dir) / (summary_file_stem(gpu) + ".json")


def tuner_command(tp: int, out_dir: Path, quick: bool) -> List[str]:
    return [sys.executable, "-m", "dsv4_sm120.tune_fp8", "--tp", str(tp), "--out-dir", str(out_dir),
            "--no-progress"] + (["--quick"] if quick else [])


def run_tuner(tp: int, out_dir: Path, quick: bool, progress=None) -> Optional[str]:
    """Run the tuner; None on success, else the reason (its last stderr line)."""
    env = dict(os.environ)
    overlay = str(OVERLAY_DIR)
    env["PYTHONPATH"] = os.pathsep.join([overlay] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = tuner_command(tp, out_dir, quick)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    except subprocess.TimeoutExpired:
        return "tune_fp8 ran past one hour"
    if progress:
        progress.step(f"fp8: tune_fp8 exited {r.returncode}")
    if r.returncode not in (0,):
        tail = [x for x in r.stderr.strip().splitlines() if x.strip()][-1:] or [f"exit code {r.returncode}"]
        return f"tune_fp8 exit {r.returncode}: {tail[0][:300]}"
    return None


def from_summary(summary: dict) -> dict:
    """Decision entry (``buckets`` + ``overall``) from a tuner summary; M values where a candidate has no
    time for some shape mark it failed with the shapes named."""
    shapes = {k: s for k, s in (summary.get("shapes") or {}).items() if s.get("complete")}
    ms = sorted({int(m) for s in shapes.values() for m in (s.get("rows") or {})})
    db = summary.get("default_backend") or {}
    buckets = {}
    for m in ms:
        row = {}
        for cand, key in (("triton", "triton_linear_us"), ("default", "default_backend_linear_us")):
            vals, missing = [], []
            for name, s in shapes.items():
                v = (s.get("rows") or {}).get(str(m), {}).get(key)
                (vals if isinstance(v, (int, float)) else missing).append(v if isinstance(v, (int, float)) else name)
            if cand == "default" and not db.get("available", True):
                row[cand] = Outcome("unavailable", reason=f"default backend {db.get('name')}: {db.get('reason')}")
            elif missing:
                row[cand] = Outcome("failed", reason=f"no time for {', '.join(sorted(missing))}")
            else:
                row[cand] = Outcome("ok", us=sum(vals), reason=f"sum over {len(vals)} shapes", timing="graph")
        ok = [(o.us, n) for n, o in row.items() if o.status == "ok"]
        buckets[str(m)] = {"winner": min(ok)[1] if ok else None,
                           "candidates": {n: o.to_json() for n, o in row.items()}}
    dec = summary.get("decision") or {}
    return {"buckets": buckets, "reference_only": [],
            "overall": {"recommended_backend": dec.get("recommended_backend") or "default",
                        "reason": dec.get("reason", "")},
            "note": f"default backend: {db.get('name', 'unknown')}; tuner mode {summary.get('mode')}"}


def unavailable(reason: str, buckets: List[int]) -> dict:
    return {"buckets": {str(b): {"winner": None, "candidates": {c: Outcome("unavailable", reason=reason).to_json()
                                                                 for c in CANDIDATES}} for b in buckets},
            "reference_only": []}


def calibrate(tp: int, gpu: str, out_dir: Path, quick: bool, device: str, progress=None,
              buckets: Optional[List[int]] = None) -> dict:
    buckets = buckets or [1, 4, 16, 64, 256]
    if not device.startswith("cuda"):
        return unavailable("FP8 GEMM timing needs a CUDA GPU (the tuner's interpreter mode is its own test)", buckets)
    why = run_tuner(tp, out_dir, quick, progress)
    path = summary_path(out_dir, gpu)
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return unavailable(why or f"no tuner summary {path}: {e}", buckets)
    entry = from_summary(summary)
    if why:
        entry["note"] = f"{entry.get('note', '')}; tuner: {why}"
    return entry
