#!/usr/bin/env python3
"""Summarise torch-profiler traces by kernel group: `make profile-summary TRACE=...`.

The code is dsv4_sm120.perf.profile_summary (tested there); `python bench/profile_summary.py --help` lists the options."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "overlay"))

from dsv4_sm120.perf import profile_summary as _impl  # noqa: E402


if __name__ == "__main__":
    sys.exit(_impl.main())
