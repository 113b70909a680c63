"""Token log-probs and entropies of ``softmax(logits / T)`` restricted to each position's sampling support.

The replay of the support a token was sampled from (top-k / top-p): for position ``t`` with kept ids ``K_t``
(global vocabulary ids, CSR: ``ids[offsets[t]:offsets[t + 1]]``), logits ``z``, temperature ``tau`` and
target ``y`` in ``K_t``:

    x_v    = z_v / tau                                         (float32, v in K_t only)
    logZ_K = m + log(sum_{v in K_t} exp(x_v - m)),  m = max_{v in K_t} x_v      (max and sums all-reduced)
    lp     = x_y - logZ_K                                      log q(y), q = softmax(x) on K_t, 0 elsewhere
    H      = logZ_K - sum_{v in K_t} q_v x_v                   entropy of q

Backward, for ``v`` in ``K_t`` only (every other logit gets an exact zero: gradients flow through the kept
logits alone), ``g_lp``, ``g_H`` the upstream gradients:

    d L / d z_v = (g_lp ([v = y] - q_v) - g_H q_v (log q_v + H)) / tau

Tensor parallelism: rank ``r`` owns the columns ``[r Vp, (r + 1) Vp)``; each rank gathers the logits of the
kept ids in its shard (``[S]`` values, never a ``[T, V]`` mask), then the same two all-reduces as the full
log-softmax (:mod:`slime_tis.engine.logprobs`): MAX of ``m [T]`` and SUM of ``[T, 4]`` (sum of exponentials,
``x_y``, ``sum e (x - m)``, how many kept ids equal ``y``). The collectives depend on the layout only. Memory:
``O(S)`` float32 besides the logit gradient, ``S`` the number of kept ids.

Bad rows give NaN (the core rejects the sequence, ``tis/nonfinite_seq_fraction``): a kept row whose target is
not among its ids (on any rank) or whose support is empty. Ids outside ``[0, V)`` belong to no shard and are
not counted (the rollout side rejects them first: :func:`slime_tis.sglang.validate_support`). Rows outside
``keep`` get log-prob and entropy 0 and a zero gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["check_support", "padded_support", "select_rows", "SupportLogProbEntropy"]

_FMIN = torch.finfo(torch.float32).min
_LOGQ_MIN = -200.0  # log q clamp in the backward, as in the full path (q is exactly 0 in float32 below it)


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
    """The supports of a ``[B, S]`` padded micro-batch (CSR over its ``B * S`` positions, row-major, as
    ``TISBatch.from_padded`` lays out the other fields) on this context-parallel rank: megatron's load-balanced CP
    slice of the positions (``engine.batch.cp_slice_padded``) with their rows; unchanged at CP = 1 or without
    ``cp_slice``. ``cp_size``, ``cp_rank``: default from ``parallel_state``."""
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


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


class SupportLogProbEntropy(torch.autograd.Function):
    """``(logits [T, Vp], targets [T], ids [S], offsets [T + 1]) -> (log_probs [T], entropy [T])``, float32."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, ids: Tensor, offsets: Tensor, temperature: float,
                group: dist.ProcessGroup | None, vocab_start: int, with_entropy: bool, keep: Tensor | None):
        n_tok, vp = logits.shape
        dev = logits.device
        ids = ids.to(device=dev, dtype=torch.int64)
        offsets = offsets.to(device=dev, dtype=torch.int64)
        lengths = offsets[1:] - offsets[:-1]
        row = torch.repeat_interleave(torch.arange(n_tok, device=dev), lengths, output_size=ids.numel())
        col = ids - vocab_start
        own = (col >= 0) & (col < vp)
        col = torch.where(own, col, torch.zeros_like(col))
        x = logits.detach()[row, col].to(torch.float32).div_(temperature)          # [S] kept logits / tau
        x = torch.where(own, x, torch.full_like(x, float("-inf")))
        row_max = torch.full((n_tok,), float("-inf"), dtype=torch.float32, device=dev)
        row_max.scatter_reduce_(0, row, x, "amax", include_self=True)
        if _group_size(group) > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        m = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))  # empty / all -inf rows
        y = (x - m[row]).clamp_(min=_FMIN)                                           # x - m, finite
        e = torch.where(own, torch.exp(y), torch.zeros_like(y))
        is_target = own & (ids == targets.to(torch.int64)[row])
        sums = torch.zeros(n_tok, 4, dtype=torch.float32, device=dev)
        sums[:, 0].index_add_(0, row, e)
        sums[:, 1].index_add_(0, row, torch.where(is_target, x, torch.zeros_like(x)))
        if with_entropy:
            sums[:, 2].index_add_(0, row, e * y)
        sums[:, 3].index_add_(0, row, is_target.to(torch.float32))
        if _group_size(group) > 1:
            dist.all_reduce(sums, group=group)
        sum_exp = sums[:, 0]
        log_z = m + torch.log(sum_exp)
        found = sums[:, 3] > 0
        log_probs = torch.where(found, sums[:, 1] - log_z, torch.full_like(log_z, float("nan")))
        entropy = torch.log(sum_exp) - sums[:, 2] / sum_exp if with_entropy else torch.zeros_like(log_probs)
        if keep is not None:
            log_probs = torch.where(keep, log_probs, 0.0)
            entropy = torch.where(keep, entropy, 0.0)
        ctx.save_for_backward(row, col, own, is_target, x, log_z, entropy, keep)
        ctx.set_materialize_grads(False)
        ctx.shape, ctx.dtype, ctx.temperature, ctx.with_entropy = (n_tok, vp), logits.dtype, temperature, with_entropy
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_lp: Tensor | None, grad_h: Tensor | None):
        row, col, own, is_target, x, log_z, entropy, keep = ctx.saved_tensors
        g_lp = grad_lp if grad_lp is not None else torch.zeros_like(log_z)
        use_h = ctx.with_entropy and grad_h is not None
        live = (g_lp != 0) | (grad_h != 0) if use_h else g_lp != 0
        if keep is not None:
            live = live & keep
        log_q = (x - log_z[row]).clamp_(min=_LOGQ_MIN)
        q = torch.exp(log_q)
        g = g_lp[row] * (is_target.to(torch.float32) - q)
        if use_h:
            g = g - grad_h[row] * q * (log_q + entropy[row])
        if ctx.temperature != 1.0:
            g = g / ctx.temperature
        g = torch.where(own & live[row], g, torch.zeros_like(g))   # selected, never 0 * NaN
        grad = torch.zeros(ctx.shape, dtype=ctx.dtype, device=x.device)
        grad.index_put_((row, col), g.to(ctx.dtype), accumulate=True)
        return grad, None, None, None, None, None, None, None, None
