"""The torch backward of token log-probs and entropies from vocab-parallel logits (no communication): the torch
path's (:mod:`slime_tis.engine.logprobs`) and the Triton kernels' fallback. Formula: docs/kernels.md, "What the
kernels compute"; rows without upstream gradient or outside ``keep`` get exact zeros (selected, never ``0 * NaN``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["CHUNK_SIZE", "LOGP_MIN", "fp32_chunk", "grad_logits", "upstream"]

#: rows per log-softmax chunk: the one default of every ``chunk_size`` of the log-prob path
CHUNK_SIZE = 1024
LOGP_MIN = -200.0  # log p clamp in the backward: exp(-200) == 0 in float32, and (log p + H) stays finite


def fp32_chunk(logits: Tensor, start: int, end: int, temperature: float) -> Tensor:
    """A fresh float32 copy of ``logits[start:end] / temperature`` (never aliases the input)."""
    chunk = logits[start:end]
    x = torch.empty(chunk.shape, dtype=torch.float32, device=chunk.device)
    x.copy_(chunk)
    if temperature != 1.0:
        x.div_(temperature)
    return x


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
