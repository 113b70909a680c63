"""Policy-loss surrogates (``--tis-loss-mode``; formulas: docs/semantics.md), one function
``f(x: SurrogateInputs, plan) -> SurrogateTerms`` and one row of :data:`SURROGATES` each, options read with
``plan.param(name)``; the token selections (DPPO's trust region, Clip-Cov / KL-Cov's covariance picks). Inputs are
0 at tokens not kept: zero loss and zero gradient there, no selection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from slime_tis.core.packing import Layout
from slime_tis.core.plan import Plan
from slime_tis.core.reducer import Reducer

__all__ = ["Surrogate", "SurrogateInputs", "SurrogateTerms", "SURROGATES", "surrogate_of", "ppo_clip_term",
           "dppo_masked", "covariance", "selection_size", "first_k", "hash_keys", "bernoulli_kl"]

F64 = torch.float64
#: the Bernoulli KL's guard against log(0) where p or q is 1 (verl and SkyRL use the same 1e-8)
BERNOULLI_EPS = 1e-8


def bernoulli_kl(p: Tensor, q: Tensor, eps: float) -> Tensor:
    """``D(p||q) = p (log p - log q) + (1 - p) (log(1 - p) - log(1 - q))``, ``p``, ``q`` in ``[eps, 1 - eps]``."""
    p, q = p.clamp(eps, 1.0 - eps), q.clamp(eps, 1.0 - eps)
    return p * (p.log() - q.log()) + (1.0 - p) * (torch.log1p(-p) - torch.log1p(-q))


def dppo_masked(lp: Tensor, anchor: Tensor, adv: Tensor, keep: Tensor, delta_low: float, delta_high: float,
                divergence: str) -> Tensor:
    """``[T]`` bool: kept tokens outside the trust region on their harmful side (float64; ``p = exp(min(lp, 0))``):
    ``dppo_tv`` ``|p - q|``, ``dppo_kl`` ``KL_B(q, p)``."""
    p, q = torch.exp(lp.to(F64).clamp(max=0.0)), torch.exp(anchor.to(F64).clamp(max=0.0))
    div = (p - q).abs() if divergence == "dppo_tv" else bernoulli_kl(q, p, BERNOULLI_EPS)
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


@dataclass(frozen=True)
class SurrogateInputs:
    """What a surrogate reads (``[T]`` float32, 0 at tokens not kept): ``lp`` differentiable, ``anchor`` detached
    (``None`` for rows without a ratio), ``adv`` detached, ``keep`` bool; a sequence ratio reduces over CP."""

    lp: Tensor
    anchor: Tensor | None
    adv: Tensor
    keep: Tensor
    layout: Layout
    reducer: Reducer


@dataclass(frozen=True)
class SurrogateTerms:
    """``[T]`` per-token ``loss``; ``[T]`` bool ``clip_active`` / ``dual_active`` / ``selected`` (False where not
    kept) of rows that clip, dual-clip, select by covariance."""

    loss: Tensor
    clip_active: Tensor | None = None
    dual_active: Tensor | None = None
    selected: Tensor | None = None


@dataclass(frozen=True)
class Surrogate:
    """One row of :data:`SURROGATES`: ``anchored`` reads a ratio pi_theta / pi_anchor (per token or per sequence);
    ``clips`` reads ``--eps-clip(-high)`` (``policy/clipfrac``); ``dual_clip`` reads ``--eps-clip-c``; ``fn`` the
    per-token loss."""

    name: str
    anchored: bool
    clips: bool
    dual_clip: bool
    fn: Callable[[SurrogateInputs, Plan], SurrogateTerms]


def ppo_clip_term(
    log_ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float, dual_clip_c: float | None,
    safety_bound: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss_t, clip_active, dual_clip_active)``: ``rho = exp(clamp(log_ratio, -B, B))``,
    ``loss_t = max(-A rho, -A clamp(rho, 1 - eps_low, 1 + eps_high))``; with ``c``, for ``A < 0``,
    ``min(loss_t, -c A)``."""
    rho = torch.exp(log_ratio.clamp(-safety_bound, safety_bound))
    unclipped = -advantages * rho
    clipped = -advantages * rho.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    if dual_clip_c is None:
        return loss, clip_active, torch.zeros_like(clip_active)
    floor = -dual_clip_c * advantages
    dual_active = (advantages < 0) & (loss > floor)
    return torch.where(dual_active, floor, loss), clip_active, dual_active


