"""Checks run before anything starts. Each failure is one line; any failure means exit non-zero.

Checks (names usable in ``PREFLIGHT_SKIP``):
  python   the environment's python exists (never skippable)
  env      the servers' settings are valid (``dsv4_sm120.settings.validate``: invalid values, retired names,
           unknown DSV4_SM120_* names, e.g. DSV4_SM120_ATTN_CONFIG's keys) and no PYTORCH_CUDA_ALLOC_CONF /
           PYTORCH_ALLOC_CONF turns on expandable_segments under NIXL (never skippable: a typo would otherwise
           surface only after the model has loaded)
  ports    every port this host will bind is free (a port configured twice is a configuration error)
  gpu      nvidia-smi sees the chosen GPUs, compute capability 12.x, enough free memory
  model    MODEL_PATH is a readable checkpoint directory with a DeepSeek-V4 config.json whose safetensors shards
           match model.safetensors.index.json (every header read and checked, no tensor data), or a Hugging Face
           id (whose config.json, when it is in the local Hugging Face cache, must be DeepSeek-V4's;
           ``dsv4_sm120.model_config``)
  memory   each server's share of the checkpoint's weights (its safetensors index) plus the KV cache of one
           CONTEXT_LEN request fits its GPUs' memory at its MEM_FRACTION (``memory_check``); a TP size that
           cannot hold them fails with the numbers
  patches  the environment's SGLang is patched with this repo's series (``dsv4_sm120.patching status``)
  nixl     ``import nixl`` works with a UCX backend and moves DSv4 KV pages intact (``nixl_check``)
  numa     prints each server's NUMA placement (``topology``; never fails)
  p2p      CUDA peer access and a short timed copy within each TP group and from every prefill GPU to every
           decode GPU (``p2p_probe``), diagnosed by ``p2p_diag`` (a hang or a corrupt copy fails, with the
           IOMMU / ACS fix and the NCCL_P2P_DISABLE=1 fallback; no peer access or slow copies warn); from the
           same facts, what the PCIe-IPC all-reduce needs (peer access between every pair of a server's GPUs,
           ``pcie_checks.check_ipc``): a server the machine profile put on it where it cannot run is switched to
           NCCL (one line); your SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 there fails
  ucx      UCX version and the protocol UCX selects for GPU-to-GPU KV writes (a two-process NIXL transfer
           between the first prefill and the first decode GPU with UCX_PROTO_INFO=y, ``ucx_info``); warns
           when it is not cuda_ipc zero-copy or the UCX predates the RTX PRO 6000 bandwidth fix, and tries
           the override that restores the direct path
  router   ``sglang_router`` is installed (when the router runs on this host)
  profile  a machine profile (``make calibrate``) matches each server GPU model and the serving environment's
           versions; warns (never fails) naming why not (no file / which versions differ): the servers then
           run the default choices. With ``CALIBRATE=1`` the calibration runs first (``calibrate_first``);
           its failure stops the start

A check may also print notes (``preflight NAME: ...``) that do not stop the start. ``p2p``, ``ucx`` and
``profile`` (and ``memory``) need the ``gpu`` check: when it fails they are listed as not run, naming it
(``NEEDS``). A dry run (``run_dry_checks``) runs every check whose inputs it has: all but ``nixl``, ``p2p`` and
``ucx`` (they move data through NIXL or between GPUs), and ``gpu`` / ``memory`` / ``profile`` only where nvidia-smi
answers; those it lists as not run, saying why.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import subprocess
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .. import model_config
from ..serve_variables import PREFLIGHT_CHECKS
from ..safetensors_index import INDEX_FILE, scan_checkpoint
from .plan import Plan, port_variable
from .pcie_checks import check_numa, check_p2p, check_ucx, ipc_unverified

CHECKS = PREFLIGHT_CHECKS
STANDIN_DEFAULT_SKIP = ("gpu", "memory", "patches", "nixl", "p2p", "ucx")
MODEL_PROBLEMS_SHOWN = 5


def skipped_checks(plan: Plan) -> List[str]:
    """PREFLIGHT_SKIP's checks through the registry (a plan.json edited by hand: its one line, a ValueError);
    unset or empty: the checks a stand-in cannot pass, or none."""
    names = plan.value("PREFLIGHT_SKIP")
    return names if names else (list(STANDIN_DEFAULT_SKIP) if plan.standin else [])


def overlay_env(plan: Plan, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment for running a ``dsv4_sm120`` module from this repo in the serving python."""
    env = dict(base if base is not None else os.environ)
    ov = str(Path(plan.repo) / "overlay")
    env["PYTHONPATH"] = ov + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# ---------------------------------------------------------------------------- ports

