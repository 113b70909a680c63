"""slime ``--rollout-data-postprocess-path slime_tis.slime.postprocess_rollout_data``.

slime calls ``fn(args, rollout_id, rollout_data)`` on every training rank before the rollout's first step
(``rollout_data``: this DP rank's samples, log-probs CP-local, ``loss_masks`` full length). Modifying nothing, it
registers the advantages for ``--use-opsm``, checks ``drop``'s rollouts (:mod:`slime_tis.slime.kept`), computes
algorithm 2's global batch-normalisation factor from pi_old (one all-reduce) and writes the log-prob dumps
(docs/dump_format.md). Pipeline stages other than the last hold no log-probs and take part in the collectives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from slime_tis.core.algorithms import algorithm_of
from slime_tis.core.correction import TISResult
from slime_tis.core.weights import normalisation_factor_over
from slime_tis.engine.parallel import ParallelContext, parallel_context
from slime_tis.engine.step import StepEngine
from slime_tis.engine.totals import step_batch_norm
from slime_tis.slime.batch import SlimePacked, pack_slime_batch
from slime_tis.slime.config import TIS_FUNCTION, SlimeView, slime_view
from slime_tis.slime.kept import check_drop_config, check_one_sample_rollouts, drop_applies
from slime_tis.slime.opsm import check_opsm
from slime_tis.slime.state import STATE
from slime_tis.tools.dump import records_from_samples, write_logprob_dump

__all__ = ["flush_recorded_train_log_probs", "postprocess_rollout_data"]


def postprocess_rollout_data(args: Any, rollout_id: Any, rollout_data: dict[str, Any]) -> None:
    """slime's rollout-data hook (module docstring). Modifies nothing in ``rollout_data``."""
    view = slime_view(args)
    cfg, row = view.cfg, algorithm_of(view.cfg)
    want_norm = step_batch_norm(cfg)
    flush_recorded_train_log_probs(args)  # the previous rollout's recorded training log-probs (algorithm 3)
    STATE.new_rollout()
    check_drop_config(view)
    if row.ppo:  # slime's own PPO loss (OPSM is applied there)
        check_opsm(view)
        if want_norm and view.use_opsm:
            raise ValueError("tis_batch_normalize with --use-opsm: the global factor is fixed before training, but "
                             "OPSM's rejections depend on each step's parameters; use one of the two")
        if view.use_opsm and rollout_data.get("advantages") is not None:
            STATE.advantages.update({id(m): (m, a) for m, a in zip(rollout_data["loss_masks"],
                                                                    rollout_data["advantages"])})
    if view.recording:
        STATE.recorder.start_rollout(rollout_id, rollout_data)
    else:
        STATE.recorder.clear()
    ctx = parallel_context()
    if drop_applies(cfg):
        check_one_sample_rollouts(rollout_data, ctx.reducer)
        STATE.drop_checked = True
    dump_dir = view.tis_dump_dir
    if not want_norm and not dump_dir:
        return
    if not rollout_data.get("log_probs"):  # no pi_old
        if not ctx.last_pp_stage or (not want_norm and view.recording):
            return  # a stage without log-probs; or the dump gets the training log-probs the custom loss records
        # --get-mismatch-metrics makes slime run its pi_old pass; it needs a TIS function
        flags = "--get-mismatch-metrics" + ("" if view.custom_tis_function_path else
                                            f" --custom-tis-function-path {TIS_FUNCTION}")
        raise ValueError(
            f"{'tis_batch_normalize' if want_norm else 'tis_dump_dir'} needs rollout_data['log_probs'] (the pi_old "
            "recompute), which slime skipped (fast path: one step per rollout without KL, or --use-rollout-logprobs); "
            f"add {flags} to force the recompute, or, with the algorithm-3 custom loss, "
            "tis_record_train_log_probs: true")
    packed = pack_slime_batch(list(rollout_data["loss_masks"]), rollout_data["total_lengths"],
                              rollout_data["response_lengths"], ctx.cp_rank, ctx.cp_size)
    if want_norm:
        res = _pi_old_correction(view, rollout_data, packed, ctx)
        STATE.rollout_id, STATE.batch_norm_key = rollout_id, cfg
        STATE.batch_norm_factor = normalisation_factor_over(cfg.plan, res.norm_sum, res.norm_count, ctx.reducer)
    if dump_dir:
        _dump(packed, rollout_data, rollout_id, ctx, Path(dump_dir) / f"logprobs_dp{ctx.dp_rank}.jsonl",
              {"train_policy": "old", "algorithm": cfg.algorithm, "writer": "slime_tis.slime"})


