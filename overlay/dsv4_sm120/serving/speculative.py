"""Which draft a DeepSeek-V4 checkpoint carries, and the SGLang 0.5.23 flags that serve it.

The rules mirror the 0.5.23 loader:

* DSpark head (DeepSeek-V4-Flash-0731): the target ``config.json`` carries any of the prefixed
  keys ``dspark_block_size``, ``dspark_markov_rank``, ``dspark_noise_token_id``,
  ``dspark_target_layer_ids`` (``speculative/dspark_components/dspark_config.py``
  ``checkpoint_bundles_dspark_draft``; ``configs/model_config.py`` ``_config_draft_model`` then
  loads the draft as ``DeepseekV4ForCausalLMDSpark``), or the checkpoint has a ``dspark/``
  subfolder with its own ``config.json`` (``arg_groups/speculative_hook.py``
  ``_target_checkpoint_dspark_subfolder``). Served with ``--speculative-algorithm DSPARK``.
* MTP layer (DeepSeek-V4-Flash): ``num_nextn_predict_layers`` > 0; the draft loads as
  ``DeepseekV4ForCausalLMNextN``. Served with ``--speculative-algorithm EAGLE`` (NEXTN is an
  alias), top-k 1 (``arg_groups/deepseek_v4_hook.py`` asserts it).

Defaults (docs/speculative.md says where each comes from): EAGLE 3 steps / 4 draft tokens
(SGLang's own DeepSeek-V4 choice); DSpark block size = the checkpoint's ``dspark_block_size``
(5 for V4-Flash-0731, the setting of the public RTX PRO 6000 numbers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

from .. import model_config
from .. import settings as registry

DSPARK_KEYS = ("dspark_block_size", "dspark_markov_rank", "dspark_noise_token_id", "dspark_target_layer_ids")
ALGORITHMS = {"auto": "auto", "eagle": "EAGLE", "nextn": "EAGLE", "mtp": "EAGLE", "dspark": "DSPARK"}
EAGLE_DEFAULT_STEPS = 3


class SpecError(ValueError):
    """A speculative-decoding setting that cannot work; one line."""


@dataclass
class DraftInfo:
    kind: Optional[str]            # "DSPARK", "EAGLE" or None (no draft)
    source: str                    # where the config came from
    dspark_block_size: Optional[int] = None
    nextn_layers: int = 0
    has_dspark: bool = False
    has_mtp: bool = False


def load_checkpoint_config(model: str, environ: Optional[Mapping[str, str]] = None) -> Tuple[Optional[dict], bool, str]:
    """(config.json as a dict or None, has a dspark/ subfolder, where it was found), read by
    ``dsv4_sm120.model_config`` (local directory, local Hugging Face cache, published Hub ids). A MODEL_PATH whose
    config cannot be used is a SpecError with the serve preflight's model line."""
    mc = model_config.read(model, environ)
    problems = mc.problems()
    if problems:
        raise SpecError(problems[0])
    if mc.config is None:
        return None, False, ""
    return mc.config, mc.has_dspark_subfolder, mc.source


def detect_draft(model: str, environ: Optional[Mapping[str, str]] = None) -> DraftInfo:
    cfg, subfolder, source = load_checkpoint_config(model, environ)
    if cfg is None:
        return DraftInfo(kind=None, source="")
    # the loader reads text_config for multimodal wrappers; DeepSeek-V4 keeps the keys at the top
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    get = lambda k: cfg.get(k, text.get(k))  # noqa: E731
    has_dspark = subfolder or any(get(k) is not None for k in DSPARK_KEYS)
    try:
        nextn = int(get("num_nextn_predict_layers") or 0)
    except (TypeError, ValueError):
        nextn = 0
    block = get("dspark_block_size")
    try:
        block = int(block) if block is not None else None
    except (TypeError, ValueError):
        raise SpecError(f"MODEL_PATH={model}: dspark_block_size={block!r} in {source} is not an integer")
    kind = "DSPARK" if has_dspark else "EAGLE" if nextn > 0 else None
    return DraftInfo(kind=kind, source=source + (" (+ dspark/ subfolder)" if subfolder else ""),
                     dspark_block_size=block, nextn_layers=nextn, has_dspark=has_dspark, has_mtp=nextn > 0)


def _int(settings: Mapping[str, str], key: str) -> Optional[int]:
    """The serve variable ``key`` through the settings registry (its range is declared there); None when empty."""
    try:
        return registry.get(key, settings)
    except registry.SettingsError as e:
        raise SpecError(str(e)) from None


