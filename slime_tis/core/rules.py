"""Rejection rules and bound counters, one row each in :data:`RULES` (docs/semantics.md, "Rejection"): metric, count
key, level of its units (``None``: off), test per unit (False outside its diagnostic domain), whether it rejects or
only counts, denominator, optional token column summed per sequence, threshold field (off while unset). Rejection
never changes a weight, only the keep mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor

from slime_tis.core.levels import MODES, SEQUENCE, TOKEN, Level
from slime_tis.core.plan import Plan
from slime_tis.core.ratios import Ratios, TokenColumn, ratio_moments
from slime_tis.core.search import M2PO_FIELD, cut_hits
from slime_tis.core.surrogates import bernoulli_kl

__all__ = ["Rule", "RULES", "NONFINITE", "Verdict", "evaluate", "rule_columns", "binary_kl"]


@dataclass(frozen=True)
class Rule:
    """One rule or bound counter (module docstring)."""

    metric: str
    key: str
    level: Callable[[Plan], Level | None]
    test: Callable[[Plan, Ratios, Level], Tensor]
    rejects: bool
    denominator: str
    column: Callable[[Plan], TokenColumn] | None = None  # a token column summed per sequence, read by test
    threshold: str | None = None  # the TISConfig field of its threshold; the row is off while unset
    doc: str = ""  # its metric in words (docs/reference.md)
    searched: bool = False  # its test reads a value searched over the global batch (``core.search``)

    @property
    def column_key(self) -> str:
        """Name of the row's per-sequence column (``Ratios.column``): ``tis.<name>_column``."""
        return self.key.removesuffix("_count") + "_column"


def _unit_scale(r: Ratios, lvl: Level) -> Tensor | float:
    """Per unit, the factor ``gamma^s`` of the mode's log bounds (``core.staleness``), or 1."""
    if r.bound_scale is None:
        return 1.0
    return r.bound_scale[1] if lvl.per_sequence else r.bound_scale[0]


def _below(bound: str, scaled: bool = False) -> Callable[[Plan, Ratios, Level], Tensor]:
    """``L_u < plan.<bound>`` (``scaled``: the mode's bound, tightened per unit with staleness)."""
    return lambda p, r, lvl: lvl.of(r) < getattr(p, bound) * (_unit_scale(r, lvl) if scaled else 1.0)


def _above(bound: str, scaled: bool = False) -> Callable[[Plan, Ratios, Level], Tensor]:
    return lambda p, r, lvl: lvl.of(r) > getattr(p, bound) * (_unit_scale(r, lvl) if scaled else 1.0)


def _counted_in(mode: str) -> Callable[[Plan], Level | None]:
    """The plan's level while its weights are on and of mode ``mode`` (a bound counter of that mode)."""
    row = MODES[mode]
    return lambda p: p.level if p.weighted and p.mode is row else None


_sequence = lambda p: SEQUENCE  # noqa: E731
_token = lambda p: TOKEN  # noqa: E731
_mask = lambda p: p.level if p.mask else None  # noqa: E731
_truncate = _counted_in("truncate")
_clip = _counted_in("clip")
#: The binary KL's probabilities are clamped to ``[eps, 1 - eps]`` (docs/semantics.md, "Binary KL").
BINARY_KL_EPS = 1e-6


def binary_kl(lp_train: Tensor, lp_rollout: Tensor) -> Tensor:
    """``[T]`` float64 ``max(D(p||q), D(q||p))`` of the Bernoulli distributions, ``p = exp(lp_train)``,
    ``q = exp(lp_rollout)`` (``surrogates.bernoulli_kl``)."""
    p, q = lp_train.double().exp(), lp_rollout.double().exp()
    return torch.maximum(bernoulli_kl(p, q, BINARY_KL_EPS), bernoulli_kl(q, p, BINARY_KL_EPS))


def _binary_kl_hit(p: Plan, r: Ratios, lvl: Level) -> Tensor:
    """Tokens whose binary KL exceeds ``phi`` (0 off the domain, where ``l = 0``)."""
    lp_rollout = r.lp_rollout.float()
    return binary_kl(lp_rollout + r.log_ratio, lp_rollout) > p.threshold("binary_kl_threshold")


