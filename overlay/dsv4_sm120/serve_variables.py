"""The serve scripts' parameters: every variable ``serve/*.sh`` and :mod:`dsv4_sm120.serving` read, with its
default and help.

The serve planner (:mod:`dsv4_sm120.serving.plan`) reads its plan from them and :mod:`dsv4_sm120.settings`
lists them as the group ``serve``. Imports nothing.
"""

from typing import Dict, Optional, Tuple

DEFAULT_MODEL = "deepseek-ai/DeepSeek-V4-Flash"

# name: (default, help). Order = the order printed by --help-vars and the dry run.
VARIABLES: Dict[str, Tuple[Optional[str], str]] = {
    "VENV": (".venv", "environment whose python runs SGLang and the router (relative = to the repo)"),
    "MODEL_PATH": (DEFAULT_MODEL, "checkpoint directory or Hugging Face id"),
    "SERVED_MODEL_NAME": ("", "name clients use (default: SGLang's, the model path)"),
    "PREFILL_GPUS": ("0,1,2,3", "GPU indices (nvidia-smi order) of the prefill server; TP = their count"),
    "DECODE_GPUS": ("4,5,6,7", "GPU indices of the decode server; TP = their count"),
    "PREFILL_HOST": ("127.0.0.1", "address the prefill server binds and the router/decode reach it at"),
    "PREFILL_PORT": ("30100", "prefill HTTP port"),
    "BOOTSTRAP_PORT": ("8998", "prefill's disaggregation bootstrap port (KV handshake)"),
    "DECODE_HOST": ("127.0.0.1", "address the decode server binds and the router reaches it at"),
    "DECODE_PORT": ("30200", "decode HTTP port"),
    "ROUTER_HOST": ("127.0.0.1", "router bind address (0.0.0.0 to serve other machines)"),
    "ROUTER_PORT": ("30000", "router port: the OpenAI-compatible endpoint clients use"),
    "ROUTER_PROMETHEUS_PORT": ("29000", "router metrics port (must differ between two routers on one host)"),
    "CONTEXT_LEN": ("65536", "--context-length of both servers"),
    "MEM_FRACTION": ("0.85", "--mem-fraction-static of both servers"),
    "PREFILL_MEM_FRACTION": ("", "override MEM_FRACTION for prefill"),
    "DECODE_MEM_FRACTION": ("", "override MEM_FRACTION for decode"),
    "MAX_RUNNING": ("16", "decode --max-running-requests and --cuda-graph-max-bs-decode (SGLang captures its own list of batch sizes up to it: docs/serving.md)"),
    "PREFILL_MAX_RUNNING": ("", "prefill --max-running-requests (default: SGLang's)"),
    "CHUNKED_PREFILL_SIZE": ("", "prefill --chunked-prefill-size (default: SGLang's)"),
    "FP8_GEMM_BACKEND": ("auto", "auto = the FP8 tuner's configs/fp8/summary_<gpu>.json decides, else SGLang's default; or a --fp8-gemm-backend value"),
    "IB_DEVICE": ("", "--disaggregation-ib-device for both servers (multi-node RDMA NIC, e.g. mlx5_0)"),
    "TRANSFER_BACKEND": ("nixl", "--disaggregation-transfer-backend"),
    "SERVER_EXTRA_ARGS": ("", "extra SGLang flags for both servers (shell-quoted string)"),
    "PREFILL_EXTRA_ARGS": ("", "extra SGLang flags for prefill"),
    "DECODE_EXTRA_ARGS": ("", "extra SGLang flags for decode"),
    "ROUTER_EXTRA_ARGS": ("", "extra sglang_router flags"),
    "SPEC_ALGORITHM": ("auto", "MTP variant: auto = the draft MODEL_PATH's config.json carries (DSpark head -> DSPARK, MTP layer -> EAGLE), or EAGLE (= NEXTN) / DSPARK"),
    "SPEC_NUM_STEPS": ("", "MTP variant, EAGLE: --speculative-num-steps (default 3, or SPEC_NUM_DRAFT_TOKENS - 1)"),
    "SPEC_EAGLE_TOPK": ("1", "MTP variant: --speculative-eagle-topk (only 1 is supported for DSv4)"),
    "SPEC_NUM_DRAFT_TOKENS": ("", "MTP variant: tokens verified per step (EAGLE: steps + 1; DSpark: block size + 1)"),
    "SPEC_DSPARK_BLOCK_SIZE": ("", "MTP variant, DSpark: --speculative-dspark-block-size (default: the checkpoint's dspark_block_size, 5 for V4-Flash-0731)"),
    "NODE_ROLE": ("all", "what this host runs: all, or a comma list of prefill,decode,router (multi-node)"),
    "LOG_DIR": ("logs", "parent of the run directories (relative = to the repo); LOG_DIR/latest -> newest run"),
    "RUN_DIR": ("", "use this run directory instead of LOG_DIR/serve-<variant>-<time>"),
    "HEALTH_TIMEOUT_S": ("1800", "seconds each part may take to become healthy"),
    "STOP_GRACE_S": ("30", "seconds between SIGTERM and SIGKILL at teardown"),
    "SUPERVISE_HEALTH_FAILS": ("0", "tear down after this many consecutive failed health checks (0 = only on exit)"),
    "SUPERVISE_HEALTH_EVERY_S": ("30", "seconds between supervision health checks"),
    "PREFLIGHT_SKIP": ("", "comma list of checks to skip: ports,gpu,model,patches,nixl,numa,p2p,ucx,router,profile"),
    "CALIBRATE": ("0", "1 = measure this box first (`make calibrate`: python -m dsv4_sm120.calibrate with the plan's TP and MODEL_PATH, on the first decode GPU; minutes) and write the machine profile the servers then read; 0 = use the profile there is"),
    "DETACH": ("0", "1 = return once everything is healthy, supervision continues in the background"),
    "DRY_RUN": ("0", "1 = print the commands and environment and run the checks that need no GPU (exit 1 if one "
                       "fails); start nothing"),
    "DSV4_SM120_SERVE_STANDIN": ("0", "1 = stand-in HTTP servers instead of SGLang (rehearsal and tests; no GPU)"),
    "NVIDIA_SMI": ("nvidia-smi", "nvidia-smi executable used by the GPU preflight"),
    "NUMA_BIND": ("1", "1 = bind each server to the NUMA node its GPUs hang off (read from sysfs); 0 = unbound, SGLang's own auto-binding off too"),
    "WARMUP": ("auto", "one real request through the router before READY (the first KV transfer's cold start); auto = on for real servers, off for stand-ins; 1 / 0"),
    "WARMUP_TIMEOUT_S": ("600", "seconds the warm-up request may take before the start fails"),
}
