"""Environment variables -> the deployment plan (what runs where, with which flags and environment).

Every knob is an environment variable with a default, declared typed in ``dsv4_sm120.serve_variables`` and read
here only through the settings registry (:func:`typed_settings`: kind, valid values, range, and the parsed value of
GPU groups, roles and extra flags; table in ``docs/serving.md``); a bad value is one line naming the variable. The plan is pure data, so ``DRY_RUN=1`` prints exactly what a real
start would run.

One server per GPU group: ``PREFILL_GPUS`` / ``DECODE_GPUS`` hold one group each by default (the servers ``prefill``
and ``decode``), or several separated by ``;`` (replicas ``prefill1``, ``decode2``, ... on the role's ports + i), all
behind the one router. Per server the plan also sets the TP all-reduce environment and, where you set no layout,
takes the serving shape ``make verify --stages shape`` recorded (``profile_choices``).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

from .. import model_config, settings
from ..moe_runner import MOE_FLAG, mxfp4_runner
from ..paths import checkout_root
from ..serve_variables import FP8_BACKENDS, ROLES, SERVE, VARIABLES, gpu_groups
from . import extra_args
from .envfiles import EnvFileError, load_env_dir
from .plan_text import changed_settings, render_dry_run  # noqa: F401  (the dry run's text, where callers find it)

LOOPBACK = {"127.0.0.1", "localhost", "::1"}

# Proc.binds' names -> the variable that sets each port.
PORT_VARIABLES = {"prefill HTTP": "PREFILL_PORT", "prefill bootstrap": "BOOTSTRAP_PORT", "decode HTTP": "DECODE_PORT",
                  "router HTTP": "ROUTER_PORT", "router metrics": "ROUTER_PROMETHEUS_PORT"}

PASS_THROUGH = re.compile(r"^(SGLANG_|DSV4_SM120_|NCCL_|UCX_|NIXL_|TORCH_NCCL_|CUDA_DEVICE_ORDER$)")
# SGLang's variables the plan sets per server itself (never listed as the caller's).
PLAN_SETS = ("SGLANG_TORCH_PROFILER_DIR", "SGLANG_HOST_IP")


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
    name: str = ""                                # unique in the plan: the role, or prefill1, decode2, ... (replicas)

    @property
    def label(self) -> str:
        """The part's name in commands, logs, state and messages (``cmd decode2:``): its role without replicas."""
        return self.name or self.role


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
    shape_reason: str = ""                   # which serving shape / draft length and why (the recorded one, yours)
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


def not_listed(name: str) -> bool:
    """Whether the caller's ``name`` stays out of the plan's list of passed-on switches: what our launchers, the
    tests and the stand-ins use among themselves (the registry's ``internal`` and ``test`` settings, the serve
    variables, which the plan lists as settings, the cache the Makefile passes) and what the plan sets itself."""
    s = settings.registry().get(name)
    return name in PLAN_SETS or name == "DSV4_SM120_CACHE" or (s is not None and s.reader in ("internal", "test",
                                                                                                "serve"))


def parse_groups(key: str, text: str) -> List[List[int]]:
    """``PREFILL_GPUS`` / ``DECODE_GPUS``: one GPU group per server, ``;`` between replicas (``gpu_groups``)."""
    try:
        return gpu_groups(text)
    except ValueError as e:
        raise ConfigError(f"{key}={text!r} is not valid: {e}") from None


def parse_gpus(key: str, text: str) -> List[int]:
    """The first server's GPUs of ``key`` (every replica of a role runs the same TP size: ``make calibrate`` measures
    one of them)."""
    return parse_groups(key, text)[0]


def replica_names(role: str, n: int) -> List[str]:
    """The names of ``n`` servers of ``role``: the role itself for one, ``role1`` .. ``roleN`` for replicas."""
    return [role] if n == 1 else [f"{role}{i + 1}" for i in range(n)]


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
    setting = (setting or "").strip().lower() or "auto"   # unset or blank: auto, as the settings table says
    if setting != "auto":
        if setting not in FP8_BACKENDS:
            raise ConfigError(f"FP8_GEMM_BACKEND={setting!r}: expected one of {', '.join(FP8_BACKENDS)}")
        return setting, f"FP8_GEMM_BACKEND={setting}"
    from dsv4_sm120.fp8_configs import ENV_BACKEND, recommended_fp8_gemm_backend

    if device_name is None and not (settings.raw(ENV_BACKEND) or "").strip():
        return None, "SGLang default (no GPU name from nvidia-smi, so no tuning summary applies)"
    import logging

    # the profile lookup logs why no profile applies; the preflight's profile check says it, under its own name
    log = logging.getLogger("dsv4_sm120.machine_profile")
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
    """The variable that sets the port of a bind named ``what`` (``Proc.binds``; replica i's port is that + i)."""
    head, _, rest = what.partition(" ")
    return PORT_VARIABLES.get(f"{head.rstrip('0123456789')} {rest}", "the port's variable")


