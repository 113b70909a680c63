"""A host call's parallel context: CP / DP / TP ranks, the last pipeline stage and the core's reducer
(:class:`~slime_tis.engine.reduce.MegatronReducer` on megatron-core's ``parallel_state``, else local)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slime_tis.core import LocalReducer, Reducer

__all__ = ["ParallelContext", "parallel_context", "megatron_parallel_state"]


@dataclass(frozen=True)
class ParallelContext:
    cp_rank: int
    cp_size: int
    reducer: Reducer
    dp_rank: int = 0
    tp_rank: int = 0
    dp_size: int = 1
    last_pp_stage: bool = True


def megatron_parallel_state() -> Any:
    """megatron-core's ``parallel_state`` when model parallel is initialised, else ``None``."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError:  # megatron-core is optional for single-process use
        return None
    return ps if ps.model_parallel_is_initialized() else None


def parallel_context() -> ParallelContext:
    """Context from megatron's ``parallel_state`` if initialised, else a single-process context."""
    ps = megatron_parallel_state()
    if ps is None:
        return ParallelContext(0, 1, LocalReducer())
    from slime_tis.engine.reduce import MegatronReducer

    return ParallelContext(
        cp_rank=ps.get_context_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
        reducer=MegatronReducer(),
        dp_rank=ps.get_data_parallel_rank(with_context_parallel=False),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(with_context_parallel=False),
        last_pp_stage=ps.is_pipeline_last_stage(ignore_virtual=True),
    )
