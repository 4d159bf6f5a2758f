"""Which MoE runner serves DeepSeek-V4-Flash's routed experts on sm_120, for both expert formats: the setting,
the machine profile's decision and the default of each, and the order between them.

NVFP4 experts (a hybrid FP8 + NVFP4 checkpoint, e.g. the output of ``python -m dsv4_sm120.convert_nvfp4``) are
decided in the server: patch 0003 asks :func:`dsv4_sm120.sglang_glue.moe.hybrid_nvfp4_moe_runner_backend`,
which answers with :func:`nvfp4_runner` on sm_120 (elsewhere SGLang's own choice stays). The order:

1. ``--moe-runner-backend`` other than ``auto``: SGLang takes it and never asks;
2. ``DSV4_SM120_MOE_BACKEND`` other than ``auto``: ``flashinfer_cutlass``, ``dsv4_triton_nvfp4`` (the overlay's
   Triton runner) or ``stock`` (SGLang's own choice, :data:`STOCK_HYBRID_BACKEND`, which runs on sm_100 only);
3. the machine profile's runner for decision ``moe.nvfp4`` (one runner per server:
   :func:`dsv4_sm120.machine_profile.overall`, the winner of the most token buckets) when it is one of the two
   NVFP4 runners on sm_120;
4. :data:`NVFP4_DEFAULT` (``flashinfer_cutlass``: ModelOpt NVFP4 through FlashInfer's CUTLASS fused MoE, which
   has sm_120 kernels; ``dsv4_triton_nvfp4`` was slower than an FP8 MoE on the H200, bench/results/moe.csv).

``dsv4_triton_nvfp4`` chosen by 2 or 3 but not available (patch 0005 not applied, Triton missing) gives
``flashinfer_cutlass`` with a warning.

MXFP4 experts (the released checkpoint) are decided by the serve planner, which passes the runner as
``--moe-runner-backend`` to both servers (:func:`mxfp4_runner`, called by :mod:`dsv4_sm120.serving.plan`):

1. the user's ``--moe-runner-backend`` in ``SERVER_EXTRA_ARGS`` / ``PREFILL_EXTRA_ARGS`` / ``DECODE_EXTRA_ARGS``;
2. the ``moe.mxfp4`` winner of the machine profile matching the GPU and this process's versions, when SGLang
   0.5.23 has that flag value (:data:`MXFP4_RUNNER_FLAGS`);
3. no flag: SGLang's default.

:mod:`dsv4_sm120.settings` declares ``DSV4_SM120_MOE_BACKEND`` with :data:`NVFP4_SETTING_CHOICES` and
:data:`NVFP4_SETTING_DEFAULT` and holds the runner names (re-exported here). Imports nothing else at load time (the
profile and the model config when asked).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

# the names, re-exported: every name of the MoE runner decision is importable from here
from dsv4_sm120.settings import (MOE_FLAG, NVFP4_DEFAULT, NVFP4_RUNNERS, NVFP4_SETTING_CHOICES,  # noqa: F401
                                 NVFP4_SETTING_DEFAULT, SM120_NVFP4_BACKEND, STOCK_HYBRID_BACKEND,
                                 TRITON_NVFP4_BACKEND)

ENV_BACKEND = "DSV4_SM120_MOE_BACKEND"

# calibrate's MXFP4 runner names -> SGLang 0.5.23's --moe-runner-backend values (spelt the same today;
# tests/test_serve_moe_runner.py checks every value against SGLang's own choices). A profile winner missing here
# is never passed.
MXFP4_RUNNER_FLAGS = {"flashinfer_mxfp4": "flashinfer_mxfp4", "deep_gemm": "deep_gemm", "marlin": "marlin"}


def nvfp4_profile_choice() -> Tuple[str, str, str]:
    """``(runner, source, detail)`` of decision ``moe.nvfp4`` from the machine profile (default
    :data:`NVFP4_DEFAULT`); never raises."""
    from dsv4_sm120 import machine_profile

    try:
        choice, source, detail = machine_profile.overall("moe.nvfp4", NVFP4_DEFAULT)
    except Exception as e:  # noqa: BLE001 - a broken profile must not stop the server
        return NVFP4_DEFAULT, f"default: profile unreadable ({type(e).__name__}: {e})", ""
    if source == "default":
        source = machine_profile.default_reason("moe.nvfp4")
    return choice, source, detail


def nvfp4_runner(setting: str, triton_available: Callable[[], bool],
                 stock: str = STOCK_HYBRID_BACKEND) -> Tuple[str, str, Optional[str]]:
    """``(runner, source, warning)`` of NVFP4 experts on sm_120 (module doc, steps 2-4): ``setting`` is
    ``DSV4_SM120_MOE_BACKEND``'s validated value, ``triton_available`` says whether ``dsv4_triton_nvfp4`` can run
    (asked only when it is chosen), ``stock`` is SGLang's own choice; ``warning`` is a line to log or None."""
    choice, source = setting, f"env {ENV_BACKEND}"
    if choice == "auto":
        choice, source, detail = nvfp4_profile_choice()
        if choice not in NVFP4_RUNNERS:
            source = f"default: profile winner {choice!r} is not an NVFP4 runner on sm_120"
            choice = NVFP4_DEFAULT
        elif detail:
            source = f"{source}; {detail}"
    if choice == "stock":
        return stock, source, None
    if choice == TRITON_NVFP4_BACKEND:
        if triton_available():
            return TRITON_NVFP4_BACKEND, source, None
        warning = (f"{ENV_BACKEND}={TRITON_NVFP4_BACKEND} but that backend is not available; using "
                   f"{SM120_NVFP4_BACKEND}")
        return SM120_NVFP4_BACKEND, f"{source}; {TRITON_NVFP4_BACKEND} not available", warning
    return SM120_NVFP4_BACKEND, source, None


