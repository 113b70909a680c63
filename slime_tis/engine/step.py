"""``StepEngine``: one optimizer step on one rank, whatever the host, in three calls.

    engine = StepEngine(cfg, reducer)
    totals = engine.begin(batches, pre_log_probs=..., pi_old_from_theta=...)   before the step's first loss
    out    = engine.loss(batch, lp_theta, entropy=...)                          each micro-batch, any order
    engine.record(out.stats)                                                    (with the host's own entries)
    metrics = engine.end(step=n)                                                after the step's last loss

``begin`` takes this rank's micro-batches of the step (:class:`~slime_tis.engine.batch.TISBatch`, packed
per-token fields) and decides what depends only on them, once: the global loss denominator, the token count
and algorithm 2's batch-normalisation factor (:func:`~slime_tis.engine.totals.step_totals`). ``loss`` is the
core's ``policy_loss`` of one micro-batch from its ``lp_theta`` (differentiable) with those totals. Each
micro-batch is corrected once: algorithms 0 and 2 with ``drop`` or batch normalisation decide it in ``begin``
without ``lp_theta`` (once per rollout where the host keeps ``decisions`` for the rollout) and ``loss`` finishes
that decision with ``core.correction.refine`` (``lp_theta``'s finiteness, the step's factor); otherwise the loss
corrects (algorithms 1, 3 read ``sg(lp_theta)``). ``end`` merges the recorded statistics and reduces them once
across ranks (:func:`~slime_tis.engine.metrics.aggregate_metrics`). Every collective is set by the configuration and the
number of micro-batches, never by the data.

A host translates its data and call order into these calls: the Megatron hook (``slime_tis.megatron``) calls
``begin`` after its pi_old / pre-pass and ``loss`` from the loss function megatron's schedule calls.

A host whose own schedule aggregates the loss (slime: per-rollout means, its own PPO surrogate) gives the engine
its totals (``StepEngine(..., totals=...)``) and uses two more calls of the same micro-batch:

    res = engine.decide(batch)                          ahead of the loss, from pi_old and pi_rollout: kept
    res = engine.correct(batch, lp_train)               the correction a host's own loss applies

``decide`` takes a batch's correction without ``lp_theta`` (its training-side log-probs are fixed for the
rollout) and keeps it in ``decisions``; ``correct`` finishes a kept decision (``refine``: the finiteness of
``lp_theta``, or of a per-token value computed from it, and the step's batch-normalisation factor) or, with
none kept, corrects now: either way one correction per micro-batch, which ``loss(..., correction=res)`` then
applies without correcting again.
"""

from __future__ import annotations

from torch import Tensor

from slime_tis.config import TISConfig
from slime_tis.core import MetricStats, PolicyLossOutput, Reducer, TISResult, compute_tis, policy_loss
from slime_tis.core.algorithms import correction_inputs
from slime_tis.core.correction import as_valid_mask, refine
from slime_tis.core.packing import packed_layout
from slime_tis.core.search import PENDING
from slime_tis.engine.batch import TISBatch
from slime_tis.engine.metrics import aggregate_metrics
from slime_tis.engine.totals import (
    Decisions,
    StepTotals,
    decides_ahead,
    host_term_inputs,
    lp_theta_inputs,
    step_totals,
    term_inputs,
)

__all__ = ["StepEngine"]


