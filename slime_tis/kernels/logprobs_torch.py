"""The torch math of token log-probs and entropies from vocab-parallel logits shared by the torch paths and the
Triton kernels' fallbacks: the full-vocabulary backward (docs/kernels.md, "What the kernels compute"), the combination
of per-rank online log-sum-exp partials, and the sampling-support replay (docs/sampling_support.md, "The training
side"). Rows without upstream gradient or outside ``keep`` get exact zeros (selected, never ``0 * NaN``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from slime_tis.kernels.dispatch import group_size

__all__ = ["CHUNK_SIZE", "FMIN", "LOGP_MIN", "fp32_chunk", "target_column", "grad_logits", "upstream", "finish_rows",
           "combine_partials", "SupportRows", "check_support", "support_rows", "support_forward", "support_grad"]

#: rows per log-softmax chunk: the one default of every ``chunk_size`` of the log-prob path
CHUNK_SIZE = 1024
LOGP_MIN = -200.0  # log p clamp in the backward: exp(-200) == 0 in float32, and (log p + H) stays finite
FMIN = torch.finfo(torch.float32).min


def target_column(targets: Tensor, start: int, width: int) -> tuple[Tensor, Tensor]:
    """``(col, hit) [T]``: each target's column in ``[start, start + width)`` (0 where outside) and whether it is in."""
    local = targets - start
    hit = (local >= 0) & (local < width)
    return torch.where(hit, local, torch.zeros_like(local)), hit


def fp32_chunk(logits: Tensor, start: int, end: int, temperature: float) -> Tensor:
    """A fresh float32 copy of ``logits[start:end] / temperature`` (never aliases the input)."""
    x = torch.empty(logits[start:end].shape, dtype=torch.float32, device=logits.device).copy_(logits[start:end])
    return x if temperature == 1.0 else x.div_(temperature)


def upstream(log_z: Tensor, keep: Tensor | None, grad_lp: Tensor | None, grad_h: Tensor | None,
             with_entropy: bool) -> tuple[Tensor, bool, Tensor]:
    """``(g_lp [T], use_h, live [T])``: ``g_lp`` (zeros where ``None``), whether ``grad_h`` counts, and the rows with
    an upstream gradient inside ``keep``; the others get exact zeros by selection (a NaN row adds no NaN)."""
    g_lp = grad_lp if grad_lp is not None else torch.zeros_like(log_z)
    use_h = with_entropy and grad_h is not None
    live = (g_lp != 0) | (grad_h != 0) if use_h else g_lp != 0
    return g_lp, use_h, live if keep is None else live & keep


def grad_logits(logits: Tensor, safe_idx: Tensor, in_shard: Tensor, log_z: Tensor, entropy: Tensor,
                keep: Tensor | None, grad_lp: Tensor | None, grad_h: Tensor | None, *, temperature: float,
                chunk_size: int, with_entropy: bool) -> Tensor:
    """``dL/dz [T, Vp]`` in the logits' dtype, ``chunk_size`` rows at a time. ``safe_idx`` / ``in_shard [T]``: the
    target's column in this shard (0 when not in it) / whether it is; ``logZ``, ``H [T]``: global, from the forward;
    ``keep [T]``: the row mask or ``None``."""
    n_tok = logits.shape[0]
    grad = torch.empty_like(logits)
    g_lp, use_h, live = upstream(log_z, keep, grad_lp, grad_h, with_entropy)
    for start in range(0, n_tok, chunk_size):
        end = min(start + chunk_size, n_tok)
        y = fp32_chunk(logits, start, end, temperature)
        y.sub_(log_z[start:end, None]).clamp_(min=LOGP_MIN)  # y = x - logZ = log p (-inf -> p = 0)
        p = torch.exp(y)
        gl = g_lp[start:end, None]
        if use_h:
            # p * (-g_lp - g_H (log p + H))
            y.add_(entropy[start:end, None]).mul_(-grad_h[start:end, None]).sub_(gl)
        else:
            y.copy_(-gl.expand_as(y))
        y.mul_(p)
        del p
        # onehot term: + g_lp at the target column on the owning rank
        hit = torch.where(in_shard[start:end], g_lp[start:end], torch.zeros_like(g_lp[start:end]))
        y.scatter_add_(1, safe_idx[start:end, None], hit[:, None])
        if temperature != 1.0:
            y.div_(temperature)
        y.masked_fill_(~live[start:end, None], 0.0)
        grad[start:end].copy_(y)
        del y
    return grad


def finish_rows(m: Tensor, sums: Tensor, with_entropy: bool, keep: Tensor | None = None) -> tuple[Tensor, ...]:
    """``(lp, H, logZ) [T]`` from the global max ``m`` and the summed ``[T, 3]`` ``(s = sum exp(x - m), x_y,
    e = sum exp(x - m)(x - m))``, ``[T, 4]`` with the replay's count of kept targets (``lp`` NaN where it is 0):
    ``logZ = m + log s``, ``lp = x_y - logZ``, ``H = log s - e / s``; ``lp = H = 0`` outside ``keep``."""
    log_s = torch.log(sums[:, 0])
    log_z = m + log_s
    lp = sums[:, 1] - log_z
    if sums.shape[1] == 4:
        lp = torch.where(sums[:, 3] > 0, lp, torch.full_like(log_z, float("nan")))
    ent = log_s - sums[:, 2] / sums[:, 0] if with_entropy else torch.zeros_like(lp)
    if keep is not None:
        lp, ent = torch.where(keep, lp, 0.0), torch.where(keep, ent, 0.0)
    return lp, ent, log_z


def combine_partials(m: Tensor, s: Tensor, x_y: Tensor, e: Tensor, group: dist.ProcessGroup | None,
                     with_entropy: bool = True, count: Tensor | None = None,
                     keep: Tensor | None = None) -> tuple[Tensor, ...]:
    """Each rank's online log-sum-exp partials ``[T]`` (max ``m``, ``s = sum exp(x - m)``, the target's ``x_y`` or 0,
    ``e = sum exp(x - m)(x - m)``[, ``count``]) -> :func:`finish_rows` of their combination: one MAX of ``[T]``, one
    SUM of ``[T, 3]`` (``[T, 4]``); none for a group of one rank."""
    big_m = m.clone()
    if group_size(group) > 1:
        dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=group)
    d = m - big_m
    alpha = torch.exp(d)
    sums = torch.stack([alpha * s, x_y, alpha * (e + d * s), *([] if count is None else [count])], dim=1)
    if group_size(group) > 1:
        dist.all_reduce(sums, group=group)
    return finish_rows(big_m, sums, with_entropy, keep)


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
    y = (x - m[rows.row]).clamp_(min=FMIN)                                       # x - m, finite
    e = torch.where(rows.own, torch.exp(y), torch.zeros_like(y))
    sums = torch.zeros(n_tok, 4, dtype=torch.float32, device=dev)
    sums[:, 0].index_add_(0, rows.row, e)
    sums[:, 1].index_add_(0, rows.row, torch.where(rows.is_target, x, torch.zeros_like(x)))
    if with_entropy:
        sums[:, 2].index_add_(0, rows.row, e * y)
    sums[:, 3].index_add_(0, rows.row, rows.is_target.to(torch.float32))
    if group_size(group) > 1:
        dist.all_reduce(sums, group=group)
    return finish_rows(m, sums, with_entropy, keep)


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
