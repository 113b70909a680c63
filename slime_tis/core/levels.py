"""Ratio levels and weight modes, one object each in :data:`LEVELS` and :data:`MODES` (docs/semantics.md, "Level",
"Mode"): a level carries ``L_u`` and its unit, a mode its weight ``w(r)``, ``r = exp(clamp(L, -B, B))``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

__all__ = ["Level", "Mode", "LEVELS", "MODES", "TOKEN", "SEQUENCE", "GEOMETRIC", "PREFIX", "PREFIX_MIN", "level_of",
           "mode_of",
           "DEFAULT_UPPER", "DEFAULT_GEOMETRIC_UPPER"]

#: Default upper bound on ``r``; the lower bound defaults to ``1 / upper``.
DEFAULT_UPPER = 2.0
#: Default upper bound of a rejecting geometric-mean level.
DEFAULT_GEOMETRIC_UPPER = 1.001


class _Named:
    """Equal to (and hashed as) its name too: ``plan.level == "token"``."""

    name: str

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return other == self.name
        return type(other) is type(self) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, eq=False)
class Level(_Named):
    """One ratio level: ``unit`` ``"token"`` or ``"sequence"`` (what one weight or rejection covers), ``log_ratio``
    the ``Ratios`` attribute holding ``L_u``, ``rejection_upper`` the default upper bound where it rejects,
    ``prefix`` ``"sum"`` / ``"min"`` for a prefix level (``core.prefix``)."""

    name: str
    unit: str
    log_ratio: str
    rejection_upper: float
    prefix: str | None = None

    @property
    def per_sequence(self) -> bool:
        """A unit is a whole sequence (one value per sequence, replicated over CP)."""
        return self.unit == "sequence"

    def of(self, ratios: Any) -> Tensor:
        """Unclamped ``L_u`` of a ``Ratios``: ``[T]`` or ``[n_seq]``, 0 off the domain."""
        return getattr(ratios, self.log_ratio)

    def domain(self, ratios: Any) -> Tensor:
        """The units' diagnostic domain: ``token_ok`` or ``seq_ok``."""
        return ratios.seq_ok if self.per_sequence else ratios.token_ok


@dataclass(frozen=True, eq=False)
class Mode(_Named):
    """One weight mode: ``weight(r, lower, upper) -> w`` (may write ``r`` in place), ``masks`` (units outside
    ``[lower, upper]`` are rejected), ``has_lower`` (the lower bound acts), ``formula`` ``w`` in words."""

    name: str
    weight: Callable[[Tensor, float, float], Tensor]
    masks: bool
    has_lower: bool
    formula: str

    def default_upper(self, level: Level) -> float:
        """The default upper bound on ``r`` at ``level``."""
        return level.rejection_upper if self.masks else DEFAULT_UPPER


TOKEN = Level("token", "token", "log_ratio", DEFAULT_UPPER)  # L_t = l_t
SEQUENCE = Level("sequence", "sequence", "seq_log_ratio_sum", DEFAULT_UPPER)  # L_i = sum_t l_t
GEOMETRIC = Level("geometric", "sequence", "seq_log_ratio_mean", DEFAULT_GEOMETRIC_UPPER)  # L_i = mean_t l_t
PREFIX = Level("prefix", "token", "prefix_sum_log_ratio", DEFAULT_UPPER, prefix="sum")  # L_t = sum_{s <= t} l_s
PREFIX_MIN = Level("prefix_min", "token", "prefix_min_log_ratio", DEFAULT_UPPER, prefix="min")  # min_{s <= t} l_s

#: Every level by name, in the order of the flag's choices.
LEVELS: dict[str, Level] = {level.name: level for level in (TOKEN, SEQUENCE, GEOMETRIC, PREFIX, PREFIX_MIN)}
#: Every mode by name, in the order of the flag's choices.
MODES: dict[str, Mode] = {mode.name: mode for mode in (
    # the weight writes r in place: r is the caller's own tensor
    Mode("truncate", lambda r, lo, hi: r.clamp_(max=hi), masks=False, has_lower=False, formula="w = min(r, upper)"),
    Mode("clip", lambda r, lo, hi: r.clamp_(min=lo, max=hi), masks=False, has_lower=True,
         formula="w = clamp(r, lower, upper)"),
    Mode("mask", lambda r, lo, hi: r, masks=True, has_lower=True,
         formula="w = r; units outside [lower, upper] rejected"),
)}


def level_of(level: Level | str) -> Level:
    """The :class:`Level` of a name (or the level itself)."""
    return level if isinstance(level, Level) else LEVELS[level]


def mode_of(mode: Mode | str) -> Mode:
    """The :class:`Mode` of a name (or the mode itself)."""
    return mode if isinstance(mode, Mode) else MODES[mode]
