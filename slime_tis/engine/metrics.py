"""A step's metrics: the core's (``core.step_metrics``: merged, checked to agree across ranks, reduced once) plus
``loss = sum_{micro-batches, DP x CP} local_sum / D`` where the host recorded ``"megatron.loss_sum"``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slime_tis.core import MetricStats, Reducer
from slime_tis.core.step_metrics import check_schema_agrees, merge_stats, reduce_step_metrics

__all__ = ["aggregate_metrics", "check_schema_agrees"]


def aggregate_metrics(stats: list[MetricStats], reducer: Reducer, *, step: int | None = None) -> dict[str, Tensor]:
    """Merge micro-batches, reduce across ranks, finalize (scalar float64 tensors; ``{}`` if no stats).

    ``step``: the caller's step (training-call) number, which must be equal on every rank (see the module doc).
    """
    merged = merge_stats(stats)
    if merged is None:
        return {}
    reduced, out = reduce_step_metrics(merged, reducer, step=step)
    sums = reduced.token_sums
    if "megatron.loss_sum" in sums:
        out["loss"] = sums["megatron.loss_sum"].double()
    return {k: v.to(torch.float64) for k, v in out.items()}
