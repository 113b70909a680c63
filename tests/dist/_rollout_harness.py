"""Several optimizer steps on one rollout through the megatron hook, against a hand computation of PPO.

The rollout is the harness's 8-row global batch with clean rollout log-probs (no NaN / veto traps), split
into 2 optimizer steps of 4 rows (slime's ``--num-steps-per-rollout 2``); each step has ``M`` micro-batches
per DP rank. pi_old is computed once, at the initial weights ``W0``, for the whole rollout
(``compute_old_log_probs``) before the first step. Between the steps every rank applies the same SGD update
``W1 = W0 - lr * g1`` with the *reference* step-1 gradient ``g1`` (its own shard), so the hook and the hand
computation train step 2 from identical weights and the clip is active there (``rho != 1``).

Hand computation (no plugin code, plain autograd on the TP=PP=CP=1 model over the step's global rows):

    rho_t  = exp(lp_theta_t - lp_old_t)                    lp_old = log-probs at W0 (fixed for the rollout)
    ppo_t  = -min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t)
    alg 0: loss = sum_{valid t} ppo_t / #valid             (token-mean over the step's global valid tokens)
    alg 2: loss = sum_{valid t} w_t ppo_t / #valid,  w_t = min(exp(lp_old_t - lp_rollout_t), upper)

The "supplied" variant gives the hook caller-supplied ``old_log_probs = lp(W0) - 0.5`` in one step at W0
(default ``pi_old="auto"``): they must be used exactly as given (the issue's measured example: clip
fraction ~0.5 instead of 0).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from _harness import (
    GLOBAL_ROWS,
    SEQ,
    TEMPERATURE,
    GlobalBatch,
    Layout,
    build_ddp_chunks,
    build_model,
    forward_step,
    full_forward,
    grad_errors,
    logged_by_megatron_lm,
    make_global_batch,
    make_items,
    naive_log_probs,
    row_assignment,
    tp_shard,
)
from _plans import CASES, LAYOUTS
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from slime_tis import TISConfig
from slime_tis.megatron import rollout_step_iterator, tis_forward_backward_func

STEPS = 2
ROWS_PER_STEP = GLOBAL_ROWS // STEPS
LR = 4.0  # SGD step on the reference gradient: large enough that the clip acts in step 2


def clean_batch(lp_full: torch.Tensor) -> GlobalBatch:
    batch = make_global_batch(lp_full)
    noise = torch.randn(GLOBAL_ROWS, SEQ, generator=torch.Generator().manual_seed(11))
    batch.rollout = lp_full + 0.3 * noise
    return batch


def hand_ppo_loss(cfg: TISConfig, lp: torch.Tensor, lp_old: torch.Tensor, lp_rollout: torch.Tensor,
                  adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    valid = mask != 0
    a = torch.where(valid, adv, torch.zeros_like(adv))
    rho = torch.exp(lp - lp_old)
    ppo = -torch.minimum(rho * a, rho.clamp(1 - cfg.eps_clip, 1 + cfg.eps_clip) * a)
    if cfg.algorithm == 2:
        ppo = torch.exp(lp_old - lp_rollout).clamp(max=cfg.upper) * ppo
    elif cfg.algorithm != 0:
        raise ValueError("the hand computation covers algorithms 0 and 2")
    return torch.where(valid, ppo, torch.zeros_like(ppo)).sum() / valid.sum()


def clip_fraction(cfg: TISConfig, lp: torch.Tensor, lp_old: torch.Tensor, adv: torch.Tensor,
                  mask: torch.Tensor) -> float:
    """Fraction of valid tokens where the clipped term is the one PPO's min selects (it bounds the update):
    A > 0 and rho > 1 + eps, or A < 0 and rho < 1 - eps."""
    valid = mask != 0
    rho, a = torch.exp(lp - lp_old)[valid], adv[valid]
    active = ((a > 0) & (rho > 1 + cfg.eps_clip)) | ((a < 0) & (rho < 1 - cfg.eps_clip))
    return float(active.float().mean())


def hand_reference(cfg: TISConfig, weights: dict, batch: GlobalBatch, *, supplied_shift: float | None = None):
    """Per step: loss, full gradients, clip fraction; and the weights after step 1's update."""
    model = build_model(Layout(), pre=True, post=True)
    model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        lp_old = naive_log_probs(full_forward(model, batch.tokens), batch.labels)
    if supplied_shift is not None:
        lp_old = lp_old + supplied_shift
    steps = []
    n_steps = 1 if supplied_shift is not None else STEPS
    for s in range(n_steps):
        rows = torch.arange(s * ROWS_PER_STEP, (s + 1) * ROWS_PER_STEP) if supplied_shift is None else \
            torch.arange(GLOBAL_ROWS)
        model.zero_grad()
        lp = naive_log_probs(full_forward(model, batch.tokens[rows]), batch.labels[rows])
        loss = hand_ppo_loss(cfg, lp, lp_old[rows], batch.rollout[rows], batch.advantages[rows],
                             batch.loss_mask[rows])
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        steps.append({"loss": float(loss.detach()), "grads": grads,
                      "clipfrac": clip_fraction(cfg, lp.detach(), lp_old[rows], batch.advantages[rows],
                                                  batch.loss_mask[rows])})
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in grads:
                    p.sub_(LR * grads[n])
    return lp_old, steps