def user_moe_flag(v: Dict[str, object]) -> Optional[str]:
    """The first of SERVER/PREFILL/DECODE_EXTRA_ARGS (typed: shell words) that passes --moe-runner-backend, or None."""
    for k in ("SERVER_EXTRA_ARGS", "PREFILL_EXTRA_ARGS", "DECODE_EXTRA_ARGS"):
        if any(t == MOE_FLAG or t.startswith(MOE_FLAG + "=") for t in v[k]):
            return k
    return None


def _gpus(s: Dict[str, str], v: Dict[str, object], roles: List[str]) -> Tuple[List[List[int]], List[List[int]]]:
    """(prefill groups, decode groups): one GPU group per server."""
    pg, dg = v["PREFILL_GPUS"], v["DECODE_GPUS"]
    both = {g for x in pg for g in x} & {g for x in dg for g in x}
    if "prefill" in roles and "decode" in roles and both:
        raise ConfigError(f"PREFILL_GPUS={s['PREFILL_GPUS']} and DECODE_GPUS={s['DECODE_GPUS']} share GPUs "
                          f"{sorted(both)} on this host")
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


def _runners(s: Dict[str, str], v: Dict[str, object], environ: Mapping[str, str], roles: List[str],
             pg: List[List[int]], dg: List[List[int]], repo: Path) -> Tuple[Optional[str], str, Optional[str], str]:
    """(--fp8-gemm-backend, why, --moe-runner-backend, why) of the servers on this host."""
    dev = None
    servers = "decode" in roles or "prefill" in roles
    user_moe = user_moe_flag(v)
    model = model_config.read(s["MODEL_PATH"], environ) if servers else None
    want_moe = servers and user_moe is None and model.moe_format == "mxfp4"
    if servers and (s["FP8_GEMM_BACKEND"].strip().lower() in ("auto", "") or want_moe):
        dev = gpu_name(s["NVIDIA_SMI"] or "nvidia-smi", (dg if "decode" in roles else pg)[0][0])
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
        if k in listed or not PASS_THROUGH.match(k) or not_listed(k):
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
           groups: Dict[str, List[List[int]]], ports: Dict[str, int], mem: Dict[str, float], v: Dict[str, object],
           urls: Dict[str, str], multi_node: bool, prof_dir: str) -> List[Proc]:
    """The processes of ``roles`` on this host, one server per GPU group (logs, NUMA binding and the all-reduce
    environment not yet set). Replica i of a role listens on its role's ports + i."""
    ph, dh = s["PREFILL_HOST"], s["DECODE_HOST"]
    pg, dg = groups["prefill"], groups["decode"]
    replicas = len(pg) > 1 or len(dg) > 1
    procs: List[Proc] = []

    def server(role: str, name: str, argv: List[str], host: str, gpus: List[int], listens) -> Proc:
        """A server process: its argv plus speculation and the extra args, its GPUs, profiler dir and host IP."""
        var = f"{role.upper()}_EXTRA_ARGS"
        argv = argv + (spec or []) + v["SERVER_EXTRA_ARGS"] + v[var]
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)),
               "SGLANG_TORCH_PROFILER_DIR": str(Path(prof_dir) / name) if replicas else prof_dir}
        if multi_node and host not in ("0.0.0.0", "::"):
            env["SGLANG_HOST_IP"] = host
        return Proc(role, argv, env, urls[name] + "/health", listens, gpus, name=name)

    if "prefill" in roles:
        for i, (name, g) in enumerate(zip(replica_names("prefill", len(pg)), pg)):
            port, boot = ports["PREFILL_PORT"] + i, ports["BOOTSTRAP_PORT"] + i
            argv = [*common, "--tp", str(len(g)), "--host", ph, "--port", str(port), "--disaggregation-mode", "prefill",
                    "--disaggregation-bootstrap-port", str(boot), "--mem-fraction-static", f"{mem['prefill']:g}"]
            if v["PREFILL_MAX_RUNNING"] is not None:
                argv += ["--max-running-requests", str(v["PREFILL_MAX_RUNNING"])]
            if v["CHUNKED_PREFILL_SIZE"] is not None:
                argv += ["--chunked-prefill-size", str(v["CHUNKED_PREFILL_SIZE"])]
            procs.append(server("prefill", name, argv, ph, g, [(ph, port, f"{name} HTTP"),
                                                               (ph, boot, f"{name} bootstrap")]))
    if "decode" in roles:
        for i, (name, g) in enumerate(zip(replica_names("decode", len(dg)), dg)):
            port = ports["DECODE_PORT"] + i
            argv = [*common, "--tp", str(len(g)), "--host", dh, "--port", str(port), "--disaggregation-mode", "decode",
                    "--mem-fraction-static", f"{mem['decode']:g}", "--max-running-requests", str(v["MAX_RUNNING"]),
                    "--cuda-graph-max-bs-decode", str(v["MAX_RUNNING"])]
            procs.append(server("decode", name, argv, dh, g, [(dh, port, f"{name} HTTP")]))
    if "router" in roles:
        procs.append(_router(s, v, python, ports, urls, len(pg), len(dg)))
    return procs


