"""Step totals: the global quantities every micro-batch's loss needs, computed once before the first one.

For the ``M`` micro-batches of one optimizer step on this rank (last pipeline stage) and the
data-parallel (x context-parallel) ranks:

    D  = sum_{ranks, micro-batches} loss_denominator(...)      global loss denominator
         (token-mean: tokens, summed over DP x CP; seq-mean-*: sequences, completed over CP by
          ``sequence_sum`` inside the core, then summed over DP only; token-sum: 0, the loss divides by 1)
    N  = sum_{ranks, micro-batches} #valid tokens              (DP x CP; used by the 3-tuple loss form)
    f  = sum norm_count / sum norm_sum                          algorithm 2 batch normalisation
         (units: tokens over DP x CP, or sequences over DP only)
    s  = core.search.search(every micro-batch's correction)    algorithm 2 global searches (M2PO's cut, the auto
         bound), before D and f, which read the keep masks and weights they give

The loss of micro-batch ``k`` is then ``local_sum_k / D``, so the sum over micro-batches and ranks is
the whole-batch loss whatever the micro-batch, DP, CP or PP sizes (docs/semantics.md, "Loss aggregation").

Keep masks (``--tis-rejected-denominator drop``) and the batch-norm sums come from the same correction call as
``policy_loss`` makes, on the same inputs (``core.algorithms.correction_inputs``, the algorithm's row): the
training-side log-probs are ``lp_old`` (algorithms 0, 2) or ``lp_theta`` at the step's parameters (algorithms
1, 3); ``lp_theta`` is known before the step only from a forward-only pass at its parameters (``recompute``:
the pi_old pass of ``pi_old="auto"`` or the pre-pass of algorithms 1, 3), and wherever it is known, its
non-finite values reject their sequence here as in the loss. Without such a pass (``pi_old="rollout"``)
the totals see every input but ``lp_theta``.

Algorithms 1 and 3 read ``lp_theta``: their totals correct at the pre-pass's ``lp_theta``, for the denominator
only, and each loss corrects again at the ``lp_theta`` of its own forward (tests/test_engine_two_forwards.py).
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
           "needs_pi_old_pass"]


@dataclass
class StepTotals:
    """Global per-step quantities (scalar float32 tensors on the batch device; see module docstring). The counts
    ``denominator`` and ``num_tokens`` are summed over micro-batches and ranks in float64 (exact beyond 2^24 tokens)
    and rounded to float32 once, as the loss scales they are."""

    denominator: Tensor
    num_tokens: Tensor
    batch_norm_factor: Tensor | None
    num_microbatches: int
    searched: Searched | None = None  # algorithm 2's searched values (``core.search``), or None: none per step


def step_batch_norm(cfg: TISConfig) -> bool:
    """Algorithm 2 with batch normalisation: one factor for the whole step (or rollout), fixed before its first loss
    (the weights read pi_old); algorithm 3 normalises each micro-batch over its own data."""
    return algorithm_of(cfg).step_batch_norm and cfg.batch_normalize


def step_searches(cfg: TISConfig) -> bool:
    """Algorithm 2 (a row whose weights read pi_old) with a global search (``core.search``): searched once per step,
    over every micro-batch; algorithms 1 and 3 search per micro-batch, in the loss."""
    return algorithm_of(cfg).needs_pi_old and searches(cfg.plan)


def step_corrects(cfg: TISConfig) -> bool:
    """Whether the step totals correct each micro-batch before the first loss: ``drop`` (the keep masks enter the
    denominator), algorithm 2's batch normalisation (its factor is a whole-step mean of the weights) or its global
    searches."""
    return cfg.plan.drop_rejected or step_batch_norm(cfg) or step_searches(cfg)


def needs_pi_old_pass(cfg: TISConfig) -> bool:
    """Algorithms 0 and 2 with pi_old taken from the training forward (``pi_old="auto"``, one optimizer step per
    rollout: pi_old = sg(pi_theta) at the step's parameters): whether the step totals need pi_old of every micro-batch
    before the first loss, i.e. a forward-only pass. Only ``drop`` (keep masks enter the denominator) and
    the batch normalisation of a weighted algorithm with pi_old (algorithm 2; its factor is a whole-batch mean of
    the weights) need it; otherwise each micro-batch's loss takes ``lp_old = lp_theta.detach()`` from its own
    training forward, at no extra cost."""
    return algorithm_of(cfg).needs_pi_old and step_corrects(cfg)


def needs_pre_pass(cfg: TISConfig) -> bool:
    """Algorithms whose ratios read ``lp_theta`` (1, 3) with ``drop`` and a rejecting rule need ``lp_theta`` of the
    whole step up front."""
    return not algorithm_of(cfg).needs_pi_old and cfg.plan.drop_rejected and cfg.rejects


def host_term_inputs(batch: TISBatch, host_kl: bool) -> tuple[Tensor, ...]:
    """The inputs of the terms a host adds to the loss itself: the reference log-probs where it adds its own KL term
    (``host_kl``: slime's ``--use-kl-loss``), else none (``policy_loss(host_inputs=...)``)."""
    return (batch.ref_log_probs,) if host_kl and batch.ref_log_probs is not None else ()


def term_inputs(cfg: TISConfig, batch: TISBatch, host_kl: bool = False) -> tuple[Tensor, ...]:
    """The batch's inputs of the loss's added terms, checked like the advantages (a non-finite valid entry rejects
    its sequence, counted in ``tis/nonfinite_seq_fraction``): the reference log-probs where a KL term reads them, the
    core's (``kl_coef``) or the host's own (:func:`host_term_inputs`)."""
    core = (batch.ref_log_probs,) if cfg.kl_coef != 0.0 and batch.ref_log_probs is not None else ()
    return core or host_term_inputs(batch, host_kl)


def _step_correction(cfg: TISConfig, batch: TISBatch, lp_train: Tensor, reducer: Reducer,
                     lp_theta: Tensor | None, searched: Searched | None = None) -> TISResult:
    """The correction ``policy_loss`` will compute for this micro-batch (the same inputs, the algorithm's row):
    its keep mask (non-finite, mask mode, RS, veto) and its unnormalised batch-norm sums, from one call."""
    row = algorithm_of(cfg)
    inputs = correction_inputs(
        cfg, lp_train=lp_train, lp_rollout=batch.rollout_log_probs if row.reads_rollout else None,
        advantages=batch.advantages.float(), lp_theta=None if lp_theta is None else lp_theta.float(),
        terms=term_inputs(cfg, batch))
    # batch_norm_factor=1.0: neither the keep mask nor norm_sum/norm_count depend on it, and it avoids a
    # per-call all-reduce
    return compute_tis(cfg, inputs.lp_train, inputs.lp_rollout, batch.loss_mask, batch.cu_seqlens, reducer=reducer,
                       batch_norm_factor=1.0, extra_finite=inputs.extra_finite, loss_finite=inputs.loss_finite,
                       searched=searched, staleness=batch.staleness)


def step_totals(cfg: TISConfig, batches: list[TISBatch], reducer: Reducer, *,
                pre_log_probs: list[Tensor] | None = None, pi_old_from_theta: bool = False) -> StepTotals:
    """Global denominator, token count and (algorithm 2) batch-norm factor for one optimizer step.

    Args:
        batches: this rank's micro-batches of the step, with ``old_log_probs`` filled for algorithms 0, 2.
        reducer: the distributed reducer (``MegatronReducer``); every rank of the DP x CP group calls
            this function with the same number of micro-batches.
        pre_log_probs: ``lp_theta`` at the step's parameters per micro-batch, where a forward-only pass
            computed it (:func:`needs_pre_pass`, or the pi_old pass of :func:`needs_pi_old_pass`).
        pi_old_from_theta: algorithms 0, 2 without a pi_old pass (not :func:`needs_pi_old_pass`): a missing
            ``old_log_probs`` is the loss's detached ``lp_theta``, which nothing here needs.

    Collectives: per micro-batch the core's CP ``sequence_sum`` where :func:`step_corrects`, then one ``batch_sum``
    for the token domain and one for the sequence domain. With a global search (:func:`step_searches`): every
    micro-batch is corrected with the searched values pending, then the searches (``SEARCH_STEPS`` all-reduces each),
    then each micro-batch is corrected with their values before ``D`` and ``f``.
    """
    if not batches:
        raise ValueError("step_totals needs at least one micro-batch")
    row = algorithm_of(cfg)
    device = batches[0].labels.device
    drop = cfg.plan.drop_rejected
    seq_domain = aggregation_of(cfg.loss_agg).per_sequence
    bn = step_batch_norm(cfg)
    search_step = step_searches(cfg)
    pending: list[tuple[TISBatch, Tensor, Tensor | None, TISResult]] = []  # corrections awaiting the searches
    den = torch.zeros((), dtype=torch.float64, device=device)  # counts: float64, exact beyond 2^24
    n_tok = torch.zeros((), dtype=torch.float64, device=device)
    norm_sum = torch.zeros((), dtype=torch.float32, device=device)
    norm_count = torch.zeros((), dtype=torch.float32, device=device)
    for k, b in enumerate(batches):
        if row.needs_pi_old and b.old_log_probs is None and not pi_old_from_theta:
            raise ValueError(f"micro-batch {k}: algorithm {row.number} needs old_log_probs (pi_old): compute it once "
                             "per rollout with compute_old_log_probs (or supply it), or use pi_old='auto'")
        if row.reads_rollout and b.rollout_log_probs is None:
            raise ValueError(f"micro-batch {k}: algorithm {row.number} needs rollout_log_probs in its TISBatch")
        lp_theta = pre_log_probs[k] if pre_log_probs else None
        keep = None
        res = None
        if drop or bn or search_step:
            lp_train = b.old_log_probs if row.needs_pi_old else lp_theta
            if lp_train is None:  # 1/3 without a rejecting rule: only non-finite data can reject
                lp_train = b.rollout_log_probs
            # lp_theta where known (a pass at the step's parameters): its non-finite values reject as in the loss
            res = _step_correction(cfg, b, lp_train.float(), reducer, lp_theta,
                                   searched=PENDING if search_step else None)
            if search_step:
                pending.append((b, lp_train, lp_theta, res))
                continue
            keep = res.loss_keep if drop else None
        den = den + loss_denominator(cfg, b.loss_mask, b.cu_seqlens, keep_mask=keep, reducer=reducer)
        n_tok = n_tok + torch.count_nonzero(as_valid_mask(b.loss_mask))
        if bn:
            norm_sum, norm_count = norm_sum + res.norm_sum, norm_count + res.norm_count
    searched = None
    if pending:  # algorithm 2's searches over every micro-batch, then each corrected with their values
        searched = search(cfg.plan, [(res.ratios, res.verdict) for *_, res in pending], reducer)
        for b, lp_train, lp_theta, _ in pending:
            res = _step_correction(cfg, b, lp_train.float(), reducer, lp_theta, searched=searched)
            den = den + loss_denominator(cfg, b.loss_mask, b.cu_seqlens, keep_mask=res.loss_keep if drop else None,
                                         reducer=reducer)
            n_tok = n_tok + torch.count_nonzero(as_valid_mask(b.loss_mask))
            if bn:
                norm_sum, norm_count = norm_sum + res.norm_sum, norm_count + res.norm_count
    # Sequence-domain counts are replicated on CP ranks (completed by sequence_sum): DP only.
    den = reducer.batch_sum(den, per_sequence=seq_domain)
    n_tok = reducer.batch_sum(n_tok)
    factor = normalisation_factor_over(cfg.plan, norm_sum, norm_count, reducer) if bn else None
    return StepTotals(denominator=den.float(), num_tokens=n_tok.float(), batch_norm_factor=factor,
                      num_microbatches=len(batches), searched=searched)

