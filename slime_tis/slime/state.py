"""Per-rollout state passed from slime's rollout-data hook to its loss hooks (same process).

slime drops unknown keys from ``rollout_data`` before the loss, but the rollout-data
post-processing hook and the loss hooks run in the same training-actor process, so what the loss
hooks need from the whole rollout batch is handed over here: the global batch-normalisation factor
(algorithm 2), the rollout of every sample, the plan for ``tis_rejected_denominator: drop``
(:mod:`slime_tis.slime.kept`) and, for the step hook, the rollout data itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from slime_tis.slime.rollouts import RolloutRegistry

__all__ = ["RolloutState", "STATE"]


@dataclass
class RolloutState:
    """``rollout_id`` of the data last post-processed, its global batch-norm factor (or None), the
    rollout membership of its samples, the ``drop`` plan (or None) and the rollout data."""

    rollout_id: object = None
    batch_norm_factor: Tensor | None = None
    batch_norm_key: object = None  # the TISConfig it was computed for
    rollouts: RolloutRegistry = field(default_factory=RolloutRegistry)
    drop_plan: Any = None  # slime_tis.slime.kept.DropPlan of this rollout
    rollout_data: dict | None = None

    def set_factor(self, rollout_id: object, factor: Tensor | None, key: object) -> None:
        self.rollout_id = rollout_id
        self.batch_norm_factor = factor
        self.batch_norm_key = key

    def clear(self) -> None:
        self.set_factor(None, None, None)
        self.rollouts.clear()
        self.drop_plan = None
        self.rollout_data = None


STATE = RolloutState()
