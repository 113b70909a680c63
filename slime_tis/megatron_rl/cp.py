"""Context parallelism for unpacked Megatron-LM RL rows: megatron-core's load-balanced layout, as the megatron-core
hook's batches use it (``slime_tis.engine.batch.cp_slice_padded``: the row cut into ``2 cp`` chunks, CP rank ``r``
keeping chunks ``r`` and ``2 cp - 1 - r``), the engine's CP reducer doing the per-sequence sums.

Every CP rank of a DP rank holds the same rows ``[B, S]`` (Megatron-LM splits the collection over DP ranks only);
on each, the model runs on the rank's part of every row (``[B, S / cp]`` tokens and position ids, causal attention
across the CP group: TE's ``sbhd`` context-parallel attention on GPU), and the ``TISBatch`` holds the same part of
the row-aligned grids (labels ``tokens[:, t + 1]``, loss mask, advantages, log-probs; the last position, which
predicts nothing, masked). The pi_old / pi_ref passes gather the parts back into full rows (:func:`gather_rows`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from slime_tis.engine.batch import cp_slice_padded

__all__ = ["gather_rows", "local_rows", "row_grid"]


def row_grid(x: Tensor) -> Tensor:
    """``[B, S-1]`` (per log-prob position) -> ``[B, S]`` aligned with the tokens, a zero last column."""
    return torch.cat([x, x.new_zeros(x.shape[0], 1)], dim=1)


def local_rows(x: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """This CP rank's part ``[B, S / cp]`` of ``[B, S]`` (``cp_slice_padded``)."""
    return cp_slice_padded(x, cp_size, cp_rank)


def gather_rows(local: Tensor, cp_size: int, group=None) -> Tensor:
    """``[B, S]`` full rows from every CP rank's part ``[B, S / cp]`` (no gradient; the log-prob passes)."""
    if cp_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    b, c = local.shape[0], local.shape[1] // 2
    full = local.new_empty(b, 2 * cp_size, c, *local.shape[2:])
    for r, part in enumerate(parts):
        full[:, r], full[:, 2 * cp_size - 1 - r] = part[:, :c], part[:, c:]
    return full.reshape(b, 2 * cp_size * c, *local.shape[2:])
