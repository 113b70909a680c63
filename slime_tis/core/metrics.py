"""Diagnostics as reducible statistics, and the formulas that turn them into metrics.

A metric such as ``tis/kl = mean_t (lp_rollout - lp_train)`` is a ratio of two sums. Averaging
per-micro-batch or per-rank means would be wrong (unequal token counts), and a mean of per-rank
minima is not a minimum. So the core returns :class:`MetricStats`: raw sums, minima and maxima,
which are merged across micro-batches (``merge``), reduced across ranks with the right operator
(``reduce``: SUM / MIN / MAX, one collective per operator) and only then turned into metrics
(``finalize``). Everything stays a tensor until the logger reads it: no host sync.

Two kinds of sums: ``token_sums`` (token-domain, summed over data x context parallel ranks) and
``seq_sums`` (one value per sequence, replicated on every context-parallel rank, summed over data
parallel ranks only).

Metric definitions (``tis/`` prefix; D = valid tokens of sequences without non-finite values,
S = such sequences, r_t = exp(clamp(l_t, -B, B)), "units" = tokens at token level, sequences at
sequence/geometric level, with level log-ratio L_u and applied weight w_u):

=========================  ==========================================================================
kl                         mean_{t in D} (lp_rollout_t - lp_train_t)
k3_kl                      mean_{t in D} (r_t - 1 - log r_t)
chi2_token                 mean_{t in D} r_t^2 - 1
chi2_seq                   mean_{i in S} exp(2 clamp(sum_{t in i} l_t, -B, B)) - 1
training_log_ppl           mean_{i in S} (-mean_{t in i} lp_train_t)
training_ppl               mean_{i in S} exp(clamp(-mean_{t in i} lp_train_t, -B, B))
rollout_log_ppl/_ppl       the same with lp_rollout
log_ppl_diff               mean_{i in S} (mean_t lp_rollout_t - mean_t lp_train_t)
log_ppl_abs_diff           mean_{i in S} |mean_t lp_rollout_t - mean_t lp_train_t|
ppl_ratio                  mean_{i in S} exp(clamp(mean_t lp_rollout_t - mean_t lp_train_t, -B, B))
ratio_mean / ratio_std     mean / std of exp(clamp(L_u, -B, B)) over units, before bounds
ratio_min / ratio_max      exp(min_u L_u) / exp(max_u L_u): true extremes, unclamped up to e^700 (float64)
weight_mean/min/max/std    of applied weights w_u over kept units (after bounds and batch-norm)
ess                        (sum_u w_u)^2 / (n_kept_units * sum_u w_u^2) over kept units
truncate_fraction          units with L_u > log(upper) / units           (truncate mode)
clip_fraction_low/high     units with L_u < log(lower) / > log(upper)    (clip mode)
mask_fraction_low/high     units rejected below / above the bounds       (mask mode)
rs_fraction_low/high       rejection-sampling units rejected below / above, over its units
veto_seq_fraction          sequences vetoed / |S|
seq_mean/max_k3_fraction   sequences rejected by the k3 rules / |S|
nonfinite_seq_fraction     sequences with a non-finite value / sequences with valid tokens
rejected_token_fraction    valid tokens rejected for any reason / valid tokens
rejected_seq_fraction      sequences rejected as a whole (non-finite, veto, sequence-level rule)
                           / sequences with valid tokens
rs_seq_masked_fraction     sequences with at least one token rejected by a rule (as a whole or by a
                           token-level rule) / sequences with valid tokens
batch_norm_factor          mean of the applied batch-normalisation factors
num_tokens / num_seqs      valid tokens / sequences with valid tokens
=========================  ==========================================================================

``policy/`` metrics (over kept tokens): ``clipfrac`` (PPO clip active), ``dual_clipfrac``,
``ppo_kl`` = mean(lp_anchor - lp_theta) with anchor = pi_old (alg 0, 2) or pi_rollout (alg 1, 3),
``kept_token_fraction``, ``nonfinite_seq_fraction``.
Empty domains give 0 (never NaN).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from slime_tis.core.reducer import Reducer
from slime_tis.core.rules import RULES

__all__ = ["MetricStats", "safe_ratio", "column_sums"]


def column_sums(columns: dict[str, Tensor]) -> dict[str, Tensor]:
    """``{name: column.sum()}`` as float64 scalars, each column summed on its own (no ``[T, k]`` copy).

    Bool columns are counted exactly; float columns are accumulated in float64, which keeps
    differences of large sums exact to ~1e-12 relative (the columns themselves stay float32).
    """
    out = {}
    for name, c in columns.items():
        out[name] = torch.count_nonzero(c).to(torch.float64) if c.dtype == torch.bool else c.sum(dtype=torch.float64)
    return out


@dataclass
class MetricStats:
    """Reducible statistics (see module docstring). All values are scalar tensors."""

    token_sums: dict[str, Tensor] = field(default_factory=dict)
    seq_sums: dict[str, Tensor] = field(default_factory=dict)
    mins: dict[str, Tensor] = field(default_factory=dict)
    maxs: dict[str, Tensor] = field(default_factory=dict)

    def merge(self, other: MetricStats) -> MetricStats:
        """Combine two micro-batches (or two sources): sums add, minima min, maxima max."""

        def combine(a: dict[str, Tensor], b: dict[str, Tensor], op: Callable[[Tensor, Tensor], Tensor]):
            out = dict(a)
            for k, v in b.items():
                out[k] = op(out[k], v) if k in out else v
            return out

        return MetricStats(
            combine(self.token_sums, other.token_sums, torch.add),
            combine(self.seq_sums, other.seq_sums, torch.add),
            combine(self.mins, other.mins, torch.minimum),
            combine(self.maxs, other.maxs, torch.maximum),
        )

    def reduce(self, reducer: Reducer) -> MetricStats:
        """Reduce across ranks: one collective per non-empty group, keys sorted.

        The keys are a function of the configuration only (the core zero-fills what a micro-batch
        lacks), so every rank issues the same collectives (number, order, op, shape) whatever its data.
        """

        def apply(d: dict[str, Tensor], fn: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
            if not d:
                return {}
            keys = sorted(d)
            stacked = fn(torch.stack([d[k].detach().double() for k in keys]))
            return dict(zip(keys, stacked.unbind(0)))

        return MetricStats(
            apply(self.token_sums, lambda x: reducer.batch_sum(x, per_sequence=False)),
            apply(self.seq_sums, lambda x: reducer.batch_sum(x, per_sequence=True)),
            apply(self.mins, reducer.batch_min),
            apply(self.maxs, reducer.batch_max),
        )

    def detach(self) -> MetricStats:
        """A copy whose tensors are detached clones (safe from in-place scaling by a schedule)."""

        def det(d: dict[str, Tensor]) -> dict[str, Tensor]:
            return {k: v.detach().clone() for k, v in d.items()}

        return MetricStats(det(self.token_sums), det(self.seq_sums), det(self.mins), det(self.maxs))

    def finalize(self) -> dict[str, Tensor]:
        """Metric values (float64 scalar tensors) from the statistics present (a few vector ops)."""
        v: dict[str, Tensor] = {
            k: t if t.dtype == torch.float64 else t.double()
            for d in (self.token_sums, self.seq_sums, self.mins, self.maxs) for k, t in d.items()
        }
        out: dict[str, Tensor] = {}
        present = [(name, num, den) for name, num, den in _RATIO_METRICS if num in v and den in v]
        if present:
            # chi2 = mean(x) - 1 on a non-empty domain: numerator sum(x) - count, so 0 stays 0 when empty
            nums = torch.stack([v[num] - v[den] if num in _MINUS_ONE else v[num] for _, num, den in present])
            values = safe_ratio(nums, torch.stack([v[den] for _, _, den in present]))
            out.update(zip((name for name, _, _ in present), values.unbind(0)))
        for name, total, squares, count in _STD_METRICS:
            if total in v and squares in v and count in v:
                mean = safe_ratio(v[total], v[count])
                out[name] = (safe_ratio(v[squares], v[count]) - mean * mean).clamp(min=0).sqrt()
        extremes = [*self.mins, *self.maxs]
        for log_space in (True, False):
            pairs = [(_LOG_EXTREMES[key] if log_space else key.replace(".", "/", 1), key)
                     for key in extremes if (key in _LOG_EXTREMES) == log_space]
            if not pairs:
                continue
            raw = torch.stack([v[key] for _, key in pairs])
            # ratio extremes unclamped up to e^+-700, where float64 stays finite; empty domains (+-inf) give 0
            value = raw.clamp(-700, 700).exp() if log_space else raw
            out.update(zip((name for name, _ in pairs), torch.where(torch.isfinite(raw), value, 0.0).unbind(0)))
        if "tis.w_sum" in v:
            out["tis/ess"] = safe_ratio(v["tis.w_sum"] ** 2, v["tis.n_kept_units"] * v["tis.w_sq_sum"])
        for name, key in (("tis/num_tokens", "tis.n_tok_valid"), ("tis/num_seqs", "tis.n_seq_valid")):
            if key in v:
                out[name] = v[key]
        return out


def safe_ratio(num: Tensor, den: Tensor) -> Tensor:
    """``num / den``, and 0 where ``den <= 0`` (an empty domain gives 0, never NaN)."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