#: Per-token divergences of verl's rejection options, by suffix (``k1`` is ``--tis-rs-level``), of
#: ``lc = clamp(l, -B, B)``: ``k2 = lc^2 / 2``, ``k3 = r - 1 - log r = expm1(lc) - lc``.
DIVERGENCES: dict[str, Callable[[Plan, Tensor], Tensor]] = {
    "k2": lambda plan, log_ratio: 0.5 * log_ratio.clamp(-plan.bound, plan.bound).square(),
    "k3": lambda plan, log_ratio: ratio_moments(log_ratio, plan.bound)[2],
}


def _divergence(option: str) -> Rule:
    """The row of verl's rejection option ``<statistic>_<k>``: reject the unit whose statistic of ``k_t``
    (:data:`DIVERGENCES`) exceeds the field ``<option>_threshold``: ``token`` ``k_t > t``; ``seq_sum`` / ``seq_mean``
    ``sum_t`` / ``mean_t k_t > t`` (column ``k_t``); ``seq_max`` ``sum_t 1[k_t > t] > 0`` (an indicator column)."""
    statistic, k = option.rsplit("_", 1)
    field, key, divergence = f"{option}_threshold", f"tis.{option}_count", DIVERGENCES[k]
    column_key = f"tis.{option}_column"
    metric = f"tis/{option}_fraction"
    flag = "--tis-" + field.replace("_", "-")
    if statistic == "token":
        return Rule(metric, key, _token, lambda p, r, lvl: divergence(p, r.log_ratio) > p.threshold(field), True,
                    "tis.n_tok", threshold=field, doc=f"with `{flag}`: tokens with `{k}_t > threshold` / tokens of `D`")
    doc = f"with `{flag}`: sequences with `{statistic.removeprefix('seq_')}_t {k}_t > threshold` / `abs(S)`"
    if statistic == "seq_max":
        return Rule(metric, key, _sequence, lambda p, r, lvl: r.column(column_key) > 0, True, "tis.n_seq",
                    column=lambda p: lambda log_r: divergence(p, log_r) > p.threshold(field), threshold=field, doc=doc)
    read = {"seq_sum": Ratios.column, "seq_mean": Ratios.column_mean}[statistic]
    return Rule(metric, key, _sequence, lambda p, r, lvl: read(r, column_key) > p.threshold(field), True, "tis.n_seq",
                column=lambda p: lambda log_r: divergence(p, log_r), threshold=field, doc=doc)


#: The always-on row: a sequence with a non-finite value at a valid token (the complement of the diagnostic domain).
NONFINITE = Rule("tis/nonfinite_seq_fraction", "tis.n_seq_nonfinite", _sequence,
                 lambda p, r, lvl: r.seq_nonfinite, True, "tis.n_seq_valid",
                 doc="sequences with a non-finite value / sequences with a valid token")

