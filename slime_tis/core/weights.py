"""Importance weights from level log-ratios: ``w = mode.weight(exp(clamp(L, -B, B)))`` and batch normalisation
``w <- w N_kept / sum_{kept u} w_u``; algorithms 0 and 1: ``w = 1``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slime_tis.core.plan import Plan
from slime_tis.core.reducer import Reducer

__all__ = ["unit_weights", "normalisation_factor", "normalisation_factor_over"]


def unit_weights(plan: Plan, level_log_ratio: Tensor, clamped: Tensor | None = None,
                 scale: Tensor | None = None) -> Tensor:
    """float32 weights of ``plan.mode`` for unclamped ``L`` (``clamped``: ``clamp(L, -B, B)`` if computed;
    ``scale``: per unit, bounds tightened to ``exp(scale * log bound)``)."""
    if not plan.weighted:
        return torch.ones_like(level_log_ratio)
    r = torch.exp(level_log_ratio.clamp(-plan.bound, plan.bound) if clamped is None else clamped)
    if scale is not None:
        return plan.mode.weight(r, torch.exp(scale * plan.log_lower), torch.exp(scale * plan.log_upper))
    return plan.mode.weight(r, plan.lower, plan.upper)  # may write r in place: this call's own tensor


def normalisation_factor(weight_sum: Tensor, unit_count: Tensor) -> Tensor:
    """Batch-normalisation factor ``count / sum`` (1 when nothing is kept)."""
    ok = weight_sum > 0
    return torch.where(ok, unit_count / torch.where(ok, weight_sum, torch.ones_like(weight_sum)),
                       torch.ones_like(weight_sum))


def normalisation_factor_over(plan: Plan, norm_sum: Tensor, norm_count: Tensor, reducer: Reducer) -> Tensor:
    """``sum norm_count / sum norm_sum`` over the ranks (one ``batch_sum``; DP only at sequence units) of this rank's
    ``TISResult.norm_sum`` / ``norm_count`` summed over the covered micro-batches."""
    total = reducer.batch_sum(torch.stack([norm_sum.float(), norm_count.float()]), per_sequence=plan.per_sequence)
    return normalisation_factor(total[0], total[1])
