"""The project's tuned FP8 block-GEMM configs: their file names and schema, where patched SGLang finds them, and
which FP8 GEMM backend to serve with.

SGLang 0.5.23 reads the Triton ``w8a8_block_fp8_matmul`` tile configs only from
``sglang/kernels/ops/gemm/configs/`` inside the wheel, under the name

    N={N},K={K},device_name={dev},dtype=fp8_w8a8,block_shape=[{bn}, {bk}].json

(``dev`` = ``torch.cuda.get_device_name().replace(" ", "_")``), a JSON mapping token counts M (string keys) to tile
configs, of which it uses the entry of the nearest M. The tuner (:mod:`dsv4_sm120.fp8`) writes these files and the
lookup below finds them for patched SGLang; both use the scheme here (:func:`config_file_name`,
:func:`validate_config_table`), so there is one implementation of it.

Patch ``0004-fp8-config-dir.patch`` makes ``get_w8a8_block_fp8_configs`` ask
:func:`dsv4_sm120.sglang_glue.fp8.project_config_path` first, which calls :func:`project_config_path` here; when
that returns None SGLang's own directory is used as before. The project directory (:func:`project_config_dir`)
is, in this order (:func:`dsv4_sm120.paths.data_dir`):

1. ``$DSV4_SM120_FP8_CONFIG_DIR`` when set (an empty value turns the project directory off: SGLang's own configs
   only; a value that is not a directory: one warning, SGLang's own);
2. ``<repo_root>/configs/fp8`` where ``repo_root`` is the checkout the patches were applied from (recorded at
   apply time in ``<sglang>/.dsv4_sm120/manifest.json``);
3. ``configs/fp8`` next to this overlay's source tree (a checkout used through ``PYTHONPATH=overlay`` or an
   editable install).

:func:`recommended_fp8_gemm_backend` says whether ``--fp8-gemm-backend triton`` beats SGLang's
default on a device: the machine profile's ``fp8_gemm`` decision when a profile matches the GPU and
this environment's versions (``make calibrate``; :mod:`dsv4_sm120.machine_profile`), else the
tuner's summary. The serve planner calls it (:func:`dsv4_sm120.serving.plan.fp8_gemm_backend`, for
``FP8_GEMM_BACKEND=auto``); ``python -m dsv4_sm120.fp8_configs backend-args`` prints its answer.

This module imports neither torch nor SGLang.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional, Tuple

from dsv4_sm120 import settings
from dsv4_sm120.paths import data_dir

logger = logging.getLogger(__name__)

ENV_CONFIG_DIR = "DSV4_SM120_FP8_CONFIG_DIR"
ENV_BACKEND = "DSV4_SM120_FP8_GEMM_BACKEND"


# --------------------------------------------------------------------------
# File names and schema (the tuner writes, the lookup reads)
# --------------------------------------------------------------------------

# SGLang 0.5.23, kernels/ops/gemm/fp8_kernel.py, get_w8a8_block_fp8_configs
CONFIG_NAME_RE = re.compile(
    r"^N=(?P<N>[1-9][0-9]*),K=(?P<K>[1-9][0-9]*),device_name=(?P<dev>[^,/\\]+),"
    r"dtype=fp8_w8a8,block_shape=\[(?P<bn>[1-9][0-9]*), (?P<bk>[1-9][0-9]*)\]\.json$"
)
REQUIRED_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
OPTIONAL_KEYS = {"SWAP_AB": bool, "SPLIT_K": int}  # honoured by SGLang 0.5.23 on sm_90 only


def sglang_device_name(raw: str) -> str:
    """The device-name field SGLang puts in config file names (spaces -> underscores)."""
    return raw.replace(" ", "_")


def config_file_name(N: int, K: int, device_name: str, block_n: int = 128, block_k: int = 128) -> str:
    """The exact file name SGLang 0.5.23 looks up for a block-FP8 GEMM of weight shape (N, K)."""
    dev = sglang_device_name(device_name)
    return f"N={N},K={K},device_name={dev},dtype=fp8_w8a8,block_shape=[{block_n}, {block_k}].json"


def parse_config_file_name(name: str) -> Optional[Dict[str, object]]:
    """The fields of a block-FP8 config file name (N, K, device_name, block_n, block_k), or None."""
    m = CONFIG_NAME_RE.match(name)
    if not m:
        return None
    return {"N": int(m["N"]), "K": int(m["K"]), "device_name": m["dev"],
            "block_n": int(m["bn"]), "block_k": int(m["bk"])}


def summary_file_stem(device_name: str) -> str:
    """The tuner's summary for a device is ``<stem>.json`` / ``<stem>.md`` next to the config files."""
    return f"summary_{sglang_device_name(device_name)}"


