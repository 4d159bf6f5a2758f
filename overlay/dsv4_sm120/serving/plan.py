"""Environment variables -> the deployment plan (what runs where, with which flags and environment).

Every knob is an environment variable with a default, declared typed in ``dsv4_sm120.serve_variables`` and read
here through the settings registry (``settings.get``: kind, valid values, range; table in ``docs/serving.md``);
a bad value is one line naming the variable. The plan is pure data, so ``DRY_RUN=1`` prints exactly what a real
start would run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

from .. import model_config, settings
from ..moe_runner import MOE_FLAG, mxfp4_runner
from ..paths import checkout_root
from ..serve_variables import FP8_BACKENDS, ROLES, SERVE, VARIABLES, gpu_list, node_roles
from . import extra_args
from .envfiles import EnvFileError, load_env_dir

LOOPBACK = {"127.0.0.1", "localhost", "::1"}

# Proc.binds' names -> the variable that sets each port.
PORT_VARIABLES = {"prefill HTTP": "PREFILL_PORT", "prefill bootstrap": "BOOTSTRAP_PORT", "decode HTTP": "DECODE_PORT",
                  "router HTTP": "ROUTER_PORT", "router metrics": "ROUTER_PROMETHEUS_PORT"}

PASS_THROUGH = re.compile(r"^(SGLANG_|DSV4_SM120_|NCCL_|UCX_|NIXL_|TORCH_NCCL_|CUDA_DEVICE_ORDER$)")
# Variables the scripts, the tests and the stand-ins use among themselves: never listed as user settings.
INTERNAL = re.compile(r"^(DSV4_SM120_SERVE_|DSV4_SM120_STANDIN_|DSV4_SM120_ORIG_PYTHONPATH$|DSV4_SM120_REPO_ROOT$|"
                      r"DSV4_SM120_CACHE$|DSV4_SM120_VARIANT$|SGLANG_TORCH_PROFILER_DIR$|SGLANG_HOST_IP$)")


# seconds the router waits for in-flight requests after SIGTERM (below the teardown's STOP_GRACE_S default)
ROUTER_SHUTDOWN_GRACE_S = 5


class ConfigError(Exception):
    """A configuration mistake, reported as one line."""


@dataclass
class Proc:
    role: str
    argv: List[str]
    env: Dict[str, str]
    health_url: str
    binds: List[Tuple[str, int, str]]        # (host, port, what)
    gpus: List[int] = field(default_factory=list)
    log: str = ""
    numa: Dict = field(default_factory=dict)      # topology.NumaBinding.to_dict() of a server
    unset: List[str] = field(default_factory=list)   # variables the server must not inherit (serve/env, caller)
    allreduce: str = ""                           # a server's TP all-reduce choice and where it came from


@dataclass
class Plan:
    variant: str
    repo: str
    python: str
    run_dir: str
    roles: List[str]
    standin: bool
    settings: Dict[str, str]
    common_env: List[Tuple[str, str, str]]   # (key, value, source)
    procs: List[Proc]
    remote_health: Dict[str, str]            # role -> health URL of parts run on another host
    urls: Dict[str, str]
    fp8_reason: str = ""
    moe_reason: str = ""
    spec_reason: str = ""
    calibrate_argv: List[str] = field(default_factory=list)   # CALIBRATE=1: run before the preflight's checks
    calibrate_env: Dict[str, str] = field(default_factory=dict)

    def value(self, name: str):
        """The typed value of serve variable ``name`` in this plan (``settings.get`` of ``self.settings``)."""
        return settings.get(name, self.settings)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Plan":
        d = json.loads(text)
        d["procs"] = [Proc(**p) for p in d["procs"]]
        d["common_env"] = [tuple(x) for x in d["common_env"]]
        for p in d["procs"]:
            p.binds = [tuple(b) for b in p.binds]
        return Plan(**d)


def settings_from_env(environ: Mapping[str, str]) -> Dict[str, str]:
    """The serve variables as text: the caller's value, or the default's text where unset or empty."""
    return {k: environ.get(k) or ("" if k == "MODEL_PATH" and k in environ else d) for k, (d, _) in VARIABLES.items()}


def typed_settings(s: Mapping[str, str]) -> Dict[str, object]:
    """Every serve variable's typed value through the settings registry; ConfigError (the registry's one line)
    for the first invalid one."""
    out = {}
    for k in SERVE:
        try:
            out[k] = settings.get(k, s)
        except settings.SettingsError as e:
            raise ConfigError(str(e)) from None
    return out


def parse_gpus(key: str, text: str) -> List[int]:
    try:
        return gpu_list(text)
    except ValueError as e:
        raise ConfigError(f"{key}={text!r} is not valid: {e}") from None


def _split(key: str, text: str) -> List[str]:
    try:
        return shlex.split(text or "")
    except ValueError as e:
        raise ConfigError(f"{key}: cannot split {text!r}: {e}")


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def gpu_name(smi: str, index: int) -> Optional[str]:
    """nvidia-smi's name of GPU ``index`` (None when there is no nvidia-smi / no such GPU)."""
    import subprocess

    try:
        r = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader", "-i", str(index)],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    name = r.stdout.strip().splitlines()[0].strip() if r.returncode == 0 and r.stdout.strip() else ""
    return name or None


