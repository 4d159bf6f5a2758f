"""``MODEL_PATH``'s config.json, read one way for the serve plan, its preflight, the speculative flags and
calibrate.

``MODEL_PATH`` is a local checkpoint directory or a Hugging Face id (``org/name``). A Hub id's config.json
is read from the local Hugging Face cache when it is there (never from the network): ``HF_HUB_CACHE``, else
``HUGGINGFACE_HUB_CACHE``, else ``HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub`` or
``~/.cache/huggingface/hub`` (huggingface_hub's own order), in its layout
``models--org--name/refs/main`` -> ``models--org--name/snapshots/<rev>/config.json``. A Hub id that is not in
the cache has the fields of its published config.json when it is one of ``PUBLISHED``; otherwise nothing
is known about it (``config`` is None, ``moe_format`` is None).

:func:`read` returns a :class:`ModelConfig`; :meth:`ModelConfig.problems` are the lines the serve preflight's
``model`` check (and the MTP script, which needs the config to choose its flags) refuse with.
Imports nothing from ``dsv4_sm120.serving`` or ``dsv4_sm120.calibrate``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Mapping, Optional

HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
CONFIG = "config.json"
DSPARK_SUBFOLDER = "dspark"

# Hub checkpoints known without reading their config (a dry run, or a first start before the download): the
# fields of their published config.json that the serve plan reads (both are DeepSeek-V4 checkpoints).
PUBLISHED = {
    "deepseek-ai/DeepSeek-V4-Flash": {"num_nextn_predict_layers": 1},
    "deepseek-ai/DeepSeek-V4-Flash-0731": {"dspark_block_size": 5, "dspark_noise_token_id": 128799,
                                           "dspark_target_layer_ids": [40, 41, 42]},
}
# The routed experts' format of published checkpoints (a Hub id missing here and not in the cache: unknown).
PUBLISHED_MOE_FORMAT = {"deepseek-ai/DeepSeek-V4-Flash": "mxfp4"}


def moe_format_of(config: Mapping) -> str:
    """``nvfp4`` when ``quantization_config.moe_quant_algo`` is NVFP4 (``make convert-nvfp4`` output), else
    ``mxfp4`` (the released experts)."""
    qc = config.get("quantization_config") or {}
    if not isinstance(qc, Mapping):
        return "mxfp4"
    return "nvfp4" if str(qc.get("moe_quant_algo", "")).upper() == "NVFP4" else "mxfp4"


def is_hf_id(model_path: str) -> bool:
    return not model_path.startswith(("/", ".", "~")) and bool(HF_ID.match(model_path))


def absolute_if_local(model_path: str) -> str:
    """``model_path`` as a process that runs elsewhere must get it: a local path (one that exists here, or one written
    as a path: starting with ``/``, ``.`` or ``~``) absolute against the current directory, ``~`` expanded; anything
    else (a Hugging Face id) unchanged. The servers run in their run directory, where a relative ``out/nvfp4`` would
    not exist and would read as a Hub id."""
    expanded = os.path.expanduser(model_path)
    if model_path and (model_path.startswith(("/", ".", "~")) or os.path.exists(expanded)):
        return os.path.abspath(expanded)
    return model_path


def hub_cache_dir(environ: Optional[Mapping[str, str]] = None) -> Path:
    """The Hugging Face hub cache directory, resolved the way huggingface_hub resolves it."""
    env = os.environ if environ is None else environ

    def expand(p: str) -> str:
        return os.path.expanduser(os.path.expandvars(p))

    for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(k):
            return Path(expand(env[k]))
    if env.get("HF_HOME"):
        return Path(expand(env["HF_HOME"])) / "hub"
    xdg = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache")
    return Path(expand(xdg)) / "huggingface" / "hub"


def hub_snapshot(repo_id: str, environ: Optional[Mapping[str, str]] = None) -> Optional[Path]:
    """The cached snapshot directory of ``repo_id``'s ``main`` revision, or None when it is not cached."""
    repo = hub_cache_dir(environ) / ("models--" + repo_id.replace("/", "--"))
    try:
        rev = (repo / "refs" / "main").read_text().strip()
    except OSError:
        return None
    snap = repo / "snapshots" / rev
    return snap if rev and "/" not in rev and snap.is_dir() else None


