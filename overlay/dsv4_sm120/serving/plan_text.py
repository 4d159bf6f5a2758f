"""The serve plan as the dry run prints it (``DRY_RUN=1`` / ``--dry-run``): pure text from a
:class:`dsv4_sm120.serving.plan.Plan` (no import of the planner, which imports this)."""

from __future__ import annotations

import shlex
from typing import List, Tuple

from ..serve_variables import VARIABLES


def changed_settings(plan) -> List[Tuple[str, str]]:
    """[(name, value)] of the variables whose value differs from their default (DRY_RUN left out)."""
    return [(k, plan.settings[k]) for k, (d, _) in VARIABLES.items()
            if k != "DRY_RUN" and plan.settings[k] != (d or "")]


def render_dry_run(plan) -> str:
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
        out.append(f"cmd {p.label}: {prefix + ' ' if prefix else ''}{shlex.join(p.argv)}")
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
    if plan.shape_reason:
        out.append(f"# serving shape: {plan.shape_reason}")
    for p in plan.procs:
        if p.allreduce:
            out.append(f"all-reduce {p.label}: {p.allreduce}")
    for p in plan.procs:
        if p.numa:
            out.append(f"numa {p.label}: {p.numa.get('text', '')}")
    out.append(f"run_dir {plan.run_dir}")
    for p in plan.procs:
        out.append(f"health {p.label}: {p.health_url}")
    for r, url in plan.remote_health.items():
        out.append(f"health {r} (other host): {url}")
    for p in plan.procs:
        out.append(f"log {p.label}: {p.log}")
    out.append(f"url router: {plan.urls['router']}")
    return "\n".join(out)
