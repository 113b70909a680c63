"""slime ``--custom-megatron-before-train-step-hook-path slime_tis.slime.before_train_step``.

slime calls ``fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)`` on every rank before
every optimizer step (``train_one_step``, ``slime/backends/megatron_utils/model.py``, THUDM/slime 624b824),
after the previous step's update. It does two things:

1. **Exact metrics**: :func:`slime_tis.slime.log_exact_metrics` (flushes the previous step's ``tis/`` metrics).
2. **Kept counts of the custom loss at this step's parameters** (algorithm 3 with
   ``tis_rejected_denominator: drop``, for the steps the rollout-data hook assigned to it, see
   :mod:`slime_tis.slime.kept`). Before the step trains:

   * slime's own ``forward_only(get_log_probs_and_entropy, ...)`` (eval mode, no gradient) over this rank's
     micro-batches of the step, grouped exactly as the step will train them, gives ``pi_theta`` at the
     step's parameters (pipeline stages take part as in any forward pass; the last one gets the log-probs);
   * the custom loss's keep decisions from them (``compute_tis`` of ``sg(pi_theta)`` against the rollout
     log-probs, non-finite advantages reject), full-length and identical on all CP ranks (one CP
     all-reduce of the per-sequence sums, one of the keep masks);
   * each rollout's ``(N_g, K_g)`` summed over the data-parallel ranks (one all-reduce of ``[4, n_batch]``)
     and registered; the custom loss then keeps exactly these tokens and divides rollout ``g`` by ``K_g``.

   Cost per step: one forward pass over the step's micro-batches (over a rollout: one forward pass over
   its data, the cost of slime's pi_old recompute: roughly a third of the training compute; not measured here),
   plus one ``[4, n_batch]`` float64 all-reduce; memory: the step's log-probs while counting, then one
   bool per response token of the step. Step 0 is skipped when slime recomputed pi_old (the same
   parameters; the rollout-data hook counted it).
"""

from __future__ import annotations

from typing import Any

from slime_tis.engine.parallel import parallel_context
from slime_tis.slime.config import tis_config_from_slime_args
from slime_tis.slime.kept import count_kept, custom_loss_kl
from slime_tis.slime.metrics import log_exact_metrics
from slime_tis.slime.rollouts import rollout_table
from slime_tis.slime.schedule import StepIterator, step_view
from slime_tis.slime.state import STATE

__all__ = ["before_train_step"]


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
    cfg = tis_config_from_slime_args(args, algorithm=3)
    keep_full, valid, kept = count_kept(cfg, view, log_probs, ctx, host_kl=custom_loss_kl(args, cfg))
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
