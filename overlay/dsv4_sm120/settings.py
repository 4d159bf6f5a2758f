"""Every environment variable dsv4_sm120 reads: the one registry.

Each setting is declared once here (name, type, valid values, default, meaning, who reads it) and read
only through :func:`get` / :func:`raw`, which validate: a bad value is a :class:`SettingsError` whose one
line names the variable and the valid values. Ours start with ``DSV4_SM120_``; the serve scripts'
parameters (``MODEL_PATH``, ``PREFILL_GPUS``, ...) keep their short names and are declared, typed, in
``dsv4_sm120.serve_variables.SERVE``, which this registry includes as the group ``serve``.

Who reads a setting (``reader``):

* ``runtime``: the patched SGLang and the kernels, in the server processes;
* ``serve``: the serve scripts (``serve/*.sh``, ``dsv4_sm120.serving``);
* ``tools``: make targets, ``scripts/*.sh``, the patch tool, the FP8 tuner;
* ``dev``: developer switches of our kernels, for tests and benchmarks (the same results as the default; listed
  in docs/DEVELOPING.md, not among the user's settings);
* ``internal``: set by our own launchers for the processes they start (never by hand);
* ``test``: test hooks (the serving stand-ins, simulated failures, GPU test launches).

:func:`validate` returns the problems of an environment (also unknown ``DSV4_SM120_*`` names, i.e.
typos, and names with the retired ``SGLANG_DSV4_`` / ``DSV4_`` prefixes); the glue's startup in the
patched SGLang and the serve preflight both refuse to start with problems.
The serve scripts' short-named parameters are validated by the serve plan, which reads every one of them;
:func:`validate` leaves them out (a server started some other way may inherit, say, a ``NODE_ROLE`` that
means something else to another tool).
``python -m dsv4_sm120.settings`` lists them (``--markdown`` is the README's table, ``--json``,
``--check`` validates the current environment; ``--write-readme`` regenerates the tables of ``TABLES``:
README.md's, docs/serving.md's and docs/DEVELOPING.md's). Importing this module imports nothing heavy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from dsv4_sm120.serve_variables import SERVE

# The MoE runner names :mod:`dsv4_sm120.moe_runner` decides between, and ``DSV4_SM120_MOE_BACKEND``'s choices:
# the registry's strings, which the runner decision takes from here.
MOE_FLAG = "--moe-runner-backend"
#: What stock SGLang 0.5.23 picks for the hybrid format (sm_100 only).
STOCK_HYBRID_BACKEND = "flashinfer_trtllm_routed"
#: The FlashInfer runner that runs ModelOpt NVFP4 MoE on sm_120.
SM120_NVFP4_BACKEND = "flashinfer_cutlass"
#: The overlay's Triton NVFP4 fused-MoE runner backend (``dsv4_sm120.moe.BACKEND_NAME``).
TRITON_NVFP4_BACKEND = "dsv4_triton_nvfp4"
#: The NVFP4 runner when neither the setting nor the machine profile picks one.
NVFP4_DEFAULT = SM120_NVFP4_BACKEND
NVFP4_RUNNERS = (SM120_NVFP4_BACKEND, TRITON_NVFP4_BACKEND)
#: ``DSV4_SM120_MOE_BACKEND``'s values and default.
NVFP4_SETTING_CHOICES = ("auto", SM120_NVFP4_BACKEND, TRITON_NVFP4_BACKEND, "stock")
NVFP4_SETTING_DEFAULT = "auto"

PREFIX = "DSV4_SM120_"
READERS = ("runtime", "serve", "tools", "dev", "internal", "test")
KINDS = ("choice", "bool", "autobool", "int", "float", "path", "text")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingsError(ValueError):
    """A bad value of a setting, as one line naming the variable and what is valid."""


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str                       # one of KINDS
    default: Optional[str]          # None: unset has its own meaning (said in ``meaning``)
    meaning: str
    reader: str                     # one of READERS
    choices: Tuple[str, ...] = ()   # kind "choice": the valid values (compared lower-cased)
    minimum: Optional[float] = None  # kinds "int" / "float": the smallest valid value
    above: bool = False             # kinds "int" / "float": the value must be strictly above ``minimum``
    check: Optional[Callable[[str], Optional[str]]] = None  # extra check of a set value: a problem or None
    values: str = ""                # the valid values in words, for the listing (default: from the kind)
    maximum: Optional[float] = None  # kinds "int" / "float": the largest valid value
    required: bool = False          # set but empty is an error (instead of meaning the default)
    convert: Optional[Callable[[str], object]] = None  # kinds "text" / "path": the typed value of a text
    #   (ValueError: the problem in words); unset or empty gives convert(default or "")

    def _range(self) -> str:
        lo = None if self.minimum is None else f"{'>' if self.above else '>='} {_num(self.minimum)}"
        if self.maximum is None:
            return lo or ""
        if lo is None:
            return f"<= {_num(self.maximum)}"
        if self.above:
            return f"{lo}, <= {_num(self.maximum)}"
        return f"{_num(self.minimum)}..{_num(self.maximum)}"

    def describe_values(self) -> str:
        if self.values:
            return self.values
        if self.kind == "choice":
            return " \\| ".join(c if c else '""' for c in self.choices)
        if self.kind == "bool":
            return "0 \\| 1"
        if self.kind == "autobool":
            return "auto \\| 0 \\| 1"
        if self.kind in ("int", "float"):
            word = "integer" if self.kind == "int" else "number"
            return f"{word} {self._range()}".strip()
        return "path" if self.kind == "path" else "text"

    def parse(self, text: Optional[str]):
        """The typed value of ``text`` (None or empty: the default's value); SettingsError when invalid."""
        if text is not None and not text.strip() and self.required:
            raise SettingsError(f"{self.name} is set but empty: unset it for the default ({self.default}) or set "
                                f"it to {self.describe_values()}")
        if text is None or not text.strip():
            if self.convert is not None:
                return self._converted(self.default or "", self.default or "")
            if self.default is None:
                return None
            if not self.default.strip():
                return _EMPTY[self.kind]
            text = self.default
        v = text.strip()
        if self.kind == "choice":
            v = v.lower()
            if v not in self.choices:
                raise SettingsError(f"{self.name}={text!r} is not valid: expected one of "
                                    f"{', '.join(c or repr(c) for c in self.choices)}")
            return v
        if self.kind in ("bool", "autobool"):
            if self.kind == "autobool" and v.lower() == "auto":
                return "auto"
            if v.lower() in _TRUE:
                return True
            if v.lower() in _FALSE:
                return False
            raise SettingsError(f"{self.name}={text!r} is not valid: expected {'auto, ' if self.kind == 'autobool' else ''}"
                                f"0 or 1 ({BOOL_WORDS})")
        if self.kind in ("int", "float"):
            try:
                num = int(v) if self.kind == "int" else float(v)
            except ValueError:
                raise SettingsError(f"{self.name}={text!r} is not valid: expected "
                                    f"{'an integer' if self.kind == 'int' else 'a number'}") from None
            low = self.minimum is not None and (num <= self.minimum if self.above else num < self.minimum)
            if low or (self.maximum is not None and num > self.maximum) or num != num or num in (_INF, -_INF):
                raise SettingsError(f"{self.name}={text!r} is out of range: expected {self._range()}")
            return num
        if self.convert is not None:
            return self._converted(v, text)
        if self.check is not None:
            problem = self.check(v)
            if problem:
                raise SettingsError(f"{self.name}={text!r} is not valid: {problem}")
        if self.kind == "text":
            return text
        path = os.path.expanduser(v)
        if path.startswith("~"):   # os.path leaves an unknown ~user as is; pathlib would raise where it is used
            raise SettingsError(f"{self.name}={text!r} is not valid: {v.split(os.sep)[0]} is not a user's home "
                                f"directory here; give the path in full")
        return path

    def _converted(self, v: str, text: str):
        try:
            return self.convert(v)
        except ValueError as e:
            raise SettingsError(f"{self.name}={text!r} is not valid: {e}") from None


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


_EMPTY = {"bool": False, "int": 0, "float": 0.0, "path": "", "text": "", "choice": "", "autobool": "auto"}
_INF = float("inf")
# what a yes/no switch takes besides 0 and 1 (said in the listings)
BOOL_WORDS = "also " + ", ".join(f"{t}/{f}" for t, f in zip(_TRUE[1:], _FALSE[1:]))


# ---- checks of free-form values


def _attention_launch(text: str) -> Optional[str]:
    from dsv4_sm120.attention.keys import DecodeInputError, parse_config

    try:
        parse_config(text, "launch config")
    except DecodeInputError as e:
        return str(e).replace("launch config: ", "")
    return None


def _fp8_backend(text: str) -> Optional[str]:
    if text.lower() in ("auto", "default", "none") or re.fullmatch(r"[a-z0-9_]+", text):
        return None
    return "expected auto, default, none or a backend name ([a-z0-9_]+)"


def _selfcheck_fault(text: str) -> Optional[str]:
    if text in ("attention", "attention-raise", "moe", "moe-raise") or re.fullmatch(r"attention-raise-T=[1-9][0-9]*",
                                                                                      text):
        return None
    return "expected attention, attention-raise, attention-raise-T=<rows>, moe or moe-raise"


def _ranks(text: str) -> Optional[str]:
    if re.fullmatch(r"[0-9]+(,[0-9]+)*", text.replace(" ", "")):
        return None
    return "expected ranks as a comma list, e.g. 1 or 0,2"


def _commit_id(text: str) -> Optional[str]:
    if re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", text):
        return None
    return "expected a commit id: 7-40 lowercase hex digits, optionally followed by -dirty"


def _hook(name: str, kind: str, default: Optional[str], meaning: str, **kw) -> Setting:
    """A test hook (reader ``test``): set by the tests and our stand-ins, never by a user."""
    return Setting(name, kind, default, meaning, "test", **kw)


# ---- the registry (order = the order of the listing)

_ATTN_CONFIG_VALUES = "comma list of launch keys, e.g. `impl=tiled` or `e4m3_int_decode=0,maxnreg=0` (docs/attention.md)"

_OURS: Tuple[Setting, ...] = (
    # runtime: the patched SGLang and the kernels
    Setting("DSV4_SM120_DISABLE", "bool", "0",
            "1: the patched SGLang does not import the overlay and runs its stock paths (A/B against upstream)",
            "runtime"),
    Setting("DSV4_SM120_ATTN_BACKEND", "choice", "dsv4",
            "who runs sparse-MLA decode / verify / draft rows on sm_120: `dsv4` = our tensor-core kernel; the "
            "others are SGLang 0.5.23's own sm_120 paths. Unset: the machine profile's winner per row bucket "
            "(`make calibrate`), else `dsv4`; set, it wins over the profile", "runtime",
            choices=("dsv4", "flashinfer", "triton", "torch")),
    Setting("DSV4_SM120_ATTN_PREFILL", "choice", "flashinfer",
            "who runs prefill (extend / mixed) rows when the backend is `dsv4`", "runtime",
            choices=("flashinfer", "dsv4")),
    Setting("DSV4_SM120_ATTN_QK", "choice", "auto",
            "QK path of our decode kernel: `auto` = `bf16`; `fp8` = block-scaled MMA, opt-in if "
            "`make bench-attention` shows it ahead", "runtime", choices=("auto", "bf16", "fp8")),
    Setting("DSV4_SM120_ATTN_CONFIG", "text", "",
            "launch variant of our decode kernel (empty: the launch tables); `make bench-attention` prints the line "
            "to set when a variant wins", "runtime", check=_attention_launch, values=_ATTN_CONFIG_VALUES),
    Setting("DSV4_SM120_ATTN_WS_MB", "float", "256",
            "workspace bound of one decode launch of our attention kernel in MiB (longer calls are cut into row "
            "chunks; tests set it low to make chunks)", "dev", minimum=0, above=True),
    Setting("DSV4_SM120_MOE_BACKEND", "choice", NVFP4_SETTING_DEFAULT,
            "MoE runner of NVFP4 checkpoints on sm_120 when `--moe-runner-backend` is auto: `auto` = the machine "
            "profile's runner, else `flashinfer_cutlass`; `dsv4_triton_nvfp4` = our Triton MoE; `stock` = "
            "SGLang's choice",
            "runtime", choices=NVFP4_SETTING_CHOICES),
    Setting("DSV4_SM120_MOE_PATH", "choice", "auto",
            "compute path of our NVFP4 MoE: `auto` = `fp4` on GPUs with FP4 MMA (sm_100, sm_120), else `bf16`",
            "runtime", choices=("auto", "fp4", "bf16")),
    Setting("DSV4_SM120_MOE_SCALED_DOT", "choice", None,
            "our MoE's fp4 path, block-scaled dot: unset = `native` on GPUs with FP4 MMA, else `emulated` (exact, "
            "slower; the same result)", "dev", choices=("native", "emulated")),
    Setting("DSV4_SM120_MOE_APRE", "choice", "1",
            "our MoE's fp4 path: 1 = quantize activations once per row before each GEMM; 0 = inside every GEMM "
            "program (the same bits; `make bench-moe` times both)", "dev", choices=("0", "1")),
    Setting("DSV4_SM120_MOE_ALIGN", "choice", "auto",
            "token grouping of our MoE: `auto` = the launch table's choice; the others replace it (all give the same "
            "bits)", "dev", choices=("auto", "inkernel", "triton", "torch")),
    Setting("DSV4_SM120_SELFCHECK", "bool", "1",
            "1: before CUDA-graph capture, every launch of our kernels that the captured rows reach is checked once "
            "on the GPU against the stock path; a failing launch steps aside to the stock path for its rows in that "
            "process (docs/calibrate.md); 0: no check",
            "runtime"),
    Setting("DSV4_SM120_RANK_AGREE_TIMEOUT_S", "float", "600",
            "seconds a rank waits for the other ranks of its tensor-parallel group where they agree on a decision "
            "(self-check fallbacks, a capture captured again, the MoE path, the PCIe-IPC all-reduce); a rank that "
            "does not answer in time stops the server with a line naming it (docs/calibrate.md)", "runtime",
            minimum=0, above=True),
    Setting("DSV4_SM120_FP8_CONFIG_DIR", "path", None,
            "where the patched SGLang looks up tuned FP8 block-GEMM configs first: unset = configs/fp8 of the "
            "checkout the patches were applied from; empty = SGLang's own configs only", "runtime",
            values="directory, or empty"),
    # serve
    Setting("DSV4_SM120_FP8_GEMM_BACKEND", "text", "",
            "`--fp8-gemm-backend` the serve scripts pass under `FP8_GEMM_BACKEND=auto`: empty = the FP8 tuning "
            "summary decides; `auto`/`default`/`none` = SGLang's default; else that backend", "serve",
            check=_fp8_backend, values="empty, auto, default, none or a backend name"),
    # tools
    Setting("DSV4_SM120_CACHE", "path", "~/.cache/dsv4_sm120",
            "the project's cache: test environment, pinned wheels, pristine SGLang copies (also a make variable)",
            "tools"),
    Setting("SGLANG_ROOT", "path", "",
            "make apply-patches / revert-patches / patch-status: patch this `sglang` package directory instead of "
            "the one in VENV (a make variable)", "tools"),
    Setting("DSV4_SM120_INSTALLER", "choice", "uv",
            "scripts/setup_env.sh: install the environment with uv, or with pip", "tools", choices=("uv", "pip")),
    Setting("DSV4_SM120_COMPILE_BYTECODE", "bool", "1",
            "scripts/setup_env.sh (uv): compile .pyc files at install; 0 saves minutes on few cores", "tools"),
    Setting("DSV4_SM120_PROFILE_DIR", "path", None,
            "make calibrate / the patched SGLang: directory of the machine profiles (unset: configs/profiles of "
            "the checkout that applied the patches; empty: profiles off)", "tools"),
    Setting("DSV4_SM120_UPSTREAM_TRITON_FILE", "path", "",
            "make calibrate without SGLang installed: path of SGLang's flash_mla_sm120_triton.py (a candidate)",
            "tools"),
    Setting("DSV4_SM120_CALIBRATE_MOE_TIMEOUT_S", "float", "900",
            "make calibrate: seconds one SGLang MoE runner's measurement may take", "tools", minimum=0, above=True),
    Setting("DSV4_SM120_COMMIT", "text", "",
            "the bench drivers: the commit their rows record (empty: the checkout's git HEAD, -dirty when tracked "
            "files differ); for a copy of a tree whose .git is not the tree's own", "tools", check=_commit_id,
            values="empty, or a commit id (7-40 hex digits, optional -dirty)"),
    # internal
    Setting("DSV4_SM120_REPO_ROOT", "path", None,
            "the checkout our launchers run from (unset: found from the package's location)", "internal"),
    Setting("DSV4_SM120_ORIG_PYTHONPATH", "text", None,
            "the caller's PYTHONPATH before a launcher added the checkout's overlay (restored for SGLang)",
            "internal"),
    Setting("DSV4_SM120_VARIANT", "choice", "base",
            "serve variant, set by serve_dsv4_mtp.sh (not passed on to the servers)", "internal",
            choices=("base", "mtp")),
    Setting("DSV4_SM120_MAKE_TARGET", "text", None,
            "the make target running a command, set by the Makefile: its hints name the make command "
            "(`make <target> ARGS=...`) instead of bare options", "internal"),
    # test hooks
    _hook("DSV4_SM120_SERVE_POLL_S", "float", "1.0", "seconds between the supervisor's checks",
            minimum=0, above=True),
    _hook("DSV4_SM120_STANDIN_ROLE", "choice", "",
            "the stand-in role the other DSV4_SM120_STANDIN_* hooks apply to (empty: every role)",
            choices=("", "prefill", "decode", "null")),
    _hook("DSV4_SM120_STANDIN_RECORD", "path", "", "file the stand-ins append every request to (JSON lines)"),
    _hook("DSV4_SM120_STANDIN_TRACE_TP", "int", "0",
            "ranks of synthetic profiler traces a stand-in writes on /start_profile (0: none)", minimum=0),
    _hook("DSV4_SM120_STANDIN_TOKEN_S", "float", "0.002", "seconds between a stand-in's streamed tokens",
            minimum=0),
    _hook("DSV4_SM120_STANDIN_FAIL_AT_START", "bool", "0", "1: the stand-in exits at start"),
    _hook("DSV4_SM120_STANDIN_STARTUP_S", "float", "0", "seconds before the stand-in reports healthy",
            minimum=0),
    _hook("DSV4_SM120_STANDIN_EXIT_AFTER_S", "float", "0", "seconds after which the stand-in exits (0: never)", minimum=0),
    _hook("DSV4_SM120_STANDIN_EXIT_WHEN_FILE", "path", "", "the stand-in exits once this file exists"),
    _hook("DSV4_SM120_STANDIN_CHILD_PIDFILE", "path", "",
            "the stand-in starts a helper process and writes its pid here"),
    _hook("DSV4_SM120_STANDIN_UNHEALTHY_WHEN_FILE", "path", "",
            "the stand-in answers health checks with 503 while this file exists"),
    _hook("DSV4_SM120_STANDIN_FIRST_GENERATE_S", "float", "0",
            "the stand-in's first generation request waits this many seconds (a transport cold start)",
            minimum=0),
    _hook("DSV4_SM120_STANDIN_FAIL_GENERATE", "bool", "0",
            "1: the stand-in answers generation requests with HTTP 500 (a broken KV transfer)"),
    _hook("DSV4_SM120_STANDIN_EXIT_ON_STREAM", "bool", "0",
            "1: the stand-in exits on its first streamed generation request (a server dying under load)"),
    _hook("DSV4_SM120_STANDIN_DIVERGE_AT", "int", "-1",
            "with the overlay on (DSV4_SM120_DISABLE off), the decode stand-in's greedy tokens differ from the "
            "stock ones from this position on (-1: never; make verify's tests)", minimum=-1),
    _hook("DSV4_SM120_SERVE_SYSFS_ROOT", "path", "/sys",
            "root of the sysfs tree the NUMA placement and the PCIe preflight read (tests point it at a fake box)"),
    _hook("DSV4_SM120_TEST_PATCHING_FAIL_AFTER", "int", "-1",
            "the patch tool fails after writing this many files (-1: never)", minimum=-1),
    _hook("DSV4_SM120_TEST_SELFCHECK_FAULT", "text", "",
            "a planted fault the self-check and the fallbacks must handle: `attention` / `moe` = our kernel's "
            "result scaled by 2 (MoE: on its first path); `attention-raise` = every call of our attention kernel "
            "raises; `attention-raise-T=<n>` = its calls of n rows raise; `moe-raise` = our MoE kernel raises on "
            "its first path (from the first layer's prepare_layer on)", check=_selfcheck_fault,
            values="empty, attention, attention-raise, attention-raise-T=<n>, moe, moe-raise"),
    _hook("DSV4_SM120_TEST_FAULT_RANKS", "text", "",
            "the ranks (torch.distributed global ranks) where DSV4_SM120_TEST_SELFCHECK_FAULT applies, comma-separated "
            "(empty: every rank): a fault on one rank of a tensor-parallel server", check=_ranks,
            values="empty, or ranks, e.g. 2 or 0,3"),
    _hook("DSV4_SM120_TEST_GPU_NAME", "text", "",
            "GPU name the SGLang glue looks the machine profile up for (CPU tests; empty: the current CUDA GPU)"),
    _hook("DSV4_SM120_TEST_DURATIONS", "path", "",
            "the record of test durations that orders make test's work, longest first (empty: "
            "test-durations.json in DSV4_SM120_CACHE; tests/xdist_groups.py)"),
    _hook("DSV4_SM120_TEST_ATTN_CONFIG", "text", "",
            "launch keys the GPU attention tests (tests/gpu) run every case with",
            check=_attention_launch, values=_ATTN_CONFIG_VALUES),
)


def _serve_settings() -> Tuple[Setting, ...]:
    # The serve scripts' parameters are declared once, typed, in serve_variables.SERVE.
    return tuple(Setting(name, v.kind, v.default, v.meaning, "serve", choices=v.choices, minimum=v.minimum,
                         above=v.above, check=v.check, values=v.values, maximum=v.maximum, required=v.required,
                         convert=v.parse)
                 for name, v in SERVE.items() if name not in _BY_NAME_OURS)


_BY_NAME_OURS: Dict[str, Setting] = {s.name: s for s in _OURS}
_ALL: Optional[Dict[str, Setting]] = None


def registry() -> Dict[str, Setting]:
    """{name: Setting} of every setting, ours then the serve scripts' parameters."""
    global _ALL
    if _ALL is None:
        _ALL = dict(_BY_NAME_OURS)
        _ALL.update((s.name, s) for s in _serve_settings())
    return _ALL


def setting(name: str) -> Setting:
    s = _BY_NAME_OURS.get(name) or registry().get(name)
    if s is None:
        raise KeyError(f"{name} is not a registered setting (dsv4_sm120/settings.py)")
    return s


def raw(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The variable's text as set (None when unset): for settings where unset and empty differ."""
    setting(name)
    return (os.environ if environ is None else environ).get(name)


def get(name: str, environ: Optional[Mapping[str, str]] = None):
    """The typed, validated value of setting ``name`` in ``environ`` (default: this process's environment):
    str for choice / text / path, bool, int or float; unset or empty gives the default's value (None where
    the default is unset). Raises SettingsError for an invalid value."""
    return setting(name).parse(raw(name, environ))


def put(name: str, value: str) -> None:
    """Set setting ``name`` for this process and the processes it starts, validated first (SettingsError): how
    our own code changes a setting at run time (the startup self-check's fallbacks)."""
    setting(name).parse(value)
    os.environ[name] = value


# ---- validation


def _cross_checks(env: Mapping[str, str]) -> List[str]:
    out = []
    try:
        qk, cfg_text = get("DSV4_SM120_ATTN_QK", env), get("DSV4_SM120_ATTN_CONFIG", env)
    except SettingsError:
        return out  # reported on their own
    if qk == "fp8" and cfg_text:
        from dsv4_sm120.attention.keys import BF16_ONLY_IMPLS, parse_config

        impl = parse_config(cfg_text).get("impl")
        if impl in BF16_ONLY_IMPLS:
            out.append(f"DSV4_SM120_ATTN_CONFIG impl={impl} has no fp8 QK path but DSV4_SM120_ATTN_QK=fp8")
    return out


# SGLang 0.5.23's own variables that our code sets for SGLang (not ours, never renamed or validated here)
SGLANG_OWN = ("SGLANG_DSV4_FP4_EXPERTS",)

# Names retired by the move to one prefix (CHANGELOG.md): set in the environment, each is an error that names its
# successor. Only these: SGLang's own SGLANG_DSV4_* variables (e.g. SGLANG_DSV4_FP4_EXPERTS) are not ours.
RENAMED = {
    "SGLANG_DSV4_SM120_DISABLE": "DSV4_SM120_DISABLE",
    "SGLANG_DSV4_SM120_ATTN_BACKEND": "DSV4_SM120_ATTN_BACKEND",
    "SGLANG_DSV4_SM120_ATTN_PREFILL": "DSV4_SM120_ATTN_PREFILL",
    "SGLANG_DSV4_SM120_NVFP4_MOE_BACKEND": "DSV4_SM120_MOE_BACKEND",
    "SGLANG_DSV4_FP8_CONFIG_DIR": "DSV4_SM120_FP8_CONFIG_DIR",
    "DSV4_FP8_GEMM_BACKEND": "DSV4_SM120_FP8_GEMM_BACKEND",
    "DSV4_CACHE": "DSV4_SM120_CACHE",
    "DSV4_INSTALLER": "DSV4_SM120_INSTALLER",
    "DSV4_COMPILE_BYTECODE": "DSV4_SM120_COMPILE_BYTECODE",
    "DSV4_SERVE_STANDIN": "DSV4_SM120_SERVE_STANDIN",
    "DSV4_REPO_ROOT": "DSV4_SM120_REPO_ROOT",
    "DSV4_ORIG_PYTHONPATH": "DSV4_SM120_ORIG_PYTHONPATH",
    "DSV4_VARIANT": "DSV4_SM120_VARIANT",
    "DSV4_SERVE_POLL_S": "DSV4_SM120_SERVE_POLL_S",
    "DSV4_PATCHING_FAIL_AFTER": "DSV4_SM120_TEST_PATCHING_FAIL_AFTER",
    "DSV4_ATTN_TEST_CONFIG": "DSV4_SM120_TEST_ATTN_CONFIG",
    **{f"DSV4_STANDIN_{k}": f"DSV4_SM120_STANDIN_{k}" for k in (
        "ROLE", "RECORD", "TRACE_TP", "TOKEN_S", "FAIL_AT_START", "STARTUP_S", "EXIT_AFTER_S", "EXIT_WHEN_FILE",
        "CHILD_PIDFILE", "UNHEALTHY_WHEN_FILE")},
}


def validate(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """Problems (one line each) with the settings in ``environ``: invalid values, unknown ``DSV4_SM120_*``
    names (typos) and retired names (``RENAMED``, as in CHANGELOG.md)."""
    env = os.environ if environ is None else environ
    problems = []
    reg = registry()
    for name in sorted(env):
        if name in reg and reg[name].reader == "serve" and not name.startswith(PREFIX):
            continue  # the serve plan validates the serve scripts' own parameters (module doc)
        if name in reg:
            try:
                reg[name].parse(env[name])
            except SettingsError as e:
                problems.append(str(e))
        elif name.startswith(PREFIX):
            problems.append(f"{name} is not a dsv4_sm120 setting (python -m dsv4_sm120.settings lists them)")
        elif name in RENAMED:
            problems.append(f"{name} was renamed to {RENAMED[name]} (CHANGELOG.md lists the renamed settings)")
    return problems + _cross_checks(env)


# ---- listing


def _rows(reader: Optional[str] = None, readers: Optional[Tuple[str, ...]] = None) -> List[Setting]:
    want = readers if readers is not None else READERS if reader is None else (reader,)
    return [s for r in READERS if r in want for s in registry().values() if s.reader == r]


def _default_text(s: Setting) -> str:
    if s.default is None:
        return "empty" if s.reader == "serve" else "unset"
    return f"`{s.default}`" if s.default else "empty"


# The generated settings tables: file (relative to the checkout) -> the readers whose settings it lists.
# README.md: what a user sets for the patched SGLang and the tools; docs/serving.md: the serve scripts' parameters;
# docs/DEVELOPING.md: the developer switches, what our launchers set for themselves and the test hooks.
TABLES: Dict[str, Tuple[str, ...]] = {"README.md": ("runtime", "tools"), "docs/serving.md": ("serve",),
                                      "docs/DEVELOPING.md": ("dev", "internal", "test")}
_CHECKOUT = Path(__file__).resolve().parents[2]


def markdown(readers: Tuple[str, ...] = TABLES["README.md"]) -> str:
    """The settings table of ``readers`` (README.md carries exactly the default one between its settings markers;
    ``TABLES`` says which file carries which). One reader: no "read by" column."""
    by = len(readers) > 1
    lines = ["| variable | values | default | " + ("read by | " if by else "") + "meaning |",
             "| --- | --- | --- | " + ("--- | " if by else "") + "--- |"]
    for s in _rows(readers=readers):
        meaning = s.meaning.replace("|", "\\|")
        lines.append(f"| `{s.name}` | {s.describe_values()} | {_default_text(s)} | "
                     + (f"{s.reader} | " if by else "") + f"{meaning} |")
    return "\n".join(lines) + "\n"


def as_json() -> str:
    return json.dumps([{"name": s.name, "kind": s.kind, "choices": list(s.choices), "default": s.default,
                        "minimum": s.minimum, "maximum": s.maximum, "reader": s.reader, "meaning": s.meaning,
                        "values": s.describe_values().replace("\\|", "|")}
                       for s in _rows()], indent=2) + "\n"


def text_listing(reader: Optional[str] = None) -> str:
    out = []
    for s in _rows(reader):
        d = "unset" if s.default is None and s.reader != "serve" else (s.default or "empty")
        out.append(f"{s.name}  [{s.reader}; {s.describe_values().replace(chr(92) + '|', '|')}; default {d}]\n"
                   f"    {s.meaning.replace('`', '')}")
    return "\n".join(out) + "\n"


README_BEGIN = "<!-- settings: begin (generated: PYTHONPATH=overlay python3 -m dsv4_sm120.settings --write-readme) -->"
README_END = "<!-- settings: end -->"


def readme_table(text: str) -> Optional[str]:
    """The table between the settings markers of a document's text (None without markers)."""
    if README_BEGIN not in text or README_END not in text:
        return None
    return text.split(README_BEGIN, 1)[1].split(README_END, 1)[0].strip("\n") + "\n"


def table_for(path: Path) -> str:
    """The table ``path`` carries: its ``TABLES`` entry (a file of this checkout), else README.md's."""
    try:
        rel = Path(path).resolve().relative_to(_CHECKOUT).as_posix()
    except ValueError:
        rel = ""
    return markdown(TABLES.get(rel, TABLES["README.md"]))


def write_readme(path: Path) -> bool:
    """Replace the table between the markers of ``path`` with :func:`table_for`; True when the file changed."""
    text = path.read_text()
    if readme_table(text) is None:
        raise SettingsError(f"{path} has no settings markers ({README_BEGIN} ... {README_END})")
    head, rest = text.split(README_BEGIN, 1)
    tail = rest.split(README_END, 1)[1]
    new = f"{head}{README_BEGIN}\n{table_for(path)}{README_END}{tail}"
    if new == text:
        return False
    path.write_text(new)
    return True


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_sm120.settings",
                                 description="List every environment variable dsv4_sm120 reads (name, valid values, "
                                             "default, who reads it, meaning), or check the current environment.")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--markdown", action="store_true", help="a markdown table (the one in README.md)")
    g.add_argument("--json", action="store_true", help="JSON: one object per setting")
    g.add_argument("--check", action="store_true",
                   help="validate this environment: print each problem, exit 1 if there is any")
    g.add_argument("--write-readme", nargs="?", const="", metavar="PATH",
                   help="rewrite the table between the settings markers of PATH (default: every generated table: "
                        + ", ".join(TABLES) + ")")
    ap.add_argument("--reader", choices=READERS, help="only the settings read by this part (plain listing)")
    a = ap.parse_args(argv)
    if a.markdown:
        sys.stdout.write(markdown())
    elif a.json:
        sys.stdout.write(as_json())
    elif a.check:
        problems = validate()
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        if not problems:
            print("settings: ok")
        return 1 if problems else 0
    elif a.write_readme is not None:
        for path in [Path(a.write_readme)] if a.write_readme else [_CHECKOUT / f for f in TABLES]:
            try:
                changed = write_readme(path)
            except (OSError, SettingsError) as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            print(f"{path}: {'settings table updated' if changed else 'settings table up to date'}")
    else:
        sys.stdout.write(text_listing(a.reader))
    return 0


if __name__ == "__main__":
    sys.exit(main())
