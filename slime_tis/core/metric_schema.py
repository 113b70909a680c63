"""Every metric declared once in :data:`METRICS` (the rules' rows from ``core.rules.RULES``): from the table come the
statistics (:func:`statistics`), per-token values (:func:`token_values`), :func:`finalize` and docs/reference.md's
metric table. Groups: ``token`` (summed over DP x CP), ``seq`` (over DP only), ``units`` / ``rs_units`` (``seq``
where the plan's / RS level is per sequence, else ``token``), ``min``, ``max``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from slime_tis.core.plan import Plan
from slime_tis.core.rules import RULES, Rule
from slime_tis.core.search import M2PO_FIELD, searches

__all__ = ["Metric", "Statistic", "METRICS", "COUNTS", "REDUCTIONS", "finalize", "statistics", "token_values",
           "metric_table", "safe_ratio", "METRIC_TABLE_HEADER", "STALENESS_ROWS", "ROUTING_ROWS"]


def safe_ratio(num: Tensor, den: Tensor) -> Tensor:
    """``num / den``, and 0 where ``den <= 0`` (an empty domain gives 0, never NaN)."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


@dataclass(frozen=True)
class Statistic:
    """A count shared as a denominator: key, group and formula ``total(context) -> 0-d float64 | None``."""

    key: str
    group: str
    total: Callable[[Any], Tensor | None]


@dataclass(frozen=True)
class Metric:
    """One metric: ``name`` logged, ``numerator`` / ``denominator`` statistic keys (extremes: the minimum / maximum,
    no denominator), ``reduction`` a key of :data:`REDUCTIONS` (``extra``: its third statistic), ``doc`` the formula
    in words (docs/reference.md). ``group`` / ``total``: where and how the numerator of one micro-batch is computed
    (``total(context) -> 0-d tensor``, ``None``: absent in this configuration; no group: another row writes it).
    ``token(TisTokens) -> [T]``: the per-token value, named ``token_name`` where it is not the unit mean."""

    name: str
    numerator: str
    denominator: str | None
    reduction: str
    doc: str
    group: str | None = None
    total: Callable[[Any], Tensor | None] | None = None
    extra: str | None = None
    token: Callable[[Any], Tensor | None] | None = None
    token_name: str | None = None


def _std(squares: Tensor, count: Tensor, total: Tensor) -> Tensor:
    mean = safe_ratio(total, count)
    return (safe_ratio(squares, count) - mean * mean).clamp(min=0).sqrt()


#: ``reduction -> f(numerator, denominator, extra)`` (float64 0-d tensors; 0 on an empty domain, never NaN).
REDUCTIONS: dict[str, Callable[[Tensor, Tensor | None, Tensor | None], Tensor]] = {
    "mean": lambda num, den, _extra: safe_ratio(num, den),
    # chi2 = mean(x) - 1 on a non-empty domain: numerator sum(x) - count, so 0 stays 0 when empty
    "mean_minus_one": lambda num, den, _extra: safe_ratio(num - den, den),
    "std": _std,  # numerator: sum of squares, extra: sum; sqrt(max(squares/n - (sum/n)^2, 0))
    "ess": lambda num, den, extra: safe_ratio(num ** 2, den * extra),  # (sum w)^2 / (n sum w^2)
    # extremes: an empty domain (+-inf) gives 0; ratio extremes unclamped up to e^+-700 (float64 stays finite)
    "exp": lambda x, _den, _extra: torch.where(torch.isfinite(x), x.clamp(-700, 700).exp(), 0.0),
    "extreme": lambda x, _den, _extra: torch.where(torch.isfinite(x), x, 0.0),
    "value": lambda num, _den, _extra: num,
}

F64 = torch.float64


def total(x: Tensor) -> Tensor:
    """Sum of a bool (count) or float column (summed in its dtype), as float64."""
    return torch.count_nonzero(x).to(F64) if x.dtype == torch.bool else x.sum().to(F64)


