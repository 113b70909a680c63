"""``MegatronReducer``: the core's ``Reducer`` on megatron's groups: ``sequence_sum`` over CP, ``batch_sum`` over DP x
CP (DP only with ``per_sequence=True``), ``batch_min`` / ``batch_max`` over DP x CP; never TP (its ranks hold copies)
or WORLD. Each is one all-reduce of a copy (none for one rank) of a statistic that must not require grad.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["MegatronReducer"]


class MegatronReducer:
    """Reducer over megatron's CP, DP and DP x CP groups: the given ones, else ``parallel_state``'s (looked up once)."""

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
        out = x.contiguous().to(torch.int32) if x.dtype == torch.bool else x.clone().contiguous()
        dist.all_reduce(out, op=op, group=group)
        return out.to(torch.bool) if x.dtype == torch.bool else out

    def sequence_sum(self, x: Tensor) -> Tensor:
        """Per-sequence partial sums ``[n_seq, k]`` completed over CP."""
        return self._reduce(x, self.cp_group, self.cp_size, dist.ReduceOp.SUM, "sequence_sum")

    def batch_sum(self, x: Tensor, *, per_sequence: bool = False) -> Tensor:
        if per_sequence:
            return self._reduce(x, self.dp_group, self.dp_size, dist.ReduceOp.SUM, "batch_sum")
        return self._reduce(x, self.dp_cp_group, self.dp_cp_size, dist.ReduceOp.SUM, "batch_sum")

    def batch_min(self, x: Tensor) -> Tensor:
        return self._reduce(x, self.dp_cp_group, self.dp_cp_size, dist.ReduceOp.MIN, "batch_min")

    def batch_max(self, x: Tensor) -> Tensor:
        return self._reduce(x, self.dp_cp_group, self.dp_cp_size, dist.ReduceOp.MAX, "batch_max")


def reducer_for_schedule(schedule_kwargs: dict) -> MegatronReducer:
    """The reducer on the schedule call's ``pg_collection`` groups (``cp``, ``dp``, ``dp_cp``; Megatron-LM >= 0.20
    passes the model's), else on ``parallel_state``'s."""
    pg = schedule_kwargs.get("pg_collection")
    groups = {name: getattr(pg, name, None) for name in ("cp", "dp", "dp_cp")} if pg is not None else {}
    return MegatronReducer(cp_group=groups.get("cp"), dp_group=groups.get("dp"), dp_cp_group=groups.get("dp_cp"))
