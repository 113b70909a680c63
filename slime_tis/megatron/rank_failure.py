"""Which rank failed, and where, when a collective breaks because another rank's training call raised
(docs/megatron.md, "A rank that failed is named"): an error leaving a hook call is recorded under :data:`KEY` of the
job's rendezvous store (first record wins), a broken connection on another rank becomes :class:`RankFailedError`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d

KEY = "slime_tis/failed_rank"
#: how long a rank whose connection broke waits for the failed rank's record
WAIT_S = 2.0
_MAX_MESSAGE = 300
#: words of a backend error caused by a peer that went away (gloo, NCCL, the TCP store)
_BROKEN = ("by peer", "remote worker", "broken pipe", "connection", "timed out", "nccl")

_recorded: list[str] = []  # this process's record while it stands (withdrawn at the next call)


class RankFailedError(RuntimeError):
    """This rank stopped because another rank's training call raised (message: that rank, where, its error)."""


@dataclass
class Phase:
    """Where a training call is (set by the hook as it goes; read when an error propagates)."""

    call: str
    name: str = "its start"


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or "(no message)"
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def _store() -> tuple[Any, int] | None:
    """The default store and this rank, or None (no process group, one process, or no store)."""
    try:
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
            return None
        return distributed_c10d._get_default_store(), dist.get_rank()  # noqa: SLF001 - the job's rendezvous store
    except Exception:  # noqa: BLE001 - no store: errors pass unchanged
        return None


def withdraw() -> None:
    """At the start of a training call: remove this process's record, if it wrote one (nothing otherwise)."""
    found = _store() if _recorded else None
    mine = _recorded.pop() if _recorded else None
    if found is None:
        return
    store, _ = found
    with contextlib.suppress(Exception):
        if store.check([KEY]) and store.get(KEY).decode("utf-8", "replace") == mine:
            store.delete_key(KEY)


def explain(e: BaseException, where: str) -> RankFailedError | None:
    """While ``e`` leaves ``where``: a broken connection after another rank's record -> the error naming that
    rank; otherwise ``None`` (``e`` stands), ``e`` recorded as this rank's failure unless a record is there."""
    found = _store()
    if found is None:
        return None
    store, rank = found
    try:
        if isinstance(e, getattr(dist, "DistError", ())) or (
                isinstance(e, RuntimeError) and any(w in str(e).lower() for w in _BROKEN)):
            if not store.check([KEY]):
                with contextlib.suppress(Exception):
                    store.wait([KEY], timedelta(seconds=WAIT_S))
            if not store.check([KEY]):
                return None  # no rank said why (killed, or failed outside a hook call)
            first = store.get(KEY).decode("utf-8", "replace")
            if first.startswith(f"rank {rank} failed"):
                return None
            return RankFailedError(f"{first}; this rank ({rank}) then stopped in {where}: {type(e).__name__}: "
                                   f"{_one_line(e)}")
        mine = f"rank {rank} failed in {where}: {type(e).__name__}: {_one_line(e)}"
        if store.compare_set(KEY, "", mine).decode("utf-8", "replace") == mine:
            _recorded[:] = [mine]
    except Exception:  # noqa: BLE001 - the store went away with the failed rank: nothing to add
        pass
    return None


@contextlib.contextmanager
def reporting(phase: Phase) -> Iterator[Phase]:
    """Run a hook call; an error leaving it is recorded, or replaced by the first failed rank's (:func:`explain`)."""
    withdraw()
    try:
        yield phase
    except Exception as e:
        other = explain(e, f"{phase.name} of {phase.call}")
        if other is None:
            raise
        raise other from e
