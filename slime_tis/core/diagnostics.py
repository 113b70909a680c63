"""The ``tis.*`` statistics of one micro-batch (sums, minima, maxima; metrics in ``core.metrics``).

Keys depend only on the plan, never on the data. Token-domain sums (D = valid tokens of finite
sequences on this rank; summed over DP x CP), with ``lc, e, k3`` of ``core.ratios.ratio_moments``
(0 outside D, where ``l = 0``)::

    kl_sum = -sum l,   k3_sum = sum (e - lc),   r2_sum = sum r^2 = sum e^2 + 2 sum e + n

Sequence-domain sums (S = finite sequences; one value per sequence, replicated over CP, summed over
DP) are sums of ``[n_seq]`` values. Level units are tokens or sequences (``plan.level``); each row
of ``core.rules.RULES`` adds its count to the sums of its units' domain.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from slime_tis.core.levels import Level
from slime_tis.core.metrics import MetricStats
from slime_tis.core.plan import Plan
from slime_tis.core.ratios import Ratios, ratio_moments
from slime_tis.core.rules import Verdict

__all__ = ["tis_statistics", "token_metrics"]

F64 = torch.float64


def _total(x: Tensor) -> Tensor:
    """Sum of a bool (count) or float column, as float64 (float32 columns are summed pairwise in float32:
    ~1e-7 relative, well inside the metrics' needs, without a float64 copy of the column)."""
    return torch.count_nonzero(x).to(F64) if x.dtype == torch.bool else x.sum().to(F64)


#: float32's largest value: a sum of squares below it is finite in float32.
F32_MAX = torch.finfo(torch.float32).max


def _sum_and_squares(e: Tensor, bound: float) -> tuple[Tensor, Tensor]:
    """float64 ``(sum e, sum e^2)`` of ``e = expm1(clamp(l, -B, B))`` (``|e| <= e^B``). In float32 (pairwise sum, BLAS
    dot: ~1e-7 relative, as the metrics need) where ``T e^(2B)`` fits float32 (``B = 20``: any ``T`` below 1e21);
    in float64 where squares could overflow (``e^(2B)`` is 1.3e52 at ``B = 60``)."""
    if e.numel() * math.exp(2.0 * bound) < F32_MAX:
        return e.sum().to(F64), torch.dot(e, e).to(F64)
    e64 = e.to(F64)
    return e64.sum(), torch.dot(e64, e64)


def _off_mask(mask: Tensor) -> Tensor:
    """float32 ``0`` on ``mask``, ``+inf`` off it: ``min(x + off)`` / ``max(x - off)`` are the extremes of a finite
    ``x`` over ``mask`` (one selection for both)."""
    return torch.where(mask, 0.0, float("inf"))


def _extremes(x: Tensor, off: Tensor) -> tuple[Tensor, Tensor]:
    """float32 (min, max) of a finite ``x`` over the mask of ``off = _off_mask(mask)``; ``(+inf, -inf)`` when the mask
    is empty."""
    if x.numel() == 0:
        inf = torch.full((), float("inf"), device=x.device)
        return inf, -inf
    x = x.float()
    return (x + off).min(), (x - off).max()


def _weight_extremes(weights: Tensor, kept_weights: Tensor, off_kept: Tensor, n_kept: Tensor) -> tuple[Tensor, Tensor]:
    """float32 (min, max) of the weights over the kept units (``off_kept = _off_mask(kept_units)``); ``(+inf, -inf)``
    when none is kept. The weights are ``>= 0`` and 0 off the kept units in ``kept_weights``: its maximum is the kept
    units' maximum."""
    inf = torch.full((), float("inf"), device=weights.device)
    if weights.numel() == 0:
        return inf, -inf
    return (weights.float() + off_kept).min(), torch.where(n_kept > 0, kept_weights.float().max(), -inf)


def tis_statistics(
    plan: Plan,
    ratios: Ratios,
    verdict: Verdict,
    weights: Tensor,
    kept_units: Tensor,
    kept_weights: Tensor,
    n_kept_units: Tensor,
    batch_norm_factor: Tensor | None,
    *,
    moments: tuple[Tensor, Tensor, Tensor] | None = None,
) -> MetricStats:
    """Raw ``tis.*`` statistics.

    Args:
        weights: applied weights per unit (``[T]`` or ``[n_seq]``), after bounds and batch-norm.
        kept_units: bool, units that survived rejection (same shape).
        kept_weights: ``weights`` on ``kept_units``, 0 elsewhere.
        n_kept_units: 0-d integer count of ``kept_units`` (exact beyond 2^24 units).
        batch_norm_factor: the applied factor (0-d) or None when batch-norm is off.
        moments: ``ratio_moments(ratios.log_ratio, plan.bound)`` where already computed.
    """
    seq_ok, has = ratios.seq_ok, ratios.seq_has_tokens
    n_valid = ratios.local_total("valid", torch.ones_like(seq_ok))
    n_tok = ratios.local_total("valid", seq_ok)
    bound = plan.bound
    _, e, k3 = ratio_moments(ratios.log_ratio, bound) if moments is None else moments
    e_sum, e2_sum = _sum_and_squares(e, bound)
    if not plan.per_sequence:  # token units: the kept units are the kept tokens
        n_kept_tok = n_kept_units.to(F64)
    elif verdict.token_rejected is None:  # valid tokens of the kept sequences
        n_kept_tok = ratios.local_total("valid", kept_units)
    else:
        n_kept_tok = _total(verdict.keep)
    tok: dict[str, Tensor] = {
        "tis.n_tok_valid": n_valid,
        "tis.n_tok": n_tok,
        "tis.n_tok_rejected": n_valid - n_kept_tok,
        "tis.kl_sum": -ratios.local_total("l", seq_ok),
        "tis.k3_sum": _total(k3),
        "tis.r2_sum": e2_sum + 2.0 * e_sum + n_tok,
    }

    log_sum = ratios.column("l")  # float64, 0 unless seq_ok
    lr_mean = ratios.seq_mean_lp_rollout
    mean_diff = -log_sum / ratios.seq_count.to(F64).clamp(min=1.0)  # mean lp_rollout - mean lp_train
    # exponents: training log-ppl, rollout log-ppl, log_ppl_diff, sum_t l (chi2_seq = exp(2 clamp(sum_t l)))
    logs = torch.stack([-ratios.seq_mean_lp_train, -lr_mean, mean_diff, log_sum])
    clamped = logs.clamp(-bound, bound)
    clamped[3] *= 2.0
    exps = torch.where(seq_ok, clamped.exp(), 0.0)
    seq: dict[str, Tensor] = {
        "tis.n_seq_valid": _total(has),
        "tis.n_seq": _total(seq_ok),
        "tis.n_seq_rejected": _total(verdict.seq_rejected & has),
        "tis.n_seq_masked": _total(verdict.seq_masked & has),
        "tis.train_log_ppl_sum": logs[0].sum(),
        "tis.train_ppl_sum": exps[0].sum(),
        "tis.rollout_log_ppl_sum": logs[1].sum(),
        "tis.rollout_ppl_sum": exps[1].sum(),
        "tis.log_ppl_diff_sum": mean_diff.sum(),
        "tis.log_ppl_abs_diff_sum": mean_diff.abs().sum(),
        "tis.ppl_ratio_sum": exps[2].sum(),
        "tis.chi2_seq_sum": exps[3].sum(),
    }

    units = seq if plan.per_sequence else tok
    level_log = ratios.level_log_ratio(plan.level)  # 0 outside the units' domain
    if plan.per_sequence:
        e_unit = torch.where(seq_ok, torch.expm1(level_log.to(F64).clamp(-bound, bound)), 0.0)
        units["tis.n_units"] = seq["tis.n_seq"]
        units["tis.ratio_sum"] = (e_unit + seq_ok).sum()
        units["tis.ratio_sq_sum"] = (e_unit * (e_unit + 2.0) + seq_ok).sum()
    else:
        units["tis.n_units"] = n_tok
        units["tis.ratio_sum"] = e_sum + n_tok
        units["tis.ratio_sq_sum"] = tok["tis.r2_sum"]
    units["tis.n_kept_units"] = n_kept_units.to(F64)
    # float64 sums: weight_std = sqrt(w_sq / n - (w / n)^2) cancels (by ~1 / std^2), float32 sums would lose ~1e-5
    w64 = kept_weights.to(F64)
    units["tis.w_sum"] = w64.sum()
    units["tis.w_sq_sum"] = torch.dot(w64, w64)
    if plan.rs_level is not None:
        rs_seq = plan.rs_level.per_sequence
        (seq if rs_seq else tok)["tis.n_rs_units"] = seq["tis.n_seq"] if rs_seq else n_tok
    for rule, level, hit in verdict.hits:
        (seq if level.per_sequence else tok)[rule.key] = _total(hit)
    if batch_norm_factor is not None:
        seq["tis.bn_factor_sum"] = batch_norm_factor.to(F64).reshape(())
        seq["tis.bn_calls"] = torch.ones((), dtype=F64, device=seq_ok.device)

    unit_ok = ratios.unit_ok(plan.level)
    off_ok = _off_mask(unit_ok)  # level_log is finite (0 off its domain)
    off_kept = off_ok if kept_units is unit_ok else _off_mask(kept_units)
    (lr_min, lr_max) = _extremes(level_log, off_ok)
    (w_min, w_max) = _weight_extremes(weights, kept_weights, off_kept, n_kept_units)
    inf = torch.full((1,), float("inf"), dtype=F64, device=seq_ok.device)  # also the value of an empty batch
    mins = {"tis.log_ratio_min": lr_min, "tis.weight_min": w_min,
            "tis.log_ppl_diff_min": torch.cat([torch.where(seq_ok, mean_diff, inf), inf]).min()}
    maxs = {"tis.log_ratio_max": lr_max, "tis.weight_max": w_max,
            "tis.log_ppl_diff_max": torch.cat([torch.where(seq_ok, mean_diff, -inf), -inf]).max()}
    return MetricStats(token_sums=tok, seq_sums=seq, mins=mins, maxs=maxs)


def token_metrics(plan: Plan, result: Any, batch_norm_factor: Tensor | None = None) -> dict[str, Tensor]:
    """Per-token ``tis/`` values (``[T]``, detached, finite) for hosts that average per token.

    On valid tokens of finite sequences (0 elsewhere), with ``e = expm1(clamp(l, -B, B))``:
    ``tis/kl = -l``, ``tis/k3_kl = e - lc``, ``tis/chi2_token = e (e + 2) = r^2 - 1``; sequence values
    broadcast to their tokens: ``tis/chi2_seq``, ``tis/log_ppl_diff``, ``tis/log_ppl_abs_diff``,
    ``tis/ppl_ratio``, ``tis/training_ppl``, ``tis/rollout_ppl``; ``tis/ratio`` (level ratio before
    bounds), ``tis/weight`` (applied); 0/1 indicators: every active row of ``core.rules.RULES``
    (unit indicator broadcast to tokens), ``tis/rejected_token_fraction``, ``tis/rejected_seq_fraction``;
    ``tis/batch_norm_factor`` if given. ``result`` is a ``TISResult``. float32, except ``tis/chi2_token``: float64,
    since ``r^2`` reaches ``e^(2B)`` (1.3e52 at ``B = 60``), beyond float32.
    """
    r, verdict, bound = result.ratios, result.verdict, plan.bound
    ok, sid = r.token_ok, r.seq_id

    def seq(x: Tensor) -> Tensor:  # [n_seq] -> tokens of finite sequences
        return torch.where(ok, x.index_select(0, sid).float(), 0.0)

    def unit(x: Tensor, level: Level) -> Tensor:
        return (x.index_select(0, sid) if level.per_sequence else x).float()

    lc, e, k3 = ratio_moments(r.log_ratio, bound)
    mean_diff = r.seq_mean_lp_rollout - r.seq_mean_lp_train
    level_log = r.level_log_ratio(plan.level)
    out: dict[str, Tensor] = {
        "tis/kl": -r.log_ratio,
        "tis/k3_kl": k3,
        "tis/chi2_token": e.to(F64) * (e.to(F64) + 2.0),
        "tis/chi2_seq": seq(torch.expm1(2.0 * r.seq_log_ratio_sum.double().clamp(-bound, bound))),
        "tis/log_ppl_diff": seq(mean_diff),
        "tis/log_ppl_abs_diff": seq(mean_diff.abs()),
        "tis/ppl_ratio": seq(torch.exp(mean_diff.clamp(-bound, bound))),
        "tis/training_ppl": seq(torch.exp((-r.seq_mean_lp_train).clamp(-bound, bound))),
        "tis/rollout_ppl": seq(torch.exp((-r.seq_mean_lp_rollout).clamp(-bound, bound))),
        "tis/ratio": torch.where(ok, unit(torch.exp(level_log.clamp(-bound, bound)), plan.level), 0.0),
        "tis/weight": result.weights.float(),
        "tis/rejected_token_fraction": (r.valid & ~result.keep_mask).float(),
        "tis/rejected_seq_fraction": (verdict.seq_rejected & r.seq_has_tokens).index_select(0, sid).float(),
    }
    for rule, level, hit in verdict.hits:
        out[rule.metric] = unit(hit, level)
    if batch_norm_factor is not None:
        out["tis/batch_norm_factor"] = torch.ones_like(lc) * batch_norm_factor.float().reshape(())
    return {k: v.detach() for k, v in out.items()}
