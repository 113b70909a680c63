"""Log-probs ``log pi(labels)`` of the model's output (the loss and every pass take them here) and the forward-only
passes recording them, per training call and pi_old once per rollout (docs/megatron.md, "pi_old: once per rollout"):
megatron's schedule with ``forward_only=True`` under ``torch.no_grad()``, float32, last pipeline stage only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from slime_tis.engine.batch import TISBatch
from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy
from slime_tis.engine.settings import CHUNK_SIZE, LogProbSettings, output_layer_of
from slime_tis.megatron.output_layer import (
    fused_log_probs,
    model_output_mode,
    returns_hidden_states,
    warn_if_upcast_logits,
)
from slime_tis.megatron.schedule import (
    default_get_tis_batch,
    materialise,
    replay,
    step_batches,
    step_items,
    with_loss_funcs,
)

__all__ = ["logits_to_log_probs", "output_to_log_probs", "forward_only_log_probs", "recompute_log_probs",
           "compute_old_log_probs", "rollout_step_iterator"]


def replayed_support(batch: TISBatch, settings: LogProbSettings) -> tuple[Tensor, Tensor] | None:
    """The micro-batch's sampling support where the log-probs replay it (``settings.sampling_support``
    ``"replay"``, or ``None`` and the batch carries one), else ``None``; ``"replay"`` without one is refused."""
    if settings.sampling_support == "full" or (batch.support_ids is None and settings.sampling_support is None):
        return None
    if batch.support_ids is None:
        raise ValueError("--tis-sampling-support replay (sampling_support='replay') but the micro-batch's TISBatch "
                         "carries no support (support_ids / support_offsets): parse the rollouts with "
                         "sampling_support=True, or use --tis-sampling-support full")
    return batch.support_ids, batch.support_offsets


def logits_to_log_probs(logits: Tensor, batch: TISBatch, settings: LogProbSettings, *,
                        with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """``[..., V/TP]`` logits -> ``(lp [T], entropy [T] | None)`` aligned with ``batch``; 0 (and no gradient)
    outside ``batch.loss_mask``."""
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.shape[0] != batch.num_tokens:
        raise ValueError(
            f"logits have {flat.shape[0]} positions ({tuple(logits.shape)}) but the micro-batch's TISBatch "
            f"has {batch.num_tokens} tokens; build it with TISBatch.from_padded(..., cp_slice=True) for CP, "
            "and return [B, S_local, V/TP] logits (model called without labels)")
    return vocab_parallel_log_probs_and_entropy(flat, batch.labels, temperature=settings.temperature,
                                                chunk_size=settings.chunk_size, with_entropy=with_entropy,
                                                row_mask=batch.loss_mask, kernels=settings.kernels,
                                                support=replayed_support(batch, settings))


def output_to_log_probs(output_tensor: Tensor, batch: TISBatch, settings: LogProbSettings, *, model_chunk=None,
                        with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """The model's output for one micro-batch -> ``(lp [T], entropy | None)`` per ``settings.output_layer``:
    logits (``None``, ``"fp32"``) or hidden states ``[B, S, H]`` with ``model_chunk``'s output weight
    (``"fused"``). A chunk in fused mode while the hook is not is refused (its hidden states would be read as
    logits)."""
    if settings.output_layer == "fused":
        if model_chunk is None:
            raise ValueError("output_layer='fused' needs the model chunk (its output weight) in the loss function")
        lp, entropy = fused_log_probs(model_chunk, output_tensor, batch.labels, temperature=settings.temperature,
                                      loss_mask=batch.loss_mask, kernels=settings.kernels,
                                      support=replayed_support(batch, settings))
        return lp, (entropy if with_entropy else None)
    if model_chunk is not None and returns_hidden_states(model_chunk):
        raise ValueError("the model's output layer returns hidden states (use_fused_output_layer was applied) "
                         "but the hook was built without fused_output_layer=True (--tis-fused-output-layer)")
    if settings.output_layer is None:
        warn_if_upcast_logits(output_tensor, model_chunk)
    return logits_to_log_probs(output_tensor, batch, settings, with_entropy=with_entropy)


def recompute_log_probs(forward_backward_func: Callable, forward_step_func: Callable, items: Any, model: Any, *,
                        batches: list[TISBatch] | None, num_microbatches: int, vpp: bool,
                        temperature: float = 1.0, chunk_size: int = CHUNK_SIZE, output_layer: str | None = None,
                        kernels: str = "torch", **schedule_kwargs: Any) -> list[Tensor] | None:
    """:func:`forward_only_log_probs` with the model in the output mode ``output_layer``: ``[lp_k [T_k]]`` on the
    last stage (``batches``: its ``TISBatch`` per micro-batch), ``None`` elsewhere. ``items``: the materialised
    micro-batch items; ``schedule_kwargs`` go to the schedule."""
    settings = LogProbSettings(temperature, chunk_size, output_layer, kernels)
    with model_output_mode(model, settings.output_layer):
        return forward_only_log_probs(forward_backward_func, forward_step_func, items, model, batches=batches,
                                      num_microbatches=num_microbatches, vpp=vpp, settings=settings,
                                      **schedule_kwargs)


def forward_only_log_probs(forward_backward_func: Callable, forward_step_func: Callable, items: Any, model: Any, *,
                           batches: list[TISBatch] | None, num_microbatches: int, vpp: bool,
                           settings: LogProbSettings, **schedule_kwargs: Any) -> list[Tensor] | None:
    """:func:`recompute_log_probs` inside the caller's ``model_output_mode``."""
    results: list[Tensor | None] = [None] * num_microbatches

    def loss_func_of(index: int, model_chunk: Any) -> Callable:
        def loss_func(output_tensor: Tensor, non_loss_data: bool = False):
            if batches is None:
                raise RuntimeError("recompute: loss on a rank without TISBatch micro-batches (not the last stage?)")
            lp, _ = output_to_log_probs(output_tensor, batches[index], settings, model_chunk=model_chunk,
                                        with_entropy=False)
            results[index] = lp.detach()
            return torch.zeros((), dtype=torch.float32, device=lp.device), {}

        return loss_func

    with torch.no_grad():
        forward_backward_func(forward_step_func=with_loss_funcs(forward_step_func, loss_func_of),
                              data_iterator=replay(items, vpp), model=model, num_microbatches=num_microbatches,
                              forward_only=True, **schedule_kwargs)
    if batches is None:
        return None
    if any(r is None for r in results):
        raise RuntimeError("recompute: the schedule did not compute the loss of every micro-batch")
    return results  # type: ignore[return-value]


