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
catastrophic_token_    token      l_t < log v (the tokens the veto tests)      no       n_tok
fraction
veto_upper_seq_        sequence   some valid token has l_t > log V            yes      n_seq
fraction
catastrophic_upper_    token      l_t > log V (the tokens it tests)           no       n_tok
token_fraction
binary_kl_fraction     token      max(D(p||q), D(q||p)) > phi (p, q: token    yes      n_tok
                                  probabilities of pi_train, pi_rollout)
seq_logprob_error_     sequence   mean_t exp(abs(l_t)) > threshold            yes      n_seq
fraction
mask_fraction_low/high level      L < log lower / L > log upper (mask mode)   yes      n_units
rs_fraction_low/high   rs_level   L < log rs_lower / L > log rs_upper         yes      n_rs_units
<option>_fraction      token      k_t > threshold (``token_k2/k3``)           yes      n_tok
<option>_fraction      sequence   sum_t / mean_t / max_t k_t > threshold      yes      n_seq
                                  (``seq_sum_*``, ``seq_mean_*``, ``seq_max_*``)
m2po_fraction          token      lc_t^2 > searched cut (``core.search``)     yes      n_tok
truncate_fraction      level      L > log upper (truncate mode, weighted)     no       n_units
clip_fraction_low/high level      L < log lower / L > log upper (clip mode)   no       n_units
=====================  =========  ==========================================  =======  ===========

