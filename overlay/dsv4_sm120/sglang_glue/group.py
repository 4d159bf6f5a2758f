"""The ranks that agree in a patched SGLang server: its tensor-parallel group, as a
:class:`dsv4_sm120.rank_agreement.Group` over the group's CPU (gloo) process group and its rendezvous store.

Every decision of the glue that changes which collectives a rank issues or which kernels a graph captures is
exchanged over this group (:mod:`.ranks`, :mod:`.graphs`, :mod:`.selfcheck`'s MoE check, :mod:`.allreduce`).
Outside a server with several ranks (one GPU, tests without torch.distributed, SGLang's groups not built yet) it is
:data:`dsv4_sm120.rank_agreement.SINGLE`: agreement is the rank's own status, at no cost.
"""

from __future__ import annotations

from dsv4_sm120 import rank_agreement as RA


def of_coordinator(coordinator) -> RA.Group:
    """The group of an SGLang ``GroupCoordinator`` (its ``cpu_group``, ``rank_in_group``, ``world_size``,
    ``unique_name``)."""
    size = int(getattr(coordinator, "world_size", 1) or 1)
    if coordinator is None or size <= 1 or getattr(coordinator, "cpu_group", None) is None:
        return RA.SINGLE
    return RA.group_of(coordinator.cpu_group, name=str(getattr(coordinator, "unique_name", "tp")),
                       rank=int(coordinator.rank_in_group), size=size)


def tp_group() -> RA.Group:
    """SGLang's tensor-parallel group of this process (``get_parallel().tp_group``), or the single group."""
    try:
        from sglang.srt.runtime_context import get_parallel

        coordinator = get_parallel().tp_group
    except Exception:  # noqa: BLE001 - no SGLang, or its groups not built: one rank
        return RA.SINGLE
    return of_coordinator(coordinator)


def who(failed) -> str:
    """``rank 2 (RuntimeError: ...)`` / ``ranks 1 (...), 3 (...)`` of ``[(rank, why), ...]``."""
    failed = list(failed)
    return ("rank " if len(failed) == 1 else "ranks ") + ", ".join(f"{r} ({why})" for r, why in failed)
