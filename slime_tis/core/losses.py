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
from slime_tis.core.ratios import packed_ratios
from slime_tis.core.reducer import LocalReducer, Reducer
from slime_tis.core.segments import Segments

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
    unclipped = -advantages * rho
    clipped = -advantages * rho.clamp(1.0 - eps_low, 1.0 + eps_high)
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
    reducer = reducer or LocalReducer()
    mask = as_valid_mask(loss_mask)
    if config.rejected_denominator == "drop":
        if keep_mask is None:
            raise ValueError("rejected_denominator='drop' (--tis-rejected-denominator drop) needs keep_mask")
        mask = keep_mask
    if config.loss_agg == "token-mean":
        return torch.count_nonzero(mask).float()
    n_tokens = check_packed({"loss_mask": loss_mask}, cu_seqlens)
    segments = Segments(cu_seqlens, n_tokens, mask.device)
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
    adv = advantages.float().detach()
    old = lp_old.float().detach() if alg in (0, 2) else None
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

    zero = torch.zeros((), dtype=torch.float32, device=theta.device)
    theta_safe = torch.where(keep, theta, zero)  # gradient flows only into kept tokens
    adv_safe = torch.where(keep, adv, zero)
    anchor = old if alg in (0, 2) else lp_rollout.float().detach()
    anchor_safe = torch.where(keep, anchor, zero)
    if alg == 3:
        w = torch.where(keep, weights, zero)
        per_token = -w * adv_safe * theta_safe
        clip_active = dual_active = None
    else:
        per_token, clip_active, dual_active = ppo_clip_term(
            theta_safe - anchor_safe, adv_safe, config.eps_clip, config.eps_high, config.dual_clip_c,
            config.safety_bound,
        )
        if alg == 2:
            per_token = weights * per_token
    per_token = torch.where(keep, per_token, zero)

    if config.loss_agg == "seq-mean-token-mean":
        counts = ratios.seq_count if config.rejected_denominator == "keep" else _sequence_counts(
            keep, segments, reducer)
        numerator = (per_token / segments.expand(counts.clamp(min=1.0))).sum()
    else:
        numerator = per_token.sum()
    if denominator is None:
        local = loss_denominator(config, loss_mask, cu_seqlens, keep_mask=keep, reducer=reducer)
        denominator = reducer.batch_sum(local, per_sequence=config.loss_agg != "token-mean")
    denominator = scalar_tensor(denominator, theta.device).clamp(min=1.0)
    loss = numerator / denominator

    policy_columns = {
        "policy.n_tok_valid": valid,
        "policy.n_tok_kept": keep,
        "policy.ppo_kl_sum": (anchor_safe - theta_detached.where(keep, zero)),
    }
    if clip_active is not None:
        policy_columns["policy.clip_count"] = clip_active & keep
        if config.dual_clip_c is not None:
            policy_columns["policy.dual_clip_count"] = dual_active & keep
    policy_stats = MetricStats(
        token_sums=column_sums(policy_columns),
        seq_sums=column_sums({"policy.n_seq_valid": ratios.seq_has_tokens,
                              "policy.n_seq_nonfinite": ratios.seq_nonfinite}),
    )
    return PolicyLossOutput(loss, stats.merge(policy_stats), keep, weights, tis)
