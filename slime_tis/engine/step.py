"""``StepEngine``: one optimizer step on one rank, whatever the host (docs/hosts.md)::

    engine = StepEngine(cfg, reducer)
    totals = engine.begin(batches, pre_log_probs=..., pi_old_from_theta=...)   before the step's first loss
    out    = engine.loss(batch, lp_theta, entropy=...)                          each micro-batch, any order
    engine.record(out.stats)
    metrics = engine.end(step=n)                                                after the step's last loss

``begin`` computes the step's global scalars once (:func:`~slime_tis.engine.totals.step_totals`); each ``loss`` is the
core's ``policy_loss`` of its micro-batch with them; ``end`` reduces the recorded statistics once. A host whose own
schedule aggregates the loss passes ``totals=`` and may apply ``correct``'s correction itself. The collectives
depend on the configuration and the number of micro-batches only.
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
        inputs = correction_inputs(self.cfg, lp_train=lp_train, lp_rollout=batch.rollout_log_probs,
                                   advantages=batch.advantages, lp_theta=lp_theta,
                                   terms=term_inputs(self.cfg, batch, self.host_kl))
        return compute_tis(self.cfg, inputs.lp_train, inputs.lp_rollout, batch.loss_mask, batch.cu_seqlens,
                           reducer=self.reducer, batch_norm_factor=None if t is None else t.batch_norm_factor,
                           extra_finite=inputs.extra_finite, reject=reject, loss_finite=inputs.loss_finite,
                           searched=None if t is None else t.searched,
                           staleness=batch.staleness)

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
