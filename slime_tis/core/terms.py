"""Terms added to the surrogate per kept token: reference KL and entropy bonus.

With ``d_t = lp_theta_t - lp_ref_t`` (Schulman's estimators of KL(pi_theta || pi_ref) from samples of pi_theta)::

    k1 = d,   k2 = d^2 / 2,   k3 = exp(-d) - 1 + d,   low_var_kl = clamp(k3(clamp(d, -20, 20)), -10, 10)

    per-token addition = beta * [w] * k(d_t)  -  h * H_t

``beta`` = ``--tis-kl-coef``, ``h`` = ``--tis-entropy-coef``, ``H_t`` the current policy's entropy at the token and
``[w]`` the token's applied rollout-correction weight when ``--tis-kl-importance-weighted`` (the samples come from
the rollout policy, not pi_theta: the same weight that corrects the surrogate corrects the estimator). The terms
act on the tokens the loss keeps and are aggregated with the surrogate (``core.aggregation``), so they share its
denominator; their gradients flow through ``lp_theta`` and ``H``.

``--tis-kl-gradient with_score`` writes the KL addition as ``beta [w] (k(d) + sg(k(d)) (lp - sg(lp)))``: the same
value, and the gradient ``beta [w] (k'(d) + k(d)) grad lp`` of ``E_{pi_theta}[k]`` over tokens sampled from the policy
(the score-function term ``k grad log pi_theta``). ``k1 + k1' = 1 + d`` and ``k3 + k3' = d`` make it an unbiased
gradient of KL(pi_theta || pi_ref); ``direct`` (``beta [w] k'(d)``) is that for ``k2`` and, for ``k3``, the gradient of
KL(pi_ref || pi_theta) in expectation.
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
    """Per-token KL estimator ``kind`` of ``pi_theta`` from ``pi_ref`` (module formulas), float32, shape of ``lp``."""
    d = lp.float() - lp_ref.float()
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.exp(-d) - 1.0 + d  # unbounded: inf in float32 where d < -88.7
    if kind == "low_var_kl":
        # d clamped first (verl's numerical-stability clamp): the same values and gradients wherever they are finite,
        # since k3 passes the +-10 clamp inside |d| < 12, and no exp overflow (whose 0 x inf gradient is NaN)
        dc = d.clamp(-LOW_VAR_KL_D, LOW_VAR_KL_D)
        return (torch.exp(-dc) - 1.0 + dc).clamp(-10.0, 10.0)
    raise ValueError(f"KL estimator = {kind!r}: must be one of {', '.join(KL_ESTIMATORS)}")


def term_loss(lp_k: Tensor, keep: Tensor, *, kl_coef: float, kl_estimator: str, lp_ref: Tensor | None,
              kl_weights: Tensor | None, entropy_coef: float, entropy: Tensor | None,
              kl_gradient: str = "direct") -> Tensor | None:
    """``[T]`` per-token addition of the active terms (0 at tokens not kept), or ``None`` when none is active.

    ``lp_k``: current log-probs, 0 where not kept (differentiable); ``lp_ref``, ``entropy``: ``[T]``;
    ``kl_weights``: ``[T]`` detached weights of the importance-weighted KL, or ``None``; ``kl_gradient``: one of
    :data:`KL_GRADIENTS` (module docstring).
    """
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
