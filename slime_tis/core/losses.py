"""The policy loss of one packed micro-batch (docs/semantics.md)::

    loss_t = [w] f_t + beta [w] k(lp_theta_t - lp_ref_t) - h H_t,   loss = sum (aggregated) / max(D, 1)

``[w]``: algorithms 2, 3 (the KL's only with ``kl_importance_weighted``); ``f``: ``core.surrogates``; terms:
``core.terms``. Inputs are selected first: a token not kept has zero loss and zero gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from slime_tis.core.aggregation import aggregate, aggregation_of
from slime_tis.core.algorithms import algorithm_of, correction_inputs
from slime_tis.core.correction import TISResult, as_valid_mask, correct, plan_of, scalar_tensor
from slime_tis.core.metric_schema import statistics
from slime_tis.core.metrics import MetricStats
from slime_tis.core.packing import Layout, check_packed, packed_layout
from slime_tis.core.plan import Plan
from slime_tis.core.prefix import Chunks
from slime_tis.core.reducer import LocalReducer, Reducer
from slime_tis.core.search import Searched
from slime_tis.core.surrogates import SurrogateInputs, surrogate_of
from slime_tis.core.terms import kl_estimate, term_loss

__all__ = ["PolicyLossOutput", "policy_loss", "loss_denominator"]

F64 = torch.float64


@dataclass
class PolicyLossOutput:
    """Result of :func:`policy_loss`: ``loss`` 0-d (differentiable w.r.t. ``lp_theta``), ``policy.*`` and ``tis.*``
    ``stats``, ``keep_mask`` ``[T]`` bool, ``weights`` ``[T]`` (ones in algorithms 0, 1), ``tis`` the correction."""

    loss: Tensor
    stats: MetricStats
    keep_mask: Tensor
    weights: Tensor
    tis: TISResult | None


def sequence_counts(mask: Tensor, layout: Layout, reducer: Reducer) -> Tensor:
    """``[n_seq]`` float64 count of ``mask`` tokens per sequence, completed over context parallelism."""
    return reducer.sequence_sum(layout.sums(mask.to(F64)[:, None]))[:, 0]


def loss_denominator(config: Any, loss_mask: Tensor, cu_seqlens: Tensor, *, keep_mask: Tensor | None = None,
                     reducer: Reducer | None = None) -> Tensor:
    """This micro-batch's share of the loss denominator (0-d float32, this rank; ``core.aggregation``), counting
    the valid tokens, or with ``drop`` the ``keep_mask`` tokens; sum it over micro-batches and ranks."""
    plan = plan_of(config)
    if plan.drop_rejected and keep_mask is None:
        raise ValueError("rejected_denominator='drop' (--tis-rejected-denominator drop) needs keep_mask")
    n_tokens = check_packed({"loss_mask": loss_mask, "keep_mask": keep_mask}, cu_seqlens)
    mask = keep_mask if plan.drop_rejected else as_valid_mask(loss_mask)
    layout = packed_layout(cu_seqlens, n_tokens, mask.device)
    counts = sequence_counts(mask, layout, reducer or LocalReducer()) if aggregation_of(plan.loss_agg).needs_counts \
        else None
    return aggregate(plan.loss_agg, None, mask, layout, counts)[1]


def policy_loss(config: Any, lp_theta: Tensor, lp_old: Tensor | None, lp_rollout: Tensor | None, advantages: Tensor,
                loss_mask: Tensor, cu_seqlens: Tensor, *, reducer: Reducer | None = None,
                denominator: Tensor | float | None = None, batch_norm_factor: Tensor | float | None = None,
                keep_override: Tensor | None = None, lp_ref: Tensor | None = None, entropy: Tensor | None = None,
                correction: TISResult | None = None, host_inputs: tuple[Tensor, ...] = (),
                searched: Searched | None = None, chunks: Chunks | None = None,
                staleness: Tensor | None = None) -> PolicyLossOutput:
    """Aggregated policy loss ``numerator / max(denominator, 1)`` of the configured algorithm on one packed
    micro-batch (arguments: docs/CORE_API.md). ``[T]`` inputs; ``lp_theta`` float32 or bfloat16 (not float16: its
    gradient reaches ``|A| exp(B) / D``)."""
    plan = plan_of(config)
    reducer = reducer or LocalReducer()
    row = algorithm_of(plan)
    sur = surrogate_of(plan.surrogate)
    if row.needs_pi_old and lp_old is None:
        raise ValueError(f"algorithm {row.number} ({row.name}) needs lp_old (the Megatron recompute)")
    if row.reads_rollout and lp_rollout is None:
        raise ValueError(f"algorithm {row.number} ({row.name}) needs lp_rollout (rollout log-probs)")
    if plan.kl_coef != 0.0 and lp_ref is None:
        raise ValueError(f"kl_coef = {plan.kl_coef:g} (--tis-kl-coef) needs lp_ref (reference-policy log-probs)")
    if plan.entropy_coef != 0.0 and entropy is None:
        raise ValueError(f"entropy_coef = {plan.entropy_coef:g} (--tis-entropy-coef) needs entropy (per token)")
    terms = (lp_ref if plan.kl_coef != 0.0 else None, entropy if plan.entropy_coef != 0.0 else None)
    tensors = {"lp_theta": lp_theta, "lp_old": lp_old if row.needs_pi_old else None, "lp_rollout": lp_rollout,
               "advantages": advantages, "loss_mask": loss_mask, "lp_ref": terms[0], "entropy": terms[1],
               **{f"host_inputs[{i}]": t for i, t in enumerate(host_inputs)}}
    n_tokens = check_packed(tensors, cu_seqlens, floats=("lp_theta", "lp_old", "lp_rollout", "advantages", "lp_ref",
                                                         "entropy"))
    if lp_theta.dtype == torch.float16:  # its gradient has its dtype: up to |A| exp(B) / D per token
        raise ValueError(f"lp_theta is float16: the gradient of the loss with respect to it reaches |A| * "
                         f"exp({plan.bound:g}) / D per token (the ratio's safety bound), beyond float16's largest "
                         "value 65504; pass float32 (or bfloat16) log-probs: the loss is computed in float32")

    theta = lp_theta.float()
    theta_d = theta.detach()
    adv = advantages.detach().float()
    old = lp_old.detach().float() if row.needs_pi_old else None
    valid = as_valid_mask(loss_mask)
    layout = packed_layout(cu_seqlens, n_tokens, theta.device)

    # one correction decides everything: weights, rejection, and which sequences count (core.algorithms)
    inputs = correction_inputs(plan, lp_train=old if row.needs_pi_old else theta_d,
                               lp_rollout=lp_rollout, advantages=adv, lp_theta=theta_d,
                               terms=tuple(t for t in terms if t is not None) + tuple(host_inputs))
    tis = correction if correction is not None else correct(
        plan, inputs.lp_train, inputs.lp_rollout, valid, layout, reducer, batch_norm_factor=batch_norm_factor,
        extra_finite=inputs.extra_finite, loss_finite=inputs.loss_finite, searched=searched, chunks=chunks,
        staleness=staleness)
    keep = tis.loss_keep
    if keep_override is not None:
        check_packed({"lp_theta": lp_theta, "keep_override": keep_override}, cu_seqlens)
        keep = as_valid_mask(keep_override) & tis.loss_ok
    weights = tis.weights if row.corrects else torch.ones_like(theta_d)  # algorithm 0: no correction, w = 1
    tis_stats = tis.stats if lp_rollout is not None else _empty(tis.stats)  # algorithm 0 without rollout data

    # select before any arithmetic: at tokens not kept every input is 0, the loss there is +-0 with zero gradient
    theta_k = torch.where(keep, theta, 0.0)
    adv_k = torch.where(keep, adv, 0.0)
    anchor = old if row.needs_pi_old else lp_rollout  # algorithm 3: pi_rollout (for policy/ppo_kl only)
    anchor_k = torch.where(keep, anchor.detach().float(), 0.0)
    out = sur.fn(SurrogateInputs(theta_k, anchor_k if sur.anchored else None, adv_k, keep, layout, reducer), plan)
    per_token = weights * out.loss if row.weighted else out.loss
    added = term_loss(theta_k, keep, kl_coef=plan.kl_coef, kl_estimator=plan.kl_estimator, lp_ref=terms[0],
                      kl_weights=weights if plan.kl_importance_weighted and row.weighted else None,
                      entropy_coef=plan.entropy_coef, entropy=terms[1], kl_gradient=plan.kl_gradient)
    if added is not None:
        per_token = per_token + added

    # the counted tokens and their per-sequence counts (the correction's, or the kept ones' under drop)
    agg = aggregation_of(plan.loss_agg)
    counted = keep if plan.drop_rejected else valid
    counts = None
    if agg.needs_counts:
        counts = sequence_counts(keep, layout, reducer) if plan.drop_rejected else tis.ratios.seq_count
    numerator, local = aggregate(plan.loss_agg, per_token, counted, layout, counts)
    if denominator is None:
        denominator = reducer.batch_sum(local, per_sequence=agg.per_sequence)
    loss = numerator / scalar_tensor(denominator, theta.device).clamp(min=1.0)

    # the KL estimate per kept token for policy/kl (d = 0 where not kept: every estimator is 0 there)
    kl = None if terms[0] is None else kl_estimate(theta_k.detach(), torch.where(keep, terms[0].detach().float(), 0.0),
                                                   plan.kl_estimator)
    batch = PolicyContext(plan, valid, keep, tis, anchor_k, theta_k, out.clip_active,
                          out.dual_active if plan.dual_clip_c is not None else None, kl, terms[1], out.selected)
    return PolicyLossOutput(loss, tis_stats.merge(_policy_stats(batch)), keep, weights, tis)


@dataclass(frozen=True)
class PolicyContext:
    """What the ``policy.*`` rows of the metric schema read (``[T]``; ``*_k``: 0 off the kept tokens; ``None``: off,
    as the surrogate's clip / dual-clip / covariance-selection masks where it has none)."""

    plan: Plan
    valid: Tensor
    keep: Tensor
    tis: TISResult
    anchor_k: Tensor
    theta_k: Tensor
    clip_active: Tensor | None
    dual_active: Tensor | None
    kl: Tensor | None = None  # the KL estimator k(lp_theta - lp_ref) per kept token (0 elsewhere), detached
    entropy: Tensor | None = None
    selected: Tensor | None = None


def _policy_stats(batch: PolicyContext) -> MetricStats:
    """``policy.*`` statistics: the ``policy.`` rows of the metric schema."""
    return MetricStats(**statistics("policy.", batch, batch.plan))


def _empty(stats: MetricStats) -> MetricStats:
    """The same keys on no token: sums 0, extremes of an empty domain (+inf minima, -inf maxima)."""
    fills = (0.0, 0.0, math.inf, -math.inf)
    return MetricStats(*({k: torch.full_like(v, fill) for k, v in d.items()} for d, fill in zip(stats.groups(), fills)))