# (metric, numerator key, denominator key): metric = numerator / denominator, 0 on an empty domain;
# the fractions of the rejection rules and bound counters come from their table (core.rules.RULES)
_RATIO_METRICS: list[tuple[str, str, str]] = [
    ("tis/kl", "tis.kl_sum", "tis.n_tok"),
    ("tis/k3_kl", "tis.k3_sum", "tis.n_tok"),
    ("tis/chi2_token", "tis.r2_sum", "tis.n_tok"),
    ("tis/chi2_seq", "tis.chi2_seq_sum", "tis.n_seq"),
    ("tis/training_log_ppl", "tis.train_log_ppl_sum", "tis.n_seq"),
    ("tis/training_ppl", "tis.train_ppl_sum", "tis.n_seq"),
    ("tis/rollout_log_ppl", "tis.rollout_log_ppl_sum", "tis.n_seq"),
    ("tis/rollout_ppl", "tis.rollout_ppl_sum", "tis.n_seq"),
    ("tis/log_ppl_diff", "tis.log_ppl_diff_sum", "tis.n_seq"),
    ("tis/log_ppl_abs_diff", "tis.log_ppl_abs_diff_sum", "tis.n_seq"),
    ("tis/ppl_ratio", "tis.ppl_ratio_sum", "tis.n_seq"),
    ("tis/ratio_mean", "tis.ratio_sum", "tis.n_units"),
    ("tis/weight_mean", "tis.w_sum", "tis.n_kept_units"),
    *((rule.metric, rule.key, rule.denominator) for rule in RULES),
    ("tis/rejected_token_fraction", "tis.n_tok_rejected", "tis.n_tok_valid"),
    ("tis/rejected_seq_fraction", "tis.n_seq_rejected", "tis.n_seq_valid"),
    ("tis/rs_seq_masked_fraction", "tis.n_seq_masked", "tis.n_seq_valid"),
    ("tis/batch_norm_factor", "tis.bn_factor_sum", "tis.bn_calls"),
    ("policy/clipfrac", "policy.clip_count", "policy.n_tok_kept"),
    ("policy/dual_clipfrac", "policy.dual_clip_count", "policy.n_tok_kept"),
    ("policy/ppo_kl", "policy.ppo_kl_sum", "policy.n_tok_kept"),
    ("policy/kept_token_fraction", "policy.n_tok_kept", "policy.n_tok_valid"),
    ("policy/nonfinite_seq_fraction", "policy.n_seq_nonfinite", "policy.n_seq_valid"),
]
_MINUS_ONE = {"tis.r2_sum", "tis.chi2_seq_sum"}  # chi2 = mean - 1: the numerator is sum - count
#: (metric, sum key, sum-of-squares key, count key): std = sqrt(max(squares/count - (sum/count)^2, 0)), 0 when empty
_STD_METRICS: list[tuple[str, str, str, str]] = [
    ("tis/ratio_std", "tis.ratio_sum", "tis.ratio_sq_sum", "tis.n_units"),
    ("tis/weight_std", "tis.w_sum", "tis.w_sq_sum", "tis.n_kept_units"),
]
#: Minima / maxima reported as ``exp`` of a log-space statistic; every other one, ``tis.X``, is the metric ``tis/X``
#: itself (so a new extreme is one ``mins`` / ``maxs`` entry of ``core.diagnostics``).
_LOG_EXTREMES = {"tis.log_ratio_min": "tis/ratio_min", "tis.log_ratio_max": "tis/ratio_max"}
