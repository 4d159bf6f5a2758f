"""Random NVFP4 experts and routings for tests and the benchmark."""

from __future__ import annotations

import math
from typing import Dict

import torch


def random_e4m3_scales(shape, gen: torch.Generator, lo: float = -3.0, hi: float = 3.0) -> torch.Tensor:
    """Positive E4M3 block scales ~ 2^U(lo, hi) (with random mantissas), on ``gen``'s device."""
    u = torch.rand(shape, generator=gen, device=gen.device) * (hi - lo) + lo
    return torch.exp2(u).to(torch.float8_e4m3fn)


def make_experts(E: int, H: int, I: int, seed: int, device="cpu") -> Dict[str, torch.Tensor]:
    """Random NVFP4 experts in the loader layout, scaled so that gate/up
    outputs have std ~1.5 and the final output std ~1 for unit-normal x.
    Gate and up use different global scales (catches mixed-up halves)."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, dtype=torch.uint8, device=device)
    w2 = torch.randint(0, 256, (E, H, I // 2), generator=g, dtype=torch.uint8, device=device)
    w13_scale = random_e4m3_scales((E, 2 * I, H // 16), g)
    w2_scale = random_e4m3_scales((E, H, I // 16), g)
    # rms(e2m1) ~ 3.1, rms(2^U(-3,3)) ~ 2.6
    base13 = 1.5 / (3.1 * 2.6 * math.sqrt(H))
    base2 = 1.0 / (3.1 * 2.6 * math.sqrt(I) * 1.5)
    w13_scale_2 = (base13 * (0.75 + 0.5 * torch.rand((E, 2), generator=g, device=device))).float()
    w2_scale_2 = (base2 * (0.75 + 0.5 * torch.rand((E,), generator=g, device=device))).float()
    return dict(w13=w13, w13_scale=w13_scale, w13_scale_2=w13_scale_2,
                w2=w2, w2_scale=w2_scale, w2_scale_2=w2_scale_2)


def random_routing(M: int, E: int, k: int, seed: int, device="cpu", kind: str = "random"):
    """(topk_weights f32 [M, k], topk_ids int32 [M, k]).

    kinds: ``random`` (distinct experts per token), ``dropped`` (about a
    quarter of the slots -1), ``repeat`` (a token may pick one expert
    twice), ``one`` (every slot on expert E-1), ``mixed`` (dropped + repeats
    + a few hot experts, most experts empty).
    """
    g = torch.Generator().manual_seed(seed)
    if kind == "one":
        ids = torch.full((M, k), E - 1, dtype=torch.int32)
    elif kind == "repeat":
        ids = torch.randint(0, E, (M, k), generator=g, dtype=torch.int32)
        ids[:, -1] = ids[:, 0]
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).to(torch.int32)
        if kind in ("dropped", "mixed"):
            drop = torch.rand((M, k), generator=g) < 0.25
            ids[drop] = -1
        if kind == "mixed":
            hot = torch.randint(0, min(E, 3), (M, k), generator=g, dtype=torch.int32)
            pick = torch.rand((M, k), generator=g) < 0.5
            ids = torch.where(pick & (ids >= 0), hot, ids)
            ids[:, 1] = ids[:, 0]
    w = torch.rand((M, k), generator=g) + 0.1
    w = (w / w.sum(dim=1, keepdim=True)).float()
    return w.to(device), ids.to(device)


class RunnerConfig:
    """The ``moe_runner_config`` fields the NVFP4 glue reads (gated SiLU, router weights applied after the experts)."""

    activation, is_gated, apply_router_weight_on_input = "silu", True, False

    def __init__(self, top_k: int, swiglu_limit: float = 1.5):
        self.top_k, self.swiglu_limit = top_k, swiglu_limit


def make_layer(E: int, H: int, I: int, top_k: int, seed: int, swiglu_limit: float = 1.5):
    """``(layer, experts)``: a module holding :func:`make_experts`' tensors under the parameter names of SGLang's
    ModelOpt NVFP4 ``FusedMoE`` layer (``w13_weight``, ``w13_weight_scale``, ``w13_weight_scale_2``, ``w2_*``) and a
    :class:`RunnerConfig`, as ``dsv4_sm120.sglang_glue.moe.prepare_layer`` receives it."""
    W = make_experts(E, H, I, seed)
    m = torch.nn.Module()
    for name, key in (("w13_weight", "w13"), ("w13_weight_scale", "w13_scale"), ("w13_weight_scale_2", "w13_scale_2"),
                      ("w2_weight", "w2"), ("w2_weight_scale", "w2_scale"), ("w2_weight_scale_2", "w2_scale_2")):
        m.register_parameter(name, torch.nn.Parameter(W[key].clone(), requires_grad=False))
    m.moe_runner_config = RunnerConfig(top_k, swiglu_limit)
    return m, W
