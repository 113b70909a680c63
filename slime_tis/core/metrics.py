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

    def groups(self) -> tuple[dict[str, Tensor], ...]:
        return self.token_sums, self.seq_sums, self.mins, self.maxs

    def merge(self, other: MetricStats) -> MetricStats:
        """Combine two micro-batches (or two sources): sums add, minima min, maxima max."""
        ops = (torch.add, torch.add, torch.minimum, torch.maximum)
        return MetricStats(*({**a, **{k: op(a[k], v) if k in a else v for k, v in b.items()}}
                             for a, b, op in zip(self.groups(), other.groups(), ops)))

    def reduce(self, reducer: Reducer) -> MetricStats:
        """Reduce across ranks: one collective per non-empty group, keys sorted (the keys follow the configuration
        only, so every rank issues the same collectives)."""
        ops = (lambda x: reducer.batch_sum(x, per_sequence=False), lambda x: reducer.batch_sum(x, per_sequence=True),
               reducer.batch_min, reducer.batch_max)
        return MetricStats(*(_reduced(d, op) for d, op in zip(self.groups(), ops)))

    def detach(self) -> MetricStats:
        """A copy whose tensors are detached clones (safe from in-place scaling by a schedule)."""
        return MetricStats(*({k: v.detach().clone() for k, v in d.items()} for d in self.groups()))

    def finalize(self) -> dict[str, Tensor]:
        """Metric values (float64 0-d) from the statistics present (``core.metric_schema.finalize``)."""
        return finalize({k: t if t.dtype == torch.float64 else t.double() for d in self.groups() for k, t in d.items()})


def _reduced(d: dict[str, Tensor], fn: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
    """``d``'s values stacked in key order, reduced by one ``fn`` call."""
    if not d:
        return {}
    keys = sorted(d)
    return dict(zip(keys, fn(torch.stack([d[k].detach().double() for k in keys])).unbind(0)))
