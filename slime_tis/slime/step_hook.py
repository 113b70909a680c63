"""slime ``--custom-megatron-before-train-step-hook-path slime_tis.slime.before_train_step``.

slime calls ``fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)`` on every rank before every
optimizer step, after the previous step's update. It

1. flushes the previous step's exact ``tis/`` metrics (:func:`log_exact_metrics`);
2. with algorithm 3's ``drop``, for the steps the rollout-data hook assigned to it (:mod:`slime_tis.slime.kept`):
   runs slime's own ``forward_only`` over this rank's micro-batches of the step (grouped as the step trains them)
   for ``pi_theta`` at the step's parameters, takes the custom loss's keep decisions from it (one CP all-reduce of
   the per-sequence sums, one of the keep masks) and registers each rollout's ``(N_g, K_g)`` summed over DP (one
   all-reduce of ``[4, n_batch]``). Cost: one forward pass over the step's data (docs/slime.md).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from slime_tis.engine.parallel import parallel_context
from slime_tis.slime.config import slime_view
from slime_tis.slime.kept import count_kept
from slime_tis.slime.rollouts import rollout_table
from slime_tis.slime.schedule import StepIterator, step_view
from slime_tis.slime.state import STATE

__all__ = ["before_train_step", "log_exact_metrics"]

logger = logging.getLogger("slime_tis.slime")


def log_exact_metrics(args: Any, rollout_id: Any = None, step_id: Any = None, *_: Any, **__: Any) -> dict[str, float]:
    """Flush the previous step's exact ``tis/`` metrics (``STATE.collector``, reduced over DP x CP), log them and
    append them as JSON to ``tis_metrics_path`` (rank 0). Usable as slime's before-train-step hook on its own; the
    last step of a run is reported by an explicit ``STATE.collector.flush()``."""
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


def _step_log_probs(args: Any, model: Any, data: dict[str, Any], micro_batches: list[list[int]]) -> list | None:
    """slime's forward-only pass over one step's micro-batches: CP-local per-sample log-probs (last stage)."""
    from slime.backends.megatron_utils.loss import get_log_probs_and_entropy
    from slime.backends.megatron_utils.model import forward_only

    iterators = [StepIterator(data, micro_batches) for _ in range(max(len(model), 1))]  # one per virtual stage
    out = forward_only(get_log_probs_and_entropy, args, model, iterators, [len(micro_batches)],
                       store_prefix="tis_step_")
    return out.get("tis_step_log_probs")


def count_step(args: Any, step_id: int, log_probs: list | None) -> None:
    """Count and register step ``step_id``'s keep decisions from ``log_probs`` (:func:`step_view` order)."""
    plan, data = STATE.drop_plan, STATE.rollout_data
    ctx = parallel_context()
    if not ctx.last_pp_stage:
        return
    view, _, local = step_view(data, step_id)
    got = 0 if log_probs is None else len(log_probs)
    if got != len(local):
        raise RuntimeError(f"before_train_step: slime's forward pass returned {got} log-prob tensors for the "
                           f"{len(local)} samples of step {step_id}")
    keep_full, valid, kept = count_kept(slime_view(args, algorithm=3), view, log_probs, ctx)
    table, _ = rollout_table(valid, kept, [plan.keys[i] for i in local], [plan.positions[i] for i in local],
                             plan.n_batch, ctx.reducer)
    STATE.rollouts.set_counted(local, keep_full, table[:, :2])


def before_train_step(args: Any, rollout_id: Any = None, step_id: Any = 0, model: Any = None, *_: Any,
                      **__: Any) -> dict[str, float]:
    """slime's before-train-step hook (module docstring); returns the flushed exact metrics."""
    values = log_exact_metrics(args, rollout_id, step_id)
    plan = STATE.drop_plan
    if plan is None or step_id not in plan.hook_steps:
        return values
    log_probs = _step_log_probs(args, model, *step_view(STATE.rollout_data, step_id)[:2])
    count_step(args, step_id, log_probs)
    if step_id == plan.hook_steps[-1]:
        STATE.rollout_data = None  # the rollout's last counted step: hold no reference beyond it
    return values
