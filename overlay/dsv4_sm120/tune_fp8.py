"""Tune SGLang's Triton block-FP8 GEMM (``w8a8_block_fp8_matmul``) for the DeepSeek-V4-Flash dense shapes.

Usage::

    python -m dsv4_sm120.tune_fp8 [--tp 4] [--quick] [--dry-run] [--out-dir configs/fp8] ...

For every weight shape (N, K) and token count M it runs SGLang's own Triton
launcher (``sglang.kernels.ops.gemm.fp8_kernel.w8a8_block_fp8_matmul_triton``)
with each candidate tile config, checks the result against an fp32 reference
on fresh random data (output poisoned with NaN before each check), times the
survivors with CUDA-graph replay over rotating weight copies (so weights come
from HBM, as in a real forward pass, not from L2), and writes one JSON per shape
under the exact file name SGLang 0.5.23 looks up for this device.

It also times, per shape and M:

* SGLang's own default Triton config (what it uses when no JSON exists),
* the JSON SGLang ships for this device and shape, if any,
* SGLang's default FP8 GEMM backend for the device (CUTLASS on sm_120,
  DeepGEMM on sm_90 when available) against the Triton linear with the tuned
  config, both end to end (activation quantization included) -- only where the
  full SGLang package imports;

and writes ``summary_<device>.json`` / ``.md`` with the winner and a
recommendation that :func:`dsv4_sm120.fp8_configs.recommended_fp8_gemm_backend`
reads for the serve scripts.

Resumable: the summary records finished shapes (with a fingerprint of the
search), and a ``.partial`` file records finished M values of the shape in
progress; rerunning skips what is done (``--force`` redoes it).  With
``--time-budget`` it stops cleanly when time is up (exit code 3) so that a
rerun continues.

Where SGLang itself cannot be imported (another torch), ``--sglang-wheel``
loads only ``fp8_kernel.py`` (and SGLang's shipped configs) from the pinned
wheel, with its few SGLang imports stubbed; the default backend is then
reported as not timed.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import importlib
import importlib.util
import json
import math
import os
import platform
import sys
import tempfile
import time
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from dsv4_sm120 import SGLANG_VERSION, __version__
from dsv4_sm120.fp8_configs import (
    config_file_name,
    sglang_device_name,
    summary_file_stem,
    validate_config_table,
)

DEFAULT_MS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096)
BLOCK = (128, 128)
DECODE_MAX_M = 64        # "decode" range for the tuned-vs-default table and the backend decision
PREFILL_MIN_M = 256
EXIT_INCOMPLETE = 3

# DeepSeek-V4-Flash dense FP8 GEMMs, (name, N, K) at TP=4 and how each is split across TP ranks:
# "col" = output dim N split, "row" = input dim K split, "rep" = replicated.
_SHAPES_TP4 = (
    ("fused wqkv_a", 1536, 4096, "rep"),
    ("wq_b / indexer wq_b", 8192, 1024, "col"),
    ("wo_b", 4096, 2048, "row"),
    ("shared expert gate_up", 1024, 4096, "col"),
    ("shared expert down", 4096, 512, "row"),
    ("MTP e/h proj", 4096, 4096, "rep"),
)


class UsageError(Exception):
    """Bad input: one line for the user, exit code 2."""


class CandidateError(Exception):
    """A candidate config failed (compile error, launch error, wrong result)."""


@dataclass(frozen=True)
class Shape:
    N: int
    K: int
    name: str = ""

    @property
    def key(self) -> str:
        return f"N={self.N},K={self.K}"


def shapes_for_tp(tp: int) -> List[Shape]:
    if tp <= 0 or 4 % tp and tp % 4:
        raise UsageError(f"--tp {tp}: expected 1, 2, 4 or 8")
    out: List[Shape] = []
    for name, n, k, split in _SHAPES_TP4:
        if split == "col":
            n = n * 4 // tp
        elif split == "row":
            k = k * 4 // tp
        if n % BLOCK[0] or k % BLOCK[1]:
            raise UsageError(f"--tp {tp}: {name} would be ({n}, {k}), not a multiple of the 128x128 block")
        out.append(Shape(n, k, name))
    # de-duplicate, keep order
    seen, uniq = set(), []
    for s in out:
        if (s.N, s.K) not in seen:
            seen.add((s.N, s.K))
            uniq.append(s)
    return uniq


def parse_shapes(text: str) -> List[Shape]:
    out = []
    for part in text.replace(" ", "").split(";"):
        if not part:
            continue
        try:
            n, k = (int(x) for x in part.split(","))
        except ValueError:
            raise UsageError(f"--shapes: {part!r} is not N,K") from None
        if n <= 0 or k <= 0 or n % BLOCK[0] or k % BLOCK[1]:
            raise UsageError(f"--shapes: ({n}, {k}) must be positive multiples of 128")
        out.append(Shape(n, k, "custom"))
    if not out:
        raise UsageError("--shapes: no shapes given")
    return out


def parse_ms(text: str) -> List[int]:
    try:
        ms = sorted({int(x) for x in text.replace(" ", "").split(",") if x})
    except ValueError:
        raise UsageError(f"--ms: {text!r} is not a comma-separated list of integers") from None
    if not ms or ms[0] <= 0:
        raise UsageError("--ms: need positive integers")
    return ms


# --------------------------------------------------------------------------
# Search space
# --------------------------------------------------------------------------

def _pow2_ceil(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def sglang_default_config() -> Dict[str, int]:
    """SGLang 0.5.23's config when no JSON exists (w8a8_block_fp8_matmul_triton, block [128, 128])."""
    return {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": BLOCK[0], "BLOCK_SIZE_K": BLOCK[1], "GROUP_SIZE_M": 32,
            "num_warps": 4, "num_stages": 3}


