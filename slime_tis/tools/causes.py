"""The training/rollout mismatch of a dump by cause: the shares of ``tis/k3_kl`` explained by truncated sampling,
MoE routing and staleness, and the remainder.

Over valid tokens with finite values: ``l_t = lp_train - lp_rollout`` (full vocabulary), ``k3(l) = exp(l) - 1 - l``,
``K = sum_t k3(l_t)``, ``l'_t = l_t - log S_t`` (``S_t`` the kept mass, ``rollout_log_mass``; 1 without it).

* truncated sampling, exactly: ``(K - sum_t k3(l'_t)) / K``;
* MoE routing (``routing_differs``), staleness (``staleness > 0``), both: the excess over the clean tokens (neither),
  ``sum_{t in c} (k3(l'_t) - b) / K`` with ``b = mean_{t clean} k3(l'_t)`` (it assumes the clean tokens show what
  the others would without their cause; negative when a cause's tokens show less than the clean ones);
* remainder: ``1 -`` the other shares (numerics, and what the dump does not record).

A share is ``None`` when the dump does not record its cause.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from slime_tis.tools.dump import LogprobDump

__all__ = ["CAUSES", "k3", "log_ratios", "mismatch_by_cause"]

#: the causes, in report order
CAUSES = ("truncated sampling", "MoE routing", "staleness", "routing and staleness", "remainder")


def k3(x: torch.Tensor) -> torch.Tensor:
    """``exp(x) - 1 - x`` (``>= 0``)."""
    return torch.expm1(x) - x


def log_ratios(dump: LogprobDump) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ok [T]`` (valid tokens with finite values) and, over those tokens, float64 ``l_t`` with the train log-probs
    over the full vocabulary (``+ log S_t`` when the dump's meta ``sampling_support`` is ``"replay"``) and
    ``log S_t`` (0 without ``rollout_log_mass``)."""
    log_r = dump.train_log_probs.double() - dump.rollout_log_probs.double()
    mass = torch.zeros_like(log_r) if dump.rollout_log_mass is None else dump.rollout_log_mass.double()
    if dump.meta.get("sampling_support") == "replay":
        log_r = log_r + mass
    ok = dump.loss_mask & torch.isfinite(log_r) & torch.isfinite(mass)
    return ok, log_r[ok], mass[ok]


def mismatch_by_cause(dump: LogprobDump) -> dict[str, Any] | None:
    """``{"k3_kl", "tokens", "shares": {cause: share or None}, "tokens_of": {cause: count}}``, or ``None`` when the
    dump records none of the causes or holds no usable token."""
    if dump.rollout_log_mass is None and dump.routing_differs is None and dump.staleness is None:
        return None
    ok, full, mass = log_ratios(dump)
    if not bool(ok.any()):
        return None
    total = float(k3(full).sum())
    shares: dict[str, float | None] = dict.fromkeys(CAUSES)
    counts = dict.fromkeys(CAUSES, 0)
    if total <= 0:
        return {"k3_kl": 0.0, "tokens": int(ok.sum()), "shares": shares, "tokens_of": counts}
    k3_rest = k3(full - mass)
    if dump.rollout_log_mass is not None:
        shares["truncated sampling"] = (total - float(k3_rest.sum())) / total
        counts["truncated sampling"] = int((mass < 0).sum())
    routed = torch.zeros_like(ok) if dump.routing_differs is None else dump.routing_differs
    stale_seq = torch.zeros(dump.n_seq, dtype=torch.bool) if dump.staleness is None else dump.staleness > 0
    routed, stale = routed[ok], torch.repeat_interleave(stale_seq, dump.lengths)[ok]
    clean = ~routed & ~stale
    groups = {"MoE routing": routed & ~stale, "staleness": stale & ~routed, "routing and staleness": routed & stale}
    recorded = {"MoE routing": dump.routing_differs is not None, "staleness": dump.staleness is not None,
                "routing and staleness": dump.routing_differs is not None and dump.staleness is not None}
    base = float(k3_rest[clean].mean()) if bool(clean.any()) else math.nan
    for cause, sel in groups.items():
        if recorded[cause]:
            counts[cause] = int(sel.sum())
            shares[cause] = float((k3_rest[sel] - base).sum()) / total if counts[cause] else 0.0
    known = [v for v in shares.values() if v is not None]
    shares["remainder"] = 1.0 - sum(known) if all(math.isfinite(v) for v in known) else math.nan
    counts["remainder"] = int(clean.sum())
    return {"k3_kl": total / int(ok.sum()), "tokens": int(ok.sum()), "shares": shares, "tokens_of": counts}


def format_causes(c: dict[str, Any]) -> list[str]:
    """The report's lines for :func:`mismatch_by_cause`'s result."""
    lines = [f"mismatch by cause (share of k3_kl = {c['k3_kl']:.4g} over {c['tokens']} tokens; "
             "slime_tis/tools/causes.py says how each is measured):"]
    for cause in CAUSES:
        share = c["shares"][cause]
        lines.append(f"  {cause:<24} not recorded in the dump" if share is None
                     else f"  {cause:<24} {100 * share:>7.1f}%   ({c['tokens_of'][cause]} tokens)")
    return lines
