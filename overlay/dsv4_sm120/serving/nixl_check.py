"""NIXL self-check: two agents move DeepSeek-V4 KV pages and the bytes arrive intact.

This is what the serving preflight runs (in the serving environment's Python) and what
``tests/test_nixl_transfer.py`` exercises: a "prefill" agent WRITEs a scattered set of
KV pages into a "decode" agent's pool through the UCX backend (DRAM, so it runs without
a GPU), with a completion notification, the way SGLang's NIXL connector moves KV.

Page layout (SGLang 0.5.23 "MODEL1" / KVLayout.V4, 584 logical bytes per token): for a
page of P tokens, ``[0, P*576)`` are token rows of 576 B (448 fp8 e4m3 "nope" bytes +
64 bf16 rope values), ``[P*576, P*584)`` hold 8 B per token (7 UE8M0 exponent bytes +
1 pad), then zero padding up to ``page_bytes = ceil(P*584/576)*576``.

Usage: ``python -m dsv4_sm120.serving.nixl_check [--two-process] [--json]``
Exit 0 when the transfer verified, 1 when it did not, 2 when NIXL/UCX is unusable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

from .ucx_info import loaded_ucx_version

TOKEN_ROW = 576          # 448 fp8 nope bytes + 64 bf16 rope values
NOPE_BYTES = 448
ROPE_BYTES = 128
SCALE_BYTES = 8          # 7 UE8M0 exponents + 1 pad per token
POISON = 0xA5


class NixlCheckError(Exception):
    """A failure with a one-line message; ``code`` 2 = NIXL unusable, 1 = bad transfer."""

    def __init__(self, msg: str, code: int = 1):
        super().__init__(msg)
        self.code = code


def kv_page_bytes(page_tokens: int) -> int:
    """Bytes of one DSv4 KV page of ``page_tokens`` tokens (rows + scales, padded to 576)."""
    if page_tokens <= 0:
        raise ValueError("page_tokens must be positive")
    logical = page_tokens * (TOKEN_ROW + SCALE_BYTES)
    return -(-logical // TOKEN_ROW) * TOKEN_ROW


def make_kv_pages(num_pages: int, page_tokens: int, seed: int):
    """A pool of DSv4 KV pages (uint8 numpy array [num_pages, page_bytes]) with random content.

    Token rows get random fp8/bf16 bytes, each scale slot 7 random exponent bytes in a
    plausible UE8M0 range and a zero pad byte, and the tail padding stays zero.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    pb = kv_page_bytes(page_tokens)
    pool = np.zeros((num_pages, pb), dtype=np.uint8)
    rows = page_tokens * TOKEN_ROW
    pool[:, :rows] = rng.integers(0, 256, size=(num_pages, rows), dtype=np.uint8)
    scales = pool[:, rows:rows + page_tokens * SCALE_BYTES].reshape(num_pages, page_tokens, SCALE_BYTES)
    scales[:, :, :7] = rng.integers(100, 140, size=(num_pages, page_tokens, 7), dtype=np.uint8)
    scales[:, :, 7] = 0
    return pool


def page_digest(page) -> str:
    return hashlib.sha256(page.tobytes()).hexdigest()


def _import_nixl():
    try:
        from nixl._api import nixl_agent, nixl_agent_config  # noqa: F401
    except Exception as e:  # ImportError, or a broken CUDA-variant loader
        raise NixlCheckError(
            f"cannot import nixl ({type(e).__name__}: {e}); install nixl-cu13==1.5.1 and nixl==1.5.1 (--no-deps)", 2)
    return nixl_agent, nixl_agent_config


def _make_agent(name: str, backend: str):
    nixl_agent, nixl_agent_config = _import_nixl()
    try:
        agent = nixl_agent(name, nixl_agent_config(backends=[]))
        plugins = agent.get_plugin_list()
        if backend not in plugins:
            raise NixlCheckError(f"NIXL has no {backend} backend plugin (available: {', '.join(plugins) or 'none'})", 2)
        agent.create_backend(backend)
    except NixlCheckError:
        raise
    except Exception as e:
        raise NixlCheckError(f"creating a NIXL agent with the {backend} backend failed: {type(e).__name__}: {e}", 2)
    return agent