def fp8_gemm_backend(setting: str, repo: Path, device_name: Optional[str]) -> Tuple[Optional[str], str]:
    """The --fp8-gemm-backend to pass (None = leave SGLang's default) and why.

    ``FP8_GEMM_BACKEND`` other than ``auto`` is passed as is. With ``auto`` the FP8 tuner's
    summary for the serving GPU (``configs/fp8/summary_<device>.json``, read through
    :func:`dsv4_sm120.fp8_configs.recommended_fp8_gemm_backend`, which also honours
    ``DSV4_SM120_FP8_GEMM_BACKEND``) decides; without a GPU name or a summary SGLang's default stays.
    """
    setting = (setting or "auto").strip().lower()
    if setting != "auto":
        if setting not in FP8_BACKENDS:
            raise ConfigError(f"FP8_GEMM_BACKEND={setting!r}: expected one of {', '.join(FP8_BACKENDS)}")
        return setting, f"FP8_GEMM_BACKEND={setting}"
    from dsv4_sm120.fp8_configs import ENV_BACKEND, recommended_fp8_gemm_backend

    if device_name is None and not (settings.raw(ENV_BACKEND) or "").strip():
        return None, "SGLang default (no GPU name from nvidia-smi, so no tuning summary applies)"
    import logging

    # the profile lookup logs why no profile applies; the preflight's profile check says it, under its own name
    log = logging.getLogger("dsv4_sm120.calibrate.machine_profile")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        choice, why = recommended_fp8_gemm_backend(device_name or "unknown", repo / "configs" / "fp8")
    except ValueError as e:
        raise ConfigError(str(e))
    finally:
        log.setLevel(level)
    if choice is not None and choice not in FP8_BACKENDS:
        raise ConfigError(f"FP8 backend {choice!r} ({why}) is not one of {', '.join(FP8_BACKENDS)}")
    return choice, (f"{choice}: {why}" if choice else f"SGLang default: {why}")


def port_variable(what: str) -> str:
    """The variable that sets the port of a bind named ``what`` (``Proc.binds``)."""
    return PORT_VARIABLES.get(what, "the port's variable")


def user_moe_flag(s: Dict[str, str]) -> Optional[str]:
    """The first of SERVER/PREFILL/DECODE_EXTRA_ARGS that passes --moe-runner-backend, or None."""
    for k in ("SERVER_EXTRA_ARGS", "PREFILL_EXTRA_ARGS", "DECODE_EXTRA_ARGS"):
        if any(t == MOE_FLAG or t.startswith(MOE_FLAG + "=") for t in _split(k, s[k])):
            return k
    return None