def run_rollout_case(layout_name: str, case_name: str, num_microbatches: int, *, weights: dict,
                     lp_full: torch.Tensor, ref, supplied: bool = False, per_step_control: bool = False) -> dict:
    """Two optimizer steps on one rollout (or one step with supplied pi_old); this rank's errors per step.

    ``per_step_control``: no rollout pass (the hook takes pi_old at each step's own parameters), which
    must disagree with the hand computation in step 2 (rho = 1 there, no clip)."""
    layout = LAYOUTS[layout_name]
    cfg = TISConfig(**CASES[case_name])
    batch = clean_batch(lp_full)
    lp_old_ref, ref_steps = ref
    dp = layout.dp(dist.get_world_size())
    dp_rank = ps.get_data_parallel_rank()
    ddps, params = build_ddp_chunks(layout, weights)
    fb = tis_forward_backward_func(get_forward_backward_func(), cfg, temperature=TEMPERATURE, chunk_size=5)
    if supplied:
        rows = row_assignment(dp, dp_rank, num_microbatches)
        items = make_items(batch, rows)
        for it, rws in zip(items, rows):
            it["tis"].old_log_probs = lp_old_ref[torch.tensor(rws)].reshape(-1).clone()
        given = [it["tis"].old_log_probs.clone() for it in items]
        step_iters = [iter(items)]
        mbs = len(rows[0])
    else:
        items = []
        for s in range(STEPS):  # the rollout's items in step order, this DP rank's share of each step
            rows = step_rows(dp, dp_rank, num_microbatches, s)
            items += make_items(batch, rows)
        mbs = len(rows[0])
        if not per_step_control:
            items = fb.compute_old_log_probs(forward_step_func=forward_step, data_iterator=iter(items), model=ddps,
                                             num_microbatches=num_microbatches, num_steps=STEPS,
                                             seq_length=SEQ, micro_batch_size=mbs)
        given = [it["tis"].old_log_probs.clone() if it["tis"].old_log_probs is not None else None for it in items]
        step_iters = [rollout_step_iterator(items, s, num_microbatches) for s in range(STEPS)]
    result = {"layout": layout_name, "case": case_name, "M": num_microbatches, "rank": dist.get_rank(),
              "last_stage": ps.is_pipeline_last_stage(), "steps": []}
    for s, it in enumerate(step_iters):
        for d in ddps:
            d.zero_grad_buffer()
        out = fb(forward_step_func=forward_step, data_iterator=it, model=ddps, num_microbatches=num_microbatches,
                 seq_length=SEQ, micro_batch_size=mbs, forward_only=False)
        step = {"recomputed": fb.last_recomputed, **grad_errors(params, ref_steps[s]["grads"]),
                "oracle_loss": ref_steps[s]["loss"], "oracle_clipfrac": ref_steps[s]["clipfrac"]}
        if ps.is_pipeline_last_stage():
            logged = logged_by_megatron_lm(out)
            step.update(loss=float(fb.last_metrics["loss"]), logged_loss=logged["loss"],
                        clipfrac=float(fb.last_metrics["policy/clipfrac"]),
                        logged_clipfrac=logged["policy/clipfrac"])
        result["steps"].append(step)
        if s + 1 < len(step_iters):  # the same SGD update everywhere, from the reference gradient
            with torch.no_grad():
                for _, p, gname in params:
                    p.sub_(LR * tp_shard(p, ref_steps[s]["grads"][gname]))
    if ps.is_pipeline_last_stage():
        now = [it["tis"].old_log_probs for it in items]
        result["pi_old_unchanged"] = all((a is None and b is None) or (a is not None and b is not None
                                                                       and torch.equal(a, b))
                                         for a, b in zip(given, now))
        result["pi_old_present"] = all(b is not None for b in now)
    return result


def step_rows(dp: int, dp_rank: int, num_microbatches: int, step: int) -> list[list[int]]:
    """Rows of each of this DP rank's micro-batches in optimizer step ``step`` (4 consecutive rows per step)."""
    mbs = ROWS_PER_STEP // (dp * num_microbatches)
    return [[step * ROWS_PER_STEP + (k * dp + dp_rank) * mbs + j for j in range(mbs)]
            for k in range(num_microbatches)]
