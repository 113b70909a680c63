"""``compute_tis``: importance weights, keep mask and ``tis.*`` statistics of one packed micro-batch, all detached:
``core.ratios`` -> ``core.rules`` -> ``core.weights`` -> ``core.diagnostics`` (docs/semantics.md). One token pass,
one ``reducer.sequence_sum`` per call (plus a ``batch_sum`` for a batch normalisation in the call); no host sync.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from slime_tis.core.diagnostics import tis_statistics
from slime_tis.core.metrics import MetricStats
from slime_tis.core.packing import Layout, check_packed, packed_layout
from slime_tis.core.plan import Plan
from slime_tis.core.prefix import Chunks, prefix_log_ratios
from slime_tis.core.ratios import Ratios, packed_ratios, ratio_moments
from slime_tis.core.reducer import LocalReducer, Reducer
from slime_tis.core.rules import Verdict, evaluate, late, rule_columns
from slime_tis.core.search import Searched, search, searches
from slime_tis.core.staleness import bound_scale, check_staleness
from slime_tis.core.weights import normalisation_factor_over, unit_weights

#: The per-sequence column of ``loss_finite`` (``correct``).
LOSS_NONFINITE = "loss_nonfinite"

__all__ = ["TISResult", "compute_tis", "correct", "plan_of", "as_valid_mask", "scalar_tensor"]


@dataclass
class TISResult:
    """Output of :func:`compute_tis`: ``[T]`` float32 ``weights`` and bool masks, ``[n_seq]`` ``seq_loss_nonfinite``,
    0-d ``norm_sum`` / ``norm_count`` (each field: docs/CORE_API.md)."""

    weights: Tensor
    keep_mask: Tensor
    stats: MetricStats
    norm_sum: Tensor
    norm_count: Tensor
    ratios: Ratios
    verdict: Verdict | None = None
    loss_keep: Tensor | None = None
    loss_ok: Tensor | None = None
    seq_loss_nonfinite: Tensor | None = None
    searched: Searched | None = None


def plan_of(config: Any) -> Plan:
    """The resolved :class:`Plan` of a ``TISConfig`` (or the plan itself)."""
    return config if isinstance(config, Plan) else config.plan


def as_valid_mask(loss_mask: Tensor) -> Tensor:
    """Loss mask as bool (any nonzero entry is a trainable token)."""
    return loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0


def scalar_tensor(value: Tensor | float, device: torch.device) -> Tensor:
    """A float32 0-d tensor on ``device`` (a Python number is filled on the device, never copied)."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=torch.float32).reshape(())
    return torch.full((), float(value), dtype=torch.float32, device=device)


def compute_tis(config: Any, lp_train: Tensor, lp_rollout: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, *,
                reducer: Reducer | None = None, batch_norm_factor: Tensor | float | None = None,
                extra_finite: tuple[Tensor, ...] = (), reject: Tensor | None = None,
                loss_finite: tuple[Tensor, ...] = (), staleness: Tensor | None = None,
                searched: Searched | None = None, chunks: Chunks | None = None) -> TISResult:
    """Importance weights of ``pi_train / pi_rollout`` with rejection and diagnostics (arguments: docs/CORE_API.md).

    ``lp_train``, ``lp_rollout`` ``[T]`` float (computed in float32, detached), ``loss_mask`` ``[T]`` bool or 0/1,
    ``cu_seqlens`` ``[n_seq + 1]`` integer on any device; ``ValueError`` naming the tensor on a shape, device, dtype
    or offset error."""
    n_tokens = check_packed(
        {"lp_train": lp_train, "lp_rollout": lp_rollout, "loss_mask": loss_mask,
         **{f"extra_finite[{i}]": t for i, t in enumerate(extra_finite)},
         **{f"loss_finite[{i}]": t for i, t in enumerate(loss_finite)}, "reject": reject},
        cu_seqlens, floats=("lp_train", "lp_rollout"))
    layout = packed_layout(cu_seqlens, n_tokens, lp_train.device)
    return correct(plan_of(config), lp_train, lp_rollout, as_valid_mask(loss_mask), layout, reducer or LocalReducer(),
                   batch_norm_factor=batch_norm_factor, extra_finite=extra_finite,
                   reject=None if reject is None else as_valid_mask(reject), loss_finite=loss_finite,
                   staleness=staleness, searched=searched, chunks=chunks)


