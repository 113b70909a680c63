"""Mixture-of-experts routing in training: rollout routing replay, and the training/engine routing disagreement.

The rollout engine reports, per token it ran, the experts its (bfloat16) router chose: ``routed_experts``
``[N, S, num_layers, k]`` in the batch (``-1`` where the engine did not run the token). In training (float32)
the router may choose other experts for the same token: rounding reorders near-tied router logits. Then the
training log-prob is that of another network than the one that sampled, and the importance ratio carries the
difference.

:class:`RoutingProbe`, attached to the megatron model's ``TopKRouter`` of every local MoE layer:

* **replay** (``replay=True``): for each micro-batch the router's top-k choice is replaced by the engine's
  experts (megatron-core's ``RouterReplay`` ``REPLAY_FORWARD``); the weights are recomputed from the training
  router's own logits over the replayed experts, ``w = softmax(logits[i_1..i_k])`` (the same normalisation as
  without replay, so gradients still reach the router). Positions the engine did not run (the last response
  token, padding) get experts ``0..k-1``: causal attention and per-token routing keep them out of every
  loss position.
* **disagreement**, counted over the routing decisions (token, layer) of loss positions, where the engine
  routed the token: ``moe/routing_mismatch`` = fraction whose expert set used by training differs from the
  engine's (0 under replay), ``moe/router_disagreement`` = fraction where the training router's own top-k
  (from its float32 logits) differs from the engine's (what replay removes; equal to the first without
  replay).

The trainer counts during the rollout's first optimizer step (epoch 0, step 0: the parameters the engine
sampled with, unless ``--rollout-lag``), so the numbers measure the numerical mismatch, not the policy's
movement over the later optimizer steps of the rollout. Counts are accumulated as tensors (no host sync in
the forward) and summed over all ranks once per step (:meth:`RoutingProbe.step_metrics`: one all-reduce of
3 numbers, on every rank, whenever the model is MoE).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


class RoutingProbe:
    """Replay and disagreement counting on the MoE routers of this rank's pipeline stage (module docstring).

    Args:
        model: the (DDP-wrapped) megatron GPT with MoE layers.
        replay: override the routers' choices with the engine's experts.
    """

    def __init__(self, model: torch.nn.Module, *, replay: bool) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self.replay, self._action = replay, RouterReplayAction.REPLAY_FORWARD
        self.routers: list[tuple[int, Any]] = []
        for layer in _unwrap(model).decoder.layers:
            router = layer.mlp.router
            if router.router_replay is None:
                raise ValueError("the MoE routers were built without moe_enable_routing_replay")
            self.routers.append((layer.layer_number - 1, router))  # global 0-based layer index
            router.register_forward_hook(self._hook(layer.layer_number - 1, router))
        self.counting = False
        self._engine: torch.Tensor | None = None  # [T, num_layers, k] in megatron token order (s-major)
        self._valid: torch.Tensor | None = None  # [T] bool: loss position that the engine routed
        self.counts = torch.zeros(3, dtype=torch.float64)  # used differs, own differs, decisions

    def begin(self, routed_experts: torch.Tensor | None, loss_mask: torch.Tensor) -> None:
        """Before the forward of a micro-batch: ``routed_experts [B, S, num_layers, k]`` (or ``None``: no replay,
        nothing counted), ``loss_mask [B, S]``."""
        if routed_experts is None:
            self._engine = self._valid = None
            for _, router in self.routers:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()
            return
        b, s, n_layers, k = routed_experts.shape
        dev = loss_mask.device
        engine = routed_experts.to(dev).transpose(0, 1).reshape(s * b, n_layers, k)  # megatron tokens are [s, b]
        self._engine = engine
        self._valid = loss_mask.transpose(0, 1).reshape(s * b) & (engine[:, 0, 0] >= 0)
        if not self.replay:
            return
        fill = torch.arange(k, device=dev).expand(s * b, k)
        for layer, router in self.routers:
            target = engine[:, layer]
            target = torch.where(target >= 0, target, fill)
            router.router_replay.clear_indices()
            router.router_replay.set_target_indices(target)
            router.router_replay.set_router_replay_action(self._action)

    def _hook(self, layer: int, router: Any) -> Any:
        def hook(module: Any, inputs: tuple, output: tuple) -> None:
            if not self.counting or self._engine is None:
                return
            _, routing_map = output  # [T, E] bool: the experts training used
            with torch.no_grad():
                logits = router.gating(inputs[0]).view(-1, routing_map.shape[-1])
                own = F.one_hot(logits.topk(router.topk, dim=-1).indices, routing_map.shape[-1]).sum(-2) > 0
                eng = F.one_hot(self._engine[:, layer].clamp_min(0), routing_map.shape[-1]).sum(-2) > 0
                valid = self._valid
                used_diff = ((routing_map != eng).any(-1) & valid).sum()
                own_diff = ((own != eng).any(-1) & valid).sum()
                self.counts += torch.stack([used_diff, own_diff, valid.sum()]).to(self.counts)

        return hook

    def step_metrics(self, world_size: int) -> dict[str, float]:
        """This step's disagreement fractions (summed over all ranks; collective when ``world_size > 1``), and
        reset the counts."""
        counts = self.counts.clone()
        if world_size > 1:
            counts = counts.float()
            torch.distributed.all_reduce(counts)
        self.counts.zero_()
        total = max(float(counts[2]), 1.0)  # host-sync-ok (logging, once per step)
        return {
            "moe/routing_mismatch": float(counts[0]) / total,  # host-sync-ok
            "moe/router_disagreement": float(counts[1]) / total,  # host-sync-ok
            "moe/routing_decisions": float(counts[2]),  # host-sync-ok
        }
