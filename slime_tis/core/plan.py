"""``Plan``: a ``TISConfig`` resolved once into plain bounds (linear and log) and switches, what the hot path reads;
algorithm 0's rejection switches resolved off; thresholds as ``(field, value)``.
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
    """Resolved correction settings (plain Python values; ``TISConfig`` fields resolved by ``TISConfig.plan``).

    ``mode``, ``level``, ``rs_level``: ``core.levels`` objects (``rs_level`` ``None``: off). ``mask``: mask-mode
    rejection is on (mode mask, algorithm != 0). ``thresholds``, ``surrogate_params``: ``(field, value)`` of the set
    rejection thresholds (none in algorithm 0) and the chosen surrogate's options. ``token_pass``: another
    implementation of the token pass (``core.ratios.TokenPass``) or ``None``: the torch code. ``target_ess``: the
    auto bound's target, or ``None``; while set, ``upper`` / ``log_upper`` are placeholders until ``core.search``
    puts the searched 0-d tensor there, as ``sq_cut`` (M2PO's cut, ``+inf`` until searched). ``staleness_buckets``:
    0 = off.
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
        """The value of the rejection threshold ``field`` (a ``TISConfig`` field), or None when off."""
        return dict(self.thresholds).get(field)

    def param(self, field: str) -> float:
        """The value of the surrogate option ``field`` (a ``TISConfig`` field name)."""
        return dict(self.surrogate_params)[field]

    @property
    def per_sequence(self) -> bool:
        """Weights are per sequence (sequence or geometric level)."""
        return self.level.per_sequence
