"""A small model of how Megatron-LM's training loop reduces and logs the schedule's loss dicts.

Modelled: NVIDIA/Megatron-LM tag ``core_v0.16.1`` (commit 55ac7082517c3878ae653c07c09c534b8aed49f6),
``megatron/training/training.py``:

* ``train_step`` (after ``optimizer.step()``, last pipeline stage only): for every key of the *first*
  micro-batch dict, the per-micro-batch values are flattened; 2-element values ``[v, c]`` are summed over the
  micro-batches, all-reduced (SUM) over the data-parallel x context-parallel group and reported as
  ``v / c``; 1-element values are averaged over this rank's micro-batches and not reduced; other sizes raise.
* ``training_log``: each reported value is added to a running total per key and logged (TensorBoard /
  W&B per iteration, console averaged over the logging interval).

megatron-core 0.16.1 ships no ``megatron.training``, so the Python 3.11 leg uses this model of its arithmetic
(written here, not copied); the Python 3.12 leg (megatron-core 0.19.2, whose wheel ships ``megatron.training``) runs
the hook under the real ``train_step`` (tests/dist/test_megatron_lm_train_step.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def train_step_loss_reduced(loss_dicts: list[dict], dp_cp_group=None) -> dict[str, torch.Tensor]:
    """What ``train_step`` returns as ``loss_reduced`` for this rank's micro-batch dicts."""
    out: dict[str, torch.Tensor] = {}
    for key in loss_dicts[0]:
        values = [d[key].reshape(-1) for d in loss_dicts]
        if values[0].numel() == 2:
            total = torch.stack(values).sum(0)
            if dp_cp_group is not None:
                dist.all_reduce(total, group=dp_cp_group)
            out[key] = total[0] / total[1]
        elif values[0].numel() == 1:
            out[key] = torch.cat(values).mean()  # the legacy form: a mean over this rank's micro-batches
        else:
            raise ValueError(f"Megatron-LM rejects a loss-dict value of shape {tuple(values[0].shape)} ({key})")
    return out
