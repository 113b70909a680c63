"""The step's micro-batch items for megatron's schedules: read once from the launcher's ``data_iterator`` and
replayed to each pass, micro-batch ``k``'s loss function handed to its ``forward_step`` call, and the last stage's
``TISBatch`` list on every TP rank (TP rank 0's, broadcast: Megatron-LM feeds TP rank 0 only; docs/megatron.md,
"Megatron-LM's training loop").
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slime_tis.engine.batch import TISBatch

__all__ = ["innermost", "with_loss_funcs", "materialise", "replay", "step_items", "step_batches",
           "default_get_tis_batch"]

_NO_ITERATOR = (
    "the last pipeline stage needs the step's TISBatch items on this tensor-parallel rank (TP rank {tp_rank} of "
    "{tp}) but its data_iterator is None. Megatron-LM gives a data iterator to TP rank 0 only unless the dataset "
    "provider sets `is_distributed = True` (train_valid_test_datasets_provider.is_distributed = True); either set "
    "it, or keep tis_forward_backward_func(..., broadcast_over_tp=True) (the default) so the hook broadcasts "
    "TP rank 0's items")


def innermost(module: Any) -> Any:
    """``module`` with its ``.module`` wrappers (DDP, Float16Module) unwrapped."""
    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return module


def with_loss_funcs(forward_step_func: Callable, loss_func_of: Callable[[int, Any], Callable | None]) -> Callable:
    """The launcher's ``forward_step`` with ``loss_func_of(k, model_chunk)`` as micro-batch ``k``'s loss function
    (``None``: the launcher's own). ``k`` counts the calls per model chunk, keyed by :func:`innermost` (the combined
    1F1B schedule passes the unwrapped model where the others pass the DDP wrapper)."""
    calls: dict[int, int] = {}

    def forward_step(data_iterator, model_chunk, *args, **kwargs):
        key = id(innermost(model_chunk))
        index = calls[key] = calls.get(key, -1) + 1
        output, own = forward_step_func(data_iterator, model_chunk, *args, **kwargs)
        loss_func = loss_func_of(index, model_chunk)
        return output, own if loss_func is None else loss_func

    return forward_step


def materialise(data_iterator: Any, num_microbatches: int, vpp: bool) -> Any:
    """``num_microbatches`` items read from the iterator (a list per virtual stage when ``vpp``; ``None`` stays
    ``None``; a list is taken as the items)."""

    def take(it):
        if it is None:
            return None
        items = list(itertools.islice(iter(it) if isinstance(it, list) else it, num_microbatches))
        if len(items) < num_microbatches:
            raise ValueError(f"data_iterator ran out after {len(items)} of num_microbatches={num_microbatches} items")
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


def replay(items: Any, vpp: bool) -> Any:
    """Fresh iterators over materialised items, in the shape megatron expects (one per virtual stage)."""
    if items is None:
        return None
    if vpp:
        return [None if chunk is None else iter(chunk) for chunk in items]
    return iter(items)


def step_items(items: Any, step: int, num_microbatches: int) -> Any:
    """Items ``step * M .. (step + 1) * M - 1`` of a rollout's materialised items (per virtual stage for a list of
    lists; ``None`` stays ``None``)."""
    if items is None:
        return None
    lo, hi = step * num_microbatches, (step + 1) * num_microbatches
    if items and isinstance(items[0], list):
        return [chunk[lo:hi] if chunk is not None else None for chunk in items]
    if hi > len(items):
        raise ValueError(f"step {step} needs items {lo}..{hi - 1} but the rollout has {len(items)} items")
    return items[lo:hi]


def _move(batch: TISBatch, device: torch.device) -> TISBatch:  # blocking, unlike TISBatch.to
    return dataclasses.replace(batch, **{
        f.name: (getattr(batch, f.name).to(device) if getattr(batch, f.name) is not None else None)
        for f in dataclasses.fields(batch)})


def step_batches(items: Any, *, vpp: bool, get_tis_batch: Callable[[Any], TISBatch], broadcast: bool,
                 ) -> tuple[list[TISBatch] | None, list[TISBatch]]:
    """``(local, batches)`` on a last-stage rank: the ``TISBatch`` of each of its items (the last virtual stage's;
    ``None`` without items) and the list its loss uses. ``broadcast`` under TP > 1: TP rank 0's list on every TP
    rank (one ``broadcast_object_list`` through the host, issued whenever TP > 1). A rank that needs items and has
    none raises, naming ``is_distributed = True`` and ``broadcast_over_tp``."""
    from megatron.core import parallel_state as ps

    last_items = None if items is None else (items[-1] if vpp else items)
    local = [get_tis_batch(it) for it in last_items] if last_items is not None else None
    group = ps.get_tensor_model_parallel_group()
    tp = dist.get_world_size(group) if dist.is_initialized() else 1
    tp_rank = dist.get_rank(group) if tp > 1 else 0
    if local is None and (tp_rank == 0 or not broadcast):
        raise ValueError(_NO_ITERATOR.format(tp_rank=tp_rank, tp=tp))
    if tp == 1 or not broadcast:
        return local, local
    payload: list = [None]
    if tp_rank == 0:
        payload = [(local[0].labels.device.type if local else "cpu", [_move(b, torch.device("cpu")) for b in local])]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    if tp_rank == 0:
        return local, local
    device_type, received = payload[0]
    device = torch.device(device_type)
    if device_type == "cuda" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return local, [_move(b, device) for b in received]


def default_get_tis_batch(item: object) -> TISBatch:
    """``item["tis"]``, a :class:`TISBatch` (one-line error otherwise)."""
    if not isinstance(item, dict) or not isinstance(item.get("tis"), TISBatch):
        keys = f" with keys {sorted(item)}" if isinstance(item, dict) else ""
        raise ValueError("each micro-batch item must be a dict with item['tis'] = TISBatch(...) "
                         f"(got {type(item).__name__}{keys}); "
                         "or pass get_tis_batch= to tis_forward_backward_func")
    return item["tis"]