#: Counts shared as denominators (their formulas over ``TisContext`` / ``PolicyContext``).
COUNTS: tuple[Statistic, ...] = (
    Statistic("tis.n_tok_valid", "token", lambda b: b.n_valid),
    Statistic("tis.n_tok", "token", lambda b: b.n_tok),
    Statistic("tis.n_seq_valid", "seq", lambda b: total(b.ratios.seq_has_tokens)),
    Statistic("tis.n_seq", "seq", lambda b: b.n_seq),
    Statistic("tis.n_units", "units", lambda b: b.n_seq if b.plan.per_sequence else b.n_tok),
    Statistic("tis.n_kept_units", "units", lambda b: b.n_kept_units.to(F64)),
    Statistic("tis.n_rs_units", "rs_units",
              lambda b: None if b.plan.rs_level is None else b.n_seq if b.plan.rs_level.per_sequence else b.n_tok),
    Statistic("tis.bn_calls", "seq",
              lambda b: None if b.factor is None else torch.ones((), dtype=F64, device=b.ratios.seq_ok.device)),
    Statistic("tis.search_calls", "seq",
              lambda b: torch.ones((), dtype=F64, device=b.ratios.seq_ok.device) if searches(b.plan) else None),
    Statistic("policy.n_tok_valid", "token", lambda p: p.valid.sum(dtype=F64)),
    Statistic("policy.n_seq_valid", "seq", lambda p: p.tis.ratios.seq_has_tokens.sum(dtype=F64)),
)


def _value(x: Tensor | float, b: Any) -> Tensor:
    """A plan value (a searched 0-d tensor, or its float placeholder before the search) as a 0-d float64 tensor."""
    return torch.as_tensor(x, dtype=F64, device=b.ratios.seq_ok.device).reshape(())


def _rule_metric(rule: Rule) -> Metric:
    """A rejection rule's row: ``count / denominator``, counted from the rule's hits (``core.rules``)."""
    return Metric(rule.metric, rule.key, rule.denominator, "mean", rule.doc)