RULES: tuple[Rule, ...] = (
    NONFINITE,
    Rule("tis/veto_seq_fraction", "tis.veto_count", _sequence,
         lambda p, r, lvl: r.column("tis.veto_column") > 0, True, "tis.n_seq",
         column=lambda p: lambda log_r: log_r < math.log(p.threshold("veto_threshold")), threshold="veto_threshold",
         doc="with the veto `v`: sequences with a valid token whose `r_t < v` / `abs(S)`"),
    # the veto's token column (l_t < log v, computed once) on the diagnostic domain
    Rule("tis/catastrophic_token_fraction", "tis.catastrophic_token_count", _token,
         lambda p, r, lvl: r.token_columns["tis.veto_column"] & r.token_ok, False, "tis.n_tok",
         threshold="veto_threshold", doc="with the veto: valid tokens with raw ratio `r_t < v` / tokens of `D`"),
    Rule("tis/mask_fraction_low", "tis.mask_low_count", _mask, _below("log_lower", True), True, "tis.n_units",
         doc="units rejected with `L_u < log lower` / units (mask mode)"),
    Rule("tis/mask_fraction_high", "tis.mask_high_count", _mask, _above("log_upper", True), True, "tis.n_units",
         doc="units rejected with `L_u > log upper` / units (mask mode)"),
    Rule("tis/rs_fraction_low", "tis.rs_low_count", lambda p: p.rs_level, _below("rs_log_lower"), True,
         "tis.n_rs_units", doc="rejection-sampling units rejected below its lower bound / its units"),
    Rule("tis/rs_fraction_high", "tis.rs_high_count", lambda p: p.rs_level, _above("rs_log_upper"), True,
         "tis.n_rs_units", doc="rejection-sampling units rejected above its upper bound / its units"),
    _divergence("seq_mean_k3"),
    _divergence("seq_max_k3"),
    # the upper side of the veto (SkyRL's outlier_token_is_threshold_high) and its token counter
    Rule("tis/veto_upper_seq_fraction", "tis.veto_upper_count", _sequence,
         lambda p, r, lvl: r.column("tis.veto_upper_column") > 0, True, "tis.n_seq",
         column=lambda p: lambda log_r: log_r > math.log(p.threshold("veto_upper_threshold")),
         threshold="veto_upper_threshold", doc="with the upper veto `V`: sequences with a valid token whose "
         "`r_t > V` / `abs(S)`"),
    Rule("tis/catastrophic_upper_token_fraction", "tis.catastrophic_upper_token_count", _token,
         lambda p, r, lvl: r.token_columns["tis.veto_upper_column"] & r.token_ok, False, "tis.n_tok",
         threshold="veto_upper_threshold", doc="with the upper veto: valid tokens with raw ratio `r_t > V` / tokens "
         "of `D`"),
    Rule("tis/binary_kl_fraction", "tis.binary_kl_count", _token, _binary_kl_hit, True, "tis.n_tok",
         threshold="binary_kl_threshold", doc="with `--tis-binary-kl-threshold`: tokens whose Bernoulli KL between "
         "the token's probabilities `p`, `q`, either way, exceeds `phi` / tokens of `D`"),
    Rule("tis/seq_logprob_error_fraction", "tis.seq_logprob_error_count", _sequence,
         lambda p, r, lvl: 1.0 + r.column_mean("tis.seq_logprob_error_column") > p.threshold(
             "seq_logprob_error_threshold"), True, "tis.n_seq",
         column=lambda p: lambda log_r: torch.expm1(log_r.abs().clamp(max=p.bound)),
         threshold="seq_logprob_error_threshold", doc="with `--tis-seq-logprob-error-threshold`: sequences with "
         "`mean_t exp(abs(l_t)) > threshold` / `abs(S)`"),
    _divergence("token_k2"),
    _divergence("token_k3"),
    _divergence("seq_sum_k2"),
    _divergence("seq_sum_k3"),
    _divergence("seq_mean_k2"),
    _divergence("seq_max_k2"),
    # M2PO (core.search): tokens whose clamped (log r)^2 exceeds the globally searched cut
    Rule("tis/m2po_fraction", "tis.m2po_count", _token, lambda p, r, lvl: cut_hits(p, r.log_ratio), True,
         "tis.n_tok", threshold=M2PO_FIELD, searched=True,
         doc="with `--tis-m2po-threshold tau`: tokens with `lc_t^2 >` the searched cut (the largest `s` whose kept "
             "tokens `lc^2 <= s` have mean `lc^2 <= tau` over the global batch) / tokens of `D`"),
    Rule("tis/truncate_fraction", "tis.truncate_count", _truncate, _above("log_upper", True), False, "tis.n_units",
         doc="units with `L_u > log upper` / units (truncate mode)"),
    Rule("tis/clip_fraction_low", "tis.clip_low_count", _clip, _below("log_lower", True), False, "tis.n_units",
         doc="units with `L_u < log lower` / units (clip mode)"),
    Rule("tis/clip_fraction_high", "tis.clip_high_count", _clip, _above("log_upper", True), False, "tis.n_units",
         doc="units with `L_u > log upper` / units (clip mode)"),
)


