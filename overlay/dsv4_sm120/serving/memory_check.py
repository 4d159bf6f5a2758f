"""Does each server's share of the weights, plus a minimum KV cache, fit its GPUs at its memory fraction?

SGLang's ``--mem-fraction-static`` is the share of a GPU's memory for the weights and the KV pool together; what is
left after the weights is the KV cache. A server of TP size t holds at least 1/t of the checkpoint's weights on
each GPU (a tensor is split across the ranks or replicated, never less), so when

    total weights / t  +  the KV cache of one CONTEXT_LEN-token request  >  fraction x the GPU's memory

the server cannot start (or starts with no room for one full request): the preflight's ``memory`` check refuses that
TP size with the numbers, before minutes of loading. The weights come from the checkpoint's safetensors index
(``metadata.total_size``; without one, the sizes of its ``*.safetensors`` files); the KV cache of one request from
:mod:`dsv4_sm120.serving.kv_bytes` (what one TP rank holds for a prompt of that length: every rank holds the whole
latent KV, one KV head), with the checkpoint's own ``compress_ratios``; the memory from nvidia-smi. A bound, not a
forecast: SGLang also needs activation and CUDA-graph memory outside the fraction, and a server that passes may
still want more KV for its batch (the note says how much is left).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..safetensors_index import INDEX_FILE
from .kv_bytes import FLASH_COMPRESS_RATIOS, transfer_bytes

GIB = float(1 << 30)


def weights_bytes(directory: Path) -> Tuple[Optional[int], str]:
    """(bytes of the checkpoint's tensors, where the number came from), or (None, why unknown)."""
    idx = Path(directory) / INDEX_FILE
    if idx.is_file():
        try:
            total = (json.loads(idx.read_text()).get("metadata") or {}).get("total_size")
        except (OSError, ValueError, AttributeError):
            total = None
        if isinstance(total, int) and not isinstance(total, bool) and total > 0:
            return total, f"{INDEX_FILE} total_size"
    shards = [p for p in Path(directory).glob("*.safetensors") if not p.name.startswith(".")]
    if shards:
        return sum(p.stat().st_size for p in shards), f"{len(shards)} *.safetensors file(s)"
    return None, f"no {INDEX_FILE} total_size and no *.safetensors in {directory}"


def ratios_of(config: Optional[Mapping]) -> List[int]:
    """The checkpoint's compress ratios for its layers (DeepSeek-V4-Flash's when its config does not say)."""
    cfg = config or {}
    n, r = cfg.get("num_hidden_layers"), cfg.get("compress_ratios")
    if isinstance(n, int) and isinstance(r, list) and len(r) >= n and all(x in (0, 4, 128) for x in r[:n]):
        return [int(x) for x in r[:n]]
    return list(FLASH_COMPRESS_RATIOS)


def server_fit(label: str, role: str, gpus: Sequence[int], fraction: float, weights: int, where: str, kv: int,
               ctx: int, memory_mib: Mapping[int, float]) -> Tuple[Optional[str], str]:
    """(the failure line or None, the note) for one server: its GPUs' smallest memory x ``fraction`` against
    ``weights`` / TP + ``kv`` (bytes)."""
    tp = len(gpus)
    have_gpu = min(memory_mib[g] for g in gpus) * (1 << 20)
    have = fraction * have_gpu
    per = weights / tp
    need = per + kv
    numbers = (f"weights {per / GIB:.1f} GiB per GPU ({weights / GIB:.1f} GiB, {where}, / TP{tp}) + KV "
               f"{kv / GIB:.2f} GiB for one {ctx}-token request = {need / GIB:.1f} GiB")
    room = f"MEM_FRACTION {fraction:g} x {have_gpu / GIB:.1f} GiB = {have / GIB:.1f} GiB"
    key = "PREFILL_GPUS" if role == "prefill" else "DECODE_GPUS"
    if need > have:
        least = next((t for t in (2, 4, 8) if t > tp and weights / t + kv <= have), None)
        fix = f"give each {role} server {least} GPUs ({key})" if least else f"give each {role} server more GPUs ({key})"
        frac = math.ceil(need / have_gpu * 100) / 100
        fix += f" or raise MEM_FRACTION to {frac:.2f}" if frac <= 0.99 else f" (no MEM_FRACTION up to 0.99 fits TP{tp})"
        return (f"{label} (GPUs {','.join(map(str, gpus))}, TP{tp}) does not fit: {numbers}, more than {room}: {fix}",
                "")
    return None, f"{label} (TP{tp}): {numbers} of {room}; {(have - need) / GIB:.1f} GiB left for more KV"


def check(servers: Sequence[Tuple[str, str, Sequence[int], float]], directory: Optional[Path],
          config: Optional[Mapping], ctx: int, memory_mib: Mapping[int, float]) -> Tuple[List[str], List[str]]:
    """(failures, notes) for ``servers`` = [(label, role, gpus, memory fraction)]; ``directory``: the local
    checkpoint (None: not on this host, nothing to check); ``memory_mib``: nvidia-smi's memory.total per GPU."""
    if not servers:
        return [], []
    if directory is None:
        return [], ["not checked: MODEL_PATH is not a checkpoint on this host (its weights are unknown here)"]
    weights, where = weights_bytes(directory)
    if weights is None:
        return [], [f"not checked: {where}"]
    missing = sorted({g for _, _, gpus, _ in servers for g in gpus if g not in memory_mib})
    if missing:
        return [], [f"not checked: nvidia-smi lists no GPU {','.join(map(str, missing))} (the gpu check says so)"]
    kv = transfer_bytes(ctx, ratios_of(config))
    fails, notes = [], []
    for label, role, gpus, frac in servers:
        fail, note = server_fit(label, role, gpus, frac, weights, where, kv, ctx, memory_mib)
        if fail:
            fails.append(fail)
        else:
            notes.append(note)
    return fails, notes


def by_gpu(table: Mapping[int, Mapping]) -> Dict[int, float]:
    """{index: memory.total MiB} from the gpu check's parsed nvidia-smi table."""
    return {i: float(g["total_mib"]) for i, g in table.items()}
