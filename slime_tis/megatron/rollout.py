"""pi_old once per rollout: ``compute_old_log_probs`` over all of a rollout's micro-batches, before its
first optimizer step.

PPO's ratio ``rho = pi_theta / pi_old`` needs ``pi_old`` fixed for the whole rollout: the policy that the
rollout's first optimizer step starts from. A rollout trained with ``N`` optimizer steps (slime's
``--num-steps-per-rollout``: the rollout's global batch split into ``N`` steps) and ``K`` PPO epochs over
it must use the same ``pi_old`` in every one of its ``N * K`` steps; recomputing it at the start of each
step makes ``rho = 1`` there and the clip never acts. slime and verl compute it in one forward-only pass
over the whole rollout before training on it; so does this function:

    items = compute_old_log_probs(get_forward_backward_func(), forward_step, data_iterator, model,
                                  num_microbatches=M, num_steps=N, seq_length=S, micro_batch_size=B)
    for epoch in range(K):
        for step in range(N):
            forward_backward(forward_step_func=forward_step, data_iterator=rollout_step_iterator(items, step, M),
                             model=model, num_microbatches=M, seq_length=S, micro_batch_size=B,
                             forward_only=False)
            optimizer.step()

It reads ``N * M`` items from ``data_iterator``, runs megatron's schedule with ``forward_only=True``
under ``torch.no_grad()`` ``N`` times with ``M`` micro-batches each (the same schedule arguments as the
training steps, so pipeline shapes and micro-batch sizes are those of training), and stores
``log pi(labels)`` (float32, logits divided by ``temperature``) in each item's
``TISBatch.old_log_probs`` on the last pipeline stage. Every rank of the job calls it with the same
arguments (it is collective like a training step). Under TP > 1 the ``TISBatch`` items of TP rank 0 are
broadcast to the other TP ranks first (``tp_data``), as in a training step.

``fused_output_layer=True`` / ``fp32_lm_head=True`` (the hook's ``--tis-fused-output-layer`` /
``--tis-fp32-lm-head``) run the pass with the model's output layer in that mode and take the log-probs as the
training loss does, so pi_old and pi_theta come from the same kernel (``recompute.recompute_log_probs``).

``TISForwardBackward.compute_old_log_probs`` does the same with the hook's temperature, chunk size, item
accessor and output-layer mode, and tells the hook that pi_old is now supplied (it never recomputes it
afterwards).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from slime_tis.engine.batch import TISBatch
from slime_tis.engine.settings import CHUNK_SIZE, LogProbSettings, output_layer_of
from slime_tis.megatron.output_layer import model_output_mode
from slime_tis.megatron.recompute import forward_only_log_probs
from slime_tis.megatron.schedule import materialise, step_items
from slime_tis.megatron.tp_data import default_get_tis_batch, step_batches

__all__ = ["compute_old_log_probs", "rollout_old_log_probs", "rollout_step_iterator"]


def _is_vpp(model: Any) -> bool:
    return isinstance(model, list) and len(model) > 1


def rollout_step_iterator(items: Any, step: int, num_microbatches: int) -> Any:
    """An iterator over the ``num_microbatches`` items of optimizer step ``step`` of a rollout's items
    (as returned by :func:`compute_old_log_probs`; one iterator per virtual stage for a list of lists;
    ``None`` stays ``None``)."""
    chunk = step_items(items, step, num_microbatches)
    if chunk is None:
        return None
    if chunk and isinstance(items[0], list):
        return [iter(c) if c is not None else None for c in chunk]
    return iter(chunk)


def compute_old_log_probs(forward_backward_func: Callable, forward_step_func: Callable, data_iterator: Any,
                          model: Any, *, num_microbatches: int, num_steps: int = 1, temperature: float = 1.0,
                          chunk_size: int = CHUNK_SIZE,
                          get_tis_batch: Callable[[Any], TISBatch] = default_get_tis_batch,
                          broadcast_over_tp: bool = True, fused_output_layer: bool = False,
                          fp32_lm_head: bool = False, kernels: str = "torch", run_pass: bool = True,
                          **schedule_kwargs: Any) -> Any:
    """Fill ``TISBatch.old_log_probs`` of a whole rollout at the current parameters (module docstring).

    Args:
        forward_backward_func: megatron's schedule (``get_forward_backward_func()``), not the hook.
        forward_step_func: the launcher's ``forward_step(data_iterator, model)`` returning ``(logits, _)``.
        data_iterator: yields the rollout's ``num_steps * num_microbatches`` micro-batch items (or is a list
            of them); a list with one per model chunk for virtual pipeline stages; ``None`` on ranks that
            get no data (their items come from TP rank 0).
        num_microbatches: micro-batches per optimizer step (``M``).
        num_steps: optimizer steps the rollout is split into (``N``).
        fused_output_layer, fp32_lm_head: the output-layer mode of the training steps (mutually exclusive).
        kernels: ``TISConfig.kernels`` of the training steps (``"torch"`` or ``"triton"``).
        schedule_kwargs: the training steps' schedule arguments (``seq_length``, ``micro_batch_size``, ...).
        run_pass: ``False`` materialises the items without a forward (algorithms 1 and 3 never read pi_old; the
            hook passes its algorithm's ``needs_pi_old``, ``core.algorithms``).

    Returns:
        The materialised items (a list, a list per model chunk, or ``None``), to be replayed to the
        training steps with :func:`rollout_step_iterator`; their ``TISBatch.old_log_probs`` hold pi_old
        (``[T]`` float32, on the last pipeline stage; overwritten if present).
    """
    settings = LogProbSettings(temperature, chunk_size, output_layer_of(fused_output_layer, fp32_lm_head), kernels)
    return rollout_old_log_probs(forward_backward_func, forward_step_func, data_iterator, model,
                                 num_microbatches=num_microbatches, num_steps=num_steps, settings=settings,
                                 get_tis_batch=get_tis_batch, broadcast_over_tp=broadcast_over_tp, run_pass=run_pass,
                                 **schedule_kwargs)


def rollout_old_log_probs(forward_backward_func: Callable, forward_step_func: Callable, data_iterator: Any,
                          model: Any, *, num_microbatches: int, num_steps: int, settings: LogProbSettings,
                          get_tis_batch: Callable[[Any], TISBatch], broadcast_over_tp: bool, run_pass: bool,
                          **schedule_kwargs: Any) -> Any:
    """:func:`compute_old_log_probs` with the log-prob settings passed whole (the hook's)."""
    for name, value in (("num_microbatches", num_microbatches), ("num_steps", num_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    from megatron.core import parallel_state as ps

    vpp = _is_vpp(model)
    items = materialise(data_iterator, num_steps * num_microbatches, vpp)
    is_last = ps.is_pipeline_last_stage(ignore_virtual=True)
    if not run_pass:
        return items
    with model_output_mode(model, settings.output_layer):
        _fill_old_log_probs(forward_backward_func, forward_step_func, items, model, num_microbatches=num_microbatches,
                            num_steps=num_steps, vpp=vpp, is_last=is_last, settings=settings,
                            get_tis_batch=get_tis_batch, broadcast_over_tp=broadcast_over_tp, **schedule_kwargs)
    return items


def _fill_old_log_probs(forward_backward_func: Callable, forward_step_func: Callable, items: Any, model: Any, *,
                        num_microbatches: int, num_steps: int, vpp: bool, is_last: bool, settings: LogProbSettings,
                        get_tis_batch: Callable[[Any], TISBatch], broadcast_over_tp: bool,
                        **schedule_kwargs: Any) -> None:
    """One forward-only pass per optimizer step; pi_old into the items' ``TISBatch`` (last stage)."""
    for step in range(num_steps):
        items_k = step_items(items, step, num_microbatches)
        local: list[TISBatch] | None = None
        batches: list[TISBatch] | None = None
        if is_last:
            local, batches = step_batches(items_k, vpp=vpp, get_tis_batch=get_tis_batch, broadcast=broadcast_over_tp)
        lps: list[Tensor] | None = forward_only_log_probs(
            forward_backward_func, forward_step_func, items_k, model, batches=batches,
            num_microbatches=num_microbatches, vpp=vpp, settings=settings, **schedule_kwargs)
        if lps is not None:
            for target in (batches, local):
                for b, lp in zip(target or [], lps):
                    b.old_log_probs = lp