def port_in_use(host: str, port: int) -> bool:
    return bind_problem(host, port) is not None


def bind_problem(host: str, port: int) -> Optional[int]:
    """The errno a server binding ``host:port`` would get (None: the bind works)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR as the servers use it (uvicorn, the router): only a live listener or
        # bound socket counts as busy, not TIME_WAIT leftovers of an earlier deployment.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno or -1
    return None


HOST_VARIABLES = {"prefill": "PREFILL_HOST", "decode": "DECODE_HOST", "router": "ROUTER_HOST"}


def check_ports(plan: Plan) -> List[str]:
    out = []
    for p in plan.procs:
        for host, port, what in p.binds:
            err = bind_problem(host, port)
            if err == errno.EADDRNOTAVAIL:
                out.append(f"{host} is not an address of this host ({what} binds {host}:{port}): run this part on "
                           f"the host that has it, or set {HOST_VARIABLES[p.role]} to one of this host's addresses")
            elif err is not None:
                out.append(f"port {port} on {host} ({what}) is already in use: stop what holds it "
                           f"(serve/stop.sh for an earlier deployment) or set {port_variable(what)} to a free port")
    return out


# ---------------------------------------------------------------------------- gpu

def parse_nvidia_smi(text: str) -> Dict[int, dict]:
    """Rows of ``index, name, compute_cap, memory.total, memory.free`` (MiB, csv, noheader, nounits)."""
    gpus = {}
    for line in text.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) < 5:
            raise ValueError(f"unexpected nvidia-smi line: {line!r}")
        idx, name, cc, total, free = parts[0], ", ".join(parts[1:-3]), parts[-3], parts[-2], parts[-1]
        gpus[int(idx)] = {"name": name, "cc": cc, "total_mib": float(total), "free_mib": float(free)}
    return gpus


def check_gpus_table(gpus: Dict[int, dict], wanted: Sequence[Tuple[str, List[int], float]]) -> List[str]:
    """``wanted``: (role, gpu indices, mem fraction). Pure function (tests feed it tables)."""
    out = []
    for role, idxs, frac in wanted:
        for i in idxs:
            g = gpus.get(i)
            if g is None:
                out.append(f"{role}: GPU {i} not found (nvidia-smi lists {len(gpus)} GPU(s): "
                           f"{','.join(map(str, sorted(gpus))) or 'none'})")
                continue
            m = re.match(r"^(\d+)\.(\d+)$", g["cc"])
            if not m or m.group(1) != "12":
                out.append(f"{role}: GPU {i} ({g['name']}) has compute capability {g['cc']}, need 12.x (sm_120)")
            need = frac * g["total_mib"]
            if g["free_mib"] < need:
                out.append(f"{role}: GPU {i} has {g['free_mib'] / 1024:.1f} GiB free of {g['total_mib'] / 1024:.1f} GiB; "
                           f"mem fraction {frac:g} needs {need / 1024:.1f} GiB (another process is using it?)")
    return out


def server_fractions(plan: Plan) -> List[Tuple[str, str, List[int], float]]:
    """[(label, role, GPUs, memory fraction)] of the servers on this host."""
    out = []
    for p in plan.procs:
        if p.role in ("prefill", "decode"):
            frac = float(plan.settings[f"{p.role.upper()}_MEM_FRACTION"] or plan.settings["MEM_FRACTION"])
            out.append((p.label, p.role, p.gpus, frac))
    return out


def gpu_table(plan: Plan) -> Tuple[Dict[int, dict], Optional[str]]:
    """(nvidia-smi's GPU table, ``parse_nvidia_smi``) or ({}, the failure line)."""
    smi = plan.settings.get("NVIDIA_SMI") or "nvidia-smi"
    try:
        r = subprocess.run([smi, "--query-gpu=index,name,compute_cap,memory.total,memory.free",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return {}, f"nvidia-smi not found ({smi}): no NVIDIA driver on this host?"
    except subprocess.TimeoutExpired:
        return {}, "nvidia-smi did not answer within 30 s"
    if r.returncode != 0:
        last = ((r.stderr or r.stdout).strip().splitlines() or ["no output"])[-1].strip()
        return {}, f"nvidia-smi failed (exit {r.returncode}): {last}"
    try:
        return parse_nvidia_smi(r.stdout), None
    except ValueError as e:
        return {}, str(e)


def check_gpu(plan: Plan) -> List[str]:
    wanted = [(label, gpus, frac) for label, _, gpus, frac in server_fractions(plan)]
    if not wanted:
        return []
    gpus, problem = gpu_table(plan)
    return [problem] if problem else check_gpus_table(gpus, wanted)


def check_memory(plan: Plan) -> Tuple[List[str], List[str]]:
    """Each server's share of the checkpoint's weights plus one CONTEXT_LEN request's KV against its GPUs' memory
    at its fraction (``memory_check``): a TP size that cannot hold them is refused with the numbers."""
    from . import memory_check

    servers = server_fractions(plan)
    if not servers:
        return [], []
    mc = model_config.read(plan.settings["MODEL_PATH"])
    table, problem = gpu_table(plan)
    if problem:
        return [], [f"not checked: {problem}"]
    return memory_check.check(servers, mc.directory if not mc.problems() else None, mc.config,
                              int(plan.settings["CONTEXT_LEN"]), memory_check.by_gpu(table))


# ---------------------------------------------------------------------------- model

def check_model(plan: Plan, weights: bool = True) -> List[str]:
    """MODEL_PATH's config.json (``dsv4_sm120.model_config``: a local directory, or a Hub id read from the local
    Hugging Face cache when it is there) and, with ``weights``, a local directory's safetensors shards."""
    if not any(p.role in ("prefill", "decode") for p in plan.procs):
        return []
    mp = plan.settings["MODEL_PATH"]
    mc = model_config.read(mp)
    problems = mc.problems()
    if problems or mc.where != "local" or not weights:
        return problems
    path = mc.directory
    has_weights = any(path.glob("*.safetensors")) or (path / INDEX_FILE).exists()
    if not has_weights:
        return [] if plan.standin else [f"MODEL_PATH={mp}: no *.safetensors weights in the directory"]
    # Shard headers against the index (8 bytes + JSON per shard, no tensor data): an empty,
    # truncated or inconsistent checkpoint fails here instead of minutes into the load.
    _, problems = scan_checkpoint(path, max_problems=MODEL_PROBLEMS_SHOWN)
    return [f"MODEL_PATH={mp}: {x}" for x in problems]


# ---------------------------------------------------------------------------- patches

def interpret_patch_status(st: dict) -> List[str]:
    if st.get("patched") and st.get("matches_repo"):
        if st.get("overlay_current") is False:
            return ["the dsv4_sm120 installed in the environment differs from this checkout (overlay code changed "
                    "since `make apply-patches`): run `make apply-patches`"]
        return []
    root = st.get("sglang_root", "?")
    if st.get("state") and st.get("state") != "applied":
        return [f"SGLang at {root} is in patch state {st['state']!r}: run `make apply-patches` (it rolls back first)"]
    if st.get("modified_files"):
        return [f"SGLang at {root}: patched files were modified since apply: {', '.join(st['modified_files'][:5])}; "
                f"run `make revert-patches && make apply-patches`"]
    if not st.get("patched"):
        return [f"SGLang at {root} is not patched: run `make apply-patches`"]
    have = (st.get("series_hash") or "?")[:12]
    want = (st.get("repo_series_hash") or "?")[:12]
    return [f"SGLang at {root} is patched with series {have} but this repo's series is {want}: "
            f"run `make revert-patches && make apply-patches`"]


def check_patches(plan: Plan) -> List[str]:
    if not any(p.role in ("prefill", "decode") for p in plan.procs):
        return []
    cmd = [plan.python, "-m", "dsv4_sm120.patching", "status", "--python", plan.python, "--json"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=overlay_env(plan), cwd=plan.repo)
    except subprocess.TimeoutExpired:
        return ["patch status check timed out after 120 s"]
    try:
        st = json.loads(r.stdout)
    except ValueError:
        msg = (r.stderr or r.stdout).strip().splitlines()
        return [f"could not read the patch status: {msg[-1] if msg else 'exit ' + str(r.returncode)}"]
    return interpret_patch_status(st)


# ---------------------------------------------------------------------------- nixl, router

def check_nixl(plan: Plan) -> List[str]:
    if not any(p.role in ("prefill", "decode") for p in plan.procs):
        return []
    env = overlay_env(plan)
    for k, v, _ in plan.common_env:
        env.setdefault(k, v)
    cmd = [plan.python, "-m", "dsv4_sm120.serving.nixl_check", "--json", "--timeout", "30"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env, cwd=plan.repo)
    except subprocess.TimeoutExpired:
        return ["NIXL check timed out after 90 s"]
    if r.returncode == 0:
        return []
    lines = [x for x in (r.stderr + r.stdout).strip().splitlines() if "nixl check" in x]
    tail = (r.stderr or r.stdout).strip().splitlines()
    return [lines[-1] if lines else f"NIXL check failed (exit {r.returncode}): {tail[-1] if tail else ''}"]


def check_router(plan: Plan) -> List[str]:
    if not any(p.role == "router" for p in plan.procs):
        return []
    code = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('sglang_router') else 3)"
    r = subprocess.run([plan.python, "-c", code], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        return [f"sglang_router is not installed in {plan.python} (pip install sglang-router==0.3.2)"]
    return []


def check_python(plan: Plan) -> List[str]:
    if not (os.path.isfile(plan.python) and os.access(plan.python, os.X_OK)):
        return [f"no python at {plan.python}: run `make setup` or set VENV to the serving environment"]
    if not plan.standin and any(p.role in ("prefill", "decode") for p in plan.procs):
        code = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('sglang') else 3)"
        r = subprocess.run([plan.python, "-c", code], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            return [f"sglang is not installed in {plan.python}: run `make setup`"]
    return []


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def check_alloc_conf(plan: Plan, env: Dict[str, str]) -> List[str]:
    """A PyTorch allocator setting with ``expandable_segments:True`` in the servers' environment, under the NIXL
    transfer backend: the KV cache then lives in CUDA VMM allocations, and NIXL's memory registration wants it off
    (SGLang 0.5.23 reads both variables the same way, ``disaggregation/mooncake/utils.py``)."""
    if plan.settings.get("TRANSFER_BACKEND", "nixl") != "nixl" or \
            not any(p.role in ("prefill", "decode") for p in plan.procs):
        return []
    out = []
    for var in ALLOC_CONF_VARS:
        for item in (env.get(var) or "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                out.append(f"{var}={env[var]!r} turns on expandable_segments, which NIXL's memory registration of "
                           f"the KV cache wants off: remove expandable_segments:True from {var} (or set "
                           f"expandable_segments:False)")
    return out


def check_attention_arch(env: Dict[str, str]) -> List[str]:
    """A split body named in ``DSV4_SM120_ATTN_CONFIG`` that sm_120 does not run (``impl=wgmma``, Hopper's
    warpgroup MMA): the servers' GPUs are sm_120 (the gpu check), so the first decode would stop the server."""
    from ..attention.keys import IMPLS, DecodeInputError, arch_names, parse_config, runs_on

    text = env.get("DSV4_SM120_ATTN_CONFIG") or ""
    try:
        impl = parse_config(text).get("impl")
    except DecodeInputError:
        return []  # reported by settings.validate
    if runs_on(impl, 12):
        return []
    others = ", ".join(i for i in IMPLS if runs_on(i, 12))
    return [f"DSV4_SM120_ATTN_CONFIG={text!r} names impl={impl}, which runs on {arch_names(impl)} only, and the "
            f"servers' GPUs are sm_120: remove impl={impl} (or name one of {others})"]


def check_overlay_env(plan: Plan, base: Optional[Dict[str, str]] = None) -> List[str]:
    """The problems the patched SGLang's startup would stop at (``dsv4_sm120.settings.validate`` of the
    servers' environment: the caller's plus serve/env/*.env: invalid values, retired names, unknown
    ``DSV4_SM120_*`` names; a split body sm_120 does not run, ``check_attention_arch``), and an allocator setting
    the KV transfer cannot work with (``check_alloc_conf``), reported before anything starts."""
    from .. import settings

    env = dict(os.environ if base is None else base)
    for k, v, _ in plan.common_env:
        env.setdefault(k, v)
    return settings.validate(env) + check_attention_arch(env) + check_alloc_conf(plan, env)


# ---------------------------------------------------------------------------- machine profile

def server_gpu_names(plan: Plan) -> Tuple[Dict[str, str], Optional[str]]:
    """({gpu name: "role GPU i,j"} of the servers' GPUs, or {} and why nvidia-smi could not say)."""
    idx = {}
    for p in plan.procs:
        if p.role in ("prefill", "decode"):
            for i in p.gpus:
                idx.setdefault(i, []).append(p.label)
    if not idx:
        return {}, None
    smi = plan.settings.get("NVIDIA_SMI") or "nvidia-smi"
    try:
        r = subprocess.run([smi, "--query-gpu=index,name", "--format=csv,noheader"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return {}, f"nvidia-smi ({smi}) did not run: {e}"
    if r.returncode != 0:
        return {}, f"nvidia-smi failed (exit {r.returncode})"
    names: Dict[str, List[str]] = {}
    for line in r.stdout.strip().splitlines():
        i, _, name = (x.strip() for x in line.partition(","))
        if i.isdigit() and int(i) in idx and name:
            names.setdefault(name, []).append(f"{'/'.join(idx[int(i)])} GPU {i}")
    return {n: ", ".join(w) for n, w in names.items()}, None


def interpret_profile_status(rows: List[dict], where: Dict[str, str]) -> List[str]:
    """Notes (never failures) from ``python -m dsv4_sm120.machine_profile status --json`` rows."""
    notes = []
    for row in rows:
        gpu = row.get("gpu", "?")
        warn = [r for r in row.get("reasons", []) if r.startswith("warning:")]
        if row.get("usable"):
            notes.append(f"machine profile {row.get('path')} applies to {gpu} ({where.get(gpu, '')})"
                         + (f"; {'; '.join(w[len('warning: '):] for w in warn)}" if warn else ""))
            continue
        why = [r for r in row.get("reasons", []) if not r.startswith("warning:")] or ["no reason given"]
        notes.append(f"WARNING: no matching machine profile for {gpu} ({where.get(gpu, '')}): {'; '.join(why)}; "
                     f"the servers use the default choices (`make calibrate`, or CALIBRATE=1, picks by measurement)")
    return notes


def check_profile(plan: Plan) -> Tuple[List[str], List[str]]:
    """Warnings only (module doc): the status runs in the serving python, whose versions the servers have.
    Stand-in servers read no profile: nothing to check."""
    if plan.standin:
        return [], []
    where, why = server_gpu_names(plan)
    if why:
        return [], [f"WARNING: could not check the machine profile ({why})"]
    if not where:
        return [], []
    env = overlay_env(plan)
    for k, v, _ in plan.common_env:
        env.setdefault(k, v)
    cmd = [plan.python, "-m", "dsv4_sm120.machine_profile", "status", "--json"]
    for n in where:
        cmd += ["--gpu", n]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=plan.repo)
        rows = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return [], [f"WARNING: could not check the machine profile ({type(e).__name__}: {e})"]
    if r.returncode != 0 or not rows:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [f"exit {r.returncode}"]
        return [], [f"WARNING: could not check the machine profile: {tail[0]}"]
    return [], interpret_profile_status(rows, where)


def calibrate_first(plan: Plan, say: Callable[[str], None] = print) -> List[str]:
    """``CALIBRATE=1``: run the plan's calibration command (output streamed); a failure line, or []."""
    if not plan.calibrate_argv:
        return []
    if plan.standin:
        say("calibrate: skipped (stand-in servers need no profile)")
        return []
    env = overlay_env(plan)
    for k, v, _ in plan.common_env:
        env.setdefault(k, v)
    env.update(plan.calibrate_env)
    say("calibrate: measuring this box first (CALIBRATE=1): " + " ".join(plan.calibrate_argv[1:]))
    try:
        rc = subprocess.run(plan.calibrate_argv, env=env, cwd=plan.repo).returncode
    except OSError as e:
        return [f"CALIBRATE=1: the calibration did not start ({e})"]
    if rc != 0:
        return [f"CALIBRATE=1: `python -m dsv4_sm120.calibrate` failed (exit {rc}); its output is above "
                f"(CALIBRATE=0 starts with the profile there is)"]
    return []


def check_model_notes(plan: Plan) -> Tuple[List[str], List[str]]:
    """The model check as the runners call it: its failures (``check_model``) and its warnings (a Hub id nothing here
    knows: ``model_config.ModelConfig.warnings``)."""
    failures = check_model(plan)
    if failures or not any(p.role in ("prefill", "decode") for p in plan.procs):
        return failures, []
    return failures, model_config.read(plan.settings["MODEL_PATH"]).warnings()


RUNNERS: Dict[str, Callable] = {
    "ports": check_ports, "gpu": check_gpu, "model": check_model_notes, "memory": check_memory,
    "patches": check_patches, "nixl": check_nixl, "router": check_router,
    "numa": check_numa, "p2p": check_p2p, "ucx": check_ucx, "profile": check_profile,
}

# A check that only means something once another one passed: when that one fails, it is not run and says why
# (a box with no NVIDIA driver fails `gpu`, not `gpu`, `p2p` and `ucx`).
NEEDS = {"p2p": "gpu", "ucx": "gpu", "profile": "gpu", "memory": "gpu"}
# Checks that run the serving environment's python (none can run without it).
NEEDS_PYTHON = ("patches", "nixl", "router", "p2p", "ucx", "profile")
# The checks a dry run leaves to the start, and why: each needs the GPUs, NIXL or processes running. A dry run runs
# every other check; `gpu` and `profile` when nvidia-smi answers.
NOT_IN_DRY_RUN = {
    "nixl": "moves KV pages through NIXL",
    "p2p": "copies between the GPUs",
    "ucx": "moves KV pages between the GPUs through NIXL/UCX",
}
NEEDS_SMI = ("gpu", "memory", "profile")


def smi_problem(plan: Plan) -> Optional[str]:
    """Why nvidia-smi does not answer here (None: it lists GPUs)."""
    smi = plan.settings.get("NVIDIA_SMI") or "nvidia-smi"
    try:
        r = subprocess.run([smi, "--query-gpu=index,name,compute_cap,memory.total,memory.free",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return f"{smi} not found"
    except (OSError, subprocess.SubprocessError) as e:
        return f"{smi} did not run ({type(e).__name__})"
    if r.returncode != 0 or not r.stdout.strip():
        return f"{smi} failed (exit {r.returncode})"
    return None


def _model_note(plan: Plan) -> str:
    """What the dry run's model check read, for its ok line."""
    if not any(p.role in ("prefill", "decode") for p in plan.procs):
        return "no server on this host"
    mc = model_config.read(plan.settings["MODEL_PATH"])
    if mc.where == "local":
        return f"{mc.source}, shard headers read"
    if mc.where == "hub":
        return "a Hugging Face id not in the local Hugging Face cache: SGLang downloads it at start"
    return mc.source


def _not_run(plan: Plan, name: str, failed: set, dry: bool, smi: Optional[str]) -> Optional[str]:
    """Why check ``name`` does not run (None: it runs)."""
    if name in NEEDS_PYTHON and "python" in failed:
        return "needs the python check, which failed"
    if NEEDS.get(name) in failed:
        return f"needs the {NEEDS[name]} check, which failed"
    if dry and name in NOT_IN_DRY_RUN:
        return f"dry run: {NOT_IN_DRY_RUN[name]}"
    if dry and name in NEEDS_SMI and smi:
        return f"dry run: needs nvidia-smi, which does not answer here: {smi}"
    return None


def _run_checks(plan: Plan, say: Callable[[str], None], dry: bool) -> List[str]:
    """Every check not skipped, in order, with its status line; the failure lines. A start stops at a missing
    serving python (nothing else can run) and runs ``CALIBRATE=1``'s calibration before the checks."""
    skip = skipped_checks(plan)
    failures, failed = [], set()
    if dry:
        say("# preflight: every check a start runs that needs no GPU, NIXL or running server (a start runs them "
            "again, with the rest):")
    env = check_overlay_env(plan)
    python = check_python(plan)
    if python and not dry:
        return python
    _verdict("env", env, say)
    failures += env
    if dry:
        _verdict("python", python, say)
        failures += python
        failed |= {"python"} if python else set()
    elif not env:
        calibration = calibrate_first(plan, say)
        if calibration:
            return calibration
    smi = smi_problem(plan) if dry else None
    for name in CHECKS:
        if name in skip:
            say(f"preflight {name}: skipped")
            _ipc_unverified(plan, name, "not verified (the p2p check is skipped)", say)
            continue
        why = _not_run(plan, name, failed, dry, smi)
        if why:
            say(f"preflight {name}: not run ({why})")
            _ipc_unverified(plan, name, "a start's p2p check verifies it (the server runs NCCL where it is missing)"
                            if dry and name in NOT_IN_DRY_RUN else f"not verified ({why})", say)
            continue
        res = RUNNERS[name](plan)
        res, notes = res if isinstance(res, tuple) else (res, [])
        ok = "ok"
        if dry and name == "model":
            ok = f"ok ({_model_note(plan)})"
        elif dry and name == "numa":
            ok, notes = ("ok (the numa lines above)" if any(p.numa for p in plan.procs) else "ok"), []
        _verdict(name, res, say, ok=ok)
        for n in notes:
            say(f"preflight {name}: {n}")
        failures += res
        failed |= {name} if res else set()
    return failures


def _ipc_unverified(plan: Plan, name: str, why: str, say: Callable[[str], None]) -> None:
    """When the p2p check does not run: a note per server that starts with the PCIe-IPC all-reduce on."""
    if name == "p2p":
        for n in ipc_unverified(plan, why):
            say(f"preflight p2p: {n}")


def run_dry_checks(plan: Plan, say: Callable[[str], None] = print) -> List[str]:
    """The dry run's preflight: the same check functions and failure lines as ``run_preflight``, every check whose
    inputs a dry run has (all but nixl, p2p and ucx; gpu and profile when nvidia-smi answers); the others are listed
    as not run. Returns the failure lines (empty = a start would get past these)."""
    return _run_checks(plan, say, dry=True)


def run_preflight(plan: Plan, say: Callable[[str], None] = print) -> List[str]:
    """Run every check not skipped; return the failure lines (empty = go)."""
    return _run_checks(plan, say, dry=False)


def _verdict(name: str, failures: List[str], say: Callable[[str], None], ok: str = "ok") -> None:
    """A check's status line (``ok`` or ``FAILED``; the line readers parse), then each failure's reason indented
    under it, so the reason sits beside its check (the refusal's summary at the end repeats them)."""
    say(f"preflight {name}: {ok if not failures else 'FAILED'}")
    for f in failures:
        say(f"  {f}")
