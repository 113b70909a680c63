"""``tis_forward_backward_func``: wrap megatron's ``forward_backward_func`` so every step uses the correction.

One training call of the wrapped function (``forward_only=False``) does, in order:

1. materialise the step's ``num_microbatches`` items from ``data_iterator`` (one list per virtual stage);
2. algorithms 0, 2: the forward-only recompute of ``lp_old`` (``recompute.recompute_log_probs``);
3. on the last pipeline stage: the step plan (global denominator, token count, algorithm-2 batch-norm
   factor; ``plan.plan_step``) on megatron's DP / CP groups;
4. megatron's training schedule with the launcher's ``forward_step_func`` wrapped so that its loss
   function is ours (``loss.make_loss_func``);
5. the step metrics: merged, reduced once, finalized (``metrics.aggregate_metrics``) into ``last_metrics``.

``forward_only=True`` calls (evaluation) go straight to megatron.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from slime_tis.config import TISConfig
from slime_tis.core import MetricStats, Reducer
from slime_tis.megatron.batch import TISBatch
from slime_tis.megatron.loss import LossForm, loss_form_for, make_loss_func
from slime_tis.megatron.metrics import aggregate_metrics
from slime_tis.megatron.plan import StepPlan, needs_pre_pass, plan_step
from slime_tis.megatron.recompute import ReplayIterator, recompute_log_probs, replay

__all__ = ["TISForwardBackward", "tis_forward_backward_func", "default_get_tis_batch"]


def default_get_tis_batch(item: Any) -> TISBatch:
    """The micro-batch item is a dict carrying ``item["tis"]``, a :class:`TISBatch`."""
    if not isinstance(item, dict) or not isinstance(item.get("tis"), TISBatch):
        keys = f" with keys {sorted(item)}" if isinstance(item, dict) else ""
        raise ValueError("each micro-batch item must be a dict with item['tis'] = TISBatch(...) "
                         f"(got {type(item).__name__}{keys}); "
                         "or pass get_tis_batch= to tis_forward_backward_func")
    return item["tis"]


def _materialise(data_iterator: Any, num_microbatches: int, vpp: bool) -> Any:
    def take(it):
        if it is None:
            return None
        items = []
        for k in range(num_microbatches):
            try:
                items.append(next(it))
            except StopIteration:
                raise ValueError(f"data_iterator ran out after {k} of "
                                 f"num_microbatches={num_microbatches} items") from None
        return items

    if vpp:
        return [take(it) for it in data_iterator]
    return take(data_iterator)


class TISForwardBackward:
    """Callable with megatron's ``forward_backward_func`` keyword signature (see module docstring).

    Attributes:
        last_metrics: finalized metrics of the last training call (dict of float64 scalar tensors on the
            last pipeline stage, identical on its DP x CP ranks; ``{}`` elsewhere).
        last_plan: the :class:`StepPlan` of the last training call (last stage) or ``None``.
    """

    def __init__(self, forward_backward_func: Callable, cfg: TISConfig, *, temperature: float = 1.0,
                 chunk_size: int = 1024, get_tis_batch: Callable[[Any], TISBatch] = default_get_tis_batch,
                 reducer: Reducer | None = None) -> None:
        if not isinstance(cfg, TISConfig):
            raise ValueError(f"cfg must be a slime_tis.TISConfig, got {type(cfg).__name__}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"temperature must be a number > 0 (the rollout sampling temperature), "
                             f"got {temperature!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        self.forward_backward_func = forward_backward_func
        self.cfg = cfg
        self.temperature = float(temperature)
        self.chunk_size = chunk_size
        self.get_tis_batch = get_tis_batch
        self.reducer = reducer
        self.last_metrics: dict[str, Tensor] = {}
        self.last_plan: StepPlan | None = None

    def __call__(self, *, forward_step_func: Callable, data_iterator: Any, model: Any, num_microbatches: int,
                 forward_only: bool = False, **kwargs: Any) -> list:
        if forward_only:
            return self.forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=num_microbatches, forward_only=True, **kwargs)
        from megatron.core import parallel_state as ps
        from megatron.core.utils import get_model_config

        from slime_tis.megatron.reduce import MegatronReducer

        cfg = self.cfg
        chunks = model if isinstance(model, list) else [model]
        vpp = isinstance(data_iterator, list)
        items = _materialise(data_iterator, num_microbatches, vpp)
        is_last = ps.is_pipeline_last_stage(ignore_virtual=True)
        batches: list[TISBatch] | None = None
        if is_last:
            last_items = items[-1] if vpp else items
            if last_items is None:
                raise ValueError("the last pipeline stage needs a data_iterator yielding the TISBatch items")
            batches = [self.get_tis_batch(it) for it in last_items]
        reducer = self.reducer or MegatronReducer()
        pre: list[Tensor] | None = None
        if cfg.needs_old_log_probs or needs_pre_pass(cfg):
            lps = recompute_log_probs(
                self.forward_backward_func, forward_step_func, items, model, batches=batches,
                num_microbatches=num_microbatches, vpp=vpp, temperature=self.temperature,
                chunk_size=self.chunk_size, **kwargs)
            if batches is not None and lps is not None:
                if cfg.needs_old_log_probs:
                    for b, lp in zip(batches, lps):
                        b.old_log_probs = lp
                else:
                    pre = lps
        form = loss_form_for(get_model_config(chunks[0]), chunks, num_microbatches)
        plan = plan_step(cfg, batches, reducer, pre_log_probs=pre) if batches is not None else None
        collector: list[MetricStats] = []
        forward_step = self._wrap_forward_step(forward_step_func, batches, plan, form, reducer, collector)
        out = self.forward_backward_func(forward_step_func=forward_step, data_iterator=replay(items, vpp),
                                         model=model, num_microbatches=num_microbatches, forward_only=False,
                                         **kwargs)
        self.last_plan = plan
        self.last_metrics = aggregate_metrics(collector, reducer) if is_last else {}
        return out

    def _wrap_forward_step(self, forward_step_func: Callable, batches: list[TISBatch] | None,
                           plan: StepPlan | None, form: LossForm, reducer: Reducer,
                           collector: list[MetricStats]) -> Callable:
        cfg, temperature, chunk_size = self.cfg, self.temperature, self.chunk_size

        def forward_step(data_iterator, model_chunk, *args):
            output, user_loss_func = forward_step_func(data_iterator, model_chunk, *args)
            if batches is None or plan is None or not isinstance(data_iterator, ReplayIterator):
                return output, user_loss_func  # not the last stage: megatron never calls the loss here
            batch = batches[data_iterator.index]
            return output, make_loss_func(cfg, batch, plan, form, reducer, collector=collector,
                                          temperature=temperature, chunk_size=chunk_size)

        return forward_step


def tis_forward_backward_func(forward_backward_func: Callable, cfg: TISConfig, *, temperature: float = 1.0,
                              chunk_size: int = 1024,
                              get_tis_batch: Callable[[Any], TISBatch] = default_get_tis_batch,
                              reducer: Reducer | None = None) -> TISForwardBackward:
    """Wrap megatron's ``get_forward_backward_func()`` result with the rollout correction (see module doc)."""
    return TISForwardBackward(forward_backward_func, cfg, temperature=temperature, chunk_size=chunk_size,
                              get_tis_batch=get_tis_batch, reducer=reducer)