def _pi_old_correction(view: SlimeView, data: dict[str, Any], packed: SlimePacked, ctx: ParallelContext) -> TISResult:
    """The rollout's correction from pi_old (``data['log_probs']``) against the rollout log-probs, without batch
    normalisation (non-finite advantages reject their sequence, as in the loss)."""
    device = packed.full_mask.device
    adv = data.get("advantages")
    batch = packed.tis_batch(rollout_log_probs=packed.cat_local("rollout_log_probs", data["rollout_log_probs"]).to(
        device), old_log_probs=packed.cat_local("log_probs", data["log_probs"]).to(device),
        advantages=None if adv is None else packed.cat_local("advantages", adv).to(device))
    return StepEngine(view.cfg.replace(batch_normalize=False), ctx.reducer).correct(batch, batch.old_log_probs)


def _dump(packed: SlimePacked, data: dict[str, Any], rollout_id: Any, ctx: ParallelContext, path: Path,
          meta: dict[str, Any], train: list | None = None, samples: list[int] | None = None) -> int:
    """Append ``data``'s samples (``samples``: these only) to the dump at ``path``: the training log-probs
    (``train``, CP-local per sample; default pi_old) and the rollout log-probs, CP chunks gathered (one CP
    all-reduce each, every CP rank), written by CP rank 0 of TP rank 0. Returns the records written."""
    device = packed.full_mask.device
    local = packed.cat_local("log_probs", data["log_probs"]) if train is None else packed.cat_local(
        "recorded log-probs", train)
    train_full = packed.gather_full(local.to(device), ctx.reducer)
    rollout_local = packed.cat_local("rollout_log_probs", data["rollout_log_probs"]).to(device)
    rollout_full = packed.gather_full(rollout_local, ctx.reducer)
    keep = list(range(len(train_full))) if samples is None else samples
    if not keep or ctx.cp_rank != 0 or ctx.tp_rank != 0:
        return 0
    recs = records_from_samples([train_full[i] for i in keep], [rollout_full[i] for i in keep],
                                [data["loss_masks"][i] for i in keep],
                                step=rollout_id if isinstance(rollout_id, int) else None,
                                **({} if samples is None else {"sample_index": keep}))
    rewards = data.get("rewards")
    if samples is None and rewards is not None and len(rewards) == len(recs):
        for rec, rew in zip(recs, rewards):
            try:
                rec["reward"] = float(rew)
            except (TypeError, ValueError):
                pass
    return write_logprob_dump(path, recs, append=True, meta=meta)


def flush_recorded_train_log_probs(args: Any, *, meta: dict[str, Any] | None = None) -> int:
    """Append the training log-probs the custom loss recorded for the current rollout (``STATE.recorder``) to
    ``<tis_dump_dir>/logprobs_theta_dp<rank>.jsonl`` (header ``train_policy: "theta_first_forward"``), then forget
    them. Every rank of the CP group (one CP all-reduce per quantity; nothing without ``tis_dump_dir``, recording,
    or a registered rollout). Returns the records written on this rank (samples the loss never saw are left out)."""
    view = slime_view(args)
    data = STATE.recorder.rollout
    if not view.tis_dump_dir or not view.recording or data is None or not data.get("loss_masks"):
        return 0
    if data.get("rollout_log_probs") is None:
        raise ValueError("tis_record_train_log_probs: the dump needs rollout_data['rollout_log_probs']")
    ctx = parallel_context()
    masks = list(data["loss_masks"])
    packed = pack_slime_batch(masks, data["total_lengths"], data["response_lengths"], ctx.cp_rank, ctx.cp_size)
    got = [STATE.recorder.recorded(m) for m in masks]
    local = [g if g is not None else torch.zeros(int(n), device=packed.full_mask.device)
             for g, n in zip(got, packed.local_lengths.tolist())]  # host-sync-ok (CPU lengths; outside the loss)
    STATE.recorder.clear()
    header = {"train_policy": "theta_first_forward", "algorithm": 3, "writer": "slime_tis.slime", **(meta or {})}
    return _dump(packed, data, data["rollout_id"], ctx,
                 Path(view.tis_dump_dir) / f"logprobs_theta_dp{ctx.dp_rank}.jsonl", header, train=local,
                 samples=[i for i, g in enumerate(got) if g is not None])
