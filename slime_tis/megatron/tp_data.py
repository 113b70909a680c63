"""The step's ``TISBatch`` items on every tensor-parallel rank of the last pipeline stage.

Megatron-LM hands a data iterator only to tensor-parallel rank 0 (unless the dataset provider sets
``is_distributed = True``); its ``get_batch`` broadcasts each micro-batch to the other TP ranks. The loss
runs on every TP rank (the vocab-parallel log-softmax all-reduces over TP), so every TP rank needs the
micro-batch's ``TISBatch``. With ``broadcast_over_tp=True`` (default) TP rank 0's ``TISBatch`` list is
broadcast to the other ranks of the TP group once per schedule call, whatever those ranks hold, so the TP
ranks always compute on identical data. The collective is issued on every last-stage rank whenever
``TP > 1``: it depends on the layout only.

Cost: one ``broadcast_object_list`` (two collectives) of the step's ``[T]`` vectors, copied to the host
on TP rank 0 (blocking, outside the loss path) and back to the device on the receivers. With
``broadcast_over_tp=False`` every TP rank must read its own items (``is_distributed = True``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slime_tis.engine.batch import TISBatch

__all__ = ["tis_batches_on_this_tp_rank", "step_batches", "default_get_tis_batch"]

_NO_ITERATOR = (
    "the last pipeline stage needs the step's TISBatch items on this tensor-parallel rank (TP rank {tp_rank} of "
    "{tp}) but its data_iterator is None. Megatron-LM gives a data iterator to TP rank 0 only unless the dataset "
    "provider sets `is_distributed = True` (train_valid_test_datasets_provider.is_distributed = True); either set "
    "it, or keep tis_forward_backward_func(..., broadcast_over_tp=True) (the default) so the hook broadcasts "
    "TP rank 0's items")


def _move(batch: TISBatch, device: torch.device) -> TISBatch:
    """A blocking copy of every tensor of ``batch`` on ``device``."""
    return dataclasses.replace(batch, **{
        f.name: (getattr(batch, f.name).to(device) if getattr(batch, f.name) is not None else None)
        for f in dataclasses.fields(batch)})


def _local_device(device_type: str) -> torch.device:
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def tis_batches_on_this_tp_rank(local: list[TISBatch] | None, *, broadcast: bool,
                                tp_group: dist.ProcessGroup | None = None) -> list[TISBatch]:
    """This TP rank's ``TISBatch`` list for the step (call on every last-stage rank).

    Args:
        local: the items this rank read from its own data iterator (``None`` without an iterator).
        broadcast: take TP rank 0's list on every TP rank (see module docstring).
        tp_group: default megatron's tensor-parallel group.

    Raises:
        ValueError: TP rank 0 without items, or a rank without items and ``broadcast=False`` (the message
            names ``is_distributed = True`` and ``broadcast_over_tp``).
    """
    if tp_group is None:
        from megatron.core import parallel_state as ps

        tp_group = ps.get_tensor_model_parallel_group()
    tp = dist.get_world_size(tp_group) if dist.is_initialized() else 1
    tp_rank = dist.get_rank(tp_group) if tp > 1 else 0
    if tp == 1 or not broadcast:
        if local is None:
            raise ValueError(_NO_ITERATOR.format(tp_rank=tp_rank, tp=tp))
        return local
    if tp_rank == 0 and local is None:
        raise ValueError(_NO_ITERATOR.format(tp_rank=tp_rank, tp=tp))
    payload: list = [None]
    if tp_rank == 0:
        payload = [(local[0].labels.device.type if local else "cpu",
                    [_move(b, torch.device("cpu")) for b in local])]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(tp_group, 0), group=tp_group)
    if tp_rank == 0:
        return local
    device_type, received = payload[0]
    device = _local_device(device_type)
    return [_move(b, device) for b in received]


def step_batches(items: Any, *, vpp: bool, get_tis_batch: Callable[[Any], TISBatch], broadcast: bool,
                 ) -> tuple[list[TISBatch] | None, list[TISBatch]]:
    """The step batch of the last pipeline stage: ``(local, batches)``, this rank's ``TISBatch`` of each of the
    step's items (``None`` where it has no items; the last virtual stage's items under ``vpp``) and the list the
    loss uses on this TP rank (:func:`tis_batches_on_this_tp_rank`). The training call and the rollout's pi_old
    pass both take their batches here."""
    last_items = None if items is None else (items[-1] if vpp else items)
    local = [get_tis_batch(it) for it in last_items] if last_items is not None else None
    return local, tis_batches_on_this_tp_rank(local, broadcast=broadcast)


def default_get_tis_batch(item: object) -> TISBatch:
    """The micro-batch item is a dict carrying ``item["tis"]``, a :class:`TISBatch`."""
    if not isinstance(item, dict) or not isinstance(item.get("tis"), TISBatch):
        keys = f" with keys {sorted(item)}" if isinstance(item, dict) else ""
        raise ValueError("each micro-batch item must be a dict with item['tis'] = TISBatch(...) "
                         f"(got {type(item).__name__}{keys}); "
                         "or pass get_tis_batch= to tis_forward_backward_func")
    return item["tis"]
