"""Where things are: this checkout, the checkout the patches were applied from, the cache, config directories.

* ``PACKAGE_DIR`` / ``OVERLAY_DIR`` / ``CHECKOUT_DIR``: this source tree (``overlay/dsv4_sm120``, ``overlay``,
  the checkout holding it). In an installed copy ``CHECKOUT_DIR`` is wherever the copy lies; :func:`repo_root`
  then answers the checkout recorded at install time.
* :func:`repo_root`: the product checkout (``DSV4_SM120_REPO_ROOT``, else this tree, else the recorded one).
* :func:`applied_repo_root`: the checkout recorded in an SGLang tree's apply manifest (what the patched SGLang
  reads its configs from).
* :func:`data_dir`: where the running server's per-device data of one kind lives (``configs/<kind>``): the
  setting, else the checkout that applied the patches, else this source tree (machine profiles, FP8 configs).
* :func:`cache_dir`: ``DSV4_SM120_CACHE``.

Standard library and :mod:`dsv4_sm120.settings` only: the patch machinery runs it from a bare checkout.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Optional

from dsv4_sm120 import settings

PACKAGE_DIR = Path(__file__).resolve().parent
OVERLAY_DIR = PACKAGE_DIR.parent
CHECKOUT_DIR = OVERLAY_DIR.parent
CONFIGS_DIR = CHECKOUT_DIR / "configs"

# the apply record inside a patched SGLang tree: <sglang>/STATE_DIR/MANIFEST, backups under STATE_DIR/BACKUP_DIR
STATE_DIR = ".dsv4_sm120"
MANIFEST = "manifest.json"
BACKUP_DIR = "backup"


def repo_root() -> Path:
    """The product checkout this module belongs to.

    Run from the checkout (PYTHONPATH=overlay) that is overlay/dsv4_sm120/../..; the copy `make apply-patches`
    installs into an environment records its checkout in ``_build.REPO_ROOT``.  DSV4_SM120_REPO_ROOT overrides both.
    """
    env = settings.get("DSV4_SM120_REPO_ROOT")
    if env:
        return Path(env).resolve()
    here = CHECKOUT_DIR
    if (here / "patches" / "series").is_file():
        return here
    try:
        from dsv4_sm120 import _build  # only in an installed copy
    except ImportError:
        return here
    recorded = Path(getattr(_build, "REPO_ROOT", "") or here)
    return recorded if (recorded / "patches" / "series").is_file() else here


def checkout_root() -> Path:
    """``DSV4_SM120_REPO_ROOT`` when set, else the checkout holding this source tree."""
    env = settings.get("DSV4_SM120_REPO_ROOT")
    return Path(env).resolve() if env else CHECKOUT_DIR


def cache_dir() -> Path:
    return Path(settings.get("DSV4_SM120_CACHE"))


def caller_environ() -> Dict[str, str]:
    """This process's environment with the caller's own PYTHONPATH: launchers (the Makefile, serve/) put the
    checkout's overlay on PYTHONPATH to run our own modules and keep the caller's value in
    DSV4_SM120_ORIG_PYTHONPATH."""
    env = dict(os.environ)
    orig = settings.raw("DSV4_SM120_ORIG_PYTHONPATH")
    if orig is not None:
        if orig:
            env["PYTHONPATH"] = orig
        else:
            env.pop("PYTHONPATH", None)
    return env


def read_manifest(root: Path) -> Optional[dict]:
    """The apply manifest of the SGLang tree ``root``; None when it has none."""
    mf = Path(root) / STATE_DIR / MANIFEST
    if not mf.is_file():
        return None
    return json.loads(mf.read_text())


def installed_sglang_root() -> Optional[Path]:
    """The directory of the ``sglang`` package this interpreter imports, or None when there is none."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).resolve().parent


def applied_repo_root(sglang_root: Optional[Path] = None) -> Optional[Path]:
    """The checkout the patches were applied from, as recorded in the apply manifest of ``sglang_root``
    (default: the installed SGLang); None when there is no SGLang, no manifest, or it names no checkout."""
    if sglang_root is None:
        sglang_root = installed_sglang_root()
    if sglang_root is None:
        return None
    try:
        repo = (read_manifest(sglang_root) or {}).get("repo_root")
    except (OSError, ValueError, AttributeError):
        return None
    return Path(repo) if repo and isinstance(repo, str) else None


def data_dir(setting: str, kind: str, sglang_root: Optional[Path] = None) -> Optional[Path]:
    """The directory of one kind of per-device data the patched SGLang reads (``kind``: ``profiles``, ``fp8``), in
    this order: the setting ``setting`` when set (empty: None, that data switched off; the value validated and
    expanded by :func:`settings.get`, which raises its one line for a value it cannot use); else ``configs/<kind>``
    of the checkout the patches were applied from (:func:`applied_repo_root`), when that checkout has a
    ``configs/`` directory; else ``configs/<kind>`` of this source tree. The directory may not exist."""
    env = settings.raw(setting)
    if env is not None:
        return Path(settings.get(setting)) if env.strip() else None
    repo = applied_repo_root(sglang_root)
    if repo is not None and (repo / "configs").is_dir():
        return repo / "configs" / kind
    return CONFIGS_DIR / kind
