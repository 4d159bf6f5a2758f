"""MoE runner candidates for the checkpoint in ``MODEL_PATH``.

Decision ``moe.nvfp4`` (an NVFP4-converted checkpoint) or ``moe.mxfp4`` (the released MXFP4 experts), over
token counts M. Every SGLang runner is measured through SGLang's own ``FusedMoE`` layer and quantization
method, in a subprocess per runner (:mod:`dsv4_sm120.calibrate.moe_worker`: a runner that crashes or leaves
global state behind cannot take the others down), with random weights of the deployment's per-rank shapes
written into the layer's parameters before SGLang's ``process_weights_after_loading`` (so the timed call is
what serving runs, weight layout processing included). ``dsv4_kernel`` is our NVFP4 kernel called directly,
without SGLang on NVFP4 experts of the same shapes (a reference point that also runs where SGLang is not
installed, and for an MXFP4 checkpoint shows what its ``make convert-nvfp4`` conversion would run; the glue
routes to our kernel as the ``dsv4_triton_nvfp4`` runner).

The gate compares sampled rows with a float64 reference of the same (dequantized) weights, SwiGLU clamp
included. Tolerances follow the activation format (:data:`dsv4_sm120.tolerances.MOE`): NVFP4 activations (the
NVFP4 runners on sm_120) carry ~15-20% relative error on random data, so the nvfp4 gate is 0.3; FP8 / MXFP8 /
bf16 activations (the MXFP4 runners) 0.08. A broken runner (wrong halves, missing clamp on large data, garbage)
lands far above either.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from typing import Dict, List, Optional

from .candidates import Candidate, Case, Outcome, sample_rows
from .deployment import Deployment
from .. import settings, tolerances
from ..paths import OVERLAY_DIR

NVFP4_RUNNERS = ("flashinfer_cutlass", "dsv4_triton_nvfp4")
MXFP4_RUNNERS = ("flashinfer_mxfp4", "deep_gemm", "marlin")
TOL = tolerances.MOE
WORKER_TIMEOUT_S = settings.get("DSV4_SM120_CALIBRATE_MOE_TIMEOUT_S")


# ----------------------------------------------------------------------------- weights and the reference

def _pow2_exp(x: float) -> int:
    return int(round(math.log2(x)))


def fill_mxfp4(params: Dict[str, "object"], H: int, I: int, seed: int) -> None:
    """Random MXFP4 experts written in place into ``w13_weight [E,2I,H/2]``, ``w2_weight [E,H,I/2]`` and the
    E8M0 scale parameters whose last dim is K/32, scaled so the expert outputs are O(1)."""
    import torch

    g = torch.Generator(device=params["w13_weight"].device).manual_seed(seed)
    for w, K, target in (("w13_weight", H, 1.5), ("w2_weight", I, 1.0 / 1.5)):
        p = params[w]
        p.view(torch.uint8).copy_(torch.randint(0, 256, p.shape, generator=g, device=p.device, dtype=torch.uint8))
        s = mx_scale(params, w, K)
        base = _pow2_exp(target / (2.93 * math.sqrt(K))) + 127
        s.view(torch.uint8).copy_(torch.randint(base - 1, base + 2, s.shape, generator=g, device=s.device,
                                                dtype=torch.uint8))


def mx_scale(params: Dict[str, "object"], weight: str, K: int):
    """The E8M0 scale parameter of ``weight`` (name starts with the weight's name, last dim K/32)."""
    for n, p in params.items():
        if n.startswith(weight + "_scale") and p.dim() == 3 and p.shape[-1] == K // 32 and p.element_size() == 1:
            return p
    raise RuntimeError(f"no MXFP4 scale parameter for {weight} (parameters: {sorted(params)})")


def dense_reference(x, topk_weights, topk_ids, expert, swiglu_limit: Optional[float]):
    """float64 ``[M, H]``: ``sum_j w_j * W2_e (silu(min(g, L)) * clamp(u, -L, L))``, ``expert(e) -> (Wg, Wu, W2)``
    float64; ids outside ``[0, E)`` dropped."""
    import torch

    M, k = topk_ids.shape
    ids = topk_ids.long().reshape(-1).cpu()
    tw = topk_weights.double().reshape(-1).cpu()
    tok = torch.arange(M).repeat_interleave(k)
    xd = x.double().cpu()
    out = None
    for e in torch.unique(ids[ids >= 0]).tolist():
        sel = torch.nonzero(ids == e).squeeze(1)
        wg, wu, wd = (w.double().cpu() for w in expert(e))
        a = xd[tok[sel]]
        g, u = a @ wg.T, a @ wu.T
        if swiglu_limit is not None:
            g, u = g.clamp(max=swiglu_limit), u.clamp(min=-swiglu_limit, max=swiglu_limit)
        y = (g * torch.sigmoid(g) * u) @ wd.T
        if out is None:
            out = torch.zeros((M, wd.shape[0]), dtype=torch.float64)
        out.index_add_(0, tok[sel], y * tw[sel, None])
    return out if out is not None else torch.zeros((M, x.shape[1]), dtype=torch.float64)


def expert_fn(fmt: str, snap: Dict[str, "object"], H: int, I: int, up_first: bool = False):
    """``e -> (Wg, Wu, W2)`` float64 from a snapshot of the layer's parameters as loaded."""
    from dsv4_sm120.nvfp4 import dequant_mxfp4, dequant_nvfp4

    def halves(w13):
        a, b = w13[:I], w13[I:]
        return (b, a) if up_first else (a, b)

    if fmt == "nvfp4":
        s13 = snap["w13_weight_scale_2"]

        def f(e):
            import torch

            s2 = s13[e] if s13.dim() == 2 else s13[e].reshape(1).expand(2)
            w13, sc = snap["w13_weight"][e], snap["w13_weight_scale"][e]
            g, u = halves(torch.cat([dequant_nvfp4(w13[:I], sc[:I], s2[0], out_dtype=torch.float64),
                                     dequant_nvfp4(w13[I:], sc[I:], s2[1], out_dtype=torch.float64)]))
            d = dequant_nvfp4(snap["w2_weight"][e], snap["w2_weight_scale"][e], snap["w2_weight_scale_2"][e],
                              out_dtype=torch.float64)
            return g, u, d
        return f
    s13, s2 = mx_scale(snap, "w13_weight", H), mx_scale(snap, "w2_weight", I)

    def f(e):
        import torch

        w13 = dequant_mxfp4(snap["w13_weight"][e], s13[e], out_dtype=torch.float64)
        g, u = halves(w13)
        return g, u, dequant_mxfp4(snap["w2_weight"][e], s2[e], out_dtype=torch.float64)
    return f


# ----------------------------------------------------------------------------- our kernel, called directly

class MoECase(Case):
    def __init__(self, M: int, dep: Deployment, device, seed: int = 0):
        import torch

        from dsv4_sm120.moe.testing import make_experts, random_routing

        self.device, self.dep = device, dep
        self.W = make_experts(dep.experts, dep.hidden, dep.moe_intermediate, seed, device=device)
        g = torch.Generator(device=device).manual_seed(seed + 17 * M)
        self.x = torch.randn(M, dep.hidden, device=device, generator=g).to(torch.bfloat16)
        self.tw, self.ids = random_routing(M, dep.experts, dep.topk, seed + M, device=device)
        self.rows = sample_rows(M, 8)
        self._ref = None

    def error(self, out) -> float:
        from dsv4_sm120.moe.reference import rel_err

        r = self.rows
        if self._ref is None:
            f = expert_fn("nvfp4", {"w13_weight": self.W["w13"], "w13_weight_scale": self.W["w13_scale"],
                                    "w13_weight_scale_2": self.W["w13_scale_2"], "w2_weight": self.W["w2"],
                                    "w2_weight_scale": self.W["w2_scale"], "w2_weight_scale_2": self.W["w2_scale_2"]},
                          self.dep.hidden, self.dep.moe_intermediate)
            self._ref = dense_reference(self.x[r], self.tw[r], self.ids[r], f, self.dep.swiglu_limit)
        return rel_err(out[r].cpu(), self._ref)


class OursDirect(Candidate):
    name, eligible = "dsv4_kernel", False

    def __init__(self, fmt: str, device):
        self.fmt, self.device, self.tol = fmt, device, TOL["nvfp4"]

    def available(self):
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if not str(self.device).startswith("cuda") and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            return "on CPU our Triton kernel needs TRITON_INTERPRET=1"
        return None

    def build(self, case: MoECase):
        from dsv4_sm120.moe import nvfp4_fused_moe

        W = case.W
        return lambda: nvfp4_fused_moe(case.x, W["w13"], W["w13_scale"], W["w13_scale_2"], W["w2"], W["w2_scale"],
                                       W["w2_scale_2"], case.tw, case.ids, swiglu_limit=case.dep.swiglu_limit)


# ----------------------------------------------------------------------------- SGLang runners (subprocess)

class SGLangRunner(Candidate):
    batch = True

    def __init__(self, backend: str, dep: Deployment, device, seed: int = 0, env: Optional[dict] = None):
        self.name, self.dep, self.device, self.seed = backend, dep, str(device), seed
        self.tol = TOL[dep.moe_format]
        self.env = env or {}

    def available(self):
        if importlib.util.find_spec("sglang") is None:
            return "sglang is not importable in this environment"
        if self.device == "cpu" and self.name != "dsv4_triton_nvfp4":
            return f"SGLang's {self.name} MoE runner needs a CUDA GPU"
        if self.name == "deep_gemm" and importlib.util.find_spec("deep_gemm") is None:
            return "module deep_gemm is not installed"
        return None

    def job(self, buckets: List[int]) -> dict:
        d = self.dep
        return {"backend": self.name, "format": d.moe_format, "device": self.device, "H": d.hidden,
                "I": d.moe_intermediate, "E": d.experts, "topk": d.topk, "swiglu_limit": d.swiglu_limit,
                "buckets": buckets, "seed": self.seed, "model_config": d.model_config}

    def measure_all(self, buckets: List[int], progress=None) -> Dict[int, Outcome]:
        env = dict(os.environ, **self.env)
        overlay = str(OVERLAY_DIR)
        env["PYTHONPATH"] = os.pathsep.join([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + [overlay])
        try:
            r = subprocess.run([sys.executable, "-m", "dsv4_sm120.calibrate.moe_worker"],
                               input=json.dumps(self.job(buckets)), capture_output=True, text=True, env=env,
                               timeout=WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            res = {b: Outcome("failed", reason=f"worker timed out after {WORKER_TIMEOUT_S:.0f}s") for b in buckets}
        else:
            res = parse_worker_output(r.stdout, r.stderr, r.returncode, buckets)
        if progress:
            progress.step(f"moe {self.name}: " + ", ".join(
                f"M={b} {o.us:.1f} us" if o.status == "ok" else f"M={b} {o.status}" for b, o in res.items()),
                len(buckets))
        return res


def parse_worker_output(stdout: str, stderr: str, rc: int, buckets: List[int]) -> Dict[int, Outcome]:
    lines = [x for x in stdout.splitlines() if x.startswith("RESULT")]
    if not lines:
        tail = [x for x in stderr.strip().splitlines() if x.strip()][-1:] or [f"exit code {rc}"]
        return {b: Outcome("failed", reason=f"worker crashed: {tail[0][:300]}") for b in buckets}
    data = json.loads(lines[-1][len("RESULT"):])
    if data.get("status") != "ok":
        return {b: Outcome(data.get("status", "failed"), reason=data.get("reason", "")) for b in buckets}
    out = {}
    for b in buckets:
        o = data.get("buckets", {}).get(str(b))
        out[b] = Outcome(**o) if o else Outcome("failed", reason="worker returned no result for this bucket")
    return out


def candidates(dep: Deployment, device, seed: int = 0) -> List[Candidate]:
    runners = NVFP4_RUNNERS if dep.moe_format == "nvfp4" else MXFP4_RUNNERS
    return [SGLangRunner(b, dep, device, seed) for b in runners] + [OursDirect(dep.moe_format, device)]


def make_case_factory(dep: Deployment, device, seed: int = 0):
    return lambda M: MoECase(M, dep, device, seed)
