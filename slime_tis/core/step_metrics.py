"""A step's metrics: merge the micro-batches' statistics, check the DP x CP ranks agree (a CRC32 of the names per kind
and the step number, one MIN and one MAX: ``ValueError`` / ``RuntimeError``, never a hang), reduce once, finalize.
"""

from __future__ import annotations

import functools
import zlib

import torch
from torch import Tensor

from slime_tis.core.metrics import MetricStats
from slime_tis.core.reducer import Reducer

__all__ = ["check_schema_agrees", "merge_stats", "reduce_step_metrics"]


def check_schema_agrees(stats: MetricStats, reducer: Reducer, *, step: int | None = None) -> None:
    """Raise ``ValueError`` if the statistic names differ across DP x CP, ``RuntimeError`` if the ``step`` numbers do
    (``None``: -1)."""
    kinds = dict(zip(("token_sums", "seq_sums", "mins", "maxs"), stats.groups()))
    device = next((t.device for d in kinds.values() for t in d.values()), torch.device("cpu"))
    sig = torch.tensor([float(zlib.crc32(",".join(sorted(d)).encode())) for d in kinds.values()]
                       + [float(-1 if step is None else step)], dtype=torch.float64, device=device)
    low, high = reducer.batch_min(sig), reducer.batch_max(sig)
    if low[-1] != high[-1]:  # host-sync-ok (after the schedule, outside the loss path)
        raise RuntimeError(
            f"training calls out of step across data-parallel x context-parallel ranks: this rank is in call {step}, "
            f"the ranks in calls {int(low[-1])} to {int(high[-1])}. A call raised on some rank and its "
            "launcher went on, so this call's collectives were paired with another call's: its gradients and "
            "metrics are invalid. Do not continue after an error in a training call; restart from a checkpoint")
    if not torch.equal(low, high):  # host-sync-ok (after the schedule, outside the loss path)
        names = {k: sorted(d) for k, d in kinds.items()}
        raise ValueError("the step's metric statistics differ across data-parallel x context-parallel ranks (an "
                         "input present on some ranks only, e.g. rollout_log_probs in some TISBatch items); "
                         f"this rank has {names}")


def merge_stats(stats: list[MetricStats]) -> MetricStats | None:
    """The micro-batches' statistics merged (sums add, extrema combine); ``None`` for none."""
    return functools.reduce(MetricStats.merge, stats) if stats else None


def reduce_step_metrics(stats: MetricStats, reducer: Reducer, *, step: int | None = None
                        ) -> tuple[MetricStats, dict[str, Tensor]]:
    """``(reduced statistics, finalized metrics)`` of one step's merged statistics over the DP x CP ranks."""
    check_schema_agrees(stats, reducer, step=step)
    reduced = stats.reduce(reducer)
    return reduced, reduced.finalize()