def active(plan: Plan) -> list[tuple[Rule, Level]]:
    """The rows on for ``plan`` (level not None, threshold if any set), with their unit level."""
    return [(rule, level) for rule in RULES
            if (rule.threshold is None or plan.threshold(rule.threshold) is not None)
            and (level := rule.level(plan)) is not None]


def late(rule: Rule, level: Level) -> bool:
    """A token-level row whose test cannot run in the token pass (a searched value, a prefix level's carry)."""
    return rule.searched or level.prefix is not None


#: Column of the tokens hit by a token-level rejecting row (present while one is active), summed per sequence.
TOKEN_REJECTIONS = "tis.token_rejections"


def rule_columns(plan: Plan, lp_rollout: Tensor | None = None,
                 bound_scale: tuple[Tensor, Tensor] | None = None) -> dict[str, TokenColumn]:
    """Token columns the active rules need summed per sequence (by ``column_key``), plus :data:`TOKEN_REJECTIONS`
    while a token-level rejecting row is active."""
    rows = active(plan)
    columns = {rule.column_key: rule.column(plan) for rule, _ in rows if rule.column is not None}
    token_rows = [rule for rule, level in rows if rule.rejects and not level.per_sequence and not late(rule, level)]
    if token_rows:
        def token_rejections(log_r: Tensor) -> Tensor:
            view = SimpleNamespace(log_ratio=log_r, lp_rollout=lp_rollout, bound_scale=bound_scale)  # a row's inputs
            hit = torch.zeros_like(log_r, dtype=torch.bool)
            for rule in token_rows:
                hit = hit | rule.test(plan, view, TOKEN)
            return hit

        columns[TOKEN_REJECTIONS] = token_rejections
    return columns


@dataclass(frozen=True)
class Verdict:
    """Outcome of the table on one micro-batch: ``hits`` ``(rule, level, [T] or [n_seq] bool)`` per active row;
    ``seq_rejected`` ``[n_seq]``; ``token_rejected`` ``[T]`` or None; ``keep`` ``[T]`` valid tokens no rule rejects;
    ``seq_masked`` ``[n_seq]`` sequences with a token rejected by a rule (complete over CP)."""

    hits: list[tuple[Rule, Level, Tensor]]
    seq_rejected: Tensor
    token_rejected: Tensor | None
    keep: Tensor
    seq_masked: Tensor

    def with_rejected_tokens(self, rejected: Tensor) -> Verdict:
        """The verdict with ``[T]`` bool ``rejected`` tokens rejected as by a token-level rule (hits unchanged)."""
        token = rejected if self.token_rejected is None else self.token_rejected | rejected
        return Verdict(self.hits, self.seq_rejected, token, self.keep & ~rejected, self.seq_masked)


def evaluate(plan: Plan, ratios: Ratios) -> Verdict:
    """Apply every active row: ``keep_t = valid_t and no rejecting row hits t or its sequence`` (``keep`` starts
    from ``token_ok``: :data:`NONFINITE` rejects exactly the sequences outside it)."""
    hits = [(rule, level, rule.test(plan, ratios, level)) for rule, level in active(plan)]
    seq_rejected = torch.zeros_like(ratios.seq_ok)
    beyond_domain: Tensor | None = None  # sequences rejected by a row other than NONFINITE
    token_rejected: Tensor | None = None
    for rule, level, mask in hits:
        if not rule.rejects:
            continue
        if not level.per_sequence:
            token_rejected = mask if token_rejected is None else token_rejected | mask
        else:
            seq_rejected = seq_rejected | mask
            if rule is not NONFINITE:
                beyond_domain = mask if beyond_domain is None else beyond_domain | mask
    keep = ratios.token_ok
    if beyond_domain is not None:
        keep = keep & ~beyond_domain.index_select(0, ratios.seq_id)
    seq_masked = seq_rejected
    if token_rejected is not None:
        keep = keep & ~token_rejected
        if TOKEN_REJECTIONS in ratios.columns:  # absent where only a searched row rejects tokens
            seq_masked = seq_rejected | (ratios.column(TOKEN_REJECTIONS) > 0)
    return Verdict(hits, seq_rejected, token_rejected, keep, seq_masked)
