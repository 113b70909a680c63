"""Per-step logging of the example job: JSONL, TensorBoard and a tqdm progress bar with ETA.

``RUN_DIR/metrics.jsonl`` holds one JSON object per step with ``step``, ``reward``, ``loss``,
``grad_norm``, ``response_len``, ``step_time_s`` and every ``tis/*`` and ``policy/*`` diagnostic.
TensorBoard event files go to ``RUN_DIR/tb`` (skipped with a warning if tensorboard is absent).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any


class RunLogger:
    """Writes the logs on the logging rank; every method is a no-op elsewhere (``enabled=False``)."""

    def __init__(
        self,
        run_dir: str,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int,
        progress: bool = True,
        tensorboard: bool = True,
    ) -> None:
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._tb = self._bar = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        from examples.rl.run_dir import cut_from_step

        for note in cut_from_step(self.path, start_step):  # a resumed run rewrites the steps it repeats
            warnings.warn(f"{note}; cut before resuming", stacklevel=2)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=start_step)
            except ImportError:
                warnings.warn("tensorboard is not installed; TensorBoard logging is off", stacklevel=2)
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, desc="train")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        row: dict[str, Any] = {"step": step}
        row.update({k: _clean(v) for k, v in sorted(metrics.items())})
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(
                reward=f"{metrics.get('reward', float('nan')):.3f}",
                k3=f"{metrics.get('tis/k3_kl', float('nan')):.2e}",
                refresh=False,
            )

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
