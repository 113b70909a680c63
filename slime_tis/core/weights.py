"""Importance weights from level log-ratios: truncate, clip, mask, and batch normalisation.

For a unit (token or sequence) with unclamped level log-ratio ``L`` and bounds ``lower < upper`` on
``r = pi_train / pi_rollout``::

    r        = exp(clamp(L, -B, B))            # safety bound B before any exp
    truncate: w = min(r, upper)                # no lower bound
    clip:     w = clamp(r, lower, upper)
    mask:     w = r                            # units outside [lower, upper] are rejected (core.rules)
    batch-norm: w <- w * N_kept / sum_{kept u} w_u

Algorithms 0 and 1 apply no weight: ``w = 1``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slime_tis.core.plan import Plan
from slime_tis.core.reducer import Reducer

__all__ = ["unit_weights", "normalisation_factor", "normalisation_factor_over"]


def unit_weights(plan: Plan, level_log_ratio: Tensor, clamped: Tensor | None = None,
                 scale: Tensor | None = None) -> Tensor:
    """Weights of ``plan.mode`` (``Mode.weight``, ``core.levels``) for unclamped level log-ratios (any shape,
    float32 out); ``clamped``: their ``clamp(L, -B, B)`` where already computed (token level: ``lc`` of
    ``core.ratios.ratio_moments``); ``scale``: per unit, the bounds tightened to ``exp(scale * log bound)``
    (``core.staleness``)."""
    if not plan.weighted:
        return torch.ones_like(level_log_ratio)
    r = torch.exp(level_log_ratio.clamp(-plan.bound, plan.bound) if clamped is None else clamped)
    if scale is not None:
        return plan.mode.weight(r, torch.exp(scale * plan.log_lower), torch.exp(scale * plan.log_upper))
    return plan.mode.weight(r, plan.lower, plan.upper)  # may write r in place: this call's own tensor


def normalisation_factor(weight_sum: Tensor, unit_count: Tensor) -> Tensor:
    """Batch-normalisation factor ``count / sum`` (1 when nothing is kept): the mean weight becomes 1."""
    ok = weight_sum > 0
    return torch.where(ok, unit_count / torch.where(ok, weight_sum, torch.ones_like(weight_sum)),
                       torch.ones_like(weight_sum))


def normalisation_factor_over(plan: Plan, norm_sum: Tensor, norm_count: Tensor, reducer: Reducer) -> Tensor:
    """The batch-normalisation factor (the value every ``batch_norm_factor`` holds) over every rank:
    ``f = sum norm_count / sum norm_sum``.

    ``norm_sum``, ``norm_count``: 0-d, this rank's sum of unnormalised kept weights and its number of kept units
    (``TISResult.norm_sum`` / ``norm_count``, summed over the micro-batches the factor covers). Token units are
    summed over DP x CP, sequence units over DP only (every CP rank holds each sequence whole). One collective.
    """
    total = reducer.batch_sum(torch.stack([norm_sum.float(), norm_count.float()]), per_sequence=plan.per_sequence)
    return normalisation_factor(total[0], total[1])
