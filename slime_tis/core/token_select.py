"""Token selections of the surrogates (docs/semantics.md): DPPO's trust-region masks and Clip-Cov / KL-Cov's
covariance selections. Inputs ``[T]``, detached, 0 at tokens not kept; every selection is False there. No host sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["dppo_masked", "DIVERGENCES", "covariance", "selection_size", "first_k", "hash_keys"]

F64 = torch.float64
#: the Bernoulli KL's guard against log(0) where p or q is 1 (verl and SkyRL use the same 1e-8)
BERNOULLI_EPS = 1e-8


def _binary_tv(p: Tensor, q: Tensor) -> Tensor:
    return (p - q).abs()


def bernoulli_kl(p: Tensor, q: Tensor, eps: float) -> Tensor:
    """``D(p||q) = p (log p - log q) + (1 - p) (log(1 - p) - log(1 - q))``, ``p``, ``q`` in ``[eps, 1 - eps]``."""
    p, q = p.clamp(eps, 1.0 - eps), q.clamp(eps, 1.0 - eps)
    return p * (p.log() - q.log()) + (1.0 - p) * (torch.log1p(-p) - torch.log1p(-q))


def _dppo_kl(p: Tensor, q: Tensor) -> Tensor:
    return bernoulli_kl(q, p, BERNOULLI_EPS)


#: ``--tis-loss-mode`` name -> the divergence between the token's Bernoulli distributions ``(p, q)``
DIVERGENCES = {"dppo_tv": _binary_tv, "dppo_kl": _dppo_kl}


def dppo_masked(lp: Tensor, anchor: Tensor, adv: Tensor, keep: Tensor, delta_low: float, delta_high: float,
                divergence: str) -> Tensor:
    """``[T]`` bool: kept tokens outside the trust region on their harmful side (float64; ``p = exp(min(lp, 0))``)."""
    p, q = torch.exp(lp.to(F64).clamp(max=0.0)), torch.exp(anchor.to(F64).clamp(max=0.0))
    div = DIVERGENCES[divergence](p, q)
    up, down = (adv > 0) & (p > q) & (div > delta_high), (adv < 0) & (p < q) & (div > delta_low)
    return keep & (up | down)


def covariance(adv: Tensor, lp: Tensor, keep: Tensor) -> Tensor:
    """``[T]`` ``(A_t - mean A)(lp_t - mean lp)`` with means over the kept tokens (0 at tokens not kept)."""
    n = keep.sum().clamp(min=1)
    a = torch.where(keep, adv, 0.0)
    x = torch.where(keep, lp, 0.0)
    return torch.where(keep, (a - a.sum() / n) * (x - x.sum() / n), 0.0)


def selection_size(keep: Tensor, ratio: float) -> Tensor:
    """0-d ``max(floor(ratio * N), 1)``, ``N`` the kept tokens (float64: ``int(ratio * N)`` as verl counts)."""
    return torch.floor(keep.sum(dtype=F64) * ratio).clamp(min=1.0)


def first_k(mask: Tensor, key: Tensor, k: Tensor) -> Tensor:
    """``[T]`` bool: the (at most) ``k`` tokens of ``mask`` with the smallest ``key`` (ties: the earlier token)."""
    order = torch.argsort(torch.where(mask, key.to(F64), torch.inf), stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return mask & (rank < k)


_MASK32 = 0xFFFFFFFF


def hash_keys(lp: Tensor) -> Tensor:
    """``[T]`` int64 in ``[0, 2^32)``: a 32-bit hash of each token's float32 log-prob bits and position."""
    x = lp.float().view(torch.int32).to(torch.int64) & _MASK32
    x = x ^ ((torch.arange(x.numel(), device=x.device) * 0x9E3779B1) & _MASK32)
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)
