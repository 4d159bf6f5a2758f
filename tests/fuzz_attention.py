#!/usr/bin/env python3
"""Random-shape stress of the sparse MLA decode split bodies against the float64 reference, on the CPU
(``TRITON_INTERPRET=1``) or a GPU. Not collected by pytest (no ``test_`` prefix): a developer tool for changes
to a body's loop structure (prefetch distances, chunk boundaries, masks).

  python3 tests/fuzz_attention.py --impl reg --seconds 300 --seed 1

Each case draws rows, heads, page sizes (1..256), candidate counts, main / c4 / c128 caches, lengths (none,
random, some zero), sinks, head slices, -1 density, all-invalid rows and a launch variant (block size, waves,
partial precision, body flags), then runs ``tests/test_attention.check`` (poisoned workspace, NaN-poisoned slots
past each length, tolerance on out and lse). Failures are printed with their case and launch; exit 1 if any."""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = {
    "reg": lambda r: dict(impl="reg", DEC_LATE=r.randint(0, 1), SPAN=r.randint(0, 1), BLOCK_N=r.choice([16, 32]),
                          num_warps=r.choice([4, 8]),
                          waves=r.choice([0.1, 0.25, 1.0, 4.0]), PART_BF16=r.randint(0, 1)),
    "tiled": lambda r: dict(impl="tiled", PREFETCH=r.randint(0, 2), BLOCK_N=r.choice([16, 32]),
                            waves=r.choice([0.1, 0.25, 1.0, 4.0]), PART_BF16=r.randint(0, 1)),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=sorted(VARIANTS), default="reg")
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (interpreter) or cuda")
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    else:
        import torch

        if not torch.cuda.is_available():
            print(f"--device {args.device}: no CUDA GPU here (use --device cpu for the interpreter)", file=sys.stderr)
            return 2
    sys.path[:0] = [str(HERE), str(HERE.parent / "overlay")]
    if args.device == "cpu":
        from test_attention import check  # noqa: E402  (after TRITON_INTERPRET is set)
    else:
        # the GPU tests' check (test_attention.py sets TRITON_INTERPRET=1 on import, which would run the kernels
        # in the interpreter on CUDA tensors)
        sys.path.insert(0, str(HERE / "gpu"))
        from test_attention_gpu import check  # noqa: E402
    from attention_cases import Case, build  # noqa: E402

    r = random.Random(args.seed)
    t0, n, bad = time.time(), 0, 0
    while time.time() - t0 < args.seconds:
        case = Case(T=r.randint(1, 5), H=r.choice([1, 3, 8, 16, 24, 40]), main_page=r.choice([1, 2, 3, 64, 256]),
                    main_pages=r.randint(1, 6), K=r.randint(1, 80), extra=r.choice([None, "c4", "c128"]),
                    extra_page=r.choice([2, 5, 64]), extra_pages=r.randint(2, 30), extra_K=r.randint(1, 90),
                    lengths=r.choice([None, "random", "zero_some"]), sink=r.choice([None, "finite", "-inf"]),
                    head_slice=r.random() < 0.3, neg_frac=r.choice([0.0, 0.1, 0.9]),
                    all_invalid_rows=(0,) if r.random() < 0.2 else (), seed=r.randint(0, 10 ** 6))
        case.main_pages = max(case.main_pages, -(-16 // case.main_page))
        cfg = VARIANTS[args.impl](r)
        os.environ["DSV4_SM120_ATTN_CONFIG"] = ",".join(f"{k}={v}" for k, v in cfg.items())
        try:
            check(build(case, device=args.device), "bf16")
        except Exception as exc:  # noqa: BLE001  (report every failure with its case)
            bad += 1
            print(f"FAIL {case} {cfg}: {exc!r:.300}", flush=True)
        n += 1
    os.environ.pop("DSV4_SM120_ATTN_CONFIG", None)
    print(f"{args.impl}: {n} cases, {bad} failures, {time.time() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
