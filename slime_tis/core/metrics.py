""":class:`MetricStats`: raw sums, minima and maxima, merged over micro-batches, reduced over ranks with their own
operator (SUM / MIN / MAX), then finalized by the metric schema (``core.metric_schema``). Tensors throughout: no
host sync. Empty domains give 0, never NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from slime_tis.core.metric_schema import finalize
from slime_tis.core.reducer import Reducer

__all__ = ["MetricStats"]


@dataclass
class MetricStats:
    """Reducible statistics, 0-d tensors by key: ``token_sums`` (summed over DP x CP), ``seq_sums`` (over DP only:
    replicated over CP), ``mins``, ``maxs``."""

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
        """Reduce across ranks: one collective per non-empty group, keys sorted (the keys follow the configuration
        only, so every rank issues the same collectives)."""

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
        """Metric values (float64 0-d) from the statistics present (``core.metric_schema.finalize``)."""
        return finalize({
            k: t if t.dtype == torch.float64 else t.double()
            for d in (self.token_sums, self.seq_sums, self.mins, self.maxs) for k, t in d.items()
        })
