"""Per-rollout state passed from slime's rollout-data hook to its loss hooks (same process).

slime drops unknown keys from ``rollout_data`` before the loss, but the rollout-data
post-processing hook and the loss hooks run in the same training-actor process, so what the loss
hooks need from the whole rollout batch is handed over here: the global batch-normalisation factor
(algorithm 2) and the rollout of every sample (``tis_rejected_denominator: drop``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from slime_tis.slime.rollouts import RolloutRegistry

__all__ = ["RolloutState", "STATE"]


@dataclass
class RolloutState:
    """``rollout_id`` of the data last post-processed, its global batch-norm factor (or None) and the
    rollout membership of its samples."""

    rollout_id: object = None
    batch_norm_factor: Tensor | None = None
    batch_norm_key: object = None  # the TISConfig it was computed for
    rollouts: RolloutRegistry = field(default_factory=RolloutRegistry)

    def set_factor(self, rollout_id: object, factor: Tensor | None, key: object) -> None:
        self.rollout_id = rollout_id
        self.batch_norm_factor = factor
        self.batch_norm_key = key

    def clear(self) -> None:
        self.set_factor(None, None, None)
        self.rollouts.clear()


STATE = RolloutState()