def candidate_configs(M: int, N: int, K: int, *, sm90: bool, quick: bool, num_sms: int = 132) -> List[Dict]:
    """Tile configs to try for one (M, N, K).  ``sm90`` adds SGLang's Hopper-only SWAP_AB / SPLIT_K keys
    (ignored by SGLang elsewhere, so they are not searched elsewhere)."""
    m16 = max(16, _pow2_ceil(M))
    if quick:
        if M <= 64:
            bms = [min(m16, 64)]
            bns = [32, 64, 128]
            warps = [4]
        else:
            bms = [64, 128]
            bns = [64, 128]
            warps = [4, 8]
        bks = [128]
        stages = [3, 4]
        groups = [16] if M > 64 else [1]
    else:
        bms = [b for b in (16, 32, 64, 128) if b <= m16]
        bns = [32, 64, 128, 256]
        warps = [4, 8]
        bks = [64, 128]
        stages = [2, 3, 4, 5]
        groups = [1, 16, 32] if M > 64 else [1]
    out = []
    for bm in bms:
        for bn in bns:
            if bn > 2 * N:
                continue
            for bk in bks:
                for w in warps:
                    if w == 8 and bm * bn < 64 * 128:
                        continue
                    for st in stages:
                        for g in groups:
                            base = {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk,
                                    "GROUP_SIZE_M": g, "num_warps": w, "num_stages": st}
                            if not sm90:
                                out.append(base)
                                continue
                            k_tiles = -(-K // bk)
                            ctas = -(-M // bm) * -(-N // bn)
                            splits = [1]
                            if M <= 256:
                                splits += [s for s in ((2, 4, 8) if quick else (2, 4, 8, 16))
                                           if s <= k_tiles and ctas * s <= 4 * num_sms]
                            swaps = [False, True] if M <= 64 else [False]
                            for sw in swaps:
                                for sk in splits:
                                    c = dict(base)
                                    if sw:
                                        c["SWAP_AB"] = True
                                    if sk > 1:
                                        c["SPLIT_K"] = sk
                                    out.append(c)
    default = sglang_default_config()
    if default not in out:   # never pick worse than SGLang's own choice (up to timing noise)
        out.append(default)
    return out


def config_id(cfg: Dict) -> str:
    return json.dumps(cfg, sort_keys=True, separators=(",", ":"))


def search_fingerprint(shape: Shape, ms: Sequence[int], *, sm90: bool, quick: bool, num_sms: int,
                       kernel_tag: str) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"N": shape.N, "K": shape.K, "ms": list(ms), "sm90": sm90, "quick": quick,
                         "kernel": kernel_tag, "v": 1}).encode())
    for m in ms:
        for c in candidate_configs(m, shape.N, shape.K, sm90=sm90, quick=quick, num_sms=num_sms):
            h.update(config_id(c).encode())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------
# Benchmark interface (the GPU implementation is below; tests use a fake)
# --------------------------------------------------------------------------

class Bench:
    """What the tuner needs from a device.  Times are microseconds per GEMM."""

    device_name_raw: str = "?"
    sm90: bool = False
    num_sms: int = 132
    kernel_tag: str = "?"
    kernel_source: str = "?"
    versions: Dict[str, str] = {}
    default_backend: Dict[str, object] = {"name": None, "available": False, "reason": "not timed"}

    def setup_shape(self, shape: Shape, ms: Sequence[int]) -> None: ...

    def setup_m(self, shape: Shape, M: int) -> None: ...

    def time_config(self, shape: Shape, M: int, cfg: Optional[Dict]) -> float:
        """Check then time SGLang's Triton launcher with ``cfg`` (None: SGLang's own default)."""
        raise NotImplementedError

    def shipped_config(self, shape: Shape, M: int) -> Optional[Dict]:
        """The config SGLang's shipped JSON for this device gives at M, if SGLang ships one."""
        return None

    def time_linear(self, shape: Shape, M: int, cfg: Dict) -> Optional[float]:
        """End-to-end Triton linear (activation quant + GEMM) with ``cfg``; None if not measurable."""
        return None

    def time_default_backend(self, shape: Shape, M: int) -> Optional[float]:
        """End-to-end linear through SGLang's default FP8 backend for this device; None if not measurable."""
        return None

    def precompile(self, jobs: List[Tuple[Shape, int, Dict]], workers: int, deadline: Optional[float],
                   progress) -> None:
        """Optionally compile candidates ahead of timing (in parallel)."""

    def release_shape(self) -> None: ...


