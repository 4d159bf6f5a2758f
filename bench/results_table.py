#!/usr/bin/env python3
"""Generate the committed table of one subject from its results file, or validate a results file.

  python bench/results_table.py table attention --gpu "NVIDIA H200"   # -> bench/results/attention_h200.md
  python bench/results_table.py table moe --out -                     # print (the file's only GPU)
  python bench/results_table.py check bench/results/fp8.csv
  python bench/results_table.py launch attention --gpu "NVIDIA H200"  # -> the H200 launch tables (--check: compare)

The table keeps the latest row per (case, impl, variant, shape); see bench/results/README.md.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "overlay"))

from dsv4_sm120.dev.bench_results import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(results_dir=REPO / "bench" / "results", prog="bench/results_table.py"))
