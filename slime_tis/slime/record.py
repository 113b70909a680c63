"""The training log-probs the algorithm-3 custom loss records (``tis_record_train_log_probs``; docs/slime.md).

Per sample the detached CP-local ``log pi_theta`` of the first loss that saw it, handed to slime's
``--save-debug-train-data`` capture and written by the next rollout's rollout-data hook.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

__all__ = ["TrainLogProbRecorder"]


class TrainLogProbRecorder:
    """First-seen detached CP-local training log-probs per sample of the current rollout."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._values: dict[int, tuple[Tensor, Tensor]] = {}  # id(loss mask) -> (mask, log-probs)
        self.rollout: dict[str, Any] | None = None  # what the dump of the current rollout needs

    def start_rollout(self, rollout_id: Any, rollout_data: dict[str, Any]) -> None:
        """Forget the previous rollout; keep references to what the dump of this one needs."""
        self.clear()
        self.rollout = {
            "rollout_id": rollout_id,
            **{k: rollout_data.get(k) for k in
               ("loss_masks", "rollout_log_probs", "total_lengths", "response_lengths")},
        }

    def record(self, batch: dict[str, Any], per_sample: Sequence[Tensor]) -> None:
        """Keep ``per_sample[i]`` (CP-local ``[T_i]``) for ``batch['loss_masks'][i]`` unless already kept."""
        try:
            from slime.backends.megatron_utils import loss as slime_loss
        except Exception:  # noqa: BLE001 - slime absent or not importable here: nothing to forward to
            slime_loss = None
        capture = getattr(slime_loss, "_maybe_capture_log_probs", None)  # slime's own capture, if it has one
        if capture is not None:
            capture(batch, list(per_sample))
        if self.rollout is None:  # no rollout-data hook: nothing would ever write (or free) our copies
            return
        for mask, lp in zip(batch["loss_masks"], per_sample):
            if id(mask) not in self._values:
                self._values[id(mask)] = (mask, lp.detach().clone())

    def recorded(self, mask: Tensor) -> Tensor | None:
        entry = self._values.get(id(mask))
        return entry[1] if entry is not None and entry[0] is mask else None
