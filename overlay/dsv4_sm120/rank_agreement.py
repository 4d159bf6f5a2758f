"""Ranks agree: every rank of a process group contributes a short status for a named topic and every rank gets
every rank's status back, bounded in time.

The ranks of one SGLang server (tensor parallelism) must issue the same collectives in the same order. A decision
one rank takes alone (a kernel that steps aside, a capture captured again, a communicator that failed to start)
can make it issue collectives the others do not: a hang at best, reductions silently paired with the wrong step at
worst. The glue (:mod:`dsv4_sm120.sglang_glue`) therefore exchanges each such outcome with :func:`agree` and every
rank takes the same decision from the same list.

How (:meth:`Group.agree`): through the group's rendezvous store (the ``TCPStore`` torch.distributed was started
with, under the group's own prefix), not a collective of the group: rank ``r`` sets the key
``dsv4_sm120/agree/<group>/<step>/<r>`` to ``{"topic": ..., "status": ...}`` (JSON), then polls until every rank's
key of that step exists and reads them all. ``<step>`` counts the agreements of the group in this process, so
ranks that run the same agreements in the same order meet at the same keys. What this gives that a gloo
collective does not (torch 2.14's gloo waits up to the group's own timeout, names no rank, and a rank that arrives
at a different collective aborts or pairs with it):

* bounded: a rank that does not answer within ``DSV4_SM120_RANK_AGREE_TIMEOUT_S`` (default 600 s) makes every
  waiting rank raise :class:`RankTimeout`, one line naming the missing ranks (``store.check`` per key);
* never mis-paired: a rank that arrives at the same step with another topic (it skipped or added an agreement)
  makes every rank raise :class:`RanksDisagree`, naming the ranks and their topics;
* host only: no device work, so it is safe inside CUDA-graph capture and costs a few store round trips.

Both are :class:`StopServer`, a ``RuntimeError``: SGLang's scheduler catches ``Exception`` (logs it and tears
the whole server down), whereas a ``SystemExit`` would end one rank without SGLang's shutdown and leave the
others blocked in their next collective. Without torch.distributed, or in a group of one, :func:`agree` returns
``[status]`` at once (no store, no overhead).

The store keeps every key (a few hundred short strings per server start: agreements happen at start-up and
capture, never per request). Imports torch only when a group is built; nothing of SGLang.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional, Sequence

from dsv4_sm120 import settings

ENV_TIMEOUT = "DSV4_SM120_RANK_AGREE_TIMEOUT_S"
PREFIX = "dsv4_sm120/agree"
MAX_STATUS_BYTES = 16384      # a status is a short summary; a longer one is a bug of the caller
_POLL_FIRST_S, _POLL_MAX_S = 0.0005, 0.02


class StopServer(RuntimeError):
    """The server must stop; the message is one line saying why (raised on every rank that takes the decision)."""


class RankTimeout(StopServer):
    """Some ranks did not reach an agreement in time (``missing``: their ranks in the group)."""

    def __init__(self, message: str, missing: Sequence[int] = ()):
        super().__init__(message)
        self.missing = list(missing)


class RanksDisagree(StopServer):
    """Ranks met at the same step of their group with different topics (``topics``: ``{rank: topic}``)."""

    def __init__(self, message: str, topics: Optional[Dict[int, str]] = None):
        super().__init__(message)
        self.topics = dict(topics or {})


def timeout_s() -> float:
    """``DSV4_SM120_RANK_AGREE_TIMEOUT_S``: how long a rank waits for the others at one agreement."""
    return float(settings.get(ENV_TIMEOUT))


def _ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class Group:
    """The ranks that agree: ``store`` (a torch.distributed ``Store``), this process's ``rank`` in the group,
    its ``size`` and ``name`` (in keys and messages). One object per group and process (:func:`group_of`): it
    counts the group's agreements."""

    def __init__(self, store, rank: int, size: int, name: str = "group"):
        if not 0 <= int(rank) < int(size):
            raise ValueError(f"rank {rank} is not in a group of {size}")
        self.store, self.rank, self.size, self.name = store, int(rank), int(size), str(name)
        self.step = 0

    def __repr__(self) -> str:
        return f"Group({self.name!r}, rank {self.rank} of {self.size}, step {self.step})"

    def _key(self, step: int, rank: int) -> str:
        return f"{PREFIX}/{self.name}/{step}/{rank}"

    def _store_down(self, what: str, e: Exception) -> StopServer:
        return StopServer(f"dsv4_sm120: rank {self.rank} of group {self.name} cannot reach the rendezvous store while "
                          f"{what} ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); the "
                          f"process hosting it (rank 0) has probably exited; the server stops")

    def agree(self, topic: str, status: Any = None, timeout: Optional[float] = None) -> List[Any]:
        """Every rank's ``status`` (JSON-serializable, short) for ``topic``, in rank order; the same list on every
        rank. Raises :class:`RankTimeout` / :class:`RanksDisagree` (module doc)."""
        step = self.step
        self.step += 1
        mine = json.dumps({"topic": str(topic), "status": status}, sort_keys=True)
        if len(mine) > MAX_STATUS_BYTES:
            raise ValueError(f"agreement {topic!r}: status of {len(mine)} bytes (at most {MAX_STATUS_BYTES})")
        if self.size == 1:
            return [json.loads(mine)["status"]]
        limit = timeout_s() if timeout is None else float(timeout)
        keys = [self._key(step, r) for r in range(self.size)]
        try:
            self.store.set(keys[self.rank], mine)
        except Exception as e:  # noqa: BLE001 - the store's own errors (connection, timeout) are not ours to type
            raise self._store_down(f"posting agreement {topic!r}", e) from e
        self._wait(keys, topic, step, limit)
        try:
            values = self.store.multi_get(keys)
        except Exception as e:  # noqa: BLE001
            raise self._store_down(f"reading agreement {topic!r}", e) from e
        entries = [json.loads(v.decode() if isinstance(v, (bytes, bytearray)) else v) for v in values]
        topics = {r: e["topic"] for r, e in enumerate(entries)}
        if len(set(topics.values())) > 1:
            raise RanksDisagree(self._mispaired(topics, step), topics)
        return [e["status"] for e in entries]

    def _mispaired(self, topics: Dict[int, str], step: int) -> str:
        """One line, the same on every rank: the ranks off the most common topic (ties: rank 0's) and theirs."""
        count: Dict[str, int] = {}
        for t in topics.values():
            count[t] = count.get(t, 0) + 1
        main = max(count, key=lambda t: (count[t], t == topics[0]))
        odd = sorted(r for r, t in topics.items() if t != main)
        rest = sorted(r for r, t in topics.items() if t == main)
        return (f"dsv4_sm120: the ranks of group {self.name} met at step {step} at different agreements: "
                + "; ".join(f"rank {r} at {topics[r]!r}" for r in odd)
                + f"; {_ranks_text(rest)} at {main!r}; the server stops instead of pairing them")

    def _wait(self, keys: List[str], topic: str, step: int, limit: float) -> None:
        t0 = time.monotonic()
        delay = _POLL_FIRST_S
        while True:
            try:
                if self.store.check(keys):
                    return
                late = time.monotonic() - t0 >= limit
                missing = [r for r, k in enumerate(keys) if not self.store.check([k])] if late else []
            except Exception as e:  # noqa: BLE001
                raise self._store_down(f"waiting at agreement {topic!r}", e) from e
            if late and missing:
                raise RankTimeout(f"dsv4_sm120: {_ranks_text(missing)} of group {self.name} ({self.size} ranks) "
                                  f"did not reach agreement {topic!r} (step {step}) within {limit:g} s "
                                  f"({ENV_TIMEOUT}); the server stops instead of hanging", missing)
            if late:
                return
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)