def _roles(s: Dict[str, str]) -> List[str]:
    try:
        return node_roles(s["NODE_ROLE"])
    except ValueError as e:
        raise ConfigError(f"NODE_ROLE={s['NODE_ROLE']!r} is not valid: {e}") from None


def _gpus(s: Dict[str, str], roles: List[str]) -> Tuple[List[int], List[int]]:
    pg = parse_gpus("PREFILL_GPUS", s["PREFILL_GPUS"])
    dg = parse_gpus("DECODE_GPUS", s["DECODE_GPUS"])
    if "prefill" in roles and "decode" in roles and set(pg) & set(dg):
        raise ConfigError(f"PREFILL_GPUS={s['PREFILL_GPUS']} and DECODE_GPUS={s['DECODE_GPUS']} share GPUs "
                          f"{sorted(set(pg) & set(dg))} on this host")
    return pg, dg


def _numbers(v: Dict[str, object]) -> Tuple[Dict[str, int], Dict[str, float]]:
    """(ports, memory fraction per server) from the typed settings."""
    ports = {k: v[k] for k in ("PREFILL_PORT", "BOOTSTRAP_PORT", "DECODE_PORT", "ROUTER_PORT", "ROUTER_PROMETHEUS_PORT")}
    mem = {r: v[f"{r.upper()}_MEM_FRACTION"] or v["MEM_FRACTION"] for r in ("prefill", "decode")}
    return ports, mem


def _speculative(variant: str, s: Dict[str, str], environ: Mapping[str, str]) -> Tuple[Optional[List[str]], str]:
    if variant != "mtp":
        return None, ""
    from .speculative import SpecError, spec_flags

    try:
        spec, spec_reason = spec_flags(s, environ)
    except SpecError as e:
        raise ConfigError(str(e))
    # --enable-metrics: the speculation counters make measure report accepted tokens per step
    return spec + ["--enable-metrics"], spec_reason


def _runners(s: Dict[str, str], environ: Mapping[str, str], roles: List[str], pg: List[int], dg: List[int],
             repo: Path) -> Tuple[Optional[str], str, Optional[str], str]:
    """(--fp8-gemm-backend, why, --moe-runner-backend, why) of the servers on this host."""
    dev = None
    servers = "decode" in roles or "prefill" in roles
    user_moe = user_moe_flag(s)
    model = model_config.read(s["MODEL_PATH"], environ) if servers else None
    want_moe = servers and user_moe is None and model.moe_format == "mxfp4"
    if servers and (s["FP8_GEMM_BACKEND"].strip().lower() in ("auto", "") or want_moe):
        dev = gpu_name(s["NVIDIA_SMI"] or "nvidia-smi", (dg if "decode" in roles else pg)[0])
    fp8, fp8_reason = fp8_gemm_backend(s["FP8_GEMM_BACKEND"], repo, dev)
    moe, moe_reason = (mxfp4_runner(s["MODEL_PATH"], dev, user_moe, model) if servers
                       else (None, "no server on this host"))
    return fp8, fp8_reason, moe, moe_reason


def directory_problem(path: Path) -> Optional[str]:
    """Why a directory cannot be made and written at ``path`` (None: it can). Nothing stays behind: a probe
    directory is made and removed in the nearest existing ancestor (the only sure test: permissions say
    nothing for root, nor on /proc or a read-only mount)."""
    p = path
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    if not p.is_dir():
        return f"{p} is not a directory" if p == path else f"{p} is a file, not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dsv4-sm120-probe-", dir=p))
    except OSError as e:
        return f"cannot create a directory in {p} ({e.strerror})"
    return None