def _addr(p) -> int:
    """Base address of a pool: a numpy array (DRAM) or a torch CUDA tensor (VRAM)."""
    return p.ctypes.data if hasattr(p, "ctypes") else p.data_ptr()


def _host(p):
    """The pool's bytes as a numpy array (a copy for a GPU tensor)."""
    return p if hasattr(p, "ctypes") else p.cpu().numpy()


def _place(pool, mem: str, dev: int):
    """A numpy pool as it lives in ``mem``: itself (DRAM) or a copy on GPU ``dev`` (VRAM)."""
    if mem == "DRAM":
        return pool
    import torch

    return torch.from_numpy(pool).to(f"cuda:{dev}")


def _register(agent, pools, mem: str = "DRAM", dev: int = 0) -> None:
    import numpy as np

    regs = np.array([[_addr(p), p.nbytes, dev] for p in pools], dtype=np.uint64)
    agent.register_memory(regs, mem)


def _page_descs(pools, pages: Sequence[int], dev: int = 0):
    """Descriptor rows (addr, len, dev) for ``pages`` of every layer pool, layer-major."""
    import numpy as np

    rows = []
    for p in pools:
        pb = p.shape[1]
        base = _addr(p)
        rows.extend([base + int(i) * pb, pb, dev] for i in pages)
    return np.array(rows, dtype=np.uint64)


def _wait(pred, timeout_s: float, what: str):
    t0 = time.monotonic()
    while True:
        r = pred()
        if r:
            return r
        if time.monotonic() - t0 > timeout_s:
            raise NixlCheckError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.002)


def _plan(num_pages: int, n_xfer: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed + 7)
    src = rng.choice(num_pages, size=n_xfer, replace=False)
    dst = rng.choice(num_pages, size=n_xfer, replace=False)
    return [int(x) for x in src], [int(x) for x in dst]


def _initiator_write(agent, remote_name: str, src_pools, src_pages, remote_rows, notif: bytes, timeout_s: float,
                     mem: str = "DRAM", dev: int = 0):
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _page_descs(src_pools, src_pages, dev), mem)
    remote = agent.prep_xfer_dlist(remote_name, remote_rows, mem)
    n = len(remote_rows)
    h = agent.make_prepped_xfer("WRITE", local, list(range(n)), remote, list(range(n)), notif)
    st = agent.transfer(h)
    if st == "ERR":
        raise NixlCheckError("NIXL transfer could not be posted (state ERR)")
    def done() -> bool:
        s = agent.check_xfer_state(h)
        if s == "ERR":
            raise NixlCheckError("NIXL transfer failed (state ERR)")
        return s == "DONE"

    _wait(done, timeout_s, "the NIXL transfer to complete")
    agent.release_xfer_handle(h)


def _verify(src_pools, src_pages, dst_pools, dst_pages, num_pages: int) -> Dict[str, int]:
    """Compare every moved page byte for byte; untouched destination pages must still hold the poison."""
    bad_moved, bad_untouched = 0, 0
    touched = set(dst_pages)
    for sp, dp in zip(map(_host, src_pools), map(_host, dst_pools)):
        for s, d in zip(src_pages, dst_pages):
            if not (sp[s] == dp[d]).all():
                bad_moved += 1
        for i in range(num_pages):
            if i not in touched and not (dp[i] == POISON).all():
                bad_untouched += 1
    return {"bad_moved_pages": bad_moved, "bad_untouched_pages": bad_untouched}