SINGLE = Group(store=None, rank=0, size=1, name="single")
_GROUPS: Dict[int, Group] = {}


def group_of(pg=None, name: Optional[str] = None, rank: Optional[int] = None,
             size: Optional[int] = None) -> Group:
    """The :class:`Group` of torch.distributed process group ``pg`` (default: the world), one per group and
    process; :data:`SINGLE` without torch.distributed or with one rank. ``name``: in keys and messages (default:
    torch's group name); ``rank`` / ``size``: this process's rank in ``pg`` and its size (default: torch's)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return SINGLE
    if not (dist.is_available() and dist.is_initialized()):
        return SINGLE
    from torch.distributed import distributed_c10d as c10d

    pg = pg if pg is not None else c10d._get_default_group()
    size = dist.get_world_size(pg) if size is None else int(size)
    if size <= 1:
        return SINGLE
    g = _GROUPS.get(id(pg))
    if g is None or g.size != size:
        store = c10d._world.pg_map[pg][1]          # the group's PrefixStore over the rendezvous store
        label = name or ("world" if pg is c10d._get_default_group() else c10d._get_process_group_name(pg))
        g = Group(store, dist.get_rank(pg) if rank is None else int(rank), size, label)
        g._pg = pg                                 # keeps id(pg) from being reused while the group is cached
        _GROUPS[id(pg)] = g
    return g


def agree(topic: str, status: Any = None, group: Optional[Group] = None,
          timeout: Optional[float] = None) -> List[Any]:
    """:meth:`Group.agree` on ``group`` (default: the world's :func:`group_of`)."""
    return (group if group is not None else group_of()).agree(topic, status, timeout)


def process_rank() -> int:
    """This process's global rank in torch.distributed (0 without it)."""
    try:
        import torch.distributed as dist

        return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0
    except Exception:  # noqa: BLE001
        return 0


def forget() -> None:
    """Drop the cached groups (tests that build several worlds in one process)."""
    _GROUPS.clear()