# --------------------------------------------------------------------------
# Progress bar
# --------------------------------------------------------------------------

class _TextBar:
    def __init__(self, total: int, desc: str, stream=sys.stderr):
        self.total, self.n, self.desc, self.stream = total, 0, desc, stream
        self._last = 0.0
        self.t0 = time.monotonic()

    def set_description(self, d: str) -> None:
        self.desc = d

    def update(self, k: int = 1) -> None:
        self.n += k
        now = time.monotonic()
        if now - self._last > 0.5 or self.n >= self.total:
            self._last = now
            frac = self.n / self.total if self.total else 1.0
            bar = "#" * int(30 * frac)
            self.stream.write(f"\r{self.desc[:40]:40s} [{bar:30s}] {self.n}/{self.total} "
                              f"{now - self.t0:6.0f}s")
            self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def make_bar(total: int, desc: str, enabled: bool = True):
    if not enabled:
        class _Null:
            def update(self, k=1): ...
            def set_description(self, d): ...
            def close(self): ...
        return _Null()
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="cfg", dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
    except ImportError:
        return _TextBar(total, desc)


# --------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------

def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o644)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def _read_json(path: Path) -> Optional[dict]:
    try:
        with open(path) as fh:
            d = json.load(fh)
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


def geomean(xs: Iterable[float]) -> Optional[float]:
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    if not xs:
        return None
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


# --------------------------------------------------------------------------
# The tuner
# --------------------------------------------------------------------------

class Tuner:
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
        s = _read_json(self.summary_path)
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
        p = _read_json(self.partial_path(sh))
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
        prev_elapsed = float((_read_json(self.partial_path(sh)) or {}).get("elapsed_s", 0.0)) if rows else 0.0
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
                    "elapsed_s": prev_elapsed + self.clock() - t0})
        finally:
            self.bench.release_shape()
        table = {str(m): rows[str(m)]["best_config"] for m in self.ms if rows[str(m)].get("best_config")}
        if not table:
            raise RuntimeError(f"{sh.key}: no candidate config passed the correctness check")
        validate_config_table(table, block_k=BLOCK[1])
        name = config_file_name(sh.N, sh.K, self.bench.device_name_raw)
        atomic_write_json(self.out_dir / name, table)
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
            "tool": f"dsv4_sm120.tune_fp8 {__version__}", "sglang_version": SGLANG_VERSION,
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
        atomic_write_json(self.summary_path, summary)
        atomic_write_text(self.summary_md_path, summary_markdown(summary))


def _rows(summary: dict):
    for key, s in summary.get("shapes", {}).items():
        if not s.get("complete"):
            continue
        for m, r in s.get("rows", {}).items():
            yield key, int(m), r


def compare_rows(summary: dict) -> dict:
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
    ok = dec >= 1.05 and (pre is None or pre >= 0.8)
    reason = (f"tuned Triton vs {db.get('name')}: geomean speedup {dec:.3f}x at M<={DECODE_MAX_M}, "
              f"{'n/a' if pre is None else f'{pre:.3f}x'} at M>={PREFILL_MIN_M} (rule: >=1.05x and >=0.8x)")
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


# --------------------------------------------------------------------------
# Loading SGLang's kernel module (installed, or from the pinned wheel)
# --------------------------------------------------------------------------

KERNEL_MODULE = "sglang.kernels.ops.gemm.fp8_kernel"
KERNEL_PATH_IN_WHEEL = "sglang/kernels/ops/gemm/fp8_kernel.py"
CONFIGS_IN_WHEEL = "sglang/kernels/ops/gemm/configs/"


def default_wheel() -> Optional[Path]:
    cache = Path(os.environ.get("DSV4_CACHE", Path.home() / ".cache" / "dsv4_sm120"))
    hits = sorted(glob.glob(str(cache / "wheels" / f"sglang-{SGLANG_VERSION}-*.whl")))
    return Path(hits[-1]) if hits else None