def run_check(page_tokens: int = 64, num_pages: int = 12, num_layers: int = 3, n_xfer: int = 5,
              seed: Optional[int] = None, backend: str = "UCX", timeout_s: float = 30.0,
              two_process: bool = False, corrupt_after: bool = False, mem: str = "DRAM",
              src_gpu: int = 0, dst_gpu: int = 0) -> dict:
    """Move ``n_xfer`` scattered pages of ``num_layers`` layer pools from a prefill agent to a decode agent.

    Returns a report dict (``ok`` plus counts, ``ucx_version``). ``corrupt_after`` flips one byte in the
    destination after the transfer (used by tests to show the verification can fail). ``mem="VRAM"`` puts
    the pools on GPUs ``src_gpu`` / ``dst_gpu`` (torch needed; use ``two_process``: UCX's cuda_ipc, the
    path the servers take, only connects two processes).
    """
    if mem not in ("DRAM", "VRAM"):
        raise ValueError(f"mem must be DRAM or VRAM, not {mem!r}")
    if mem == "VRAM":
        try:
            import torch
        except ImportError:
            raise NixlCheckError("VRAM check needs torch", 2)
        if not torch.cuda.is_available() or max(src_gpu, dst_gpu) >= torch.cuda.device_count():
            raise NixlCheckError(f"VRAM check needs GPUs {src_gpu} and {dst_gpu}; this box has "
                                 f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}", 2)
    import numpy as np

    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    if not 0 < n_xfer <= num_pages:
        raise ValueError("need 0 < n_xfer <= num_pages")
    src_pages, dst_pages = _plan(num_pages, n_xfer, seed)
    src_pools = [_place(make_kv_pages(num_pages, page_tokens, seed + li), mem, src_gpu) for li in range(num_layers)]
    notif = f"room={seed}:pages={n_xfer}".encode()
    t0 = time.monotonic()
    report = {"backend": backend, "page_tokens": page_tokens, "page_bytes": kv_page_bytes(page_tokens),
              "num_layers": num_layers, "pages_moved": n_xfer, "seed": seed, "two_process": two_process,
              "bytes_moved": n_xfer * num_layers * kv_page_bytes(page_tokens), "mem": mem,
              "src_gpu": src_gpu if mem == "VRAM" else None, "dst_gpu": dst_gpu if mem == "VRAM" else None}
    if not two_process:
        prefill = _make_agent("dsv4-check-prefill", backend)
        decode = _make_agent("dsv4-check-decode", backend)
        dst_pools = [_place(np.full((num_pages, kv_page_bytes(page_tokens)), POISON, dtype=np.uint8), mem, dst_gpu)
                     for _ in range(num_layers)]
        _register(prefill, src_pools, mem, src_gpu)
        _register(decode, dst_pools, mem, dst_gpu)
        name = prefill.add_remote_agent(decode.get_agent_metadata())
        name = name.decode() if isinstance(name, bytes) else name
        decode.add_remote_agent(prefill.get_agent_metadata())
        _initiator_write(prefill, name, src_pools, src_pages, _page_descs(dst_pools, dst_pages, dst_gpu), notif,
                         timeout_s, mem, src_gpu)
        _wait(lambda: decode.check_remote_xfer_done("dsv4-check-prefill", notif), timeout_s,
              "the transfer notification on the decode agent")
        if corrupt_after:
            dst_pools[0][dst_pages[0], 17] ^= 0x01
        report["ucx_version"] = loaded_ucx_version()
        report.update(_verify(src_pools, src_pages, dst_pools, dst_pages, num_pages))
    else:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_target_process, args=(child, backend, page_tokens, num_pages, num_layers,
                                                         dst_pages, notif, timeout_s, corrupt_after, mem, dst_gpu),
                           daemon=True)
        proc.start()
        try:
            if not parent.poll(timeout_s + 30):
                raise NixlCheckError("the decode-side process did not answer")
            msg = parent.recv()
            if "error" in msg:
                raise NixlCheckError(msg["error"], msg.get("code", 1))
            prefill = _make_agent("dsv4-check-prefill", backend)
            report["ucx_version"] = loaded_ucx_version()
            _register(prefill, src_pools, mem, src_gpu)
            name = prefill.add_remote_agent(msg["metadata"])
            name = name.decode() if isinstance(name, bytes) else name
            parent.send({"metadata": prefill.get_agent_metadata(),
                         "digests": [[page_digest(_host(p)[s]) for s in src_pages] for p in src_pools]})
            remote_rows = np.array(msg["rows"], dtype=np.uint64)
            _initiator_write(prefill, name, src_pools, src_pages, remote_rows, notif, timeout_s, mem, src_gpu)
            if not parent.poll(timeout_s + 30):
                raise NixlCheckError("the decode-side process did not report its verification")
            res = parent.recv()
            if "error" in res:
                raise NixlCheckError(res["error"], res.get("code", 1))
            report.update(res)
        finally:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    report["seconds"] = round(time.monotonic() - t0, 3)
    report["ok"] = report["bad_moved_pages"] == 0 and report["bad_untouched_pages"] == 0
    return report