def _run_dir(s: Dict[str, str], repo: Path, variant: str, now: Optional[float]) -> Path:
    """The run directory (not created here); ConfigError when it or LOG_DIR (where LOG_DIR/latest goes) cannot be
    made or written."""
    log_dir = Path(os.path.expanduser(s["LOG_DIR"]))
    log_dir = log_dir if log_dir.is_absolute() else repo / log_dir
    checks = [("LOG_DIR", log_dir)]
    if s["RUN_DIR"]:
        run_dir = Path(os.path.expanduser(s["RUN_DIR"]))
        run_dir = run_dir if run_dir.is_absolute() else repo / run_dir
        checks.append(("RUN_DIR", run_dir))
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now if now is not None else time.time()))
        run_dir = log_dir / f"serve-{variant}-{stamp}-{os.getpid()}"
    for var, d in checks:
        problem = directory_problem(d)
        if problem:
            raise ConfigError(f"{var}={s[var]}: the run directory cannot go there ({problem}); set {var} to a "
                              f"writable directory")
    return run_dir


def _common_env(repo: Path, environ: Mapping[str, str]) -> List[Tuple[str, str, str]]:
    try:
        common_env = load_env_dir(repo / "serve" / "env", environ)
    except EnvFileError as e:
        raise ConfigError(str(e))
    # Switches the caller set for SGLang / the overlay / NCCL / UCX reach the servers anyway (the
    # environment is inherited); list them so the start banner and the dry run show them.
    listed = {c[0] for c in common_env}
    for k in sorted(environ):
        if k in listed or not PASS_THROUGH.match(k) or INTERNAL.match(k):
            continue
        common_env.append((k, environ[k], "environment"))
    return common_env


def _server_common(s: Dict[str, str], python: str, standin: bool, ctx: int, fp8: Optional[str],
                   moe: Optional[str]) -> List[str]:
    """The start of both servers' command lines: interpreter, launcher and the flags they share."""
    launcher = ["-m", "dsv4_sm120.serving.standin"] if standin else ["-m", "sglang.launch_server"]
    common = [python, *launcher, "--model-path", s["MODEL_PATH"], "--context-length", str(ctx),
              "--disaggregation-transfer-backend", s["TRANSFER_BACKEND"]]
    if s["SERVED_MODEL_NAME"]:
        common += ["--served-model-name", s["SERVED_MODEL_NAME"]]
    if fp8:
        common += ["--fp8-gemm-backend", fp8]
    if moe:
        common += [MOE_FLAG, moe]
    if s["IB_DEVICE"]:
        common += ["--disaggregation-ib-device", s["IB_DEVICE"]]
    return common


