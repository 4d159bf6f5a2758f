"""The command line: ``python -m dsv4_sm120.convert_nvfp4 SRC DST [options]`` (``make convert-nvfp4``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from .driver import convert
from .layout import ConvertError
from .verify import verify_conversion


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dsv4_sm120.convert_nvfp4",
        description="Convert DeepSeek-V4-Flash MXFP4 routed experts to NVFP4 (hybrid FP8+NVFP4 checkpoint "
                    "that SGLang 0.5.23 auto-detects). Bit-exact for every in-range block; streams one shard at "
                    "a time; resumable; never writes into SRC.",
        epilog="Exit codes: 0 ok, 1 --verify found a difference, 2 refused. See docs/nvfp4.md.",
    )
    ap.add_argument("src", metavar="SRC", help="source checkpoint directory (DeepSeek-V4-Flash, MXFP4 experts)")
    ap.add_argument("dst", metavar="DST", help="output directory (new or empty, or a previous partial run)")
    ap.add_argument("--input-scales", metavar="PATH", default=None,
                    help="activation scales: an NVFP4 checkpoint directory with routed-expert input_scale tensors, "
                         "or a JSON file ({\"w13\": x, \"w2\": y, \"tensors\": {name: value}}); default: the "
                         "uncalibrated bound documented in docs/nvfp4.md")
    ap.add_argument("--verify", action="store_true",
                    help="after converting, dequantize SRC and DST experts and compare all of them, and compare "
                         "every carried tensor byte for byte")
    ap.add_argument("--verify-only", action="store_true", help="only verify an existing DST")
    ap.add_argument("--dry-run", action="store_true", help="check SRC, plan, print sizes; write nothing")
    ap.add_argument("--quick-resume", action="store_true",
                    help="on a rerun, check finished shards by size and header only (default: sha256)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("-q", "--quiet", action="store_true", help="only errors")
    a = ap.parse_args(argv)
    try:
        if a.verify_only:
            r = verify_conversion(Path(a.src), Path(a.dst), quiet=a.quiet, progress=not a.no_progress)
            return 0 if r["ok"] else 1
        res = convert(Path(a.src), Path(a.dst), input_scales=a.input_scales, verify=a.verify,
                      dry_run=a.dry_run, quick_resume=a.quick_resume, progress=not a.no_progress, quiet=a.quiet)
        if res.verify is not None and not res.verify["ok"]:
            return 1
        return 0
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume", file=sys.stderr)
        return 130

