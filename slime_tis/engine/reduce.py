"""``MegatronReducer``: the core's ``Reducer`` protocol on megatron's ``parallel_state`` process groups.

=================  ===========================================  ==========
method             group (megatron ``parallel_state``)          operator
=================  ===========================================  ==========
``sequence_sum``   context-parallel group                       SUM
``batch_sum``      data-parallel x context-parallel group       SUM
``batch_sum``      data-parallel group (``per_sequence=True``)  SUM
``batch_min``      data-parallel x context-parallel group       MIN
``batch_max``      data-parallel x context-parallel group       MAX
=================  ===========================================  ==========

Never WORLD: tensor-parallel ranks hold identical copies of every statistic (the log-probs are already
all-reduced over TP) and pipeline stages other than the last hold none, so both are excluded by
construction. Each method is one all-reduce on a copy (inputs are not modified) and a no-op for a
group of one rank. Inputs must not require grad: these are statistics, not loss terms; a
differentiable all-reduce here would double-count gradients that megatron DDP already reduces.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["MegatronReducer"]


class MegatronReducer:
    """Reducer over megatron's CP, DP and DP x CP groups (looked up once, at construction).

    Args:
        cp_group, dp_group, dp_cp_group: override the groups (default: ``parallel_state``'s, which must
            be initialised). Useful for custom process-group collections.
    """

    def __init__(self, *, cp_group: dist.ProcessGroup | None = None,
                 dp_group: dist.ProcessGroup | None = None,
                 dp_cp_group: dist.ProcessGroup | None = None) -> None:
        if cp_group is None or dp_group is None or dp_cp_group is None:
            from megatron.core import parallel_state as ps

            if not ps.model_parallel_is_initialized():
                raise RuntimeError("MegatronReducer needs megatron parallel_state.initialize_model_parallel"
                                   "() first (or explicit cp_group, dp_group and dp_cp_group)")
            cp_group = cp_group or ps.get_context_parallel_group()
            dp_group = dp_group or ps.get_data_parallel_group(with_context_parallel=False)
            dp_cp_group = dp_cp_group or ps.get_data_parallel_group(with_context_parallel=True)
        self.cp_group, self.dp_group, self.dp_cp_group = cp_group, dp_group, dp_cp_group
        self.cp_size = dist.get_world_size(cp_group)
        self.dp_size = dist.get_world_size(dp_group)
        self.dp_cp_size = dist.get_world_size(dp_cp_group)

    @staticmethod
    def _reduce(x: Tensor, group: dist.ProcessGroup, size: int, op: dist.ReduceOp, what: str) -> Tensor:
        if x.requires_grad:
            raise ValueError(f"MegatronReducer.{what}: input requires grad; "
                             "reductions are for detached statistics")
        if size == 1:
            return x
        out = x.clone().contiguous()
        if out.dtype == torch.bool:
            out = out.to(torch.int32)
            dist.all_reduce(out, op=op, group=group)
            return out.to(torch.bool)
        dist.all_reduce(out, op=op, group=group)
        return out

    def sequence_sum(self, x: Tensor) -> Tensor:
        """Per-sequence partial sums ``[n_seq, k]`` completed over the CP group (every CP rank must call)."""
        return self._reduce(x, self.cp_group, self.cp_size, dist.ReduceOp.SUM, "sequence_sum")

    def batch_sum(self, x: Tensor, *, per_sequence: bool = False) -> Tensor:
        """SUM over DP x CP (token-domain values) or over DP only (``per_sequence=True``)."""
        if per_sequence:
            return self._reduce(x, self.dp_group, self.dp_size, dist.ReduceOp.SUM, "batch_sum")
        return self._reduce(x, self.dp_cp_group, self.dp_cp_size, dist.ReduceOp.SUM, "batch_sum")

    def batch_min(self, x: Tensor) -> Tensor:
        """Element-wise MIN over DP x CP (a true minimum, not a mean of per-rank minima)."""
        return self._reduce(x, self.dp_cp_group, self.dp_cp_size, dist.ReduceOp.MIN, "batch_min")

    def batch_max(self, x: Tensor) -> Tensor:
        """Element-wise MAX over DP x CP."""
        return self._reduce(x, self.dp_cp_group, self.dp_cp_size, dist.ReduceOp.MAX, "batch_max")


def reducer_for_schedule(schedule_kwargs: dict) -> MegatronReducer:
    """The reducer on the groups the schedule itself is told to use.

    Megatron-LM >= 0.20 hands ``train_step``'s ``pg_collection`` (the model's process groups, which need not be
    ``parallel_state``'s) to the schedule and all-reduces the logged ``[loss, count]`` pairs over its ``dp_cp``
    group. When the schedule call carries one, the loss denominators and metrics are reduced over its ``cp``,
    ``dp`` and ``dp_cp`` groups; otherwise over ``parallel_state``'s."""
    pg = schedule_kwargs.get("pg_collection")
    groups = {name: getattr(pg, name, None) for name in ("cp", "dp", "dp_cp")} if pg is not None else {}
    return MegatronReducer(cp_group=groups.get("cp"), dp_group=groups.get("dp"), dp_cp_group=groups.get("dp_cp"))
