"""The deployment's shapes, read from the same settings the serve scripts use.

TP = the number of ``DECODE_GPUS`` (the decode server runs the calibrated decode paths), heads per rank =
64 / TP, MTP draft tokens = ``SPEC_NUM_DRAFT_TOKENS``, context = ``CONTEXT_LEN`` (sets the c128 candidate
count), all through :mod:`dsv4_sm120.serving.plan` (``VARIABLES`` defaults, same validation). The MoE
format and expert shapes come from ``MODEL_PATH``'s ``config.json``: ``quantization_config.moe_quant_algo ==
NVFP4`` (e.g. ``make convert-nvfp4`` output) -> ``nvfp4``, otherwise the released MXFP4 experts; read through
:mod:`dsv4_sm120.model_config` (a local directory, or a Hugging Face id's config.json in the local Hugging Face
cache). When neither has it (a Hugging Face id not downloaded here) the released DeepSeek-V4-Flash shapes are
used and the plan says so.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Mapping, Optional

from dsv4_sm120 import model_config
from dsv4_sm120.serving.plan import ConfigError, parse_gpus, settings_from_env

# DeepSeek-V4-Flash (released config.json)
FLASH = {"hidden_size": 4096, "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 6,
         "num_attention_heads": 64, "swiglu_limit": 10.0, "index_topk": 512, "sliding_window": 128}
SWA_PAGE, C4_PAGE, C128_PAGE = 256, 64, 2


class DeploymentError(ValueError):
    """Bad serve settings or checkpoint config (one line)."""


@dataclass
class Deployment:
    tp: int
    heads: int
    draft_tokens: int
    context_len: int
    model_path: str
    moe_format: str                 # nvfp4 | mxfp4
    hidden: int
    moe_intermediate: int           # per TP rank
    experts: int
    topk: int
    swiglu_limit: Optional[float]
    index_topk: int
    window: int
    config_source: str
    model_config: Dict = field(default_factory=dict, repr=False)

    @property
    def c128_topk(self) -> int:
        """Candidates per row of a c128 layer: ceil64(2 * ceil(context / 256))."""
        n = 2 * math.ceil(self.context_len / 256)
        return 64 * math.ceil(n / 64)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("model_config")
        d["c128_topk"] = self.c128_topk
        return d


moe_format = model_config.moe_format_of


def read_model_config(model_path: str) -> tuple:
    """(config dict, source text), read by ``dsv4_sm120.model_config``: a local directory's config.json, or a Hub
    id's from the local Hugging Face cache (a config that cannot be read is a DeploymentError); otherwise the
    released DeepSeek-V4-Flash values."""
    mc = model_config.read(model_path)
    if mc.where in ("local", "hub-cache"):
        if mc.problem:
            raise DeploymentError(mc.problem)
        return mc.config, mc.source
    cfg = dict(FLASH, architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4")
    return cfg, (f"MODEL_PATH={model_path} is not a local directory nor in the local Hugging Face cache: released "
                 f"DeepSeek-V4-Flash shapes (MXFP4 experts)")


def _draft_tokens(s: Dict[str, str]) -> int:
    """Tokens a verify pass checks per request, as the MTP serve script would run it (SPEC_NUM_DRAFT_TOKENS, else
    what ``serving.speculative`` derives for MODEL_PATH's draft: EAGLE steps + 1, DSpark block + 1); SGLang's
    EAGLE default (4) when the checkpoint's draft cannot be told here (verify rows are then B x 4)."""
    from dsv4_sm120.serving.speculative import SpecError, spec_flags

    if (s.get("SPEC_NUM_DRAFT_TOKENS") or "").strip():
        return int(s["SPEC_NUM_DRAFT_TOKENS"])
    try:
        flags, _ = spec_flags(s)
    except SpecError:
        return 4
    if "--speculative-dspark-block-size" in flags:
        return int(flags[flags.index("--speculative-dspark-block-size") + 1]) + 1
    return int(flags[flags.index("--speculative-num-draft-tokens") + 1])


def from_env(environ: Mapping[str, str]) -> Deployment:
    s = settings_from_env(environ)
    try:
        gpus = parse_gpus("DECODE_GPUS", s["DECODE_GPUS"])
        draft = _draft_tokens(s)
        ctx = int(s["CONTEXT_LEN"])
    except ConfigError as e:
        raise DeploymentError(str(e)) from None
    except ValueError:
        raise DeploymentError(f"SPEC_NUM_DRAFT_TOKENS={s['SPEC_NUM_DRAFT_TOKENS']!r} / CONTEXT_LEN="
                              f"{s['CONTEXT_LEN']!r} must be integers") from None
    if not 1 <= draft <= 64 or ctx < 256:
        raise DeploymentError(f"SPEC_NUM_DRAFT_TOKENS={draft} must be 1..64 and CONTEXT_LEN={ctx} >= 256")
    tp = len(gpus)
    cfg, src = read_model_config(s["MODEL_PATH"])

    def num(key):
        v = cfg.get(key, FLASH[key])
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise DeploymentError(f"{src}: {key}={v!r} is not a positive number")
        return v

    heads, inter = int(num("num_attention_heads")), int(num("moe_intermediate_size"))
    if heads % tp or inter % tp:
        raise DeploymentError(f"TP={tp} (DECODE_GPUS) does not divide {heads} heads / moe_intermediate {inter}")
    lim = cfg.get("swiglu_limit", FLASH["swiglu_limit"])
    return Deployment(tp=tp, heads=heads // tp, draft_tokens=draft, context_len=ctx, model_path=s["MODEL_PATH"],
                      moe_format=moe_format(cfg), hidden=int(num("hidden_size")), moe_intermediate=inter // tp,
                      experts=int(num("n_routed_experts")), topk=int(num("num_experts_per_tok")),
                      swiglu_limit=float(lim) if lim else None, index_topk=int(num("index_topk")),
                      window=int(cfg.get("sliding_window", FLASH["sliding_window"])), config_source=src,
                      model_config=cfg)


def tiny(dep: Deployment) -> Deployment:
    """Interpreter-sized shapes (``--device cpu``): same format and structure, a few of everything."""
    return Deployment(tp=dep.tp, heads=2, draft_tokens=min(dep.draft_tokens, 2), context_len=2048,
                      model_path=dep.model_path, moe_format=dep.moe_format, hidden=64, moe_intermediate=32,
                      experts=8, topk=2, swiglu_limit=dep.swiglu_limit, index_topk=16, window=16,
                      config_source=dep.config_source + " (tiny CPU shapes)", model_config=dep.model_config)


def attention_buckets(dep: Deployment, quick: bool, cpu: bool = False) -> List[int]:
    """Row counts T: decode batches B and verify rows B x draft tokens (B in 1..256)."""
    if cpu:
        return [1, 3]
    bs = [1, 4, 16, 64, 256] if quick else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    rows = set(bs) | {b * dep.draft_tokens for b in bs if b * dep.draft_tokens <= 256 * dep.draft_tokens}
    if quick:
        rows = set(bs) | {b * dep.draft_tokens for b in (1, 16)}
    return sorted(rows)


def moe_buckets(quick: bool, cpu: bool = False) -> List[int]:
    if cpu:
        return [1, 5]
    return [1, 4, 16, 64, 256] if quick else [1, 2, 4, 8, 16, 32, 64, 128, 256]