#: Every metric, in logging order.
METRICS: tuple[Metric, ...] = (
    Metric("tis/kl", "tis.kl_sum", "tis.n_tok", "mean", "`mean_{t in D} (lp_rollout - lp_train)`",
           "token", lambda b: -b.ratios.local_total("l", b.ratios.seq_ok), token=lambda t: -t.r.log_ratio),
    Metric("tis/k3_kl", "tis.k3_sum", "tis.n_tok", "mean",
           "`mean_{t in D} (r_t - 1 - log r_t)`, computed as `expm1(lc_t) - lc_t`",
           "token", lambda b: total(b.k3), token=lambda t: t.k3),
    Metric("tis/chi2_token", "tis.r2_sum", "tis.n_tok", "mean_minus_one", "`mean_{t in D} r_t^2 - 1`",
           "token", lambda b: b.r2_sum,
           token=lambda t: t.e.to(F64) * (t.e.to(F64) + 2.0)),  # float64: r^2 reaches e^(2B), beyond float32
    Metric("tis/chi2_seq", "tis.chi2_seq_sum", "tis.n_seq", "mean_minus_one",
           "`mean_{i in S} exp(2 clamp(sum_{t in i} l_t, -B, B)) - 1`", "seq", lambda b: b.exps[3].sum(),
           token=lambda t: t.seq(torch.expm1(2.0 * t.r.seq_log_ratio_sum.double().clamp(-t.bound, t.bound)))),
    Metric("tis/training_log_ppl", "tis.train_log_ppl_sum", "tis.n_seq", "mean",
           "`mean_{i in S} (-mean_{t in i} lp_train)`", "seq", lambda b: b.logs[0].sum()),
    Metric("tis/training_ppl", "tis.train_ppl_sum", "tis.n_seq", "mean",
           "`mean_{i in S} exp(clamp(-mean_{t in i} lp_train, -B, B))`", "seq", lambda b: b.exps[0].sum(),
           token=lambda t: t.seq(torch.exp((-t.r.seq_mean_lp_train).clamp(-t.bound, t.bound)))),
    Metric("tis/rollout_log_ppl", "tis.rollout_log_ppl_sum", "tis.n_seq", "mean",
           "`mean_{i in S} (-mean_{t in i} lp_rollout)`", "seq", lambda b: b.logs[1].sum()),
    Metric("tis/rollout_ppl", "tis.rollout_ppl_sum", "tis.n_seq", "mean",
           "`mean_{i in S} exp(clamp(-mean_{t in i} lp_rollout, -B, B))`", "seq", lambda b: b.exps[1].sum(),
           token=lambda t: t.seq(torch.exp((-t.r.seq_mean_lp_rollout).clamp(-t.bound, t.bound)))),
    Metric("tis/log_ppl_diff", "tis.log_ppl_diff_sum", "tis.n_seq", "mean",
           "`mean_{i in S} (mean_t lp_rollout - mean_t lp_train)`", "seq", lambda b: b.mean_diff.sum(),
           token=lambda t: t.seq(t.mean_diff)),
    Metric("tis/log_ppl_abs_diff", "tis.log_ppl_abs_diff_sum", "tis.n_seq", "mean",
           "`mean_{i in S} abs(mean_t lp_rollout - mean_t lp_train)`", "seq", lambda b: b.mean_diff.abs().sum(),
           token=lambda t: t.seq(t.mean_diff.abs())),
    Metric("tis/ppl_ratio", "tis.ppl_ratio_sum", "tis.n_seq", "mean",
           "`mean_{i in S} exp(clamp(mean_t lp_rollout - mean_t lp_train, -B, B))`", "seq",
           lambda b: b.exps[2].sum(), token=lambda t: t.seq(torch.exp(t.mean_diff.clamp(-t.bound, t.bound)))),
    Metric("tis/ratio_mean", "tis.ratio_sum", "tis.n_units", "mean",
           "mean over units of `exp(clamp(L_u, -B, B))`, before bounds", "units", lambda b: b.ratio_sums[0],
           token=lambda t: torch.where(t.ok, t.unit(torch.exp(t.level_log.clamp(-t.bound, t.bound)), t.plan.level),
                                       0.0),
           token_name="tis/ratio"),
    Metric("tis/weight_mean", "tis.w_sum", "tis.n_kept_units", "mean",
           "mean of the applied weights over kept units (after bounds and batch-norm)", "units",
           lambda b: b.w64.sum(), token=lambda t: t.result.weights.float(), token_name="tis/weight"),
    *(_rule_metric(rule) for rule in RULES),
    Metric("tis/rejected_token_fraction", "tis.n_tok_rejected", "tis.n_tok_valid", "mean",
           "valid tokens rejected for any reason / valid tokens", "token", lambda b: b.n_valid - b.n_kept_tok,
           token=lambda t: (t.r.valid & ~t.result.keep_mask).float()),
    Metric("tis/rejected_seq_fraction", "tis.n_seq_rejected", "tis.n_seq_valid", "mean",
           "sequences rejected as a whole (non-finite, veto, sequence-level rule) / sequences with a valid token",
           "seq", lambda b: total(b.verdict.seq_rejected & b.ratios.seq_has_tokens),
           token=lambda t: (t.verdict.seq_rejected & t.r.seq_has_tokens).index_select(0, t.sid).float()),
    Metric("tis/rs_seq_masked_fraction", "tis.n_seq_masked", "tis.n_seq_valid", "mean",
           "sequences with at least one token rejected by a rule (as a whole or by a token-level rule) / sequences "
           "with a valid token", "seq", lambda b: total(b.verdict.seq_masked & b.ratios.seq_has_tokens)),
    Metric("tis/batch_norm_factor", "tis.bn_factor_sum", "tis.bn_calls", "mean",
           "mean of the applied batch-normalisation factors", "seq",
           lambda b: None if b.factor is None else b.factor.to(F64).reshape(()),
           token=lambda t: None if t.factor is None else torch.ones_like(t.lc) * t.factor.float().reshape(())),
    Metric("tis/auto_upper_bound", "tis.auto_upper_sum", "tis.search_calls", "mean",
           "with `--tis-upper-bound auto`: the searched truncation bound (mean over the corrections of the step: one "
           "value per step in algorithm 2)", "seq",
           lambda b: None if b.plan.target_ess is None else _value(b.plan.upper, b)),
    Metric("tis/log_ratio_sq_cut", "tis.log_ratio_sq_cut_sum", "tis.search_calls", "mean",
           "with M2PO on: the searched cut on `lc^2` (mean over the corrections of the step)", "seq",
           lambda b: None if b.plan.threshold(M2PO_FIELD) is None else _value(b.plan.sq_cut, b)),
    Metric("policy/clipfrac", "policy.clip_count", "policy.n_tok_kept", "mean",
           "kept tokens where the clip is active / kept tokens (dppo_tv, dppo_kl: outside the trust region)",
           "token",
           lambda p: None if p.clip_active is None else p.clip_active.sum(dtype=F64)),
    Metric("policy/cov_selected_fraction", "policy.cov_selected_count", "policy.n_tok_kept", "mean",
           "clip_cov / kl_cov: kept tokens selected by covariance (taken out of the loss / given the penalty) / kept "
           "tokens", "token", lambda p: None if p.selected is None else p.selected.sum(dtype=F64)),
    Metric("policy/dual_clipfrac", "policy.dual_clip_count", "policy.n_tok_kept", "mean",
           "kept tokens where the dual clip is active / kept tokens", "token",
           lambda p: None if p.dual_active is None else p.dual_active.sum(dtype=F64)),
    Metric("policy/ppo_kl", "policy.ppo_kl_sum", "policy.n_tok_kept", "mean",
           "`mean (lp_anchor - lp_theta)` over kept tokens, anchor = pi_old (alg 0, 2) or pi_rollout (1, 3)",
           "token", lambda p: (p.anchor_k - p.theta_k.detach()).sum(dtype=F64)),
    Metric("policy/kept_token_fraction", "policy.n_tok_kept", "policy.n_tok_valid", "mean",
           "kept tokens / valid tokens", "token", lambda p: p.keep.sum(dtype=F64)),
    Metric("policy/nonfinite_seq_fraction", "policy.n_seq_nonfinite", "policy.n_seq_valid", "mean",
           "sequences with a non-finite loss input / sequences with a valid token", "seq",
           lambda p: p.tis.seq_loss_nonfinite.sum(dtype=F64)),
    Metric("policy/kl", "policy.kl_sum", "policy.n_tok_kept", "mean",
           "with `--tis-kl-coef`: `mean k(lp_theta - lp_ref)` over kept tokens, `k` the `--tis-kl-estimator` "
           "(before the coefficient and any weight)", "token",
           lambda p: None if p.kl is None else p.kl.sum(dtype=F64)),
    Metric("policy/entropy", "policy.entropy_sum", "policy.n_tok_kept", "mean",
           "with `--tis-entropy-coef`: `mean H_t` over kept tokens (the current policy's entropy)", "token",
           lambda p: None if p.entropy is None
           else torch.where(p.keep, p.entropy.detach().float(), 0.0).sum(dtype=F64)),
    Metric("tis/ratio_std", "tis.ratio_sq_sum", "tis.n_units", "std",
           "population std over units of `exp(clamp(L_u, -B, B))`, before bounds", "units",
           lambda b: b.ratio_sums[1], extra="tis.ratio_sum"),
    Metric("tis/weight_std", "tis.w_sq_sum", "tis.n_kept_units", "std",
           "population std of the applied weights over kept units", "units", lambda b: torch.dot(b.w64, b.w64),
           extra="tis.w_sum"),
    Metric("tis/ratio_min", "tis.log_ratio_min", None, "exp",
           "`exp(min_u L_u)`: the true minimum, unclamped (float64)", "min", lambda b: b.log_ratio_extremes[0]),
    Metric("tis/weight_min", "tis.weight_min", None, "extreme", "minimum applied weight over kept units", "min",
           lambda b: b.weight_extremes[0]),
    Metric("tis/log_ppl_diff_min", "tis.log_ppl_diff_min", None, "extreme",
           "`min_{i in S}` of `mean_t lp_rollout - mean_t lp_train`", "min", lambda b: b.log_ppl_diff_extremes[0]),
    Metric("tis/ratio_max", "tis.log_ratio_max", None, "exp",
           "`exp(max_u L_u)`: the true maximum, unclamped (float64)", "max", lambda b: b.log_ratio_extremes[1]),
    Metric("tis/weight_max", "tis.weight_max", None, "extreme", "maximum applied weight over kept units", "max",
           lambda b: b.weight_extremes[1]),
    Metric("tis/log_ppl_diff_max", "tis.log_ppl_diff_max", None, "extreme",
           "`max_{i in S}` of `mean_t lp_rollout - mean_t lp_train`", "max", lambda b: b.log_ppl_diff_extremes[1]),
    Metric("tis/ess", "tis.w_sum", "tis.n_kept_units", "ess",
           "`(sum_u w_u)^2 / (n_kept_units * sum_u w_u^2)` over kept units", extra="tis.w_sq_sum"),
    Metric("tis/num_tokens", "tis.n_tok_valid", None, "value", "valid tokens"),
    Metric("tis/num_seqs", "tis.n_seq_valid", None, "value", "sequences with a valid token"),
    Metric("tis/staleness_invalid_seq_fraction", "tis.staleness_invalid", "tis.n_seq_valid", "mean",
           "with `--tis-staleness-buckets`: sequences whose staleness is negative or not finite (in no bucket) / "
           "sequences with a valid token"),
    # the token ratio and its spread, whatever the level (top-p / top-k bias: docs/sampling_support.md)
    Metric("tis/token_ratio_mean", "tis.token_r_sum", "tis.n_tok", "mean",
           "`mean_{t in D} r_t` (token ratios, whatever the level)", "token", lambda b: b.e_sums[0] + b.n_tok),
    Metric("tis/token_ratio_outside_10pct_fraction", "tis.n_tok_outside_10pct", "tis.n_tok", "mean",
           "fraction of tokens of `D` with `r_t` outside [0.9, 1.1]", "token",
           lambda b: total(b.e.abs() > 0.1), token=lambda t: (t.e.abs() > 0.1).float()),
)

