"""The megatron-core schedule contract of both Megatron hosts (docs/megatron.md, "The schedule contract"): a
micro-batch's ``loss = local_sum / D`` goes back as ``(loss * M * g / cp, report)``, or ``(loss * N, n_local,
report)`` with ``calculate_per_token_loss``; ``M`` micro-batches, ``cp`` the CP size, ``N`` the step's valid tokens
over DP x CP, ``g`` the data-parallel wrapper's gradient divisor (read from the wrapper, never guessed). ``report``
maps keys to ``[v, c]`` pairs that ``train_step`` sums over micro-batches and the ``R`` DP x CP ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from slime_tis.core.correction import as_valid_mask
from slime_tis.engine.parallel import megatron_parallel_state

__all__ = ["LossForm", "loss_form_for", "data_parallel_grad_average", "report_pair", "add_metrics_to_loss_dicts"]


@dataclass(frozen=True)
class LossForm:
    """One step's scaling: ``per_token`` (the 3-tuple form), ``M``, ``cp``, ``g`` and ``R``."""

    per_token: bool
    num_microbatches: int
    cp_size: int
    grad_average: float
    report_ranks: int = 1

    @property
    def two_tuple_scale(self) -> float:
        return self.num_microbatches * self.grad_average / self.cp_size

    def returns(self, loss: Tensor, num_tokens: Tensor, loss_mask: Tensor, report: dict) -> tuple:
        """What ``loss_func`` returns for ``loss`` (0-d), ``N`` and the micro-batch's ``loss_mask [T]``."""
        if self.per_token:
            return loss * num_tokens, as_valid_mask(loss_mask).sum().to(torch.int), report
        return loss * self.two_tuple_scale, report

    def loss_pair(self, loss: Tensor) -> Tensor:
        """``[loss * M * R, 1]``: ``train_step`` logs the sum of ``loss`` over micro-batches and ranks."""
        return report_pair(loss.detach() * (self.num_microbatches * self.report_ranks))

    def rank_sum_pair(self, local: Tensor) -> Tensor:
        """``[local * R, 1]`` in every micro-batch dict: ``train_step`` logs the sum of ``local`` over ranks."""
        return report_pair(local * self.report_ranks)


def report_pair(value: Tensor) -> Tensor:
    """``[value, 1]`` (detached, ``value``'s device and dtype): logged as ``value`` when equal in every dict."""
    v = value.detach().reshape(1)
    return torch.cat([v, torch.ones_like(v)])


def add_metrics_to_loss_dicts(loss_dicts: list, metrics: dict[str, Tensor]) -> None:
    """``[value, 1]`` of every step metric but ``loss`` into every micro-batch dict, in place."""
    pairs = {k: report_pair(v) for k, v in sorted(metrics.items()) if k != "loss"}
    for d in loss_dicts:
        if isinstance(d, dict):
            d.update(pairs)


def loss_form_for(model_chunks: list, num_microbatches: int, *, per_token: bool,
                  grad_average: float | None = None) -> LossForm:
    """The step's :class:`LossForm`: ``cp`` and ``R`` from ``parallel_state`` (1 where not initialised), ``g`` from
    the wrapper of ``model_chunks`` unless ``grad_average`` is given."""
    ps = megatron_parallel_state()
    cp, dp_cp = 1, 1
    if ps is not None:
        cp = ps.get_context_parallel_world_size()
        dp_cp = ps.get_data_parallel_world_size(with_context_parallel=True)
    g = data_parallel_grad_average(model_chunks, dp_cp_size=dp_cp, per_token=per_token, override=grad_average)
    return LossForm(per_token=per_token, num_microbatches=num_microbatches, cp_size=cp, grad_average=g,
                    report_ranks=dp_cp)


def _megatron_fsdp_classes() -> tuple[type, ...]:
    """megatron-core's FSDP wrapper classes (0.20: ``...V1`` / ``...V2``, the plain name a factory function)."""
    try:
        from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter
    except ImportError:  # pragma: no cover - megatron-core builds without FSDP
        return ()
    names = ("FullyShardedDataParallel", "FullyShardedDataParallelV1", "FullyShardedDataParallelV2")
    return tuple(c for c in (getattr(adapter, n, None) for n in names) if isinstance(c, type))


def _chunk_average(chunk: Any, dp_cp_size: int, per_token: bool) -> float | None:
    """``g`` of one model chunk, or ``None`` for a wrapper not known here (FSDP V2 has no ``dist_index``)."""
    from megatron.core.distributed import DistributedDataParallel

    if isinstance(chunk, DistributedDataParallel):
        wrapper_per_token = bool(getattr(chunk.config, "calculate_per_token_loss", False))
        if wrapper_per_token != per_token:
            raise ValueError(
                f"megatron DistributedDataParallel was built with calculate_per_token_loss={wrapper_per_token} but "
                f"the model config has calculate_per_token_loss={per_token}; build the DDP wrapper with the "
                "model's own TransformerConfig")
        return 1.0 if per_token else float(chunk.dp_cp_group.size())
    if isinstance(chunk, _megatron_fsdp_classes()):
        if per_token:
            return 1.0
        dist_index = getattr(chunk.module, "dist_index", None)
        return None if dist_index is None else float(dist_index.get_dp_group().size())
    if isinstance(chunk, torch.nn.parallel.DistributedDataParallel):
        import torch.distributed as dist

        return float(dist.get_world_size(chunk.process_group))
    return 1.0 if dp_cp_size == 1 else None


def data_parallel_grad_average(model_chunks: list, *, dp_cp_size: int, per_token: bool,
                               override: float | None = None) -> float:
    """``g``: what the data-parallel wrapper of every chunk divides the summed gradient by (docs/megatron.md), or
    ``override`` (a number > 0). ``ValueError``: an unknown wrapper with ``dp_cp_size > 1`` and no ``override``,
    chunks that disagree, a megatron DDP wrapper whose per-token setting differs from ``per_token``."""
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, (int, float)) or not override > 0:
            raise ValueError(f"grad_average must be a number > 0 (the factor the data-parallel wrapper divides "
                             f"the summed gradient by), got {override!r}")
        return float(override)
    values = []
    for chunk in model_chunks:
        g = _chunk_average(chunk, dp_cp_size, per_token)
        if g is None:
            raise ValueError(
                f"cannot tell how the model wrapper {type(chunk).__name__} reduces gradients over the "
                f"{dp_cp_size} data-parallel x context-parallel ranks (known: megatron-core "
                "DistributedDataParallel / FullyShardedDataParallel, torch DistributedDataParallel); pass "
                f"grad_average= to tis_forward_backward_func: {dp_cp_size} if the wrapper averages gradients "
                "over those ranks, 1 if it sums them")
        values.append(g)
    if len(set(values)) > 1:
        raise ValueError(f"model chunks average gradients over different rank counts {values}")
    return values[0] if values else 1.0
