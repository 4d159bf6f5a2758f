"""The converter's messages on stderr: log lines, human-readable sizes, the progress bar (tqdm when installed,
else a percentage line every 2 s)."""

from __future__ import annotations

import sys
import time


def log(msg: str, quiet: bool = False) -> None:
    if not quiet:
        print(msg, file=sys.stderr)


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


class Progress:
    """Progress over ``total`` units (bytes or tensors); called with each step's amount."""

    def __init__(self, total: int, enabled: bool, desc: str = "convert"):
        self.bar = None
        self.enabled = enabled
        self.total, self.done, self.last = total, 0, 0.0
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                                desc=desc, file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def __call__(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and time.monotonic() - self.last > 2:
            self.last = time.monotonic()
            print(f"  {100 * self.done / max(self.total, 1):5.1f}%  {human(self.done)} / {human(self.total)}",
                  file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
