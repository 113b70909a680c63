"""Metrics for slime: token-shaped tensors for slime's reducer, and the exact ``MetricStats`` path.

**slime's path.** A TIS hook returns a dict of flat, CP-local, token-shaped tensors; slime reduces
each with its per-sample reducer over the *original* loss masks, sums over micro-batches and
DP x CP ranks, and divides by the number of samples. A reported value is therefore

    mean over samples i of ( mean over valid tokens t of i of x_t )

so a token statistic (``tis/kl``) becomes a mean of per-sample means (not the token mean), a
sequence statistic broadcast to its tokens (``tis/chi2_seq``, ``tis/rejected_seq_fraction``)
becomes its mean over samples, and a minimum or maximum could only be reported as an *average* of
per-sample extremes. :func:`token_metrics` therefore emits no min/max (and no ``ess`` or ``std``,
which are not means); every value is finite at every position (0 for sequences with non-finite
data, which still count in slime's denominator).

**Exact path.** The hooks also add the core's :class:`MetricStats` of every micro-batch to a
process-wide :data:`COLLECTOR`. :func:`log_exact_metrics` (usable as slime's
``--custom-megatron-before-train-step-hook-path``) reduces them over DP x CP with SUM / MIN / MAX
and finalises them into the SPEC metrics (true token means, true min/max, ess, ...); they are
logged, kept in ``COLLECTOR.last``, and appended as JSON to ``args.tis_metrics_path`` if set.
Micro-batches re-run under ``--recompute-loss-function`` (activation checkpointing replays the
loss in backward) are counted once: stats are keyed by the identity of the micro-batch's rollout
log-prob tensors.
"""

from __future__ import annotations

import json
import logging
import math
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from slime_tis.config import TISConfig
from slime_tis.core import MetricStats
from slime_tis.core.correction import TISResult
from slime_tis.core.rejection import find_rejections
from slime_tis.core.weights import outside_bounds

__all__ = ["COLLECTOR", "ExactMetricsCollector", "log_exact_metrics", "token_metrics"]

logger = logging.getLogger("slime_tis.slime")


def token_metrics(
    cfg: TISConfig, res: TISResult, batch_norm_factor: Tensor | None = None
) -> dict[str, Tensor]:
    """Per-token (CP-local ``[T]`` float32, detached, finite) ``tis/`` metrics for slime's reducer.

    With ``r_t = exp(clamp(l_t, -B, B))``, sequence quantities broadcast to their tokens, and 0 at
    tokens of sequences with non-finite data:

    ``tis/kl = lp_rollout - lp_train``, ``tis/k3_kl = r - 1 - log r``, ``tis/chi2_token = r^2 - 1``,
    ``tis/chi2_seq = exp(2 clamp(sum_i l, -B, B)) - 1``, ``tis/log_ppl_diff = mean_i lp_rollout -
    mean_i lp_train``, ``tis/log_ppl_abs_diff``, ``tis/ppl_ratio = exp(log_ppl_diff)``,
    ``tis/training_ppl``, ``tis/rollout_ppl``, ``tis/ratio`` (level ratio before bounds),
    ``tis/weight`` (applied weight), and 0/1 indicators averaged into fractions:
    ``tis/rejected_token_fraction``, ``tis/rejected_seq_fraction``, ``tis/nonfinite_seq_fraction``,
    ``tis/veto_seq_fraction`` (veto on), ``tis/truncate_fraction`` / ``tis/clip_fraction_low|high``
    / ``tis/mask_fraction_low|high`` (per mode; unit indicators broadcast), ``tis/rs_fraction_low|high``
    (rejection sampling on), ``tis/batch_norm_factor`` (batch-norm on).
    """
    rt = res.ratios
    rej = find_rejections(cfg, rt)  # the core's rejection masks (mode, RS, veto, non-finite)
    bound = cfg.safety_bound
    zero = torch.zeros((), dtype=torch.float32, device=rt.log_ratio.device)
    sid = rt.seq_id
    seq_ok_t = rt.seq_ok[sid]
    ok = rt.token_ok
    per_seq_units = cfg.level != "token"

    def seq(x: Tensor) -> Tensor:
        return torch.where(seq_ok_t, x[sid], zero)

    def unit(x: Tensor, per_seq: bool = per_seq_units) -> Tensor:
        return x[sid].float() if per_seq else x.float()

    log_r = rt.log_ratio.clamp(-bound, bound)
    r = torch.exp(log_r)
    mean_diff = rt.seq_mean_lp_rollout - rt.seq_mean_lp_train
    level_log = rt.level_log_ratio(cfg.level)
    unit_ok = rt.unit_ok(cfg.level)
    out: dict[str, Tensor] = {
        "tis/kl": torch.where(ok, rt.lp_rollout - rt.lp_train, zero),
        "tis/k3_kl": torch.where(ok, r - 1.0 - log_r, zero),
        "tis/chi2_token": torch.where(ok, r * r - 1.0, zero),
        "tis/chi2_seq": seq(torch.exp(2.0 * rt.seq_log_ratio_sum.clamp(-bound, bound)) - 1.0),
        "tis/log_ppl_diff": seq(mean_diff),
        "tis/log_ppl_abs_diff": seq(mean_diff.abs()),
        "tis/ppl_ratio": seq(torch.exp(mean_diff.clamp(-bound, bound))),
        "tis/training_ppl": seq(torch.exp((-rt.seq_mean_lp_train).clamp(-bound, bound))),
        "tis/rollout_ppl": seq(torch.exp((-rt.seq_mean_lp_rollout).clamp(-bound, bound))),
        "tis/ratio": torch.where(unit(unit_ok).bool(), torch.exp(unit(level_log).clamp(-bound, bound)), zero),
        "tis/weight": res.weights.float(),
        "tis/rejected_token_fraction": (rt.valid & ~res.keep_mask).float(),
        "tis/rejected_seq_fraction": (rej.seq_rejected & rt.seq_has_tokens)[sid].float(),
        "tis/nonfinite_seq_fraction": rt.seq_nonfinite[sid].float(),
    }
    if cfg.veto_threshold is not None and cfg.algorithm != 0:
        out["tis/veto_seq_fraction"] = rt.seq_veto[sid].float()
    if cfg.applies_weights and cfg.mode in ("truncate", "clip"):
        below, above = outside_bounds(level_log, cfg.lower_bound, cfg.upper_bound)
        if cfg.mode == "truncate":
            out["tis/truncate_fraction"] = unit(above & unit_ok)
        else:
            out["tis/clip_fraction_low"] = unit(below & unit_ok)
            out["tis/clip_fraction_high"] = unit(above & unit_ok)
    if rej.mode_below is not None:
        out["tis/mask_fraction_low"] = unit(rej.mode_below)
        out["tis/mask_fraction_high"] = unit(rej.mode_above)
    if rej.rs_below is not None:
        rs_seq = cfg.rs_level != "token"
        out["tis/rs_fraction_low"] = unit(rej.rs_below, rs_seq)
        out["tis/rs_fraction_high"] = unit(rej.rs_above, rs_seq)
    if batch_norm_factor is not None:
        out["tis/batch_norm_factor"] = torch.ones_like(r) * batch_norm_factor.float().reshape(())
    return {k: v.detach() for k, v in out.items()}


