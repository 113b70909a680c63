"""Step totals: the global scalars every micro-batch's loss needs, computed once before the first one, over this
rank's micro-batches and the DP (x CP) ranks (docs/semantics.md, "Loss aggregation")::

    D = sum loss_denominator      tokens over DP x CP; sequences over DP (completed over CP by the core); token-sum: 0
    N = sum #valid tokens         over DP x CP (the 3-tuple loss form)
    f = sum norm_count / sum norm_sum      algorithm 2's batch normalisation (units as D)
    s = core.search.search(...)            algorithm 2's global searches, before D and f

Keep masks (``drop``) and batch-norm sums come from the correction ``policy_loss`` makes, on the same inputs; for
algorithms 1 and 3 at the ``lp_theta`` of a forward-only pass (tests/test_engine_two_forwards.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from slime_tis.config import TISConfig
from slime_tis.core import Reducer, TISResult, compute_tis, loss_denominator
from slime_tis.core.aggregation import aggregation_of
from slime_tis.core.algorithms import algorithm_of, correction_inputs
from slime_tis.core.correction import as_valid_mask
from slime_tis.core.search import PENDING, Searched, search, searches
from slime_tis.core.weights import normalisation_factor_over
from slime_tis.engine.batch import TISBatch

__all__ = ["StepTotals", "step_totals", "step_batch_norm", "step_corrects", "step_searches", "needs_pre_pass",
           "needs_pi_old_pass", "correct_batch"]


@dataclass
class StepTotals:
    """``D``, ``N`` (summed in float64, rounded to float32 once), ``f`` and ``s`` of a step (module docstring)."""

    denominator: Tensor
    num_tokens: Tensor
    batch_norm_factor: Tensor | None
    num_microbatches: int
    searched: Searched | None = None  # algorithm 2's searched values (``core.search``), or None: none per step


def step_batch_norm(cfg: TISConfig) -> bool:
    """Algorithm 2 with batch normalisation: one factor per step, before its first loss (algorithm 3 normalises each
    micro-batch over its own data)."""
    return algorithm_of(cfg).step_batch_norm and cfg.batch_normalize


def step_searches(cfg: TISConfig) -> bool:
    """Algorithm 2 with a global search (``core.search``): once per step over every micro-batch (algorithms 1 and 3
    search per micro-batch, in the loss)."""
    return algorithm_of(cfg).needs_pi_old and searches(cfg.plan)


def step_corrects(cfg: TISConfig) -> bool:
    """Whether the step totals correct each micro-batch: ``drop``, algorithm 2's batch normalisation or searches."""
    return cfg.plan.drop_rejected or step_batch_norm(cfg) or step_searches(cfg)


def needs_pi_old_pass(cfg: TISConfig) -> bool:
    """Algorithms 0 and 2 with ``pi_old="auto"``: whether the step totals need every micro-batch's pi_old before the
    first loss (a forward-only pass); otherwise each loss takes ``lp_old = lp_theta.detach()`` of its own forward."""
    return algorithm_of(cfg).needs_pi_old and step_corrects(cfg)


def needs_pre_pass(cfg: TISConfig) -> bool:
    """Algorithms 1 and 3 with ``drop`` and a rejecting rule: ``lp_theta`` of the whole step is needed up front."""
    return not algorithm_of(cfg).needs_pi_old and cfg.plan.drop_rejected and cfg.rejects


def host_term_inputs(batch: TISBatch, host_kl: bool) -> tuple[Tensor, ...]:
    """The inputs of the terms a host adds to the loss itself: the reference log-probs of its own KL term."""
    return (batch.ref_log_probs,) if host_kl and batch.ref_log_probs is not None else ()


def term_inputs(cfg: TISConfig, batch: TISBatch, host_kl: bool = False) -> tuple[Tensor, ...]:
    """The batch's inputs of the loss's added terms, checked like the advantages: the reference log-probs where the
    core's KL term (``kl_coef``) or the host's reads them."""
    core = (batch.ref_log_probs,) if cfg.kl_coef != 0.0 and batch.ref_log_probs is not None else ()
    return core or host_term_inputs(batch, host_kl)


def correct_batch(cfg: TISConfig, batch: TISBatch, lp_train: Tensor, reducer: Reducer, *, lp_rollout: Tensor | None,
                  advantages: Tensor, lp_theta: Tensor | None = None, host_kl: bool = False,
                  batch_norm_factor: Tensor | float | None = None, searched: Searched | None = None,
                  reject: Tensor | None = None) -> TISResult:
    """``compute_tis`` of one micro-batch on the inputs of ``core.algorithms.correction_inputs``."""
    inputs = correction_inputs(cfg, lp_train=lp_train, lp_rollout=lp_rollout, advantages=advantages, lp_theta=lp_theta,
                               terms=term_inputs(cfg, batch, host_kl))
    return compute_tis(cfg, inputs.lp_train, inputs.lp_rollout, batch.loss_mask, batch.cu_seqlens, reducer=reducer,
                       batch_norm_factor=batch_norm_factor, extra_finite=inputs.extra_finite, reject=reject,
                       loss_finite=inputs.loss_finite, searched=searched, staleness=batch.staleness)


