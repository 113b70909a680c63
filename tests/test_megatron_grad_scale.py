"""``data_parallel_grad_average``: the gradient averaging of the data-parallel wrapper is read, never guessed.

Megatron DDP (``average_in_collective`` on and off) and an unknown wrapper under DP=2 run in real processes
(tests/dist: ``dp2-...-avg_in_collective``, ``test_unknown_data_parallel_wrapper_is_an_error``)."""

from __future__ import annotations

import pytest
import torch

from slime_tis.megatron import data_parallel_grad_average


class AveragingWrapper(torch.nn.Module):
    """A wrapper of the kind the hook cannot read (it might average or sum: nothing says which)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(2, 2)


def test_unknown_wrapper_with_several_ranks_is_an_error_naming_the_fix():
    with pytest.raises(ValueError, match=r"AveragingWrapper .* over the 4 data-parallel x context-parallel ranks"
                                         r".*grad_average= .*: 4 if the wrapper averages"):
        data_parallel_grad_average([AveragingWrapper()], dp_cp_size=4, per_token=False)


def test_one_rank_needs_no_wrapper_knowledge_and_an_override_is_used_as_given():
    assert data_parallel_grad_average([AveragingWrapper()], dp_cp_size=1, per_token=False) == 1.0
    assert data_parallel_grad_average([AveragingWrapper()], dp_cp_size=4, per_token=False, override=4) == 4.0
    assert data_parallel_grad_average([AveragingWrapper()], dp_cp_size=4, per_token=False, override=1) == 1.0
    for bad in (0, -2, True, "4"):
        with pytest.raises(ValueError, match="grad_average must be a number > 0"):
            data_parallel_grad_average([], dp_cp_size=4, per_token=False, override=bad)


def test_fsdp_name_that_is_a_factory_function_megatron_core_0_20(monkeypatch):
    """megatron-core 0.20 (Megatron-LM main, commit d98e8a64dd, ``megatron/core/distributed/fsdp/
    mcore_fsdp_adapter.py``) turns ``FullyShardedDataParallel`` into a factory function that returns a
    ``FullyShardedDataParallelV1`` or ``FullyShardedDataParallelV2`` instance. The module is rebuilt that way here
    (a function under the old name, two classes beside it): ``isinstance(chunk, <function>)`` raised TypeError for
    every wrapper that is not megatron DDP, even at DP=1."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter

    class FullyShardedDataParallelV1(torch.nn.Module):
        def __init__(self, dp_size: int) -> None:
            super().__init__()
            group = type("Group", (), {"size": lambda self: dp_size})()
            self.module = torch.nn.Linear(2, 2)
            self.module.dist_index = type("DistIndex", (), {"get_dp_group": lambda self: group})()

    class FullyShardedDataParallelV2(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(2, 2)

    def FullyShardedDataParallel(*args, **kwargs):  # noqa: N802 - the factory keeps the class's old name
        raise AssertionError("the factory is never called by the hook")

    monkeypatch.setattr(adapter, "FullyShardedDataParallel", FullyShardedDataParallel)
    monkeypatch.setattr(adapter, "FullyShardedDataParallelV1", FullyShardedDataParallelV1, raising=False)
    monkeypatch.setattr(adapter, "FullyShardedDataParallelV2", FullyShardedDataParallelV2, raising=False)

    assert data_parallel_grad_average([AveragingWrapper()], dp_cp_size=1, per_token=False) == 1.0
    assert data_parallel_grad_average([FullyShardedDataParallelV1(4)], dp_cp_size=4, per_token=False) == 4.0
    assert data_parallel_grad_average([FullyShardedDataParallelV1(4)], dp_cp_size=4, per_token=True) == 1.0
    with pytest.raises(ValueError, match=r"FullyShardedDataParallelV2 .*grad_average="):
        data_parallel_grad_average([FullyShardedDataParallelV2()], dp_cp_size=2, per_token=False)