def rollout_step_iterator(items: Any, step: int, num_microbatches: int) -> Any:
    """An iterator over optimizer step ``step``'s items of a rollout's items (from :func:`compute_old_log_probs`;
    one per virtual stage for a list of lists; ``None`` stays ``None``)."""
    return replay(step_items(items, step, num_microbatches), vpp=bool(items) and isinstance(items[0], list))


def compute_old_log_probs(forward_backward_func: Callable, forward_step_func: Callable, data_iterator: Any,
                          model: Any, *, num_microbatches: int, num_steps: int = 1, temperature: float = 1.0,
                          chunk_size: int = CHUNK_SIZE,
                          get_tis_batch: Callable[[Any], TISBatch] = default_get_tis_batch,
                          broadcast_over_tp: bool = True, fused_output_layer: bool = False,
                          fp32_lm_head: bool = False, kernels: str = "torch", sampling_support: str | None = None,
                          run_pass: bool = True, **schedule_kwargs: Any) -> Any:
    """pi_old of a whole rollout at the current parameters: reads ``num_steps * num_microbatches`` items, runs one
    forward-only pass per optimizer step with the training steps' ``schedule_kwargs`` and stores ``lp [T]``
    float32 in each item's ``TISBatch.old_log_probs`` (last stage; overwritten if present). Collective: every rank
    calls it. ``run_pass=False`` only materialises the items (algorithms 1 and 3 never read pi_old). Returns the
    items (a list, a list per model chunk, or ``None``) for :func:`rollout_step_iterator`."""
    settings = LogProbSettings(temperature, chunk_size, output_layer_of(fused_output_layer, fp32_lm_head), kernels,
                               sampling_support)
    for name, value in (("num_microbatches", num_microbatches), ("num_steps", num_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    from megatron.core import parallel_state as ps

    vpp = isinstance(model, list) and len(model) > 1
    items = materialise(data_iterator, num_steps * num_microbatches, vpp)
    if not run_pass:
        return items
    is_last = ps.is_pipeline_last_stage(ignore_virtual=True)
    with model_output_mode(model, settings.output_layer):
        for step in range(num_steps):
            items_k = step_items(items, step, num_microbatches)
            local = batches = None
            if is_last:
                local, batches = step_batches(items_k, vpp=vpp, get_tis_batch=get_tis_batch,
                                              broadcast=broadcast_over_tp)
            lps = forward_only_log_probs(forward_backward_func, forward_step_func, items_k, model, batches=batches,
                                         num_microbatches=num_microbatches, vpp=vpp, settings=settings,
                                         **schedule_kwargs)
            for target in (batches, local) if lps is not None else ():
                for b, lp in zip(target or [], lps):
                    b.old_log_probs = lp
    return items
