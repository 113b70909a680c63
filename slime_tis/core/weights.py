"""Importance weights from level log-ratios: truncate, clip, mask (SPEC "Mode").

For a unit (token or sequence) with unclamped level log-ratio ``L`` and bounds ``lower < upper``
on ``r = pi_train / pi_rollout``::

    r        = exp(clamp(L, -B, B))            # safety bound B before any exp
    truncate: w = min(r, upper)                # no lower bound
    clip:     w = clamp(r, lower, upper)
    mask:     w = r                            # units outside [lower, upper] are rejected

Bound tests are done on the unclamped ``L`` in log space (``L < log lower``, ``L > log upper``),
so they neither overflow nor feel the safety clamp.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["outside_bounds", "bounded_weights"]


def outside_bounds(log_ratio: Tensor, lower: float, upper: float) -> tuple[Tensor, Tensor]:
    """``(below, above)``: bool masks of ``log_ratio < log(lower)`` and ``log_ratio > log(upper)``."""
    return log_ratio < math.log(lower), log_ratio > math.log(upper)


def bounded_weights(mode: str, log_ratio: Tensor, lower: float, upper: float, safety_bound: float) -> Tensor:
    """Weights ``w`` of the given mode for unclamped per-unit log-ratios ``log_ratio`` (any shape).

    Returns a float32 tensor of the same shape (not detached here; callers pass detached inputs).
    """
    ratio = torch.exp(log_ratio.clamp(-safety_bound, safety_bound))
    if mode == "truncate":
        return ratio.clamp(max=upper)
    if mode == "clip":
        return ratio.clamp(min=lower, max=upper)
    return ratio  # mask: weights are never changed by rejection; the keep mask is
