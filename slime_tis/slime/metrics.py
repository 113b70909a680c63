"""slime's metrics: token-shaped tensors for slime's reducer, and the exact statistics of every micro-batch.

slime reduces a token-shaped metric as a mean over samples of per-sample means, so :func:`token_metrics` emits
means only, all finite. :class:`ExactMetricsCollector` (``STATE.collector``) merges each micro-batch's
``MetricStats`` once (a loss replayed under ``--recompute-loss-function`` is ignored); its flush is the step
engine's end.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from slime_tis.config import TISConfig
from slime_tis.core import MetricStats
from slime_tis.core.correction import TISResult
from slime_tis.core.diagnostics import token_metrics as core_token_metrics
from slime_tis.core.reducer import LocalReducer
from slime_tis.core.step_metrics import merge_stats
from slime_tis.engine.metrics import aggregate_metrics
from slime_tis.engine.step import StepEngine

__all__ = ["ExactMetricsCollector", "token_metrics"]

logger = logging.getLogger("slime_tis.slime")


def token_metrics(
    cfg: TISConfig, res: TISResult, batch_norm_factor: Tensor | None = None
) -> dict[str, Tensor]:
    """Per-token (CP-local ``[T]``, detached, finite) ``tis/`` metrics for slime's reducer: the core's
    (``slime_tis.core.diagnostics.token_metrics``)."""
    return core_token_metrics(cfg.plan, res, batch_norm_factor)


class ExactMetricsCollector:
    """The micro-batches' ``MetricStats`` since the last flush, merged as they come (``records``: at most one)."""

    def __init__(self) -> None:
        self.records: list[MetricStats] = []  # the collector list of every hook call's engine
        self._seen: dict[tuple[int, ...], list[weakref.ref]] = {}
        self.reducer: Any = None
        self.engine: StepEngine | None = None

    def reset(self) -> None:
        """Drop what was recorded since the last flush, unreduced (a step that failed before its flush)."""
        self.__init__()

    def add(self, stats: MetricStats, tensors: Sequence[Tensor], reducer: Any, engine: StepEngine | None = None,
            ) -> None:
        """Record one micro-batch's statistics (``engine.record``, an engine whose collector is :attr:`records`), keyed
        by its live input ``tensors``: a call with the very same tensor objects (a replayed loss) is ignored."""
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
        """The step's end (``StepEngine.end``: reduced over DP x CP, finalised), then reset; every rank of the DP x CP
        group calls it (ranks without statistics, pipeline stages other than the last, return ``{}``)."""
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
        return {k: float(v) for k, v in metrics.items()}  # host-sync-ok (once per step, logging)
