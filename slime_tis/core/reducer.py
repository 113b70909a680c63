"""The one door through which distributed behaviour enters the core (docs/CORE_API.md, "Reducer protocol").

``sequence_sum``: per-sequence partial sums ``[n_seq, k]`` over CP (every CP rank calls it for every micro-batch);
``batch_sum``: over DP x CP (DP only with ``per_sequence``); ``batch_min`` / ``batch_max``: extrema over DP x CP.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

__all__ = ["Reducer", "LocalReducer"]


@runtime_checkable
class Reducer(Protocol):
    """Reductions the core needs from the parallel layout (module docstring)."""

    def sequence_sum(self, x: Tensor) -> Tensor:
        ...

    def batch_sum(self, x: Tensor, *, per_sequence: bool = False) -> Tensor:
        ...

    def batch_min(self, x: Tensor) -> Tensor:
        ...

    def batch_max(self, x: Tensor) -> Tensor:
        ...


class LocalReducer:
    """Identity reducer: one process holds whole sequences and the whole batch."""

    def sequence_sum(self, x: Tensor) -> Tensor:
        return x

    def batch_sum(self, x: Tensor, *, per_sequence: bool = False) -> Tensor:
        return x

    def batch_min(self, x: Tensor) -> Tensor:
        return x

    def batch_max(self, x: Tensor) -> Tensor:
        return x
