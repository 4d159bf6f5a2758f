"""``python -m dsv4_sm120.tune_fp8`` (``make tune-fp8``): the FP8 block-GEMM tuner's command.

The tuner itself is the :mod:`dsv4_sm120.fp8` package; ``--help`` lists the options and
:mod:`dsv4_sm120.fp8.cli` describes what a run does.
"""

from __future__ import annotations

import sys

from dsv4_sm120.fp8.cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