The ``<option>`` rows are verl's rejection options of the same names (:func:`_divergence`), with the per-token
divergences ``k2 = (log r)^2 / 2`` and ``k3 = r - 1 - log r`` of the clamped log-ratio (:data:`DIVERGENCES`);
verl's ``k1`` options are ``rs_level`` token / sequence / geometric (``token_k1``, ``seq_sum_k1``,
``seq_mean_k1``), whose bounds are stated on ``r`` here (verl's ``"lo_hi"`` keeps ``1/hi <= r <= 1/lo``).

The binary KL (KPop) treats the vocabulary as two events, the sampled token and every other one:
``D(p||q) = p log(p/q) + (1-p) log((1-p)/(1-q))`` with ``p = pi_train(token)``, ``q = pi_rollout(token)`` clamped to
``[1e-6, 1 - 1e-6]``, in float64 (:func:`binary_kl`). The sequence log-prob error is NeMo-RL's
``seq_logprob_error_threshold``: column ``expm1(min(abs(l_t), B))``, so that the test reads ``1 + mean > t``.
With the bounds tightened by staleness (``core.staleness``), the mode's rows (mask, truncate, clip) compare ``L``
with its unit's log bounds times ``gamma^s`` (``Ratios.bound_scale``).

Every test is False outside its diagnostic domain: level log-ratios are 0 there and every pair of
bounds contains 1; per-sequence statistics and divergences are 0 there and their thresholds are > 0
(the log-prob error's ``>= 1``, its value at ``l = 0``). Rejection never
changes a weight, only the keep mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from slime_tis.core.levels import MODES, SEQUENCE, TOKEN, Level
from slime_tis.core.plan import Plan
from slime_tis.core.ratios import Ratios, TokenColumn, ratio_moments
from slime_tis.core.search import M2PO_FIELD, cut_hits
from slime_tis.core.token_select import bernoulli_kl

__all__ = ["Rule", "RULES", "NONFINITE", "Verdict", "evaluate", "rule_columns", "binary_kl"]


@dataclass(frozen=True)
class Rule:
    """One rule or bound counter (see the module table)."""

    metric: str
    key: str
    level: Callable[[Plan], Level | None]
    test: Callable[[Plan, Ratios, Level], Tensor]
    rejects: bool
    denominator: str
    column: Callable[[Plan], TokenColumn] | None = None  # a token column summed per sequence, read by test
    threshold: str | None = None  # the TISConfig field of its threshold (declared there); the row is off while unset
    doc: str = ""  # its metric in words (docs/reference.md's metric table, ``core.metric_schema``)
    searched: bool = False  # its test reads a value searched over the global batch (``core.search``): no column

    @property
    def column_key(self) -> str:
        """Name of the row's per-sequence column (``Ratios.column``): ``tis.<name>_column``, apart from the count
        ``key`` it feeds, since a column may hold a sum of divergences rather than a count."""
        return self.key.removesuffix("_count") + "_column"


def _unit_scale(r: Ratios, lvl: Level) -> Tensor | float:
    """Per unit, the factor of the mode's log bounds (``core.staleness``: ``gamma^s``), 1 without tightening."""
    if r.bound_scale is None:
        return 1.0
    return r.bound_scale[1] if lvl.per_sequence else r.bound_scale[0]


def _below(bound: str, scaled: bool = False) -> Callable[[Plan, Ratios, Level], Tensor]:
    if scaled:  # the mode's bound, tightened per unit with staleness
        return lambda p, r, lvl: lvl.of(r) < getattr(p, bound) * _unit_scale(r, lvl)
    return lambda p, r, lvl: lvl.of(r) < getattr(p, bound)


def _above(bound: str, scaled: bool = False) -> Callable[[Plan, Ratios, Level], Tensor]:
    if scaled:
        return lambda p, r, lvl: lvl.of(r) > getattr(p, bound) * _unit_scale(r, lvl)
    return lambda p, r, lvl: lvl.of(r) > getattr(p, bound)


def _counted_in(mode: str) -> Callable[[Plan], Level | None]:
    """The plan's level while its weights are on and of mode ``mode`` (a bound counter of that mode)."""
    row = MODES[mode]
    return lambda p: p.level if p.weighted and p.mode is row else None


_sequence = lambda p: SEQUENCE  # noqa: E731
_token = lambda p: TOKEN  # noqa: E731
_mask = lambda p: p.level if p.mask else None  # noqa: E731
_truncate = _counted_in("truncate")
_clip = _counted_in("clip")

def _k2(plan: Plan, log_ratio: Tensor) -> Tensor:
    """``k2 = (log r)^2 / 2`` of the clamped log-ratio ``lc = clamp(l, -B, B)`` (verl's ``token_k2``)."""
    return 0.5 * log_ratio.clamp(-plan.bound, plan.bound).square()


def _k3(plan: Plan, log_ratio: Tensor) -> Tensor:
    """``k3 = r - 1 - log r = expm1(lc) - lc`` (verl's ``token_k3``; exact near ``r = 1``, never negative)."""
    return ratio_moments(log_ratio, plan.bound)[2]


#: Probabilities are clamped to ``[BINARY_KL_EPS, 1 - BINARY_KL_EPS]`` before the binary KL (prime-rl #3283's value):
#: a token whose log-prob rounds to 0 would otherwise have an infinite divergence against any other probability.
BINARY_KL_EPS = 1e-6


def binary_kl(lp_train: Tensor, lp_rollout: Tensor) -> Tensor:
    """``[T]`` float64 ``max(D(p||q), D(q||p))`` of the Bernoulli distributions (sampled token, any other token),
    ``p = exp(lp_train)``, ``q = exp(lp_rollout)`` clamped to ``[eps, 1 - eps]``,
    ``D(p||q) = p (log p - log q) + (1 - p) (log(1 - p) - log(1 - q))``."""
    p, q = lp_train.double().exp(), lp_rollout.double().exp()
    return torch.maximum(bernoulli_kl(p, q, BINARY_KL_EPS), bernoulli_kl(q, p, BINARY_KL_EPS))


def _binary_kl_hit(p: Plan, r: Ratios, lvl: Level) -> Tensor:
    """Tokens whose binary KL exceeds ``phi`` (``l = 0`` off the domain: ``p = q``, divergence 0)."""
    lp_rollout = r.lp_rollout.float()
    return binary_kl(lp_rollout + r.log_ratio, lp_rollout) > p.threshold("binary_kl_threshold")


#: Per-token divergences of verl's rejection options, by suffix (``k1`` is ``--tis-rs-level``, bounds on r).
DIVERGENCES: dict[str, Callable[[Plan, Tensor], Tensor]] = {"k2": _k2, "k3": _k3}


def _divergence(option: str) -> Rule:
    """The row of verl's rejection option ``option`` = ``<statistic>_<k>`` (``token_k2``, ``seq_sum_k3``,
    ``seq_mean_k2``, ``seq_max_k3``, ...): reject the unit whose statistic of the per-token divergence ``k``
    (:data:`DIVERGENCES`) exceeds the ``TISConfig`` field ``<option>_threshold``; verl keeps ``stat <= t``.

    ``token``: the token, ``k_t > t``. ``seq_sum`` / ``seq_mean``: the sequence, ``sum_t k_t > t`` /
    ``mean_t k_t > t`` over its valid tokens (column ``k_t``). ``seq_max``: the sequence, ``max_t k_t > t``,
    i.e. ``sum_t 1[k_t > t] > 0`` (an indicator column: exact, and a sum completes over context parallelism).
    Metric ``tis/<option>_fraction``: units rejected / units of the domain.
    """
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
    """The rows that are on for ``plan`` (level not None and threshold, if any, set), with their unit level."""
    return [(rule, level) for rule in RULES
            if (rule.threshold is None or plan.threshold(rule.threshold) is not None)
            and (level := rule.level(plan)) is not None]


def late(rule: Rule, level: Level) -> bool:
    """A token-level row whose test cannot run in the token pass: a searched value (the whole batch's) or a prefix
    level (a carry across ranks); its rejected tokens' sequences are completed later (``core.correction``)."""
    return rule.searched or level.prefix is not None


#: Column of the tokens hit by a token-level rejecting row, summed per sequence: a sequence with a rejected token
#: (complete over context parallelism, like every column). Present while a token-level rejecting row is active.
TOKEN_REJECTIONS = "tis.token_rejections"


class _TokenLogRatios:
    """What a token-level row's test reads (the token log-ratios ``l``, the rollout log-probs), before the
    per-sequence sums exist."""

    def __init__(self, log_ratio: Tensor, lp_rollout: Tensor | None, bound_scale) -> None:
        self.log_ratio = log_ratio  # what ``TOKEN.of`` reads
        self.lp_rollout, self.bound_scale = lp_rollout, bound_scale


def rule_columns(plan: Plan, lp_rollout: Tensor | None = None,
                 bound_scale: tuple[Tensor, Tensor] | None = None) -> dict[str, TokenColumn]:
    """Token columns the active rules need summed per sequence, named by the rule's ``column_key``, plus
    :data:`TOKEN_REJECTIONS` while a token-level rejecting row is active (its test reads token log-ratios, the
    ``[T]`` ``lp_rollout`` and the bounds' factors ``Ratios.bound_scale``)."""
    rows = active(plan)
    columns = {rule.column_key: rule.column(plan) for rule, _ in rows if rule.column is not None}
    token_rows = [rule for rule, level in rows if rule.rejects and not level.per_sequence and not late(rule, level)]
    if token_rows:
        def token_rejections(log_r: Tensor) -> Tensor:
            view = _TokenLogRatios(log_r, lp_rollout, bound_scale)
            hit = torch.zeros_like(log_r, dtype=torch.bool)
            for rule in token_rows:
                hit = hit | rule.test(plan, view, TOKEN)
            return hit

        columns[TOKEN_REJECTIONS] = token_rejections
    return columns


@dataclass(frozen=True)
class Verdict:
    """Outcome of the table on one micro-batch.

    ``hits``: ``(rule, level, mask)`` per active row, mask ``[T]`` or ``[n_seq]`` bool.
    ``seq_rejected``: ``[n_seq]`` sequences rejected as a whole. ``token_rejected``: ``[T]`` tokens
    rejected by a token-level rule, or None. ``keep``: ``[T]`` valid tokens that survive every rule.
    ``seq_masked``: ``[n_seq]`` sequences with at least one token rejected by a rule (whole or token-level;
    complete over context parallelism).
    """

    hits: list[tuple[Rule, Level, Tensor]]
    seq_rejected: Tensor
    token_rejected: Tensor | None
    keep: Tensor
    seq_masked: Tensor

    def with_rejected_tokens(self, rejected: Tensor) -> Verdict:
        """The verdict with ``[T]`` bool ``rejected`` tokens rejected as well, as by a token-level rule
        (e.g. a host's own mask applied before the correction); weights and rows' hits are unchanged."""
        token = rejected if self.token_rejected is None else self.token_rejected | rejected
        return Verdict(self.hits, self.seq_rejected, token, self.keep & ~rejected, self.seq_masked)


def evaluate(plan: Plan, ratios: Ratios) -> Verdict:
    """Apply every active row of :data:`RULES`; ``keep_t = valid_t and no rejecting rule hits t or its sequence``.

    :data:`NONFINITE` rejects exactly the sequences outside the diagnostic domain, so ``keep`` starts from
    ``token_ok`` and only the other sequence-level rejections are expanded to tokens (none: ``keep`` is ``token_ok``).
    """
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