class StepEngine:
    """One step's totals, per-micro-batch losses and metrics (module docstring)."""

    def __init__(self, cfg: TISConfig, reducer: Reducer, *, totals: StepTotals | None = None,
                 collector: list[MetricStats] | None = None, decisions: Decisions | None = None,
                 host_kl: bool = False) -> None:
        self.cfg = cfg
        self.reducer = reducer
        self.totals = totals
        #: the host adds its own KL term against the batches' ``ref_log_probs`` (slime's ``--use-kl-loss``): they are
        #: checked like the advantages in every correction, as where the core's KL term is on (``term_inputs``)
        self.host_kl = host_kl
        #: corrections decided without lp_theta (``engine.totals.decides_ahead``); a host may pass one cache for
        #: a whole rollout, so a micro-batch is decided once per rollout
        self.decisions = Decisions() if decisions is None else decisions
        self._ahead = decides_ahead(cfg)
        self.collector: list[MetricStats] = [] if collector is None else collector

    def begin(self, batches: list[TISBatch], *, pre_log_probs: list[Tensor] | None = None,
              pi_old_from_theta: bool = False) -> StepTotals:
        """The step totals of this rank's micro-batches (``engine.totals.step_totals``), kept for :meth:`loss`."""
        self.totals = step_totals(self.cfg, batches, self.reducer, pre_log_probs=pre_log_probs,
                                  pi_old_from_theta=pi_old_from_theta, decisions=self.decisions)
        return self.totals

    @property
    def _searched(self):
        """The step's searched values (algorithm 2, ``engine.totals``), or ``None``: searched per correction."""
        return None if self.totals is None else self.totals.searched

    def _finish(self, decided: TISResult, batch: TISBatch, factor: Tensor | None, lp_theta: Tensor,
                entropy: Tensor | None = None) -> TISResult:
        """A kept decision finished for this micro-batch (``refine``): ``lp_theta``'s (and ``entropy``'s) non-finite
        values reject their sequence, and the step's batch-normalisation ``factor`` applies."""
        layout = packed_layout(batch.cu_seqlens, batch.loss_mask.shape[0], batch.loss_mask.device)
        return refine(self.cfg.plan, decided, as_valid_mask(batch.loss_mask), layout, self.reducer,
                      batch_norm_factor=factor, searched=self._searched, **lp_theta_inputs(self.cfg, lp_theta, entropy))

    def decide(self, batch: TISBatch, lp_train: Tensor | None = None) -> TISResult:
        """The correction of ``batch`` without ``lp_theta``, from ``lp_train`` (default ``batch.old_log_probs``), the
        rollout log-probs and the advantages (no batch normalisation), kept in ``decisions`` (found there when the
        batch was decided already): what :meth:`correct` and :meth:`loss` finish for each micro-batch."""
        found = self.decisions.get(batch)
        if found is not None:
            return found
        lp = batch.old_log_probs if lp_train is None else lp_train
        if lp is None:
            raise ValueError("StepEngine.decide needs pi_old: lp_train or the batch's old_log_probs")
        inputs = correction_inputs(self.cfg, lp_train=lp, lp_rollout=batch.rollout_log_probs,
                                   advantages=batch.advantages, terms=term_inputs(self.cfg, batch, self.host_kl))
        res = compute_tis(self.cfg.replace(batch_normalize=False), inputs.lp_train, inputs.lp_rollout,
                          batch.loss_mask, batch.cu_seqlens, reducer=self.reducer, extra_finite=inputs.extra_finite,
                          loss_finite=inputs.loss_finite, searched=PENDING)
        self.decisions.put(batch, res)
        return res

    def correct(self, batch: TISBatch, lp_train: Tensor, *, lp_theta: Tensor | None = None,
                reject: Tensor | None = None) -> TISResult:
        """One micro-batch's correction for a host whose own loss applies it, with the step's batch-normalisation
        factor (``totals``): the decision kept for ``batch`` finished with ``lp_theta``'s finiteness (``refine``),
        or, with none kept (or a ``reject`` mask, a rule of the host's decided per step), ``compute_tis`` of
        ``lp_train``, the rollout log-probs and the batch's advantages (``batch.advantages``: the advantages or a
        per-token value computed from them and ``lp_theta``)."""
        factor = None if self.totals is None else self.totals.batch_norm_factor
        decided = self.decisions.get(batch) if reject is None else None
        if decided is not None:
            return self._finish(decided, batch, factor, batch.advantages if lp_theta is None else lp_theta)
        inputs = correction_inputs(self.cfg, lp_train=lp_train, lp_rollout=batch.rollout_log_probs,
                                   advantages=batch.advantages, lp_theta=lp_theta,
                                   terms=term_inputs(self.cfg, batch, self.host_kl))
        return compute_tis(self.cfg, inputs.lp_train, inputs.lp_rollout, batch.loss_mask, batch.cu_seqlens,
                           reducer=self.reducer, batch_norm_factor=factor, extra_finite=inputs.extra_finite,
                           reject=reject, loss_finite=inputs.loss_finite, searched=self._searched)

    def loss(self, batch: TISBatch, lp_theta: Tensor, *, entropy: Tensor | None = None,
             lp_old: Tensor | None = None, correction: TISResult | None = None,
             keep_override: Tensor | None = None) -> PolicyLossOutput:
        """``policy_loss`` of one micro-batch: ``local_sum / D`` with the step's totals (``lp_old``: pi_old where
        the batch carries none, e.g. ``sg(lp_theta)`` of this forward; ``correction``: this micro-batch's from
        :meth:`correct`, applied as it is; ``keep_override``: ``[T]`` the tokens the loss keeps, decided by the
        host before the step)."""
        if self.totals is None:
            raise RuntimeError("StepEngine.loss before begin: the step totals decide every micro-batch's loss")
        t = self.totals
        decided = self.decisions.get(batch) if self._ahead and lp_old is None and correction is None else None
        if decided is not None:  # decided before the step: finish it with this forward's lp_theta, never redo it
            decided = self._finish(decided, batch, t.batch_norm_factor, lp_theta, entropy)
        return policy_loss(self.cfg, lp_theta, batch.old_log_probs if lp_old is None else lp_old,
                           batch.rollout_log_probs, batch.advantages, batch.loss_mask, batch.cu_seqlens,
                           reducer=self.reducer, denominator=t.denominator, batch_norm_factor=t.batch_norm_factor,
                           lp_ref=batch.ref_log_probs, entropy=entropy, keep_override=keep_override,
                           host_inputs=host_term_inputs(batch, self.host_kl), searched=t.searched,
                           correction=decided if correction is None else correction)

    def record(self, stats: MetricStats) -> None:
        """Keep one micro-batch's statistics (detached) for :meth:`end`."""
        self.collector.append(stats.detach())

    def end(self, *, step: int | None = None) -> dict[str, Tensor]:
        """The step's metrics: merged, reduced once, finalized (``{}`` without statistics)."""
        return aggregate_metrics(self.collector, self.reducer, step=step)
