"""The ``allreduce`` decision in the calibrate report: per server a table (µs per size and method, the method the
choice runs in bold, the fastest marked), the choice and the environment it gives the server, every method that
did not run with its reason; and a plot (µs per message size, one line per method, the IPC bound marked)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Mapping, Optional

from ..machine_profile.allreduce_choice import IPC, describe_nccl
from ..serving.allreduce_env import server_env

_CELL = {"unavailable": "n/a", "failed": "fail", "rejected": "wrong"}


def _kib(n: int) -> str:
    return f"{n / 1024:g}"


def _cell(o: Mapping, chosen: bool, fastest: bool) -> str:
    if o.get("status") != "ok":
        return _CELL.get(o.get("status"), "?")
    s = f"{o['us']:.1f}" if o.get("us") is not None else "?"
    return (f"**{s}**" if chosen else s) + (" ◆" if fastest else "")


def server_lines(role: str, s: Mapping) -> List[str]:
    gpus = ",".join(map(str, s.get("gpus") or [])) or "-"
    out = [f"### {role} (GPUs {gpus}, TP{s.get('tp')}, hidden {s.get('hidden')} {s.get('dtype', 'bf16')})", ""]
    if s.get("status") != "ok":
        return out + [f"Not measured: {s.get('reason')}.", ""]
    c = s.get("choice") or {}
    if c.get("status") == "ok":
        env = server_env(role, int(s["tp"]), {}, {"decisions": {"allreduce": {"servers": {role: s}}}})
        out += [f"Choice: {c['reason']}; with IPC off: {describe_nccl(c['nccl_only']['nccl'])} (cost {c['cost']} "
                f"over {c['sizes']} sizes, {c['sizes']} = the fastest everywhere).",
                "Server environment: " + (" ".join(f"`{k}={v}`" for k, v in env.env.items()) or "none")
                + (f"; not set: {', '.join(env.unset)}" if env.unset else "") + ".", ""]
    else:
        out += [f"No choice: {c.get('reason')}.", ""]
    methods = list(s.get("methods") or {})
    out += ["| rows | KiB | runs | " + " | ".join(f"`{m}`" for m in methods) + " |",
            "|---:|---:|---|" + "---:|" * len(methods)]
    reasons = {}
    for r in sorted(s.get("sizes", {}), key=int):
        row = s["sizes"][r]
        cells = []
        for m in methods:
            o = row["candidates"].get(m, {"status": "unavailable", "reason": "not measured"})
            cells.append(_cell(o, m == row.get("chosen"), m == row.get("winner")))
            if o.get("status") != "ok" and o.get("reason"):
                reasons.setdefault((m, o["status"], o["reason"]), []).append(r)
        out.append(f"| {r} | {_kib(row.get('bytes', 0))} | {row.get('chosen') or '-'} | " + " | ".join(cells) + " |")
    out += ["", "Cells: µs per all-reduce; **bold**: what the choice runs at that size; ◆: the fastest verified."]
    for m, info in (s.get("methods") or {}).items():
        extra = ", ".join(f"{k} {v}" for k, v in (info.get("info") or {}).items() if v not in (None, [], ""))
        if extra:
            out.append(f"- `{m}`: {extra}")
    out += [f"- `{m}` {st} at rows {','.join(rs)}: {why}" for (m, st, why), rs in reasons.items()]
    return out + [""]


def markdown_lines(d: Mapping, png_name: Optional[str] = None) -> List[str]:
    out = ["## allreduce", ""]
    if d.get("note"):
        out += [d["note"], ""]
    if png_name:
        out += [f"![µs per all-reduce]({png_name})", ""]
    for role, s in (d.get("servers") or {}).items():
        out += server_lines(role, s)
    return out


def plot(d: Mapping, path: Path, title: str = "") -> Optional[str]:
    """Write the PNG; None on success, else why not."""
    servers = [(r, s) for r, s in (d.get("servers") or {}).items() if s.get("status") == "ok"]
    if not servers:
        return "no server was measured"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return f"matplotlib is not importable ({type(e).__name__})"
    fig, axes = plt.subplots(1, len(servers), figsize=(6 * len(servers), 4.2), squeeze=False)
    for ax, (role, s) in zip(axes.flat, servers):
        series = {}
        for row in s.get("sizes", {}).values():
            for m, o in row["candidates"].items():
                if o.get("status") == "ok" and o.get("us") is not None:
                    series.setdefault(m, []).append((row["bytes"], o["us"]))
        for m, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m,
                    linewidth=2.2 if m == IPC else 1.2)
        c = s.get("choice") or {}
        if c.get("ipc_max_numel"):
            ax.axvline(c["ipc_max_numel"] * 2, color="grey", linestyle="--", linewidth=1,
                       label=f"IPC bound ({c['ipc_max_rows']} rows)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{role}: TP{s.get('tp')}, GPUs {','.join(map(str, s.get('gpus') or []))}")
        ax.set_xlabel("bytes per rank (rows x hidden x 2)")
        ax.set_ylabel("µs per all-reduce")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None
