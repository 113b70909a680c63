"""The ``tis.*`` statistics of one micro-batch and its per-token values, from ``core.metric_schema``; keys follow the
plan only. :class:`TisContext` / :class:`TisTokens` compute each quantity once; token sums are over ``D`` (valid
tokens of finite sequences), sequence sums over the finite sequences.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from slime_tis.core.levels import Level
from slime_tis.core.metric_schema import statistics, token_values, total
from slime_tis.core.metrics import MetricStats
from slime_tis.core.plan import Plan
from slime_tis.core.ratios import Ratios, ratio_moments
from slime_tis.core.rules import Verdict
from slime_tis.core.staleness import staleness_statistics

__all__ = ["tis_statistics", "token_metrics", "TisContext", "TisTokens"]

F64 = torch.float64
#: float32's largest value: a sum of squares below it is finite in float32.
F32_MAX = torch.finfo(torch.float32).max


def _sum_and_squares(e: Tensor, bound: float) -> tuple[Tensor, Tensor]:
    """float64 ``(sum e, sum e^2)``, summed in float32 where ``T e^(2B)`` fits it, else in float64."""
    if e.numel() * math.exp(2.0 * bound) < F32_MAX:
        return e.sum().to(F64), torch.dot(e, e).to(F64)
    e64 = e.to(F64)
    return e64.sum(), torch.dot(e64, e64)


def _off_mask(mask: Tensor) -> Tensor:
    """``0`` on ``mask``, ``+inf`` off it: ``min(x + off)`` / ``max(x - off)`` are the extremes over ``mask``."""
    return torch.where(mask, 0.0, float("inf"))


def _extremes(x: Tensor, off: Tensor) -> tuple[Tensor, Tensor]:
    """float32 (min, max) of a finite ``x`` over ``mask`` (``off = _off_mask(mask)``); ``(+inf, -inf)`` if empty."""
    if x.numel() == 0:
        inf = torch.full((), float("inf"), device=x.device)
        return inf, -inf
    x = x.float()
    return (x + off).min(), (x - off).max()


def _weight_extremes(weights: Tensor, kept_weights: Tensor, off_kept: Tensor, n_kept: Tensor) -> tuple[Tensor, Tensor]:
    """float32 (min, max) of the weights (``>= 0``) over the kept units; ``(+inf, -inf)`` when none is kept."""
    inf = torch.full((), float("inf"), device=weights.device)
    if weights.numel() == 0:
        return inf, -inf
    return (weights.float() + off_kept).min(), torch.where(n_kept > 0, kept_weights.float().max(), -inf)


class TisContext:
    """What the ``tis.*`` rows of the metric schema read, computed once per micro-batch: the arguments of
    :func:`tis_statistics`; ``e``, ``k3`` (``[T]``, 0 off ``D``); float64 counts ``n_valid``, ``n_tok``, ``n_seq``,
    ``n_kept_tok``; ``r2_sum = sum_D r^2 = sum e^2 + 2 sum e + n``; ``logs`` ``[4, n_seq]`` (training log-ppl,
    rollout log-ppl, ``mean_diff``, ``sum_t l``) and ``exps = exp(clamp(logs, -B, B))`` (the last doubled);
    ``ratio_sums`` ``(sum r_u, sum r_u^2)`` over the level's units; ``(min, max)`` pairs."""

    def __init__(self, plan: Plan, ratios: Ratios, verdict: Verdict, weights: Tensor, kept_units: Tensor,
                 kept_weights: Tensor, n_kept_units: Tensor, factor: Tensor | None,
                 moments: tuple[Tensor, Tensor, Tensor] | None) -> None:
        self.plan, self.ratios, self.verdict, self.weights = plan, ratios, verdict, weights
        self.kept_units, self.kept_weights, self.n_kept_units = kept_units, kept_weights, n_kept_units
        self.factor = factor
        self.bound = bound = plan.bound
        seq_ok = ratios.seq_ok
        _, self.e, self.k3 = ratio_moments(ratios.log_ratio, bound) if moments is None else moments
        self.n_valid = ratios.local_total("valid", torch.ones_like(seq_ok))
        self.n_tok = ratios.local_total("valid", seq_ok)
        self.n_seq = total(seq_ok)
        self.e_sums = e_sum, e2_sum = _sum_and_squares(self.e, bound)
        self.r2_sum = e2_sum + 2.0 * e_sum + self.n_tok
        if not plan.per_sequence:  # token units: the kept units are the kept tokens
            self.n_kept_tok = n_kept_units.to(F64)
        elif verdict.token_rejected is None:  # valid tokens of the kept sequences
            self.n_kept_tok = ratios.local_total("valid", kept_units)
        else:
            self.n_kept_tok = total(verdict.keep)

        log_sum = ratios.column("l")  # float64, 0 unless seq_ok
        self.mean_diff = -log_sum / ratios.seq_count.to(F64).clamp(min=1.0)
        self.logs = torch.stack([-ratios.seq_mean_lp_train, -ratios.seq_mean_lp_rollout, self.mean_diff, log_sum])
        clamped = self.logs.clamp(-bound, bound)
        clamped[3] *= 2.0
        self.exps = torch.where(seq_ok, clamped.exp(), 0.0)

        self.level_log = plan.level.of(ratios)  # 0 outside the units' domain
        if plan.level.log_ratio != "log_ratio":  # sequence units, or a prefix level's own token ratios
            unit_ok = plan.level.domain(ratios)
            e_unit = torch.where(unit_ok, torch.expm1(self.level_log.to(F64).clamp(-bound, bound)), 0.0)
            self.ratio_sums = (e_unit + unit_ok).sum(), (e_unit * (e_unit + 2.0) + unit_ok).sum()
        else:
            self.ratio_sums = e_sum + self.n_tok, self.r2_sum
        # float64: weight_std = sqrt(w_sq / n - (w / n)^2) cancels (by ~1 / std^2), float32 sums would lose ~1e-5
        self.w64 = kept_weights.to(F64)

        unit_ok = plan.level.domain(ratios)
        off_ok = _off_mask(unit_ok)  # level_log is finite (0 off its domain)
        off_kept = off_ok if kept_units is unit_ok else _off_mask(kept_units)
        self.log_ratio_extremes = _extremes(self.level_log, off_ok)
        self.weight_extremes = _weight_extremes(weights, kept_weights, off_kept, n_kept_units)
        inf = torch.full((1,), float("inf"), dtype=F64, device=seq_ok.device)  # also the value of an empty batch
        self.log_ppl_diff_extremes = (torch.cat([torch.where(seq_ok, self.mean_diff, inf), inf]).min(),
                                      torch.cat([torch.where(seq_ok, self.mean_diff, -inf), -inf]).max())