def _target_process(conn, backend, page_tokens, num_pages, num_layers, dst_pages, notif, timeout_s, corrupt_after,
                    mem="DRAM", dst_gpu=0):
    """Decode side in its own process: register a poisoned pool, wait for the write, verify digests."""
    import numpy as np

    try:
        decode = _make_agent("dsv4-check-decode", backend)
        pools = [_place(np.full((num_pages, kv_page_bytes(page_tokens)), POISON, dtype=np.uint8), mem, dst_gpu)
                 for _ in range(num_layers)]
        _register(decode, pools, mem, dst_gpu)
        conn.send({"metadata": decode.get_agent_metadata(), "rows": _page_descs(pools, dst_pages, dst_gpu).tolist()})
        if not conn.poll(timeout_s + 30):
            raise NixlCheckError("the prefill-side process did not send its metadata")
        msg = conn.recv()
        decode.add_remote_agent(msg["metadata"])
        _wait(lambda: decode.check_remote_xfer_done("dsv4-check-prefill", notif), timeout_s,
              "the transfer notification on the decode agent")
        if corrupt_after:
            pools[0][dst_pages[0], 17] ^= 0x01
        pools = [_host(p) for p in pools]
        bad_moved = sum(1 for li, p in enumerate(pools) for k, d in enumerate(dst_pages)
                        if page_digest(p[d]) != msg["digests"][li][k])
        touched = set(dst_pages)
        bad_untouched = sum(1 for p in pools for i in range(num_pages) if i not in touched and not (p[i] == POISON).all())
        conn.send({"bad_moved_pages": bad_moved, "bad_untouched_pages": bad_untouched})
    except NixlCheckError as e:
        conn.send({"error": str(e), "code": e.code})
    except Exception as e:  # report, never hang the parent
        conn.send({"error": f"{type(e).__name__}: {e}", "code": 1})


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_sm120.serving.nixl_check",
                                 description="Two NIXL agents (UCX, DRAM) move DeepSeek-V4 KV pages; verify every byte.")
    ap.add_argument("--page-tokens", type=int, default=64, help="tokens per KV page (SGLang DSv4: 256 SWA, 64 c4, 2 c128)")
    ap.add_argument("--pages", type=int, default=12, help="pages per layer pool")
    ap.add_argument("--layers", type=int, default=3, help="layer pools (separately registered buffers)")
    ap.add_argument("--moved", type=int, default=5, help="pages moved per layer")
    ap.add_argument("--backend", default=os.environ.get("SGLANG_DISAGGREGATION_NIXL_BACKEND", "UCX"))
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--two-process", action="store_true", help="put the decode agent in a second process")
    ap.add_argument("--mem", choices=("dram", "vram"), default="dram",
                    help="vram: pools on GPUs --src-gpu / --dst-gpu (implies --two-process; needs torch)")
    ap.add_argument("--src-gpu", type=int, default=0)
    ap.add_argument("--dst-gpu", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    a = ap.parse_args(argv)
    try:
        rep = run_check(a.page_tokens, a.pages, a.layers, a.moved, a.seed, a.backend, a.timeout,
                        a.two_process or a.mem == "vram", mem=a.mem.upper(), src_gpu=a.src_gpu, dst_gpu=a.dst_gpu)
    except NixlCheckError as e:
        print(f"nixl check: FAILED: {e}", file=sys.stderr)
        return e.code
    except ValueError as e:
        print(f"nixl check: bad arguments: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(rep, sort_keys=True))
    elif rep["ok"]:
        print(f"nixl check: OK ({rep['backend']}, {rep['pages_moved']} pages x {rep['num_layers']} layers, "
              f"{rep['bytes_moved']} bytes, {rep['seconds']} s)")
    else:
        print(f"nixl check: FAILED: {rep['bad_moved_pages']} moved pages differ, "
              f"{rep['bad_untouched_pages']} untouched pages overwritten", file=sys.stderr)
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
