"""The sampling-support replay from the hidden states (torch): only the kept logits ``x_v = h_t . W_v / tau`` are
formed (``O(S H)``, no ``[T, V]`` logits), then the replay's formulas (:mod:`slime_tis.kernels.logprobs_torch`);
backward ``dL/dh_t = sum_{v in K_t} g_v W_v``, ``dL/dW_v = sum_{t: v in K_t} g_v h_t``. docs/sampling_support.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from slime_tis.kernels.dispatch import group_size
from slime_tis.kernels.logprobs_torch import SupportRows, check_support, support_forward, support_grad, support_rows
from slime_tis.kernels.output_layer import check_inputs

__all__ = ["SupportFusedOutputLayer", "fused_support_log_probs_and_entropy"]


def _kept_logits(hidden: Tensor, weight: Tensor, rows: SupportRows, temperature: float, chunk: int) -> Tensor:
    x = torch.empty(rows.row.numel(), dtype=torch.float32, device=hidden.device)
    for c in range(0, x.numel(), chunk):
        r, k = rows.row[c:c + chunk], rows.col[c:c + chunk]
        x[c:c + chunk] = (hidden[r].to(torch.float32) * weight[k].to(torch.float32)).sum(-1)
    return x.div_(temperature)


class SupportFusedOutputLayer(torch.autograd.Function):
    """``(hidden [T, H], weight [Vp, H], targets [T], ids [S], offsets [T + 1]) -> (log_probs [T], entropy [T])``."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, ids: Tensor, offsets: Tensor,
                temperature: float, group: dist.ProcessGroup | None, vocab_start: int, keep: Tensor | None,
                chunk: int, reduce_hidden_grad: bool):
        rows = support_rows(ids, offsets, targets, vocab_start, weight.shape[0])
        x = _kept_logits(hidden.detach(), weight.detach(), rows, temperature, chunk)
        lp, ent, log_z = support_forward(x, rows, hidden.shape[0], group, True, keep)
        ctx.save_for_backward(hidden, weight, *rows, x, log_z, ent, keep)
        ctx.set_materialize_grads(False)
        ctx.temperature, ctx.group, ctx.chunk, ctx.reduce = temperature, group, chunk, reduce_hidden_grad
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp: Tensor | None, grad_h: Tensor | None):
        hidden, weight, row, col, own, is_target, x, log_z, entropy, keep = ctx.saved_tensors
        rows = SupportRows(row, col, own, is_target)
        g = support_grad(x, rows, log_z, entropy, keep, grad_lp, grad_h, ctx.temperature, True)
        d_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for c in range(0, g.numel(), ctx.chunk):
            r, k, gc = row[c:c + ctx.chunk], col[c:c + ctx.chunk], g[c:c + ctx.chunk, None]
            live = gc != 0  # selected, never 0 * NaN (a masked row may hold anything)
            d_hidden.index_add_(0, r, torch.where(live, gc * weight[k].to(torch.float32), 0.0))
            d_weight.index_add_(0, k, torch.where(live, gc * hidden[r].to(torch.float32), 0.0))
        group = ctx.group
        if ctx.reduce and group_size(group) > 1:
            dist.all_reduce(d_hidden, group=group)
        return (d_hidden.to(hidden.dtype), d_weight.to(weight.dtype), None, None, None, None, None, None, None, None,
                None)


def fused_support_log_probs_and_entropy(hidden: Tensor, weight: Tensor, targets: Tensor,
                                        support: tuple[Tensor, Tensor], *, temperature: float = 1.0,
                                        loss_mask: Tensor | None = None, tp_group=None,
                                        reduce_hidden_grad: bool = True, chunk_size: int = 65536,
                                        ) -> tuple[Tensor, Tensor]:
    """:func:`slime_tis.kernels.output_layer.fused_log_probs_and_entropy` (same arguments; the torch code) restricted
    to each position's ``support`` ``(ids [S], offsets [N + 1])`` over the ``N`` flattened positions and renormalised
    there; ``chunk_size``: kept ids per dot-product chunk."""
    temperature = check_inputs(hidden, weight, targets, loss_mask, temperature, chunk_size, tp_group)
    flat_y = targets.reshape(-1).to(torch.int64)
    ids, offsets = check_support(support, flat_y.numel())
    keep = None if loss_mask is None else loss_mask.reshape(-1).to(flat_y.device) != 0
    tp = group_size(tp_group)
    vocab_start = (dist.get_rank(tp_group) if tp > 1 else 0) * weight.shape[0]
    lp, ent = SupportFusedOutputLayer.apply(hidden.reshape(-1, hidden.shape[-1]), weight, flat_y, ids, offsets,
                                            temperature, tp_group if tp > 1 else None, vocab_start, keep,
                                            chunk_size, bool(reduce_hidden_grad))
    return lp.view(targets.shape), ent.view(targets.shape)