def ppo_clip(x: SurrogateInputs, plan: Plan) -> SurrogateTerms:
    loss, clip_active, dual_active = ppo_clip_term(x.lp - x.anchor, x.adv, plan.eps_low, plan.eps_high,
                                                   plan.dual_clip_c, plan.bound)
    return SurrogateTerms(loss, clip_active, dual_active)


def reinforce(x: SurrogateInputs, plan: Plan) -> SurrogateTerms:
    return SurrogateTerms(-x.adv * x.lp)


def gspo(x: SurrogateInputs, plan: Plan) -> SurrogateTerms:
    """Clipped surrogate of ``s_t = exp(sg(S_i) + lp_t - sg(lp_t))``, ``S_i`` the kept tokens' mean log-ratio."""
    log_ratio = (x.lp - x.anchor).detach()
    sums = x.reducer.sequence_sum(x.layout.sums(torch.stack([log_ratio.to(F64), x.keep.to(F64)], dim=1)))
    seq_log_ratio = (sums[:, 0] / sums[:, 1].clamp(min=1.0)).float()
    log_s = x.layout.expand(seq_log_ratio) + x.lp - x.lp.detach()
    loss, clip_active, _ = ppo_clip_term(log_s, x.adv, plan.eps_low, plan.eps_high, None, plan.bound)
    return SurrogateTerms(loss, clip_active & x.keep)


def cispo(x: SurrogateInputs, plan: Plan) -> SurrogateTerms:
    rho = torch.exp((x.lp - x.anchor).detach().clamp(-plan.bound, plan.bound))
    clipped = rho.clamp(1.0 - plan.eps_low, 1.0 + plan.eps_high)
    return SurrogateTerms(-clipped * x.adv * x.lp, (clipped != rho) & x.keep)


def on_policy(x: SurrogateInputs, plan: Plan) -> SurrogateTerms:
    return SurrogateTerms(-x.adv * torch.exp(x.lp - x.lp.detach()))


def sapo(x: SurrogateInputs, plan: Plan) -> SurrogateTerms:
    rho = torch.exp((x.lp - x.anchor).clamp(-plan.bound, plan.bound))
    tau = torch.where(x.adv > 0, plan.param("sapo_tau_pos"), plan.param("sapo_tau_neg"))
    return SurrogateTerms(-x.adv * torch.sigmoid(tau * (rho - 1.0)) * (4.0 / tau))


def _dppo(divergence: str) -> Callable[[SurrogateInputs, Plan], SurrogateTerms]:
    def dppo(x: SurrogateInputs, plan: Plan) -> SurrogateTerms:
        masked = dppo_masked(x.lp.detach(), x.anchor, x.adv, x.keep, plan.eps_low, plan.eps_high, divergence)
        rho = torch.exp((x.lp - x.anchor).clamp(-plan.bound, plan.bound))
        return SurrogateTerms(torch.where(masked, 0.0, -x.adv * rho), masked)
    return dppo


def geo_mean(x: SurrogateInputs, plan: Plan) -> SurrogateTerms:
    """GMPO ``-Abar_i sg(g_i) (1 + c_t - sg(c_t))``: per sequence ``-Abar_i g_i`` and GMPO's gradient."""
    log_ratio = x.lp - x.anchor
    c = torch.where(x.adv > 0, log_ratio.clamp(max=plan.eps_high),
                    torch.where(x.adv < 0, log_ratio.clamp(min=-plan.eps_low), 0.0))
    cols = torch.stack([c.detach(), x.adv, x.keep.float()], dim=1).to(F64)
    sums = x.reducer.sequence_sum(x.layout.sums(cols))
    n = sums[:, 2].clamp(min=1.0)
    seq = (-sums[:, 1] / n) * torch.exp((sums[:, 0] / n).clamp(-plan.bound, plan.bound))
    clipped = ((x.adv > 0) & (log_ratio > plan.eps_high)) | ((x.adv < 0) & (log_ratio < -plan.eps_low))
    loss = torch.where(x.keep, x.layout.expand(seq).float() * (1.0 + c - c.detach()), 0.0)
    return SurrogateTerms(loss, clipped.detach() & x.keep)


