"""The ``loss_func`` megatron-core's schedules call on the last pipeline stage, and its return form.

``make_loss_func(...)(output_tensor)``:

    lp_theta, H = output_to_log_probs(output_tensor, batch)                            [T] fp32
                  (``recompute``: vocab-parallel log-softmax of logits / temperature, or the fused
                  output layer from the hidden states)
    out         = engine.loss(batch, lp_theta, entropy=H)                            loss = local_sum / D
                  (``engine.step.StepEngine``: the core's policy_loss with the step totals D, f)

(the surrogate, the KL and entropy terms and the aggregation are the configuration's, all in the core).

and returns the schedule's form (:class:`LossForm`), pre-compensating megatron's own scaling so that the final
parameter gradient is ``sum_{micro-batches, DP x CP ranks} grad(local_sum) / D``: the 2-tuple
``(loss * M * g / cp, metrics)`` (``g``: the wrapper's gradient divisor, read by ``grad_scale``) or, with
``calculate_per_token_loss``, the 3-tuple ``(loss * N, n_local, metrics)`` (the derivation: docs/megatron.md, "Which
return form, and why"). The metrics dict holds detached clones, its ``"loss"`` Megatron-LM's reporting pair
(``loss_dict.py``); the micro-batch's ``MetricStats`` go to the engine (``record``) for one reduction after the
schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from slime_tis.config import TISConfig
from slime_tis.core import MetricStats, Reducer
from slime_tis.core.correction import as_valid_mask
from slime_tis.engine.batch import TISBatch
from slime_tis.engine.settings import CHUNK_SIZE, LogProbSettings
from slime_tis.engine.step import StepEngine
from slime_tis.engine.totals import StepTotals
from slime_tis.megatron.loss_dict import report_pair
from slime_tis.megatron.recompute import output_to_log_probs
from slime_tis.megatron.schedule import MicroBatchCounter

__all__ = ["LossForm", "loss_form_for", "make_loss_func", "loss_func_for", "forward_step_with_tis_loss"]


@dataclass(frozen=True)
class LossForm:
    """How megatron will rescale the returned loss (see module docstring).

    Attributes:
        per_token: ``config.calculate_per_token_loss`` (3-tuple form) or not (2-tuple form).
        num_microbatches: ``M``.
        cp_size: context-parallel size (the schedule multiplies a 2-tuple loss by it).
        grad_average: ``g``, the factor the data-parallel wrapper divides the summed gradient by
            (``grad_scale.data_parallel_grad_average``: ``dp * cp`` for megatron DDP).
        report_ranks: DP x CP ranks Megatron-LM's ``train_step`` all-reduces the loss report over.
    """

    per_token: bool
    num_microbatches: int
    cp_size: int
    grad_average: float
    report_ranks: int = 1

    @property
    def two_tuple_scale(self) -> float:
        return self.num_microbatches * self.grad_average / self.cp_size


def loss_form_for(model_config, model_chunks: list, num_microbatches: int, *,
                  grad_average: float | None = None) -> LossForm:
    """Read megatron's scaling conventions from the model config and the data-parallel wrapper itself
    (``grad_scale.data_parallel_grad_average``; ``grad_average`` overrides it for unknown wrappers)."""
    from megatron.core import parallel_state as ps

    from slime_tis.megatron.grad_scale import data_parallel_grad_average

    per_token = bool(getattr(model_config, "calculate_per_token_loss", False))
    if per_token and getattr(model_config, "finalize_model_grads_func", None) is None:
        raise ValueError("config.calculate_per_token_loss=True needs config.finalize_model_grads_func "
                         "(megatron divides the gradients by the global token count there)")
    cp = ps.get_context_parallel_world_size()
    dp_cp = ps.get_data_parallel_world_size(with_context_parallel=True)
    g = data_parallel_grad_average(model_chunks, dp_cp_size=dp_cp, per_token=per_token, override=grad_average)
    return LossForm(per_token=per_token, num_microbatches=num_microbatches, cp_size=cp, grad_average=g,
                    report_ranks=dp_cp)


def make_loss_func(cfg: TISConfig, batch: TISBatch, totals: StepTotals, form: LossForm, reducer: Reducer, *,
                   collector: list[MetricStats], temperature: float = 1.0, chunk_size: int = CHUNK_SIZE,
                   model_chunk=None, output_layer: str | None = None,
                   pi_old_from_theta: bool = False) -> Callable[[Tensor], tuple]:
    """Build megatron's ``loss_func(output_tensor)`` for one micro-batch (see module docstring).

    ``pi_old_from_theta``: a batch without ``old_log_probs`` takes ``lp_old = sg(lp_theta)`` from this very
    forward (one optimizer step per rollout: the step starts at the rollout's parameters, so that *is* pi_old).

    ``model_chunk`` (the chunk the schedule ran; its output weight) and ``temperature``, ``chunk_size``,
    ``output_layer`` (``None``, ``"fp32"``, ``"fused"``; with ``cfg.kernels`` the step's
    :class:`~slime_tis.engine.settings.LogProbSettings`) select how log-probs are taken from ``output_tensor``
    (:func:`output_to_log_probs`). The micro-batch's statistics go to ``collector``.
    """
    engine = StepEngine(cfg, reducer, totals=totals, collector=collector)
    settings = LogProbSettings(temperature, chunk_size, output_layer, cfg.kernels)
    return loss_func_for(engine, batch, form, settings=settings, model_chunk=model_chunk,
                         pi_old_from_theta=pi_old_from_theta)


def loss_func_for(engine: StepEngine, batch: TISBatch, form: LossForm, *, settings: LogProbSettings,
                  model_chunk=None, pi_old_from_theta: bool = False) -> Callable[[Tensor], tuple]:
    """:func:`make_loss_func` on the step's engine (its totals, reducer and statistics), the log-prob settings
    passed whole: megatron's output -> ``lp_theta`` -> ``engine.loss`` -> the schedule's return form."""

    def loss_func(output_tensor: Tensor, non_loss_data: bool = False):
        lp, entropy = output_to_log_probs(output_tensor, batch, settings, model_chunk=model_chunk,
                                          with_entropy=engine.cfg.entropy_coef != 0.0)
        lp_old = lp.detach() if batch.old_log_probs is None and pi_old_from_theta else None
        out = engine.loss(batch, lp, entropy=entropy, lp_old=lp_old)
        valid = as_valid_mask(batch.loss_mask)
        engine.record(out.stats.merge(MetricStats(token_sums={"megatron.loss_sum": out.loss.detach().clone()})))
        metrics = {"loss": report_pair(out.loss.detach() * (form.num_microbatches * form.report_ranks))}
        if form.per_token:
            n_local = valid.sum().to(torch.int)
            return out.loss * engine.totals.num_tokens, n_local, metrics
        return out.loss * form.two_tuple_scale, metrics

    return loss_func


def forward_step_with_tis_loss(forward_step_func: Callable, engine: StepEngine | None,
                               batches: list[TISBatch] | None, form: LossForm, *, settings: LogProbSettings,
                               pi_old_from_theta: bool = False) -> Callable:
    """The launcher's ``forward_step_func`` with this step's loss function: micro-batch ``k`` (counted per model
    chunk, :class:`~slime_tis.megatron.schedule.MicroBatchCounter`) gets the loss function of ``batches[k]``.
    Off the last pipeline stage (``engine`` / ``batches`` ``None``) the launcher's own loss function is returned:
    megatron never calls it there."""
    counter = MicroBatchCounter()

    def forward_step(data_iterator, model_chunk, *args, **kwargs):
        index = counter.next_index(model_chunk)
        output, user_loss_func = forward_step_func(data_iterator, model_chunk, *args, **kwargs)
        if batches is None or engine is None:
            return output, user_loss_func
        return output, loss_func_for(engine, batches[index], form, settings=settings, model_chunk=model_chunk,
                                     pi_old_from_theta=pi_old_from_theta)

    return forward_step
