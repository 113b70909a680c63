"""Global searches: a bound found over the whole batch by a fixed-iteration bisection in log space.

Two values of the plan are not given but searched for, each over the global batch (every micro-batch the search
covers, every data-parallel x context-parallel rank):

* ``--tis-m2po-threshold tau`` (M2PO, arXiv 2510.01161): the largest cut ``s`` on ``q_t = lc_t^2`` (``lc`` the
  clamped token log-ratio) such that the tokens kept, ``q_t <= s``, have ``sum q / n <= tau``; tokens with
  ``q_t > s`` are rejected (the ``tis/m2po_fraction`` row of ``core.rules``). Over the token domain ``D``.
* ``--tis-upper-bound auto --tis-target-ess E`` (truncate mode): the largest bound ``c`` such that the truncated
  weights ``w_u = min(r_u, c)`` of the kept units have ``ESS(c) = (sum w)^2 / (N sum w^2) >= E``.

Both predicates hold below the answer and fail above it (``docs/semantics.md``, "Global searches": the kept mean of
``q`` is non-decreasing in ``s``, ``ESS`` non-increasing in ``c``), so bisection finds the boundary::

    a, b = log lo, log hi                       (a satisfies the predicate, or is the floor lo)
    repeat SEARCH_STEPS times:
        m = (a + b) / 2;  S = reducer.batch_sum(local sums at exp(m))     one all-reduce of 2-3 float64 scalars
        a, b = (m, b) if predicate(S) else (a, m)
    return exp(a)

The answer is the lower end ``exp(a)``: its predicate holds (or it is ``lo``), and it lies within a factor
``exp((log hi - log lo) / 2^SEARCH_STEPS)`` below the true boundary (:func:`precision`). Every rank issues
``SEARCH_STEPS`` all-reduces per search (M2PO: ``[2]``, the kept sum of ``q`` and count; auto: ``[3]``, ``sum w``,
``sum w^2`` and the kept count ``N``), whatever its data: no host sync, no data-dependent branch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from slime_tis.core.plan import Plan
from slime_tis.core.reducer import Reducer

__all__ = ["SEARCH_STEPS", "Searched", "bisect_log", "m2po_cut", "auto_upper", "precision", "m2po_values",
           "ess_values", "searches", "M2PO_FIELD", "PENDING", "search", "kept_units", "cut_hits"]

#: Bisection iterations per search (one all-reduce each). The bracket shrinks by ``2^30``: the auto bound's
#: (``[1, 2 e^B]``, ``B = 20``) relative precision is ``20.7 / 2^30 = 1.9e-8``, below float32's resolution.
SEARCH_STEPS = 30
#: The ``TISConfig`` field of M2PO's ``tau`` (a rejection threshold: the row of ``core.rules`` names it).
M2PO_FIELD = "m2po_threshold"
F64 = torch.float64


@dataclass(frozen=True)
class Searched:
    """The values of one search (0-d float32 tensors; ``None``: that search is off).

    ``cut``: the cut ``s`` on ``q = lc^2`` (tokens with ``q > s`` rejected). ``upper``: the truncation bound.
    """

    cut: Tensor | None = None
    upper: Tensor | None = None

    def apply(self, plan: Plan) -> Plan:
        """``plan`` with the searched values in place of its placeholders (``upper``, ``log_upper``, ``cut``)."""
        changes: dict = {}
        if self.cut is not None:
            changes["sq_cut"] = self.cut
        if self.upper is not None:
            changes.update(upper=self.upper, log_upper=torch.log(self.upper))
        return dataclasses.replace(plan, **changes) if changes else plan


#: The searched values of a decision taken before them (``engine.totals``: each micro-batch decided, then the step's
#: searches, then each decision finished with their values): no search, the placeholders stay.
PENDING = Searched()


def searches(plan: Plan) -> bool:
    """Whether ``plan`` has a searched value (M2PO on, or the auto truncation bound)."""
    return plan.target_ess is not None or plan.threshold(M2PO_FIELD) is not None


def precision(lo: float, hi: float) -> float:
    """The relative precision of a search on ``[lo, hi]``: the answer is within ``x exp(-p) <= answer <= x`` of the
    true boundary ``x``, ``p = (log hi - log lo) / 2^SEARCH_STEPS``."""
    return (math.log(hi) - math.log(lo)) / 2 ** SEARCH_STEPS


def bisect_log(lo: float, hi: float, sums: Callable[[Tensor], Tensor], accept: Callable[[Tensor], Tensor],
               reducer: Reducer, *, per_sequence: bool, device: torch.device) -> Tensor:
    """The largest ``x`` in ``[lo, hi]`` (to :func:`precision`) whose global sums pass ``accept``.

    ``sums(x)``: this rank's ``[k]`` float64 sums at ``x`` (0-d float64); ``accept(total) -> 0-d bool`` on their
    sum over ranks (``reducer.batch_sum``, over DP only where ``per_sequence``). ``accept`` must hold below the
    boundary and fail above it. Returns a 0-d float64 tensor; ``lo`` where ``accept`` fails everywhere.
    """
    a = torch.full((), math.log(lo), dtype=F64, device=device)
    b = torch.full((), math.log(hi), dtype=F64, device=device)
    for _ in range(SEARCH_STEPS):
        m = 0.5 * (a + b)
        ok = accept(reducer.batch_sum(sums(m.exp()), per_sequence=per_sequence))
        a, b = torch.where(ok, m, a), torch.where(ok, b, m)
    return a.exp()


def m2po_values(plan: Plan, log_ratio: Tensor, token_ok: Tensor) -> Tensor:
    """``[T]`` float64 ``q_t = clamp(l_t, -B, B)^2`` on the token domain, ``+inf`` off it (never kept by a cut)."""
    q = log_ratio.to(F64).clamp(-plan.bound, plan.bound).square()
    return torch.where(token_ok, q, math.inf)


def m2po_cut(plan: Plan, q: Tensor, reducer: Reducer) -> Tensor:
    """The M2PO cut (0-d float64, as ``q``: the rule compares in float64): the largest ``s`` in ``[tau, 2 B^2]``
    with ``sum_{q <= s} q <= tau n_{q <= s}``
    over every rank. ``q``: :func:`m2po_values` of the tokens the search covers (``[T]``, any micro-batches
    concatenated). At ``s = tau`` the predicate holds (every kept ``q <= tau``); above ``2 B^2 >= max q`` every token
    of ``D`` is kept."""
    tau = plan.threshold(M2PO_FIELD)

    def sums(s: Tensor) -> Tensor:
        kept = q <= s
        return torch.stack([torch.where(kept, q, 0.0).sum(), kept.sum(dtype=F64)])

    def accept(total: Tensor) -> Tensor:
        return total[0] <= tau * total[1]

    return bisect_log(tau, 2.0 * plan.bound ** 2, sums, accept, reducer, per_sequence=False, device=q.device)


def ess_values(plan: Plan, level_log_ratio: Tensor, kept_units: Tensor) -> Tensor:
    """``[U]`` float64 ratios ``r_u = exp(clamp(L_u, -B, B))`` of the kept units, 0 elsewhere (a 0 adds nothing to
    ``sum w`` or ``sum w^2``; the count ``N`` is the kept units')."""
    r = level_log_ratio.to(F64).clamp(-plan.bound, plan.bound).exp()
    return torch.where(kept_units, r, 0.0)


def auto_upper(plan: Plan, r: Tensor, n_kept: Tensor, reducer: Reducer) -> Tensor:
    """The auto truncation bound (0-d float32): the largest ``c`` in ``[1, 2 e^B]`` with
    ``(sum min(r, c))^2 >= E N sum min(r, c)^2`` over every rank (``E = plan.target_ess``), where ``r`` is
    :func:`ess_values` (``[U]``, any micro-batches concatenated) and ``n_kept`` this rank's kept units (0-d). Units
    are summed over DP x CP at token units, DP only at sequence units (replicated over CP). ``1`` where even
    ``c = 1`` leaves ``ESS < E`` (a bound never excludes 1); ``2 e^B`` (no truncation) where the raw ratios reach
    ``E``."""
    target = plan.target_ess
    count = n_kept.to(F64).reshape(())

    def sums(c: Tensor) -> Tensor:
        w = torch.minimum(r, c)
        return torch.stack([w.sum(), torch.dot(w, w), count])

    def accept(total: Tensor) -> Tensor:
        return total[0] * total[0] >= target * total[2] * total[1]

    return bisect_log(1.0, 2.0 * math.exp(plan.bound), sums, accept, reducer, per_sequence=plan.per_sequence,
                      device=r.device).float()


def cut_hits(plan: Plan, log_ratio: Tensor) -> Tensor:
    """``[T]`` bool, tokens M2PO rejects: ``clamp(l, -B, B)^2 > cut`` in float64 (as :func:`m2po_values`, so the rule
    rejects exactly the tokens the search left out); none while the cut is the placeholder ``+inf``."""
    return log_ratio.to(F64).clamp(-plan.bound, plan.bound).square() > plan.sq_cut


def kept_units(plan: Plan, ratios, verdict) -> Tensor:
    """The units the weights cover (``[T]`` or ``[n_seq]`` bool): kept tokens at token units (M2PO's rejections
    included at ``plan``'s cut), sequences of the domain not rejected as a whole at sequence units."""
    if plan.per_sequence:
        return ratios.seq_ok & ~verdict.seq_rejected
    return verdict.keep & ~cut_hits(plan, ratios.log_ratio) if plan.threshold(M2PO_FIELD) is not None \
        else verdict.keep


def search(plan: Plan, items, reducer: Reducer) -> Searched:
    """The searched values of ``plan`` over ``items``: ``(Ratios, Verdict)`` of every micro-batch the search covers
    on this rank (the verdict of ``core.rules.evaluate``, M2PO's cut at any value). M2PO first (over the token
    domain), then the auto bound over the units kept by every rule, M2PO's cut included. Collectives:
    ``SEARCH_STEPS`` per search that is on."""
    device = items[0][0].log_ratio.device
    cut = None
    if plan.threshold(M2PO_FIELD) is not None:
        q = torch.cat([m2po_values(plan, r.log_ratio, r.token_ok) for r, _ in items])
        cut = m2po_cut(plan, q, reducer)
    upper = None
    if plan.target_ess is not None:
        p = Searched(cut=cut).apply(plan)
        units = [(plan.level.of(r), kept_units(p, r, v)) for r, v in items]
        r64 = torch.cat([ess_values(plan, log_u, kept) for log_u, kept in units])
        n_kept = sum((torch.count_nonzero(kept) for _, kept in units), torch.zeros((), dtype=torch.int64,
                                                                                  device=device))
        upper = auto_upper(plan, r64, n_kept, reducer)
    return Searched(cut=cut, upper=upper)
