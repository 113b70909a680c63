"""Rejection rules and bound counters, declared once in :data:`RULES`.

Each row names a rule, the level of its units (a function of the :class:`~slime_tis.core.plan.Plan`;
``None`` = off), its test per unit, whether it rejects, the statistic it is averaged over, and for a
threshold rule the ``TISConfig`` field of its threshold (declared there with its flag, valid range,
help and start-up line; the row is off while the field is unset, and reads ``plan.threshold(field)``). The
core evaluates the table (:func:`evaluate`), the statistics count each row (``tis.<key>``) and the
metrics report ``tis/<metric> = count / denominator`` (``slime_tis.core.metrics``); adapters read the
same rows. A unit is a token at token level and a whole sequence at sequence/geometric level.

=====================  =========  ==========================================  =======  ===========
metric                 level      test (per unit)                             rejects  averaged over
=====================  =========  ==========================================  =======  ===========
nonfinite_seq_fraction sequence   NaN/inf at a valid token (always on)        yes      n_seq_valid
veto_seq_fraction      sequence   some valid token has l_t < log v            yes      n_seq
mask_fraction_low/high level      L < log lower / L > log upper (mask mode)   yes      n_units
rs_fraction_low/high   rs_level   L < log rs_lower / L > log rs_upper         yes      n_rs_units
seq_mean_k3_fraction   sequence   mean_t k3_t > threshold                     yes      n_seq
seq_max_k3_fraction    sequence   max_t k3_t > threshold                      yes      n_seq
truncate_fraction      level      L > log upper (truncate mode, weighted)     no       n_units
clip_fraction_low/high level      L < log lower / L > log upper (clip mode)   no       n_units
=====================  =========  ==========================================  =======  ===========

Every test is False outside its diagnostic domain: level log-ratios are 0 there and every pair of
bounds contains 1; per-sequence statistics are 0 there and k3 thresholds are > 0. Rejection never
changes a weight, only the keep mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from slime_tis.core.plan import Plan
from slime_tis.core.ratios import Ratios, TokenColumn, ratio_moments

__all__ = ["Rule", "RULES", "Verdict", "evaluate", "rule_columns"]


@dataclass(frozen=True)
class Rule:
    """One rule or bound counter (see the module table)."""

    metric: str
    key: str
    level: Callable[[Plan], str | None]
    test: Callable[[Plan, Ratios, str], Tensor]
    rejects: bool
    denominator: str
    column: Callable[[Plan], TokenColumn] | None = None  # a token column summed per sequence, read by test
    threshold: str | None = None  # the TISConfig field of its threshold (declared there); the row is off while unset


def _below(bound: str) -> Callable[[Plan, Ratios, str], Tensor]:
    return lambda p, r, lvl: r.level_log_ratio(lvl) < getattr(p, bound)


def _above(bound: str) -> Callable[[Plan, Ratios, str], Tensor]:
    return lambda p, r, lvl: r.level_log_ratio(lvl) > getattr(p, bound)


_sequence = lambda p: "sequence"  # noqa: E731
_mask = lambda p: p.level if p.mask else None  # noqa: E731
_truncate = lambda p: p.level if p.weighted and p.mode == "truncate" else None  # noqa: E731
_clip = lambda p: p.level if p.weighted and p.mode == "clip" else None  # noqa: E731

RULES: tuple[Rule, ...] = (
    Rule("tis/nonfinite_seq_fraction", "tis.n_seq_nonfinite", _sequence,
         lambda p, r, lvl: r.seq_nonfinite, True, "tis.n_seq_valid"),
    Rule("tis/veto_seq_fraction", "tis.veto_count", _sequence,
         lambda p, r, lvl: r.column("tis.veto_count") > 0, True, "tis.n_seq",
         column=lambda p: lambda log_r: log_r < math.log(p.threshold("veto_threshold")), threshold="veto_threshold"),
    Rule("tis/mask_fraction_low", "tis.mask_low_count", _mask, _below("log_lower"), True, "tis.n_units"),
    Rule("tis/mask_fraction_high", "tis.mask_high_count", _mask, _above("log_upper"), True, "tis.n_units"),
    Rule("tis/rs_fraction_low", "tis.rs_low_count", lambda p: p.rs_level, _below("rs_log_lower"), True,
         "tis.n_rs_units"),
    Rule("tis/rs_fraction_high", "tis.rs_high_count", lambda p: p.rs_level, _above("rs_log_upper"), True,
         "tis.n_rs_units"),
    Rule("tis/seq_mean_k3_fraction", "tis.seq_mean_k3_count", _sequence,
         lambda p, r, lvl: r.column_mean("tis.seq_mean_k3_count") > p.threshold("seq_mean_k3_threshold"), True,
         "tis.n_seq", column=lambda p: lambda log_r: ratio_moments(log_r, p.bound)[2],
         threshold="seq_mean_k3_threshold"),
    Rule("tis/seq_max_k3_fraction", "tis.seq_max_k3_count", _sequence,
         lambda p, r, lvl: r.column("tis.seq_max_k3_count") > 0, True, "tis.n_seq",
         column=lambda p: lambda log_r: ratio_moments(log_r, p.bound)[2] > p.threshold("seq_max_k3_threshold"),
         threshold="seq_max_k3_threshold"),
    Rule("tis/truncate_fraction", "tis.truncate_count", _truncate, _above("log_upper"), False, "tis.n_units"),
    Rule("tis/clip_fraction_low", "tis.clip_low_count", _clip, _below("log_lower"), False, "tis.n_units"),
    Rule("tis/clip_fraction_high", "tis.clip_high_count", _clip, _above("log_upper"), False, "tis.n_units"),
)


def active(plan: Plan) -> list[tuple[Rule, str]]:
    """The rows that are on for ``plan`` (level not None and threshold, if any, set), with their unit level."""
    return [(rule, level) for rule in RULES
            if (rule.threshold is None or plan.threshold(rule.threshold) is not None)
            and (level := rule.level(plan)) is not None]


def rule_columns(plan: Plan) -> dict[str, TokenColumn]:
    """Token columns the active rules need summed per sequence, named by the rule's key."""
    return {rule.key: rule.column(plan) for rule, _ in active(plan) if rule.column is not None}


