"""One SGLang MoE runner, measured through SGLang's own ``FusedMoE`` layer (run by :mod:`.moe` in a subprocess).

Reads a job (JSON on stdin: backend, format, device, shapes, buckets, the checkpoint's config.json), resolves
SGLang's server arguments for a one-rank server with ``--moe-runner-backend <backend>`` against that config,
publishes them, builds ``FusedMoE`` with the quantization config SGLang's loader derives, writes random
experts into its parameters, runs ``process_weights_after_loading``, then per token count M: one call gated
against the float64 reference (sampled rows), then timed (CUDA graph replay where capturable). Prints one
line ``RESULT<json>``: ``{"status", "reason", "method", "buckets": {M: outcome}}``. On ``--device cpu`` the
platform is forced to sm_120 (as the integration tests do) so SGLang resolves its sm_120 choices.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
import time
import types
from pathlib import Path


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0][:300] if s else ''}"


def _platform(cpu: bool):
    if not cpu:
        return contextlib.nullcontext()
    from sglang.srt.runtime_context import override_platform

    return override_platform(is_cuda=True, is_hip=False, has_flashinfer=True, is_sm120=True, is_sm100=False,
                             is_sm100_or_sm110=False, is_sm90=False, is_blackwell=True)


def build_layer(job: dict, model_dir: str):
    import torch
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.model_loader import loader
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import prepare_server_args

    dev = "cuda" if job["device"].startswith("cuda") else "cpu"
    a = prepare_server_args(["--model-path", model_dir, "--device", "cuda", "--tp", "1",
                             "--moe-runner-backend", job["backend"]])
    a.resolve_once()
    publish(a, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0 if dev == "cuda" else None))
    initialize_moe_config()
    # one rank, no process groups: the combine asks the TP group only whether it is wider than one rank
    get_parallel().override_permanently(tp_group=types.SimpleNamespace(world_size=1))
    qc = loader._get_quantization_config(ModelConfig.from_server_args(a), LoadConfig())
    with torch.device(dev):
        layer = FusedMoE(num_experts=job["E"], top_k=job["topk"], hidden_size=job["H"], intermediate_size=job["I"],
                         layer_id=1, quant_config=qc, params_dtype=torch.bfloat16, swiglu_limit=job["swiglu_limit"],
                         prefix="model.layers.1.mlp.experts")
    return layer


def fill_and_snapshot(layer, job: dict) -> dict:
    import torch

    from dsv4_sm120.calibrate.moe import fill_mxfp4
    from dsv4_sm120.moe.testing import make_experts

    params = dict(layer.named_parameters())
    H, I, E = job["H"], job["I"], job["E"]
    if job["format"] == "nvfp4":
        W = make_experts(E, H, I, job["seed"], device=params["w13_weight"].device)
        for name, key in (("w13_weight", "w13"), ("w13_weight_scale", "w13_scale"), ("w2_weight", "w2"),
                          ("w2_weight_scale", "w2_scale"), ("w2_weight_scale_2", "w2_scale_2")):
            params[name].data.copy_(W[key].view(params[name].dtype).reshape(params[name].shape))
        s2 = params["w13_weight_scale_2"]
        s2.data.copy_(W["w13_scale_2"] if s2.dim() == 2 else W["w13_scale_2"][:, 0])
    else:
        fill_mxfp4(params, H, I, job["seed"])
    for n, p in params.items():
        if "input_scale" in n and p.is_floating_point():
            p.data.fill_(1.0)
    return {n: p.detach().clone().cpu() for n, p in params.items()}


def run(job: dict) -> dict:
    import torch

    from dsv4_sm120.calibrate.candidates import Outcome, gate, sample_rows, time_call
    from dsv4_sm120.calibrate.moe import TOL, dense_reference, expert_fn
    from dsv4_sm120.moe.reference import rel_err
    from dsv4_sm120.moe.testing import random_routing

    cpu = not job["device"].startswith("cuda")
    if not cpu:
        torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory(prefix="dsv4_calibrate_moe_") as d:
        Path(d, "config.json").write_text(json.dumps(job["model_config"]))
        if job["format"] == "mxfp4":
            os.environ.setdefault("SGLANG_DSV4_FP4_EXPERTS", "1")
        with _platform(cpu):
            try:
                layer = build_layer(job, d)
                snap = fill_and_snapshot(layer, job)
                layer.quant_method.process_weights_after_loading(layer)
            except Exception as e:  # noqa: BLE001
                return {"status": "failed", "reason": f"building the layer: {_first_line(e)}"}
            from sglang.srt.layers.moe.topk import StandardTopKOutput

            method = type(layer.quant_method).__name__
            up_first = bool(getattr(layer.quant_method, "load_up_proj_weight_first", False))
            ref_expert = expert_fn(job["format"], snap, job["H"], job["I"], up_first=up_first)
            tol = TOL[job["format"]]
            out = {}
            dev = next(layer.parameters()).device
            for M in job["buckets"]:
                g = torch.Generator(device=dev).manual_seed(job["seed"] + 17 * M)
                x = torch.randn(M, job["H"], device=dev, generator=g).to(torch.bfloat16)
                tw, ids = random_routing(M, job["E"], job["topk"], job["seed"] + M, device=dev)
                topk = StandardTopKOutput(tw, ids, torch.zeros((M, job["E"]), device=dev))
                rows = sample_rows(M, 8)
                try:
                    t0 = time.perf_counter()
                    y = layer(x, topk)
                    first_us = (time.perf_counter() - t0) * 1e6
                    y = getattr(y, "hidden_states", y)
                    ref = dense_reference(x[rows], tw[rows], ids[rows], ref_expert, job["swiglu_limit"])
                    err = rel_err(y[rows].float().cpu(), ref)
                except Exception as e:  # noqa: BLE001
                    out[str(M)] = Outcome("failed", reason=_first_line(e)).to_json()
                    continue
                why = gate(err, tol)
                if why:
                    out[str(M)] = Outcome("rejected", err=err, tol=tol, reason=why).to_json()
                    continue
                if cpu:  # the interpreter (tests only): the gated call's wall clock
                    out[str(M)] = Outcome("ok", us=first_us, err=err, tol=tol, timing="wall").to_json()
                    continue
                try:
                    us, how = time_call(lambda: layer(x, topk))
                    out[str(M)] = Outcome("ok", us=us, err=err, tol=tol, timing=how).to_json()
                except Exception as e:  # noqa: BLE001
                    out[str(M)] = Outcome("failed", err=err, reason=f"timing: {_first_line(e)}").to_json()
    return {"status": "ok", "method": method, "buckets": out}


def main() -> int:
    logging.disable(logging.WARNING)
    try:
        job = json.loads(sys.stdin.read())
    except ValueError as e:
        print("RESULT" + json.dumps({"status": "failed", "reason": f"bad job: {e}"}))
        return 2
    try:
        import sglang  # noqa: F401
    except Exception as e:  # noqa: BLE001
        res = {"status": "unavailable", "reason": f"sglang does not import: {_first_line(e)}"}
    else:
        try:
            res = run(job)
        except Exception as e:  # noqa: BLE001
            res = {"status": "failed", "reason": _first_line(e)}
    print("RESULT" + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