def _procs(s: Dict[str, str], roles: List[str], python: str, common: List[str], spec: Optional[List[str]],
           gpus: Dict[str, List[int]], ports: Dict[str, int], mem: Dict[str, float], v: Dict[str, object],
           urls: Dict[str, str], multi_node: bool, prof_dir: str) -> List[Proc]:
    """The processes of ``roles`` on this host (logs and NUMA binding not yet set)."""
    ph, dh, rh = s["PREFILL_HOST"], s["DECODE_HOST"], s["ROUTER_HOST"]
    pg, dg = gpus["prefill"], gpus["decode"]
    procs: List[Proc] = []

    def server(role: str, argv: List[str], host: str, role_gpus: List[int], listens) -> Proc:
        """A server process: its argv plus speculation and the extra args, its GPUs, profiler dir and host IP."""
        var = f"{role.upper()}_EXTRA_ARGS"
        argv = argv + (spec or []) + _split("SERVER_EXTRA_ARGS", s["SERVER_EXTRA_ARGS"]) + _split(var, s[var])
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, role_gpus)), "SGLANG_TORCH_PROFILER_DIR": prof_dir}
        if multi_node and host not in ("0.0.0.0", "::"):
            env["SGLANG_HOST_IP"] = host
        return Proc(role, argv, env, urls[role] + "/health", listens, role_gpus)

    if "prefill" in roles:
        argv = [*common, "--tp", str(len(pg)), "--host", ph, "--port", str(ports["PREFILL_PORT"]),
                "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(ports["BOOTSTRAP_PORT"]),
                "--mem-fraction-static", f"{mem['prefill']:g}"]
        if v["PREFILL_MAX_RUNNING"] is not None:
            argv += ["--max-running-requests", str(v["PREFILL_MAX_RUNNING"])]
        if v["CHUNKED_PREFILL_SIZE"] is not None:
            argv += ["--chunked-prefill-size", str(v["CHUNKED_PREFILL_SIZE"])]
        procs.append(server(
            "prefill", argv, ph, pg,
            [(ph, ports["PREFILL_PORT"], "prefill HTTP"), (ph, ports["BOOTSTRAP_PORT"], "prefill bootstrap")]))
    if "decode" in roles:
        argv = [*common, "--tp", str(len(dg)), "--host", dh, "--port", str(ports["DECODE_PORT"]),
                "--disaggregation-mode", "decode", "--mem-fraction-static", f"{mem['decode']:g}",
                "--max-running-requests", str(v["MAX_RUNNING"]), "--cuda-graph-max-bs-decode", str(v["MAX_RUNNING"])]
        procs.append(server("decode", argv, dh, dg, [(dh, ports["DECODE_PORT"], "decode HTTP")]))
    if "router" in roles:
        argv = [python, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                "--prefill", urls["prefill"], str(ports["BOOTSTRAP_PORT"]), "--decode", urls["decode"],
                "--host", rh, "--port", str(ports["ROUTER_PORT"]),
                "--prometheus-host", rh, "--prometheus-port", str(ports["ROUTER_PROMETHEUS_PORT"]),
                "--log-level", "info",
                # the router waits this long for in-flight requests on SIGTERM (its default, 180 s, outlasts
                # the teardown's STOP_GRACE_S, so a stop with a dropped stream would end in SIGKILL)
                "--shutdown-grace-period-secs", str(ROUTER_SHUTDOWN_GRACE_S)] + _split("ROUTER_EXTRA_ARGS", s["ROUTER_EXTRA_ARGS"])
        procs.append(Proc("router", argv, {}, urls["router"] + "/health",
                          [(rh, ports["ROUTER_PORT"], "router HTTP"),
                           (rh, ports["ROUTER_PROMETHEUS_PORT"], "router metrics")]))
    return procs


def _check_ports(procs: List[Proc]) -> None:
    """Two parts on one host must not share a port."""
    seen: Dict[Tuple[str, int], str] = {}
    for p in procs:
        for h, port, what in p.binds:
            key = (_url_host(h), port)
            if key in seen:
                raise ConfigError(f"port {port} is configured twice on {h}: {seen[key]} ({port_variable(seen[key])}) "
                                  f"and {what} ({port_variable(what)}): set one of them to another port")
            seen[key] = what


