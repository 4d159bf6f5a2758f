"""``GpuBench``: checks and times SGLang's block-FP8 Triton launcher on the GPU, one candidate config at a time.

Per candidate: the config is injected in place of SGLang's JSON lookup, the launcher runs once with its
output poisoned with NaN and the result is compared with an fp32 reference of the dequantized product on
fresh random data (a config that computes a wrong product, or leaves the output unwritten, fails); then it
is timed by CUDA-graph replay over enough rotating weight copies that the weights come from device memory,
as in a forward pass, not from L2.  Where SGLang's ``fp8_utils`` imports, the tuned Triton linear
(activation quantization + GEMM) and the linear of SGLang's default backend for the device are timed too.

``device="cpu"`` runs SGLang's kernel in Triton's interpreter (``TRITON_INTERPRET=1``) with wall-clock
timing: for testing the tuner only.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from dsv4_sm120 import hints
from dsv4_sm120.cuda_timing import cuda_graph_us
from dsv4_sm120.fp8_configs import config_file_name, config_for_m, read_json_object
from dsv4_sm120.fp8.errors import CandidateError, UsageError
from dsv4_sm120.fp8.kernel import load_kernel
from dsv4_sm120.fp8.progress import make_bar
from dsv4_sm120.fp8.search import Bench, config_id
from dsv4_sm120.fp8.shapes import BLOCK, Shape

# Rotate the weights through at least this many bytes: more than the L2 of the GPUs this targets (the
# RTX PRO 6000's 128 MB is the largest), so each timed GEMM reads its weights from device memory.
_L2_TARGET_BYTES = 192 << 20
_MAX_COPIES = 64
_REL_TOL_GEMM = 1e-2             # bf16 output of an exact-fp8 product: ~2e-3 expected
_REL_TOL_LINEAR = 8e-2           # + fp8 activation quantization: ~3.6% expected


class GpuBench(Bench):
    """The tuner's device.  ``source`` / ``wheel`` choose where SGLang's kernel comes from (see
    :mod:`dsv4_sm120.fp8.kernel`); ``time_default_backend`` also times SGLang's default FP8 backend."""

    def __init__(self, source: str = "auto", wheel: Optional[Path] = None, seed: int = 0,
                 time_default_backend: bool = True, reps: int = 5, device: str = "cuda"):
        try:
            import torch
            import triton
        except ImportError as e:
            raise UsageError(f"the tuner needs torch and triton ({e}); run it in the project's environment "
                             f"(make setup), or use {hints.args('--dry-run')} to see the plan") from None

        self.torch, self.device = torch, device
        if device == "cuda":
            if not torch.cuda.is_available():
                raise UsageError(f"no CUDA GPU visible: the tuner needs one (use {hints.args('--dry-run')} to see "
                                 "the plan)")
        elif device == "cpu":   # for tests: Triton's interpreter, wall-clock timing
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise UsageError("device cpu needs TRITON_INTERPRET=1")
        else:
            raise UsageError(f"unknown device {device!r}")
        self._tmp = tempfile.TemporaryDirectory(prefix="dsv4_tune_fp8_")
        self.source_arg, self.wheel_arg = source, wheel
        self.mod, self.utils, self.kernel_source, self.kernel_path = load_kernel(source, wheel, Path(self._tmp.name))
        self.kernel_tag = hashlib.sha256(Path(self.kernel_path).read_bytes()).hexdigest()[:12]
        if device == "cuda":
            props = torch.cuda.get_device_properties(0)
            self.device_name_raw = torch.cuda.get_device_name(0)
            cap = tuple(torch.cuda.get_device_capability(0))
            self.num_sms = props.multi_processor_count
        else:
            self.device_name_raw, cap, self.num_sms = "CPU TRITON INTERPRETER", (0, 0), 1
        self.sm90 = cap == (9, 0)
        self.versions = {"torch": torch.__version__, "triton": triton.__version__,
                         "cuda": str(torch.version.cuda), "python": platform.python_version(),
                         "capability": f"sm_{cap[0]}{cap[1]}"}
        self.seed, self.reps = seed, reps
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self._default_linear = None
        self.default_backend = {"name": None, "available": False, "reason": "not requested"}
        if time_default_backend and device == "cuda":
            self._init_default_backend(cap)
        self._orig_lookup = self.mod.get_w8a8_block_fp8_configs
        self._orig_prepare = self.mod.prepare_block_fp8_matmul_inputs

    def _sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    # -- default backend ------------------------------------------------------
    def _init_default_backend(self, cap) -> None:
        if self.utils is None:
            name = "cutlass (sgl_kernel)" if cap[0] == 12 else ("deep_gemm" if tuple(cap) == (9, 0) else "?")
            self.default_backend = {"name": name, "available": False,
                                    "reason": "SGLang's fp8_utils / sgl_kernel / deep_gemm not importable here "
                                              f"({self.kernel_source})"}
            return
        u = self.utils
        try:
            backend = "cutlass" if cap[0] == 12 else ("triton" if cap[0] == 11 else "auto")
            u.FP8_GEMM_RUNNER_BACKEND = u.Fp8GemmRunnerBackend(backend)   # as initialize_fp8_gemm_config
            fn = u.dispatch_w8a8_block_fp8_linear(list(BLOCK))
            name = getattr(getattr(fn, "func", fn), "__name__", str(fn))
            if name == "triton_w8a8_block_fp8_linear":
                self.default_backend = {"name": "triton", "available": True, "reason": "dispatch picks Triton",
                                        "function": name}
            else:
                self._default_linear = fn
                self.default_backend = {"name": name, "available": True, "reason": f"--fp8-gemm-backend {backend}",
                                        "function": name}
        except Exception as e:
            self.default_backend = {"name": None, "available": False,
                                    "reason": f"dispatch failed: {type(e).__name__}: {e}"[:300]}

    # -- data ---------------------------------------------------------------
    def _rand_fp8(self, *shape):
        t = self.torch.randn(*shape, device=self.device, generator=self.gen, dtype=self.torch.float32)
        return t.clamp_(-448, 448).to(self.torch.float8_e4m3fn)

    def _rand_scale(self, *shape):
        return (self.torch.rand(*shape, device=self.device, generator=self.gen) * 1.5 + 0.25) * 1e-2

    def setup_shape(self, shape: Shape, ms: Sequence[int]) -> None:
        wbytes = shape.N * shape.K
        self.copies = max(2, min(_MAX_COPIES, -(-_L2_TARGET_BYTES // wbytes))) if self.device == "cuda" else 2
        self.B = [self._rand_fp8(shape.N, shape.K) for _ in range(self.copies)]
        self.Bs = [self._rand_scale(shape.N // BLOCK[0], shape.K // BLOCK[1]) for _ in range(self.copies)]
        self.B_deq = self._dequant(self.B[0], self.Bs[0], rows_block=BLOCK[0])
        self._sync()

    def _dequant(self, q, s, rows_block=1):
        torch = self.torch
        f = q.to(torch.float32)
        s = s.repeat_interleave(BLOCK[1], dim=1)[:, : q.shape[1]]
        if rows_block > 1:
            s = s.repeat_interleave(rows_block, dim=0)[: q.shape[0]]
        return f * s

    def _ref(self, a_deq):
        torch = self.torch
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            return a_deq @ self.B_deq.T
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev

    def setup_m(self, shape: Shape, M: int) -> None:
        torch = self.torch
        n = self.copies
        self.A = [self._rand_fp8(M, shape.K) for _ in range(n)]
        self.As = [self._rand_scale(M, shape.K // BLOCK[1]) for _ in range(n)]
        self.ref = self._ref(self._dequant(self.A[0], self.As[0]))
        self.X = None
        self.ref_lin = None
        if self._default_linear is not None or self.utils is not None:
            self.X = [torch.randn(M, shape.K, device=self.device, generator=self.gen, dtype=torch.bfloat16)
                      for _ in range(n)]
            self.ref_lin = self._ref(self.X[0].to(torch.float32))

    def release_shape(self) -> None:
        self.B = self.Bs = self.A = self.As = self.X = None
        self.B_deq = self.ref = self.ref_lin = None
        if self.device == "cuda":
            self.torch.cuda.empty_cache()

    # -- helpers --------------------------------------------------------------
    @contextlib.contextmanager
    def _with_config(self, M: int, cfg: Optional[Dict], poison: bool = False):
        mod = self.mod
        table = None if cfg is None else {M: dict(cfg)}
        mod.get_w8a8_block_fp8_configs = lambda N, K, bn, bk: table
        if poison:
            orig = self._orig_prepare

            def prepare(*a, **kw):
                M_, N_, K_, C = orig(*a, **kw)
                C.fill_(float("nan"))
                return M_, N_, K_, C

            mod.prepare_block_fp8_matmul_inputs = prepare
        try:
            yield
        finally:
            mod.get_w8a8_block_fp8_configs = self._orig_lookup
            mod.prepare_block_fp8_matmul_inputs = self._orig_prepare

    def _gemm(self, i: int):
        return self.mod.w8a8_block_fp8_matmul_triton(self.A[i], self.B[i], self.As[i], self.Bs[i], list(BLOCK),
                                                     output_dtype=self.torch.bfloat16)

    def _check(self, out, ref, tol: float, what: str) -> None:
        torch = self.torch
        if out.shape != ref.shape:
            raise CandidateError(f"{what}: output shape {tuple(out.shape)} != {tuple(ref.shape)}")
        o = out.to(torch.float32)
        if not torch.isfinite(o).all():
            raise CandidateError(f"{what}: non-finite output (unwritten or overflow)")
        err = (torch.linalg.vector_norm(o - ref) / torch.linalg.vector_norm(ref)).item()
        if not err <= tol:
            raise CandidateError(f"{what}: relative error {err:.3g} > {tol}")

    def _graph_us(self, fns: List[Callable]) -> float:
        if self.device != "cuda":
            for f in fns:
                f()
            t0 = time.perf_counter()
            for f in fns:
                f()
            return (time.perf_counter() - t0) * 1e6 / len(fns)
        return cuda_graph_us(fns, self.reps)

    # -- Bench API ------------------------------------------------------------
    def time_config(self, shape: Shape, M: int, cfg: Optional[Dict]) -> float:
        try:
            with self._with_config(M, cfg, poison=True):
                out = self._gemm(0)
                self._sync()
            self._check(out, self.ref, _REL_TOL_GEMM, "gemm")
            with self._with_config(M, cfg):
                return self._graph_us([(lambda i=i: self._gemm(i)) for i in range(self.copies)])
        except CandidateError:
            raise
        except Exception as e:  # compile / launch / resource errors of this config
            with contextlib.suppress(Exception):
                self._sync()
            raise CandidateError(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from None

    def shipped_config(self, shape: Shape, M: int) -> Optional[Dict]:
        path = Path(self.kernel_path).parent / "configs" / config_file_name(shape.N, shape.K, self.device_name_raw)
        table = read_json_object(path)
        return config_for_m(table, M, block_k=BLOCK[1]) if table else None

    def _time_linear_fn(self, fn, what: str) -> Optional[float]:
        Ws = self.Bs
        try:
            out = fn(self.X[0], self.B[0], list(BLOCK), Ws[0])
            self._sync()
            self._check(out, self.ref_lin, _REL_TOL_LINEAR, what)
            return self._graph_us([(lambda i=i: fn(self.X[i], self.B[i], list(BLOCK), Ws[i]))
                                   for i in range(self.copies)])
        except Exception as e:
            print(f"\nnote: {what} at M={self.X[0].shape[0]} failed: {type(e).__name__}: {e}"[:400], file=sys.stderr)
            return None

    def time_linear(self, shape: Shape, M: int, cfg: Dict) -> Optional[float]:
        if self.utils is None or self.X is None:
            return None
        with self._with_config(M, cfg):
            return self._time_linear_fn(self.utils.triton_w8a8_block_fp8_linear, "triton linear")

    def time_default_backend(self, shape: Shape, M: int) -> Optional[float]:
        if self._default_linear is None or self.X is None:
            return None
        return self._time_linear_fn(self._default_linear, f"{self.default_backend['name']} linear")

    def precompile(self, jobs, workers, deadline, progress) -> None:
        """Compile the candidates in ``workers`` processes (Triton's disk cache is shared), so the timing
        loop finds them compiled.  One representative job per kernel specialization."""
        if workers <= 1 or not jobs:
            return
        import multiprocessing as mp

        def mclass(m):
            return 1 if m == 1 else (16 if m % 16 == 0 else 0)

        reps: Dict[str, Tuple[Shape, int, Dict]] = {}
        for sh, m, cfg in jobs:
            k = f"{config_id(cfg)}|{mclass(m)}|{(sh.K // BLOCK[1]) % 16 == 0}|{sh.N % 16 == 0}"
            reps.setdefault(k, (sh, m, cfg))
        work = [(s.N, s.K, m, cfg) for s, m, cfg in reps.values()]
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        bar = make_bar(len(work), f"compiling ({workers} procs)", enabled=progress)
        t0 = time.monotonic()
        failed = done = 0
        ex = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_worker_init,
                                 initargs=(self.source_arg, str(self.wheel_arg) if self.wheel_arg else None, self.device))
        try:
            pending = {ex.submit(_worker_compile, w) for w in work}
            while pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                fin, pending = wait(pending, timeout=left, return_when=FIRST_COMPLETED)
                for f in fin:
                    try:
                        ok = f.result()
                    except Exception:   # a worker died (BrokenProcessPool): the timing loop compiles the rest
                        ok = False
                    failed += not ok
                    done += 1
                    bar.update(1)
        finally:
            ex.shutdown(wait=False, cancel_futures=True)
            bar.close()
        self.precompile_stats = {"variants": len(work), "compiled": done - failed, "failed_or_skipped":
                                 len(work) - done + failed, "workers": workers,
                                 "seconds": round(time.monotonic() - t0, 1)}
        print(f"precompile: {self.precompile_stats}", file=sys.stderr)


# The compile processes of GpuBench.precompile (spawned): each loads SGLang's kernel once, then compiles the
# candidates it is given into Triton's shared disk cache, so the timing loop finds them compiled.
_W: Dict[str, object] = {}


def _worker_init(source: str, wheel: Optional[str], device: str = "cuda") -> None:
    import torch

    if device == "cuda":
        torch.cuda.set_device(0)
    _W["device"] = device
    d = tempfile.mkdtemp(prefix="dsv4_tune_fp8_w_")
    mod, _, _, _ = load_kernel(source, Path(wheel) if wheel else None, Path(d))
    _W["mod"] = mod
    _W["torch"] = torch


def _worker_compile(job) -> bool:
    N, K, M, cfg = job
    torch, mod, dev = _W["torch"], _W["mod"], _W["device"]
    try:
        a = torch.randn(M, K, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(N, K, device=dev).to(torch.float8_e4m3fn)
        as_ = torch.rand(M, K // BLOCK[1], device=dev)
        bs = torch.rand(N // BLOCK[0], K // BLOCK[1], device=dev)
        mod.get_w8a8_block_fp8_configs = lambda *_a: {M: dict(cfg)}
        mod.w8a8_block_fp8_matmul_triton(a, b, as_, bs, list(BLOCK), output_dtype=torch.bfloat16)
        if dev == "cuda":
            torch.cuda.synchronize()
        return True
    except Exception:
        if dev == "cuda":
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
        return False

