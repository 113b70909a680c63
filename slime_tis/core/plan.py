"""``Plan``: the configuration resolved once into plain bounds and switches (what the hot path reads).

``TISConfig`` (``slime_tis.config``) is the validated, user-facing object; ``TISConfig.plan`` resolves
it to a :class:`Plan` once (cached per configuration). Every bound is stored in log space for the
tests ``L < log lower`` / ``L > log upper`` and linearly for the weight clamps. Algorithm 0 never
rejects (only non-finite data), so its rejection switches are resolved off here, not tested later.

A rejection rule's threshold is declared once, on its ``TISConfig`` field, with :func:`threshold` (flag,
valid range, help, ``describe()`` wording); the flag, the validation, the start-up line and
``Plan.thresholds`` are generated from that declaration, and the rule's row in ``core.rules.RULES`` names
the field. A new threshold-style rule therefore touches ``core/rules.py`` and ``config.py`` only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = ["Plan", "Threshold", "threshold", "declared_thresholds", "resolve"]

#: Valid ranges of a threshold: the test and the words of the error message.
RANGES = {
    "> 0": (lambda v: v > 0, "must be > 0"),
    "in (0, 1)": (lambda v: 0 < v < 1, "must lie in (0, 1)"),
}


@dataclass(frozen=True)
class Threshold:
    """Declaration of a rejection rule's threshold (the metadata of one ``TISConfig`` field).

    Attributes:
        flag: command-line flag (its argparse dest is the flag without ``--``, ``-`` -> ``_``).
        valid: key of :data:`RANGES` (``"> 0"`` or ``"in (0, 1)"``).
        help: argparse help, ending with the default ("Default: off.").
        describe: the ``TISConfig.describe()`` line, ``{value:g}`` is the threshold.
        why: optional reason appended to the error message.
        aliases: other argparse dests a host may use for the same value.
    """

    flag: str
    valid: str
    help: str
    describe: str
    why: str = ""
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.valid not in RANGES:
            raise ValueError(f"Threshold {self.flag}: valid = {self.valid!r}: must be one of {', '.join(RANGES)}")

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def problem(self, value: float) -> str | None:
        """The error text for an out-of-range ``value``, or None when it is valid."""
        ok, words = RANGES[self.valid]
        if ok(value):
            return None
        return words + (f" ({self.why})" if self.why else "")


def threshold(**declaration: Any) -> Any:
    """A ``TISConfig`` field ``float | None = None`` (None = rule off) carrying a :class:`Threshold`."""
    return dataclasses.field(default=None, metadata={"threshold": Threshold(**declaration)})


def declared_thresholds(config: Any) -> dict[str, Threshold]:
    """``{field name: Threshold}`` of a ``TISConfig`` class or instance, in field order."""
    return {f.name: f.metadata["threshold"] for f in dataclasses.fields(config) if "threshold" in f.metadata}


@dataclass(frozen=True)
class Plan:
    """Resolved correction settings (all plain Python values).

    Attributes:
        algorithm: 0..3. weighted: importance weights multiply the loss (algorithms 2, 3).
        mode, level: weight mode and ratio level of the weights and of mask-mode rejection.
        lower, upper, log_lower, log_upper: the mode's bounds on r and their logs.
        mask: mask-mode rejection is on (mode "mask" and algorithm != 0).
        rs_level: rejection-sampling level or None; rs_log_lower, rs_log_upper: its log bounds.
        thresholds: ``(field, value)`` of every rejection threshold that is set (none in algorithm 0);
            read with :meth:`threshold`.
        batch_normalize, drop_rejected, loss_agg: loss switches.
        eps_low, eps_high, dual_clip_c: PPO clip. bound: the safety bound B.
        kernels: ``"torch"`` or ``"triton"``: which code computes the token pass (``slime_tis.kernels.dispatch``).
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
    batch_normalize: bool
    drop_rejected: bool
    loss_agg: str
    eps_low: float
    eps_high: float
    dual_clip_c: float | None
    bound: float
    thresholds: tuple[tuple[str, float], ...] = ()
    kernels: str = "torch"

    def threshold(self, field: str) -> float | None:
        """The value of the rejection threshold ``field`` (a ``TISConfig`` field name), or None when off."""
        return dict(self.thresholds).get(field)

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
        batch_normalize=config.batch_normalize,
        drop_rejected=config.rejected_denominator == "drop",
        loss_agg=config.loss_agg,
        eps_low=float(config.eps_clip),
        eps_high=config.eps_high,
        dual_clip_c=None if config.dual_clip_c is None else float(config.dual_clip_c),
        bound=float(config.safety_bound),
        thresholds=tuple((name, float(getattr(config, name))) for name in declared_thresholds(config)
                         if rejecting and getattr(config, name) is not None),
        kernels=config.kernels,
    )
