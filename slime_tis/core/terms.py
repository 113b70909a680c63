"""Terms added per kept token (docs/semantics.md, "Reference KL and entropy")::

    beta [w] k(d) - h H_t,   d = lp_theta - lp_ref,   k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d,
    low_var_kl = clamp(k3(clamp(d, -20, 20)), -10, 10);   with_score: k + sg(k) (lp - sg(lp))
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KL_ESTIMATORS", "KL_GRADIENTS", "kl_estimate", "term_loss"]

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
KL_GRADIENTS = ("direct", "with_score")
#: low_var_kl's bound on ``d`` before its exponential (verl's ``kl_penalty``: 20)
LOW_VAR_KL_D = 20.0


def kl_estimate(lp: Tensor, lp_ref: Tensor, kind: str) -> Tensor:
    """Per-token KL estimator ``kind`` of ``d = lp - lp_ref`` (module formulas), float32."""
    d = lp.float() - lp_ref.float()
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.exp(-d) - 1.0 + d  # unbounded: inf in float32 where d < -88.7
    if kind == "low_var_kl":
        # d clamped first: the same values and gradients where finite, no exp overflow (docs/semantics.md)
        dc = d.clamp(-LOW_VAR_KL_D, LOW_VAR_KL_D)
        return (torch.exp(-dc) - 1.0 + dc).clamp(-10.0, 10.0)
    raise ValueError(f"KL estimator = {kind!r}: must be one of {', '.join(KL_ESTIMATORS)}")


def term_loss(lp_k: Tensor, keep: Tensor, *, kl_coef: float, kl_estimator: str, lp_ref: Tensor | None,
              kl_weights: Tensor | None, entropy_coef: float, entropy: Tensor | None,
              kl_gradient: str = "direct") -> Tensor | None:
    """``[T]`` addition of the active terms (0 where not kept; ``lp_k`` is 0 there), or ``None`` when none is."""
    out = None
    if kl_coef != 0.0:
        ref_k = torch.where(keep, lp_ref.detach().float(), 0.0)  # d = 0 where not kept: every estimator is 0
        k = kl_estimate(lp_k, ref_k, kl_estimator)
        if kl_gradient == "with_score":  # + sg(k) grad lp: the score-function term, 0 in value
            k = k + k.detach() * (lp_k - lp_k.detach())
        kl = kl_coef * k
        out = kl * kl_weights if kl_weights is not None else kl
    if entropy_coef != 0.0:
        bonus = -entropy_coef * torch.where(keep, entropy.float(), 0.0)
        out = bonus if out is None else out + bonus
    return out
