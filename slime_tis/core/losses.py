"""Policy losses of algorithms 0-3 and their aggregation over packed sequences.

Per kept token ``t`` (``A`` advantage, ``B`` safety bound, ``w`` detached importance weight)::

    ppo_term(rho) = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))
                    then, with dual clip c > 1 and A < 0: min(that, -c A)
    alg 0:  ppo_term(exp(clamp(lp_theta - lp_old,     -B, B)))
    alg 1:  ppo_term(exp(clamp(lp_theta - lp_rollout, -B, B)))           (rejection only, w = 1)
    alg 2:  w * ppo_term(exp(clamp(lp_theta - lp_old, -B, B))),  w from lp_old - lp_rollout
    alg 3:  -w * A * lp_theta,                                   w from sg(lp_theta) - lp_rollout

Rejected tokens contribute zero loss and zero gradient (selection with ``torch.where``, so a NaN
at a rejected or masked position cannot leak into the loss or the gradient).

Aggregation (``loss = numerator / denominator``; the denominator is global when supplied)::

    token-mean:           sum_t loss_t                        / N_tokens
    seq-mean-token-mean:  sum_i (1 / n_i) sum_{t in i} loss_t / N_seqs
    seq-mean-token-sum:   sum_i sum_{t in i} loss_t           / N_seqs

``n_i``, ``N_tokens``, ``N_seqs`` count valid tokens / sequences with a valid token
(``rejected_denominator="keep"``) or kept ones (``"drop"``). With the global denominator, the sum
of per-micro-batch losses over micro-batches and data-parallel ranks equals the whole-batch loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from slime_tis.config import TISConfig
from slime_tis.core.correction import TISResult, as_valid_mask, scalar_tensor, tis_on_segments
from slime_tis.core.metrics import MetricStats, column_sums
from slime_tis.core.packing import check_packed
from slime_tis.core.ratios import ROW_VALID, as_float32, packed_ratios
from slime_tis.core.reducer import LocalReducer, Reducer
from slime_tis.core.segments import Segments, select, valid_bits

__all__ = ["PolicyLossOutput", "policy_loss", "ppo_clip_term", "loss_denominator"]


@dataclass
class PolicyLossOutput:
    """Result of :func:`policy_loss`.

    ``loss``: scalar (differentiable w.r.t. ``lp_theta``); ``stats``: ``policy.*`` and ``tis.*``
    statistics; ``keep_mask`` ``[T]`` bool; ``weights`` ``[T]`` applied importance weights (ones for
    algorithms 0 and 1); ``tis``: the full :class:`TISResult` when rollout log-probs were given.
    """

    loss: Tensor
    stats: MetricStats
    keep_mask: Tensor
    weights: Tensor
    tis: TISResult | None


def ppo_clip_term(
    log_ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float, dual_clip_c: float | None,
    safety_bound: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Clipped PPO surrogate per token.

    ``rho = exp(clamp(log_ratio, -B, B))``; returns ``(loss_t, clip_active, dual_clip_active)`` where
    ``loss_t = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))`` and, with ``c``, for ``A < 0``
    ``loss_t = min(loss_t, -c A)``.
    """
    rho = torch.exp(log_ratio.clamp(-safety_bound, safety_bound))
    neg_advantages = -advantages
    unclipped = neg_advantages * rho
    clipped = neg_advantages * rho.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    if dual_clip_c is None:
        return loss, clip_active, torch.zeros_like(clip_active)
    floor = -dual_clip_c * advantages
    dual_active = (advantages < 0) & (loss > floor)
    return torch.where(dual_active, floor, loss), clip_active, dual_active


def _sequence_counts(mask: Tensor, segments: Segments, reducer: Reducer) -> Tensor:
    """Per-sequence count of ``mask`` tokens ``[n_seq]`` float32, completed over context parallelism."""
    buf = segments.row_buffer(1)
    buf[0, : segments.n_tokens].copy_(mask.view(torch.uint8))
    return reducer.sequence_sum(segments.sums(buf))[:, 0].float()


