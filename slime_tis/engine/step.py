"""``StepEngine``: one optimizer step on one rank, whatever the host, in three calls.

    engine = StepEngine(cfg, reducer)
    totals = engine.begin(batches, pre_log_probs=..., pi_old_from_theta=...)   before the step's first loss
    out    = engine.loss(batch, lp_theta, entropy=...)                          each micro-batch, any order
    engine.record(out.stats)                                                    (with the host's own entries)
    metrics = engine.end(step=n)                                                after the step's last loss

``begin`` takes this rank's micro-batches of the step (:class:`~slime_tis.engine.batch.TISBatch`, packed
per-token fields) and computes the step's global scalars once: the loss denominator, the token count and
algorithm 2's batch-normalisation factor (:func:`~slime_tis.engine.totals.step_totals`). ``loss`` is the core's
``policy_loss`` of one micro-batch from its ``lp_theta`` (differentiable) with those totals: each loss corrects its
own micro-batch. ``end`` merges the recorded statistics and reduces them once across ranks
(:func:`~slime_tis.engine.metrics.aggregate_metrics`). Every collective is set by the configuration and the number
of micro-batches, never by the data.

A host translates its data and call order into these calls: the Megatron hook (``slime_tis.megatron``) calls
``begin`` after its pi_old / pre-pass and ``loss`` from the loss function megatron's schedule calls. A host whose
own schedule aggregates the loss (slime: per-rollout means, its own PPO surrogate) gives the engine its totals
(``StepEngine(..., totals=...)``) and may take a micro-batch's correction itself, ``res = engine.correct(batch,
lp_train)``, which ``loss(..., correction=res)`` then applies without correcting again.
"""

from __future__ import annotations

from torch import Tensor

from slime_tis.config import TISConfig
from slime_tis.core import MetricStats, PolicyLossOutput, Reducer, TISResult, compute_tis, policy_loss
from slime_tis.core.algorithms import correction_inputs
from slime_tis.engine.batch import TISBatch
from slime_tis.engine.metrics import aggregate_metrics
from slime_tis.engine.totals import StepTotals, host_term_inputs, step_totals, term_inputs

__all__ = ["StepEngine"]


class StepEngine:
    """One step's totals, per-micro-batch losses and metrics (module docstring)."""

    def __init__(self, cfg: TISConfig, reducer: Reducer, *, totals: StepTotals | None = None,
                 collector: list[MetricStats] | None = None, host_kl: bool = False) -> None:
        self.cfg = cfg
        self.reducer = reducer
        self.totals = totals
        #: the host adds its own KL term against the batches' ``ref_log_probs`` (slime's ``--use-kl-loss``): they are
        #: checked like the advantages in every correction, as where the core's KL term is on (``term_inputs``)
        self.host_kl = host_kl
        self.collector: list[MetricStats] = [] if collector is None else collector

    def begin(self, batches: list[TISBatch], *, pre_log_probs: list[Tensor] | None = None,
              pi_old_from_theta: bool = False) -> StepTotals:
        """The step totals of this rank's micro-batches (``engine.totals.step_totals``), kept for :meth:`loss`."""
        self.totals = step_totals(self.cfg, batches, self.reducer, pre_log_probs=pre_log_probs,
                                  pi_old_from_theta=pi_old_from_theta)
        return self.totals

    @property
    def _searched(self):
        """The step's searched values (algorithm 2, ``engine.totals``), or ``None``: searched per correction."""
        return None if self.totals is None else self.totals.searched

    def correct(self, batch: TISBatch, lp_train: Tensor, *, lp_theta: Tensor | None = None,
                reject: Tensor | None = None) -> TISResult:
        """One micro-batch's correction for a host whose own loss applies it, with the step's batch-normalisation
        factor (``totals``; none: normalised over this call's data): ``compute_tis`` of ``lp_train``, the rollout
        log-probs, the batch's advantages (``batch.advantages``: the advantages or a per-token value computed from
        them and ``lp_theta``) and ``reject`` (``[T]`` bool: a rule of the host's, decided per step)."""
        factor = None if self.totals is None else self.totals.batch_norm_factor
        inputs = correction_inputs(self.cfg, lp_train=lp_train, lp_rollout=batch.rollout_log_probs,
                                   advantages=batch.advantages, lp_theta=lp_theta,
                                   terms=term_inputs(self.cfg, batch, self.host_kl))
        return compute_tis(self.cfg, inputs.lp_train, inputs.lp_rollout, batch.loss_mask, batch.cu_seqlens,
                           reducer=self.reducer, batch_norm_factor=factor, extra_finite=inputs.extra_finite,
                           reject=reject, loss_finite=inputs.loss_finite, searched=self._searched,
                           staleness=batch.staleness)

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
        return policy_loss(self.cfg, lp_theta, batch.old_log_probs if lp_old is None else lp_old,
                           batch.rollout_log_probs, batch.advantages, batch.loss_mask, batch.cu_seqlens,
                           reducer=self.reducer, denominator=t.denominator, batch_norm_factor=t.batch_norm_factor,
                           lp_ref=batch.ref_log_probs, entropy=entropy, keep_override=keep_override,
                           host_inputs=host_term_inputs(batch, self.host_kl), searched=t.searched,
                           correction=correction, staleness=batch.staleness)

    def record(self, stats: MetricStats) -> None:
        """Keep one micro-batch's statistics (detached) for :meth:`end`."""
        self.collector.append(stats.detach())

    def end(self, *, step: int | None = None) -> dict[str, Tensor]:
        """The step's metrics: merged, reduced once, finalized (``{}`` without statistics)."""
        return aggregate_metrics(self.collector, self.reducer, step=step)
