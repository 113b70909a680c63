"""The parallel context of a host call: CP / DP / TP ranks, the last pipeline stage and the core's reducer.

Every host here runs on megatron-core's ``parallel_state`` (slime's ``mpu`` is it); when it is initialised the
engine reduces over its groups with :class:`~slime_tis.engine.reduce.MegatronReducer` (CP for per-sequence
sums, DP x CP / DP for batch statistics). Without it (single process, unit tests) everything is local.
"""

from __future__ import annotations

from dataclasses import dataclass

from slime_tis.core import LocalReducer, Reducer

__all__ = ["ParallelContext", "parallel_context"]


@dataclass(frozen=True)
class ParallelContext:
    cp_rank: int
    cp_size: int
    reducer: Reducer
    dp_rank: int = 0
    tp_rank: int = 0
    dp_size: int = 1
    last_pp_stage: bool = True


def parallel_context() -> ParallelContext:
    """Context from megatron's ``parallel_state`` if initialised, else a single-process context."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError:  # megatron-core is optional for single-process use
        return ParallelContext(0, 1, LocalReducer())
    if not ps.model_parallel_is_initialized():
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