def loss_denominator(
    config: TISConfig,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    *,
    keep_mask: Tensor | None = None,
    reducer: Reducer | None = None,
) -> Tensor:
    """This micro-batch's contribution to the loss denominator (scalar float32, this rank).

    ``token-mean``: number of valid tokens (``drop``: kept tokens) on this rank; sum it over
    micro-batches and data x context parallel ranks. ``seq-mean-*``: number of sequences with at
    least one valid (``drop``: kept) token, completed over context parallelism with
    ``reducer.sequence_sum``; sum it over micro-batches and data-parallel ranks only.
    ``rejected_denominator="drop"`` needs ``keep_mask``.
    """
    if config.rejected_denominator == "drop" and keep_mask is None:
        raise ValueError("rejected_denominator='drop' (--tis-rejected-denominator drop) needs keep_mask")
    valid = as_valid_mask(loss_mask)
    if config.loss_agg == "token-mean":
        return _local_denominator(config, valid, keep_mask, None, reducer or LocalReducer())
    n_tokens = check_packed({"loss_mask": loss_mask}, cu_seqlens)
    segments = Segments(cu_seqlens, n_tokens, valid.device)
    return _local_denominator(config, valid, keep_mask, segments, reducer or LocalReducer())


def _local_denominator(config: TISConfig, valid: Tensor, keep: Tensor | None, segments: Segments | None,
                       reducer: Reducer, seq_has_tokens: Tensor | None = None) -> Tensor:
    """:func:`loss_denominator` on validated inputs (``seq_has_tokens``: the reduced flags, if known)."""
    mask = keep if config.rejected_denominator == "drop" else valid
    if config.loss_agg == "token-mean":
        return torch.count_nonzero(mask).float()
    if mask is valid and seq_has_tokens is not None:
        return seq_has_tokens.sum(dtype=torch.float32)
    return (_sequence_counts(mask, segments, reducer) > 0).sum(dtype=torch.float32)


