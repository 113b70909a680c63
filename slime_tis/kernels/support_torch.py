"""The torch math of the sampling-support replay (formulas: docs/sampling_support.md, "The training side"), shared
by the log-probs from logits (:mod:`slime_tis.engine.support_logprobs`) and from hidden states
(:mod:`slime_tis.kernels.output_layer_support`), which gather the kept logits ``x [S]`` their own way.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from slime_tis.kernels.dispatch import group_size
from slime_tis.kernels.logprobs_torch import LOGP_MIN, upstream

__all__ = ["SupportRows", "check_support", "support_rows", "support_forward", "support_grad"]

_FMIN = torch.finfo(torch.float32).min


def check_support(support: object, n_rows: int) -> tuple[Tensor, Tensor]:
    """``(ids [S] integer, offsets [n_rows + 1] integer)`` or ``ValueError`` naming what is wrong."""
    if not isinstance(support, (tuple, list)) or len(support) != 2:
        raise ValueError(f"support must be a pair (support_ids [S], support_offsets [T + 1]), got "
                         f"{type(support).__name__}")
    ids, offsets = support
    for name, t in (("support_ids", ids), ("support_offsets", offsets)):
        if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor, got {getattr(t, 'dtype', type(t).__name__)} "
                             f"{tuple(getattr(t, 'shape', ()))}")
    if offsets.numel() != n_rows + 1:
        raise ValueError(f"support_offsets has {offsets.numel()} entries; the logits have {n_rows} rows, so it "
                         f"needs {n_rows + 1}")
    return ids, offsets


class SupportRows(NamedTuple):
    """Where each kept id lies on this shard, all ``[S]``: its position, its column (0 when not owned), owned by this
    shard, owned and equal to the position's target."""

    row: Tensor
    col: Tensor
    own: Tensor
    is_target: Tensor


def support_rows(ids: Tensor, offsets: Tensor, targets: Tensor, vocab_start: int, vp: int) -> SupportRows:
    """:class:`SupportRows` of the CSR ``(ids [S], offsets [T + 1])`` on the shard ``[vocab_start, vocab_start +
    vp)``; no host synchronisation (``repeat_interleave`` with the known output size)."""
    dev = targets.device
    ids = ids.to(device=dev, dtype=torch.int64)
    offsets = offsets.to(device=dev, dtype=torch.int64)
    n_tok = offsets.numel() - 1
    row = torch.repeat_interleave(torch.arange(n_tok, device=dev), offsets[1:] - offsets[:-1],
                                  output_size=ids.numel())
    col = ids - vocab_start
    own = (col >= 0) & (col < vp)
    col = torch.where(own, col, torch.zeros_like(col))
    return SupportRows(row, col, own, own & (ids == targets.to(torch.int64)[row]))


def support_forward(x: Tensor, rows: SupportRows, n_tok: int, group: dist.ProcessGroup | None, with_entropy: bool,
                    keep: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(lp [T], H [T], logZ_K [T])`` from the kept logits ``x [S]`` (float32, any value where not owned)."""
    dev = x.device
    x = torch.where(rows.own, x, torch.full_like(x, float("-inf")))
    row_max = torch.full((n_tok,), float("-inf"), dtype=torch.float32, device=dev)
    row_max.scatter_reduce_(0, rows.row, x, "amax", include_self=True)
    if group_size(group) > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    m = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))  # empty / all -inf rows
    y = (x - m[rows.row]).clamp_(min=_FMIN)                                       # x - m, finite
    e = torch.where(rows.own, torch.exp(y), torch.zeros_like(y))
    sums = torch.zeros(n_tok, 4, dtype=torch.float32, device=dev)
    sums[:, 0].index_add_(0, rows.row, e)
    sums[:, 1].index_add_(0, rows.row, torch.where(rows.is_target, x, torch.zeros_like(x)))
    if with_entropy:
        sums[:, 2].index_add_(0, rows.row, e * y)
    sums[:, 3].index_add_(0, rows.row, rows.is_target.to(torch.float32))
    if group_size(group) > 1:
        dist.all_reduce(sums, group=group)
    sum_exp = sums[:, 0]
    log_z = m + torch.log(sum_exp)
    lp = torch.where(sums[:, 3] > 0, sums[:, 1] - log_z, torch.full_like(log_z, float("nan")))
    ent = torch.log(sum_exp) - sums[:, 2] / sum_exp if with_entropy else torch.zeros_like(lp)
    if keep is not None:
        lp, ent = torch.where(keep, lp, 0.0), torch.where(keep, ent, 0.0)
    return lp, ent, log_z


def support_grad(x: Tensor, rows: SupportRows, log_z: Tensor, entropy: Tensor, keep: Tensor | None,
                 grad_lp: Tensor | None, grad_h: Tensor | None, temperature: float, with_entropy: bool) -> Tensor:
    """``g [S]`` float32: ``dL/dz`` of each kept logit (0 where not owned or without an upstream gradient)."""
    g_lp, use_h, live = upstream(log_z, keep, grad_lp, grad_h, with_entropy)
    log_q = (x - log_z[rows.row]).clamp_(min=LOGP_MIN)
    q = torch.exp(log_q)
    g = g_lp[rows.row] * (rows.is_target.to(torch.float32) - q)
    if use_h:
        g = g - grad_h[rows.row] * q * (log_q + entropy[rows.row])
    if temperature != 1.0:
        g = g / temperature
    return torch.where(rows.own & live[rows.row], g, torch.zeros_like(g))
