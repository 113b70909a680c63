"""A step's metrics: the core's (``core.step_metrics``: merged, checked to agree across ranks, reduced once) plus
``loss = sum_{micro-batches, DP x CP} local_sum / D`` where the host recorded ``"megatron.loss_sum"``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slime_tis.core import MetricStats, Reducer
from slime_tis.core.step_metrics import merge_stats, reduce_step_metrics

__all__ = ["aggregate_metrics"]


def aggregate_metrics(stats: list[MetricStats], reducer: Reducer, *, step: int | None = None) -> dict[str, Tensor]:
    """The step's metrics as scalar float64 tensors (``{}`` without stats); ``step``: equal on every rank."""
    merged = merge_stats(stats)
    if merged is None:
        return {}
    reduced, out = reduce_step_metrics(merged, reducer, step=step)
    if "megatron.loss_sum" in reduced.token_sums:
        out["loss"] = reduced.token_sums["megatron.loss_sum"]
    return {k: v.to(torch.float64) for k, v in out.items()}
