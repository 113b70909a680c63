"""``StepEngine``: one optimizer step on one rank, whatever the host (docs/hosts.md): ``begin(batches)`` computes the
step's global scalars once (:func:`~slime_tis.engine.totals.step_totals`), ``loss(batch, lp_theta)`` is the core's
``policy_loss`` of each micro-batch with them, ``record(out.stats)`` keeps its statistics and ``end()`` reduces them
once. A host whose own schedule aggregates the loss passes ``totals=`` and may apply ``correct``'s correction itself.
The collectives depend on the configuration and the number of micro-batches only.
"""

from __future__ import annotations

from torch import Tensor

from slime_tis.config import TISConfig
from slime_tis.core import MetricStats, PolicyLossOutput, Reducer, TISResult, policy_loss
from slime_tis.engine.batch import TISBatch
from slime_tis.engine.metrics import aggregate_metrics
from slime_tis.engine.totals import StepTotals, correct_batch, host_term_inputs, step_totals

__all__ = ["StepEngine"]


class StepEngine:
    """One step's totals, per-micro-batch losses and metrics (module docstring); ``host_kl``: the host adds its own KL
    term against ``ref_log_probs`` (slime's ``--use-kl-loss``), so they are checked like the advantages."""

    def __init__(self, cfg: TISConfig, reducer: Reducer, *, totals: StepTotals | None = None,
                 collector: list[MetricStats] | None = None, host_kl: bool = False) -> None:
        self.cfg = cfg
        self.reducer = reducer
        self.totals = totals
        self.host_kl = host_kl
        self.collector: list[MetricStats] = [] if collector is None else collector

    def begin(self, batches: list[TISBatch], *, pre_log_probs: list[Tensor] | None = None,
              pi_old_from_theta: bool = False) -> StepTotals:
        """The step totals of this rank's micro-batches, kept for :meth:`loss`."""
        self.totals = step_totals(self.cfg, batches, self.reducer, pre_log_probs=pre_log_probs,
                                  pi_old_from_theta=pi_old_from_theta)
        return self.totals

    def correct(self, batch: TISBatch, lp_train: Tensor, *, lp_theta: Tensor | None = None,
                reject: Tensor | None = None) -> TISResult:
        """``compute_tis`` of one micro-batch for a host whose own loss applies it, with the step's batch-normalisation
        factor and searched values where ``totals`` are set; ``reject [T]``: the host's own rule."""
        t = self.totals
        return correct_batch(self.cfg, batch, lp_train, self.reducer, lp_rollout=batch.rollout_log_probs,
                             advantages=batch.advantages, lp_theta=lp_theta, host_kl=self.host_kl, reject=reject,
                             batch_norm_factor=None if t is None else t.batch_norm_factor,
                             searched=None if t is None else t.searched)

    def loss(self, batch: TISBatch, lp_theta: Tensor, *, entropy: Tensor | None = None,
             lp_old: Tensor | None = None, correction: TISResult | None = None,
             keep_override: Tensor | None = None) -> PolicyLossOutput:
        """``policy_loss`` (``local_sum / D``) of one micro-batch with the step's totals; ``lp_old``: pi_old where the
        batch carries none; ``correction``: :meth:`correct`'s, applied as it is; ``keep_override [T]``: the kept tokens,
        decided by the host."""
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
