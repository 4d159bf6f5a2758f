"""The FP8 tuner's search loop: for every shape and M, check and time each candidate through a
:class:`~dsv4_sm120.fp8.search.Bench`, keep the fastest that passed, write SGLang's JSON per shape and the
summary.

Resumable: the summary records finished shapes with the fingerprint of their search, and a ``.partial`` file
next to the JSONs records the finished M values of the shape in progress; a rerun skips both (``force``
redoes them).  With a time budget the loop stops between candidates when time is up and returns
``EXIT_INCOMPLETE`` so that a rerun continues.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from dsv4_sm120 import SGLANG_VERSION, __version__
from dsv4_sm120.fileio import atomic_write_json, atomic_write_text
from dsv4_sm120.fp8_configs import (
    config_file_name,
    read_json_object,
    sglang_device_name,
    summary_file_stem,
    validate_config_table,
)
from dsv4_sm120.fp8.errors import EXIT_INCOMPLETE, CandidateError
from dsv4_sm120.fp8.progress import make_bar
from dsv4_sm120.fp8.search import Bench, candidate_configs, config_id, search_fingerprint
from dsv4_sm120.fp8.shapes import BLOCK, Shape
from dsv4_sm120.fp8.summary import compare_rows, decide_backend, summary_markdown

# Recorded in the summary's "tool" field.
TOOL_NAME = "dsv4_sm120.tune_fp8"
# Tuned tables, partial results and summaries are shared files (committed, read by the serving user).
OUT_MODE = 0o644


class Tuner:
    """Tunes ``shapes`` x ``ms`` through ``bench`` into ``out_dir``; :meth:`run` returns 0 or EXIT_INCOMPLETE.

    ``clock`` and ``log`` are injectable for tests; ``jobs`` > 0 asks the bench to compile the candidates
    in that many processes before timing."""

    def __init__(self, bench: Bench, shapes: Sequence[Shape], ms: Sequence[int], out_dir: Path, *,
                 quick: bool, force: bool = False, time_budget: Optional[float] = None,
                 jobs: int = 0, progress: bool = True, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] = lambda s: print(s, file=sys.stderr), tp: Optional[int] = None):
        self.bench, self.shapes, self.ms = bench, list(shapes), sorted(set(ms))
        self.out_dir, self.quick, self.force = Path(out_dir), quick, force
        self.clock, self.log, self.jobs, self.progress, self.tp = clock, log, jobs, progress, tp
        self.t_start = clock()
        self.deadline = None if time_budget is None else self.t_start + time_budget
        self.dev = sglang_device_name(bench.device_name_raw)
        self.summary_path = self.out_dir / (summary_file_stem(bench.device_name_raw) + ".json")
        self.summary_md_path = self.summary_path.with_suffix(".md")
        self.timed = 0

    # -- state ------------------------------------------------------------
    def fingerprint(self, shape: Shape) -> str:
        return search_fingerprint(shape, self.ms, sm90=self.bench.sm90, quick=self.quick,
                                  num_sms=self.bench.num_sms, kernel_tag=self.bench.kernel_tag)

    def partial_path(self, shape: Shape) -> Path:
        return self.out_dir / f".{config_file_name(shape.N, shape.K, self.bench.device_name_raw)}.partial"

    def load_summary(self) -> dict:
        s = read_json_object(self.summary_path)
        if not s or s.get("device_name") != self.dev or s.get("schema") != 1:
            s = {}
        s.setdefault("shapes", {})
        return s

    def _out_of_time(self) -> bool:
        return self.deadline is not None and self.clock() >= self.deadline

    # -- main loop ----------------------------------------------------------
    def run(self) -> int:
        summary = self.load_summary()
        todo = []
        for sh in self.shapes:
            rec = summary["shapes"].get(sh.key)
            json_ok = (self.out_dir / config_file_name(sh.N, sh.K, self.bench.device_name_raw)).is_file()
            if (not self.force and rec and rec.get("complete") and json_ok
                    and rec.get("fingerprint") == self.fingerprint(sh)):
                self.log(f"{sh.key}: already tuned (fingerprint {rec['fingerprint']}), skipping")
                continue
            todo.append(sh)
        total = sum(len(candidate_configs(m, s.N, s.K, sm90=self.bench.sm90, quick=self.quick,
                                          num_sms=self.bench.num_sms)) for s in todo for m in self.ms)
        if todo and self.jobs > 0:
            jobs = []
            for s in todo:
                done = set(self._load_partial(s).keys())
                for m in self.ms:
                    if str(m) in done:
                        continue
                    jobs += [(s, m, c) for c in candidate_configs(m, s.N, s.K, sm90=self.bench.sm90,
                                                                   quick=self.quick, num_sms=self.bench.num_sms)]
            self.bench.precompile(jobs, self.jobs, self.deadline, self.progress)
        bar = make_bar(total, "tuning", enabled=self.progress)
        complete = True
        try:
            for sh in todo:
                if not self._tune_shape(sh, summary, bar):
                    complete = False
                    break
        finally:
            bar.close()
        summary = self._finish_summary(summary)
        self._write_summary(summary)
        if not complete:
            self.log(f"time budget used up after {self.clock() - self.t_start:.0f}s; "
                     f"rerun the same command to continue")
            return EXIT_INCOMPLETE
        return 0

    def _load_partial(self, sh: Shape) -> Dict[str, dict]:
        p = read_json_object(self.partial_path(sh))
        if self.force or not p or p.get("fingerprint") != self.fingerprint(sh):
            return {}
        rows = p.get("rows")
        return rows if isinstance(rows, dict) else {}

    def _tune_shape(self, sh: Shape, summary: dict, bar) -> bool:
        fp = self.fingerprint(sh)
        old = summary["shapes"].get(sh.key)
        if old and old.get("complete"):   # being retuned: its old record no longer counts as done
            old["complete"] = False
        rows = self._load_partial(sh)
        t0 = self.clock()
        prev_elapsed = float((read_json_object(self.partial_path(sh)) or {}).get("elapsed_s", 0.0)) if rows else 0.0
        self.bench.setup_shape(sh, self.ms)
        try:
            for m in self.ms:
                cands = candidate_configs(m, sh.N, sh.K, sm90=self.bench.sm90, quick=self.quick,
                                          num_sms=self.bench.num_sms)
                if str(m) in rows:
                    bar.update(len(cands))
                    continue
                if self._out_of_time():
                    return False
                bar.set_description(f"{sh.key} M={m}")
                row = self._tune_m(sh, m, cands, bar)
                if row is None:
                    return False
                rows[str(m)] = row
                atomic_write_json(self.partial_path(sh), {
                    "fingerprint": fp, "device_name": self.dev, "rows": rows,
                    "elapsed_s": prev_elapsed + self.clock() - t0}, mode=OUT_MODE, indent=2)
        finally:
            self.bench.release_shape()
        table = {str(m): rows[str(m)]["best_config"] for m in self.ms if rows[str(m)].get("best_config")}
        if not table:
            raise RuntimeError(f"{sh.key}: no candidate config passed the correctness check")
        validate_config_table(table, block_k=BLOCK[1])
        name = config_file_name(sh.N, sh.K, self.bench.device_name_raw)
        atomic_write_json(self.out_dir / name, table, mode=OUT_MODE, indent=2)
        summary["shapes"][sh.key] = {
            "N": sh.N, "K": sh.K, "name": sh.name, "complete": True, "fingerprint": fp, "config_file": name,
            "elapsed_s": round(prev_elapsed + self.clock() - t0, 1), "rows": rows}
        self._write_summary(self._finish_summary(summary))
        with contextlib.suppress(OSError):
            self.partial_path(sh).unlink()
        self.log(f"{sh.key}: wrote {name}")
        return True

    def _tune_m(self, sh: Shape, m: int, cands: List[Dict], bar) -> Optional[dict]:
        self.bench.setup_m(sh, m)
        best, best_us, failures, errors = None, math.inf, 0, []
        for cfg in cands:
            if self._out_of_time():
                return None
            try:
                us = self.bench.time_config(sh, m, cfg)
                self.timed += 1
            except CandidateError as e:
                failures += 1
                if len(errors) < 3:
                    errors.append(f"{config_id(cfg)}: {e}")
                us = math.inf
            bar.update(1)
            if us < best_us:
                best, best_us = cfg, us
        row = {"best_config": best, "best_us": None if best is None else round(best_us, 3),
               "candidates": len(cands), "failed": failures}
        if errors:
            row["errors"] = errors
        try:
            row["sglang_default_cfg_us"] = round(self.bench.time_config(sh, m, None), 3)
        except CandidateError as e:
            row["sglang_default_cfg_us"] = None
            row["sglang_default_cfg_error"] = str(e)[:300]
        shipped = self.bench.shipped_config(sh, m)
        row["sglang_shipped_cfg"] = shipped
        if shipped is not None:
            try:
                row["sglang_shipped_cfg_us"] = round(self.bench.time_config(sh, m, shipped), 3)
            except CandidateError as e:
                row["sglang_shipped_cfg_us"] = None
                row["sglang_shipped_cfg_error"] = str(e)[:300]
        if best is not None:
            tl = self.bench.time_linear(sh, m, best)
            db = self.bench.time_default_backend(sh, m)
            row["triton_linear_us"] = None if tl is None else round(tl, 3)
            row["default_backend_linear_us"] = None if db is None else round(db, 3)
            if tl is not None and db is not None:
                row["winner"] = "triton" if tl < db else "default"
        return row

    # -- summary ------------------------------------------------------------
    def _finish_summary(self, summary: dict) -> dict:
        b = self.bench
        summary.update({
            "schema": 1, "device_name": self.dev, "device_name_raw": b.device_name_raw,
            "tool": f"{TOOL_NAME} {__version__}", "sglang_version": SGLANG_VERSION,
            "kernel_source": b.kernel_source, "versions": dict(b.versions),
            "mode": "quick" if self.quick else "full", "ms": list(self.ms), "tp": self.tp,
            "updated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "default_backend": dict(b.default_backend),
            "block_shape": list(BLOCK),
        })
        summary["shapes"] = dict(sorted(summary["shapes"].items(), key=lambda kv: (kv[1]["N"], kv[1]["K"])))
        summary["last_run"] = {"wall_s": round(self.clock() - self.t_start, 1), "timed_candidates": self.timed,
                               "precompile": getattr(b, "precompile_stats", None)}
        summary["tuning_elapsed_s"] = round(sum(s.get("elapsed_s", 0) for s in summary["shapes"].values()), 1)
        summary["pending_shapes"] = [sh.key for sh in self.shapes
                                     if not summary["shapes"].get(sh.key, {}).get("complete")]
        summary["comparison"] = compare_rows(summary)
        summary["decision"] = decide_backend(summary)
        return summary

    def _write_summary(self, summary: dict) -> None:
        atomic_write_json(self.summary_path, summary, mode=OUT_MODE, indent=2)
        atomic_write_text(self.summary_md_path, summary_markdown(summary), mode=OUT_MODE)

