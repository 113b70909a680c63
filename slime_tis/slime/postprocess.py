"""slime ``--rollout-data-postprocess-path slime_tis.slime.postprocess_rollout_data``.

slime calls ``fn(args, rollout_id, rollout_data)`` in every training process after the old / ref
log-probs and the advantages are computed and before the first training step of a rollout;
``rollout_data`` holds this data-parallel rank's samples as per-sample lists (log-probs CP-local,
``loss_masks`` full length). This hook sees the whole step, which the per-micro-batch loss hooks
cannot, and does two things:

1. **Global batch normalisation (algorithm 2, ``tis_batch_normalize: true``).** The weights
   ``w = f(pi_old / pi_rollout)`` are fixed for the step, so the factor that rescales them to mean 1
   over the kept units of the whole global batch is computed once here::

       factor = (sum over DP ranks of kept units) / (sum over DP ranks of their unnormalised weights)

   with the core's ``compute_tis`` (``norm_sum``, ``norm_count``) on every sample of this rank, then
   one all-reduce (DP x CP for token units, DP for sequence units). The TIS hook multiplies the
   weights by it. Here the global batch is the whole rollout, which is one optimizer step with
   slime's default ``--num-steps-per-rollout 1``; with several steps per rollout the factor is
   shared by the rollout's steps. slime's own ``mis.py`` normalises per micro-batch and rank.
2. **Log-prob dump (``tis_dump_dir`` set).** Appends this rank's full responses (CP chunks
   gathered) to ``<tis_dump_dir>/logprobs_dp<rank>.jsonl`` in the documented dump format
   (``docs/dump_format.md``), for ``slime-tis diagnose``.

Both need ``rollout_data['log_probs']`` (the recomputed ``pi_old``). slime skips that recompute in
its fast path (one step per rollout, no KL, no ``--get-mismatch-metrics``); add
``--get-mismatch-metrics`` to force it.

3. **Recorded training log-probs (algorithm 3, ``tis_record_train_log_probs: true``).** Writes the
   previous rollout's log-probs recorded by the custom loss (:mod:`slime_tis.slime.record`) and starts
   recording this one; the pi_old dump above is then skipped when slime ran no recompute.
4. **Rollout membership and ``drop``.** Registers each sample's rollout (``rollout_data['rollout_ids']``; and its
   advantages with ``--use-opsm``) for the loss hooks and, with ``tis_rejected_denominator: drop``, decides how
   each rollout's kept-token count reaches them, counting now what pi_old decides and refusing what cannot
   be exact (:mod:`slime_tis.slime.kept`).

Pipeline stages other than the last hold no log-probs and
do nothing (the loss runs on the last stage).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from slime_tis.core.algorithms import algorithm_of
from slime_tis.core.weights import batch_norm_factor
from slime_tis.engine.parallel import ParallelContext, parallel_context
from slime_tis.slime.batch import gather_full_responses, pack_slime_batch
from slime_tis.slime.config import tis_config_from_slime_args
from slime_tis.slime.custom_options import check_custom_options
from slime_tis.slime.kept import custom_loss_kl, drop_applies, pi_old_correction, plan_rollout_drop
from slime_tis.slime.opsm import check_opsm
from slime_tis.slime.record import RECORDER, flush_recorded_train_log_probs, recording_enabled
from slime_tis.slime.rollouts import unit_keys
from slime_tis.slime.schedule import pi_old_pass_flags
from slime_tis.slime.state import STATE
from slime_tis.tools.dump import records_from_samples, write_logprob_dump

__all__ = ["postprocess_rollout_data"]

logger = logging.getLogger("slime_tis.slime")


def _needs_log_probs(args: Any, rollout_data: dict[str, Any], ctx: ParallelContext, what: str) -> bool:
    if rollout_data.get("log_probs"):
        return True
    if not ctx.last_pp_stage:
        return False
    raise ValueError(
        f"{what} needs rollout_data['log_probs'] (the pi_old recompute), which slime skipped "
        f"(fast path: one step per rollout without KL, or --use-rollout-logprobs); add {pi_old_pass_flags(args)} "
        "to force the recompute, or, with the algorithm-3 custom loss, tis_record_train_log_probs: true"
    )


def uses_reinforce_is_loss(args: Any) -> bool:
    """Whether slime's loss is this package's algorithm-3 custom loss (``--loss-type custom_loss``)."""
    path = str(getattr(args, "custom_loss_function_path", None) or "")
    return getattr(args, "loss_type", None) == "custom_loss" and path.endswith("reinforce_is_loss")


def postprocess_rollout_data(args: Any, rollout_id: Any, rollout_data: dict[str, Any]) -> None:
    """slime's rollout-data hook (module docstring). Modifies nothing in ``rollout_data``."""
    cfg = tis_config_from_slime_args(args, algorithm=3 if uses_reinforce_is_loss(args) else None)
    row = algorithm_of(cfg)
    want_norm = cfg.batch_normalize and row.step_batch_norm
    dump_dir = getattr(args, "tis_dump_dir", None)
    flush_recorded_train_log_probs(args)  # the previous rollout's recorded training log-probs (algorithm 3)
    STATE.clear()
    if not row.ppo:  # the custom loss: its refusals before anything is counted
        check_custom_options(args, cfg.rejected_denominator == "drop")
    if row.ppo:  # slime's own PPO loss (OPSM is applied there)
        check_opsm(args)
        if want_norm and getattr(args, "use_opsm", False):
            raise ValueError("tis_batch_normalize with --use-opsm: the global factor is fixed before training, but "
                             "OPSM's rejections depend on each step's parameters; use one of the two")
    masks = rollout_data.get("loss_masks") or []
    positions = rollout_data.get("partition")
    units = unit_keys(rollout_data, range(len(masks)) if positions is None else positions)
    use_opsm = getattr(args, "use_opsm", False) and row.ppo
    STATE.rollouts.register(masks, units, rollout_data.get("advantages") if use_opsm else None)
    recording = recording_enabled(args)
    if recording:
        RECORDER.start_rollout(rollout_id, rollout_data)
    else:
        RECORDER.clear()
    ctx = parallel_context()
    # the rollout's correction from pi_old, computed at most once for drop's counts and the batch normalisation
    whole = functools.cache(lambda: pi_old_correction(cfg, rollout_data, rollout_data["log_probs"], ctx,
                                                      host_kl=custom_loss_kl(args, cfg)))
    if drop_applies(cfg):
        STATE.drop_plan = plan_rollout_drop(args, cfg, rollout_data, ctx, STATE.rollouts, whole)
        if STATE.drop_plan.hook_steps:
            STATE.rollout_data = rollout_data  # for the step hook's forward passes (released after the last)
    if not want_norm and not dump_dir:
        return
    if not want_norm and recording and not rollout_data.get("log_probs"):
        return  # no pi_old: the dump gets the training log-probs the custom loss records
    if not _needs_log_probs(args, rollout_data, ctx, "tis_batch_normalize" if want_norm else "tis_dump_dir"):
        return
    if want_norm:
        # the loss's inputs known now (pi_old, rollout log-probs, advantages): what they reject is left out here too;
        # the same correction as drop's counts from pi_old (``whole``: computed once for both)
        packed, res = whole()
        factor = batch_norm_factor(cfg.plan, res.norm_sum, res.norm_count, ctx.reducer)
        STATE.set_factor(rollout_id, factor, cfg)
    else:
        packed = pack_slime_batch(rollout_data["loss_masks"], rollout_data["total_lengths"],
                                  rollout_data["response_lengths"], ctx.cp_rank, ctx.cp_size)
    lp_old = packed.cat_local("log_probs", rollout_data["log_probs"]).to(packed.full_mask.device)
    lp_rollout = packed.cat_local("rollout_log_probs", rollout_data["rollout_log_probs"]).to(lp_old.device)

    if dump_dir:
        train_full = gather_full_responses(packed, lp_old, ctx.reducer)
        rollout_full = gather_full_responses(packed, lp_rollout, ctx.reducer)
        if ctx.cp_rank == 0 and ctx.tp_rank == 0:
            path = Path(dump_dir) / f"logprobs_dp{ctx.dp_rank}.jsonl"
            recs = records_from_samples(
                train_full,
                rollout_full,
                list(rollout_data["loss_masks"]),
                step=int(rollout_id) if isinstance(rollout_id, int) else None,
            )
            rewards = rollout_data.get("rewards")
            if rewards is not None and len(rewards) == len(recs):
                for rec, rew in zip(recs, rewards):
                    try:
                        rec["reward"] = float(rew)
                    except (TypeError, ValueError):
                        pass
            write_logprob_dump(
                path,
                recs,
                append=True,
                meta={"train_policy": "old", "algorithm": cfg.algorithm, "writer": "slime_tis.slime"},
            )
