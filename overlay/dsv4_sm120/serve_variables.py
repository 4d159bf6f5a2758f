"""The serve scripts' parameters: every variable ``serve/*.sh`` and :mod:`dsv4_sm120.serving` read, typed: kind,
valid values or range, default and meaning.

:mod:`dsv4_sm120.settings` turns each into a setting of the group ``serve`` (one registry: ``settings.get`` parses
and validates them, ``python -m dsv4_sm120.settings`` lists them, docs/serving.md's table is generated from them),
and the serve planner (:mod:`dsv4_sm120.serving.plan`) reads every one through that registry: a variable with a
``parse`` gets its parsed value (GPU groups, roles, check names, shell words), the others their kind's. ``VARIABLES`` is the
plain view ``{name: (default text, meaning)}``. Imports nothing of the package.
"""

import shlex
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

DEFAULT_MODEL = "deepseek-ai/DeepSeek-V4-Flash"

# the preflight's checks (dsv4_sm120.serving.preflight; names usable in PREFLIGHT_SKIP)
PREFLIGHT_CHECKS = ("ports", "gpu", "model", "memory", "patches", "nixl", "numa", "p2p", "ucx", "router", "profile")
ROLES = ("prefill", "decode", "router")
# SGLang 0.5.23 FP8_GEMM_RUNNER_BACKEND_CHOICES and DISAGG_TRANSFER_BACKEND_CHOICES (srt/arg_groups/choices.py)
FP8_BACKENDS = ("auto", "deep_gemm", "flashinfer_trtllm", "flashinfer_cutlass", "flashinfer_deepgemm",
                "flashinfer_cutedsl", "cutlass", "triton", "aiter")
TRANSFER_BACKENDS = ("nixl", "mooncake", "mooncake_tcp", "ascend", "mori", "fake")
# serving.speculative's names of the draft algorithms (lower case)
SPEC_ALGORITHMS = ("auto", "eagle", "nextn", "mtp", "dspark")


class Var(NamedTuple):
    """One serve variable (the fields of :class:`dsv4_sm120.settings.Setting`)."""
    default: Optional[str]           # None: empty means what ``meaning`` says (e.g. SGLang's own default)
    meaning: str
    kind: str = "text"               # text | path | bool | autobool | int | float | choice
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    above: bool = False              # the value must be strictly above ``minimum``
    choices: Tuple[str, ...] = ()
    check: Optional[Callable[[str], Optional[str]]] = None   # a problem with a set value, or None
    parse: Optional[Callable[[str], object]] = None          # a text's typed value (ValueError: the problem)
    values: str = ""                 # the valid values in words (default: from the kind)
    required: bool = False           # set but empty is refused (instead of meaning the default)


# ---- checks of free-form values (each returns the problem in words, or None)