@dataclass(frozen=True)
class Verdict:
    """Outcome of the table on one micro-batch.

    ``hits``: ``(rule, level, mask)`` per active row, mask ``[T]`` or ``[n_seq]`` bool.
    ``seq_rejected``: ``[n_seq]`` sequences rejected as a whole. ``token_rejected``: ``[T]`` tokens
    rejected by a token-level rule, or None. ``keep``: ``[T]`` valid tokens that survive every rule.
    """

    hits: list[tuple[Rule, str, Tensor]]
    seq_rejected: Tensor
    token_rejected: Tensor | None
    keep: Tensor

    def with_rejected_tokens(self, rejected: Tensor) -> Verdict:
        """The verdict with ``[T]`` bool ``rejected`` tokens rejected as well, as by a token-level rule
        (e.g. a host's own mask applied before the correction); weights and rows' hits are unchanged."""
        token = rejected if self.token_rejected is None else self.token_rejected | rejected
        return Verdict(self.hits, self.seq_rejected, token, self.keep & ~rejected)


def evaluate(plan: Plan, ratios: Ratios) -> Verdict:
    """Apply every active row of :data:`RULES`; ``keep_t = valid_t and no rejecting rule hits t or its sequence``."""
    hits = [(rule, level, rule.test(plan, ratios, level)) for rule, level in active(plan)]
    seq_rejected = torch.zeros_like(ratios.seq_ok)
    token_rejected: Tensor | None = None
    for rule, level, mask in hits:
        if not rule.rejects:
            continue
        if level == "token":
            token_rejected = mask if token_rejected is None else token_rejected | mask
        else:
            seq_rejected = seq_rejected | mask
    keep = (~seq_rejected).index_select(0, ratios.seq_id) & ratios.valid
    if token_rejected is not None:
        keep = keep & ~token_rejected
    return Verdict(hits, seq_rejected, token_rejected, keep)
