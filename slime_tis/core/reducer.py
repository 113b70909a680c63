"""The one door through which distributed behaviour enters the core.

The core computes everything on the tokens it is given. Three kinds of reduction need other
processes, and each is a method of a :class:`Reducer`:

* ``sequence_sum``: under context parallelism a sequence is split across the CP ranks, so the
  per-sequence partial sums ``[n_seq, k]`` (log-ratio sum, valid-token count, ...) must be summed
  over the CP group before any sequence- or geometric-level decision. Every CP rank must call it
  for every micro-batch, even when it holds no valid token.
* ``batch_sum``: statistics over the whole (micro-)batch: metric numerators and denominators,
  global token counts, batch-normalisation sums. Token-domain values are summed over DP x CP;
  per-sequence values (``per_sequence=True``) only over DP, because after ``sequence_sum`` every
  CP rank holds an identical copy of each sequence's value.
* ``batch_min`` / ``batch_max``: true extrema over DP x CP (never a mean of per-rank extrema).

:class:`LocalReducer` is the single-process identity; ``slime_tis.megatron`` supplies one on
Megatron's process groups.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

__all__ = ["Reducer", "LocalReducer"]


@runtime_checkable
class Reducer(Protocol):
    """Reductions the core needs from the parallel layout (see module docstring)."""

    def sequence_sum(self, x: Tensor) -> Tensor:
        """Complete per-sequence partial sums ``[n_seq, k]`` over the context-parallel group."""
        ...

    def batch_sum(self, x: Tensor, *, per_sequence: bool = False) -> Tensor:
        """Sum over the data-parallel x context-parallel group (data-parallel only if ``per_sequence``)."""
        ...

    def batch_min(self, x: Tensor) -> Tensor:
        """Element-wise minimum over the data-parallel x context-parallel group."""
        ...

    def batch_max(self, x: Tensor) -> Tensor:
        """Element-wise maximum over the data-parallel x context-parallel group."""
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
