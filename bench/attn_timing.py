"""Timing for bench/bench_attention.py: one call under CUDA-graph replay over several layers (``time_call``), the
gather floor and the MMA floor at a point (``time_floor``, ``time_mma_floor``; the kernels are bench/attn_floor.py
and bench/attn_mma_floor.py), and the table of each impl's time as a share of a floor (``floor_share_table``)."""

from __future__ import annotations

import statistics
import sys

from attn_inputs import ROW_KEYS

# The gather floor: timed first at each point, at each of FLOOR_WAVES (programs aimed at per SM), the fastest
# recorded; the other impls' rows get floor_share = floor us / their us in their notes.
FLOOR, FLOOR_WAVES = "gather-floor", (4, 8, 16)
# The MMA floor (Hopper): the candidates-as-M body's QK and PV warpgroup MMAs for the call and nothing else; ours'
# rows get mma_share = its us / theirs.
MMA_FLOOR, MMA_FLOOR_MAX_HEADS = "mma-floor", 32
_mma_notes = set()   # the skip notes already printed


def time_floor(args, torch, layers, qs, check_rows, bytes_call):
    """The gather floor at one point: each plan of FLOOR_WAVES timed as the impls are (graph replay over the
    layers), the fastest kept; its checksum of the check rows compared with torch's sum of the same bytes.
    -> (row fields us, gbps, notes; the floor's us or None)."""
    import attn_floor as F

    notes = [f"layers={args.layers}"]
    sms = torch.cuda.get_device_properties(qs[0].device).multi_processor_count
    best = None
    try:
        for waves in FLOOR_WAVES:
            floors = [F.GatherFloor(qs[i], num_sms=sms, waves=waves, **layers[i][0]) for i in range(len(layers))]
            if best is None:  # the checksum once (the plans differ only in how the rows are cut)
                _, cs = floors[0]()
                kw = {k: (v[check_rows] if k in ROW_KEYS else v) for k, v in layers[0][0].items()}
                got = F.checksum(cs)[check_rows].cpu()
                want = F.reference_checksum(qs[0][check_rows], **kw).cpu()
                if not torch.equal(got, want):
                    raise RuntimeError("the floor's checksum differs from torch's sum of the same bytes")
                notes.append("checksum=ok")
            us, spread = time_call(torch, lambda i: floors[i](), len(layers), True, args.replays)
            if best is None or us < best[0]:
                best = (us, spread, floors[0].plan)
        us, spread, plan_ = best
        notes += [f"spread_us={spread:.2f}", f"plan={plan_}"]
        return dict(us=round(us, 2), gbps=round(bytes_call / us / 1e3, 1), notes="; ".join(notes)), us
    except Exception as e:  # noqa: BLE001 - a failing floor must not stop the impls
        notes.append("error=" + f"{type(e).__name__}: {str(e)[:300]}".replace(";", ","))
        return dict(notes="; ".join(notes)), None


def time_mma_floor(args, torch, H, layers):
    """The MMA floor at one point (Hopper only: None, None elsewhere, with a note on stderr once), timed as the
    impls are and its per-program sums checked. -> (row fields us and notes, or None; its us or None)."""
    why = None
    if torch.cuda.get_device_capability()[0] != 9:
        why = "it issues Hopper's warpgroup MMAs (sm_90 only)"
    elif H > MMA_FLOOR_MAX_HEADS:
        why = "it is the candidates-as-M body's MMAs, which run up to 32 heads (more heads run the 64-head body)"
    if why:
        if why not in _mma_notes:
            print(f"note: mma-floor skipped: {why}", file=sys.stderr)
            _mma_notes.add(why)
        return None, None
    import attn_mma_floor as M

    notes = [f"layers={args.layers}"]
    try:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        floors = [M.MmaFloor(H, M.call_blocks(H, **kw), num_sms=sms, device="cuda", seed=i)
                  for i, (kw, *_) in enumerate(layers)]
        floors[0]()
        torch.cuda.synchronize()
        floors[0].check()
        notes.append("sums=ok")
        us, spread = time_call(torch, lambda i: floors[i](), len(layers), True, args.replays)
        notes += [f"spread_us={spread:.2f}", f"plan={floors[0].plan}", f"blocks={floors[0].W}"]
        return dict(us=round(us, 2), notes="; ".join(notes)), us
    except Exception as e:  # noqa: BLE001 - a failing floor must not stop the impls
        notes.append("error=" + f"{type(e).__name__}: {str(e)[:300]}".replace(";", ","))
        return dict(notes="; ".join(notes)), None


def floor_share_table(rows, note="floor_share", title="Gather floor share (floor us / impl us; 1.0 = at the floor):"):
    """Markdown: per case and shape, the floor's share of each impl's time (floor us / impl us; 1.0 = at the
    floor) at each B, from the rows' ``note`` notes (floor_share, or mma_share for the MMA floor); empty when no
    row has one."""
    def share(r):
        return note_value(r["notes"], note)

    got = [r for r in rows if share(r)]
    if not got:
        return ""
    out = ["", title, ""]
    for key in dict.fromkeys((r["case"], r["layout"], r["heads"], r["context"]) for r in got):
        rs = [r for r in got if (r["case"], r["layout"], r["heads"], r["context"]) == key]
        bs = sorted({int(r["batch"]) for r in rs})
        out += [f"{key[0]} ({key[1]}, H={key[2]}, context {key[3]}):",
                "| impl | " + " | ".join(f"B={b}" for b in bs) + " |", "| --- |" + " ---: |" * len(bs)]
        for impl, variant in dict.fromkeys((r["impl"], r["variant"]) for r in rs):
            cell = {int(r["batch"]): share(r) for r in rs if (r["impl"], r["variant"]) == (impl, variant)}
            name = impl + ("" if variant == "default" else f" {variant}")
            out.append(f"| {name} | " + " | ".join(cell.get(b, "-") for b in bs) + " |")
        out.append("")
    return "\n".join(out)


def note_value(notes: str, key: str):
    """The text of ``key=...`` among a row's ``;``-separated notes, or None."""
    for n in notes.split(";"):
        k, _, v = n.strip().partition("=")
        if k == key:
            return v
    return None


def time_call(torch, f, n_layers, graph, replays):
    """Median us per layer call (5 samples), and the samples' spread; graph: the layers captured in one graph."""
    for i in range(n_layers):
        f(i)
    torch.cuda.synchronize()
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(n_layers):
                f(i)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(n_layers):
                f(i)
        run = g.replay
    else:
        def run():
            for i in range(n_layers):
                f(i)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    samples = []
    n = replays if graph else max(3, replays // 10)
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n):
            run()
        e1.record()
        torch.cuda.synchronize()
        samples.append(e0.elapsed_time(e1) * 1000.0 / (n * n_layers))
    return statistics.median(samples), max(samples) - min(samples)
