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
