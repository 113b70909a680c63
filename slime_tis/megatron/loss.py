"""The ``loss_func`` megatron-core's schedules call on the last pipeline stage: the model's output -> ``lp_theta``
(``recompute.output_to_log_probs``) -> ``StepEngine.loss`` -> the return form and ``"loss"`` report of the schedule
contract (``slime_tis.engine.megatron_schedule``); the micro-batch's statistics go to the engine.
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
from slime_tis.megatron.schedule import with_loss_funcs

__all__ = ["LossForm", "loss_form_for", "make_loss_func", "loss_func_for", "forward_step_with_tis_loss"]


def loss_form_for(model_config, model_chunks: list, num_microbatches: int, *,
                  grad_average: float | None = None) -> LossForm:
    """The contract's :class:`LossForm` with ``per_token`` = ``model_config.calculate_per_token_loss`` (which needs
    ``finalize_model_grads_func``)."""
    per_token = bool(getattr(model_config, "calculate_per_token_loss", False))
    if per_token and getattr(model_config, "finalize_model_grads_func", None) is None:
        raise ValueError("config.calculate_per_token_loss=True needs config.finalize_model_grads_func "
                         "(megatron divides the gradients by the global token count there)")
    return schedule_loss_form(model_chunks, num_microbatches, per_token=per_token, grad_average=grad_average)


def make_loss_func(cfg: TISConfig, batch: TISBatch, totals: StepTotals, form: LossForm, reducer: Reducer, *,
                   collector: list[MetricStats], temperature: float = 1.0, chunk_size: int = CHUNK_SIZE,
                   model_chunk=None, output_layer: str | None = None,
                   pi_old_from_theta: bool = False) -> Callable[[Tensor], tuple]:
    """:func:`loss_func_for` on a fresh engine holding ``totals``; the statistics go to ``collector``."""
    engine = StepEngine(cfg, reducer, totals=totals, collector=collector)
    settings = LogProbSettings(temperature, chunk_size, output_layer, cfg.kernels, cfg.sampling_support)
    return loss_func_for(engine, batch, form, settings=settings, model_chunk=model_chunk,
                         pi_old_from_theta=pi_old_from_theta)


def loss_func_for(engine: StepEngine, batch: TISBatch, form: LossForm, *, settings: LogProbSettings,
                  model_chunk=None, pi_old_from_theta: bool = False) -> Callable[[Tensor], tuple]:
    """Megatron's ``loss_func(output_tensor)`` for ``batch``. ``pi_old_from_theta``: a batch without
    ``old_log_probs`` takes ``lp_old = sg(lp_theta)`` of this forward (one optimizer step per rollout)."""

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
    """The launcher's ``forward_step`` with micro-batch ``k``'s loss function for ``batches[k]``; off the last
    stage (``batches`` ``None``) the launcher's own, which megatron never calls there."""

    def loss_func_of(index: int, model_chunk) -> Callable | None:
        if batches is None or engine is None:
            return None
        return loss_func_for(engine, batches[index], form, settings=settings, model_chunk=model_chunk,
                             pi_old_from_theta=pi_old_from_theta)

    return with_loss_funcs(forward_step_func, loss_func_of)
