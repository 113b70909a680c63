"""Rollout routing replay on megatron-core's ``RouterReplay`` and the ``moe/*`` routing metrics
(``--tis-routing-replay``; data layout, token order, metrics and refusals: docs/megatron.md, "Mixture of experts").
A router forward inside the backward (activation recompute) takes megatron's ``REPLAY_BACKWARD`` queue; the counts
are summed over every rank by one all-reduce after the step (divided by TP where TP ranks route the same tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from slime_tis.engine.batch import cp_slice_padded
from slime_tis.megatron.schedule import innermost

__all__ = ["RoutingBatch", "RoutingReplay", "default_get_routing", "moe_layer_pattern"]


@dataclass
class RoutingBatch:
    """``experts [B, S, L_moe, k]`` int (``-1``: not routed by the engine), ``loss_mask [B, S]``, ``packed``: rows
    are packed sequences (``[1, T]``, CP = 1 only)."""

    experts: Tensor
    loss_mask: Tensor
    packed: bool = False

    def __post_init__(self) -> None:
        e, m = self.experts, self.loss_mask
        if not isinstance(e, Tensor) or e.dim() != 4 or e.dtype.is_floating_point or e.dtype == torch.bool:
            raise ValueError("RoutingBatch.experts must be an integer tensor [B, S, moe_layers, topk], got "
                             + (f"{e.dtype} {list(e.shape)}" if isinstance(e, Tensor) else type(e).__name__))
        if not isinstance(m, Tensor) or tuple(m.shape) != tuple(e.shape[:2]):
            raise ValueError(f"RoutingBatch.loss_mask must be [B, S] = {list(e.shape[:2])} like experts, got "
                             + (str(list(m.shape)) if isinstance(m, Tensor) else type(m).__name__))


def default_get_routing(item: Any) -> RoutingBatch | None:
    """``item["routing"]`` (``None`` where the item is not a dict or has none)."""
    return item.get("routing") if isinstance(item, dict) else None


def moe_layer_pattern(config: Any) -> list[bool]:
    """Per global layer (0-based), whether it is a MoE layer: ``config.moe_layer_freq`` as megatron reads it (an
    int ``f``: every ``f``-th layer from layer 0; a list: one 0/1 per layer)."""
    freq, n = config.moe_layer_freq, config.num_layers
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(n)]
    if len(freq) != n:
        raise ValueError(f"moe_layer_freq has {len(freq)} entries, the model {n} layers")
    return [bool(f) for f in freq]


@dataclass
class _Slot:
    """One local MoE layer: its index among the MoE layers, its router, this micro-batch's engine routing."""

    moe_index: int
    router: Any
    engine: Tensor | None = None  # [N, k] the engine's experts (-1: not routed), router token order
    valid: Tensor | None = None  # [N] bool: loss position that the engine routed
    fresh: bool = False  # targets set for the next (non-recompute) forward


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward pass (a checkpointed layer recomputing its forward)."""
    return torch._C._current_graph_task_id() != -1


def _begin_on_next(inner: Any, begin: Callable[[Any], None]) -> Iterator[Any]:
    """The launcher's data iterator; each item it hands out first sets its routing on the chunk's MoE layers."""
    while True:
        try:
            item = next(inner)
        except StopIteration:
            return
        begin(item)
        yield item


class RoutingReplay:
    """On this rank's MoE routers: ``replay`` the engine's experts, ``count`` the routing metrics in training
    forwards; ``get_routing``: item -> :class:`RoutingBatch` (or ``None``)."""

    def __init__(self, *, replay: bool, count: bool,
                 get_routing: Callable[[Any], RoutingBatch | None] = default_get_routing) -> None:
        self.replay, self.count, self.get_routing = bool(replay), bool(count), get_routing
        self._chunks: dict[int, list[_Slot]] = {}
        self._counts: Tensor | None = None  # float64 [3]: used differs, own differs, decisions
        self._device: torch.device | None = None
        self._num_moe: int | None = None
        self._tp_duplicates = 1
        self._active = self._counting = False

    def _slots(self, model_chunk: Any) -> list[_Slot]:
        inner = innermost(model_chunk)
        key = id(inner)
        if key not in self._chunks:
            self._chunks[key] = self._attach(inner)
        return self._chunks[key]

    def _attach(self, chunk: torch.nn.Module) -> list[_Slot]:
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.transformer_layer import TransformerLayer

        slots = []
        for layer in chunk.modules():
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if not isinstance(layer, TransformerLayer) or not isinstance(router, TopKRouter):
                continue
            pattern = moe_layer_pattern(router.config)
            g = layer.layer_number - 1  # global, 0-based (pipeline / virtual-pipeline offset included)
            if g >= len(pattern):
                raise ValueError(f"routing replay: a MoE layer numbered {g + 1} beyond num_layers={len(pattern)} "
                                 "(multi-token-prediction layers) is not supported")
            if not pattern[g]:
                raise ValueError(f"layer {g} has a router but moe_layer_freq={router.config.moe_layer_freq} makes "
                                 "it dense")
            if self.replay and getattr(router, "router_replay", None) is None:
                raise ValueError("--tis-routing-replay (routing_replay=True) needs the MoE routers built with "
                                 "moe_enable_routing_replay=True (TransformerConfig / --moe-enable-routing-replay)")
            slot = _Slot(sum(pattern[:g]), router)
            router.register_forward_pre_hook(self._pre_hook(slot))
            router.register_forward_hook(self._count_hook(slot))
            slots.append(slot)
            self._num_moe = sum(pattern)
        if self._device is None:
            p = next(chunk.parameters(), None)
            self._device = p.device if p is not None else torch.device("cpu")
            cfg = getattr(chunk, "config", None)
            tp = ps.get_tensor_model_parallel_world_size()
            self._tp_duplicates = tp if tp > 1 and not getattr(cfg, "sequence_parallel", False) else 1
        return slots

    @contextmanager
    def active(self, forward_step_func: Callable, *, training: bool) -> Iterator[Callable]:
        """For one schedule pass: the launcher's ``forward_step`` setting each item's routing on its chunk's MoE
        layers (``training``: the pass counts the metrics). Targets and actions are cleared on entry and exit."""
        def forward_step(data_iterator: Any, model_chunk: Any, *args: Any, **kwargs: Any) -> Any:
            slots = self._slots(model_chunk)
            if slots and data_iterator is not None:
                data_iterator = _begin_on_next(data_iterator, lambda item: self._begin(slots, item))
            return forward_step_func(data_iterator, model_chunk, *args, **kwargs)

        self._clear_all()
        self._active, self._counting = True, training and self.count
        try:
            yield forward_step
        finally:
            self._active = self._counting = False
            self._clear_all()

    def _clear_all(self) -> None:
        for slot in (slot for slots in self._chunks.values() for slot in slots):
            slot.engine = slot.valid = None
            slot.fresh = False
            if slot.router.router_replay is not None:
                slot.router.router_replay.clear_indices()
                slot.router.router_replay.clear_router_replay_action()

    def _begin(self, slots: list[_Slot], item: Any) -> None:
        from megatron.core import parallel_state as ps

        rb = self.get_routing(item)
        if rb is None:
            raise ValueError("--tis-routing-replay / routing metrics: a micro-batch carries no routed experts "
                             "(get_routing(item) is None; put a RoutingBatch in item['routing'] on every rank "
                             "holding MoE layers)")
        if not isinstance(rb, RoutingBatch):
            raise ValueError(f"get_routing(item) must return a slime_tis.megatron.RoutingBatch, got "
                             f"{type(rb).__name__}")
        b, s, n_layers, k = rb.experts.shape
        topk = slots[0].router.topk
        if n_layers != self._num_moe or k != topk:
            raise ValueError(f"routed experts have shape [B={b}, S={s}, moe_layers={n_layers}, topk={k}], the model "
                             f"[B, S, moe_layers={self._num_moe}, topk={topk}]")
        cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        if rb.packed and cp > 1:
            raise ValueError("RoutingBatch(packed=True) with context parallelism is not supported (megatron splits "
                             "packed sequences per sequence under CP)")
        experts = cp_slice_padded(rb.experts, cp, cp_rank).transpose(0, 1)  # [S_cp, B, L, k]
        mask = cp_slice_padded(rb.loss_mask, cp, cp_rank).transpose(0, 1)  # [S_cp, B]
        tp = ps.get_tensor_model_parallel_world_size()
        if tp > 1 and getattr(slots[0].router.config, "sequence_parallel", False):
            s_cp = experts.shape[0]
            if s_cp % tp:
                raise ValueError(f"sequence parallelism: the {s_cp} tokens per row on this CP rank are not "
                                 f"divisible by tensor_model_parallel_size={tp}")
            r = ps.get_tensor_model_parallel_rank()
            experts, mask = experts.chunk(tp)[r], mask.chunk(tp)[r]
        dev = self._device
        experts = experts.reshape(-1, n_layers, k).to(dev)
        routed = (experts >= 0).all(-1)  # [N, L]
        mask = mask.reshape(-1).to(dev).bool()
        fill = torch.arange(k, device=dev).expand(experts.shape[0], k)
        for slot in slots:
            engine = experts[:, slot.moe_index]
            slot.engine, slot.valid, slot.fresh = engine, mask & routed[:, slot.moe_index], True
            if self.replay:
                slot.router.router_replay.set_target_indices(torch.where(engine >= 0, engine, fill).long())

    def _pre_hook(self, slot: _Slot) -> Callable:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        def pre(module: Any, args: tuple) -> None:
            if not self._active:
                return
            if _in_backward():  # a recompute: megatron's queue of this router's targets, in forward order
                if self.replay:
                    module.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
                return
            if not slot.fresh:
                raise RuntimeError(f"routing replay: MoE layer {slot.moe_index} ran a forward without its "
                                   "micro-batch's routed experts (the launcher's forward_step must read its item "
                                   "from data_iterator on every rank holding MoE layers)")
            slot.fresh = False
            tokens = args[0].shape[0] * args[0].shape[1]
            if slot.engine.shape[0] != tokens:
                raise ValueError(f"routed experts give {slot.engine.shape[0]} tokens to MoE layer {slot.moe_index} "
                                 f"on this rank, its router sees {tokens} ({list(args[0].shape[:2])}): the "
                                 "RoutingBatch must be [B, S] of the launcher's full (not CP-sliced) tokens")
            if self.replay:
                module.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

        return pre

    def _count_hook(self, slot: _Slot) -> Callable:
        def hook(module: Any, args: tuple, output: tuple) -> None:
            if not self._counting or _in_backward():
                return
            routing_map = output[1]  # [N, E] bool: the experts training used
            n_exp = routing_map.shape[-1]
            with torch.no_grad():
                logits = module.gating(args[0]).reshape(-1, n_exp)
                own = F.one_hot(logits.topk(module.topk, dim=-1).indices, n_exp).sum(-2) > 0
                eng = F.one_hot(slot.engine.long().clamp_min(0), n_exp).sum(-2) > 0
                used_diff = ((routing_map != eng).any(-1) & slot.valid).sum()
                own_diff = ((own != eng).any(-1) & slot.valid).sum()
                counts = torch.stack([used_diff, own_diff, slot.valid.sum()]).to(torch.float64)
                self._counts = counts if self._counts is None else self._counts + counts.to(self._counts)

        return hook

    def step_metrics(self) -> dict[str, Tensor]:
        """This step's routing metrics (float64 0-d, the same on every rank), counts reset. Collective (world)."""
        from slime_tis.core.metric_schema import finalize

        dev = self._device or torch.device("cpu")
        counts = torch.zeros(3, dtype=torch.float64, device=dev) if self._counts is None else self._counts.to(dev)
        self._counts = None
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(counts)
        counts = counts / self._tp_duplicates
        used, own, decisions = counts.unbind(0)
        return finalize({"moe.used_differs": used, "moe.own_differs": own, "moe.decisions": decisions})
