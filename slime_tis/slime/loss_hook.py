"""slime ``--loss-type custom_loss --custom-loss-function-path slime_tis.slime.reinforce_is_loss`` (algorithm 3).

``fn(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)``, ``logits`` ``[1, T_pad, V/TP]`` of the packed
micro-batch: ``loss_t = -w_t A_t lp_theta_t``, ``w = sg(pi_theta / pi_rollout)`` at the configured level and mode,
``lp_theta`` from ``logits / --rollout-temperature`` at the rows of slime's CP layout (:mod:`slime_tis.slime.layout`,
:mod:`slime_tis.slime.allgather_cp`). slime's aggregation as per-sample coefficients on the advantages and one
token sum: ``1 / N_g`` (``rollout_mask_sums``, else the sample's own count), ``1 / K_g`` with ``drop``, or the
token sum with ``--calculate-per-token-loss``. slime's entropy and KL terms over kept tokens; ``--use-opsm``,
``--use-unbiased-kl`` and a custom pg-loss reducer as slime applies them (:mod:`slime_tis.slime.custom_options`).
Refused: ``--rollout-top-p < 1``, the ``tis_kl_coef`` / ``tis_entropy_coef`` keys (docs/slime.md).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from slime_tis.core.terms import KL_ESTIMATORS, kl_estimate
from slime_tis.engine.parallel import parallel_context
from slime_tis.slime.allgather_cp import allgather_response_rows, to_zigzag
from slime_tis.slime.batch import mask_sums, pack_slime_batch
from slime_tis.slime.config import slime_view
from slime_tis.slime.custom_options import (
    opsm_mask,
    per_token_pg_loss,
    slime_anchor,
    slime_pg_loss_reducer,
    unbiased_kl,
)
from slime_tis.slime.kept import check_drop_config, drop_applies
from slime_tis.slime.layout import response_logit_rows
from slime_tis.slime.metrics import token_metrics
from slime_tis.slime.state import STATE

__all__ = ["check_slime_terms", "reinforce_is_loss"]

logger = logging.getLogger("slime_tis.slime")


def check_slime_terms(cfg: Any, *, own_loss: bool) -> None:
    """In slime the KL and entropy terms are slime's own flags; ``own_loss``: slime's policy loss computes the
    surrogate (PPO clip, or its ``--advantage-estimator gspo``), so ``tis_loss_mode`` cannot choose another."""
    for field, theirs in (("kl_coef", "--use-kl-loss --kl-loss-coef --kl-loss-type"), ("entropy_coef",
                                                                                       "--entropy-coef")):
        if getattr(cfg, field) != 0.0:
            raise ValueError(f"tis_{field} = {getattr(cfg, field)!r}: in slime this term is slime's own ({theirs}); "
                             "remove the tis_ key")
    if own_loss and cfg.loss_mode not in (None, "ppo_clip"):
        raise ValueError(f"tis_loss_mode = {cfg.loss_mode!r}: slime's own policy loss computes the surrogate "
                         "(PPO clip; GSPO with --advantage-estimator gspo) and the TIS function only weights and "
                         "rejects it; for reinforce / on_policy use the custom loss slime_tis.slime.reinforce_is_loss")


def reinforce_is_loss(
    args: Any,
    batch: dict[str, Any],
    logits: Tensor,
    sum_of_sample_mean: Callable[[Tensor], Tensor],
) -> tuple[Tensor, dict[str, Tensor]]:
    """slime custom loss for algorithm 3 (module docstring). Returns ``(loss, metrics)``."""
    view = slime_view(args, algorithm=3)
    cfg = view.cfg
    check_slime_terms(cfg, own_loss=False)
    if view.rollout_top_p < 1.0:
        raise ValueError(
            f"--rollout-top-p = {view.rollout_top_p}: top-p replay is not supported by reinforce_is_loss; use "
            "slime's policy loss with the TIS hook (--use-tis --custom-tis-function-path "
            "slime_tis.slime.compute_tis_for_slime), which supports it, or sample with --rollout-top-p 1"
        )
    check_drop_config(view, checked=STATE.drop_checked)
    if batch.get("rollout_log_probs") is None:
        raise ValueError("reinforce_is_loss needs batch['rollout_log_probs'] (SGLang log-probs of the responses)")
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"logits must be slime's packed [1, T, V/TP], got shape {tuple(logits.shape)}")
    if not view.use_rollout_logprobs:
        STATE.warn_once("recompute", "slime_tis.slime.reinforce_is_loss (algorithm 3) does not use pi_old: add "
                        "--use-rollout-logprobs (in place of --use-tis, which slime does not accept with it) so that "
                        "slime skips the old-log-prob recompute", logger)
    drop = drop_applies(cfg)

    ctx = parallel_context()
    allgather = ctx.cp_size > 1 and bool(view.allgather_cp)
    total, resp = batch["total_lengths"], batch["response_lengths"]
    packed = pack_slime_batch(batch["loss_masks"], total, resp, ctx.cp_rank, ctx.cp_size)
    device = logits.device
    if allgather:  # slime's contiguous chunks of the concatenated micro-batch (slime_tis.slime.allgather_cp)
        rows, tok, resp_pos = allgather_response_rows(total, resp, ctx.cp_rank, int(logits.shape[1]), device=device)
    else:
        rows, tok = response_logit_rows(total, resp, ctx.cp_rank, ctx.cp_size, device=device)
    targets = torch.cat(list(batch["unconcat_tokens"])).to(device)[tok]
    entropy_coef = view.entropy
    from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy  # lazy: torch.distributed only

    lp_theta, entropy = vocab_parallel_log_probs_and_entropy(
        logits[0][rows], targets, temperature=view.temperature,
        chunk_size=view.chunk_size or max(int(rows.shape[0]), 1),  # slime: -1 = no chunking
        with_entropy=entropy_coef != 0.0, kernels=cfg.kernels)
    if allgather:  # back to the zigzag layout of everything else slime hands the loss
        cp_group = getattr(ctx.reducer, "cp_group", None)
        n_full = int(packed.full_mask.shape[0])
        lp_theta = to_zigzag(lp_theta, resp_pos, n_full, packed.index, cp_group)
        if entropy is not None:
            entropy = to_zigzag(entropy, resp_pos, n_full, packed.index, cp_group)
    if view.recording or view.save_debug_train_data:  # device copies; written later
        STATE.recorder.record(batch, lp_theta.detach().split(packed.local_lengths.tolist()))  # host-sync-ok (CPU)
    lp_rollout = packed.cat_local("rollout_log_probs", batch["rollout_log_probs"]).to(device)
    advantages = packed.cat_local("advantages", batch["advantages"]).to(device)
    # slime's aggregation as per-sample coefficients on the (linear) advantages, then one token sum (the engine's
    # totals: denominator 1, SlimeState.engine)
    use_kl = bool(view.use_kl_loss)
    ref = packed.cat_local("ref_log_probs", batch["ref_log_probs"]).to(device) if use_kl else None
    # a KL term in the loss: its reference log-probs are checked like advantages
    engine = STATE.engine(cfg.replace(loss_agg="token-mean", rejected_denominator="keep"), ctx.reducer, device,
                          host_kl=view.host_kl)
    batch_in = packed.tis_batch(advantages=advantages, rollout_log_probs=lp_rollout, ref_log_probs=ref)
    decided = None
    reduce_pg = view.custom_pg_loss_reducer_function_path
    if cfg.loss_agg == "seq-mean-token-mean":
        if drop:  # K_g: the sample's kept tokens (kept.py), from the correction the loss then applies (the
            # coefficients are finite, so the advantages' finiteness it reads is the same after them)
            decided = engine.correct(batch_in, lp_theta)
            coef = 1.0 / packed.counts(packed.full_keep_masks(decided.loss_keep, ctx.reducer)).clamp(min=1.0)
        else:  # N_g: slime's rollout_mask_sums (a whole rollout's valid tokens), else the sample's own count
            sums = batch.get("rollout_mask_sums")
            n_g = packed.counts() if sums is None else mask_sums(sums, len(resp), packed.full_mask.device)
            coef = 1.0 / n_g.clamp(min=1.0)
        if reduce_pg is None:  # a custom pg-loss reducer chooses its own denominators
            advantages = advantages * coef[packed.local_sample_index()]
    use_opsm = bool(view.use_opsm)
    use_unbiased = use_kl and bool(view.use_unbiased_kl)
    anchor = slime_anchor(view, batch, packed, lp_theta) if use_opsm or use_unbiased else None
    if use_opsm:  # slime's own mask on the policy term only (the loss is linear in the advantages)
        opsm, opsm_clipfrac = opsm_mask(args, batch, packed, lp_theta, anchor, advantages, ctx.reducer)
        advantages = advantages * opsm

    out = engine.loss(dataclasses.replace(batch_in, advantages=advantages), lp_theta, correction=decided)
    keep = out.keep_mask
    zero = torch.zeros((), dtype=torch.float32, device=device)
    pg_loss = out.loss
    if reduce_pg is not None:  # slime's reducer contract: full-length masks with the rejected tokens zeroed
        reducer_fn = slime_pg_loss_reducer(view, batch, packed.full_keep_masks(keep, ctx.reducer))
        pg_loss = reducer_fn(per_token_pg_loss(cfg, lp_theta, advantages, out.weights, keep, packed.cu_seqlens,
                                               ctx.reducer))
    loss = pg_loss
    metrics: dict[str, Tensor] = {"pg_loss": pg_loss.detach().clone()}
    if entropy_coef != 0.0:
        entropy_loss = sum_of_sample_mean(torch.where(keep, entropy, zero))
        loss = loss - entropy_coef * entropy_loss
        metrics["entropy_loss"] = entropy_loss.detach().clone()
    if use_kl:
        kl_coef, kind = view.kl, view.kl_loss_type
        if kind not in KL_ESTIMATORS:
            raise ValueError(f"--kl-loss-type = {kind!r}: must be one of {', '.join(KL_ESTIMATORS)}")
        # inputs selected first: with the term in the loss the kept tokens' are finite (the correction rejected the
        # sequences of any non-finite reference log-prob), elsewhere every estimator reads d = 0, so no NaN reaches
        # the loss or a gradient; at --kl-loss-coef 0 (a metric only, detached) non-finite values stay out of it
        theta_k = torch.where(keep, lp_theta if kl_coef != 0.0 else lp_theta.detach(), zero)
        ref_k = torch.where(keep, ref.detach().float(), zero)
        if use_unbiased:
            kl = unbiased_kl(theta_k, ref_k, torch.where(keep, anchor, zero), kind)
        else:
            kl = kl_estimate(theta_k, ref_k, kind)
        kl_loss = sum_of_sample_mean(torch.where(keep & torch.isfinite(kl), kl, zero))
        if kl_coef != 0.0:
            loss = loss + kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach().clone()
    if lp_theta.numel() == 0 or allgather:  # keep every parameter in the graph (slime does the same)
        loss = loss + 0.0 * logits.sum()
    metrics["loss"] = loss.detach().clone()
    if use_opsm:
        metrics["opsm_clipfrac"] = opsm_clipfrac.detach()

    assert out.tis is not None  # algorithm 3 always has rollout log-probs
    tm = token_metrics(cfg, out.tis, None)
    tm["ppo_kl"] = tm["tis/kl"]  # lp_rollout - sg(lp_theta): the anchor is pi_rollout in algorithm 3
    valid_ok = out.tis.ratios.token_ok
    tm["train_rollout_logprob_abs_diff"] = torch.where(valid_ok, (lp_theta.detach() - lp_rollout).abs(), zero)
    for name, value in tm.items():
        metrics[name] = sum_of_sample_mean(value).detach()
    STATE.collector.add(out.stats, list(batch["rollout_log_probs"]), ctx.reducer, engine)  # engine.record, once
    return loss, metrics
