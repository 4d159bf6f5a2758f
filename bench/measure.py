#!/usr/bin/env python3
"""Decode throughput of the running deployment at several concurrencies (JSON, table, PNG): `make measure`.

The code is dsv4_sm120.perf.measure (tested there); `python bench/measure.py --help` lists the options."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "overlay"))

from dsv4_sm120.perf import measure as _impl  # noqa: E402

_impl.REPO = REPO

if __name__ == "__main__":
    sys.exit(_impl.main())
