"""Which tokens and sequences are rejected: mask mode, rejection sampling, veto, non-finite data.

Rejection never changes a weight, only the keep mask (SPEC "What rejection does to the loss").
A rejected token contributes zero loss and zero gradient; whether it stays in the loss denominator
is ``TISConfig.rejected_denominator``.

Rules (each optional except the last):

* mask mode (``--tis-mode mask``): units whose level ratio lies outside ``[lower, upper]``;
* rejection sampling (``--tis-rs-level``): units whose ratio at ``rs_level`` lies outside
  ``[rs_lower, rs_upper]``;
* veto (``--tis-veto-threshold v``): sequences with any valid token of raw ratio ``< v``;
* non-finite: sequences with NaN/inf at any valid token (always on).

A unit is a token at token level and a whole sequence at sequence/geometric level.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from slime_tis.config import TISConfig
from slime_tis.core.ratios import PackedRatios
from slime_tis.core.weights import outside_bounds

__all__ = ["Rejection", "find_rejections"]


@dataclass
class Rejection:
    """Rejection masks of one micro-batch.

    ``keep``: ``[T]`` bool, valid tokens that survive every rule. ``seq_rejected``: ``[n_seq]`` bool,
    sequences rejected as a whole (non-finite, veto, or a sequence/geometric-level rule).
    ``mode_below/above`` and ``rs_below/above`` are per-unit masks (``[T]`` or ``[n_seq]``) restricted
    to the diagnostic domain, or ``None`` when the rule is off.
    """

    keep: Tensor
    seq_rejected: Tensor
    mode_below: Tensor | None
    mode_above: Tensor | None
    rs_below: Tensor | None
    rs_above: Tensor | None


def find_rejections(config: TISConfig, ratios: PackedRatios) -> Rejection:
    """Apply every configured rejection rule to ``ratios`` (see module docstring).

    Unit masks need no restriction to the diagnostic domain: ``ratios.level_log_ratio`` is 0 outside
    it and every pair of bounds contains 1 (``lower <= 1 <= upper``), so ``L = 0`` is never outside them.
    """
    seq_reject = ratios.seq_nonfinite | ratios.seq_veto
    token_reject: Tensor | None = None

    mode_below = mode_above = rs_below = rs_above = None
    if config.mode == "mask" and config.algorithm != 0:
        mode_below, mode_above = outside_bounds(
            ratios.level_log_ratio(config.level), config.lower_bound, config.upper_bound
        )
        if config.level == "token":
            token_reject = mode_below | mode_above
        else:
            seq_reject = seq_reject | mode_below | mode_above
    if config.rs_level is not None:
        rs_below, rs_above = outside_bounds(
            ratios.level_log_ratio(config.rs_level), config.rs_lower_bound, config.rs_upper_bound
        )
        if config.rs_level == "token":
            rs_reject = rs_below | rs_above
            token_reject = rs_reject if token_reject is None else token_reject | rs_reject
        else:
            seq_reject = seq_reject | rs_below | rs_above

    keep = ratios.valid & ~ratios.segments.expand(seq_reject)
    if token_reject is not None:
        keep = keep & ~token_reject
    return Rejection(keep, seq_reject, mode_below, mode_above, rs_below, rs_above)