def build_plan(environ: Mapping[str, str], variant: str = "base", now: Optional[float] = None) -> Plan:
    if variant not in ("base", "mtp"):
        raise ConfigError(f"unknown variant {variant!r}")
    s = settings_from_env(environ)
    v = typed_settings(s)
    # a local checkpoint, absolute: servers, draft detection, calibration, verify and measure get this path
    s["MODEL_PATH"] = model_config.absolute_if_local(s["MODEL_PATH"])
    repo = checkout_root()
    standin = v["DSV4_SM120_SERVE_STANDIN"]

    venv = Path(v["VENV"])
    venv = venv if venv.is_absolute() else repo / venv
    python = str(venv / "bin" / "python")

    roles = _roles(s)
    problem = extra_args.check(s, roles, variant)
    if problem:
        raise ConfigError(problem)
    pg, dg = _gpus(s, roles)
    ports, mem = _numbers(v)
    spec, spec_reason = _speculative(variant, s, environ)
    fp8, fp8_reason, moe, moe_reason = _runners(s, environ, roles, pg, dg, repo)
    cal_argv, cal_env = calibrate_command(s, python, roles, pg, dg)
    run_dir = _run_dir(s, repo, variant, now)
    common_env = _common_env(repo, environ)

    ph, dh, rh = s["PREFILL_HOST"], s["DECODE_HOST"], s["ROUTER_HOST"]
    urls = {"prefill": f"http://{_url_host(ph)}:{ports['PREFILL_PORT']}",
            "decode": f"http://{_url_host(dh)}:{ports['DECODE_PORT']}",
            "router": f"http://{_url_host(rh)}:{ports['ROUTER_PORT']}"}
    multi_node = not (ph in LOOPBACK and dh in LOOPBACK)
    prof_dir = environ.get("SGLANG_TORCH_PROFILER_DIR") or str(run_dir / "profile")
    procs = _procs(s, roles, python, _server_common(s, python, standin, v["CONTEXT_LEN"], fp8, moe), spec,
                   {"prefill": pg, "decode": dg}, ports, mem, v, urls, multi_node, prof_dir)
    for p in procs:
        p.log = str(run_dir / f"{p.role}.log")
    _bind_numa(procs, s, environ)
    _bind_allreduce(procs, s, {**{k: v for k, v, _ in common_env}, **environ})
    if not multi_node and not s["IB_DEVICE"] and not any(k == "UCX_NET_DEVICES" for k, _, _ in common_env):
        # One host: KV moves over cuda_ipc / shared memory; pinning UCX's network devices to loopback keeps
        # its wire-up off unreachable interfaces (docker bridges, down IB ports), where transfers can hang
        # until SGLang's timeout.
        for p in procs:
            if p.role in ("prefill", "decode"):
                p.env["UCX_NET_DEVICES"] = "lo"
    _check_ports(procs)

    remote = {}
    if "router" in roles:
        for r in ("prefill", "decode"):
            if r not in roles:
                remote[r] = urls[r] + "/health"

    return Plan(variant=variant, repo=str(repo), python=python, run_dir=str(run_dir), roles=roles, standin=standin,
                settings=s, common_env=common_env, procs=procs, remote_health=remote, urls=urls,
                fp8_reason=fp8_reason, moe_reason=moe_reason, spec_reason=spec_reason, calibrate_argv=cal_argv,
                calibrate_env=cal_env)


def calibrate_command(s: Dict[str, str], python: str, roles: List[str], pg: List[int],
                      dg: List[int]) -> Tuple[List[str], Dict[str, str]]:
    """``CALIBRATE=1``: the ``make calibrate`` equivalent (argv, extra environment) run before the preflight's
    profile check: the serving python on the first GPU of the decode server (of the prefill server when this
    host runs no decode), with that server's GPUs as ``DECODE_GPUS`` (the TP the shapes follow) and
    ``MODEL_PATH``. ``([], {})`` when ``CALIBRATE`` is 0 or this host runs no server."""
    gpus = dg if "decode" in roles else (pg if "prefill" in roles else [])
    if not settings.get("CALIBRATE", s) or not gpus:
        return [], {}
    env = {"CUDA_VISIBLE_DEVICES": str(gpus[0]), "DECODE_GPUS": ",".join(map(str, gpus)),
           "MODEL_PATH": s["MODEL_PATH"]}
    return [python, "-m", "dsv4_sm120.calibrate"], env


def _bind_numa(procs: List[Proc], s: Dict[str, str], environ: Mapping[str, str]) -> None:
    """NUMA placement of the servers from the box's topology (``topology.numa_bindings``): the node goes
    into ``Proc.numa`` (the supervisor pins the server to it) and SGLang gets ``--numa-node`` per TP rank.
    ``NUMA_BIND=0`` leaves both unbound and turns SGLang's own automatic binding off."""
    from .topology import numa_bindings, sglang_numa_args

    servers = [p for p in procs if p.role in ("prefill", "decode")]
    if not servers:
        return
    enabled = settings.get("NUMA_BIND", s)
    sysfs = Path(settings.get("DSV4_SM120_SERVE_SYSFS_ROOT", environ) or "/sys")
    binds = numa_bindings({p.role: p.gpus for p in servers}, s["NVIDIA_SMI"] or "nvidia-smi", sysfs, enabled)
    for p in servers:
        b = binds[p.role]
        p.numa = b.to_dict()
        p.numa["text"] = b.describe()
        if not enabled:
            p.env["SGLANG_AUTO_NUMA_BIND"] = "0"
        elif "--numa-node" not in p.argv:      # a --numa-node in *_EXTRA_ARGS is the user's choice
            p.argv += sglang_numa_args(b)


