"""Where patched SGLang finds tuned FP8 block-GEMM configs, and which FP8 GEMM backend to serve with.

SGLang 0.5.23 reads the Triton ``w8a8_block_fp8_matmul`` tile configs only from
``sglang/kernels/ops/gemm/configs/`` inside the wheel, under the name
``N={N},K={K},device_name={dev},dtype=fp8_w8a8,block_shape=[{bn}, {bk}].json``
(``dev`` = ``torch.cuda.get_device_name().replace(" ", "_")``; the scheme and the
schema check are in :mod:`dsv4_sm120.fp8.configs`).  Patch
``0004-fp8-config-dir.patch`` makes ``get_w8a8_block_fp8_configs`` ask
:func:`dsv4_sm120.sglang_glue.fp8.project_config_path` first, which looks in
:func:`project_config_dir` (defined there); when that returns None SGLang's own directory is used as before.

The project directory is, in this order:

1. ``$DSV4_SM120_FP8_CONFIG_DIR`` when set (an empty value turns the project
   directory off: SGLang's own configs only);
2. ``<repo_root>/configs/fp8`` where ``repo_root`` is the checkout the patches
   were applied from (recorded at apply time in
   ``<sglang>/.dsv4_sm120/manifest.json``);
3. ``configs/fp8`` next to this overlay's source tree (a checkout used through
   ``PYTHONPATH=overlay`` or an editable install).

:func:`recommended_fp8_gemm_backend` says whether ``--fp8-gemm-backend triton`` beats SGLang's
default on a device: the machine profile's ``fp8_gemm`` decision when a profile matches the GPU and
this environment's versions (``make calibrate``; :mod:`dsv4_sm120.calibrate.machine_profile`), else the
tuner's summary. The serve planner calls it (:func:`dsv4_sm120.serving.plan.fp8_gemm_backend`, for
``FP8_GEMM_BACKEND=auto``); ``python -m dsv4_sm120.fp8_configs backend-args`` prints its answer.

This module imports neither torch nor SGLang at import time.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional, Tuple

from dsv4_sm120 import settings

# The file naming scheme and the schema check are the tuner's (one implementation for writer and reader);
# re-exported so that this module alone answers every question about the project's config files.
from dsv4_sm120.fp8.configs import (
    CONFIG_NAME_RE,
    OPTIONAL_KEYS,
    REQUIRED_KEYS,
    config_file_name,
    parse_config_file_name,
    read_json_object,
    sglang_device_name,
    summary_file_stem,
    validate_config_table,
)
# where the patched SGLang looks (the glue's reader); re-exported with the rest of the config-file answers
from dsv4_sm120.sglang_glue.fp8 import ENV_CONFIG_DIR, project_config_dir, project_config_path

__all__ = [
    "ENV_CONFIG_DIR", "ENV_BACKEND", "project_config_dir", "load_summary",
    "detect_device_name", "recommended_fp8_gemm_backend",
    "CONFIG_NAME_RE", "OPTIONAL_KEYS", "REQUIRED_KEYS", "config_file_name", "parse_config_file_name",
    "sglang_device_name", "summary_file_stem", "validate_config_table",
]

ENV_BACKEND = "DSV4_SM120_FP8_GEMM_BACKEND"


# --------------------------------------------------------------------------
# Backend recommendation for the serve scripts
# --------------------------------------------------------------------------


def load_summary(device_name: str, config_dir: Optional[Path] = None) -> Optional[dict]:
    """The tuner's summary for ``device_name`` in ``config_dir`` (default: the project directory), or None."""
    d = config_dir if config_dir is not None else project_config_dir()
    if d is None:
        return None
    return read_json_object(Path(d) / (summary_file_stem(device_name) + ".json"))


