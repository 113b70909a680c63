"""Step totals: the global quantities every micro-batch's loss needs, computed once before the first one.

For the ``M`` micro-batches of one optimizer step on this rank (last pipeline stage) and the
data-parallel (x context-parallel) ranks:

    D  = sum_{ranks, micro-batches} loss_denominator(...)      global loss denominator
         (token-mean: tokens, summed over DP x CP; seq-mean-*: sequences, completed over CP by
          ``sequence_sum`` inside the core, then summed over DP only; token-sum: 0, the loss divides by 1)
    N  = sum_{ranks, micro-batches} #valid tokens              (DP x CP; used by the 3-tuple loss form)
    f  = sum norm_count / sum norm_sum                          algorithm 2 batch normalisation
         (units: tokens over DP x CP, or sequences over DP only)
    s  = core.search.search(every micro-batch's decision)      algorithm 2 global searches (M2PO's cut, the auto
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

Decide once (algorithms 0 and 2, whose correction reads pi_old and pi_rollout, :func:`decides_ahead`): the
correction of a micro-batch is taken without ``lp_theta`` and kept in a :class:`Decisions` cache that a host may
hold for a whole rollout (the Megatron hook: from its rollout pass to the next), so a micro-batch met again (a
later epoch) is not corrected again; the step totals and each loss finish it with ``core.correction.refine``
(``lp_theta``'s finiteness, the step's batch-normalisation factor), which gives exactly what one correction
seeing every input gives. Algorithms 1 and 3 read ``lp_theta``: their totals correct at the pre-pass's
``lp_theta``, for the denominator only, and each loss at the ``lp_theta`` of its own forward (every rule, weight
and statistic of theirs reads it: nothing of the totals' correction is left to finish).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from slime_tis.config import TISConfig
from slime_tis.core import Reducer, TISResult, compute_tis, loss_denominator
from slime_tis.core.aggregation import aggregation_of
from slime_tis.core.algorithms import algorithm_of, correction_inputs
from slime_tis.core.correction import as_valid_mask, refine
from slime_tis.core.packing import packed_layout
from slime_tis.core.search import PENDING, Searched, search, searches
from slime_tis.core.weights import batch_norm_factor
from slime_tis.engine.batch import TISBatch

__all__ = ["StepTotals", "Decisions", "step_totals", "needs_pre_pass", "needs_pi_old_pass", "decides_ahead"]


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


class Decisions:
    """Corrections decided without ``lp_theta`` (:func:`decides_ahead`), per micro-batch, for as long as its inputs
    are the same tensors: an entry is found by the ``TISBatch`` object and holds only if the batch still carries
    the same ``old_log_probs``, ``rollout_log_probs``, ``advantages``, ``loss_mask``, ``cu_seqlens`` and
    ``ref_log_probs`` objects (the tensors are assumed unchanged in place). The holder clears it when a new
    rollout begins. Whether an entry is found depends on the host's object flow, the same on every rank of a
    data-parallel x context-parallel group, never on the data."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[tuple, TISResult]] = {}

    @staticmethod
    def _key(b: TISBatch) -> tuple:
        return (b, b.old_log_probs, b.rollout_log_probs, b.advantages, b.loss_mask, b.cu_seqlens, b.ref_log_probs)

    def get(self, b: TISBatch) -> TISResult | None:
        entry = self._entries.get(id(b))
        if entry is None or any(x is not y for x, y in zip(entry[0], self._key(b))):
            return None
        return entry[1]

    def put(self, b: TISBatch, result: TISResult) -> None:
        self._entries[id(b)] = (self._key(b), result)  # the key holds the objects: their ids are not reused

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def decides_ahead(cfg: TISConfig) -> bool:
    """Whether the step decides each micro-batch's correction before its loss, without ``lp_theta``: algorithms 0
    and 2 (the correction reads pi_old) where the totals need it (``drop``'s keep masks, algorithm 2's batch
    normalisation). The loss then finishes that decision (``refine``) instead of correcting again."""
    row = algorithm_of(cfg)
    return row.lp_train == "lp_old" and (cfg.rejected_denominator == "drop" or (row.step_batch_norm and
                                                                             cfg.batch_normalize)
                                         or searches(cfg.plan))