def gpu_list(text: str) -> List[int]:
    """``0,1,2,3`` -> [0, 1, 2, 3]; ValueError (the problem in words) for anything a TP group cannot be."""
    parts = [x.strip() for x in (text or "").split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError("expected a comma list of GPU indices, e.g. 0,1,2,3")
    gpus = [int(p) for p in parts]
    if len(set(gpus)) != len(gpus):
        raise ValueError("it lists a GPU twice")
    if len(gpus) not in (1, 2, 4, 8):
        raise ValueError(f"TP size {len(gpus)} does not divide DeepSeek-V4's 64 heads evenly in SGLang (use 1, 2, 4 "
                         f"or 8 GPUs)")
    return gpus


def gpu_groups(text: str) -> List[List[int]]:
    """``0,1,2,3`` -> [[0, 1, 2, 3]]; ``4,5;6,7`` -> [[4, 5], [6, 7]] (one server per group, ``;`` between them:
    replicas behind the router). Every group is a TP group (:func:`gpu_list`), all of one size (the replicas of a
    role are alike: one calibration, one measured shape), no GPU in two groups; ValueError (the problem in words)."""
    parts = (text or "").split(";")
    groups = []
    for i, part in enumerate(parts):
        try:
            groups.append(gpu_list(part))
        except ValueError as e:
            raise ValueError(f"{e}" if len(parts) == 1 else f"group {i + 1} ({part.strip()!r}): {e}") from None
    seen = [g for grp in groups for g in grp]
    twice = sorted({g for g in seen if seen.count(g) > 1})
    if twice:
        raise ValueError(f"GPU {','.join(map(str, twice))} is in two groups (each server needs its own GPUs)")
    if len({len(g) for g in groups}) > 1:
        raise ValueError(f"the groups have different sizes ({', '.join(str(len(g)) for g in groups)} GPUs): "
                         f"replicas of one server run one TP size")
    return groups


def node_roles(text: str) -> List[str]:
    """``all`` / empty -> every role; else the comma list, in ROLES order; ValueError for an unknown role."""
    txt = (text or "").strip()
    roles = list(ROLES) if txt in ("all", "") else [r.strip() for r in txt.split(",") if r.strip()]
    for r in roles:
        if r not in ROLES:
            raise ValueError(f"unknown role {r!r} (use all, or a comma list of {', '.join(ROLES)})")
    return [r for r in ROLES if r in roles]


def skipped(text: str) -> List[str]:
    """PREFLIGHT_SKIP's check names; ValueError naming the unknown ones."""
    names = [x.strip() for x in (text or "").split(",") if x.strip()]
    bad = [n for n in names if n not in PREFLIGHT_CHECKS]
    if bad:
        raise ValueError(f"unknown check(s) {', '.join(bad)} (known: {', '.join(PREFLIGHT_CHECKS)})")
    return names


def words(text: str) -> List[str]:
    """Shell words of an ``*_EXTRA_ARGS`` value; ValueError (the problem in words) when it does not split."""
    try:
        return shlex.split(text)
    except ValueError as e:
        raise ValueError(f"cannot split it as shell words ({e})") from None


_PORT = dict(kind="int", minimum=1, maximum=65535)
_SECONDS = dict(kind="int", minimum=1)
_FRACTION = dict(kind="float", minimum=0, above=True, maximum=0.99)
_GPUS = dict(parse=gpu_groups, values="comma list of 1, 2, 4 or 8 GPU indices; `;` between replicas "
             "(e.g. 4,5;6,7)")
_EXTRA = dict(parse=words, values="shell words; not the flags the plan sets (docs/serving.md)")

# Order = the order of --help-vars, the dry run and docs/serving.md's table.
SERVE: Dict[str, Var] = {
    "VENV": Var(".venv", "environment whose python runs SGLang and the router (relative = to the repo)", "path"),
    "MODEL_PATH": Var(DEFAULT_MODEL, "checkpoint directory (relative = to the current directory) or Hugging Face id",
                      values="a directory, or a Hugging Face id (org/name)", required=True),
    "SERVED_MODEL_NAME": Var(None, "name clients use (empty: SGLang's, the model path)"),
    "PREFILL_GPUS": Var("0,1,2,3", "GPU indices (nvidia-smi order) of the prefill server; TP = their count; groups "
                        "separated by `;` are replicas behind the router (empty: the recorded shape, else 0,1,2,3)",
                        **_GPUS),
    "DECODE_GPUS": Var("4,5,6,7", "GPU indices of the decode server; TP = their count; `4,5;6,7` = two TP2 decode "
                       "servers (empty: the recorded shape, else 4,5,6,7)", **_GPUS),
    "PREFILL_HOST": Var("127.0.0.1", "address the prefill server binds and the router/decode reach it at"),
    "PREFILL_PORT": Var("30100", "prefill HTTP port (replica i: this + i)", **_PORT),
    "BOOTSTRAP_PORT": Var("8998", "prefill's disaggregation bootstrap port (KV handshake; replica i: this + i)",
                          **_PORT),
    "DECODE_HOST": Var("127.0.0.1", "address the decode server binds and the router reaches it at"),
    "DECODE_PORT": Var("30200", "decode HTTP port (replica i: this + i)", **_PORT),
    "ROUTER_HOST": Var("127.0.0.1", "router bind address (0.0.0.0 to serve other machines)"),
    "ROUTER_PORT": Var("30000", "router port: the OpenAI-compatible endpoint clients use", **_PORT),
    "ROUTER_PROMETHEUS_PORT": Var("29000", "router metrics port (must differ between two routers on one host)",
                                  **_PORT),
    "CONTEXT_LEN": Var("65536", "--context-length of both servers", "int", minimum=256, maximum=1 << 21),
    "MEM_FRACTION": Var("0.85", "--mem-fraction-static of both servers", **_FRACTION),
    "PREFILL_MEM_FRACTION": Var(None, "override MEM_FRACTION for prefill (empty: MEM_FRACTION)", **_FRACTION),
    "DECODE_MEM_FRACTION": Var(None, "override MEM_FRACTION for decode (empty: MEM_FRACTION)", **_FRACTION),
    "MAX_RUNNING": Var("16", "decode --max-running-requests and --cuda-graph-max-bs-decode, per decode server (SGLang "
                       "captures its own list of batch sizes up to it: docs/serving.md)", "int", minimum=1, maximum=4096),
    "SHAPE_CONCURRENCY": Var(None, "concurrent requests the recorded serving shape and draft length are picked for "
                             "(`make verify ARGS='--stages shape'`: the winner at the nearest measured concurrency at "
                             "or above it; empty: MAX_RUNNING)", "int", minimum=1, maximum=65536),
    "PREFILL_MAX_RUNNING": Var(None, "prefill --max-running-requests (empty: SGLang's)", "int", minimum=1),
    "CHUNKED_PREFILL_SIZE": Var(None, "prefill --chunked-prefill-size (empty: SGLang's)", "int", minimum=1),
    "FP8_GEMM_BACKEND": Var("auto", "auto = the machine profile's or the FP8 tuner's choice "
                            "(configs/fp8/summary_<gpu>.json), else SGLang's default; or a --fp8-gemm-backend value",
                            "choice", choices=FP8_BACKENDS),
    "IB_DEVICE": Var(None, "--disaggregation-ib-device for both servers (multi-node RDMA NIC, e.g. mlx5_0)"),
    "TRANSFER_BACKEND": Var("nixl", "--disaggregation-transfer-backend", "choice", choices=TRANSFER_BACKENDS),
    "SERVER_EXTRA_ARGS": Var(None, "extra SGLang flags for both servers", **_EXTRA),
    "PREFILL_EXTRA_ARGS": Var(None, "extra SGLang flags for prefill", **_EXTRA),
    "DECODE_EXTRA_ARGS": Var(None, "extra SGLang flags for decode", **_EXTRA),
    "ROUTER_EXTRA_ARGS": Var(None, "extra sglang_router flags", **_EXTRA),
    "SPEC_ALGORITHM": Var("auto", "MTP variant: auto = the draft MODEL_PATH's config.json carries (DSpark head -> "
                          "DSPARK, MTP layer -> EAGLE), or EAGLE (= NEXTN, MTP) / DSPARK", "choice",
                          choices=SPEC_ALGORITHMS),
    "SPEC_NUM_STEPS": Var(None, "MTP variant, EAGLE: --speculative-num-steps (empty: 3, or SPEC_NUM_DRAFT_TOKENS - 1)",
                          "int", minimum=1, maximum=16),
    "SPEC_EAGLE_TOPK": Var("1", "MTP variant: --speculative-eagle-topk (only 1 is supported for DSv4)", "int",
                           minimum=1, maximum=64),
    "SPEC_NUM_DRAFT_TOKENS": Var(None, "MTP variant: tokens verified per step (EAGLE: steps + 1; DSpark: block size "
                                 "+ 1)", "int", minimum=2, maximum=64),
    "SPEC_DSPARK_BLOCK_SIZE": Var(None, "MTP variant, DSpark: --speculative-dspark-block-size (empty: the "
                                  "checkpoint's dspark_block_size, 5 for V4-Flash-0731)", "int", minimum=1,
                                  maximum=63),
    "NODE_ROLE": Var("all", "what this host runs: all, or a comma list of prefill,decode,router (multi-node)",
                     parse=node_roles, values="all, or a comma list of prefill, decode, router"),
    "LOG_DIR": Var("logs", "parent of the run directories (relative = to the repo); LOG_DIR/latest -> newest run",
                   "path"),
    "RUN_DIR": Var(None, "use this run directory instead of LOG_DIR/serve-<variant>-<time> (relative = to the repo)",
                   "path"),
    "HEALTH_TIMEOUT_S": Var("1800", "seconds each part may take to become healthy", **_SECONDS),
    "STOP_GRACE_S": Var("30", "seconds between SIGTERM and SIGKILL at teardown", **_SECONDS),
    "SUPERVISE_HEALTH_FAILS": Var("0", "tear down after this many consecutive failed health checks (0 = only on "
                                  "exit)", "int", minimum=0),
    "SUPERVISE_HEALTH_EVERY_S": Var("30", "seconds between supervision health checks", **_SECONDS),
    "PREFLIGHT_SKIP": Var(None, "comma list of checks to skip: " + ",".join(PREFLIGHT_CHECKS),
                          parse=skipped, values="comma list of " + ", ".join(PREFLIGHT_CHECKS)),
    "CALIBRATE": Var("0", "1 = measure this box first (`make calibrate` with the plan's TP and MODEL_PATH, on the "
                     "first decode GPU; minutes) and write the machine profile the servers then read; 0 = use the "
                     "profile there is", "bool"),
    "DETACH": Var("0", "1 = return once everything is healthy, supervision continues in the background", "bool"),
    "DRY_RUN": Var("0", "1 = print the commands and environment and run every check that needs no GPU, NIXL or "
                   "running server (exit 1 if one fails); start nothing", "bool"),
    "DSV4_SM120_SERVE_STANDIN": Var("0", "1 = stand-in HTTP servers instead of SGLang (rehearsal and tests; no GPU)",
                                    "bool"),
    "NVIDIA_SMI": Var("nvidia-smi", "nvidia-smi executable used by the GPU preflight and the NUMA placement"),
    "NUMA_BIND": Var("1", "1 = bind each server to the NUMA node its GPUs hang off (read from sysfs); 0 = unbound, "
                     "SGLang's own auto-binding off too", "bool"),
    "WARMUP": Var("auto", "one real request through the router before READY (the first KV transfer's cold start); "
                  "auto = on for real servers, off for stand-ins", "autobool"),
    "WARMUP_TIMEOUT_S": Var("600", "seconds the warm-up request may take before the start fails", **_SECONDS),
}

# name: (default text, meaning): the plain view (empty text where the default is None)
VARIABLES: Dict[str, Tuple[str, str]] = {k: (v.default or "", v.meaning) for k, v in SERVE.items()}