#: The rows of each staleness bucket (``core.staleness``; ``--tis-staleness-buckets N``): ``{b}`` is the bucket's label
#: (``0``, ..., ``N-1``, ``<N>plus``), the statistics are those of ``D_b``, the tokens of ``D`` in its sequences.
STALENESS_ROWS: tuple[Metric, ...] = (
    Metric("tis/staleness_{b}/num_tokens", "tis.staleness_{b}.n_tok_valid", None, "value",
           "valid tokens of the sequences of staleness bucket `b`"),
    Metric("tis/staleness_{b}/num_seqs", "tis.staleness_{b}.n_seq", None, "value", "finite sequences of bucket `b`"),
    Metric("tis/staleness_{b}/kl", "tis.staleness_{b}.kl_sum", "tis.staleness_{b}.n_tok", "mean",
           "`mean_{t in D_b} (lp_rollout - lp_train)`"),
    Metric("tis/staleness_{b}/k3_kl", "tis.staleness_{b}.k3_sum", "tis.staleness_{b}.n_tok", "mean",
           "`mean_{t in D_b} (r_t - 1 - log r_t)`"),
    Metric("tis/staleness_{b}/rejected_token_fraction", "tis.staleness_{b}.n_tok_rejected",
           "tis.staleness_{b}.n_tok_valid", "mean", "valid tokens of bucket `b` rejected for any reason / its valid "
           "tokens"),
    Metric("tis/staleness_{b}/weight_mean", "tis.staleness_{b}.w_sum", "tis.staleness_{b}.n_tok_kept", "mean",
           "mean applied weight over the kept tokens of bucket `b` (a sequence's weight once per token)"),
)


