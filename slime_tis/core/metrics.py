"""Diagnostics as reducible statistics, and the formulas that turn them into metrics.

A metric such as ``tis/kl = mean_t (lp_rollout - lp_train)`` is a ratio of two sums. Averaging
per-micro-batch or per-rank means would be wrong (unequal token counts), and a mean of per-rank
minima is not a minimum. So the core returns :class:`MetricStats`: raw sums, minima and maxima,
which are merged across micro-batches (``merge``), reduced across ranks with the right operator
(``reduce``: SUM / MIN / MAX, one collective per operator) and only then turned into metrics
(``finalize``). Everything stays a tensor until the logger reads it: no host sync.

Two kinds of sums: ``token_sums`` (token-domain, summed over data x context parallel ranks) and
``seq_sums`` (one value per sequence, replicated on every context-parallel rank, summed over data
parallel ranks only).

Every metric, its statistics, its reduction and its formula are declared once in the metric schema
(``core.metric_schema.METRICS``; docs/reference.md's metric table is generated from it):
``finalize`` applies the schema's reductions to the statistics present.
Empty domains give 0 (never NaN).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from slime_tis.core.metric_schema import finalize, safe_ratio
from slime_tis.core.reducer import Reducer

__all__ = ["MetricStats", "safe_ratio", "column_sums"]


def column_sums(columns: dict[str, Tensor]) -> dict[str, Tensor]:
    """``{name: column.sum()}`` as float64 scalars, each column summed on its own (no ``[T, k]`` copy).

    Bool columns are counted exactly; float columns are accumulated in float64, which keeps
    differences of large sums exact to ~1e-12 relative (the columns themselves stay float32).
    """
    out = {}
    for name, c in columns.items():
        out[name] = torch.count_nonzero(c).to(torch.float64) if c.dtype == torch.bool else c.sum(dtype=torch.float64)
    return out


@dataclass
class MetricStats:
    """Reducible statistics (see module docstring). All values are scalar tensors."""

    token_sums: dict[str, Tensor] = field(default_factory=dict)
    seq_sums: dict[str, Tensor] = field(default_factory=dict)
    mins: dict[str, Tensor] = field(default_factory=dict)
    maxs: dict[str, Tensor] = field(default_factory=dict)

    def merge(self, other: MetricStats) -> MetricStats:
        """Combine two micro-batches (or two sources): sums add, minima min, maxima max."""

        def combine(a: dict[str, Tensor], b: dict[str, Tensor], op: Callable[[Tensor, Tensor], Tensor]):
            out = dict(a)
            for k, v in b.items():
                out[k] = op(out[k], v) if k in out else v
            return out

        return MetricStats(
            combine(self.token_sums, other.token_sums, torch.add),
            combine(self.seq_sums, other.seq_sums, torch.add),
            combine(self.mins, other.mins, torch.minimum),
            combine(self.maxs, other.maxs, torch.maximum),
        )

    def reduce(self, reducer: Reducer) -> MetricStats:
        """Reduce across ranks: one collective per non-empty group, keys sorted.

        The keys are a function of the configuration only (the core zero-fills what a micro-batch
        lacks), so every rank issues the same collectives (number, order, op, shape) whatever its data.
        """

        def apply(d: dict[str, Tensor], fn: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
            if not d:
                return {}
            keys = sorted(d)
            stacked = fn(torch.stack([d[k].detach().double() for k in keys]))
            return dict(zip(keys, stacked.unbind(0)))

        return MetricStats(
            apply(self.token_sums, lambda x: reducer.batch_sum(x, per_sequence=False)),
            apply(self.seq_sums, lambda x: reducer.batch_sum(x, per_sequence=True)),
            apply(self.mins, reducer.batch_min),
            apply(self.maxs, reducer.batch_max),
        )

    def detach(self) -> MetricStats:
        """A copy whose tensors are detached clones (safe from in-place scaling by a schedule)."""

        def det(d: dict[str, Tensor]) -> dict[str, Tensor]:
            return {k: v.detach().clone() for k, v in d.items()}

        return MetricStats(det(self.token_sums), det(self.seq_sums), det(self.mins), det(self.maxs))

    def finalize(self) -> dict[str, Tensor]:
        """Metric values (float64 scalar tensors) from the statistics present: the reductions of the metric
        schema (``core.metric_schema.METRICS``; a few vector ops)."""
        return finalize({
            k: t if t.dtype == torch.float64 else t.double()
            for d in (self.token_sums, self.seq_sums, self.mins, self.maxs) for k, t in d.items()
        })