def spec_flags(settings: Dict[str, str], environ: Optional[Mapping[str, str]] = None) -> Tuple[List[str], str]:
    """SGLang flags for the speculative variant (the same on prefill and decode) and a one-line why.

    Both servers get the same flags: under PD, 0.5.23 registers the draft pool's SWA state as its
    own transfer component only when both sides have a draft pool of the same geometry
    (``disaggregation/utils.py`` ``setup_state_kv_args``), and it is the prefill side that writes
    the draft layer's SWA rows for the prompt (docs/speculative.md, "PD").
    """
    model = settings.get("MODEL_PATH", "")
    want_txt = (settings.get("SPEC_ALGORITHM") or "auto").strip()
    want = ALGORITHMS.get(want_txt.lower())
    if want is None:
        raise SpecError(f"SPEC_ALGORITHM={want_txt!r}: expected auto, EAGLE (= NEXTN, MTP) or DSPARK")
    info = detect_draft(model, environ)
    if want == "auto":
        if not info.source:
            raise SpecError(f"MODEL_PATH={model}: cannot read its config.json here (not a local directory, not in "
                            f"the Hugging Face cache) to tell which draft it carries: download it first, or set "
                            f"SPEC_ALGORITHM=EAGLE or DSPARK")
        if info.kind is None:
            raise SpecError(f"MODEL_PATH={model} carries no draft model (its config.json has neither dspark_* keys "
                            f"nor num_nextn_predict_layers > 0): serve it without speculation "
                            f"(serve/serve_dsv4_tp4.sh)")
        algo, why = info.kind, f"{info.kind} chosen from {info.source}"
    else:
        algo, why = want, f"SPEC_ALGORITHM={want_txt}"
        if info.source and algo == "DSPARK" and not info.has_dspark:
            raise SpecError(f"SPEC_ALGORITHM={want_txt}: MODEL_PATH={model} carries no DSpark head (no dspark_* keys "
                            f"in {info.source}, no dspark/ subfolder)")
        if info.source and algo == "EAGLE" and info.has_dspark:
            raise SpecError(f"SPEC_ALGORITHM={want_txt}: MODEL_PATH={model} carries a DSpark head, not an MTP layer "
                            f"(SGLang would load its DSpark stages as a NextN layer): use SPEC_ALGORITHM=auto or DSPARK")
        if info.source and algo == "EAGLE" and not info.has_mtp:
            raise SpecError(f"SPEC_ALGORITHM={want_txt}: MODEL_PATH={model} has no MTP layer "
                            f"(num_nextn_predict_layers is 0 or missing in {info.source})")

    steps = _int(settings, "SPEC_NUM_STEPS")
    draft = _int(settings, "SPEC_NUM_DRAFT_TOKENS")
    topk = _int(settings, "SPEC_EAGLE_TOPK")
    block = _int(settings, "SPEC_DSPARK_BLOCK_SIZE")
    if topk not in (None, 1):
        raise SpecError(f"SPEC_EAGLE_TOPK={topk}: DeepSeek-V4 speculation in SGLang 0.5.23 supports topk 1 only")

    if algo == "EAGLE":
        if block is not None:
            raise SpecError("SPEC_DSPARK_BLOCK_SIZE applies to DSpark only; EAGLE takes SPEC_NUM_STEPS")
        if steps is None:
            steps = draft - 1 if draft is not None else EAGLE_DEFAULT_STEPS
        if draft is None:
            draft = steps + 1
        if draft != steps + 1:
            raise SpecError(f"SPEC_NUM_DRAFT_TOKENS={draft} with SPEC_NUM_STEPS={steps}: with topk 1 the draft "
                            f"tokens are steps + 1 = {steps + 1}")
        flags = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(steps),
                 "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(draft)]
        return flags, f"{why}: EAGLE/NEXTN, {steps} steps, {draft} draft tokens"

    if steps is not None and steps != 1:
        raise SpecError(f"SPEC_NUM_STEPS={steps}: DSpark drafts a whole block in one step; set "
                        f"SPEC_DSPARK_BLOCK_SIZE (tokens per block) instead")
    if block is None and draft is not None:
        block = draft - 1
    if block is not None and draft is not None and draft != block + 1:
        raise SpecError(f"SPEC_NUM_DRAFT_TOKENS={draft} with SPEC_DSPARK_BLOCK_SIZE={block}: DSpark verifies "
                        f"block + 1 = {block + 1} tokens per step")
    block_src = "SPEC_DSPARK_BLOCK_SIZE" if (settings.get("SPEC_DSPARK_BLOCK_SIZE") or "").strip() \
        else "SPEC_NUM_DRAFT_TOKENS - 1" if block is not None else None
    if block is None and info.dspark_block_size is not None:
        block, block_src = info.dspark_block_size, "the checkpoint's dspark_block_size"
    flags = ["--speculative-algorithm", "DSPARK"]
    if block is None:
        return flags, f"{why}: DSPARK, block size left to SGLang (checkpoint's draft config, else 7)"
    return flags + ["--speculative-dspark-block-size", str(block)], \
        f"{why}: DSPARK, block size {block} ({block_src}), {block + 1} tokens verified per step"