def staleness_rows(values: dict[str, Any]) -> list[Metric]:
    """:data:`STALENESS_ROWS` for every bucket label whose statistics are in ``values`` (the configuration's)."""
    labels = [k[len("tis.staleness_"):-len(".n_seq")] for k in values
              if k.startswith("tis.staleness_") and k.endswith(".n_seq")]
    return [Metric(m.name.format(b=b), m.numerator.format(b=b), m.denominator and m.denominator.format(b=b),
                   m.reduction, m.doc) for b in labels for m in STALENESS_ROWS]

#: Mixture-of-experts routing (``megatron.routing_replay``): counts over the routing decisions (token, MoE layer)
#: at loss positions that the rollout engine routed, in the training forwards of a step, summed over all ranks.
ROUTING_ROWS: tuple[Metric, ...] = (
    Metric("moe/routing_mismatch", "moe.used_differs", "moe.decisions", "mean",
           "routing decisions (token, MoE layer) at loss positions the engine routed where the expert set training "
           "used differs from the engine's / those decisions (0 with `--tis-routing-replay`)"),
    Metric("moe/router_disagreement", "moe.own_differs", "moe.decisions", "mean",
           "those decisions where the training router's own top-k (from its logits) differs from the engine's / "
           "those decisions (what replay overrides; equal to `moe/routing_mismatch` without replay)"),
    Metric("moe/routing_decisions", "moe.decisions", None, "value",
           "routing decisions (token, MoE layer) at loss positions the engine routed, counted over all ranks"),
)

