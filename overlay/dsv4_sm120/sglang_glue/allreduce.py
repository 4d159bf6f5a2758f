"""The group the ranks agree in (:func:`tp_group`), and patch 0007: SGLang's FlashInfer PCIe-IPC all-reduce
(``SGLANG_ENABLE_PCIE_IPC_ALLREDUCE``) is set up, built and tuned with the ranks' agreement: a rank whose set-up
fails must not all-reduce with NCCL while the others wait in the PCIe-IPC kernels (which spin on peer flags with no
timeout).

Stock SGLang 0.5.23 decides each step per rank:

* ``GroupCoordinator.__init__`` builds ``PcieIpcCommunicator`` inside a per-rank ``try``: a rank that raises warns
  and keeps NCCL, the others use PCIe IPC. :func:`agree_setup` (called right after) exchanges the outcome over the
  group's CPU group: when any rank failed, every rank drops the communicator (NCCL on every rank), with one line
  naming the rank and its error.
* ``PcieIpcCommunicator._ensure_workspace`` builds the workspace lazily (``prepare()`` at warm-up, else the first
  eligible tensor, possibly mid-forward or inside a capture) and tunes it, each in a per-rank ``try``.
  :func:`ensure_workspace` runs that stock code, records whether the build or the tune raised on this rank, and
  exchanges it: when the build failed on any rank, every rank stays on NCCL (a rank that built its workspace keeps
  it out of SGLang's shutdown, whose ``destroy()`` is a collective the other ranks would not join); when only the
  tune failed somewhere, the ranks would pick launch configurations differently (FlashInfer hangs when they
  differ), so every rank stays on NCCL too. Every rank reaches the build with the same tensor in the same order
  (SGLang's own precondition), and the exchange is host-only, so it is safe where the build happens.

The group: every decision of the glue that changes which collectives a rank issues or which kernels a graph
captures is exchanged over SGLang's tensor-parallel group (:func:`tp_group`: a
:class:`dsv4_sm120.rank_agreement.Group` over the group's CPU (gloo) process group and its rendezvous store), by
:mod:`.graphs`, :mod:`.selfcheck`'s MoE check and the functions here. Outside a server with several ranks (one GPU,
tests without torch.distributed, SGLang's groups not built yet) it is :data:`dsv4_sm120.rank_agreement.SINGLE`:
agreement is the rank's own status, at no cost. Choosing the all-reduce by measurement reuses
:func:`of_coordinator` and :func:`dsv4_sm120.rank_agreement.agree` for its choice.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from dsv4_sm120 import rank_agreement as RA

logger = logging.getLogger(__name__)


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


def _text(e: BaseException) -> str:
    first = (str(e).splitlines() or [""])[0][:300]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def agree_setup(coordinator, comm, error: Optional[BaseException]):
    """The communicator every rank keeps after ``PcieIpcCommunicator(...)`` returned ``comm`` or raised ``error``
    on this rank: ``comm`` when it is on (not ``disabled``) on every rank, or when it is off on every rank; else
    None on every rank (NCCL), logged once per rank naming the ranks that failed."""
    group = of_coordinator(coordinator)
    if error is not None:
        mine = _text(error)
    elif comm is None or getattr(comm, "disabled", True):
        mine = "off on this rank (FlashInfer without pcie_ipc_comm, or not a CUDA device)"
    else:
        mine = None
    statuses = group.agree(f"PCIe-IPC all-reduce set-up of group {group.name}", mine)
    failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if not failed:
        return comm
    if len(failed) < group.size:
        logger.error("dsv4_sm120: FlashInfer PCIe-IPC all-reduce set-up failed on %s; agreed by all %d ranks: every "
                     "rank of group %s all-reduces with NCCL", who(failed), group.size, group.name)
    return None


def _recording(cls, errors: dict) -> Callable:
    """``cls`` (the workspace class) that records whether its construction or its ``tune`` raised."""
    def build(*args, **kwargs):
        try:
            ws = cls(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - recorded; SGLang's own except logs it
            errors["build"] = _text(e)
            raise
        tune = getattr(ws, "tune", None)
        if tune is not None:
            def recorded_tune(*a, **k):
                try:
                    return tune(*a, **k)
                except Exception as e:  # noqa: BLE001 - recorded; SGLang's _tune logs it
                    errors["tune"] = _text(e)
                    raise
            try:
                ws.tune = recorded_tune
            except AttributeError:   # a class with __slots__: the tune outcome is not recorded
                pass
        return ws
    return build


def ensure_workspace(comm, inp, stock: Callable) -> bool:
    """``PcieIpcCommunicator._ensure_workspace(inp)`` (``stock``: SGLang's own) with the ranks' agreement on its
    outcome (module doc). True when this rank's workspace serves (then it does on every rank)."""
    if comm._workspace is not None:
        return True
    if getattr(comm, "_build_failed", False):
        return False
    errors: dict = {}
    cls = comm._workspace_cls
    comm._workspace_cls = _recording(cls, errors)
    try:
        ok = bool(stock(inp))
    except Exception as e:  # noqa: BLE001 - agreed below; NCCL serves on every rank
        errors.setdefault("build", _text(e))
        ok = False
    finally:
        comm._workspace_cls = cls
    if not ok and "build" not in errors:
        errors["build"] = "not built (SGLang's log says why)"
    group = _group_of(comm)
    statuses = group.agree("PCIe-IPC all-reduce workspace", {"build": errors.get("build"), "tune": errors.get("tune")})
    failed = [(r, s["build"]) for r, s in enumerate(statuses) if s["build"]]
    what = "build"
    if not failed:
        failed, what = [(r, s["tune"]) for r, s in enumerate(statuses) if s["tune"]], "tune"
    if not failed:
        return True
    comm.disabled = True
    comm._build_failed = True
    if comm._workspace is not None and what == "build":
        comm._dsv4_unshared_workspace = comm._workspace     # kept alive, out of SGLang's collective destroy()
        comm._workspace = None
    if failed:
        logger.error("dsv4_sm120: FlashInfer PCIe-IPC all-reduce workspace %s failed on %s; agreed by all %d ranks: "
                     "every rank of group %s all-reduces with NCCL", what, who(failed), group.size, group.name)
    return False


def _group_of(comm):
    """The agreement group of a communicator: its CPU group (SGLang passes the TP group's: then that group, named
    as SGLang names it)."""
    cpu = getattr(comm, "_cpu_group", None)
    if cpu is None:
        return RA.SINGLE
    tp = tp_group()
    return tp if getattr(tp, "_pg", None) is cpu else RA.group_of(cpu)
