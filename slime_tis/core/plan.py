"""``Plan``: the configuration resolved once into plain bounds and switches (what the hot path reads).

``TISConfig`` (``slime_tis.config``) is the validated, user-facing object; ``TISConfig.plan`` resolves
it to a :class:`Plan` once (cached per configuration). Every bound is stored in log space for the
tests ``L < log lower`` / ``L > log upper`` and linearly for the weight clamps. Algorithm 0 never
rejects (only non-finite data), so its rejection switches are resolved off here, not tested later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = ["Plan", "resolve"]


@dataclass(frozen=True)
class Plan:
    """Resolved correction settings (all plain Python values).

    Attributes:
        algorithm: 0..3. weighted: importance weights multiply the loss (algorithms 2, 3).
        mode, level: weight mode and ratio level of the weights and of mask-mode rejection.
        lower, upper, log_lower, log_upper: the mode's bounds on r and their logs.
        mask: mask-mode rejection is on (mode "mask" and algorithm != 0).
        rs_level: rejection-sampling level or None; rs_log_lower, rs_log_upper: its log bounds.
        log_veto: log of the veto threshold, or None.
        seq_mean_k3, seq_max_k3: k3 rejection thresholds, or None.
        batch_normalize, drop_rejected, loss_agg: loss switches.
        eps_low, eps_high, dual_clip_c: PPO clip. bound: the safety bound B.
    """

    algorithm: int
    weighted: bool
    mode: str
    level: str
    lower: float
    upper: float
    log_lower: float
    log_upper: float
    mask: bool
    rs_level: str | None
    rs_log_lower: float
    rs_log_upper: float
    log_veto: float | None
    seq_mean_k3: float | None
    seq_max_k3: float | None
    batch_normalize: bool
    drop_rejected: bool
    loss_agg: str
    eps_low: float
    eps_high: float
    dual_clip_c: float | None
    bound: float

    @property
    def per_sequence(self) -> bool:
        """Weights are per sequence (sequence or geometric level) rather than per token."""
        return self.level != "token"


@lru_cache(maxsize=64)
def resolve(config: Any) -> Plan:
    """The :class:`Plan` of a validated ``TISConfig`` (hashable, frozen; cached)."""
    rejecting = config.algorithm != 0
    rs_level = config.rs_level if rejecting else None
    return Plan(
        algorithm=config.algorithm,
        weighted=config.applies_weights,
        mode=config.mode,
        level=config.level,
        lower=config.lower_bound,
        upper=config.upper_bound,
        log_lower=math.log(config.lower_bound),
        log_upper=math.log(config.upper_bound),
        mask=config.mode == "mask" and rejecting,
        rs_level=rs_level,
        rs_log_lower=math.log(config.rs_lower_bound) if rs_level else 0.0,
        rs_log_upper=math.log(config.rs_upper_bound) if rs_level else 0.0,
        log_veto=math.log(config.veto_threshold) if rejecting and config.veto_threshold is not None else None,
        seq_mean_k3=config.seq_mean_k3_threshold if rejecting else None,
        seq_max_k3=config.seq_max_k3_threshold if rejecting else None,
        batch_normalize=config.batch_normalize,
        drop_rejected=config.rejected_denominator == "drop",
        loss_agg=config.loss_agg,
        eps_low=float(config.eps_clip),
        eps_high=config.eps_high,
        dual_clip_c=None if config.dual_clip_c is None else float(config.dual_clip_c),
        bound=float(config.safety_bound),
    )