def lp_theta_inputs(cfg: TISConfig, lp_theta: Tensor, entropy: Tensor | None = None) -> dict[str, tuple[Tensor, ...]]:
    """``refine``'s keywords that add ``lp_theta`` (and the loss's ``entropy`` where its term is on) to a decision
    of :func:`decides_ahead`: a correcting row's ``extra_finite``, or algorithm 0's ``loss_finite``, as
    ``core.algorithms.correction_inputs`` places them."""
    new = tuple(t.detach() for t in (lp_theta, entropy if cfg.entropy_coef != 0.0 else None) if t is not None)
    return {"extra_finite": new} if algorithm_of(cfg).rejects else {"loss_finite": new}


def needs_pi_old_pass(cfg: TISConfig) -> bool:
    """Algorithms 0 and 2 with pi_old taken from the training forward (``pi_old="auto"``, one optimizer step per
    rollout: pi_old = sg(pi_theta) at the step's parameters): whether the step totals need pi_old of every micro-batch
    before the first loss, i.e. a forward-only pass. Only ``drop`` (keep masks enter the denominator) and
    the batch normalisation of a weighted algorithm with pi_old (algorithm 2; its factor is a whole-batch mean of
    the weights) need it; otherwise each micro-batch's loss takes ``lp_old = lp_theta.detach()`` from its own
    training forward, at no extra cost."""
    row = algorithm_of(cfg)
    return row.needs_pi_old and (cfg.rejected_denominator == "drop" or (row.step_batch_norm and cfg.batch_normalize)
                                 or searches(cfg.plan))


def needs_pre_pass(cfg: TISConfig) -> bool:
    """Algorithms whose ratios read ``lp_theta`` (1, 3) with ``drop`` and a rejecting rule need ``lp_theta`` of the
    whole step up front."""
    return algorithm_of(cfg).lp_train == "lp_theta" and cfg.rejected_denominator == "drop" and cfg.rejects


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
                       searched=searched)


