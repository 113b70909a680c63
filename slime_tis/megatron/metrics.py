"""Step metrics: merge per-micro-batch statistics, reduce once over ranks, finalize.

``aggregate_metrics`` returns the core's ``tis/*`` and ``policy/*`` metrics plus

    loss            = sum_{micro-batches, DP x CP} local_sum / D      (the exact global loss)
    policy/entropy  = mean over valid tokens of the entropy of softmax(logits / temperature)

Each statistic is reduced with its own operator (SUM for sums, MIN for minima, MAX for maxima) on
megatron's DP x CP (or DP) group: one collective per operator, outside the loss path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slime_tis.core import MetricStats, Reducer
from slime_tis.core.metrics import safe_ratio

__all__ = ["aggregate_metrics"]


def aggregate_metrics(stats: list[MetricStats], reducer: Reducer) -> dict[str, Tensor]:
    """Merge micro-batches, reduce across ranks, finalize (scalar float64 tensors; ``{}`` if no stats)."""
    if not stats:
        return {}
    merged = stats[0]
    for s in stats[1:]:
        merged = merged.merge(s)
    reduced = merged.reduce(reducer)
    out = reduced.finalize()
    sums = reduced.token_sums
    if "megatron.loss_sum" in sums:
        out["loss"] = sums["megatron.loss_sum"].double()
    if "megatron.entropy_sum" in sums and "policy.n_tok_valid" in sums:
        out["policy/entropy"] = safe_ratio(sums["megatron.entropy_sum"].double(),
                                       sums["policy.n_tok_valid"].double())
    return {k: v.to(torch.float64) for k, v in out.items()}
