"""slime ``--custom-tis-function-path slime_tis.slime.compute_tis_for_slime``.

slime calls it per micro-batch inside ``policy_loss_function`` (``--use-tis`` or ``--get-mismatch-metrics``) as
``fn(args, pg_loss=, train_log_probs=, rollout_log_probs=, loss_masks=, total_lengths=, response_lengths=)``:
``pg_loss`` ``[T_local]`` flat CP-local (PPO-clipped), log-probs per-sample CP-local ``[T_i]`` (``train``: pi_old,
or the detached current log-probs), ``loss_masks`` per-sample full-length ``[R_i]``. It returns ``(pg_loss, masks,
metrics)``: ``w * pg_loss`` (algorithm 2; ``pg_loss`` for 1), 0 at rejected tokens, by selection; full-length masks
with the rejected tokens zeroed (slime still divides by the original counts); token-shaped ``tis/`` metrics.
Algorithm 0 returns its inputs and the metrics. Tokens slime's OPSM zeroed count as rejected but stay in the masks
(:mod:`slime_tis.slime.opsm`); ``drop`` rescales each rollout by ``N_g / K_g`` (:mod:`slime_tis.slime.kept`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from slime_tis.core.algorithms import algorithm_of
from slime_tis.engine.parallel import parallel_context
from slime_tis.engine.totals import step_batch_norm
from slime_tis.slime.batch import pack_slime_batch
from slime_tis.slime.config import slime_view
from slime_tis.slime.kept import check_drop_config, drop_applies
from slime_tis.slime.loss_hook import check_slime_terms
from slime_tis.slime.metrics import token_metrics
from slime_tis.slime.opsm import check_opsm, opsm_rejected, registered_advantages
from slime_tis.slime.state import STATE

__all__ = ["compute_tis_for_slime"]


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
    check_drop_config(view, checked=STATE.drop_checked)
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
    factor = STATE.batch_norm_factor if step_batch_norm(cfg) else None
    if step_batch_norm(cfg) and (factor is None or STATE.batch_norm_key != cfg):
        raise RuntimeError("tis_batch_normalize with --use-tis (algorithm 2) normalises over the whole global batch, "
                           "which the per-micro-batch TIS hook cannot see: add --rollout-data-postprocess-path "
                           "slime_tis.slime.postprocess_rollout_data")
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
