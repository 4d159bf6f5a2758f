"""Progress bar for the tuner and the parallel compile step: tqdm when installed, else a one-line text bar."""

from __future__ import annotations

import sys
import time


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