def _router(s: Dict[str, str], v: Dict[str, object], python: str, ports: Dict[str, int], urls: Dict[str, str],
            n_prefill: int, n_decode: int) -> Proc:
    """sglang_router in PD mode in front of every prefill server (with its bootstrap port) and every decode server.
    Several decode servers are served round robin (their KV arrives from prefill: no prefix cache to be aware of),
    unless ROUTER_EXTRA_ARGS names a policy."""
    rh = s["ROUTER_HOST"]
    extra = v["ROUTER_EXTRA_ARGS"]
    argv = [python, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for i, name in enumerate(replica_names("prefill", n_prefill)):
        argv += ["--prefill", urls[name], str(ports["BOOTSTRAP_PORT"] + i)]
    for name in replica_names("decode", n_decode):
        argv += ["--decode", urls[name]]
    argv += ["--host", rh, "--port", str(ports["ROUTER_PORT"]),
             "--prometheus-host", rh, "--prometheus-port", str(ports["ROUTER_PROMETHEUS_PORT"]), "--log-level", "info",
             # the router waits this long for in-flight requests on SIGTERM (its default, 180 s, outlasts
             # the teardown's STOP_GRACE_S, so a stop with a dropped stream would end in SIGKILL)
             "--shutdown-grace-period-secs", str(ROUTER_SHUTDOWN_GRACE_S)]
    if n_decode > 1 and not any(t.split("=", 1)[0] in ("--policy", "--decode-policy") for t in extra):
        argv += ["--decode-policy", "round_robin"]
    return Proc("router", argv + extra, {}, urls["router"] + "/health",
                [(rh, ports["ROUTER_PORT"], "router HTTP"), (rh, ports["ROUTER_PROMETHEUS_PORT"], "router metrics")],
                name="router")


def _urls(s: Dict[str, str], ports: Dict[str, int], pg: List[List[int]], dg: List[List[int]]) -> Dict[str, str]:
    """Every server's URL by name, each role's first server under the role's name, and the router's."""
    urls = {"router": f"http://{_url_host(s['ROUTER_HOST'])}:{ports['ROUTER_PORT']}"}
    for role, groups, host, key in (("prefill", pg, s["PREFILL_HOST"], "PREFILL_PORT"),
                                    ("decode", dg, s["DECODE_HOST"], "DECODE_PORT")):
        names = replica_names(role, len(groups))
        for i, name in enumerate(names):
            if ports[key] + i > 65535 or (role == "prefill" and ports["BOOTSTRAP_PORT"] + i > 65535):
                over = key if ports[key] + i > 65535 else "BOOTSTRAP_PORT"
                raise ConfigError(f"{role} replica {i + 1} would listen past port 65535 ({over} + {i}): set {key} / "
                                  f"BOOTSTRAP_PORT lower")
            urls[name] = f"http://{_url_host(host)}:{ports[key] + i}"
        urls[role] = urls[names[0]]
    return urls


WILDCARD = ("", "0.0.0.0", "::")   # a bind on every address of the host (``::`` is dual-stack on Linux)


def _bind_host(host: str) -> str:
    """One spelling per address: host names are case-free, IPv6 may come in brackets, ``localhost`` is
    ``127.0.0.1``."""
    h = host.strip().lower()
    h = h[1:-1] if h.startswith("[") and h.endswith("]") else h
    return "127.0.0.1" if h == "localhost" else h


def _same_address(a: str, b: str) -> bool:
    """Two binds (spellings from :func:`_bind_host`) take the same address: the same host, or a wildcard and one
    of this host's own (another wildcard or a loopback address; a wildcard and a remote host's address are on
    different machines of a multi-node plan)."""
    def here(h: str) -> bool:
        return h in WILDCARD or h.startswith("127.") or h == "::1"
    return a == b or (a in WILDCARD and here(b)) or (b in WILDCARD and here(a))


def _check_ports(procs: List[Proc]) -> None:
    """Two parts on one host must not share a port (however the host is spelled)."""
    seen: List[Tuple[str, int, str]] = []
    for p in procs:
        for h, port, what in p.binds:
            addr = _bind_host(h)
            first = next((w for sh, sp, w in seen if sp == port and _same_address(sh, addr)), None)
            if first is not None:
                raise ConfigError(f"port {port} is configured twice on {h}: {first} ({port_variable(first)}) "
                                  f"and {what} ({port_variable(what)}): set one of them to another port")
            seen.append((addr, port, what))


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

    roles = v["NODE_ROLE"]
    problem = extra_args.check(s, roles, variant)
    if problem:
        raise ConfigError(problem)
    shape_reason = _recorded_shape(s, environ, variant, standin, roles, v)
    v = typed_settings(s)        # with the recorded shape
    pg, dg = _gpus(s, v, roles)
    ports, mem = _numbers(v)
    spec, spec_reason = _speculative(variant, s, environ)
    fp8, fp8_reason, moe, moe_reason = _runners(s, v, environ, roles, pg, dg, repo)
    cal_argv, cal_env = calibrate_command(s, python, roles, pg[0], dg[0])
    run_dir = _run_dir(s, repo, variant, now)
    common_env = _common_env(repo, environ)

    urls = _urls(s, ports, pg, dg)
    multi_node = not (s["PREFILL_HOST"] in LOOPBACK and s["DECODE_HOST"] in LOOPBACK)
    prof_dir = environ.get("SGLANG_TORCH_PROFILER_DIR") or str(run_dir / "profile")
    procs = _procs(s, roles, python, _server_common(s, python, standin, v["CONTEXT_LEN"], fp8, moe), spec,
                   {"prefill": pg, "decode": dg}, ports, mem, v, urls, multi_node, prof_dir)
    for p in procs:
        p.log = str(run_dir / f"{p.label}.log")
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
        for r, groups in (("prefill", pg), ("decode", dg)):
            if r not in roles:
                remote.update({n: urls[n] + "/health" for n in replica_names(r, len(groups))})

    return Plan(variant=variant, repo=str(repo), python=python, run_dir=str(run_dir), roles=roles, standin=standin,
                settings=s, common_env=common_env, procs=procs, remote_health=remote, urls=urls,
                fp8_reason=fp8_reason, moe_reason=moe_reason, spec_reason=spec_reason, calibrate_argv=cal_argv,
                calibrate_env=cal_env, shape_reason=shape_reason)


def _recorded_shape(s: Dict[str, str], environ: Mapping[str, str], variant: str, standin: bool, roles: List[str],
                    v: Dict[str, object]) -> str:
    """The serving shape (``PREFILL_GPUS`` / ``DECODE_GPUS``) and, for the MTP variant, the draft length that
    ``make verify ARGS='--stages shape'`` recorded in the machine profile as the winner at ``SHAPE_CONCURRENCY``
    (empty: ``MAX_RUNNING``), put into ``s`` where you set none (``profile_choices.recorded_shape``); the line
    saying which and why. A recorded shape is for a whole deployment on one host (``NODE_ROLE=all``)."""
    from .profile_choices import recorded_shape

    if roles != list(ROLES):
        return f"yours (NODE_ROLE={s['NODE_ROLE']}: a recorded shape is for the whole deployment on one host)"
    conc = v["SHAPE_CONCURRENCY"] or v["MAX_RUNNING"]
    apply, why = recorded_shape(variant, environ, s, standin, s["NVIDIA_SMI"] or "nvidia-smi", int(conc),
                                "SHAPE_CONCURRENCY" if v["SHAPE_CONCURRENCY"] else "MAX_RUNNING")
    s.update(apply)
    return why


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
    binds = numa_bindings({p.label: p.gpus for p in servers}, s["NVIDIA_SMI"] or "nvidia-smi", sysfs, enabled)
    for p in servers:
        b = binds[p.label]
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

