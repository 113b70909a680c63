"""Per-rollout state passed from slime's rollout-data hook to its loss hooks (same process).

slime drops unknown keys from ``rollout_data`` before the loss, but the rollout-data
post-processing hook and the loss hooks run in the same training-actor process, so the global
batch-normalisation factor computed before training (algorithm 2) is handed over here.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["RolloutState", "STATE"]


@dataclass
class RolloutState:
    """``rollout_id`` of the data last post-processed, and its global batch-norm factor (or None)."""

    rollout_id: object = None
    batch_norm_factor: Tensor | None = None
    batch_norm_key: object = None  # the TISConfig it was computed for

    def set_factor(self, rollout_id: object, factor: Tensor | None, key: object) -> None:
        self.rollout_id = rollout_id
        self.batch_norm_factor = factor
        self.batch_norm_key = key

    def clear(self) -> None:
        self.set_factor(None, None, None)


STATE = RolloutState()
