"""Loss aggregations (``--tis-loss-agg``), one row each; :func:`aggregate` is the only code of their formulas::

    name                  numerator                           this call's share of D
    token-mean            sum_t loss_t                        counted tokens    (summed over DP x CP)
    seq-mean-token-mean   sum_i (1 / n_i) sum_{t in i} loss_t sequences, n_i > 0 (summed over DP only)
    seq-mean-token-sum    sum_i sum_{t in i} loss_t           idem
    token-sum             sum_t loss_t                        0

The loss is ``numerator / max(D, 1)`` with the global ``D`` (docs/semantics.md, "Loss aggregation").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from slime_tis.core.packing import Layout

__all__ = ["Aggregation", "AGGREGATIONS", "aggregation_of", "aggregate"]


@dataclass(frozen=True)
class Aggregation:
    """One row of :data:`AGGREGATIONS`: ``token_weight`` ``"1"`` or ``"1/n_i"``, ``denominator`` ``"tokens"``,
    ``"sequences"`` or ``"one"``."""

    name: str
    token_weight: str
    denominator: str

    @property
    def per_sequence(self) -> bool:
        """The denominator counts sequences (replicated on CP ranks: summed over DP only)."""
        return self.denominator == "sequences"

    @property
    def needs_counts(self) -> bool:
        """The formula reads per-sequence counts ``n_i`` (completed over CP)."""
        return self.per_sequence or self.token_weight == "1/n_i"


AGGREGATIONS: dict[str, Aggregation] = {
    "token-mean": Aggregation("token-mean", token_weight="1", denominator="tokens"),
    "seq-mean-token-mean": Aggregation("seq-mean-token-mean", token_weight="1/n_i", denominator="sequences"),
    "seq-mean-token-sum": Aggregation("seq-mean-token-sum", token_weight="1", denominator="sequences"),
    "token-sum": Aggregation("token-sum", token_weight="1", denominator="one"),
}


def aggregation_of(name: str) -> Aggregation:
    """The row named ``name``."""
    if name not in AGGREGATIONS:
        raise ValueError(f"loss_agg = {name!r}: must be one of {', '.join(AGGREGATIONS)}")
    return AGGREGATIONS[name]


def aggregate(name: str, per_token: Tensor | None, counted: Tensor, layout: Layout,
              counts: Tensor | None) -> tuple[Tensor | None, Tensor]:
    """``(numerator, this call's share of D)`` (module table): ``per_token`` ``[T]`` losses, 0 where not counted
    (``None``: the denominator only); ``counted`` ``[T]`` bool; ``counts`` ``[n_seq]`` counted tokens per sequence,
    complete over CP (where :attr:`Aggregation.needs_counts`)."""
    row = aggregation_of(name)
    if row.needs_counts and counts is None:
        raise ValueError(f"loss_agg = {name!r} needs the per-sequence counts")
    if row.denominator == "tokens":
        local = counted.sum(dtype=torch.float32)
    elif row.denominator == "sequences":
        local = (counts > 0).sum(dtype=torch.float32)
    else:
        local = torch.zeros((), dtype=torch.float32, device=counted.device)
    if per_token is None:
        return None, local
    if row.token_weight == "1/n_i":
        per_token = per_token / layout.expand(counts.to(per_token.dtype).clamp(min=1.0))
    return per_token.sum(), local
