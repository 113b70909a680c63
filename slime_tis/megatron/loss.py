"""The ``loss_func`` megatron-core's schedules call on the last pipeline stage: megatron's output -> ``lp_theta``
(``recompute.output_to_log_probs``) -> ``engine.loss`` -> the schedule contract's return form and ``"loss"`` report
(``slime_tis.engine.megatron_schedule``; docs/megatron.md, "The schedule contract"). The micro-batch's
``MetricStats`` go to the engine (``record``) for one reduction after the schedule.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from slime_tis.config import TISConfig
from slime_tis.core import MetricStats, Reducer
from slime_tis.engine.batch import TISBatch
from slime_tis.engine.megatron_schedule import LossForm
from slime_tis.engine.megatron_schedule import loss_form_for as schedule_loss_form
from slime_tis.engine.settings import CHUNK_SIZE, LogProbSettings
from slime_tis.engine.step import StepEngine
from slime_tis.engine.totals import StepTotals
from slime_tis.megatron.recompute import output_to_log_probs
from slime_tis.megatron.schedule import MicroBatchCounter

__all__ = ["LossForm", "loss_form_for", "make_loss_func", "loss_func_for", "forward_step_with_tis_loss"]


def loss_form_for(model_config, model_chunks: list, num_microbatches: int, *,
                  grad_average: float | None = None) -> LossForm:
    """The hook's :class:`LossForm`: ``calculate_per_token_loss`` from the model config (which then needs
    ``finalize_model_grads_func``), the rest from ``megatron_schedule.loss_form_for``."""
    per_token = bool(getattr(model_config, "calculate_per_token_loss", False))
    if per_token and getattr(model_config, "finalize_model_grads_func", None) is None:
        raise ValueError("config.calculate_per_token_loss=True needs config.finalize_model_grads_func "
                         "(megatron divides the gradients by the global token count there)")
    return schedule_loss_form(model_chunks, num_microbatches, per_token=per_token, grad_average=grad_average)


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
    settings = LogProbSettings(temperature, chunk_size, output_layer, cfg.kernels, cfg.sampling_support)
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
        engine.record(out.stats.merge(MetricStats(token_sums={"megatron.loss_sum": out.loss.detach().clone()})))
        return form.returns(out.loss, engine.totals.num_tokens, batch.loss_mask, {"loss": form.loss_pair(out.loss)})

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