def _step_correction(cfg: TISConfig, batch: TISBatch, lp_train: Tensor, reducer: Reducer,
                     lp_theta: Tensor | None, searched: Searched | None = None) -> TISResult:
    """The correction ``policy_loss`` will compute for this micro-batch: its keep mask and batch-norm sums (neither
    depends on ``batch_norm_factor``: 1.0 spares an all-reduce)."""
    return correct_batch(cfg, batch, lp_train, reducer, advantages=batch.advantages.float(), batch_norm_factor=1.0,
                         lp_rollout=batch.rollout_log_probs if algorithm_of(cfg).reads_rollout else None,
                         lp_theta=None if lp_theta is None else lp_theta.float(), searched=searched)


def step_totals(cfg: TISConfig, batches: list[TISBatch], reducer: Reducer, *,
                pre_log_probs: list[Tensor] | None = None, pi_old_from_theta: bool = False) -> StepTotals:
    """The :class:`StepTotals` of this rank's micro-batches (``old_log_probs`` set for algorithms 0 and 2 unless
    ``pi_old_from_theta``: the loss takes its own detached ``lp_theta``); ``pre_log_probs``: ``lp_theta`` per
    micro-batch where a forward-only pass computed it. Every DP x CP rank calls it with as many micro-batches.

    Collectives: where :func:`step_corrects`, the core's CP ``sequence_sum`` per micro-batch (with a global search:
    every micro-batch corrected with the values pending, the searches, then corrected again); then one ``batch_sum``
    per domain.
    """
    if not batches:
        raise ValueError("step_totals needs at least one micro-batch")
    row = algorithm_of(cfg)
    device = batches[0].labels.device
    drop = cfg.plan.drop_rejected
    bn = step_batch_norm(cfg)
    search_step = step_searches(cfg)
    corrects = step_corrects(cfg)
    corrections: list[tuple[Tensor, Tensor | None, TISResult | None]] = []  # (lp_train, lp_theta, result) per batch
    for k, b in enumerate(batches):
        if row.needs_pi_old and b.old_log_probs is None and not pi_old_from_theta:
            raise ValueError(f"micro-batch {k}: algorithm {row.number} needs old_log_probs (pi_old): compute it once "
                             "per rollout with compute_old_log_probs (or supply it), or use pi_old='auto'")
        if row.reads_rollout and b.rollout_log_probs is None:
            raise ValueError(f"micro-batch {k}: algorithm {row.number} needs rollout_log_probs in its TISBatch")
        lp_theta = pre_log_probs[k] if pre_log_probs else None
        res = lp_train = None
        if corrects:
            lp_train = b.old_log_probs if row.needs_pi_old else lp_theta
            if lp_train is None:  # 1/3 without a rejecting rule: only non-finite data can reject
                lp_train = b.rollout_log_probs
            lp_train = lp_train.float()
            res = _step_correction(cfg, b, lp_train, reducer, lp_theta, searched=PENDING if search_step else None)
        corrections.append((lp_train, lp_theta, res))
    searched = None
    if search_step:  # algorithm 2's searches over every micro-batch, then each corrected with their values
        searched = search(cfg.plan, [(res.ratios, res.verdict) for *_, res in corrections], reducer)
        corrections = [(lp_train, lp_theta, _step_correction(cfg, b, lp_train, reducer, lp_theta, searched=searched))
                       for b, (lp_train, lp_theta, _) in zip(batches, corrections)]
    den = torch.zeros((), dtype=torch.float64, device=device)  # counts: float64, exact beyond 2^24
    n_tok = torch.zeros((), dtype=torch.float64, device=device)
    norm_sum = torch.zeros((), dtype=torch.float32, device=device)
    norm_count = torch.zeros((), dtype=torch.float32, device=device)
    for b, (*_, res) in zip(batches, corrections):
        keep = res.loss_keep if drop else None
        den = den + loss_denominator(cfg, b.loss_mask, b.cu_seqlens, keep_mask=keep, reducer=reducer)
        n_tok = n_tok + torch.count_nonzero(as_valid_mask(b.loss_mask))
        if bn:
            norm_sum, norm_count = norm_sum + res.norm_sum, norm_count + res.norm_count
    # Sequence-domain counts are replicated on CP ranks (completed by sequence_sum): DP only.
    den = reducer.batch_sum(den, per_sequence=aggregation_of(cfg.loss_agg).per_sequence)
    n_tok = reducer.batch_sum(n_tok)
    factor = normalisation_factor_over(cfg.plan, norm_sum, norm_count, reducer) if bn else None
    return StepTotals(denominator=den.float(), num_tokens=n_tok.float(), batch_norm_factor=factor,
                      num_microbatches=len(batches), searched=searched)
