"""Forward-only pass over a step's micro-batches that records ``log pi(labels)`` at the current parameters.

Used for the old-log-prob recompute of algorithms 0 and 2 (``lp_old``, the "proximal" policy at the
start of the step) and skipped for algorithms 1 and 3, which use the rollout log-probs instead (unless
``--tis-rejected-denominator drop`` needs the step's kept-token count before the first backward, see
``plan.needs_pre_pass``). It runs megatron's own schedule with ``forward_only=True`` under
``torch.no_grad()``, so pipeline stages exchange activations exactly as in training; the log-probs
(float32, logits divided by the rollout temperature) exist on the last stage only. With an output-layer
mode (``"fused"``, ``"fp32"``) the pass runs with the model in that mode and takes the log-probs exactly as
the training loss does (``loss.output_to_log_probs``), so pi_old and pi_theta come from the same kernel.
megatron's ``Float16Module`` returns the last stage's output in the model's dtype during the pass
(``model_dtype_output.model_dtype_output_during``), as in the training step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from slime_tis.megatron.batch import TISBatch
from slime_tis.megatron.loss import output_to_log_probs
from slime_tis.megatron.model_dtype_output import model_dtype_output_during
from slime_tis.megatron.output_layer import output_layer_mode_during

__all__ = ["ReplayIterator", "MicroBatchCounter", "recompute_log_probs", "replay", "materialise"]


class MicroBatchCounter:
    """Micro-batch index of each ``forward_step`` call: megatron runs every model chunk's forward over the
    micro-batches in order 0, 1, ..., so the ``n``-th call with a given chunk is micro-batch ``n``. Works
    where the data iterator is ``None`` (tensor-parallel ranks > 0 in Megatron-LM) or not ours. Chunks are
    keyed by the innermost module (``.module`` unwrapped): the combined 1F1B schedule passes the unwrapped
    model where the others pass the DDP wrapper."""

    def __init__(self) -> None:
        self._calls: dict[int, int] = {}

    def next_index(self, model_chunk: Any) -> int:
        inner = model_chunk
        while isinstance(getattr(inner, "module", None), torch.nn.Module):
            inner = inner.module
        key = id(inner)
        index = self._calls.get(key, 0)
        self._calls[key] = index + 1
        return index


def materialise(data_iterator: Any, num_microbatches: int, vpp: bool) -> Any:
    """Read ``num_microbatches`` items from the iterator (a list per virtual stage when ``vpp``; ``None``
    stays ``None``; a list is taken as the items themselves)."""

    def take(it):
        if it is None:
            return None
        if isinstance(it, list):
            it = iter(it)
        items = []
        for k in range(num_microbatches):
            try:
                items.append(next(it))
            except StopIteration:
                raise ValueError(f"data_iterator ran out after {k} of "
                                 f"num_microbatches={num_microbatches} items") from None
        return items

    if data_iterator is None:
        return None
    if vpp:
        if not isinstance(data_iterator, list):
            raise ValueError("with several model chunks (virtual pipeline stages) data_iterator must be a list "
                             f"with one iterator per chunk, got {type(data_iterator).__name__}")
        return [take(it) for it in data_iterator]
    if isinstance(data_iterator, list) and len(data_iterator) == 1 and hasattr(data_iterator[0], "__next__"):
        data_iterator = data_iterator[0]  # megatron accepts [iterator] for one model chunk
    return take(data_iterator)


class ReplayIterator(Iterator):
    """Iterates over a materialised list of micro-batch items and remembers the last one handed out."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.index = -1

    def __next__(self) -> Any:
        if self.index + 1 >= len(self.items):
            raise StopIteration
        self.index += 1
        return self.items[self.index]

    @property
    def last(self) -> Any:
        return self.items[self.index] if self.index >= 0 else None


def replay(items: list[Any] | list[list[Any]] | None, vpp: bool) -> Any:
    """Fresh replay iterator(s) in the shape megatron expects (one per virtual stage when ``vpp``)."""
    if items is None:
        return None
    if vpp:
        return [ReplayIterator(chunk) if chunk is not None else None for chunk in items]
    return ReplayIterator(items)


def recompute_log_probs(forward_backward_func: Callable, forward_step_func: Callable, items: Any,
                        model: Any, *,
                        batches: list[TISBatch] | None, num_microbatches: int, vpp: bool,
                        temperature: float = 1.0, chunk_size: int = 1024, output_layer: str | None = None,
                        kernels: str = "torch", **schedule_kwargs: Any) -> list[Tensor] | None:
    """``[lp_k [T_k] for each micro-batch k]`` on the last pipeline stage, ``None`` elsewhere.

    Args:
        forward_backward_func: megatron's schedule (``get_forward_backward_func()``).
        forward_step_func: the launcher's ``forward_step(data_iterator, model)`` returning ``(logits, _)``.
        items: the step's materialised micro-batch items (list, or list of lists for virtual stages).
        batches: this rank's ``TISBatch`` per micro-batch (last stage), else ``None``.
        output_layer: ``None``, ``"fp32"`` or ``"fused"``: the model's output-layer mode during the pass
            (``output_layer.output_layer_mode_during``) and how log-probs are taken (``output_to_log_probs``).
        kernels: ``TISConfig.kernels`` (``"torch"`` or ``"triton"``), as in the training loss.
        schedule_kwargs: forwarded to the schedule (``seq_length``, ``micro_batch_size``, ...).
    """
    results: list[Tensor | None] = [None] * num_microbatches
    counter = MicroBatchCounter()

    def forward_step(data_iterator, model_chunk, *args, **kwargs):
        index = counter.next_index(model_chunk)
        output, _ = forward_step_func(data_iterator, model_chunk, *args, **kwargs)

        def loss_func(output_tensor: Tensor, non_loss_data: bool = False):
            if batches is None:
                raise RuntimeError("recompute: loss on a rank without TISBatch micro-batches "
                                   "(not the last stage?)")
            lp, _ = output_to_log_probs(output_tensor, batches[index], model_chunk=model_chunk,
                                        output_layer=output_layer, temperature=temperature,
                                        chunk_size=chunk_size, with_entropy=False, kernels=kernels)
            results[index] = lp.detach()
            return torch.zeros((), dtype=torch.float32, device=lp.device), {}

        return output, loss_func

    with torch.no_grad(), output_layer_mode_during(model, output_layer), model_dtype_output_during(model):
        forward_backward_func(forward_step_func=forward_step, data_iterator=replay(items, vpp), model=model,
                              num_microbatches=num_microbatches, forward_only=True, **schedule_kwargs)
    if batches is None:
        return None
    if any(r is None for r in results):
        raise RuntimeError("recompute: the schedule did not compute the loss of every micro-batch")
    return results  # type: ignore[return-value]