def _bind_allreduce(procs: List[Proc], s: Dict[str, str], server_environ: Mapping[str, str]) -> None:
    """Each server's TP all-reduce environment (``profile_choices.allreduce``: your settings, else the machine
    profile's measured choice for that server at its TP size, else the defaults), in ``Proc.env`` / ``Proc.unset``,
    with the line that says where it came from. ``server_environ``: what the servers inherit (the caller's
    environment over serve/env/*.env)."""
    from .profile_choices import allreduce

    for p in procs:
        if p.role in ("prefill", "decode"):
            senv = allreduce(p.role, p.gpus, server_environ, s["NVIDIA_SMI"] or "nvidia-smi")
            p.env.update(senv.env)
            p.unset = list(senv.unset)
            p.allreduce = senv.source


def changed_settings(plan: Plan) -> List[Tuple[str, str]]:
    """[(name, value)] of the variables whose value differs from their default (DRY_RUN left out)."""
    return [(k, plan.settings[k]) for k, (d, _) in VARIABLES.items()
            if k != "DRY_RUN" and plan.settings[k] != (d or "")]


def render_dry_run(plan: Plan) -> str:
    """The plan as text: the commands first (``cmd ROLE: ENV=... argv``, shell-quoted, one line each),
    then the environment the servers get on top of the inherited one, the settings that differ from
    their defaults, and where health checks, logs and the router are."""
    out = [f"# dsv4_sm120 serve plan: variant={plan.variant} roles={','.join(plan.roles)}"
           f"{' STANDIN' if plan.standin else ''} (dry run: nothing started; the preflight's checks that need no GPU, "
           f"NIXL or running server follow the plan)"]
    if plan.calibrate_argv:
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.calibrate_env.items())
        out.append(f"cmd calibrate: {prefix} {shlex.join(plan.calibrate_argv)}")   # CALIBRATE=1: before preflight
    for p in plan.procs:
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in p.env.items())
        out.append(f"cmd {p.role}: {prefix + ' ' if prefix else ''}{shlex.join(p.argv)}")
    files = [(k, v, src) for k, v, src in plan.common_env if src != "environment"]
    caller = [(k, v, src) for k, v, src in plan.common_env if src == "environment"]
    if files:
        out.append("# environment added for both servers by serve/env/*.env:")
        out += [f"env {k}={shlex.quote(v)}  # {src}" for k, v, src in files]
    if caller:
        out.append("# from your environment (both servers inherit it; it wins over serve/env/*.env):")
        out += [f"env {k}={shlex.quote(v)}  # {src}" for k, v, src in caller]
    changed = changed_settings(plan)
    if changed:
        out.append("# settings that differ from their defaults (serve/serve_dsv4_tp4.sh --help-vars lists all):")
        out += [f"setting {k}={shlex.quote(v)}" for k, v in changed]
    else:
        out.append("# every setting at its default (serve/serve_dsv4_tp4.sh --help-vars lists them)")
    out.append(f"# fp8 gemm backend: {plan.fp8_reason}")
    if plan.moe_reason:
        out.append(f"# moe runner: {plan.moe_reason}")
    if plan.spec_reason:
        out.append(f"# speculative decoding: {plan.spec_reason}")
    for p in plan.procs:
        if p.allreduce:
            out.append(f"all-reduce {p.role}: {p.allreduce}")
    for p in plan.procs:
        if p.numa:
            out.append(f"numa {p.role}: {p.numa.get('text', '')}")
    out.append(f"run_dir {plan.run_dir}")
    for p in plan.procs:
        out.append(f"health {p.role}: {p.health_url}")
    for r, url in plan.remote_health.items():
        out.append(f"health {r} (other host): {url}")
    for p in plan.procs:
        out.append(f"log {p.role}: {p.log}")
    out.append(f"url router: {plan.urls['router']}")
    return "\n".join(out)
