"""slime's hooks as calls of the step engine (:class:`slime_tis.engine.step.StepEngine`).

slime calls this package's hooks by path, one at a time, in one training process. Each hook translates slime's
per-sample lists into the engine's packed micro-batch (:func:`micro_batch`) and its call into engine calls:

======================================  ======================================================================
slime's call                            engine calls
======================================  ======================================================================
rollout-data hook, once per rollout     ``decide``: the rollout's correction from pi_old where ``drop``'s counts
                                        or the batch normalisation need it (:func:`decide_rollout`), kept for
                                        every step and micro-batch of the rollout
TIS function, per micro-batch           ``correct``: the kept decision of its samples (:func:`kept_part`)
                                        finished with ``pg_loss``'s finiteness, or one correction now
custom loss, per micro-batch            ``correct`` where ``drop`` counts in the micro-batch, then ``loss``
both, per micro-batch                   ``record`` (:data:`slime_tis.slime.metrics.COLLECTOR`, once per
                                        micro-batch)
before-train-step hook                  ``end``: the previous step's exact metrics
======================================  ======================================================================

slime aggregates the loss itself (per-rollout means, :mod:`slime_tis.slime.rollouts`), so the engine's totals are
the host's (:func:`step_engine`): denominator 1 (the custom loss folds slime's means into per-token coefficients
on the advantages and takes one token sum) and the rollout's batch-normalisation factor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from slime_tis.core import Reducer, TISResult
from slime_tis.engine.batch import TISBatch
from slime_tis.engine.step import StepEngine
from slime_tis.engine.subset import decision_part
from slime_tis.engine.totals import StepTotals
from slime_tis.slime.batch import SlimePacked
from slime_tis.slime.metrics import COLLECTOR
from slime_tis.slime.state import STATE

__all__ = ["RolloutDecision", "decide_rollout", "kept_part", "micro_batch", "step_engine"]


def micro_batch(packed: SlimePacked, *, advantages: Tensor | None, rollout_log_probs: Tensor,
                old_log_probs: Tensor | None = None, ref_log_probs: Tensor | None = None) -> TISBatch:
    """One slime micro-batch (or rollout) as the engine's packed batch: this CP rank's response tokens, sample by
    sample (slime predicts no labels here: the engine's corrections and losses read none)."""
    mask = packed.local_mask
    labels = torch.zeros((), dtype=torch.int64, device=mask.device).expand(mask.shape[0])
    return TISBatch(labels=labels, loss_mask=mask, advantages=advantages, cu_seqlens=packed.cu_seqlens,
                    rollout_log_probs=rollout_log_probs, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs)


def step_engine(cfg: Any, reducer: Reducer, device: torch.device, *,
                batch_norm_factor: Tensor | None = None, host_kl: bool = False) -> StepEngine:
    """The engine of one slime hook call: slime's totals (module docstring); its records go to the step's
    :data:`~slime_tis.slime.metrics.COLLECTOR`; ``host_kl``: the custom loss adds slime's KL term
    (:func:`slime_tis.slime.kept.custom_loss_kl`)."""
    one = torch.ones((), device=device)  # a device tensor: a Python float would sync the host
    return StepEngine(cfg, reducer, totals=StepTotals(one, one, batch_norm_factor, 1), collector=COLLECTOR.records,
                      host_kl=host_kl)


@dataclass(frozen=True)
class RolloutDecision:
    """The rollout's correction from pi_old (``lp``: the per-sample tensors it read), kept by the rollout-data
    hook for the TIS function's micro-batches (:func:`kept_part`)."""

    cfg: Any
    packed: SlimePacked
    lp: tuple[Tensor, ...]
    result: TISResult


def decide_rollout(cfg: Any, packed: SlimePacked, lp: Sequence[Tensor], batch: TISBatch, reducer: Reducer, *,
                   keep: bool, host_kl: bool = False) -> TISResult:
    """``StepEngine.decide`` of the whole rollout ``batch`` (its ``old_log_probs``: ``lp``, the CP-local per-sample
    pi_old, concatenated); with ``keep`` remembered for the rollout's micro-batches."""
    res = StepEngine(cfg, reducer, host_kl=host_kl).decide(batch)
    if keep:
        STATE.decision = RolloutDecision(cfg, packed, tuple(lp), res)
    return res


def kept_part(engine: StepEngine, batch: TISBatch, loss_masks: Sequence[Tensor], lp: Sequence[Tensor],
              packed: SlimePacked) -> None:
    """Keep the rollout decision's part for the micro-batch ``batch`` (slime's ``loss_masks``, its pi_old ``lp``)
    in ``engine.decisions`` when the rollout-data hook decided every one of its samples from these very tensors
    with this configuration; the engine's ``correct`` then finishes it with ``pg_loss``'s finiteness instead of
    correcting again. The rollout was decided with its advantages, from which slime's ``pg_loss`` is computed (not
    finite wherever they are not), so the finished part is the micro-batch's own correction. Whether it is found
    depends on the configuration and slime's object flow, the same on every rank, never on the data. Memory: the
    kept decision holds a few per-token tensors of the rollout (this rank's tokens) until the next rollout."""
    d = STATE.decision
    if d is None or d.cfg != engine.cfg or not loss_masks:
        return
    idx = STATE.rollouts.indices(loss_masks)
    if idx is None or any(d.lp[i] is not t for i, t in zip(idx, lp)):
        return
    rows = torch.tensor(idx, dtype=torch.int64)
    starts = d.packed.local_starts()[rows]
    mine = torch.repeat_interleave(torch.arange(len(idx)), packed.local_lengths)  # CPU: lengths are host integers
    tokens = torch.arange(mine.shape[0]) - packed.local_starts()[mine] + starts[mine]
    device = batch.loss_mask.device
    engine.decisions.put(batch, decision_part(d.result, rows.to(device, non_blocking=True),
                                             tokens.to(device, non_blocking=True), mine.to(device, non_blocking=True)))
