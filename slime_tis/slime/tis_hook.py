"""slime ``--custom-tis-function-path slime_tis.slime.compute_tis_for_slime``.

slime calls it once per micro-batch inside ``policy_loss_function`` (with ``--use-tis`` or
``--get-mismatch-metrics``)::

    pg_loss, masks, metrics = fn(args, pg_loss=..., train_log_probs=..., rollout_log_probs=...,
                                 loss_masks=..., total_lengths=..., response_lengths=...)

``pg_loss``: ``[T_local]`` flat CP-local per-token PPO loss (already clipped); ``train_log_probs`` /
``rollout_log_probs``: per-sample CP-local ``[T_i]`` (zigzag chunks; ``train`` = pi_old, or the detached current
log-probs where slime skipped the recompute); ``loss_masks``: per-sample full-length ``[R_i]``. It returns the new
flat ``pg_loss`` (``w * pg_loss`` for algorithm 2; 0 at rejected tokens, by selection), full-length masks with the
rejected tokens zeroed (slime's reducer divides by the original counts) and flat CP-local token-shaped metrics
(:func:`slime_tis.slime.metrics.token_metrics`). Algorithm 0 (``--get-mismatch-metrics`` only): metrics only;
algorithm 1 (``--use-rollout-logprobs``): rejection only; algorithm 2 (``--use-tis``): weights and rejection.

The numbers are the step engine's correction of the packed CP-local tokens (``StepEngine.correct``, the CP
reducer: one CP all-reduce for the sums, one for the full-length masks, every CP rank for every sample). Tokens
slime's ``--use-opsm`` zeroed are counted as rejected in the metrics and ``drop``'s counts, their loss stays 0, and
the returned masks keep them unless a rule rejects them (slime's entropy / KL / reducer masks, as with slime's own
OPSM; :mod:`slime_tis.slime.opsm`). ``drop`` scales each rollout's
loss by ``N_g / K_g`` (:mod:`slime_tis.slime.kept`); algorithm 2's batch normalisation uses the rollout's factor
(:mod:`slime_tis.slime.postprocess`). slime's loss computes the surrogate and the KL / entropy terms itself:
``tis_loss_mode`` other than ``ppo_clip`` and the ``tis_kl_coef`` / ``tis_entropy_coef`` keys are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from slime_tis.config import TISConfig
from slime_tis.core.algorithms import algorithm_of
from slime_tis.engine.parallel import parallel_context
from slime_tis.engine.totals import step_batch_norm
from slime_tis.slime.batch import pack_slime_batch
from slime_tis.slime.config import slime_view
from slime_tis.slime.kept import NEEDS_HOOK, check_drop_config, drop_applies
from slime_tis.slime.loss_hook import check_slime_terms
from slime_tis.slime.metrics import token_metrics
from slime_tis.slime.opsm import check_opsm, opsm_rejected, registered_advantages
from slime_tis.slime.state import STATE

__all__ = ["compute_tis_for_slime"]


def _batch_norm_factor(cfg: TISConfig) -> Tensor | None:
    if not step_batch_norm(cfg):
        return None
    if STATE.batch_norm_factor is None or STATE.batch_norm_key != cfg:
        raise RuntimeError(
            "tis_batch_normalize with --use-tis (algorithm 2) normalises over the whole global batch, "
            "which the per-micro-batch TIS hook cannot see: add "
            "--rollout-data-postprocess-path slime_tis.slime.postprocess_rollout_data"
        )
    return STATE.batch_norm_factor


def compute_tis_for_slime(
    args: Any,
    *,
    pg_loss: Tensor,
    train_log_probs: Sequence[Tensor],
    rollout_log_probs: Sequence[Tensor],
    loss_masks: Sequence[Tensor],
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    **kwargs: Any,
) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
    """slime's TIS-function contract (module docstring); returns ``(pg_loss, masks, metrics)``."""
    view = slime_view(args, algorithm=None)
    cfg = view.cfg
    row = algorithm_of(cfg)
    if not row.ppo:
        raise ValueError(
            "use_tis and use_rollout_logprobs are both set (algorithm 3, REINFORCE + IS): slime's PPO loss "
            "cannot express it; use --loss-type custom_loss --custom-loss-function-path "
            "slime_tis.slime.reinforce_is_loss (see docs/slime.md)"
        )
    check_slime_terms(cfg, own_loss=True)
    check_drop_config(view)
    if drop_applies(cfg) and not STATE.drop_checked:
        raise ValueError(NEEDS_HOOK)
    check_opsm(view)
    ctx = parallel_context()
    packed = pack_slime_batch(loss_masks, total_lengths, response_lengths, ctx.cp_rank, ctx.cp_size)
    lp_train = packed.cat_local("train_log_probs", train_log_probs)
    lp_rollout = packed.cat_local("rollout_log_probs", rollout_log_probs)
    if pg_loss.dim() != 1 or pg_loss.shape[0] != lp_train.shape[0]:
        raise ValueError(
            f"pg_loss has shape {tuple(pg_loss.shape)} but the CP-local log-probs have {lp_train.shape[0]} "
            "tokens; slime passes a flat CP-local per-token loss"
        )
    factor = _batch_norm_factor(cfg)
    opsm = None
    if view.use_opsm:  # tokens slime's OPSM zeroed are not kept
        adv = registered_advantages(STATE.advantages, loss_masks, packed.cat_local)
        opsm = opsm_rejected(pg_loss, adv.to(pg_loss.device), packed.local_mask)
    # pg_loss stands in for the advantages and lp_theta: a non-finite value at a valid token rejects its sequence
    batch = packed.tis_batch(advantages=pg_loss.detach(), rollout_log_probs=lp_rollout, old_log_probs=lp_train)
    engine = STATE.engine(cfg, ctx.reducer, pg_loss.device, batch_norm_factor=factor)
    res = engine.correct(batch, lp_train, reject=opsm)
    metrics = token_metrics(cfg, res, factor if cfg.batch_normalize else None)
    if rollout_log_probs:
        STATE.collector.add(res.stats, list(rollout_log_probs), ctx.reducer, engine)  # engine.record, once

    if not row.corrects:  # algorithm 0, --get-mismatch-metrics without correction: diagnostics only
        return pg_loss, list(loss_masks), metrics

    keep = res.loss_keep
    zero = torch.zeros((), dtype=pg_loss.dtype, device=pg_loss.device)
    new_loss = pg_loss * res.weights.to(pg_loss.dtype) if row.weighted else pg_loss
    masks = packed.full_keep_masks(keep, ctx.reducer)
    if drop_applies(cfg):  # slime divides by N_g = n_i (kept.py): rescale each sample by n_i / K_g
        scale = packed.counts() / packed.counts(masks).clamp(min=1.0)
        new_loss = new_loss * scale[packed.local_sample_index()].to(pg_loss.dtype)
    new_loss = torch.where(keep, new_loss, zero)
    if opsm is not None:  # OPSM's tokens stay in slime's entropy, KL and reducer masks, as with slime's own OPSM
        masks = packed.full_keep_masks(keep | (opsm & engine.correct(batch, lp_train).loss_keep), ctx.reducer)
    return new_loss, masks, metrics
