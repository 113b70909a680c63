"""slime's schedule of one rollout, read from ``rollout_data``: which samples train in which optimizer step.

slime 624b824 (``build_dp_schedule``, ``train``) hands each DP rank ``micro_batch_indices`` (its micro-batches) and
``num_microbatches`` (per optimizer step): step ``s`` trains micro-batches ``o_s .. o_s + num_microbatches[s] - 1``,
``o_s = sum(num_microbatches[:s])``; every sample is in one micro-batch, all samples of a rollout in one step.
:func:`step_view` is one step's part, renumbered for slime's ``forward_only`` (the step hook's pass).
"""

from __future__ import annotations

from typing import Any

__all__ = ["n_steps", "sample_steps", "step_micro_batches", "step_view", "StepIterator"]

#: per-sample keys slime's ``forward_only`` reads (``slime/backends/megatron_utils/model.py``), plus the ones
#: the counting needs
_STEP_KEYS = ("tokens", "loss_masks", "multimodal_train_inputs", "total_lengths", "response_lengths",
              "rollout_log_probs", "advantages", "ref_log_probs")


def n_steps(rollout_data: dict[str, Any]) -> int:
    """Optimizer steps of this rollout (``len(num_microbatches)``; 1 when slime gave no schedule)."""
    num = rollout_data.get("num_microbatches")
    return len(num) if num else 1


def step_micro_batches(rollout_data: dict[str, Any], step: int) -> list[list[int]]:
    """The rank's micro-batches (local sample indices) that optimizer step ``step`` trains."""
    num = rollout_data.get("num_microbatches")
    mbs = rollout_data.get("micro_batch_indices")
    if not num or mbs is None:
        if step != 0:
            raise ValueError(f"step {step}: rollout_data has no num_microbatches / micro_batch_indices (one step)")
        return [list(range(len(rollout_data.get("loss_masks") or [])))]
    start = sum(int(k) for k in num[:step])
    return [list(m) for m in mbs[start:start + int(num[step])]]


def sample_steps(rollout_data: dict[str, Any]) -> list[int]:
    """Optimizer step of every local sample (``-1`` for a sample in no micro-batch)."""
    out = [-1] * len(rollout_data.get("loss_masks") or [])
    for s in range(n_steps(rollout_data)):
        for mb in step_micro_batches(rollout_data, s):
            for i in mb:
                out[i] = s
    return out


def step_view(rollout_data: dict[str, Any], step: int) -> tuple[dict[str, Any], list[list[int]], list[int]]:
    """``(data, micro_batch_indices, local)``: step ``step``'s samples as their own per-sample lists (the same
    tensor objects, micro-batch order), its micro-batches renumbered ``0 .. n - 1`` in that order, and each
    listed sample's index in ``rollout_data``."""
    mbs = step_micro_batches(rollout_data, step)
    local = [i for mb in mbs for i in mb]
    data = {k: [rollout_data[k][i] for i in local] for k in _STEP_KEYS if rollout_data.get(k) is not None}
    renumbered, start = [], 0
    for mb in mbs:
        renumbered.append(list(range(start, start + len(mb))))
        start += len(mb)
    return data, renumbered, local


class StepIterator:
    """slime's ``DataIterator`` contract (``reset``, ``get_next(keys)``, ``micro_batch_indices``) over a
    :func:`step_view`: what ``forward_only`` walks for the step hook's forward pass."""

    def __init__(self, data: dict[str, Any], micro_batch_indices: list[list[int]]) -> None:
        self.rollout_data = data
        self.micro_batch_indices = micro_batch_indices
        self.offset = 0

    def get_next(self, keys: Any) -> dict[str, Any]:
        idx = self.micro_batch_indices[self.offset]
        self.offset += 1
        return {k: (None if self.rollout_data.get(k) is None else [self.rollout_data[k][i] for i in idx])
                for k in keys}

    def reset(self) -> StepIterator:
        self.offset = 0
        return self