@dataclass
class ModelConfig:
    model_path: str
    where: str                       # local | hub-cache | published (a known Hub id, not cached) | hub | invalid
    config: Optional[dict] = None    # None: not read (a problem, or a Hub id nothing is known about)
    source: str = ""                 # what was read, for messages
    problem: Optional[str] = None    # the one line why config.json cannot be used (where is local/hub-cache/invalid)
    directory: Optional[Path] = None  # the checkpoint directory (local, or the cache snapshot)
    has_dspark_subfolder: bool = False

    @property
    def is_deepseek_v4(self) -> Optional[bool]:
        """Whether config.json names a DeepSeek-V4 model (None when it was not read)."""
        if self.config is None:
            return None
        if self.where == "published":
            return True
        return str(self.config.get("model_type", "")).startswith("deepseek_v4")

    def problems(self) -> List[str]:
        """The model check's lines about config.json: missing / unreadable / not JSON / not DeepSeek-V4."""
        if self.problem:
            return [self.problem]
        if self.config is not None and not self.is_deepseek_v4:
            where = "" if self.where == "local" else f" ({self.source})"
            return [f"MODEL_PATH={self.model_path}: model_type is {self.config.get('model_type')!r}{where}, "
                    f"expected deepseek_v4 (this deployment serves DeepSeek-V4 checkpoints)"]
        return []

    def warnings(self) -> List[str]:
        """What the model check says without refusing: a Hub id nothing here knows (a download is plausible)."""
        if self.where != "hub" or self.problem:
            return []
        return [f"WARNING: MODEL_PATH={self.model_path} is neither in the local Hugging Face cache nor a published "
                f"checkpoint this plan knows ({', '.join(PUBLISHED)}): SGLang downloads it at start, and nothing here "
                f"checks that it is a DeepSeek-V4 checkpoint"]

    @property
    def moe_format(self) -> Optional[str]:
        """``nvfp4`` / ``mxfp4`` of the routed experts, or None when unknown here (config.json not read or unusable,
        or a published Hub id whose format is not listed)."""
        if self.problems() or self.config is None:
            return None
        if self.where == "published":
            return PUBLISHED_MOE_FORMAT.get(self.model_path)
        return moe_format_of(self.config)


def _load(model_path: str, f: Path, label: str) -> tuple:
    """(config dict or None, problem line or None) of one config.json."""
    if not f.is_file() or not os.access(f, os.R_OK):
        return None, f"MODEL_PATH={model_path} has no readable {label}"
    try:
        cfg = json.loads(f.read_text())
    except OSError as e:
        return None, f"MODEL_PATH={model_path}: cannot read {label} ({e.strerror})"
    except ValueError as e:
        return None, f"MODEL_PATH={model_path}: {label} is not valid JSON ({e})"
    if not isinstance(cfg, dict):
        return None, f"MODEL_PATH={model_path}: {label} is not a JSON object"
    return cfg, None


def _distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions)."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


TYPO_DISTANCE = 2


def unknown_hub_id_problem(model_path: str) -> Optional[str]:
    """Why a Hub id that is neither cached nor published is almost surely a mistake (None: a download is plausible):
    it differs from a published id only in case or by at most ``TYPO_DISTANCE`` characters (a typo), or its first
    part is a local directory (a local path that does not exist, e.g. ``out/nvfp4`` run from the wrong place)."""
    for known in PUBLISHED:
        if model_path.lower() == known.lower() or _distance(model_path, known) <= TYPO_DISTANCE:
            return (f"MODEL_PATH={model_path} is not in the local Hugging Face cache nor a published checkpoint: did "
                    f"you mean {known}?")
    first = model_path.partition("/")[0]
    if os.path.isdir(first):
        return (f"MODEL_PATH={model_path} does not exist here ({os.path.abspath(first)} does: a local path?) and is "
                f"not a Hugging Face id in the local cache nor a published checkpoint")
    return None


def read(model_path: str, environ: Optional[Mapping[str, str]] = None) -> ModelConfig:
    """MODEL_PATH's config (module doc). Never raises for a bad checkpoint: ``problems()`` says what is wrong."""
    local = Path(os.path.expanduser(model_path))
    if local.exists():
        if not local.is_dir():
            return ModelConfig(model_path, "local", problem=f"MODEL_PATH={model_path} is not a directory")
        f = local / CONFIG
        cfg, problem = _load(model_path, f, CONFIG)
        return ModelConfig(model_path, "local", cfg, str(f), problem, local,
                           (local / DSPARK_SUBFOLDER / CONFIG).is_file())
    if not is_hf_id(model_path):
        return ModelConfig(model_path, "invalid",
                           problem=f"MODEL_PATH={model_path} does not exist and is not a Hugging Face id (org/name)")
    snap = hub_snapshot(model_path, environ)
    if snap is not None and (snap / CONFIG).exists():
        f = snap / CONFIG
        cfg, problem = _load(model_path, f, f"config.json in the Hugging Face cache ({f})")
        return ModelConfig(model_path, "hub-cache", cfg, f"config.json in the local Hugging Face cache ({f})", problem,
                           snap, (snap / DSPARK_SUBFOLDER / CONFIG).is_file())
    if model_path in PUBLISHED:
        return ModelConfig(model_path, "published", dict(PUBLISHED[model_path]),
                           "the published config.json of this Hub id, not in the local Hugging Face cache")
    return ModelConfig(model_path, "hub", source="a Hub id not in the local Hugging Face cache",
                       problem=unknown_hub_id_problem(model_path))
