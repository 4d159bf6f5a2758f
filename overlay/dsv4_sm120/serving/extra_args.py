"""The flags the serve plan sets itself, which ``*_EXTRA_ARGS`` may not pass.

SGLang and sglang_router keep the last value of a flag given twice, and ``*_EXTRA_ARGS`` come after the plan's
flags: ``SERVER_EXTRA_ARGS="--tp=2 --context-length 1024"`` would run TP2 on four GPUs and bypass ``CONTEXT_LEN``'s
range check. Each flag the plan owns names the variable that sets it; a flag in an extra-args variable that is one
of them, in ``--flag value`` or ``--flag=value`` form, or an abbreviation argparse would expand to one (both parsers
take unique prefixes: the plan itself passes ``--tp``), is refused with one line naming that variable. The lists
hold every alias SGLang 0.5.23's parsers know (``tests/test_serve_dryrun.py`` checks them against the real parsers).

Left to the user on purpose: ``--moe-runner-backend`` and ``--numa-node`` (the plan's own choices step aside for
them), and in the base variant the speculative flags (the plan sets none there).
"""

from __future__ import annotations

import shlex
from typing import Dict, List, Optional

_GPUS = "PREFILL_GPUS / DECODE_GPUS (TP = their count)"
# flag -> the variable that sets it, on both servers
SERVER_BOTH: Dict[str, str] = {
    "--model-path": "MODEL_PATH", "--model": "MODEL_PATH",
    "--tp-size": _GPUS, "--tensor-parallel-size": _GPUS, "--base-gpu-id": _GPUS,
    "--host": "PREFILL_HOST / DECODE_HOST", "--port": "PREFILL_PORT / DECODE_PORT",
    "--context-length": "CONTEXT_LEN",
    "--mem-fraction-static": "MEM_FRACTION (or PREFILL_MEM_FRACTION / DECODE_MEM_FRACTION)",
    "--served-model-name": "SERVED_MODEL_NAME", "--fp8-gemm-backend": "FP8_GEMM_BACKEND",
    "--disaggregation-mode": "NODE_ROLE (each server has its mode)",
    "--disaggregation-transfer-backend": "TRANSFER_BACKEND", "--disaggregation-ib-device": "IB_DEVICE",
}
SERVER_ROLE: Dict[str, Dict[str, str]] = {
    "prefill": {"--disaggregation-bootstrap-port": "BOOTSTRAP_PORT", "--max-running-requests": "PREFILL_MAX_RUNNING",
                "--chunked-prefill-size": "CHUNKED_PREFILL_SIZE"},
    "decode": {"--max-running-requests": "MAX_RUNNING", "--cuda-graph-max-bs-decode": "MAX_RUNNING"},
}
# the MTP variant's speculative flags (serve/serve_dsv4_mtp.sh)
SPECULATIVE: Dict[str, str] = {
    "--speculative-algorithm": "SPEC_ALGORITHM", "--speculative-num-steps": "SPEC_NUM_STEPS",
    "--speculative-eagle-topk": "SPEC_EAGLE_TOPK", "--speculative-num-draft-tokens": "SPEC_NUM_DRAFT_TOKENS",
    "--speculative-dspark-block-size": "SPEC_DSPARK_BLOCK_SIZE",
}
ROUTER: Dict[str, str] = {
    "--pd-disaggregation": "the plan (the router always runs in PD mode)",
    "--prefill": "PREFILL_HOST / PREFILL_PORT / BOOTSTRAP_PORT", "--decode": "DECODE_HOST / DECODE_PORT",
    "--host": "ROUTER_HOST", "--port": "ROUTER_PORT", "--prometheus-host": "ROUTER_HOST",
    "--prometheus-port": "ROUTER_PROMETHEUS_PORT",
    "--shutdown-grace-period-secs": "the plan (kept below STOP_GRACE_S, so a stop never ends in SIGKILL)",
}


def owned(role: str, variant: str) -> Dict[str, str]:
    """{flag: the variable that sets it} of the plan's command for ``role`` (prefill, decode, router)."""
    if role == "router":
        return dict(ROUTER)
    out = dict(SERVER_BOTH, **SERVER_ROLE[role])
    if variant == "mtp":
        out.update(SPECULATIVE)
    return out


def owned_flag_problem(var: str, tokens: List[str], flags: Dict[str, str]) -> Optional[str]:
    """The line refusing the first token of ``var``'s words that passes a flag of ``flags`` (None: none does)."""
    for tok in tokens:
        if not tok.startswith("--") or len(tok) <= 2:
            continue
        name = tok.split("=", 1)[0]
        if name in flags:
            return (f"{var} passes {name}, which the plan sets from {flags[name]}: set that instead "
                    f"(docs/serving.md, \"Variables\")")
        longer = sorted(f for f in flags if f.startswith(name))
        if longer:
            return (f"{var} passes {name}, an abbreviation of {' / '.join(longer)} (the parser expands unique "
                    f"prefixes), which the plan sets from {flags[longer[0]]}: set that instead (docs/serving.md, "
                    f"\"Variables\")")
    return None


def check(s: Dict[str, str], roles: List[str], variant: str) -> Optional[str]:
    """The first problem with the extra-args variables of the parts on this host (None: none)."""
    per_role = {"prefill": ("SERVER_EXTRA_ARGS", "PREFILL_EXTRA_ARGS"),
                "decode": ("SERVER_EXTRA_ARGS", "DECODE_EXTRA_ARGS"), "router": ("ROUTER_EXTRA_ARGS",)}
    for role in roles:
        flags = owned(role, variant)
        for var in per_role[role]:
            problem = owned_flag_problem(var, shlex.split(s.get(var) or ""), flags)
            if problem:
                return problem
    return None