class ExactMetricsCollector:
    """Accumulates the core's ``MetricStats`` across micro-batches (once per micro-batch)."""

    def __init__(self) -> None:
        self.stats: MetricStats | None = None
        self._seen: dict[tuple[int, ...], list[weakref.ref]] = {}
        self.last: dict[str, float] = {}
        self.reducer: Any = None

    def add(self, stats: MetricStats, tensors: Sequence[Tensor], reducer: Any) -> None:
        """Add one micro-batch's statistics, identified by its (live) input tensors: a call with the
        very same tensor objects (the loss replayed by activation checkpointing) is ignored."""
        key = tuple(id(t) for t in tensors)
        refs = self._seen.get(key)
        if refs is not None and all(r() is t for r, t in zip(refs, tensors)):
            return
        if len(self._seen) > 4096:  # never flushed: forget micro-batches whose tensors are gone
            self._seen = {k: v for k, v in self._seen.items() if all(r() is not None for r in v)}
        self._seen[key] = [weakref.ref(t) for t in tensors]
        self.reducer = reducer
        detached = stats.detach()
        self.stats = detached if self.stats is None else self.stats.merge(detached)

    def flush(self, reducer: Any = None) -> dict[str, float]:
        """Reduce over DP x CP, finalise, reset. Every rank of the DP x CP group must call it.

        Ranks without statistics (pipeline stages other than the last) return ``{}`` and take part
        in no collective; all ranks of a DP x CP group are on the same stage, so they agree.
        """
        stats, self.stats = self.stats, None
        self._seen.clear()
        reducer = reducer or self.reducer
        self.reducer = None
        if stats is None:
            return {}
        if reducer is not None:
            stats = stats.reduce(reducer)
        values = {k: float(v) for k, v in stats.finalize().items()}  # host-sync-ok (once per step, logging)
        self.last = values
        return values


COLLECTOR = ExactMetricsCollector()


def log_exact_metrics(
    args: Any, rollout_id: Any = None, step_id: Any = None, *_: Any, **__: Any
) -> dict[str, float]:
    """slime ``--custom-megatron-before-train-step-hook-path`` entry: flush the previous step's exact
    ``tis/`` metrics (reduced over DP x CP), log them, and append them to ``args.tis_metrics_path``.

    Runs before every training step, so it reports the step before it (the last step of a run is
    reported by an explicit ``COLLECTOR.flush()``).
    """
    values = COLLECTOR.flush()
    if not values:
        return values
    logger.info(
        "slime_tis exact metrics (before rollout %s step %s): %s",
        rollout_id,
        step_id,
        ", ".join(f"{k}={v:.6g}" for k, v in sorted(values.items())),
    )
    path = getattr(args, "tis_metrics_path", None)
    if path:
        rank0 = True
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank0 = torch.distributed.get_rank() == 0
        if rank0:
            p = Path(path)
            p.parent.mkdir(parents=True, exist_ok=True)
            clean = {k: (v if math.isfinite(v) else None) for k, v in values.items()}
            with open(p, "a", encoding="utf-8") as f:
                f.write(json.dumps({"rollout_id": rollout_id, "step_id": step_id, **clean}) + "\n")
    return values
