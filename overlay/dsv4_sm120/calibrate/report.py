"""Readable report of a machine profile: markdown tables (µs per bucket and candidate, winner in bold, every
unavailable / failed / rejected candidate with its reason) and a PNG of µs vs bucket per decision and
candidate (matplotlib when importable; otherwise the markdown says so)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def deployment_lines(dep: dict) -> list:
    """The deployment summary (``Deployment.summary()``) as two plain lines: the shapes, and where they come from."""
    moe = (f"MoE {dep.get('moe_format')} ({dep.get('experts')} experts, top-{dep.get('topk')}, hidden "
           f"{dep.get('hidden')}, intermediate {dep.get('moe_intermediate')} per rank"
           + (f", SwiGLU limit {dep['swiglu_limit']:g}" if dep.get("swiglu_limit") is not None else "") + ")")
    return [f"deployment: TP {dep.get('tp')}, {dep.get('heads')} heads per rank, {dep.get('draft_tokens')} draft "
            f"tokens, context {dep.get('context_len')} (c128 top-k {dep.get('c128_topk')}), SWA window "
            f"{dep.get('window')}, index top-k {dep.get('index_topk')}; {moe}",
            f"model: {dep.get('config_source')}"]


def _cell(o: dict, win: bool) -> str:
    if o.get("status") == "ok":
        s = f"{o['us']:.1f}" if o.get("us") is not None else "?"
        return f"**{s}**" if win else s
    return {"unavailable": "n/a", "failed": "fail", "rejected": "wrong"}.get(o.get("status"), "?")


def markdown(profile: dict, png_name: Optional[str] = None, png_note: str = "",
             extra_png: Optional[dict] = None) -> str:
    v = profile.get("versions", {})
    dep = profile.get("deployment", {})
    out = [f"# Machine profile: {profile.get('gpu')}", "",
           f"Measured {profile.get('created_at')} by `make calibrate`"
           f"{' (quick)' if profile.get('quick') else ''}; device `{profile.get('device', 'cuda')}`.", "",
           "Versions: " + ", ".join(f"{k} {v.get(k)}" for k in v), "",
           "Deployment: " + ", ".join(f"{k}={dep[k]}" for k in ("tp", "heads", "draft_tokens", "context_len",
                                                                   "moe_format", "hidden", "moe_intermediate",
                                                                   "experts", "topk") if k in dep), ""]
    if profile.get("wall_s") is not None:
        out += [f"Wall time: {profile['wall_s']:.0f} s.", ""]
    if png_name:
        out += [f"![µs per call]({png_name})", ""]
    elif png_note:
        out += [f"(no plot: {png_note})", ""]
    out += ["Cells: µs per call (CUDA-graph replay where capturable), **winner** in bold; `n/a` unavailable, "
            "`fail` did not build/run, `wrong` failed the float64 correctness gate (never a winner).", ""]
    for name, d in profile.get("decisions", {}).items():
        if name == "allreduce":   # per-server fields, not buckets
            from .allreduce_report import markdown_lines

            out += markdown_lines(d, (extra_png or {}).get(name))
            continue
        if name == "shape":       # recorded by make verify --stages shape, which writes its own table
            out += ["## shape", "", "The serving shape and draft length `make verify ARGS='--stages shape'` recorded "
                    "(its report has the table; docs/verify.md).", ""]
            continue
        buckets = sorted(d.get("buckets", {}), key=int)
        cands = []
        for b in buckets:
            for c in d["buckets"][b]["candidates"]:
                if c not in cands:
                    cands.append(c)
        kind = d.get("bucket_kind", "n")
        out += [f"## {name}", ""]
        if d.get("note"):
            out += [d["note"], ""]
        if d.get("reference_only"):
            out += [f"Reference points (timed, never chosen): {', '.join(d['reference_only'])}.", ""]
        if d.get("overall"):
            out += [f"Server-wide: `{d['overall'].get('recommended_backend')}` ({d['overall'].get('reason')}).", ""]
        out += [f"| {kind} | winner | " + " | ".join(f"`{c}`" for c in cands) + " |",
                "|---:|---|" + "---:|" * len(cands)]
        reasons = {}
        for b in buckets:
            row = d["buckets"][b]
            w = row.get("winner")
            cells = []
            for c in cands:
                o = row["candidates"].get(c, {"status": "unavailable", "reason": "not measured"})
                cells.append(_cell(o, c == w))
                if o.get("status") != "ok" and o.get("reason"):
                    reasons.setdefault((c, o["status"], o["reason"]), []).append(b)
            out.append(f"| {b} | {w or '-'} | " + " | ".join(cells) + " |")
        errs = []
        for c in cands:
            e = [d["buckets"][b]["candidates"].get(c, {}).get("err") for b in buckets]
            e = [x for x in e if x is not None]
            if e:
                errs.append(f"`{c}` {max(e):.2g}")
        if errs:
            out += ["", "Largest error vs float64 per candidate: " + ", ".join(errs) + "."]
        if reasons:
            out += [""] + [f"- `{c}` {st} at {kind}={','.join(bs)}: {r}" for (c, st, r), bs in reasons.items()]
        out.append("")
    return "\n".join(out)


def plot(profile: dict, path: Path) -> Optional[str]:
    """Write the PNG; None on success, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return f"matplotlib is not importable ({type(e).__name__})"
    decs = [(n, d) for n, d in profile.get("decisions", {}).items()
            if any(o.get("status") == "ok" for r in d.get("buckets", {}).values() for o in r["candidates"].values())]
    if not decs:
        return "no candidate produced a time"
    cols = min(3, len(decs))
    rows = -(-len(decs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
    for ax, (name, d) in zip(axes.flat, decs):
        series = {}
        for b, r in d["buckets"].items():
            for c, o in r["candidates"].items():
                if o.get("status") == "ok" and o.get("us") is not None:
                    series.setdefault(c, []).append((int(b), o["us"]))
        for c, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=c)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel(d.get("bucket_kind", "n"))
        ax.set_ylabel("µs per call")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(decs):]:
        ax.axis("off")
    fig.suptitle(f"{profile.get('gpu')} — make calibrate {profile.get('created_at')}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


def write(profile: dict, md_path: Path) -> tuple:
    """Write ``<stem>.md`` and ``<stem>.png`` next to each other; returns (md path, png path or None, note)."""
    png = md_path.with_suffix(".png")
    note = plot(profile, png)
    extra = {}
    if "allreduce" in profile.get("decisions", {}):
        from .allreduce_report import plot as allreduce_plot

        ar_png = md_path.with_name(md_path.stem + "-allreduce.png")
        if allreduce_plot(profile["decisions"]["allreduce"], ar_png, f"{profile.get('gpu')}: TP all-reduce") is None:
            extra["allreduce"] = ar_png.name
    md_path.write_text(markdown(profile, None if note else png.name, note or "", extra))
    return md_path, (None if note else png), note
