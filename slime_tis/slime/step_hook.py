"""slime ``--custom-megatron-before-train-step-hook-path slime_tis.slime.before_train_step``.

slime calls ``fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)`` on every rank before every
optimizer step, after the previous step's update; the hook flushes the previous step's exact ``tis/`` metrics.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from slime_tis.slime.config import slime_view
from slime_tis.slime.state import STATE

__all__ = ["before_train_step", "log_exact_metrics"]

logger = logging.getLogger("slime_tis.slime")


def log_exact_metrics(args: Any, rollout_id: Any = None, step_id: Any = None, *_: Any, **__: Any) -> dict[str, float]:
    """Flush the previous step's exact ``tis/`` metrics (``STATE.collector``, reduced over DP x CP), log them and
    append them as JSON to ``tis_metrics_path`` (rank 0); returns them. The last step of a run is reported by an
    explicit ``STATE.collector.flush()``."""
    values = STATE.collector.flush()
    if not values:
        return values
    logger.info("slime_tis exact metrics (before rollout %s step %s): %s", rollout_id, step_id,
                ", ".join(f"{k}={v:.6g}" for k, v in sorted(values.items())))
    path = slime_view(args).tis_metrics_path
    rank0 = not (torch.distributed.is_available() and torch.distributed.is_initialized()) or \
        torch.distributed.get_rank() == 0
    if path and rank0:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        clean = {k: (v if math.isfinite(v) else None) for k, v in values.items()}
        with open(p, "a", encoding="utf-8") as f:
            f.write(json.dumps({"rollout_id": rollout_id, "step_id": step_id, **clean}) + "\n")
    return values


#: slime's before-train-step hook: :func:`log_exact_metrics`
before_train_step = log_exact_metrics
