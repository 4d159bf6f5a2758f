#!/usr/bin/env python3
"""PD KV-transfer benchmark: NIXL agents move one TP4 rank's DeepSeek-V4 KV pages between two GPUs.

For each prompt length (default 1k / 8k / 32k / 128k tokens) a "prefill" agent WRITEs the pages SGLang
0.5.23 sends for that prompt (``dsv4_sm120.serving.kv_bytes``: per layer the SWA window pages, per c4
layer its c4 KV + indexer pages, per c128 layer its c128 pages, KVLayout.V4 page sizes) from scattered
slots of per-layer pools on ``--src-gpu`` into scattered slots on ``--dst-gpu``, held by a "decode" agent
in a second process (UCX's cuda_ipc, the servers' path, only connects two processes), with the
connector's completion notification. The environment is the servers' (``serve/env/*.env``, and
``UCX_NET_DEVICES=lo`` as on a single-host deployment unless set). Each prompt: one untimed transfer
(the cold start, reported as ``first_us``), then ``--reps`` timed ones (median); the moved bytes are
verified once. Next to it, a plain peer copy (``cudaMemcpyPeer`` via ``tensor.copy_``) of the same
number of bytes in one piece. At TP4 four such transfers (one per rank pair) run at once.

Rows go to ``--results`` (default ``DSV4_SM120_CACHE/bench/kv.csv``, outside the tracked tree; the project's
recorded rows are ``bench/results/kv.csv``; subject ``kv``). Needs torch and nixl only (no SGLang).
``--src-gpu 0 --dst-gpu 0`` runs on a one-GPU box (it then measures NIXL/UCX over device memory, not
PCIe); ``--mem dram`` moves host memory (no GPU; exercises the same agents); ``--dry-run`` prints the
byte table.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "overlay"))

from dsv4_sm120.dev import bench_results as R  # noqa: E402
from dsv4_sm120 import hints  # noqa: E402
from dsv4_sm120.serving import kv_bytes as KB  # noqa: E402

DEFAULT_PROMPTS = "1024,8192,32768,131072"


class BenchError(Exception):
    pass


def server_environment(environ: Dict[str, str]) -> List[Tuple[str, str, str]]:
    """The serve/env/*.env settings (the caller's values win) plus the single-host UCX_NET_DEVICES pin."""
    from dsv4_sm120.serving.envfiles import load_env_dir

    env = load_env_dir(REPO / "serve" / "env", environ)
    if "UCX_NET_DEVICES" not in environ and not any(k == "UCX_NET_DEVICES" for k, _, _ in env):
        env.append(("UCX_NET_DEVICES", "lo", "single-host deployment (serving/plan.py)"))
    return env


def layout(prompt: int, ratios) -> List[Tuple[str, int, int, int]]:
    """[(kind, layer, item_bytes, items)] one rank sends for ``prompt`` tokens."""
    return [(k.name, li, k.item_bytes, k.items_per_layer) for k in KB.transfer_plan(prompt, ratios)
            for li in range(k.layers)]


def alloc(items: List[Tuple[str, int, int, int]], mem: str, dev: int, seed: Optional[int]):
    """One pool per (kind, layer) with 2x the slots the prompt needs (so slots can be scattered)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    pools = []
    for _, _, item, n in items:
        shape = (2 * n, item)
        if mem == "DRAM":
            pools.append(rng.integers(0, 256, size=shape, dtype=np.uint8) if seed is not None
                         else np.full(shape, 0xA5, dtype=np.uint8))
        else:
            import torch

            g = torch.Generator(device=f"cuda:{dev}").manual_seed(seed or 0)
            t = torch.empty(shape, dtype=torch.uint8, device=f"cuda:{dev}")
            if seed is not None:
                t.random_(0, 256, generator=g)
            else:
                t.fill_(0xA5)
            pools.append(t)
    return pools


def descs(pools, slots: List[List[int]], dev: int):
    import numpy as np

    from dsv4_sm120.serving.nixl_check import _addr

    rows = []
    for p, sl in zip(pools, slots):
        base, item = _addr(p), p.shape[1]
        rows.extend([base + s * item, item, dev] for s in sl)
    return np.array(rows, dtype=np.uint64)


def digest(pools, slots) -> str:
    from dsv4_sm120.serving.nixl_check import _host

    h = hashlib.sha256()
    for p, sl in zip(pools, slots):
        hp = _host(p)
        for s in sl:
            h.update(hp[s].tobytes())
    return h.hexdigest()


def pick_slots(items, seed: int) -> List[List[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.choice(2 * n, size=n, replace=False)] for _, _, _, n in items]


def _target(conn, backend: str, mem: str, dev: int, env: Dict[str, str]) -> None:
    """Decode side: per prompt, allocate poisoned pools, hand out addresses, wait for the notifications,
    answer digest requests."""
    os.environ.update(env)
    from dsv4_sm120.serving.nixl_check import NixlCheckError, _addr, _make_agent, _register

    try:
        agent = _make_agent("dsv4-bench-decode", backend)
        # every prompt's pools up front: the initiator loads this agent's metadata (its registered memory) once
        per_prompt = [alloc(items, mem, dev, None) for items in conn.recv()["items"]]
        agent.register_memory([(_addr(p), p.nbytes, dev, "") for ps in per_prompt for p in ps], mem)
        conn.send({"metadata": agent.get_agent_metadata(),
                   "bases": [[(_addr(p), p.shape[1]) for p in ps] for ps in per_prompt]})
        pools = None
        while True:
            msg = conn.recv()
            if msg["cmd"] == "use":
                pools = per_prompt[msg["index"]]
                conn.send({"ok": True})
            elif msg["cmd"] == "peer":
                agent.add_remote_agent(msg["metadata"])
                conn.send({"ok": True})
            elif msg["cmd"] == "wait":
                t0 = time.monotonic()
                while not agent.check_remote_xfer_done("dsv4-bench-prefill", msg["notif"]):
                    if time.monotonic() - t0 > msg["timeout"]:
                        raise NixlCheckError(f"no notification {msg['notif']!r} within {msg['timeout']} s")
                    time.sleep(0.0005)
                conn.send({"ok": True})
            elif msg["cmd"] == "digest":
                if mem == "VRAM":
                    import torch

                    torch.cuda.synchronize(dev)
                conn.send({"digest": digest(pools, msg["slots"])})
            elif msg["cmd"] == "quit":
                return
    except Exception as e:  # report, never leave the parent waiting
        conn.send({"error": f"{type(e).__name__}: {e}"})


def _ask(conn, msg: dict, timeout: float) -> dict:
    conn.send(msg)
    if not conn.poll(timeout):
        raise BenchError(f"the decode-side process did not answer {msg['cmd']!r} within {timeout:g} s")
    r = conn.recv()
    if "error" in r:
        raise BenchError(f"decode side: {r['error']}")
    return r


def nixl_run(agent, conn, remote: str, index: int, bases, prompt: int, ratios, mem: str, src: int, dst: int,
             reps: int, timeout: float) -> dict:
    import numpy as np

    from dsv4_sm120.serving.nixl_check import _addr

    items = layout(prompt, ratios)
    pools = alloc(items, mem, src, seed=prompt)
    reg = agent.get_reg_descs([(_addr(p), p.nbytes, src, "") for p in pools], mem)
    agent.register_memory(reg)
    try:
        _ask(conn, {"cmd": "use", "index": index}, timeout)
        src_slots, dst_slots = pick_slots(items, prompt + 1), pick_slots(items, prompt + 2)
        rrows = np.array([[b + s * item, item, dst] for (b, item), sl in zip(bases, dst_slots) for s in sl],
                         dtype=np.uint64)
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs(pools, src_slots, src), mem)
        remote_l = agent.prep_xfer_dlist(remote, rrows, mem)
        n = len(rrows)
        times = []
        for rep in range(reps + 1):
            notif = f"bench:{prompt}:{rep}".encode()
            h = agent.make_prepped_xfer("WRITE", local, list(range(n)), remote_l, list(range(n)), notif)
            t0 = time.perf_counter()
            if agent.transfer(h) == "ERR":
                raise BenchError("NIXL could not post the transfer")
            while True:
                st = agent.check_xfer_state(h)
                if st == "DONE":
                    break
                if st == "ERR":
                    raise BenchError("NIXL transfer failed (state ERR)")
                if time.perf_counter() - t0 > timeout:
                    raise BenchError(f"transfer of {prompt} tokens did not finish within {timeout:g} s")
            times.append(time.perf_counter() - t0)
            agent.release_xfer_handle(h)
            _ask(conn, {"cmd": "wait", "notif": notif, "timeout": timeout}, timeout + 30)
            if rep == 0:
                want = digest(pools, src_slots)
                got = _ask(conn, {"cmd": "digest", "slots": dst_slots}, timeout + 60)["digest"]
                if got != want:
                    raise BenchError(f"prompt {prompt}: the decode side's pages differ from the sent ones")
        agent.release_dlist_handle(local)
        agent.release_dlist_handle(remote_l)
        return {"first_s": times[0], "s": statistics.median(times[1:]), "descs": n,
                "bytes": sum(item * cnt for _, _, item, cnt in items)}
    finally:
        agent.deregister_memory(reg)


def peer_copy(nbytes: int, mem: str, src: int, dst: int, reps: int) -> float:
    """Seconds per plain copy of ``nbytes`` in one piece (cudaMemcpyPeer; numpy copy for DRAM)."""
    if mem == "DRAM":
        import numpy as np

        a, b = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        ts = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            np.copyto(b, a)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts[1:])
    import torch

    a = torch.ones(nbytes, dtype=torch.uint8, device=f"cuda:{src}")
    b = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")
    ts = []
    for _ in range(reps + 1):
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(dst)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:])


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/bench_kv.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS, help=f"prompt lengths in tokens (default {DEFAULT_PROMPTS})")
    ap.add_argument("--src-gpu", type=int, default=None, help="prefill-side GPU (default 0)")
    ap.add_argument("--dst-gpu", type=int, default=None,
                    help="decode-side GPU (default: 4 on a box of 8, else 1, else 0)")
    ap.add_argument("--mem", choices=("vram", "dram"), default="vram", help="dram: host memory, no GPU needed")
    ap.add_argument("--reps", type=int, default=5, help="timed transfers per prompt (after one cold one)")
    ap.add_argument("--config", type=Path, default=None, help="a checkpoint's config.json (its compress_ratios)")
    ap.add_argument("--backend", default=os.environ.get("SGLANG_DISAGGREGATION_NIXL_BACKEND", "UCX"))
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per transfer before giving up")
    ap.add_argument("--results", type=Path, default=R.user_results("kv"),
                    help="results file to append to (default: DSV4_SM120_CACHE/bench/kv.csv, outside the tree; the "
                         "project's recorded rows: bench/results/kv.csv)")
    ap.add_argument("--dry-run", action="store_true", help="print the bytes per prompt, move nothing")
    a = ap.parse_args(argv)
    try:
        prompts = [int(x) for x in a.prompts.split(",") if x.strip()]
        if not prompts or min(prompts) <= 0:
            raise ValueError
    except ValueError:
        print(f"bench_kv: --prompts {a.prompts!r}: expected a comma list of positive token counts", file=sys.stderr)
        return 2
    try:
        ratios = KB.compress_ratios_from_config(a.config)
    except ValueError as e:
        print(f"bench_kv: {e}", file=sys.stderr)
        return 2
    print(f"# one TP4 rank's KV pages per prompt ({len(ratios)} layers: {ratios.count(4)} c4, {ratios.count(128)} c128);"
          f" four ranks move this much each, at once")
    for n in prompts:
        s = KB.summary(n, ratios)
        print(f"prompt {n:>7}: {s['total'] / 2**20:9.2f} MiB in {s['descriptors']:>6} pages "
              f"(swa {s.get('swa', 0) / 2**20:.2f}, c4 {s.get('c4', 0) / 2**20:.2f}, "
              f"c4 indexer {s.get('c4_indexer', 0) / 2**20:.2f}, c128 {s.get('c128', 0) / 2**20:.2f} MiB)")
    if a.dry_run:
        return 0
    mem = a.mem.upper()
    src = 0 if a.src_gpu is None else a.src_gpu
    if mem == "VRAM":
        try:
            import torch
        except ImportError:
            print("bench_kv: torch is not installed: cannot measure GPU-to-GPU KV transfer (the table above is "
                  f"what it would move; {hints.args('--mem dram')} exercises the NIXL agents on host memory)",
                  file=sys.stderr)
            return 2
        ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if ngpu == 0:
            print("bench_kv: no CUDA GPU: cannot measure GPU-to-GPU KV transfer or the peer-copy baseline (the table "
                  f"above is what it would move; {hints.args('--mem dram')} exercises the NIXL agents on host memory)",
                  file=sys.stderr)
            return 2
        dst = a.dst_gpu if a.dst_gpu is not None else (4 if ngpu >= 8 else (1 if ngpu >= 2 else 0))
        if max(src, dst) >= ngpu:
            print(f"bench_kv: GPU {max(src, dst)} does not exist (this box has {ngpu}); choose others "
                  f"({hints.args('--src-gpu N --dst-gpu M')})", file=sys.stderr)
            return 2
        if src == dst:
            print(f"# note: source and destination are the same GPU {src}: this measures NIXL/UCX over device memory "
                  f"and a device-to-device copy, not PCIe (needs two GPUs)")
    else:
        dst = src if a.dst_gpu is None else a.dst_gpu
    env_list = server_environment(dict(os.environ))
    env = {k: v for k, v, _ in env_list}
    os.environ.update(env)
    print("# environment (the servers'): " + " ".join(f"{k}={v}" for k, v in env.items()))

    from dsv4_sm120.serving.nixl_check import NixlCheckError, _make_agent
    from dsv4_sm120.serving.ucx_info import loaded_ucx_version

    command = "python bench/bench_kv.py " + " ".join(shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
    info = R.environment(REPO, command)
    if mem == "DRAM":
        info["gpu"] = "host memory (dram)"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, a.backend, mem, dst, env), daemon=True)
    proc.start()
    rows = []
    try:
        parent.send({"items": [layout(n, ratios) for n in prompts]})
        if not parent.poll(a.timeout + 120):
            raise BenchError("the decode-side process did not start")
        hello = parent.recv()
        if "error" in hello:
            raise BenchError(f"decode side: {hello['error']}")
        agent = _make_agent("dsv4-bench-prefill", a.backend)
        remote = agent.add_remote_agent(hello["metadata"])
        remote = remote.decode() if isinstance(remote, bytes) else remote
        _ask(parent, {"cmd": "peer", "metadata": agent.get_agent_metadata()}, a.timeout)
        ucx = loaded_ucx_version() or "unknown"
        print(f"{'prompt':>8} {'MiB':>9} {'pages':>7} {'NIXL us':>11} {'GB/s':>7} {'first us':>11} "
              f"{'peer us':>10} {'GB/s':>7} {'nixl/peer':>9}")
        for i, n in enumerate(prompts):
            r = nixl_run(agent, parent, remote, i, hello["bases"][i], n, ratios, mem, src, dst, max(1, a.reps),
                         a.timeout)
            pc = peer_copy(r["bytes"], mem, src, dst, max(1, a.reps))
            shape = {"prompt": n, "bytes": r["bytes"], "descs": r["descs"], "src": src, "dst": dst}
            notes = f"first_us={r['first_s'] * 1e6:.0f};ucx={ucx};backend={a.backend};mem={a.mem};tp4_ranks=4"
            rows.append(dict(case="tp4_rank", impl="nixl-ucx", us=r["s"] * 1e6, gbps=r["bytes"] / r["s"] / 1e9,
                             notes=notes, **shape, **info))
            rows.append(dict(case="tp4_rank", impl="memcpy-peer", us=pc * 1e6, gbps=r["bytes"] / pc / 1e9,
                             notes=f"one contiguous copy;mem={a.mem}", **shape, **info))
            print(f"{n:>8} {r['bytes'] / 2**20:>9.2f} {r['descs']:>7} {r['s'] * 1e6:>11.0f} "
                  f"{r['bytes'] / r['s'] / 1e9:>7.2f} {r['first_s'] * 1e6:>11.0f} {pc * 1e6:>10.0f} "
                  f"{r['bytes'] / pc / 1e9:>7.2f} {r['s'] / pc:>9.2f}", flush=True)
            R.append_rows(a.results, "kv", rows[-2:])
        parent.send({"cmd": "quit"})
    except (BenchError, NixlCheckError) as e:
        print(f"bench_kv: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # a NIXL / CUDA error: one line, not a traceback
        print(f"bench_kv: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    print(f"# {len(rows)} rows appended to {a.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
