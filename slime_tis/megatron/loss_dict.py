"""The per-micro-batch loss dicts in the form Megatron-LM's ``train_step`` reduces and logs correctly.

Megatron-LM (``megatron/training/training.py``, ``train_step`` at tag ``core_v0.16.1``) turns the list of
per-micro-batch dicts the schedule returns into the logged values, key by key, on the last pipeline stage:

* a 2-element value ``[v, c]``: ``sum`` over micro-batches, ``all_reduce(SUM)`` over DP x CP, logged
  ``sum v / sum c``;
* a 1-element value: the mean over this rank's micro-batches, not reduced over DP (the legacy form; the
  hook never uses it, a share of a global loss averaged that way is wrong by ``M`` and differs per rank).

Every micro-batch dict must carry the same keys (``train_step`` reads the keys of the first one) and every
DP x CP rank the same key set (one all-reduce per key).

The hook reports, in every micro-batch dict ``k`` of the ``M`` on each of the ``R`` DP x CP ranks:

    "loss":   [loss_k * M * R, 1]       loss_k = this micro-batch's share of the step loss (sum = step loss)
    metric:   [value, 1]                value = the exact finalized step metric (already identical on
                                        every rank: reduced over DP x CP before the schedule returns)

so ``train_step`` logs ``sum_{k, ranks} loss_k`` (the step loss) and each metric unchanged, on every
rank. The gradients are not involved (these are detached copies).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["report_pair", "add_metrics_to_loss_dicts"]


def report_pair(value: Tensor) -> Tensor:
    """``[value, 1]`` as a 1-D tensor on ``value``'s device and dtype (detached)."""
    v = value.detach().reshape(1)
    return torch.cat([v, torch.ones_like(v)])


def add_metrics_to_loss_dicts(loss_dicts: list, metrics: dict[str, Tensor]) -> None:
    """Put ``[value, 1]`` of every metric into every micro-batch dict (in place; ``loss`` is left alone).

    ``loss_dicts`` is the list the training schedule returned on the last pipeline stage. Keys of
    ``metrics`` are the same on every DP x CP rank (finalized after one reduction with a schema fixed by
    the configuration), so the key set ``train_step`` all-reduces matches across ranks.
    """
    pairs = {k: report_pair(v) for k, v in sorted(metrics.items()) if k != "loss"}
    for d in loss_dicts:
        if isinstance(d, dict):
            d.update(pairs)
