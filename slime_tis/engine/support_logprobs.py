"""Token log-probs and entropies of ``softmax(logits / T)`` restricted to each position's sampling support (the
CSR ``ids[offsets[t]:offsets[t + 1]]`` of global ids) and renormalised there: the torch replay (the same two TP
all-reduces as the full pass, memory ``O(S)``, gradients through the kept logits only) and the CP slicing of the
supports. Formulas and bad rows (NaN): docs/sampling_support.md, "The training side".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from slime_tis.kernels.logprobs_torch import SupportRows, check_support, support_forward, support_grad, support_rows

__all__ = ["check_support", "padded_support", "select_rows", "SupportLogProbEntropy"]


def select_rows(ids: Tensor, offsets: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """The CSR of rows ``rows [n]`` (int64 indices) of the CSR ``(ids, offsets)``, in that order."""
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    new_offsets = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=offsets.device)
    new_offsets[1:] = torch.cumsum(lengths, 0)
    total = int(new_offsets[-1])  # host-sync-ok (batch preparation, outside the loss)
    first = torch.repeat_interleave(new_offsets[:-1], lengths, output_size=total)
    src = torch.repeat_interleave(starts, lengths, output_size=total) + torch.arange(total, device=ids.device) - first
    return ids[src], new_offsets


def padded_support(ids: Tensor, offsets: Tensor, shape: tuple[int, int], *, cp_slice: bool = True,
                   cp_size: int | None = None, cp_rank: int | None = None) -> tuple[Tensor, Tensor]:
    """The CSR of a ``[B, S]`` padded micro-batch's supports (over its ``B * S`` positions, row-major) on this CP rank,
    sliced as ``TISBatch.from_padded`` slices the other fields (``cp_size``, ``cp_rank``: from ``parallel_state``)."""
    from slime_tis.engine.batch import _cp_layout, cp_slice_padded

    b, s = shape
    ids, offsets = check_support((ids, offsets), b * s)
    if cp_slice and (cp_size is None or cp_rank is None):
        cp_size, cp_rank = _cp_layout()
    if not cp_slice or cp_size == 1:
        return ids, offsets.to(torch.int64)
    positions = torch.arange(b * s, device=offsets.device).view(b, s)
    rows = cp_slice_padded(positions, cp_size, cp_rank).reshape(-1)
    return select_rows(ids, offsets.to(torch.int64), rows)


class SupportLogProbEntropy(torch.autograd.Function):
    """``(logits [T, Vp], targets [T], ids [S], offsets [T + 1]) -> (log_probs [T], entropy [T])``, float32."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, ids: Tensor, offsets: Tensor, temperature: float,
                group: dist.ProcessGroup | None, vocab_start: int, with_entropy: bool, keep: Tensor | None):
        n_tok, vp = logits.shape
        rows = support_rows(ids, offsets, targets, vocab_start, vp)
        x = logits.detach()[rows.row, rows.col].to(torch.float32).div_(temperature)   # [S] kept logits / tau
        lp, ent, log_z = support_forward(x, rows, n_tok, group, with_entropy, keep)
        ctx.save_for_backward(*rows, x, log_z, ent, keep)
        ctx.set_materialize_grads(False)
        ctx.shape, ctx.dtype, ctx.temperature, ctx.with_entropy = (n_tok, vp), logits.dtype, temperature, with_entropy
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp: Tensor | None, grad_h: Tensor | None):
        row, col, own, is_target, x, log_z, entropy, keep = ctx.saved_tensors
        rows = SupportRows(row, col, own, is_target)
        g = support_grad(x, rows, log_z, entropy, keep, grad_lp, grad_h, ctx.temperature, ctx.with_entropy)
        grad = torch.zeros(ctx.shape, dtype=ctx.dtype, device=x.device)
        grad.index_put_((row, col), g.to(ctx.dtype), accumulate=True)
        return grad, None, None, None, None, None, None, None, None
