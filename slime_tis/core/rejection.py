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

__all__ = ["Rejection", "find_rejections", "sequence_rejections", "token_rejections"]


@dataclass
class Rejection:
    """Rejection masks of one micro-batch.

    ``keep``: ``[T]`` bool, valid tokens that survive every rule. ``seq_rejected``: ``[n_seq]`` bool,
    sequences rejected as a whole (non-finite, veto, or a sequence/geometric-level rule).
    ``token_rejected``: ``[T]`` bool tokens rejected by a token-level rule, or ``None`` without one.
    ``mode_below/above`` and ``rs_below/above`` are per-unit masks (``[T]`` or ``[n_seq]``) restricted
    to the diagnostic domain, or ``None`` when the rule is off.
    """

    keep: Tensor
    seq_rejected: Tensor
    mode_below: Tensor | None
    mode_above: Tensor | None
    rs_below: Tensor | None
    rs_above: Tensor | None
    token_rejected: Tensor | None = None


def find_rejections(config: TISConfig, ratios: PackedRatios) -> Rejection:
    """Apply every configured rejection rule to ``ratios`` (see module docstring)."""
    rejection = sequence_rejections(config, ratios)
    token_rejections(config, ratios.log_ratio, rejection)
    keep = ratios.valid & ~ratios.segments.expand(rejection.seq_rejected)
    rejection.keep = keep if rejection.token_rejected is None else keep & ~rejection.token_rejected
    return rejection


def sequence_rejections(config: TISConfig, ratios: PackedRatios) -> Rejection:
    """The sequence-level rules (non-finite, veto, sequence/geometric mode and rejection sampling).

    Returns a :class:`Rejection` whose ``keep`` is still unset (an empty tensor) and whose
    token-level fields are filled by :func:`token_rejections`.

    Unit masks need no restriction to the diagnostic domain: ``ratios.level_log_ratio`` is 0 outside
    it and every pair of bounds contains 1 (``lower <= 1 <= upper``), so ``L = 0`` is never outside them.
    """
    seq_reject = ratios.seq_nonfinite | ratios.seq_veto
    out = Rejection(seq_reject.new_empty(0), seq_reject, None, None, None, None)
    if config.mode == "mask" and config.algorithm != 0 and config.level != "token":
        out.mode_below, out.mode_above = outside_bounds(
            ratios.level_log_ratio(config.level), config.lower_bound, config.upper_bound
        )
        seq_reject = seq_reject | out.mode_below | out.mode_above
    if config.rs_level is not None and config.rs_level != "token":
        out.rs_below, out.rs_above = outside_bounds(
            ratios.level_log_ratio(config.rs_level), config.rs_lower_bound, config.rs_upper_bound
        )
        seq_reject = seq_reject | out.rs_below | out.rs_above
    out.seq_rejected = seq_reject
    return out


def token_rejections(config: TISConfig, log_ratio: Tensor, rejection: Rejection) -> None:
    """The token-level rules on ``log_ratio`` (``[T]``, 0 outside the token domain), into ``rejection``."""
    if config.mode == "mask" and config.algorithm != 0 and config.level == "token":
        rejection.mode_below, rejection.mode_above = outside_bounds(log_ratio, config.lower_bound, config.upper_bound)
        rejection.token_rejected = rejection.mode_below | rejection.mode_above
    if config.rs_level == "token":
        rejection.rs_below, rejection.rs_above = outside_bounds(log_ratio, config.rs_lower_bound, config.rs_upper_bound)
        rs_reject = rejection.rs_below | rejection.rs_above
        token = rejection.token_rejected
        rejection.token_rejected = rs_reject if token is None else token | rs_reject