def tis_statistics(plan: Plan, ratios: Ratios, verdict: Verdict, weights: Tensor, kept_units: Tensor,
                   kept_weights: Tensor, n_kept_units: Tensor, batch_norm_factor: Tensor | None, *,
                   moments: tuple[Tensor, Tensor, Tensor] | None = None) -> MetricStats:
    """The ``tis.*`` statistics: the schema's ``tis.`` rows plus each active rule's count. ``weights``,
    ``kept_units``, ``kept_weights``: per unit (``[T]`` or ``[n_seq]``), after bounds and batch normalisation;
    ``n_kept_units``: 0-d integer; ``moments``: ``ratio_moments(ratios.log_ratio, plan.bound)`` if computed."""
    batch = TisContext(plan, ratios, verdict, weights, kept_units, kept_weights, n_kept_units, batch_norm_factor,
                     moments)
    groups = statistics("tis.", batch, plan)
    if plan.staleness_buckets:
        staleness_statistics(batch, groups)
    for rule, level, hit in verdict.hits:
        groups["seq_sums" if level.per_sequence else "token_sums"][rule.key] = total(hit)
    return MetricStats(**groups)


class TisTokens:
    """The quantities the per-token formulas of the metric schema read (``[T]``; 0 off the token domain)."""

    def __init__(self, plan: Plan, result: Any, factor: Tensor | None) -> None:
        self.plan, self.result, self.factor, self.bound = plan, result, factor, plan.bound
        self.r, self.verdict = result.ratios, result.verdict
        self.ok, self.sid = self.r.token_ok, self.r.seq_id
        self.lc, self.e, self.k3 = ratio_moments(self.r.log_ratio, plan.bound)
        self.mean_diff = self.r.seq_mean_lp_rollout - self.r.seq_mean_lp_train
        self.level_log = plan.level.of(self.r)

    def seq(self, x: Tensor) -> Tensor:
        """``[n_seq]`` -> tokens of finite sequences (float32, 0 elsewhere)."""
        return torch.where(self.ok, x.index_select(0, self.sid).float(), 0.0)

    def unit(self, x: Tensor, level: Level) -> Tensor:
        """A unit value of ``level`` on its tokens (float32)."""
        return (x.index_select(0, self.sid) if level.per_sequence else x).float()


def token_metrics(plan: Plan, result: Any, batch_norm_factor: Tensor | None = None) -> dict[str, Tensor]:
    """Per-token ``tis/`` values (``[T]``, detached, finite; 0 off ``D``) of a ``TISResult`` for hosts that average
    per token: the schema's per-token formulas and each active rule's 0/1 hit. float32, ``tis/chi2_token`` float64
    (``r^2`` reaches ``e^(2B)``)."""
    tokens = TisTokens(plan, result, batch_norm_factor)
    out = token_values(tokens)
    for rule, level, hit in result.verdict.hits:
        out[rule.metric] = tokens.unit(hit, level)
    return {k: v.detach() for k, v in out.items()}
