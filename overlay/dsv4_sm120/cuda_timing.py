"""Timing GPU calls the way serving runs them: captured in one CUDA graph and replayed.

Used by the FP8 GEMM tuner (:mod:`dsv4_sm120.fp8.gpu`) and the MoE benchmark (``bench/bench_moe.py``).
Imports torch only when called.
"""
from __future__ import annotations

import statistics
from typing import Callable, Sequence


def cuda_graph_us(fns: Sequence[Callable[[], object]], reps: int) -> float:
    """Median microseconds per call of ``fns``: the calls are run once on a side stream (warm-up, as capture
    requires), captured together in one CUDA graph, replayed once, then replayed ``reps`` times, each replay
    timed with CUDA events; the median replay time is divided by ``len(fns)``."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    g.reset()
    del g
    return statistics.median(ts) * 1000.0 / len(fns)