def mxfp4_runner(model_path: str, device_name: Optional[str], user_flag: Optional[str],
                 model=None) -> Tuple[Optional[str], str]:
    """The --moe-runner-backend for an MXFP4 checkpoint (None = add nothing: SGLang's default or the user's
    flag) and why: the ``moe.mxfp4`` winner of the machine profile matching ``device_name`` and this
    process's versions (the serving python's), through :func:`dsv4_sm120.machine_profile.overall`. Only for a
    checkpoint known to have MXFP4 routed experts (``model_config``: its config.json, local or in the Hugging
    Face cache, or a published Hub id); an unknown format gets no flag. ``user_flag``: the variable that passes
    ``--moe-runner-backend`` already, or None; ``model``: the checkpoint's :class:`dsv4_sm120.model_config.ModelConfig`
    when the caller has read it."""
    if user_flag:
        return None, f"your {MOE_FLAG} in {user_flag} wins"
    from dsv4_sm120 import model_config

    mc = model if model is not None else model_config.read(model_path)
    fmt = mc.moe_format
    if mc.problems():
        return None, "not added: MODEL_PATH's config.json cannot be used (the model check says why)"
    if fmt is None:
        return None, (f"not added: the MoE format of MODEL_PATH={model_path} is unknown here ({mc.source}); "
                      f"SGLang picks the runner from the checkpoint it loads")
    if fmt != "mxfp4":
        return None, (f"not added: {fmt.upper()} routed experts ({mc.source}); the patched SGLang picks the NVFP4 "
                      f"runner itself")
    if device_name is None:
        return None, "SGLang default (no GPU name from nvidia-smi, so no machine profile applies)"
    import logging

    from dsv4_sm120 import machine_profile as P

    log = logging.getLogger(P.__name__)
    level = log.level
    log.setLevel(logging.ERROR)          # the reasons go into this line; the preflight warns about them
    try:
        prof, path, reasons = P.active_profile(device_name)
        choice, source, detail = P.overall("moe.mxfp4", gpu=device_name)
    finally:
        log.setLevel(level)
    if prof is None:
        why = "; ".join(r for r in reasons if not r.startswith("warning:")) or "no reason given"
        return None, f"SGLang default (no matching machine profile for {device_name}: {why})"
    if source == "default":
        return None, f"SGLang default (profile {path} has no moe.mxfp4 winner{': ' + detail if detail else ''})"
    flag = MXFP4_RUNNER_FLAGS.get(choice)
    if flag is None:
        return None, (f"SGLang default (profile {path} picks {choice!r}, which is not a {MOE_FLAG} choice of "
                      f"SGLang 0.5.23; skipped)")
    return flag, f"{flag}: profile {path}{' (' + detail + ')' if detail else ''}"
