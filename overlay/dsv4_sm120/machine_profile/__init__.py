"""Machine profile: what `make calibrate` measured on one GPU model, and the lookup the SGLang glue uses.

One JSON per GPU model in ``<repo>/configs/profiles/<GPU_name>.json`` (spaces -> underscores, as SGLang names
its config files). The directory is, in order: ``$DSV4_SM120_PROFILE_DIR`` (empty = profiles off);
``<repo_root>/configs/profiles`` where ``repo_root`` is the checkout that patched the installed SGLang (its
``.dsv4_sm120/manifest.json``); ``configs/profiles`` next to this overlay's source tree.

Schema (``schema`` = :data:`SCHEMA`)::

    {"schema": 1, "gpu": "<torch.cuda.get_device_name()>", "created_at": "<UTC ISO>",
     "versions": {"sglang", "flashinfer", "triton", "torch", "cuda", "driver", "dsv4_sm120"},
     "deployment": {"tp", "heads", "draft_tokens", "moe_format", ...},
     "decisions": {"<name>": {"bucket_kind": "rows"|"tokens", "default": "<choice>", "note": "...",
                              "buckets": {"<n>": {"winner": "<choice>"|null,
                                                  "candidates": {"<choice>": {"status": "ok"|"failed"|
                                                     "unavailable"|"rejected", "us": float|null,
                                                     "err": float|null, "tol": float|null, "reason": str}}}}}}}

The ``allreduce`` decision has per-server fields instead of buckets (``servers``: ``prefill`` / ``decode`` -> the GPU
group, the measured sizes and the choice; docs/pcie.md), validated by ``allreduce_choice.validate_entry``; the
``shape`` decision (``make verify ARGS='--stages shape'``: the serving shape and draft length per variant and
concurrency; docs/verify.md) by ``shape_decision.validate_entry``.

Version keying (:func:`match`): a profile is used only when the GPU name is exactly the running one and
:data:`MUST_MATCH` versions are equal: ``sglang``, ``flashinfer``, ``triton``, ``torch`` -- they build or run the
candidates, so a change can reorder the winners. :data:`WARN_ONLY` (``cuda``, ``driver``, ``dsv4_sm120``) only
warn: a driver update rarely reorders kernels, and requiring our exact commit would void every profile at each
commit (rerun ``make calibrate`` after kernel changes). A running version that cannot be determined counts as a
mismatch for MUST_MATCH fields.

:func:`decision` is the one call the SGLang glue makes: ``decision(name, bucket) -> (choice, source)`` with
``source`` = ``"profile <file>"`` or ``"default"``. Buckets: a call with ``n`` rows/tokens uses the smallest
measured bucket ``>= n`` (the largest when ``n`` is beyond them), so a CUDA graph of batch ``n`` is routed
statically. This module imports neither torch nor SGLang at import time.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import time
from pathlib import Path
from typing import Dict, Optional, Tuple
from .. import settings
from ..fileio import atomic_write_json
from ..paths import CHECKOUT_DIR, applied_repo_root, data_dir

logger = logging.getLogger(__name__)

SCHEMA = 1
ENV_DIR = "DSV4_SM120_PROFILE_DIR"
VERSION_FIELDS = ("sglang", "flashinfer", "triton", "torch", "cuda", "driver", "dsv4_sm120")
MUST_MATCH = ("sglang", "flashinfer", "triton", "torch")
WARN_ONLY = ("cuda", "driver", "dsv4_sm120")
STATUSES = ("ok", "failed", "unavailable", "rejected")

# What the product does without a profile (the fixed choices the patches make today).
DEFAULTS: Dict[str, str] = {
    "attention.swa": "dsv4", "attention.swa_c4": "dsv4", "attention.swa_c128": "dsv4",
    "moe.nvfp4": "flashinfer_cutlass", "moe.mxfp4": "flashinfer_mxfp4", "fp8_gemm": "default",
}


class ProfileError(ValueError):
    """A profile file that is not valid (one line: which file, what is wrong)."""


def file_stem(gpu: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", gpu.strip().replace(" ", "_"))


def profile_dir() -> Optional[Path]:
    """Where profiles live (module doc: :func:`dsv4_sm120.paths.data_dir`); None when switched off. The directory
    may not exist yet."""
    return data_dir(ENV_DIR, "profiles")


def profile_path(gpu: str, directory: Optional[Path] = None) -> Optional[Path]:
    d = directory if directory is not None else profile_dir()
    return None if d is None else Path(d) / f"{file_stem(gpu)}.json"


# -------------------------------------------------------------------------- validation, load, save

def validate(p: object, source: str = "profile") -> dict:
    """Return ``p`` when it follows the schema, else raise :class:`ProfileError` naming ``source``."""
    def bad(msg):
        raise ProfileError(f"{source}: {msg}")

    if not isinstance(p, dict):
        bad("not a JSON object")
    if p.get("schema") != SCHEMA:
        bad(f"schema {p.get('schema')!r}, expected {SCHEMA} (rerun `make calibrate`)")
    if not isinstance(p.get("gpu"), str) or not p["gpu"]:
        bad("no GPU name")
    v = p.get("versions")
    if not isinstance(v, dict) or any(k not in v for k in VERSION_FIELDS):
        bad(f"versions must hold {', '.join(VERSION_FIELDS)}")
    decs = p.get("decisions")
    if not isinstance(decs, dict):
        bad("no decisions object")
    for name, d in decs.items():
        if name == "allreduce":   # per-server fields instead of buckets (machine_profile/allreduce_choice.py)
            from .allreduce_choice import validate_entry

            why = validate_entry(d)
            if why:
                bad(f"decision 'allreduce': {why}")
            continue
        if name == "shape":       # the serving shape per variant (make verify --stages shape; machine_profile/shape_decision.py)
            from .shape_decision import validate_entry as validate_shape

            why = validate_shape(d)
            if why:
                bad(f"decision 'shape': {why}")
            continue
        if not isinstance(d, dict) or not isinstance(d.get("buckets"), dict):
            bad(f"decision {name!r} has no buckets")
        for b, row in d["buckets"].items():
            # the glue finds a bucket by str(int(key)): "01" or "+1" would validate and then miss (KeyError)
            if not (isinstance(b, str) and b.isascii() and b.isdigit() and int(b) > 0 and str(int(b)) == b):
                bad(f"decision {name!r}: bucket {b!r} is not a positive integer written plainly (e.g. \"8\")")
            cands = row.get("candidates") if isinstance(row, dict) else None
            if not isinstance(cands, dict):
                bad(f"decision {name!r} bucket {b}: no candidates")
            for c, r in cands.items():
                if not isinstance(r, dict) or r.get("status") not in STATUSES:
                    bad(f"decision {name!r} bucket {b}: candidate {c!r} has no valid status")
            w = row.get("winner")
            if w is not None and not isinstance(w, str):
                bad(f"decision {name!r} bucket {b}: winner {w!r} is not a name")
            if w is not None and (w not in cands or cands[w]["status"] != "ok"):
                bad(f"decision {name!r} bucket {b}: winner {w!r} did not pass the correctness gate")
        ov = d.get("overall")
        if ov is not None and not (isinstance(ov, dict)
                                   and isinstance(ov.get("recommended_backend"), (str, type(None)))):
            bad(f"decision {name!r}: overall must be an object whose recommended_backend is a name")
    return p


def load(path: Path) -> dict:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except OSError as e:
        raise ProfileError(f"{path}: cannot read ({e.strerror})") from None
    except ValueError as e:
        raise ProfileError(f"{path}: not valid JSON ({e})") from None
    return validate(data, str(path))


def save(profile: dict, path: Path) -> Path:
    """Validate, then write atomically (temp file in the same directory, fsync, rename): a crash at any
    point leaves the previous profile intact."""
    validate(profile, str(path))
    path = Path(path)
    atomic_write_json(path, profile, indent=1, sort_keys=False)
    return path


# -------------------------------------------------------------------------- versions and matching

def _dist_version(name: str) -> Optional[str]:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _git_commit() -> Optional[str]:
    repo = applied_repo_root() or CHECKOUT_DIR
    try:
        r = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                           text=True, timeout=10)
        if r.returncode == 0 and r.stdout.strip():
            d = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
            return r.stdout.strip() + ("-dirty" if d.returncode == 0 and d.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def _driver() -> Optional[str]:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                           capture_output=True, text=True, timeout=20)
        out = r.stdout.strip().splitlines()
        return out[0].strip() if r.returncode == 0 and out else None
    except (OSError, subprocess.SubprocessError):
        return None


def _torch_cuda() -> Optional[str]:
    """``torch.version.cuda`` without importing torch where it is not imported yet: the serve plan reads profiles
    and must stay torch-free (a torch import there costs seconds); torch writes the value into its
    ``torch/version.py`` at build time."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        return getattr(getattr(torch, "version", None), "cuda", None)
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        text = Path(distribution("torch").locate_file("torch/version.py")).read_text()
    except (ImportError, PackageNotFoundError, OSError, ValueError):
        return None
    m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]*)['\"]", text, re.M)
    return (m.group(1) or None) if m else None


def running_versions() -> Dict[str, Optional[str]]:
    """The versions this process would run with (None where one cannot be determined)."""
    from dsv4_sm120 import __version__

    commit = _git_commit()
    return {"sglang": _dist_version("sglang"), "flashinfer": _dist_version("flashinfer-python"),
            "triton": _dist_version("triton"), "torch": _dist_version("torch"), "cuda": _torch_cuda(),
            "driver": _driver(), "dsv4_sm120": f"{__version__}+{commit}" if commit else __version__}


_VERSIONS: Dict[str, Optional[str]] = {}


def _process_versions() -> Dict[str, Optional[str]]:
    """:func:`running_versions`, found once per process (they do not change while a server runs)."""
    if not _VERSIONS:
        _VERSIONS.update(running_versions())
    return dict(_VERSIONS)


def match(profile: dict, gpu: str, versions: Dict[str, Optional[str]]) -> Tuple[bool, list]:
    """(usable, reasons): reasons name every mismatch; a MUST_MATCH or GPU mismatch makes it unusable,
    WARN_ONLY mismatches are returned as warnings with usable True."""
    reasons = []
    ok = True
    if profile.get("gpu") != gpu:
        return False, [f"profile is for GPU {profile.get('gpu')!r}, this is {gpu!r}"]
    pv = profile.get("versions", {})
    for k in MUST_MATCH:
        if versions.get(k) is None or pv.get(k) != versions.get(k):
            ok = False
            reasons.append(f"{k} {pv.get(k)} in profile, {versions.get(k)} running (rerun `make calibrate`)")
    for k in WARN_ONLY:
        if pv.get(k) != versions.get(k):
            reasons.append(f"warning: {k} {pv.get(k)} in profile, {versions.get(k)} running")
    return ok, reasons


def winner(profile: dict, name: str, bucket: int) -> Optional[str]:
    """The measured winner of decision ``name`` for a call of ``bucket`` rows/tokens (module doc), or None."""
    d = profile.get("decisions", {}).get(name)
    if not d or not d.get("buckets"):
        return None
    rows = {int(b): r for b, r in d["buckets"].items()}
    keys = sorted(rows)
    pick = next((b for b in keys if b >= bucket), keys[-1])
    return rows[pick].get("winner")


# -------------------------------------------------------------------------- the glue's entry point

_CACHE: Dict[str, object] = {}


def _current_gpu() -> Optional[str]:
    """The current CUDA device's name (``DSV4_SM120_TEST_GPU_NAME`` when set: CPU tests of the glue)."""
    forced = settings.get("DSV4_SM120_TEST_GPU_NAME")
    if forced:
        return forced
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(torch.cuda.current_device())
    except Exception:  # noqa: BLE001
        pass
    return None


def active_profile(gpu: Optional[str] = None, versions: Optional[dict] = None,
                   directory: Optional[Path] = None) -> Tuple[Optional[dict], Optional[Path], list]:
    """(profile or None, its path, reasons). Cached per (gpu, directory); never raises."""
    gpu = gpu or _current_gpu()
    if gpu is None:
        return None, None, ["no CUDA GPU"]
    try:
        path = profile_path(gpu, directory)
    except settings.SettingsError as e:   # refused at start-up too; here it only means no profile
        logger.warning("dsv4_sm120 profile: %s; ignored: stock decisions", e)
        return None, None, [str(e)]
    key = f"{gpu}|{path}"
    if key in _CACHE:
        return _CACHE[key]
    if path is None:
        res = (None, None, [f"{ENV_DIR} is empty: profiles off"])
    elif not path.is_file():
        res = (None, path, [f"no profile {path} (run `make calibrate`)"])
    else:
        try:
            prof = load(path)
            ok, reasons = match(prof, gpu, versions if versions is not None else _process_versions())
            res = (prof if ok else None, path, reasons)
        except ProfileError as e:
            res = (None, path, [f"{e}; ignored: stock decisions"])
        except Exception as e:  # noqa: BLE001 - a profile we cannot read must never stop the server
            res = (None, path, [f"{path}: cannot be used ({type(e).__name__}: {e}); ignored: stock decisions"])
    for r in res[2]:
        logger.warning("dsv4_sm120 profile: %s", r)
    _CACHE[key] = res
    return res


def decision(name: str, bucket: int, default: Optional[str] = None, *, gpu: Optional[str] = None,
             versions: Optional[dict] = None, directory: Optional[Path] = None) -> Tuple[str, str]:
    """``(choice, source)`` for decision ``name`` at ``bucket`` rows/tokens: the profile's winner
    (``source = "profile <file>"``) or ``default`` / :data:`DEFAULTS` (``source = "default"``)."""
    fallback = default if default is not None else DEFAULTS.get(name)
    if fallback is None:
        raise KeyError(f"unknown decision {name!r}; known: {', '.join(sorted(DEFAULTS))}")
    prof, path, _ = active_profile(gpu, versions, directory)
    if prof is not None:
        w = winner(prof, name, int(bucket))
        if w is not None:
            return w, f"profile {path}"
    return fallback, "default"


def bucket_winners(name: str, *, gpu: Optional[str] = None, versions: Optional[dict] = None,
                   directory: Optional[Path] = None) -> Tuple[list, str]:
    """``([(bucket, winner or None), ...] sorted by bucket, source)`` of decision ``name`` in the active
    profile; ``([], "default")`` without one. A call of ``n`` rows/tokens uses the first bucket ``>= n``
    (the last beyond them): :func:`winner`."""
    prof, path, _ = active_profile(gpu, versions, directory)
    d = (prof or {}).get("decisions", {}).get(name)
    if not d or not d.get("buckets"):
        return [], "default"
    rows = sorted((int(b), r.get("winner")) for b, r in d["buckets"].items())
    return rows, f"profile {path}"


def overall(name: str, default: Optional[str] = None, *, gpu: Optional[str] = None,
            versions: Optional[dict] = None, directory: Optional[Path] = None) -> Tuple[str, str, str]:
    """``(choice, source, detail)`` for a decision made once per server (the MoE runner, the FP8 GEMM
    backend): the profile's ``overall.recommended_backend`` when it records one (the FP8 tuner's
    server-wide recommendation), else the winner of the most buckets (a tie keeps ``default`` when it is
    among the tied, else the winner of the larger buckets); ``default`` / :data:`DEFAULTS` without a profile
    or winners. ``detail`` says how the buckets voted, for the log line."""
    fallback = default if default is not None else DEFAULTS.get(name)
    if fallback is None:
        raise KeyError(f"unknown decision {name!r}; known: {', '.join(sorted(DEFAULTS))}")
    prof, path, _ = active_profile(gpu, versions, directory)
    d = (prof or {}).get("decisions", {}).get(name)
    if not d:
        return fallback, "default", ""
    rec = (d.get("overall") or {}).get("recommended_backend")
    if isinstance(rec, str) and rec:
        return rec, f"profile {path}", str((d.get("overall") or {}).get("reason") or "")
    rows, _ = bucket_winners(name, gpu=gpu, versions=versions, directory=directory)
    votes: Dict[str, list] = {}
    for b, w in rows:
        if w is not None:
            votes.setdefault(w, []).append(b)
    if not votes:
        return fallback, "default", "no bucket has a winner"
    top = max(len(v) for v in votes.values())
    tied = [w for w, v in votes.items() if len(v) == top]
    pick = fallback if fallback in tied else max(tied, key=lambda w: max(votes[w]))
    detail = "; ".join(f"{w} won {'M' if d.get('bucket_kind') == 'tokens' else 'T'}="
                       f"{','.join(map(str, bs))}" for w, bs in sorted(votes.items()))
    return pick, f"profile {path}", detail


def default_reason(name: str, gpu: Optional[str] = None) -> str:
    """Why decision ``name`` runs its default, for the glue's log line: no matching profile, or a profile without a
    winner for it."""
    prof, path, _ = active_profile(gpu)
    if prof is not None:
        return f"default: profile {path} has no winner for {name} here"
    return "default: no matching profile for this GPU; make calibrate picks by measurement"


def status(gpu: str, versions: Optional[dict] = None, directory: Optional[Path] = None) -> dict:
    """``{"usable", "path", "reasons"}`` for ``gpu`` with ``versions`` (default: this process's): what the
    serve preflight reports (``python -m dsv4_sm120.machine_profile status``)."""
    prof, path, reasons = active_profile(gpu, versions, directory)
    return {"gpu": gpu, "usable": prof is not None, "path": str(path) if path else None,
            "reasons": list(reasons)}


def clear_cache() -> None:
    _CACHE.clear()


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def main(argv=None) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m dsv4_sm120.machine_profile",
                                 description="Whether a machine profile applies to a GPU with this environment's "
                                             "versions (the serve preflight's profile check).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("status", help="print whether a profile matches GPU (JSON with --json)")
    st.add_argument("--gpu", action="append", required=True, help="GPU name as nvidia-smi prints it (repeatable)")
    st.add_argument("--dir", type=Path, help="profile directory (default: the one the patched SGLang reads)")
    st.add_argument("--json", action="store_true", help="one JSON object per GPU name, one per line")
    a = ap.parse_args(argv)
    logging.getLogger(__name__).setLevel(logging.ERROR)   # the reasons are printed, not logged
    versions = running_versions()
    for g in dict.fromkeys(a.gpu):
        res = status(g, versions, a.dir)
        if a.json:
            print(json.dumps(res))
        else:
            print(f"{g}: {'profile ' + str(res['path']) if res['usable'] else 'no usable profile'}"
                  + "".join(f"\n  {r}" for r in res["reasons"]))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
