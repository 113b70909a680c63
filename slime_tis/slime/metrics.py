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
(after checking that every rank holds the same statistics, ``core.step_metrics``) and finalises them into
the documented metrics (true token means, true min/max, ess, ...); they are
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
from slime_tis.core.diagnostics import token_metrics as core_token_metrics
from slime_tis.core.reducer import LocalReducer
from slime_tis.core.step_metrics import merge_stats
from slime_tis.engine.metrics import aggregate_metrics
from slime_tis.engine.step import StepEngine
from slime_tis.engine.totals import StepTotals

__all__ = ["COLLECTOR", "ExactMetricsCollector", "log_exact_metrics", "step_engine", "token_metrics"]

logger = logging.getLogger("slime_tis.slime")


def token_metrics(
    cfg: TISConfig, res: TISResult, batch_norm_factor: Tensor | None = None
) -> dict[str, Tensor]:
    """Per-token (CP-local ``[T]``, detached, finite; float32, ``tis/chi2_token`` float64) ``tis/`` metrics for
    slime's reducer.

    The values, rules and indicators are the core's (``slime_tis.core.diagnostics.token_metrics``,
    rows of ``slime_tis.core.rules.RULES``); this adapter computes none of its own.
    """
    return core_token_metrics(cfg.plan, res, batch_norm_factor)


class ExactMetricsCollector:
    """The step engine's records of slime's hooks (``StepEngine.record``, once per micro-batch) and their end
    (``StepEngine.end``): the micro-batches' ``MetricStats``, merged as they come (``records`` holds at most one
    entry, whatever the number of micro-batches before a flush)."""

    def __init__(self) -> None:
        self.records: list[MetricStats] = []  # the collector list of every hook call's engine
        self._seen: dict[tuple[int, ...], list[weakref.ref]] = {}
        self.last: dict[str, float] = {}
        self.reducer: Any = None
        self.engine: StepEngine | None = None

    def reset(self) -> None:
        """Drop what was recorded since the last flush, unreduced (a step that failed before its flush)."""
        self.__init__()

    @property
    def stats(self) -> MetricStats | None:
        """The merged statistics recorded since the last flush (``None`` for none)."""
        return merge_stats(self.records)

    def add(self, stats: MetricStats, tensors: Sequence[Tensor], reducer: Any, engine: StepEngine | None = None,
            ) -> None:
        """Record one micro-batch's statistics (``engine.record``, an engine whose collector is :attr:`records`),
        identified by its (live) input tensors: a call with the very same tensor objects (the loss replayed by
        activation checkpointing) is ignored."""
        key = tuple(id(t) for t in tensors)
        refs = self._seen.get(key)
        if refs is not None and all(r() is t for r, t in zip(refs, tensors)):
            return
        if len(self._seen) > 4096:  # never flushed: forget micro-batches whose tensors are gone
            self._seen = {k: v for k, v in self._seen.items() if all(r() is not None for r in v)}
        self._seen[key] = [weakref.ref(t) for t in tensors]
        self.reducer = reducer
        if engine is None or engine.collector is not self.records:
            self.records.append(stats.detach())
        else:
            engine.record(stats)
            self.engine = engine
        if len(self.records) > 1:
            self.records[:] = [merge_stats(self.records)]

    def flush(self, reducer: Any = None) -> dict[str, float]:
        """The step's end (``StepEngine.end``: reduced over DP x CP, finalised), then reset. Every rank of the DP x CP
        group must call it.

        Ranks without statistics (pipeline stages other than the last) return ``{}`` and take part
        in no collective; all ranks of a DP x CP group are on the same stage, so they agree.
        """
        engine, self.engine = self.engine, None
        reducer = reducer or self.reducer or LocalReducer()
        self.reducer = None
        self._seen.clear()
        if not self.records:
            return {}
        try:
            if engine is None:
                metrics = aggregate_metrics(self.records, reducer)
            else:
                engine.reducer = reducer
                metrics = engine.end()
        finally:
            self.records.clear()
        values = {k: float(v) for k, v in metrics.items()}  # host-sync-ok (once per step, logging)
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


def step_engine(cfg: Any, reducer: Any, device: torch.device, *, batch_norm_factor: Tensor | None = None,
                host_kl: bool = False) -> StepEngine:
    """The step engine of one slime hook call. slime aggregates the loss itself (per-rollout means,
    :mod:`slime_tis.slime.rollouts`), so the engine's totals are the host's: denominator 1 (the custom loss folds
    slime's means into per-token coefficients on the advantages and takes one token sum) and the rollout's
    batch-normalisation factor. Its records go to the step's :data:`COLLECTOR`; ``host_kl``: the custom loss adds
    slime's KL term (:func:`slime_tis.slime.kept.custom_loss_kl`)."""
    one = torch.ones((), device=device)  # a device tensor: a Python float would sync the host
    return StepEngine(cfg, reducer, totals=StepTotals(one, one, batch_norm_factor, 1), collector=COLLECTOR.records,
                      host_kl=host_kl)
