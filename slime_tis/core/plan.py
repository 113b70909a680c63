"""``Plan``: the configuration resolved once into plain bounds and switches (what the hot path reads).

``TISConfig`` (``slime_tis.config``) is the validated, user-facing object; ``TISConfig.plan`` resolves
it to a :class:`Plan` once (cached per configuration). Every bound is stored in log space for the
tests ``L < log lower`` / ``L > log upper`` and linearly for the weight clamps. Algorithm 0 never
rejects (only non-finite data), so its rejection switches are resolved off, not tested later.

The core knows nothing of flags: a rejection rule's threshold reaches it as ``(name, value)`` in
``Plan.thresholds``, read by the rule's row in ``core.rules.RULES``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from slime_tis.core.levels import Level, Mode
from slime_tis.core.ratios import TokenPass

__all__ = ["Plan"]


@dataclass(frozen=True)
class Plan:
    """Resolved correction settings (all plain Python values).

    Attributes:
        algorithm: 0..3. weighted: importance weights multiply the loss (algorithms 2, 3).
        mode, level: weight mode and ratio level (``core.levels`` objects: formula, unit, default bounds) of the
            weights and of mask-mode rejection.
        lower, upper, log_lower, log_upper: the mode's bounds on r and their logs.
        mask: mask-mode rejection is on (mode "mask" and algorithm != 0).
        rs_level: rejection-sampling :class:`~slime_tis.core.levels.Level` or None; rs_log_lower, rs_log_upper:
            its log bounds.
        thresholds: ``(field, value)`` of every rejection threshold that is set (none in algorithm 0);
            read with :meth:`threshold`.
        batch_normalize, drop_rejected, loss_agg: loss switches.
        eps_low, eps_high, dual_clip_c: PPO clip. bound: the safety bound B.
        token_pass: the implementation of the correction's token pass (``core.ratios.TokenPass``), or ``None``:
            the torch code. The core names no kernel: ``TISConfig`` resolves ``--tis-kernels`` to it.
        surrogate: the policy-loss row of ``core.surrogates.SURROGATES``; surrogate_params: ``(field, value)`` of its
            options (read with :meth:`param`).
        kl_coef, kl_estimator, kl_importance_weighted, entropy_coef: the terms of ``core.terms``.
        target_ess: the auto truncation bound's target ESS (``--tis-upper-bound auto``), or ``None``: ``upper`` is
            given. While set, ``upper`` / ``log_upper`` are placeholders until ``core.search`` puts the searched bound
            (a 0-d tensor) in their place.
        sq_cut: M2PO's cut on ``(log r)^2`` (``core.search``): ``+inf`` (nothing rejected) until searched.
        staleness_buckets: ``N`` of the metrics split by staleness (``core.staleness``), 0 = off.
        staleness_decay: ``gamma`` of the mode's bounds tightened with staleness (``core.staleness``), or None.
        kl_gradient: ``"direct"`` or ``"with_score"``: the KL term's gradient (``core.terms``).
    """

    algorithm: int
    weighted: bool
    mode: Mode
    level: Level
    lower: float
    upper: float
    log_lower: float
    log_upper: float
    mask: bool
    rs_level: Level | None
    rs_log_lower: float
    rs_log_upper: float
    batch_normalize: bool
    drop_rejected: bool
    loss_agg: str
    eps_low: float
    eps_high: float
    dual_clip_c: float | None
    bound: float
    thresholds: tuple[tuple[str, float], ...] = ()
    token_pass: TokenPass | None = None
    surrogate: str = "ppo_clip"
    surrogate_params: tuple[tuple[str, float], ...] = ()
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_importance_weighted: bool = False
    entropy_coef: float = 0.0
    target_ess: float | None = None
    sq_cut: Any = math.inf
    staleness_buckets: int = 0
    staleness_decay: float | None = None
    kl_gradient: str = "direct"

    def threshold(self, field: str) -> float | None:
        """The value of the rejection threshold ``field`` (a ``TISConfig`` field name), or None when off."""
        return dict(self.thresholds).get(field)

    def param(self, field: str) -> float:
        """The value of the surrogate option ``field`` (a ``TISConfig`` field name)."""
        return dict(self.surrogate_params)[field]

    @property
    def per_sequence(self) -> bool:
        """Weights are per sequence (sequence or geometric level) rather than per token."""
        return self.level.per_sequence