def validate_config_table(table: object, block_k: int = 128) -> None:
    """Raise ValueError unless ``table`` is a config JSON SGLang 0.5.23 can use as is."""
    if not isinstance(table, dict) or not table:
        raise ValueError("config must be a non-empty JSON object mapping M to a tile config")
    for key, cfg in table.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) > 0):
            raise ValueError(f"key {key!r} is not a positive integer M")
        if not isinstance(cfg, dict):
            raise ValueError(f"M={key}: value is not an object")
        missing = [k for k in REQUIRED_KEYS if k not in cfg]
        if missing:
            raise ValueError(f"M={key}: missing {missing}")
        extra = [k for k in cfg if k not in REQUIRED_KEYS and k not in OPTIONAL_KEYS]
        if extra:
            raise ValueError(f"M={key}: unknown keys {extra}")
        for k in REQUIRED_KEYS:
            v = cfg[k]
            if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
                raise ValueError(f"M={key}: {k}={v!r} is not a positive integer")
        for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps"):
            if cfg[k] & (cfg[k] - 1):
                raise ValueError(f"M={key}: {k}={cfg[k]} is not a power of two")
        if min(cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]) < 16:
            raise ValueError(f"M={key}: Triton tl.dot needs every block size >= 16")
        bk = cfg["BLOCK_SIZE_K"]
        if bk > block_k or block_k % bk:
            raise ValueError(f"M={key}: BLOCK_SIZE_K={bk} must divide the quantization block {block_k}")
        if "SWAP_AB" in cfg and not isinstance(cfg["SWAP_AB"], bool):
            raise ValueError(f"M={key}: SWAP_AB must be true/false")
        if "SPLIT_K" in cfg:
            s = cfg["SPLIT_K"]
            if not (isinstance(s, int) and not isinstance(s, bool) and s > 0 and not s & (s - 1)):
                raise ValueError(f"M={key}: SPLIT_K={s!r} must be a power of two")


def config_for_m(table: Dict[str, dict], M: int, block_k: int = 128) -> dict:
    """The tile config SGLang uses at token count ``M`` from a loaded table: the entry of the nearest M (the
    first in file order on a tie), with a BLOCK_SIZE_K below the quantization block that does not divide it
    raised to the block (as SGLang's lookup does on CUDA)."""
    by_m = {int(k): v for k, v in table.items()}
    cfg = dict(by_m[min(by_m, key=lambda x: abs(x - M))])
    if cfg.get("BLOCK_SIZE_K", block_k) < block_k and block_k % cfg["BLOCK_SIZE_K"]:
        cfg["BLOCK_SIZE_K"] = block_k
    return cfg


def read_json_object(path: Path) -> Optional[dict]:
    """The JSON object in ``path``, or None when it is missing, unreadable, not JSON or not an object."""
    try:
        with open(path) as fh:
            d = json.load(fh)
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------
# Where patched SGLang finds the project's configs
# --------------------------------------------------------------------------

_warned: set = set()    # one warning per directory / file and process


def _warn_once(key: str, msg: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


def project_config_dir(sglang_root: Optional[Path] = None) -> Optional[Path]:
    """The project's FP8 config directory (module doc), or None when switched off or not a directory. A setting
    that cannot be used raises its one line (SettingsError, a ValueError)."""
    d = data_dir(ENV_CONFIG_DIR, "fp8", sglang_root)
    if d is None or d.is_dir():
        return d
    if settings.raw(ENV_CONFIG_DIR) is not None:
        _warn_once(str(d), "%s=%s is not a directory; using SGLang's own FP8 GEMM configs", ENV_CONFIG_DIR, d)
    return None


def project_config_path(json_file_name: str, sglang_root: Optional[Path] = None) -> Optional[str]:
    """Path of the project's config named ``json_file_name`` (SGLang's name), or None to use SGLang's own: no
    project directory, no such file, a name that is not a plain file name, or a file that is not a valid config
    (one warning). The glue's caller turns any error of the lookup itself into SGLang's own configs."""
    if os.path.basename(json_file_name) != json_file_name:
        return None
    d = project_config_dir(sglang_root)
    if d is None:
        return None
    path = d / json_file_name
    if not path.is_file():
        return None
    try:
        with open(path) as fh:
            table = json.load(fh)
        info = parse_config_file_name(json_file_name)
        validate_config_table(table, block_k=int(info["block_k"]) if info else 128)
    except (OSError, ValueError) as e:
        _warn_once(str(path), "ignoring invalid FP8 GEMM config %s (%s); using SGLang's own", path, e)
        return None
    return str(path)


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
    from dsv4_sm120 import machine_profile as P

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
