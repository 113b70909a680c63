"""Policy-loss surrogates, one function and one row each (``--tis-loss-mode``; verl's ``loss_mode`` names).

Per kept token ``t`` of sequence ``i`` (``A`` advantage, ``lp`` = log pi_theta, ``a`` the anchor's log-probs, ``B`` the
safety bound, ``sg`` stop-gradient, ``clip(x) = clamp(x, 1 - eps_low, 1 + eps_high)``)::

    name       ratio     per-token loss
    ppo_clip   token     rho = exp(clamp(lp - a, -B, B));  max(-A rho, -A clip(rho)); dual clip c: min(., -c A) if A < 0
    reinforce  (none)    -A lp
    gspo       sequence  s_t = exp(clamp(sg(S_i) + lp - sg(lp), -B, B)),  S_i = mean_{kept t in i} (lp - a);
                         max(-A s_t, -A clip(s_t))
    cispo      token     -sg(clip(exp(clamp(lp - a, -B, B)))) A lp
    on_policy  (none)    -A exp(lp - sg(lp))          (the ratio forced to 1; its gradient is REINFORCE's)
    sapo       token     -A (4 / tau) sigmoid(tau (rho - 1)),  rho = exp(clamp(lp - a, -B, B)),
                         tau = tau_pos if A > 0 else tau_neg   (a soft gate instead of a clip)
    dppo_tv    token     -A rho m_t,  m_t = 0 where the token left the trust region |p - q| <= delta on its harmful
    dppo_kl    token     side (``core.token_select``; delta_low / delta_high = eps_low / eps_high; the KL row: the
                         Bernoulli KL between q = pi_anchor and p = pi_theta of the token instead of |p - q|)
    geo_mean   sequence  -Abar_i sg(g_i) (1 + c_t - sg(c_t)),  g_i = exp(clamp(mean_{kept t in i} c_t, -B, B)),
                         c_t = min(lp - a, eps_high) if A > 0, max(lp - a, -eps_low) if A < 0, 0 if A = 0,
                         Abar_i = mean_{kept t in i} A  (GMPO: -Abar_i g_i per sequence, its exact gradient)
    clip_cov   token     ppo_clip's loss (no dual clip), 0 at k tokens (a hash's pick) with lb < cov_t < ub, not clipped
    kl_cov     token     -A rho + coef |clamp(lp - a, -B, B)| at the k tokens of largest cov_t  (``core.token_select``:
                         cov_t and k over the tokens this rank holds of the micro-batch)

The algorithm (``core.algorithms``) supplies the anchor (pi_old in algorithms 0 and 2, pi_rollout in 1) and the
rollout-correction weight ``w`` that multiplies every row's loss (algorithms 2 and 3); rows with a ratio need an
anchor, so algorithm 3 (whose ``w = sg(pi_theta) / pi_rollout`` already is that ratio) takes only the rows without
one. A surrogate is one function ``f(x: SurrogateInputs, plan) -> SurrogateTerms`` plus its row in
:data:`SURROGATES`; its options are ``TISConfig`` fields declared with ``config_fields.surrogate_option`` and read
with ``plan.param(name)``.

Every input is selected with ``torch.where`` before any arithmetic (0 at tokens not kept), so tokens not kept give a
zero loss and a zero gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from slime_tis.core.packing import Layout
from slime_tis.core.plan import Plan
from slime_tis.core.reducer import Reducer
from slime_tis.core.token_select import covariance, dppo_masked, first_k, hash_keys, selection_size

__all__ = ["Surrogate", "SurrogateInputs", "SurrogateTerms", "SURROGATES", "surrogate_of", "ppo_clip_term"]

F64 = torch.float64


@dataclass(frozen=True)
class SurrogateInputs:
    """What a surrogate reads (``[T]`` float32, 0 at tokens not kept).

    Attributes:
        lp: current log-probs (differentiable). anchor: the anchor's log-probs (detached; ``None`` for rows without
        a ratio). adv: advantages (detached). keep: bool tokens kept. layout, reducer: the packed layout and the
        distributed reductions (a sequence-level ratio completes its sums over context parallelism).
    """

    lp: Tensor
    anchor: Tensor | None
    adv: Tensor
    keep: Tensor
    layout: Layout
    reducer: Reducer


@dataclass(frozen=True)
class SurrogateTerms:
    """``loss``: ``[T]`` per-token loss; ``clip_active`` / ``dual_active``: ``[T]`` bool (rows that clip / dual-clip),
    ``selected``: ``[T]`` bool (rows that select tokens by covariance), False at tokens not kept."""

    loss: Tensor
    clip_active: Tensor | None = None
    dual_active: Tensor | None = None
    selected: Tensor | None = None


@dataclass(frozen=True)
class Surrogate:
    """One row of :data:`SURROGATES`.

    Attributes:
        name: the ``--tis-loss-mode`` value.
        ratio: ``"token"`` or ``"sequence"``: the ratio pi_theta / pi_anchor it reads; ``None``: no anchor.
        clips: it reads ``--eps-clip`` / ``--eps-clip-high`` (and reports ``policy/clipfrac``).
        dual_clip: it reads ``--eps-clip-c`` (and reports ``policy/dual_clipfrac`` when set).
        fn: the per-token loss.
        formula: the per-token loss, in words.
        selects: it selects tokens by covariance (and reports ``policy/cov_selected_fraction``).
    """

    name: str
    ratio: str | None
    clips: bool
    dual_clip: bool
    fn: Callable[[SurrogateInputs, Plan], SurrogateTerms]
    formula: str
    selects: bool = False

    @property
    def anchored(self) -> bool:
        return self.ratio is not None


def ppo_clip_term(
    log_ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float, dual_clip_c: float | None,
    safety_bound: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Clipped PPO surrogate per token: ``(loss_t, clip_active, dual_clip_active)``.

    ``rho = exp(clamp(log_ratio, -B, B))``, ``loss_t = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))``
    and, with ``c``, for ``A < 0``: ``loss_t = min(loss_t, -c A)``.
    """
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
    """Sequence ratio ``S_i`` = mean over the kept tokens (one CP reduction of two columns), then the clipped
    surrogate of ``s_t = sg(S_i) * pi_theta_t / sg(pi_theta_t)`` (clipped per sequence: ``s_t`` is ``S_i`` in value)."""
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
    """GMPO: per sequence ``-Abar_i g_i``, written per token so that its sequence mean is that value and its gradient
    at token ``t`` is GMPO's ``-Abar_i g_i c_t' / n_i`` (one CP reduction of three columns, all detached)."""
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
    """Covariance selections are over the tokens this rank holds; refused where a sequence is split over CP ranks
    (a reducer over a CP group states its ``cp_size``, as ``MegatronReducer`` does)."""
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
    "ppo_clip": Surrogate("ppo_clip", ratio="token", clips=True, dual_clip=True, fn=ppo_clip,
                          formula="max(-A rho, -A clip(rho)), dual clip; rho = pi_theta / pi_anchor"),
    "reinforce": Surrogate("reinforce", ratio=None, clips=False, dual_clip=False, fn=reinforce,
                           formula="-A log pi_theta"),
    "gspo": Surrogate("gspo", ratio="sequence", clips=True, dual_clip=False, fn=gspo,
                      formula="max(-A s, -A clip(s)); s = sg(geometric-mean ratio) pi_theta / sg(pi_theta)"),
    "cispo": Surrogate("cispo", ratio="token", clips=True, dual_clip=False, fn=cispo,
                       formula="-sg(clip(rho)) A log pi_theta; rho = pi_theta / pi_anchor"),
    "on_policy": Surrogate("on_policy", ratio=None, clips=False, dual_clip=False, fn=on_policy,
                           formula="-A pi_theta / sg(pi_theta)"),
    "sapo": Surrogate("sapo", ratio="token", clips=False, dual_clip=False, fn=sapo,
                      formula="-A (4 / tau) sigmoid(tau (rho - 1)); tau = tau_pos (A > 0) or tau_neg"),
    **{name: Surrogate(name, ratio="token", clips=True, dual_clip=False, fn=_dppo(name),
                       formula=f"-A rho, 0 outside the trust region ({what} of the token's probability <= delta)")
       for name, what in (("dppo_tv", "|pi_theta - pi_anchor|"), ("dppo_kl", "Bernoulli KL"))},
    "geo_mean": Surrogate("geo_mean", ratio="sequence", clips=True, dual_clip=False, fn=geo_mean,
                          formula="-mean(A) exp(mean of the log-ratio clipped at [-eps_low, eps_high]) per sequence"),
    "clip_cov": Surrogate("clip_cov", ratio="token", clips=True, dual_clip=False, fn=clip_cov, selects=True,
                          formula="ppo_clip's, 0 at pseudo-random tokens whose covariance of A and lp is in (lb, ub)"),
    "kl_cov": Surrogate("kl_cov", ratio="token", clips=False, dual_clip=False, fn=kl_cov, selects=True,
                        formula="-A rho, + coef abs(log rho) at the tokens of largest covariance of A and lp"),
}


def surrogate_of(name: str) -> Surrogate:
    """The row named ``name``."""
    if name not in SURROGATES:
        raise ValueError(f"policy_loss = {name!r}: must be one of {', '.join(SURROGATES)}")
    return SURROGATES[name]
