"""Process-group setup for the example: single process or ``torchrun``, CPU (gloo) or CUDA (nccl)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    pp_rank: int
    pp_size: int
    device: torch.device

    @property
    def is_engine_rank(self) -> bool:
        """The rank that owns the rollout engine / client (global rank 0)."""
        return self.rank == 0

    @property
    def is_logging_rank(self) -> bool:
        """Last pipeline stage of data-parallel rank 0: it sees the loss and the tis/ metrics."""
        return self.dp_rank == 0 and self.pp_rank == self.pp_size - 1


def init_distributed(*, pp: int = 1, seed: int = 0) -> DistInfo:
    """Initialise torch.distributed (env from torchrun, or a 1-process group) and megatron's
    ``parallel_state`` with pipeline size ``pp`` (the rest of the world is data parallel, TP = 1)."""
    from examples.rl import cpu_compat

    cpu_compat.enable()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not torch.distributed.is_initialized():
        alone = {}
        if "RANK" not in os.environ:  # plain `python -m examples.rl.train`: one process, its store in memory (no port)
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            alone = dict(store=torch.distributed.HashStore(), rank=0, world_size=1)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            torch.distributed.init_process_group("nccl", **alone)
        else:
            torch.distributed.init_process_group("gloo", **alone)
    world = torch.distributed.get_world_size()
    if world % pp:
        raise ValueError(f"world size {world} is not divisible by --pp {pp}")
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(seed)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return DistInfo(
        rank=torch.distributed.get_rank(),
        world_size=world,
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=pp,
        device=device,
    )


def shutdown() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
