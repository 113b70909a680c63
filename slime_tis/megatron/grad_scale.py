"""How many data-parallel ranks the model wrapper averages gradients over, read from the wrapper itself.

The 2-tuple loss form must pre-compensate the wrapper's averaging ``g`` (``loss.LossForm``): the final
gradient is ``(1 / g) * sum over ranks`` of what each rank's backward produced. ``g`` is taken from what
the wrapper decided, never guessed:

=================================================  ==========================================================
model chunk                                        ``g``
=================================================  ==========================================================
megatron-core ``DistributedDataParallel``          ``ddp.dp_cp_group.size()``: megatron scales gradients to
                                                   ``1 / dp_cp_group.size()`` (pre-scaling, or ``AVG`` in the
                                                   collective with ``average_in_collective``) and asserts it;
                                                   ``1`` (a plain sum) when its config has
                                                   ``calculate_per_token_loss``
megatron-core ``FullyShardedDataParallel`` (V1)    its data-parallel group size (megatron_fsdp scales by
                                                   ``1 / dp`` the same two ways); ``1`` with per-token loss
``torch.nn.parallel.DistributedDataParallel``      ``process_group.size()`` (torch DDP always averages)
anything else, DP x CP world of one rank           ``1`` (averaging over one rank is the identity)
anything else, DP x CP world > 1                   unknown: ``ValueError`` at the first training call,
                                                   asking for ``grad_average=`` (no silent guess)
=================================================  ==========================================================

Every chunk must agree; the value is checked against the wrapper's own per-token setting, which must
match the model config the loss form is chosen from.
"""

from __future__ import annotations

from typing import Any

__all__ = ["data_parallel_grad_average"]


def _megatron_fsdp_classes() -> tuple[type, ...]:
    """The megatron-core FSDP wrapper *classes* of the installed version.

    megatron-core <= 0.19 defines the class ``FullyShardedDataParallel``; from 0.20 (Megatron-LM main, commit
    d98e8a64dd) that name is a factory function returning a ``FullyShardedDataParallelV1`` (which keeps the
    ``module.dist_index`` read below) or a ``FullyShardedDataParallelV2`` (no ``dist_index``: reported as unknown,
    so ``grad_average=`` is asked for). Only classes are returned, so ``isinstance`` never sees a function."""
    try:
        from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter
    except ImportError:  # pragma: no cover - megatron-core builds without FSDP
        return ()
    names = ("FullyShardedDataParallel", "FullyShardedDataParallelV1", "FullyShardedDataParallelV2")
    return tuple(c for c in (getattr(adapter, n, None) for n in names) if isinstance(c, type))


def _chunk_average(chunk: Any, dp_cp_size: int, per_token: bool) -> float | None:
    """``g`` of one model chunk, or ``None`` when the wrapper is not one this module knows."""
    import torch
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
        if dist_index is None:
            return None
        return float(dist_index.get_dp_group().size())
    if isinstance(chunk, torch.nn.parallel.DistributedDataParallel):
        import torch.distributed as dist

        return float(dist.get_world_size(chunk.process_group))
    if dp_cp_size == 1:
        return 1.0
    return None


def data_parallel_grad_average(model_chunks: list, *, dp_cp_size: int, per_token: bool,
                               override: float | None = None) -> float:
    """``g`` for :class:`~slime_tis.megatron.loss.LossForm` (see the module table).

    Args:
        model_chunks: the ``model`` list handed to the schedule.
        dp_cp_size: size of megatron's data-parallel x context-parallel group.
        per_token: ``config.calculate_per_token_loss`` of the model.
        override: the caller's ``grad_average=`` (a number > 0): used as given, for wrappers this module
            cannot read (it must be the factor the wrapper divides the summed gradient by).

    Raises:
        ValueError: an unknown wrapper with ``dp_cp_size > 1`` and no ``override``; chunks that disagree;
            a megatron DDP wrapper whose per-token setting differs from the model config.
    """
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
