"""Global searches (docs/semantics.md, "Global searches"): M2PO's cut and the auto truncation bound, each the largest
value in ``[lo, hi]`` whose predicate holds over the global batch, by ``SEARCH_STEPS`` bisection steps in log space
(one ``batch_sum`` of 2-3 float64 scalars each, whatever the data; no host sync).
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

__all__ = ["SEARCH_STEPS", "Searched", "bisect_log", "m2po_cut", "auto_upper", "searches", "M2PO_FIELD", "PENDING",
           "search", "kept_units", "cut_hits"]

#: Bisection iterations per search (one all-reduce each): the bracket shrinks by ``2^30``.
SEARCH_STEPS = 30
#: The ``TISConfig`` field of M2PO's ``tau``.
M2PO_FIELD = "m2po_threshold"
F64 = torch.float64


@dataclass(frozen=True)
class Searched:
    """The searched values, 0-d tensors (``None``: off): ``cut`` on ``q = lc^2``, ``upper`` the truncation bound."""

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


#: No searched value: the plan's placeholders stay.
PENDING = Searched()


def searches(plan: Plan) -> bool:
    """Whether ``plan`` has a searched value (M2PO on, or the auto truncation bound)."""
    return plan.target_ess is not None or plan.threshold(M2PO_FIELD) is not None


def bisect_log(lo: float, hi: float, sums: Callable[[Tensor], Tensor], accept: Callable[[Tensor], Tensor],
               reducer: Reducer, *, per_sequence: bool, device: torch.device) -> Tensor:
    """0-d float64: the largest ``x`` in ``[lo, hi]`` with ``accept(batch_sum(sums(x)))``, to a relative
    ``(log hi - log lo) / 2^SEARCH_STEPS``; ``accept`` holds below the boundary and fails above it (``lo`` where it
    fails everywhere)."""
    a = torch.full((), math.log(lo), dtype=F64, device=device)
    b = torch.full((), math.log(hi), dtype=F64, device=device)
    for _ in range(SEARCH_STEPS):
        m = 0.5 * (a + b)
        ok = accept(reducer.batch_sum(sums(m.exp()), per_sequence=per_sequence))
        a, b = torch.where(ok, m, a), torch.where(ok, b, m)
    return a.exp()


def _squared(plan: Plan, log_ratio: Tensor) -> Tensor:
    return log_ratio.to(F64).clamp(-plan.bound, plan.bound).square()


def m2po_cut(plan: Plan, q: Tensor, reducer: Reducer) -> Tensor:
    """0-d float64: the largest ``s`` in ``[tau, 2 B^2]`` with ``sum_{q <= s} q <= tau n_{q <= s}`` over every rank
    (``q``: ``[T]`` float64 ``clamp(l_t, -B, B)^2`` of the covered micro-batches' token domain, ``+inf`` off it)."""
    tau = plan.threshold(M2PO_FIELD)

    def sums(s: Tensor) -> Tensor:
        kept = q <= s
        return torch.stack([torch.where(kept, q, 0.0).sum(), kept.sum(dtype=F64)])

    def accept(total: Tensor) -> Tensor:
        return total[0] <= tau * total[1]

    return bisect_log(tau, 2.0 * plan.bound ** 2, sums, accept, reducer, per_sequence=False, device=q.device)


def auto_upper(plan: Plan, r: Tensor, n_kept: Tensor, reducer: Reducer) -> Tensor:
    """0-d float32: the largest ``c`` in ``[1, 2 e^B]`` with ``(sum min(r, c))^2 >= E N sum min(r, c)^2`` over every
    rank (``r``: float64 ``exp(clamp(L_u, -B, B))`` of the covered kept units, 0 elsewhere; ``n_kept``: ``N``)."""
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
    """``[T]`` bool, tokens M2PO rejects: ``clamp(l, -B, B)^2 > cut`` in float64 (as the search)."""
    return _squared(plan, log_ratio) > plan.sq_cut


def kept_units(plan: Plan, ratios, verdict) -> Tensor:
    """``[T]`` or ``[n_seq]`` bool: the kept units at ``plan``'s cut (sequences: finite, not rejected as a whole)."""
    if plan.per_sequence:
        return ratios.seq_ok & ~verdict.seq_rejected
    return verdict.keep & ~cut_hits(plan, ratios.log_ratio) if plan.threshold(M2PO_FIELD) is not None \
        else verdict.keep


def search(plan: Plan, items, reducer: Reducer) -> Searched:
    """The searched values over ``items``, ``(Ratios, Verdict)`` of the covered micro-batches on this rank: M2PO's
    cut first, then the auto bound over the units every rule (M2PO included) keeps."""
    device = items[0][0].log_ratio.device
    cut = None
    if plan.threshold(M2PO_FIELD) is not None:
        q = torch.cat([torch.where(r.token_ok, _squared(plan, r.log_ratio), math.inf) for r, _ in items])
        cut = m2po_cut(plan, q, reducer)
    upper = None
    if plan.target_ess is not None:
        p = Searched(cut=cut).apply(plan)
        units = [(plan.level.of(r), kept_units(p, r, v)) for r, v in items]
        r64 = torch.cat([torch.where(kept, log_u.to(F64).clamp(-plan.bound, plan.bound).exp(), 0.0)
                         for log_u, kept in units])
        n_kept = sum((torch.count_nonzero(kept) for _, kept in units), torch.zeros((), dtype=torch.int64,
                                                                                  device=device))
        upper = auto_upper(plan, r64, n_kept, reducer)
    return Searched(cut=cut, upper=upper)