def step_totals(cfg: TISConfig, batches: list[TISBatch], reducer: Reducer, *,
                pre_log_probs: list[Tensor] | None = None, pi_old_from_theta: bool = False,
                decisions: Decisions | None = None) -> StepTotals:
    """Global denominator, token count and (algorithm 2) batch-norm factor for one optimizer step.

    Args:
        batches: this rank's micro-batches of the step, with ``old_log_probs`` filled for algorithms 0, 2.
        reducer: the distributed reducer (``MegatronReducer``); every rank of the DP x CP group calls
            this function with the same number of micro-batches.
        pre_log_probs: ``lp_theta`` at the step's parameters per micro-batch, where a forward-only pass
            computed it (:func:`needs_pre_pass`, or the pi_old pass of :func:`needs_pi_old_pass`).
        pi_old_from_theta: algorithms 0, 2 without a pi_old pass (not :func:`needs_pi_old_pass`): a missing
            ``old_log_probs`` is the loss's detached ``lp_theta``, which nothing here needs.
        decisions: where :func:`decides_ahead`, the micro-batches' corrections without ``lp_theta``: found there,
            or decided here and added (a fresh cache when ``None``).

    Collectives: per micro-batch the core's CP ``sequence_sum`` where needed (none for a decision found in
    ``decisions``; one more where ``refine`` adds a pre-pass's ``lp_theta``), then one ``batch_sum`` for the
    token domain and one for the sequence domain. With a global search (algorithm 2, ``core.search``): every
    micro-batch is decided first (with the searched values pending), then the searches (``SEARCH_STEPS`` all-reduces
    each), then each decision is finished with them (M2PO: one ``sequence_sum`` each) before ``D`` and ``f``.
    """
    if not batches:
        raise ValueError("step_totals needs at least one micro-batch")
    row = algorithm_of(cfg)
    device = batches[0].labels.device
    drop = cfg.rejected_denominator == "drop"
    seq_domain = aggregation_of(cfg.loss_agg).per_sequence
    bn = row.step_batch_norm and cfg.batch_normalize  # algorithm 2: once per step
    ahead = decides_ahead(cfg)
    if ahead and decisions is None:
        decisions = Decisions()
    den = torch.zeros((), dtype=torch.float64, device=device)  # counts: float64, exact beyond 2^24
    n_tok = torch.zeros((), dtype=torch.float64, device=device)
    norm_sum = torch.zeros((), dtype=torch.float32, device=device)
    norm_count = torch.zeros((), dtype=torch.float32, device=device)
    search_step = ahead and searches(cfg.plan)
    pending: list[tuple[TISBatch, TISResult]] = []  # decisions awaiting the step's searched values
    for k, b in enumerate(batches):
        if row.needs_pi_old and b.old_log_probs is None and not pi_old_from_theta:
            raise ValueError(f"micro-batch {k}: algorithm {row.number} needs old_log_probs (pi_old): compute it once "
                             "per rollout with compute_old_log_probs (or supply it), or use pi_old='auto'")
        if row.reads_rollout and b.rollout_log_probs is None:
            raise ValueError(f"micro-batch {k}: algorithm {row.number} needs rollout_log_probs in its TISBatch")
        lp_theta = pre_log_probs[k] if pre_log_probs else None
        keep = None
        res = None
        if ahead and b.old_log_probs is not None:
            res = decisions.get(b)
            if res is None:
                res = _step_correction(cfg, b, b.old_log_probs.float(), reducer, None, searched=PENDING)
                decisions.put(b, res)
            if lp_theta is not None:  # its non-finite values reject their sequence here as in the loss
                layout = packed_layout(b.cu_seqlens, b.loss_mask.shape[0], device)
                res = refine(cfg.plan, res, as_valid_mask(b.loss_mask), layout, reducer, batch_norm_factor=1.0,
                             searched=PENDING, **lp_theta_inputs(cfg, lp_theta))
            if search_step:
                pending.append((b, res))
                continue
            keep = res.loss_keep if drop else None
        elif drop or bn:
            lp_train = b.old_log_probs if row.lp_train == "lp_old" else lp_theta
            if lp_train is None:  # 1/3 without a rejecting rule: only non-finite data can reject
                lp_train = b.rollout_log_probs
            res = _step_correction(cfg, b, lp_train.float(), reducer, lp_theta)
            keep = res.loss_keep if drop else None
        den = den + loss_denominator(cfg, b.loss_mask, b.cu_seqlens, keep_mask=keep, reducer=reducer)
        n_tok = n_tok + torch.count_nonzero(as_valid_mask(b.loss_mask))
        if bn:
            norm_sum, norm_count = norm_sum + res.norm_sum, norm_count + res.norm_count
    searched = None
    if pending:  # algorithm 2's searches over every micro-batch, then each decision finished with their values
        searched = search(cfg.plan, [(res.ratios, res.verdict) for _, res in pending], reducer)
        for b, res in pending:
            layout = packed_layout(b.cu_seqlens, b.loss_mask.shape[0], device)
            res = refine(cfg.plan, res, as_valid_mask(b.loss_mask), layout, reducer, batch_norm_factor=1.0,
                         searched=searched)
            den = den + loss_denominator(cfg, b.loss_mask, b.cu_seqlens, keep_mask=res.loss_keep if drop else None,
                                         reducer=reducer)
            n_tok = n_tok + torch.count_nonzero(as_valid_mask(b.loss_mask))
            if bn:
                norm_sum, norm_count = norm_sum + res.norm_sum, norm_count + res.norm_count
    # Sequence-domain counts are replicated on CP ranks (completed by sequence_sum): DP only.
    den = reducer.batch_sum(den, per_sequence=seq_domain)
    n_tok = reducer.batch_sum(n_tok)
    factor = batch_norm_factor(cfg.plan, norm_sum, norm_count, reducer) if bn else None
    return StepTotals(denominator=den.float(), num_tokens=n_tok.float(), batch_norm_factor=factor,
                      num_microbatches=len(batches), searched=searched)

