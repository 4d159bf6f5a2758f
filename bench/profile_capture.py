#!/usr/bin/env python3
"""Torch-profiler capture of the decode server under load, summarised by kernel group: `make profile`.

The code is dsv4_sm120.perf.profile_capture (tested there); `python bench/profile_capture.py --help` lists the options."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "overlay"))

from dsv4_sm120.perf import profile_capture as _impl  # noqa: E402
from dsv4_sm120.perf.profile_capture import start_profile_body  # noqa: E402,F401 - for importers of this file

_impl.REPO = REPO
_impl.measure.REPO = REPO

if __name__ == "__main__":
    sys.exit(_impl.main())