def policy_loss(
    config: TISConfig,
    lp_theta: Tensor,
    lp_old: Tensor | None,
    lp_rollout: Tensor | None,
    advantages: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    *,
    reducer: Reducer | None = None,
    denominator: Tensor | float | None = None,
    batch_norm_factor: Tensor | float | None = None,
) -> PolicyLossOutput:
    """Aggregated policy loss of ``config.algorithm`` on one packed micro-batch.

    Args:
        lp_theta: ``[T]`` current log-probs (differentiable).
        lp_old: ``[T]`` recomputed pi_old (required by algorithms 0 and 2, ignored by 1 and 3).
        lp_rollout: ``[T]`` rollout log-probs (required by 1, 2, 3; optional in 0 = diagnostics).
        advantages: ``[T]`` per-token advantages.
        loss_mask, cu_seqlens: packed layout (see ``slime_tis.core.packing``).
        reducer: distributed reductions (default: single process).
        denominator: the global denominator (see :func:`loss_denominator`), or ``None`` for this
            call's own count reduced over ``reducer``.
        batch_norm_factor: precomputed global factor (algorithm 2), see :func:`compute_tis`.

    Returns:
        :class:`PolicyLossOutput`; ``loss = numerator / max(denominator, 1)``.
    """
    reducer = reducer or LocalReducer()
    alg = config.algorithm
    if alg in (0, 2) and lp_old is None:
        raise ValueError(f"algorithm {alg} ({config.algorithm_name}) needs lp_old (the Megatron recompute)")
    if alg in (1, 2, 3) and lp_rollout is None:
        raise ValueError(f"algorithm {alg} ({config.algorithm_name}) needs lp_rollout (rollout log-probs)")
    tensors = {"lp_theta": lp_theta, "lp_old": lp_old if alg in (0, 2) else None,
               "lp_rollout": lp_rollout, "advantages": advantages, "loss_mask": loss_mask}
    n_tokens = check_packed(tensors, cu_seqlens)
    for name in ("lp_theta", "lp_old", "lp_rollout", "advantages"):
        t = tensors[name]
        if t is not None and not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")

    theta = lp_theta.float()
    theta_detached = theta.detach()
    adv = as_float32(advantages.detach())
    old = as_float32(lp_old.detach()) if alg in (0, 2) else None
    valid = as_valid_mask(loss_mask)
    segments = Segments(cu_seqlens, n_tokens, theta.device)

    tis: TISResult | None = None
    stats = MetricStats()
    if lp_rollout is not None:
        lp_train = old if alg in (0, 2) else theta_detached
        extra = (adv,) if alg != 0 else ()
        extra = extra + ((theta_detached,) if alg == 2 else ())
        tis = tis_on_segments(config, lp_train, lp_rollout, valid, segments, reducer,
                              batch_norm_factor=batch_norm_factor, extra_finite=extra)
        stats = stats.merge(tis.stats)
    if tis is not None and alg != 0:
        keep, weights, ratios = tis.keep_mask, tis.weights, tis.ratios
    else:  # algorithm 0: only non-finite inputs of its own loss reject (rollout data changes nothing)
        with torch.no_grad():
            ratios = packed_ratios(old, theta_detached, valid, segments, reducer, extra_finite=(adv,))
        keep = ratios.token_ok
        weights = torch.ones_like(theta_detached)

    # Selection before any arithmetic: at tokens that are not kept every input below is 0, so each
    # per-token loss there is +-0 with zero gradient, and a NaN at such a token cannot reach the loss.
    zero = torch.zeros((), dtype=torch.float32, device=theta.device)
    keep_bits = valid_bits(keep)
    theta_safe = torch.where(keep, theta, zero)  # gradient flows only into kept tokens
    adv_safe = select(keep_bits, adv)
    anchor = old if alg in (0, 2) else as_float32(lp_rollout.detach())
    anchor_safe = select(keep_bits, anchor)
    clip_active = dual_active = None
    if alg == 3:
        per_token = -weights * adv_safe * theta_safe  # weights are finite (0 outside valid finite tokens)
    else:
        per_token, clip_active, dual_active = ppo_clip_term(
            theta_safe - anchor_safe, adv_safe, config.eps_clip, config.eps_high, config.dual_clip_c,
            config.safety_bound,
        )
        if alg == 2:
            per_token = weights * per_token

    if config.loss_agg == "seq-mean-token-mean":
        counts = ratios.seq_count if config.rejected_denominator == "keep" else _sequence_counts(
            keep, segments, reducer)
        numerator = (per_token / segments.expand(counts.clamp(min=1.0))).sum()
    else:
        numerator = per_token.sum()
    if denominator is None:
        local = _local_denominator(config, valid, keep, segments, reducer, ratios.seq_has_tokens)
        denominator = reducer.batch_sum(local, per_sequence=config.loss_agg != "token-mean")
    denominator = scalar_tensor(denominator, theta.device).clamp(min=1.0)
    loss = numerator / denominator

    f64 = torch.float64
    token_sums = {
        "policy.n_tok_valid": ratios.seq_sums_local[:, ROW_VALID].sum(),
        "policy.n_tok_kept": torch.count_nonzero(keep).to(f64),
        "policy.ppo_kl_sum": (anchor_safe - theta_safe.detach()).sum().to(f64),
    }
    if clip_active is not None:  # both are False wherever the token is not kept (all inputs 0 there)
        token_sums["policy.clip_count"] = torch.count_nonzero(clip_active).to(f64)
        if config.dual_clip_c is not None:
            token_sums["policy.dual_clip_count"] = torch.count_nonzero(dual_active).to(f64)
    policy_stats = MetricStats(
        token_sums=token_sums,
        seq_sums=column_sums({"policy.n_seq_valid": ratios.seq_has_tokens,
                              "policy.n_seq_nonfinite": ratios.seq_nonfinite}),
    )
    return PolicyLossOutput(loss, stats.merge(policy_stats), keep, weights, tis)
