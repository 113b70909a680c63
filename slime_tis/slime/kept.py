"""``tis_rejected_denominator: drop`` in slime: each hook divides its micro-batch's rollouts by their kept tokens.

slime divides each sample's token sum by ``N_g = rollout_mask_sums[i]``, the valid tokens of its whole rollout
(the sample's own count without it); ``drop`` divides by ``K_g``, the rollout's kept tokens. A hook sees one
micro-batch, so ``drop`` is exact only where every rollout's valid tokens lie in one sample (``N_g = n_i``): the
rollout-data hook refuses any other rollout batch (docs/slime.md, "What the loss divides by").
"""

from __future__ import annotations

from typing import Any

import torch

from slime_tis.core.algorithms import algorithm_of
from slime_tis.slime.batch import mask_sums

__all__ = ["check_drop_config", "check_one_sample_rollouts", "drop_applies"]

NEEDS_HOOK = ("tis_rejected_denominator = 'drop' needs --rollout-data-postprocess-path "
              "slime_tis.slime.postprocess_rollout_data (it checks that every rollout is one sample)")
MULTI_SAMPLE = ("tis_rejected_denominator = 'drop' with rollouts of several samples: slime packs a rollout's "
                "samples into different micro-batches, data-parallel ranks or optimizer steps, so its kept-token count "
                "K_g would need a pi_old pass or an extra forward pass per optimizer step before the loss; use "
                "tis_rejected_denominator: keep (the default)")
PER_TOKEN = ("tis_rejected_denominator = 'drop' cannot be honoured with --calculate-per-token-loss: slime "
             "divides by the step's original token count; use the default per-rollout mean or 'keep'")


def drop_applies(cfg: Any) -> bool:
    """``drop`` with slime's per-rollout mean (the case that needs ``K_g``)."""
    return cfg.rejected_denominator == "drop" and algorithm_of(cfg).corrects and cfg.loss_agg == "seq-mean-token-mean"


def check_drop_config(view: Any, *, checked: bool = True) -> None:
    """Configuration-level refusals of ``drop`` (``view``: the :class:`~slime_tis.slime.config.SlimeView`);
    ``checked``: the rollout-data hook checked this rollout (:data:`NEEDS_HOOK` otherwise)."""
    cfg = view.cfg
    if cfg.rejected_denominator != "drop" or not algorithm_of(cfg).corrects:
        return
    if view.calculate_per_token_loss:
        raise ValueError(PER_TOKEN)
    reducer = view.custom_pg_loss_reducer_function_path
    if reducer is not None:
        raise ValueError(f"tis_rejected_denominator = 'drop' with --custom-pg-loss-reducer-function-path {reducer}: "
                         "your reducer chooses each sample's denominator from the kept masks it is given; use "
                         "tis_rejected_denominator: keep, or slime's default reducer")
    if view.use_opsm and not algorithm_of(cfg).ppo:  # the custom loss applies slime's OPSM after the correction
        raise ValueError("tis_rejected_denominator = 'drop' with --use-opsm: drop divides each rollout by its tokens "
                         "kept by the rejection rules, counted before OPSM decides, so OPSM's zeroed tokens would "
                         "count as kept; use tis_rejected_denominator: keep")
    if not checked:  # here drop_applies(cfg): --calculate-per-token-loss was refused above
        raise ValueError(NEEDS_HOOK)


def check_one_sample_rollouts(rollout_data: dict[str, Any], reducer: Any) -> None:
    """Raise :data:`MULTI_SAMPLE` where, on any rank, a sample with valid tokens has ``rollout_mask_sums`` above the
    sum of its own loss mask (one all-reduce MAX of one number, taken on every rank whatever the data)."""
    masks = list(rollout_data.get("loss_masks") or [])
    sums = rollout_data.get("rollout_mask_sums")
    device = masks[0].device if masks else torch.device("cpu")
    split = torch.zeros(1, dtype=torch.float64, device=device)
    if sums is not None and masks:
        own = torch.stack([m.double().sum() for m in masks])
        split[0] = ((mask_sums(sums, len(masks), device).double() > own) & (own > 0)).any().double()
    if float(reducer.batch_max(split)[0]) > 0:  # host-sync-ok (rollout-data hook, before training)
        raise ValueError(MULTI_SAMPLE)