_GROUPS = {"token": "token_sums", "seq": "seq_sums", "min": "mins", "max": "maxs"}


def _rows(prefix: str) -> tuple[tuple[str, str, Callable], ...]:
    return tuple((key, group, total) for key, group, total in (
        *((c.key, c.group, c.total) for c in COUNTS),
        *((m.numerator, m.group, m.total) for m in METRICS if m.total is not None),
    ) if key.startswith(prefix))


#: ``prefix -> ((key, group, total), ...)``: the statistics of each context, in table order (built once).
_STATISTICS = {prefix: _rows(prefix) for prefix in ("tis.", "policy.")}


def statistics(prefix: str, context: Any, plan: Plan) -> dict[str, dict[str, Tensor]]:
    """``{MetricStats field: {key: 0-d tensor}}`` of every count and numerator whose key starts with ``prefix``
    (``"tis."`` or ``"policy."``), computed from ``context`` (rules' counts are added by the caller)."""
    out: dict[str, dict[str, Tensor]] = {name: {} for name in _GROUPS.values()}
    where = {group: out[field] for group, field in _GROUPS.items()}
    where["units"] = where["seq" if plan.per_sequence else "token"]
    where["rs_units"] = where["seq" if plan.rs_level is not None and plan.rs_level.per_sequence else "token"]
    for key, group, total in _STATISTICS[prefix]:
        if (value := total(context)) is not None:
            where[group][key] = value
    return out


def token_values(context: Any) -> dict[str, Tensor]:
    """``{name: [T] tensor}`` of every row with a per-token formula present for ``context`` (``TisTokens``)."""
    return {m.token_name or m.name: value for m in METRICS
            if m.token is not None and (value := m.token(context)) is not None}


def finalize(values: dict[str, Tensor]) -> dict[str, Tensor]:
    """Metric values (float64 0-d) of every row whose statistics are in ``values`` (float64 0-d), in table order.

    The rows of each reduction are computed together (one stacked vector op per reduction, element-wise: the same
    values as one by one)."""
    present = [m for m in (*METRICS, *staleness_rows(values), *ROUTING_ROWS) if m.numerator in values
               and (m.denominator is None or m.denominator in values) and (m.extra is None or m.extra in values)]
    by_reduction: dict[str, list[Metric]] = {}
    for m in present:
        by_reduction.setdefault(m.reduction, []).append(m)
    computed: dict[str, Tensor] = {}
    for reduction, rows in by_reduction.items():
        num = torch.stack([values[m.numerator] for m in rows])
        den = None if rows[0].denominator is None else torch.stack([values[m.denominator] for m in rows])
        extra = None if rows[0].extra is None else torch.stack([values[m.extra] for m in rows])
        computed.update(zip((m.name for m in rows), REDUCTIONS[reduction](num, den, extra).unbind(0)))
    return {m.name: computed[m.name] for m in present}


METRIC_TABLE_HEADER = "| metric | formula |"


def metric_table() -> str:
    """docs/reference.md's metric table (markdown), one row per metric in table order; consecutive rows with the same
    formula share a line."""
    rows: list[tuple[list[str], str]] = []
    for m in METRICS:
        if rows and rows[-1][1] == m.doc:
            rows[-1][0].append(m.name)
        else:
            rows.append(([m.name], m.doc))
    rows += [([m.name.format(b="<b>")], m.doc) for m in STALENESS_ROWS]
    rows += [([m.name], m.doc) for m in ROUTING_ROWS]
    lines = [METRIC_TABLE_HEADER, "|---|---|"]
    lines += ["| " + ", ".join(f"`{name}`" for name in names) + f" | {doc} |" for names, doc in rows]
    return "\n".join(lines) + "\n"