def extract_from_wheel(wheel: Path, dest: Path) -> Path:
    """Extract fp8_kernel.py and SGLang's shipped GEMM configs from the wheel; returns the .py path."""
    if not wheel.is_file():
        raise UsageError(f"--sglang-wheel {wheel}: no such file")
    if f"sglang-{SGLANG_VERSION}-" not in wheel.name:
        raise UsageError(f"--sglang-wheel {wheel.name}: expected the pinned sglang {SGLANG_VERSION} wheel")
    try:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n == KERNEL_PATH_IN_WHEEL or
                     (n.startswith(CONFIGS_IN_WHEEL) and n.endswith(".json"))]
            if KERNEL_PATH_IN_WHEEL not in names:
                raise UsageError(f"{wheel.name} has no {KERNEL_PATH_IN_WHEEL}")
            for n in names:
                target = dest / n
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(n))
    except zipfile.BadZipFile:
        raise UsageError(f"--sglang-wheel {wheel}: not a wheel (zip) file") from None
    return dest / KERNEL_PATH_IN_WHEEL


def load_kernel_from_file(path: Path):
    """Import SGLang's fp8_kernel.py alone, with stand-ins for the few SGLang names it imports.

    The stand-ins compute what SGLang computes for a CUDA device (device name, sm_90 check, core count);
    DeepGEMM is reported absent.  sys.modules is restored afterwards, so nothing else sees them."""
    import torch

    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)

    class _Platform:
        is_sm90 = tuple(cap) == (9, 0)
        is_sm120 = cap[0] == 12
        is_blackwell = cap[0] in (10, 11, 12)

    def _register_custom_op(*a, **kw):
        if a and callable(a[0]) and not kw:
            return a[0]
        return lambda f: f

    stubs = {
        "sglang": types.ModuleType("sglang"),
        "sglang.srt": types.ModuleType("sglang.srt"),
        "sglang.srt.layers": types.ModuleType("sglang.srt.layers"),
        "sglang.srt.layers.deep_gemm_wrapper": types.ModuleType("sglang.srt.layers.deep_gemm_wrapper"),
        "sglang.srt.runtime_context": types.ModuleType("sglang.srt.runtime_context"),
        "sglang.srt.utils": types.ModuleType("sglang.srt.utils"),
        "sglang.srt.utils.custom_op": types.ModuleType("sglang.srt.utils.custom_op"),
    }
    for k in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.utils"):
        stubs[k].__path__ = []
    stubs["sglang.srt.layers"].deep_gemm_wrapper = stubs["sglang.srt.layers.deep_gemm_wrapper"]
    stubs["sglang.srt.layers.deep_gemm_wrapper"].ENABLE_JIT_DEEPGEMM = False
    stubs["sglang.srt.runtime_context"].get_platform = lambda: _Platform
    u = stubs["sglang.srt.utils"]
    u.get_device_core_count = lambda device_id=0: torch.cuda.get_device_properties(device_id).multi_processor_count
    u.get_device_name = lambda device_id=0: torch.cuda.get_device_name(device_id)
    u.is_cuda = lambda: torch.cuda.is_available() and torch.version.cuda is not None
    u.is_hip = lambda: torch.version.hip is not None
    u.is_gfx1250_supported = lambda: False
    u.log_info_on_rank0 = lambda logger, msg: logger.info(msg)
    stubs["sglang.srt.utils.custom_op"].register_custom_op = _register_custom_op
    saved = {k: sys.modules.get(k) for k in stubs}
    name = "_dsv4_sglang_fp8_kernel"
    try:
        sys.modules.update(stubs)
        spec = importlib.util.spec_from_file_location(name, str(path))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return mod


def load_kernel(source: str, wheel: Optional[Path], workdir: Path):
    """(kernel module, fp8_utils module or None, source description, kernel file path)."""
    if source in ("auto", "installed"):
        try:
            mod = importlib.import_module(KERNEL_MODULE)
            try:
                utils = importlib.import_module("sglang.srt.layers.quantization.fp8_utils")
            except Exception as e:  # the GEMM kernel still works without the linear wrappers
                utils = None
                print(f"note: sglang fp8_utils not importable ({type(e).__name__}: {e}); "
                      "default backend not timed", file=sys.stderr)
            import sglang

            return mod, utils, f"installed sglang {getattr(sglang, '__version__', '?')}", Path(mod.__file__)
        except Exception as e:
            if source == "installed":
                raise UsageError(f"cannot import {KERNEL_MODULE}: {type(e).__name__}: {e}") from None
    if source == "installed-file":
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.origin:
            raise UsageError("--kernel-source installed-file: sglang is not installed")
        path = Path(spec.origin).parent / "kernels" / "ops" / "gemm" / "fp8_kernel.py"
        if not path.is_file():
            raise UsageError(f"--kernel-source installed-file: {path} missing")
        return load_kernel_from_file(path), None, f"installed {path.name} only", path
    wheel = wheel or default_wheel()
    if wheel is None:
        raise UsageError("SGLang is not importable here and no --sglang-wheel was given "
                         f"(looked for sglang-{SGLANG_VERSION}-*.whl under $DSV4_CACHE/wheels)")
    path = extract_from_wheel(Path(wheel), workdir)
    return load_kernel_from_file(path), None, f"{Path(wheel).name} (fp8_kernel.py only)", path


# --------------------------------------------------------------------------
# GPU benchmark
# --------------------------------------------------------------------------