def correct(plan: Plan, lp_train: Tensor, lp_rollout: Tensor, valid: Tensor, layout: Layout, reducer: Reducer, *,
            batch_norm_factor: Tensor | float | None = None, extra_finite: tuple[Tensor, ...] = (),
            reject: Tensor | None = None, loss_finite: tuple[Tensor, ...] = (), staleness: Tensor | None = None,
            searched: Searched | None = None, chunks: Chunks | None = None) -> TISResult:
    """:func:`compute_tis` on validated inputs (``valid`` bool ``[T]``, ``layout`` of the batch)."""
    if (plan.staleness_buckets or plan.staleness_decay is not None) and staleness is None:
        raise ValueError("staleness: --tis-staleness-buckets / --tis-staleness-bound-decay is set but the host gave no "
                         "per-sequence staleness (compute_tis(..., staleness=[n_seq] tensor))")
    if staleness is not None:
        staleness = check_staleness(staleness, layout.n_seq, valid.device)
    with torch.no_grad():
        scale = None  # the mode's bounds tightened with staleness: factors per token and per sequence
        if plan.staleness_decay is not None:
            seq_scale = bound_scale(plan, staleness)
            scale = (layout.expand(seq_scale), seq_scale)
        columns = rule_columns(plan, lp_rollout.detach(), scale)
        if loss_finite:  # 1 where a loss input is not finite at a valid token, summed per sequence
            bad = torch.zeros_like(valid)
            for t in loss_finite:
                bad = bad | ~torch.isfinite(t.detach())
            bad_column = (valid & bad).to(torch.float64)
            columns = {**columns, LOSS_NONFINITE: lambda _l: bad_column}
        ratios = packed_ratios(lp_train.detach(), lp_rollout.detach(), valid, layout, reducer,
                               extra_finite=tuple(t.detach() for t in extra_finite), rule_columns=columns,
                               token_pass=plan.token_pass)
        if staleness is not None:
            ratios = dataclasses.replace(ratios, staleness=staleness.detach(), bound_scale=scale)
        if plan.level.prefix is not None:
            ratios = _with_prefix(plan, ratios, layout, reducer, chunks)
        # the decision from the ratios: rules, weights, batch normalisation, statistics (no token pass)
        if searches(plan):
            if searched is None:
                searched = search(plan, [(ratios, _verdict(plan, ratios, reject))], reducer)
            plan = searched.apply(plan)
        verdict = _verdict(plan, ratios, reject)
        late_hits = [hit for rule, level, hit in verdict.hits if rule.rejects and not level.per_sequence
                     and late(rule, level)]
        if late_hits:
            verdict = _with_late_sequences(ratios, verdict, late_hits, layout, reducer)
        moments = ratio_moments(ratios.log_ratio, plan.bound)  # token (lc, e, k3): token weights and diagnostics
        clamped = moments[0] if plan.level.log_ratio == "log_ratio" else None  # the token level's lc
        unit_scale = None if scale is None else scale[1 if plan.per_sequence else 0]
        weights = unit_weights(plan, ratios.level_log_ratio(plan.level), clamped, unit_scale)  # [T] or [n_seq]
        kept_units = ratios.seq_ok & ~verdict.seq_rejected if plan.per_sequence else verdict.keep
        # weights are finite (clamped exponent, finite factor): a product with a mask is the selection
        kept_weights = weights * kept_units
        n_kept_units = torch.count_nonzero(kept_units)  # int64: exact beyond 2^24 units
        norm_sum, norm_count = kept_weights.sum(), n_kept_units.float()

        factor: Tensor | None = None
        if plan.batch_normalize:
            if batch_norm_factor is None:
                factor = normalisation_factor_over(plan, norm_sum, norm_count, reducer)
            else:
                factor = scalar_tensor(batch_norm_factor, weights.device)
            weights, kept_weights = weights * factor, kept_weights * factor

        if plan.per_sequence:  # the weight of the token's sequence (0 if non-finite) on valid tokens
            token_weights = layout.expand(weights * ratios.seq_ok) * ratios.valid
        elif kept_units is ratios.token_ok and factor is None:  # nothing rejected in the domain: the same product
            token_weights = kept_weights
        else:
            token_weights = weights * ratios.token_ok
        stats = tis_statistics(plan, ratios, verdict, weights, kept_units, kept_weights, n_kept_units, factor,
                               moments=moments)
        loss_keep, loss_ok, seq_loss_nonfinite = verdict.keep, ratios.token_ok, ratios.seq_nonfinite
        if loss_finite:
            seq_loss_nonfinite = ratios.seq_has_tokens & (ratios.seq_sums[:, ratios.columns.index(LOSS_NONFINITE)] > 0)
            loss_ok = valid & ~layout.expand(seq_loss_nonfinite)
            loss_keep = loss_ok if reject is None else loss_ok & ~reject
    return TISResult(token_weights, verdict.keep, stats, norm_sum, norm_count, ratios, verdict, loss_keep, loss_ok,
                     seq_loss_nonfinite, searched)


def _with_prefix(plan: Plan, ratios: Ratios, layout: Layout, reducer: Reducer, chunks: Chunks | None) -> Ratios:
    """``ratios`` with the plan's prefix level's ``L_t`` (``core.prefix``; a carry over CP from ``chunks``)."""
    if chunks is None and getattr(reducer, "cp_size", 1) > 1:
        raise ValueError(f"--tis-level {plan.level.name} under context parallelism (CP = {reducer.cp_size}) needs each "
                         "token's chunk index (chunks=(chunk [T], K)) for the prefix's carry across CP ranks; this "
                         "host passes none: use CP = 1 or another level")
    values = prefix_log_ratios(plan.level.prefix, ratios.log_ratio, ratios.token_ok, layout, reducer, chunks)
    return dataclasses.replace(ratios, **{plan.level.log_ratio: values})


def _verdict(plan: Plan, ratios: Ratios, reject: Tensor | None) -> Verdict:
    verdict = evaluate(plan, ratios)
    return verdict if reject is None else verdict.with_rejected_tokens(reject & ratios.valid)


def _with_late_sequences(ratios: Ratios, verdict: Verdict, hits: list[Tensor], layout: Layout,
                         reducer: Reducer) -> Verdict:
    """``verdict`` with the sequences holding a token a late row (``core.rules.late``) rejected in ``seq_masked``
    (one ``sequence_sum``)."""
    hit = hits[0]
    for h in hits[1:]:
        hit = hit | h
    per_seq = reducer.sequence_sum(layout.sums((hit & ratios.token_ok).to(torch.float64)[:, None]))[:, 0] > 0
    return dataclasses.replace(verdict, seq_masked=verdict.seq_masked | (per_seq & ratios.seq_ok))
