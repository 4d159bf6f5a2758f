"""The Candidate interface, the correctness gate, timing, and the per-bucket winner logic every decision shares.

A decision (e.g. ``attention.swa_c4``) has buckets (row / token counts) and candidates. For each bucket the
harness builds one :class:`Case` (inputs + a float64 reference of sampled rows) shared by all candidates; each
candidate that is available builds its call, runs it once for the gate (error vs the reference <= its
tolerance), then is timed. Outcomes per (bucket, candidate):

* ``unavailable``: :meth:`Candidate.available` gave a reason (missing module, wrong GPU, ...);
* ``failed``: building or running raised (the exception's type and message are the reason);
* ``rejected``: it ran but failed the correctness gate (never a winner, however fast);
* ``ok``: passed, with its time in µs.

The winner of a bucket is the fastest ``ok`` candidate that is ``eligible`` (a reference point the serving
glue cannot route to, e.g. FlashMLA on sm_90, is timed and reported but never wins). Nothing here raises
for a bad candidate: a decision always completes with a reason for every cell.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Iterable, List, Optional

from .. import tolerances


@dataclass
class Outcome:
    status: str                      # ok | failed | unavailable | rejected
    us: Optional[float] = None
    err: Optional[float] = None
    tol: Optional[float] = None
    reason: str = ""
    timing: str = ""                 # graph | events | wall

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if v not in (None, "")}
        for k in ("us", "err"):
            if k in d and isinstance(d[k], float):
                d[k] = float(f"{d[k]:.4g}") if math.isfinite(d[k]) else None
        return d


class NotApplicable(RuntimeError):
    """Raised by :meth:`Candidate.build` when the candidate does not apply to this bucket (reported as
    unavailable with the message)."""


class Case:
    """Inputs of one bucket plus the float64 reference. Subclasses set ``device`` and implement
    :meth:`error` (relative error of a candidate's output against the reference, inf for NaN/inf)."""

    device = "cpu"

    def error(self, out) -> float:  # pragma: no cover - interface
        raise NotImplementedError


class Candidate:
    """One implementation of a decision. ``name`` is the choice string the profile records (what the glue
    routes to); ``tol`` the gate's relative-error bound for its numeric format."""

    name = "?"
    eligible = True
    tol = tolerances.BF16_RESULT
    batch = False   # True: measures every bucket itself (measure_all), e.g. in a subprocess

    def available(self) -> Optional[str]:
        """None when the candidate can run here, else the reason it cannot."""
        return None

    def build(self, case: Case) -> Callable[[], object]:
        """A zero-argument call producing the candidate's output for ``case`` (allocations done here)."""
        raise NotImplementedError

    def measure_all(self, buckets: List[int], progress=None) -> Dict[int, Outcome]:  # batch candidates
        raise NotImplementedError


def sample_rows(n: int, k: int = 16) -> List[int]:
    """Up to ``k`` row indices spread over ``0..n-1``, first and last included (the gate checks these)."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def time_call(fn: Callable[[], object], min_ms: float = 20.0, max_iters: int = 200) -> tuple:
    """(µs per call, method) of a CUDA call: captured in a CUDA graph and replayed (what serving runs), or eager
    with CUDA events when capture fails. On the interpreter (tests only) the callers time the gated call itself."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    runner, method = fn, "events"
    try:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize()
        runner, method = g.replay, "graph"
    except Exception:  # noqa: BLE001 - not capturable: eager timing
        torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    runner()
    b.record()
    b.synchronize()
    once = max(a.elapsed_time(b), 1e-3)
    iters = int(max(5, min(max_iters, min_ms / once)))
    a.record()
    for _ in range(iters):
        runner()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / iters, method


def gate(err: float, tol: float) -> Optional[str]:
    """None when ``err`` passes, else the rejection reason."""
    if err is None or not math.isfinite(err):
        return f"output has NaN/inf (err {err})"
    if err > tol:
        return f"error {err:.3g} > tolerance {tol:.3g} vs the float64 reference"
    return None


def measure(cand: Candidate, case: Case) -> Outcome:
    """Build, gate and time one candidate on one case; never raises."""
    try:
        fn = cand.build(case)
        t0 = time.perf_counter()
        out = fn()
        _sync(case.device)
        first_us = (time.perf_counter() - t0) * 1e6
        err = float(case.error(out))
    except NotApplicable as e:
        return Outcome("unavailable", reason=str(e))
    except Exception as e:  # noqa: BLE001
        return Outcome("failed", reason=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}")
    why = gate(err, cand.tol)
    if why:
        return Outcome("rejected", err=err, tol=cand.tol, reason=why)
    if not str(case.device).startswith("cuda"):  # the interpreter (tests only): the gated call's wall clock
        return Outcome("ok", us=first_us, err=err, tol=cand.tol, timing="wall")
    try:
        us, how = time_call(fn)
    except Exception as e:  # noqa: BLE001
        return Outcome("failed", err=err, tol=cand.tol, reason=f"timing: {type(e).__name__}: {e}"[:300])
    return Outcome("ok", us=us, err=err, tol=cand.tol, timing=how)


def pick_winner(row: Dict[str, Outcome], eligible: Dict[str, bool]) -> Optional[str]:
    ok = [(o.us, n) for n, o in row.items() if o.status == "ok" and o.us is not None and eligible.get(n, True)]
    return min(ok)[1] if ok else None


class Progress:
    """Progress lines with elapsed time and ETA: ``[calibrate 01:02 eta 03:10 25%] what``."""

    def __init__(self, total: int, stream=None, quiet: bool = False):
        self.total, self.done, self.t0 = max(1, total), 0, time.monotonic()
        self.stream, self.quiet = stream or sys.stderr, quiet

    @staticmethod
    def _mmss(s: float) -> str:
        s = int(max(0, s))
        return f"{s // 60:02d}:{s % 60:02d}"

    def step(self, what: str, units: int = 1) -> None:
        self.done = min(self.total, self.done + units)
        el = time.monotonic() - self.t0
        eta = el / self.done * (self.total - self.done) if self.done else 0.0
        if not self.quiet:
            print(f"[calibrate {self._mmss(el)} eta {self._mmss(eta)} {100 * self.done // self.total:3d}%] {what}",
                  file=self.stream, flush=True)


def run_decision(name: str, candidates: Iterable[Candidate], buckets: List[int],
                 make_case: Callable[[int], Case], progress: Optional[Progress] = None) -> dict:
    """Measure every candidate on every bucket; returns the decision's profile entry (``buckets`` only;
    the caller adds ``bucket_kind`` / ``default`` / notes)."""
    cands = list(candidates)
    rows: Dict[int, Dict[str, Outcome]] = {b: {} for b in buckets}
    live = []
    for c in cands:
        why = None
        try:
            why = c.available()
        except Exception as e:  # noqa: BLE001
            why = f"availability check raised {type(e).__name__}: {e}"
        if why:
            for b in buckets:
                rows[b][c.name] = Outcome("unavailable", reason=why)
            if progress:
                progress.step(f"{name}: {c.name} unavailable: {why}", len(buckets))
        else:
            live.append(c)
    for c in [c for c in live if c.batch]:
        try:
            res = c.measure_all(list(buckets), progress)
        except Exception as e:  # noqa: BLE001
            res = {b: Outcome("failed", reason=f"{type(e).__name__}: {e}"[:300]) for b in buckets}
        for b in buckets:
            o = res.get(b) or Outcome("failed", reason="no result for this bucket")
            if o.status == "ok":
                why = gate(o.err, c.tol)
                if why:
                    o = Outcome("rejected", us=o.us, err=o.err, tol=c.tol, reason=why)
            rows[b][c.name] = o
    for b in buckets:
        inline = [c for c in live if not c.batch]
        if not inline:
            continue
        try:
            case = make_case(b)
        except Exception as e:  # noqa: BLE001
            for c in inline:
                rows[b][c.name] = Outcome("failed", reason=f"building the inputs: {type(e).__name__}: {e}"[:300])
            continue
        for c in inline:
            o = measure(c, case)
            rows[b][c.name] = o
            if progress:
                detail = f"{o.us:.1f} us err {o.err:.2g}" if o.status == "ok" else f"{o.status}: {o.reason}"
                progress.step(f"{name} n={b} {c.name}: {detail}")
        del case
    eligible = {c.name: c.eligible for c in cands}
    return {"buckets": {str(b): {"winner": pick_winner(rows[b], eligible),
                                 "candidates": {n: o.to_json() for n, o in rows[b].items()}}
                        for b in buckets},
            "reference_only": sorted(n for n, e in eligible.items() if not e)}
