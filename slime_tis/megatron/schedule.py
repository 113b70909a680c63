"""Schedule plumbing: the step's micro-batch items read once, replayed to megatron's schedules, and the
micro-batch index of each ``forward_step`` call.

A training call reads its ``num_microbatches`` items from the launcher's ``data_iterator`` once
(:func:`materialise`), so that a forward-only pass and the training schedule can both run over them
(:func:`replay`); :func:`step_items` cuts one optimizer step's items out of a rollout's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["MicroBatchCounter", "ReplayIterator", "materialise", "replay", "step_items"]


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
    """Iterates over a materialised list of micro-batch items in order."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.index = -1

    def __next__(self) -> Any:
        if self.index + 1 >= len(self.items):
            raise StopIteration
        self.index += 1
        return self.items[self.index]


def replay(items: list[Any] | list[list[Any]] | None, vpp: bool) -> Any:
    """Fresh replay iterator(s) in the shape megatron expects (one per virtual stage when ``vpp``)."""
    if items is None:
        return None
    if vpp:
        return [ReplayIterator(chunk) if chunk is not None else None for chunk in items]
    return ReplayIterator(items)


def step_items(items: Any, step: int, num_microbatches: int) -> Any:
    """Items ``step * M .. (step + 1) * M - 1`` of a rollout's materialised items (per virtual stage for a list
    of lists; ``None`` stays ``None``)."""
    if items is None:
        return None
    lo, hi = step * num_microbatches, (step + 1) * num_microbatches
    if items and isinstance(items[0], list):
        return [chunk[lo:hi] if chunk is not None else None for chunk in items]
    if hi > len(items):
        raise ValueError(f"step {step} needs items {lo}..{hi - 1} but the rollout has {len(items)} items")
    return items[lo:hi]