_L2_TARGET_BYTES = 192 << 20     # rotate weights through at least this many bytes (H200 L2 = 60 MB)
_MAX_COPIES = 64
_REL_TOL_GEMM = 1e-2             # bf16 output of an exact-fp8 product: ~2e-3 expected
_REL_TOL_LINEAR = 8e-2           # + fp8 activation quantization: ~3.6% expected


class GpuBench(Bench):
    def __init__(self, source: str = "auto", wheel: Optional[Path] = None, seed: int = 0,
                 time_default_backend: bool = True, reps: int = 5, device: str = "cuda"):
        import torch
        import triton

        self.torch, self.device = torch, device
        if device == "cuda":
            if not torch.cuda.is_available():
                raise UsageError("no CUDA GPU visible: the tuner needs one (use --dry-run to see the plan)")
        elif device == "cpu":   # for tests: Triton's interpreter, wall-clock timing
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise UsageError("device cpu needs TRITON_INTERPRET=1")
        else:
            raise UsageError(f"unknown device {device!r}")
        self._tmp = tempfile.TemporaryDirectory(prefix="dsv4_tune_fp8_")
        self.source_arg, self.wheel_arg = source, wheel
        self.mod, self.utils, self.kernel_source, self.kernel_path = load_kernel(source, wheel, Path(self._tmp.name))
        self.kernel_tag = hashlib.sha256(Path(self.kernel_path).read_bytes()).hexdigest()[:12]
        if device == "cuda":
            props = torch.cuda.get_device_properties(0)
            self.device_name_raw = torch.cuda.get_device_name(0)
            cap = tuple(torch.cuda.get_device_capability(0))
            self.num_sms = props.multi_processor_count
        else:
            self.device_name_raw, cap, self.num_sms = "CPU TRITON INTERPRETER", (0, 0), 1
        self.sm90 = cap == (9, 0)
        self.versions = {"torch": torch.__version__, "triton": triton.__version__,
                         "cuda": str(torch.version.cuda), "python": platform.python_version(),
                         "capability": f"sm_{cap[0]}{cap[1]}"}
        self.seed, self.reps = seed, reps
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self._default_linear = None
        self.default_backend = {"name": None, "available": False, "reason": "not requested"}
        if time_default_backend and device == "cuda":
            self._init_default_backend(cap)
        self._orig_lookup = self.mod.get_w8a8_block_fp8_configs
        self._orig_prepare = self.mod.prepare_block_fp8_matmul_inputs

    def _sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    # -- default backend ------------------------------------------------------
    def _init_default_backend(self, cap) -> None:
        if self.utils is None:
            name = "cutlass (sgl_kernel)" if cap[0] == 12 else ("deep_gemm" if tuple(cap) == (9, 0) else "?")
            self.default_backend = {"name": name, "available": False,
                                    "reason": "SGLang's fp8_utils / sgl_kernel / deep_gemm not importable here "
                                              f"({self.kernel_source})"}
            return
        u = self.utils
        try:
            backend = "cutlass" if cap[0] == 12 else ("triton" if cap[0] == 11 else "auto")
            u.FP8_GEMM_RUNNER_BACKEND = u.Fp8GemmRunnerBackend(backend)   # as initialize_fp8_gemm_config
            fn = u.dispatch_w8a8_block_fp8_linear(list(BLOCK))
            name = getattr(getattr(fn, "func", fn), "__name__", str(fn))
            if name == "triton_w8a8_block_fp8_linear":
                self.default_backend = {"name": "triton", "available": True, "reason": "dispatch picks Triton",
                                        "function": name}
            else:
                self._default_linear = fn
                self.default_backend = {"name": name, "available": True, "reason": f"--fp8-gemm-backend {backend}",
                                        "function": name}
        except Exception as e:
            self.default_backend = {"name": None, "available": False,
                                    "reason": f"dispatch failed: {type(e).__name__}: {e}"[:300]}

    # -- data ---------------------------------------------------------------
    def _rand_fp8(self, *shape):
        t = self.torch.randn(*shape, device=self.device, generator=self.gen, dtype=self.torch.float32)
        return t.clamp_(-448, 448).to(self.torch.float8_e4m3fn)

    def _rand_scale(self, *shape):
        return (self.torch.rand(*shape, device=self.device, generator=self.gen) * 1.5 + 0.25) * 1e-2

    def setup_shape(self, shape: Shape, ms: Sequence[int]) -> None:
        torch = self.torch
        wbytes = shape.N * shape.K
        self.copies = max(2, min(_MAX_COPIES, -(-_L2_TARGET_BYTES // wbytes))) if self.device == "cuda" else 2
        self.B = [self._rand_fp8(shape.N, shape.K) for _ in range(self.copies)]
        self.Bs = [self._rand_scale(shape.N // BLOCK[0], shape.K // BLOCK[1]) for _ in range(self.copies)]
        self.B_deq = self._dequant(self.B[0], self.Bs[0], rows_block=BLOCK[0])
        self._sync()

    def _dequant(self, q, s, rows_block=1):
        torch = self.torch
        f = q.to(torch.float32)
        s = s.repeat_interleave(BLOCK[1], dim=1)[:, : q.shape[1]]
        if rows_block > 1:
            s = s.repeat_interleave(rows_block, dim=0)[: q.shape[0]]
        return f * s

    def _ref(self, a_deq):
        torch = self.torch
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            return a_deq @ self.B_deq.T
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev

    def setup_m(self, shape: Shape, M: int) -> None:
        torch = self.torch
        n = self.copies
        self.A = [self._rand_fp8(M, shape.K) for _ in range(n)]
        self.As = [self._rand_scale(M, shape.K // BLOCK[1]) for _ in range(n)]
        self.ref = self._ref(self._dequant(self.A[0], self.As[0]))
        self.X = None
        self.ref_lin = None
        if self._default_linear is not None or self.utils is not None:
            self.X = [torch.randn(M, shape.K, device=self.device, generator=self.gen, dtype=torch.bfloat16)
                      for _ in range(n)]
            self.ref_lin = self._ref(self.X[0].to(torch.float32))

    def release_shape(self) -> None:
        self.B = self.Bs = self.A = self.As = self.X = None
        self.B_deq = self.ref = self.ref_lin = None
        if self.device == "cuda":
            self.torch.cuda.empty_cache()

    # -- helpers --------------------------------------------------------------
    @contextlib.contextmanager
    def _with_config(self, M: int, cfg: Optional[Dict], poison: bool = False):
        mod = self.mod
        table = None if cfg is None else {M: dict(cfg)}
        mod.get_w8a8_block_fp8_configs = lambda N, K, bn, bk: table
        if poison:
            orig = self._orig_prepare

            def prepare(*a, **kw):
                M_, N_, K_, C = orig(*a, **kw)
                C.fill_(float("nan"))
                return M_, N_, K_, C

            mod.prepare_block_fp8_matmul_inputs = prepare
        try:
            yield
        finally:
            mod.get_w8a8_block_fp8_configs = self._orig_lookup
            mod.prepare_block_fp8_matmul_inputs = self._orig_prepare

    def _gemm(self, i: int):
        return self.mod.w8a8_block_fp8_matmul_triton(self.A[i], self.B[i], self.As[i], self.Bs[i], list(BLOCK),
                                                     output_dtype=self.torch.bfloat16)

    def _check(self, out, ref, tol: float, what: str) -> None:
        torch = self.torch
        if out.shape != ref.shape:
            raise CandidateError(f"{what}: output shape {tuple(out.shape)} != {tuple(ref.shape)}")
        o = out.to(torch.float32)
        if not torch.isfinite(o).all():
            raise CandidateError(f"{what}: non-finite output (unwritten or overflow)")
        err = (torch.linalg.vector_norm(o - ref) / torch.linalg.vector_norm(ref)).item()
        if not err <= tol:
            raise CandidateError(f"{what}: relative error {err:.3g} > {tol}")

    def _graph_us(self, fns: List[Callable]) -> float:
        torch = self.torch
        if self.device != "cuda":
            for f in fns:
                f()
            t0 = time.perf_counter()
            for f in fns:
                f()
            return (time.perf_counter() - t0) * 1e6 / len(fns)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in fns:
                f()
        g.replay()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(self.reps):
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1))
        g.reset()
        del g
        ts.sort()
        return ts[len(ts) // 2] * 1000.0 / len(fns)

    # -- Bench API ------------------------------------------------------------
    def time_config(self, shape: Shape, M: int, cfg: Optional[Dict]) -> float:
        torch = self.torch
        try:
            with self._with_config(M, cfg, poison=True):
                out = self._gemm(0)
                self._sync()
            self._check(out, self.ref, _REL_TOL_GEMM, "gemm")
            with self._with_config(M, cfg):
                return self._graph_us([(lambda i=i: self._gemm(i)) for i in range(self.copies)])
        except CandidateError:
            raise
        except Exception as e:  # compile / launch / resource errors of this config
            with contextlib.suppress(Exception):
                self._sync()
            raise CandidateError(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from None

    def shipped_config(self, shape: Shape, M: int) -> Optional[Dict]:
        path = Path(self.kernel_path).parent / "configs" / config_file_name(shape.N, shape.K, self.device_name_raw)
        t = _read_json(path)
        if not t:
            return None
        table = {int(k): v for k, v in t.items()}
        cfg = dict(table[min(table, key=lambda x: abs(x - M))])
        if cfg.get("BLOCK_SIZE_K", BLOCK[1]) < BLOCK[1] and BLOCK[1] % cfg["BLOCK_SIZE_K"]:
            cfg["BLOCK_SIZE_K"] = BLOCK[1]   # SGLang's own clamp
        return cfg

    def _time_linear_fn(self, fn, what: str) -> Optional[float]:
        torch = self.torch
        Ws = self.Bs
        try:
            out = fn(self.X[0], self.B[0], list(BLOCK), Ws[0])
            self._sync()
            self._check(out, self.ref_lin, _REL_TOL_LINEAR, what)
            return self._graph_us([(lambda i=i: fn(self.X[i], self.B[i], list(BLOCK), Ws[i]))
                                   for i in range(self.copies)])
        except Exception as e:
            print(f"\nnote: {what} at M={self.X[0].shape[0]} failed: {type(e).__name__}: {e}"[:400], file=sys.stderr)
            return None

    def time_linear(self, shape: Shape, M: int, cfg: Dict) -> Optional[float]:
        if self.utils is None or self.X is None:
            return None
        with self._with_config(M, cfg):
            return self._time_linear_fn(self.utils.triton_w8a8_block_fp8_linear, "triton linear")

    def time_default_backend(self, shape: Shape, M: int) -> Optional[float]:
        if self._default_linear is None or self.X is None:
            return None
        return self._time_linear_fn(self._default_linear, f"{self.default_backend['name']} linear")

    def precompile(self, jobs, workers, deadline, progress) -> None:
        """Compile the candidates in ``workers`` processes (Triton's disk cache is shared), so the timing
        loop finds them compiled.  One representative job per kernel specialization."""
        if workers <= 1 or not jobs:
            return
        import multiprocessing as mp

        def mclass(m):
            return 1 if m == 1 else (16 if m % 16 == 0 else 0)

        reps: Dict[str, Tuple[Shape, int, Dict]] = {}
        for sh, m, cfg in jobs:
            k = f"{config_id(cfg)}|{mclass(m)}|{(sh.K // BLOCK[1]) % 16 == 0}|{sh.N % 16 == 0}"
            reps.setdefault(k, (sh, m, cfg))
        work = [(s.N, s.K, m, cfg) for s, m, cfg in reps.values()]
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        bar = make_bar(len(work), f"compiling ({workers} procs)", enabled=progress)
        t0 = time.monotonic()
        failed = done = 0
        ex = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_worker_init,
                                 initargs=(self.source_arg, str(self.wheel_arg) if self.wheel_arg else None, self.device))
        try:
            pending = {ex.submit(_worker_compile, w) for w in work}
            while pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                fin, pending = wait(pending, timeout=left, return_when=FIRST_COMPLETED)
                for f in fin:
                    try:
                        ok = f.result()
                    except Exception:   # a worker died (BrokenProcessPool): the timing loop compiles the rest
                        ok = False
                    failed += not ok
                    done += 1
                    bar.update(1)
        finally:
            ex.shutdown(wait=False, cancel_futures=True)
            bar.close()
        self.precompile_stats = {"variants": len(work), "compiled": done - failed, "failed_or_skipped":
                                 len(work) - done + failed, "workers": workers,
                                 "seconds": round(time.monotonic() - t0, 1)}
        print(f"precompile: {self.precompile_stats}", file=sys.stderr)


_W: Dict[str, object] = {}


def _worker_init(source: str, wheel: Optional[str], device: str = "cuda") -> None:
    import torch

    if device == "cuda":
        torch.cuda.set_device(0)
    _W["device"] = device
    d = tempfile.mkdtemp(prefix="dsv4_tune_fp8_w_")
    mod, _, _, _ = load_kernel(source, Path(wheel) if wheel else None, Path(d))
    _W["mod"] = mod
    _W["torch"] = torch


def _worker_compile(job) -> bool:
    N, K, M, cfg = job
    torch, mod, dev = _W["torch"], _W["mod"], _W["device"]
    try:
        a = torch.randn(M, K, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(N, K, device=dev).to(torch.float8_e4m3fn)
        as_ = torch.rand(M, K // BLOCK[1], device=dev)
        bs = torch.rand(N // BLOCK[0], K // BLOCK[1], device=dev)
        mod.get_w8a8_block_fp8_configs = lambda *_a: {M: dict(cfg)}
        mod.w8a8_block_fp8_matmul_triton(a, b, as_, bs, list(BLOCK), output_dtype=torch.bfloat16)
        if dev == "cuda":
            torch.cuda.synchronize()
        return True
    except Exception:
        if dev == "cuda":
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
        return False


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

def _repo_default_out() -> Optional[Path]:
    d = Path(__file__).resolve().parents[2] / "configs"
    if d.is_dir():
        return d / "fp8"
    from dsv4_sm120.fp8_configs import project_config_dir

    return project_config_dir()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m dsv4_sm120.tune_fp8",
        description="Tune SGLang's Triton block-FP8 GEMM configs for the DeepSeek-V4-Flash dense shapes on the "
                    "local GPU; writes one JSON per shape (named as SGLang looks it up) and a summary.",
        epilog="Exit codes: 0 done, 2 bad usage / no GPU, 3 stopped by --time-budget (rerun to continue).")
    ap.add_argument("--tp", type=int, default=4, help="tensor-parallel size the shapes are sharded for (default 4)")
    ap.add_argument("--shapes", help="explicit weight shapes 'N,K;N,K;...' instead of the DSv4-Flash set")
    ap.add_argument("--ms", help="comma-separated token counts M (default: %s)" % ",".join(map(str, DEFAULT_MS)))
    ap.add_argument("--quick", action="store_true", help="small search space (minutes instead of hours)")
    ap.add_argument("--out-dir", type=Path, help="where JSONs and summary go (default: the project's configs/fp8)")
    ap.add_argument("--force", action="store_true", help="retune shapes that are already done")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (shapes, M, candidates, files); no GPU")
    ap.add_argument("--time-budget", type=float, help="stop cleanly after this many seconds (rerun to resume)")
    ap.add_argument("--jobs", type=int, default=-1,
                    help="processes compiling candidates ahead of timing (default: CPU count, max 16; 0: off)")
    ap.add_argument("--kernel-source", choices=("auto", "installed", "installed-file", "wheel"), default="auto",
                    help="SGLang's kernel from the installed sglang, its fp8_kernel.py alone (installed-file), or "
                         "from the pinned wheel (auto: installed if importable, else the wheel)")
    ap.add_argument("--sglang-wheel", type=Path, help="the pinned sglang wheel (for --kernel-source wheel/auto)")
    ap.add_argument("--no-default-backend", action="store_true", help="do not time SGLang's default backend")
    ap.add_argument("--sm90", choices=("auto", "yes", "no"), default="auto",
                    help="(--dry-run only) plan for an sm_90 device (adds SWAP_AB/SPLIT_K)")
    ap.add_argument("--device-name", help="(--dry-run only) device name to plan file names for")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default); cpu runs SGLang's kernel in Triton's interpreter (needs TRITON_INTERPRET=1; "
                         "for testing the tuner only)")
    ap.add_argument("--seed", type=int, default=0, help="random seed for the test data")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        shapes = parse_shapes(a.shapes) if a.shapes else shapes_for_tp(a.tp)
        ms = parse_ms(a.ms) if a.ms else list(DEFAULT_MS)
        out = a.out_dir or _repo_default_out()
        if out is None:
            raise UsageError("no project configs/ directory found: pass --out-dir")
        if a.time_budget is not None and a.time_budget <= 0:
            raise UsageError("--time-budget must be positive")
        if a.dry_run:
            return dry_run(a, shapes, ms, Path(out))
        jobs = a.jobs if a.jobs >= 0 else min(16, os.cpu_count() or 1)
        bench = GpuBench(source=a.kernel_source,
                         wheel=a.sglang_wheel, seed=a.seed, time_default_backend=not a.no_default_backend,
                         device=a.device)
        print(f"device {bench.device_name_raw} ({bench.versions['capability']}, {bench.num_sms} SMs); "
              f"kernel: {bench.kernel_source}; default backend: {bench.default_backend}", file=sys.stderr)
        t = Tuner(bench, shapes, ms, Path(out), quick=a.quick, force=a.force, time_budget=a.time_budget,
                  jobs=jobs, progress=not a.no_progress, tp=None if a.shapes else a.tp)
        rc = t.run()
        print(f"summary: {t.summary_md_path}", file=sys.stderr)
        return rc
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted; finished M values are saved, rerun to continue", file=sys.stderr)
        return 130


def dry_run(a, shapes: List[Shape], ms: List[int], out: Path) -> int:
    dev = a.device_name
    sm90 = {"yes": True, "no": False}.get(a.sm90)
    if dev is None or sm90 is None:
        try:
            import torch

            if torch.cuda.is_available():
                dev = dev or torch.cuda.get_device_name(0)
                if sm90 is None:
                    sm90 = tuple(torch.cuda.get_device_capability(0)) == (9, 0)
        except Exception:
            pass
    dev = dev or "UNKNOWN_DEVICE"
    sm90 = bool(sm90)
    total = 0
    print(f"plan for {dev} ({'sm_90' if sm90 else 'not sm_90'}), {'quick' if a.quick else 'full'} search, "
          f"M = {','.join(map(str, ms))}")
    for s in shapes:
        n = sum(len(candidate_configs(m, s.N, s.K, sm90=sm90, quick=a.quick)) for m in ms)
        total += n
        print(f"  {s.key:16s} {s.name:24s} {n:6d} candidates -> {out / config_file_name(s.N, s.K, dev)}")
    print(f"  total {total} candidate timings; summary -> {out / (summary_file_stem(dev) + '.json')} (+ .md)")
    return 0


if __name__ == "__main__":
    # run the package module's main, so worker processes pickle functions by their importable name
    from dsv4_sm120 import tune_fp8 as _self

    sys.exit(_self.main())