def detect_device_name() -> Optional[str]:
    """GPU 0's name as torch reports it (nvidia-smi first: it is much faster to start than torch)."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                               capture_output=True, text=True, timeout=20)
            name = r.stdout.strip().splitlines()[0].strip() if r.returncode == 0 and r.stdout.strip() else ""
            if name:
                return name
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return None


def profile_fp8_backend(device_name: str, profile_dir: Optional[Path] = None) -> Optional[Tuple[Optional[str], str]]:
    """(backend or None for SGLang's default, reason) from the machine profile's ``fp8_gemm`` decision for
    ``device_name`` with this environment's versions, or None when no profile applies or it has no such decision.
    One flag per server: the decision's ``overall`` recommendation, else the winner of the most token buckets."""
    from dsv4_sm120.calibrate import machine_profile as P

    try:
        prof, path, _ = P.active_profile(device_name, directory=profile_dir)
        if prof is None or "fp8_gemm" not in prof.get("decisions", {}):
            return None
        choice, source, detail = P.overall("fp8_gemm", "default", gpu=device_name, directory=profile_dir)
    except Exception:  # noqa: BLE001 - an unreadable profile leaves the tuner's summary in charge
        return None
    if source == "default":
        return None
    why = f"{source}" + (f": {detail}" if detail else "")
    return (None, why) if choice in ("default", "auto", "none") else (choice, why)


def recommended_fp8_gemm_backend(device_name: Optional[str] = None,
                                 config_dir: Optional[Path] = None,
                                 profile_dir: Optional[Path] = None) -> Tuple[Optional[str], str]:
    """(backend, reason): the machine profile's ``fp8_gemm`` choice when a profile applies
    (:func:`profile_fp8_backend`; ``profile_dir`` default: the profile module's directory), else ``"triton"``
    when the tuner's summary for this device says Triton wins, else None (keep SGLang's default).
    ``$DSV4_SM120_FP8_GEMM_BACKEND`` overrides both (``auto`` / ``default`` mean None)."""
    env = settings.get(ENV_BACKEND).strip()  # validated: SettingsError (a ValueError) names the variable
    if env:
        if env.lower() in ("auto", "default", "none"):
            return None, f"{ENV_BACKEND}={env}: SGLang's default backend"
        return env, f"{ENV_BACKEND}={env}"
    if device_name is None:
        device_name = detect_device_name()
        if device_name is None:
            return None, "no GPU found: SGLang's default backend"
    prof = profile_fp8_backend(device_name, profile_dir)
    if prof is not None:
        return prof
    summary = load_summary(device_name, config_dir)
    if summary is None:
        return None, f"no FP8 tuning summary for {sglang_device_name(device_name)} (run `make tune-fp8`)"
    decision = summary.get("decision") or {}
    backend = decision.get("recommended_backend")
    reason = decision.get("reason") or "no reason recorded"
    if backend == "triton":
        missing = [s for s in summary.get("shapes", {}).values() if not s.get("complete")]
        if missing or summary.get("pending_shapes"):
            return None, "tuning summary is incomplete (rerun `make tune-fp8` to finish it)"
        return "triton", reason
    return None, reason


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_sm120.fp8_configs",
                                 description="FP8 block-GEMM config lookup and backend choice (see module doc).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("backend-args", help="print the SGLang FP8 GEMM backend arguments to serve with "
                                            "(empty when SGLang's default wins)")
    p.add_argument("--device-name", help="device name as torch reports it (default: GPU 0)")
    p.add_argument("--config-dir", type=Path, help="directory with the tuner's summary (default: project dir)")
    p.add_argument("--explain", action="store_true", help="print the reason on stderr")
    p = sub.add_parser("where", help="print the project config directory in use (empty if none)")
    p = sub.add_parser("lookup", help="print which file SGLang would load for a shape")
    p.add_argument("--N", type=int, required=True)
    p.add_argument("--K", type=int, required=True)
    p.add_argument("--device-name", required=True)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "backend-args":
            backend, reason = recommended_fp8_gemm_backend(a.device_name, a.config_dir)
            if a.explain:
                print(f"fp8 gemm backend: {backend or 'SGLang default'} ({reason})", file=sys.stderr)
            if backend:
                print(f"--fp8-gemm-backend {backend}")
        elif a.cmd == "where":
            d = project_config_dir()
            print(d if d is not None else "")
        elif a.cmd == "lookup":
            name = config_file_name(a.N, a.K, a.device_name)
            p = project_config_path(name)
            print(p if p else f"(not in project dir) {name}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main())