def _rank_local(x: SurrogateInputs, name: str) -> None:
    """Refuse a covariance selection (over this rank's tokens) where sequences are split over CP ranks."""
    cp = getattr(x.reducer, "cp_size", 1)
    if cp > 1:
        raise ValueError(f"--tis-loss-mode {name} selects tokens by a covariance over the micro-batch's tokens on "
                         f"each rank; with context parallelism (cp_size = {cp}) they are split over ranks and the "
                         "selection would depend on the split: use context_parallel_size 1")


def clip_cov(x: SurrogateInputs, plan: Plan) -> SurrogateTerms:
    _rank_local(x, "clip_cov")
    loss, clipped, _ = ppo_clip_term(x.lp - x.anchor, x.adv, plan.eps_low, plan.eps_high, None, plan.bound)
    cov = covariance(x.adv, x.lp.detach(), x.keep)
    candidates = x.keep & ~clipped & (cov > plan.param("clip_cov_lb")) & (cov < plan.param("clip_cov_ub"))
    selected = first_k(candidates, hash_keys(x.lp.detach()), selection_size(x.keep, plan.param("clip_cov_ratio")))
    return SurrogateTerms(torch.where(selected, 0.0, loss), clipped & x.keep, selected=selected)


def kl_cov(x: SurrogateInputs, plan: Plan) -> SurrogateTerms:
    _rank_local(x, "kl_cov")
    log_ratio = (x.lp - x.anchor).clamp(-plan.bound, plan.bound)
    cov = covariance(x.adv, x.lp.detach(), x.keep)
    selected = first_k(x.keep, -cov, selection_size(x.keep, plan.param("kl_cov_ratio")))
    penalty = torch.where(selected, plan.param("kl_cov_coef") * log_ratio.abs(), 0.0)
    return SurrogateTerms(-x.adv * torch.exp(log_ratio) + penalty, selected=selected)


SURROGATES: dict[str, Surrogate] = {
    "ppo_clip": Surrogate("ppo_clip", anchored=True, clips=True, dual_clip=True, fn=ppo_clip),
    "reinforce": Surrogate("reinforce", anchored=False, clips=False, dual_clip=False, fn=reinforce),
    "gspo": Surrogate("gspo", anchored=True, clips=True, dual_clip=False, fn=gspo),
    "cispo": Surrogate("cispo", anchored=True, clips=True, dual_clip=False, fn=cispo),
    "on_policy": Surrogate("on_policy", anchored=False, clips=False, dual_clip=False, fn=on_policy),
    "sapo": Surrogate("sapo", anchored=True, clips=False, dual_clip=False, fn=sapo),
    "dppo_tv": Surrogate("dppo_tv", anchored=True, clips=True, dual_clip=False, fn=_dppo("dppo_tv")),
    "dppo_kl": Surrogate("dppo_kl", anchored=True, clips=True, dual_clip=False, fn=_dppo("dppo_kl")),
    "geo_mean": Surrogate("geo_mean", anchored=True, clips=True, dual_clip=False, fn=geo_mean),
    "clip_cov": Surrogate("clip_cov", anchored=True, clips=True, dual_clip=False, fn=clip_cov),
    "kl_cov": Surrogate("kl_cov", anchored=True, clips=False, dual_clip=False, fn=kl_cov),
}


def surrogate_of(name: str) -> Surrogate:
    """The row named ``name``."""
    if name not in SURROGATES:
        raise ValueError(f"policy_loss = {name!r}: must be one of {', '.join(SURROGATES)}")
    return SURROGATES[name]
