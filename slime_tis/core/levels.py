"""Ratio levels and weight modes, declared once in :data:`LEVELS` and :data:`MODES`.

A level says which log-ratio ``L_u`` a unit carries and what a unit is; a mode says how the weight is made from
``r = exp(clamp(L, -B, B))`` and whether units outside the bounds are rejected. Each object carries its own
formula, unit and default bounds, so the core asks the object instead of branching on a name. Users and flags
keep the names (``--tis-level geometric``, ``TISConfig(mode="mask")``); ``TISConfig.plan`` resolves them once.

=========  ==========================  ========  ===============================================
level      log-ratio ``L_u``           unit      default upper bound where it rejects (mask, RS)
=========  ==========================  ========  ===============================================
token      ``l_t``                     token     2.0
sequence   ``sum_{t in i} l_t``        sequence  2.0
geometric  ``mean_{t in i} l_t``       sequence  1.001
prefix     ``sum_{s <= t in i} l_s``   token     2.0   (CTPO: the cumulative prefix product)
prefix_min ``min_{s <= t in i} l_s``   token     2.0   (MinPRO: the prefix's smallest token ratio)
=========  ==========================  ========  ===============================================

The prefix levels read the sequence's earlier tokens: ``core.prefix`` computes them (with a carry across context
parallel ranks from each token's chunk index).

=========  ==============================  =======  =========  ====================
mode       weight ``w``                    rejects  has lower  default upper bound
=========  ==============================  =======  =========  ====================
truncate   ``min(r, upper)``               no       no         2.0
clip       ``clamp(r, lower, upper)``      no       yes        2.0
mask       ``r`` (outside: rejected)       yes      yes        the level's rejecting bound
=========  ==============================  =======  =========  ====================

Unset lower bounds default to ``1 / upper``.
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
#: Default upper bound of a rejecting geometric-mean level (a geometric mean of ratios stays near 1).
DEFAULT_GEOMETRIC_UPPER = 1.001


class _Named:
    """Equal to its name as well (``plan.level == "token"``: users and host code may hold the name); hashed by it."""

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
    """One ratio level (a row of the module's level table).

    Attributes:
        name: the user-facing name (``--tis-level`` / ``--tis-rs-level`` value).
        unit: ``"token"`` or ``"sequence"``: what one weight or one rejection covers.
        log_ratio: the ``core.ratios.Ratios`` attribute holding ``L_u`` (``[T]`` or ``[n_seq]``, 0 off the domain).
        formula: ``L_u`` in words (docs).
        rejection_upper: the default upper bound on ``r`` where units of this level are rejected.
        prefix: ``"sum"`` / ``"min"`` for a prefix level (``core.prefix``), else ``None``.
    """

    name: str
    unit: str
    log_ratio: str
    formula: str
    rejection_upper: float
    prefix: str | None = None

    @property
    def per_sequence(self) -> bool:
        """A unit is a whole sequence (one value per sequence, replicated over context parallelism)."""
        return self.unit == "sequence"

    def of(self, ratios: Any) -> Tensor:
        """Unclamped ``L_u`` of a ``Ratios``: ``[T]`` at token unit, ``[n_seq]`` otherwise; 0 off the domain."""
        return getattr(ratios, self.log_ratio)

    def domain(self, ratios: Any) -> Tensor:
        """The diagnostic domain of the units of a ``Ratios``: ``token_ok`` or ``seq_ok``."""
        return ratios.seq_ok if self.per_sequence else ratios.token_ok


def _truncate(r: Tensor, lower: float, upper: float) -> Tensor:
    return r.clamp_(max=upper)  # in place: r is the caller's own tensor


def _clip(r: Tensor, lower: float, upper: float) -> Tensor:
    return r.clamp_(min=lower, max=upper)


def _mask(r: Tensor, lower: float, upper: float) -> Tensor:
    return r


@dataclass(frozen=True, eq=False)
class Mode(_Named):
    """One weight mode (a row of the module's mode table).

    Attributes:
        name: the user-facing name (``--tis-mode`` value).
        weight: ``(r, lower, upper) -> w`` (may write ``r`` in place).
        masks: units outside ``[lower, upper]`` are rejected (mask-mode rejection).
        has_lower: the lower bound acts (truncate has none).
        formula: ``w`` in words (docs).
    """

    name: str
    weight: Callable[[Tensor, float, float], Tensor]
    masks: bool
    has_lower: bool
    formula: str

    def default_upper(self, level: Level) -> float:
        """The default upper bound on ``r`` at ``level``: the level's rejecting bound if this mode rejects."""
        return level.rejection_upper if self.masks else DEFAULT_UPPER


TOKEN = Level("token", "token", "log_ratio", "L_t = l_t", DEFAULT_UPPER)
SEQUENCE = Level("sequence", "sequence", "seq_log_ratio_sum", "L_i = sum_t l_t", DEFAULT_UPPER)
GEOMETRIC = Level("geometric", "sequence", "seq_log_ratio_mean", "L_i = mean_t l_t", DEFAULT_GEOMETRIC_UPPER)
PREFIX = Level("prefix", "token", "prefix_sum_log_ratio", "L_t = sum_{s <= t} l_s", DEFAULT_UPPER, prefix="sum")
PREFIX_MIN = Level("prefix_min", "token", "prefix_min_log_ratio", "L_t = min_{s <= t} l_s", DEFAULT_UPPER,
                   prefix="min")

#: Every level by name, in the order of the flag's choices.
LEVELS: dict[str, Level] = {level.name: level for level in (TOKEN, SEQUENCE, GEOMETRIC, PREFIX, PREFIX_MIN)}
#: Every mode by name, in the order of the flag's choices.
MODES: dict[str, Mode] = {mode.name: mode for mode in (
    Mode("truncate", _truncate, masks=False, has_lower=False, formula="w = min(r, upper)"),
    Mode("clip", _clip, masks=False, has_lower=True, formula="w = clamp(r, lower, upper)"),
    Mode("mask", _mask, masks=True, has_lower=True, formula="w = r; units outside [lower, upper] rejected"),
)}


def level_of(level: Level | str) -> Level:
    """The :class:`Level` of a name (or the level itself)."""
    return level if isinstance(level, Level) else LEVELS[level]


def mode_of(mode: Mode | str) -> Mode:
    """The :class:`Mode` of a name (or the mode itself)."""
    return mode if isinstance(mode, Mode) else MODES[mode]
