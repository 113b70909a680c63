"""One slime rollout, trained the way slime 624b824 trains it, around the plugin's hooks (test harness).

Re-stated in our own words from THUDM/slime 624b824 (no slime code is imported or copied):

* the rollout batch: agentic rollouts of several samples, ``rollout_ids`` and ``rollout_mask_sums`` (every
  sample carries the loss-mask total of its whole rollout) as ``RolloutManager._convert_samples_to_train_data``
  (``slime/ray/rollout.py``) builds them;
* the schedule: ``tests/_slime_schedule.py`` (``build_dp_schedule``); each rank's ``rollout_data`` as
  ``_split_train_data_by_dp`` + ``process_rollout_data`` (``slime/utils/data.py``) + the actor's
  ``_get_rollout_data`` build it: lists over the rank's samples (``partition`` order), ``total_lengths`` of
  the rank, ``raw_reward`` of the whole batch, log-probs CP-local, ``num_microbatches``,
  ``micro_batch_indices``, ``global_batch_sizes``;
* ``train_actor`` (``slime/backends/megatron_utils/actor.py``): the pi_old recompute (when slime runs it), the
  rollout-data hook, then per step the before-train-step hook and the step's micro-batches, each handed to
  the loss as lists of the *same* tensor objects (``DataIterator.get_next``);
* the loss: the custom loss (``--loss-type custom_loss``), or ``policy_loss_function``
  (``slime/backends/megatron_utils/loss.py``): PPO term of ``compute_policy_loss``, OPSM's mask
  (``compute_opsm_mask``, ``slime/utils/ppo_utils.py``) multiplied into it, the TIS function, then the reducer
  rebuilt with the returned masks and ``rollout_mask_sums`` (the policy term's, or
  ``--custom-pg-loss-reducer-function-path``'s with those masks) and, over the rebuilt reducer, the entropy term
  (``--entropy-coef``) and the KL term (``compute_approx_kl``, ``--use-kl-loss``, ``--use-unbiased-kl``);
  each micro-batch's loss enters the step as ``loss / step_global_batch_size`` per DP x CP rank.

The model is linear: the logits of sample ``i`` are ``X_i @ W`` with fixed features ``X_i`` and one shared
parameter ``W``, so an optimizer step moves the log-probs of every sample (as a real model's step does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from _slime_oracle import owner_layout
from _slime_schedule import build_dp_schedule
from torch import Tensor

VOCAB = 12
FEATURES = 6
TEMP = 0.8


@dataclass
class Rollouts:
    """The whole rollout batch (full-length, CPU)."""

    prompt_lengths: list[int]
    response_lengths: list[int]
    tokens: list[Tensor]
    masks: list[Tensor]
    rollout_lp: list[Tensor]
    advantages: list[Tensor]
    rollout_ids: list[int]
    features: list[Tensor]
    pi_old_full: dict[int, Tensor] = field(default_factory=dict)  # full-length pi_old, once recomputed
    ref_lp: list[Tensor] = field(default_factory=list)  # the reference model's log-probs (slime's ref_log_probs)

    @property
    def total_lengths(self) -> list[int]:
        return [p + r for p, r in zip(self.prompt_lengths, self.response_lengths)]

    def mask_sums(self) -> list[float]:
        tot: dict[int, float] = {}
        for rid, m in zip(self.rollout_ids, self.masks):
            tot[rid] = tot.get(rid, 0.0) + float(m.sum())
        return [tot[rid] for rid in self.rollout_ids]


def response_log_probs(ro: Rollouts, w: Tensor, i: int) -> Tensor:
    """``[R_i]`` log pi_W of sample ``i``'s response tokens (differentiable in ``w``)."""
    p, r = ro.prompt_lengths[i], ro.response_lengths[i]
    logits = ro.features[i] @ w / TEMP
    return torch.log_softmax(logits[p - 1:p - 1 + r], -1).gather(-1, ro.tokens[i][p:, None]).squeeze(-1)


def response_entropy(ro: Rollouts, w: Tensor, i: int) -> Tensor:
    """``[R_i]`` entropy ``-sum_v p_v log p_v`` of pi_W at sample ``i``'s response positions (differentiable)."""
    p, r = ro.prompt_lengths[i], ro.response_lengths[i]
    logp = torch.log_softmax((ro.features[i] @ w / TEMP)[p - 1:p - 1 + r], -1)
    return -(logp.exp() * logp).sum(-1)


def make_rollouts(seed: int, sizes: list[int], w0: Tensor, *, spread: float = 0.35, nan_trap: bool = True) -> Rollouts:
    """Rollouts of ``sizes[g]`` samples each (ids 10 g + 7, shuffled in the batch), rollout log-probs =
    the policy at ``w0`` plus noise; traps: tool tokens (mask 0), one catastrophic token (ratio e^-9, for the
    veto), negative advantages and, with ``nan_trap``, NaN rollout log-probs at the tool tokens and at one
    valid token (which rejects its sample). Algorithm 1's anchor is the rollout log-prob, so there slime's own
    PPO term would turn such a NaN into NaN gradients: no NaN trap there (slime writes 0 at tool tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = [10 * k + 7 for k, n in enumerate(sizes) for _ in range(n)]
    perm = torch.randperm(len(ids), generator=g).tolist()
    ids = [ids[j] for j in perm]
    n = len(ids)
    prompts = torch.randint(2, 7, (n,), generator=g).tolist()
    resps = torch.randint(3, 12, (n,), generator=g).tolist()
    ro = Rollouts(prompts, resps, [], [], [], [], ids, [])
    for i, (p, r) in enumerate(zip(prompts, resps)):
        ro.tokens.append(torch.randint(0, VOCAB, (p + r,), generator=g))
        ro.features.append(torch.randn(p + r, FEATURES, generator=g))
        m = torch.ones(r)
        if r > 5 and i % 3 == 0:
            m[2:4] = 0  # tool tokens
        ro.masks.append(m)
        ro.advantages.append(torch.full((r,), float(torch.randn((), generator=g))))
    for i in range(n):
        lp = response_log_probs(ro, w0, i).detach()
        lr = lp + spread * torch.randn(lp.shape, generator=g)
        lr[ro.masks[i] == 0] = float("nan") if nan_trap else 0.0  # no rollout log-prob at tool tokens: ignored
        ro.rollout_lp.append(lr)
        ro.ref_lp.append(response_log_probs(ro, 0.7 * w0, i).detach())
    if nan_trap:
        ro.rollout_lp[n // 2][0] = float("nan") if ro.masks[n // 2][0] else ro.rollout_lp[n // 2][0]
    last = n - 1
    ro.rollout_lp[last][-1] = response_log_probs(ro, w0, last)[-1].detach() + 9.0  # catastrophic token
    return ro


def initial_weights(seed: int) -> Tensor:
    return torch.randn(FEATURES, VOCAB, generator=torch.Generator().manual_seed(seed)) * 0.7


# ----------------------------------------------------------------------------- slime's rank view
class DataIter:
    """slime's ``DataIterator``: the micro-batches of one rank, lists of the rank's own tensor objects."""

    def __init__(self, data: dict, micro_batch_indices: list[list[int]]) -> None:
        self.rollout_data, self.micro_batch_indices, self.offset = data, micro_batch_indices, 0

    def get_next(self, keys) -> dict:
        idx = self.micro_batch_indices[self.offset]
        self.offset += 1
        return {k: (None if self.rollout_data.get(k) is None else [self.rollout_data[k][i] for i in idx])
                for k in keys}

    def reset(self) -> DataIter:
        self.offset = 0
        return self


@dataclass
class Layout:
    dp_rank: int = 0
    dp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1


def local(x: Tensor, total: int, resp: int, lay: Layout) -> Tensor:
    idx = owner_layout(total, resp, lay.cp_size)[lay.cp_rank]
    return x[torch.tensor(idx, dtype=torch.long)] if idx else x[:0]


def rank_data(ro: Rollouts, sched, lay: Layout, *, raw_reward: bool = True, mask_sums: bool = True) -> dict:
    """This rank's ``rollout_data`` as the hooks receive it (module docstring)."""
    partitions, mbs, num_mb, gbs = sched
    part = partitions[lay.dp_rank]
    tot = ro.total_lengths
    data = {
        "partition": part,
        "tokens": [ro.tokens[j] for j in part],
        "response_lengths": [ro.response_lengths[j] for j in part],
        "total_lengths": [tot[j] for j in part],
        "loss_masks": [ro.masks[j].to(torch.int32) for j in part],
        "rollout_ids": [ro.rollout_ids[j] for j in part],
        "rollout_log_probs": [local(ro.rollout_lp[j], tot[j], ro.response_lengths[j], lay) for j in part],
        "advantages": [local(ro.advantages[j], tot[j], ro.response_lengths[j], lay) for j in part],
        "ref_log_probs": [local(ro.ref_lp[j], tot[j], ro.response_lengths[j], lay) for j in part],
        "num_microbatches": num_mb,
        "micro_batch_indices": mbs[lay.dp_rank],
        "global_batch_sizes": gbs,
    }
    if mask_sums:
        sums = ro.mask_sums()
        data["rollout_mask_sums"] = torch.tensor([sums[j] for j in part], dtype=torch.float32)
    if raw_reward:
        data["raw_reward"] = [0.0] * len(ro.masks)
    return data


def slime_recomputes_pi_old(args, n_steps: int) -> bool:
    """``train_actor``'s condition for the pi_old forward (``can_reuse_log_probs_in_loss`` spelled out)."""
    reuse = (n_steps == 1 and args.loss_type == "policy_loss" and not args.use_rollout_logprobs
             and not args.get_mismatch_metrics)
    return (not args.use_rollout_logprobs or args.get_mismatch_metrics) and not reuse


# ----------------------------------------------------------------------------- slime's loss pieces
def sum_of_sample_mean(batch: dict, masks: list[Tensor], lay: Layout):
    """``get_sum_of_sample_mean`` (per-rollout denominators ``rollout_mask_sums``), CP-local."""
    denoms = batch["rollout_mask_sums"]
    if denoms is None:
        denoms = [m.sum() for m in masks]

    def reduce(x: Tensor) -> Tensor:
        out, start = torch.zeros(()), 0
        for m, d, t, r in zip(masks, denoms, batch["total_lengths"], batch["response_lengths"]):
            ml = local(m.float(), t, r, lay)
            out = out + (x[start:start + ml.numel()] * ml).sum() / torch.as_tensor(d).float().clamp(min=1)
            start += ml.numel()
        return out
    return reduce


def ppo_term(ppo_kl: Tensor, adv: Tensor, args) -> Tensor:
    """``compute_policy_loss``: ``max(-r A, -clip(r) A)``, dual clip ``min(., -c A)`` where ``A < 0``."""
    ratio = torch.exp(-ppo_kl)
    eps_high = args.eps_clip_high if args.eps_clip_high is not None else args.eps_clip
    loss = torch.maximum(-ratio * adv, -ratio.clamp(1 - args.eps_clip, 1 + eps_high) * adv)
    if args.eps_clip_c is not None:
        loss = torch.where(adv < 0, torch.minimum(-args.eps_clip_c * adv, loss), loss)
    return loss


def opsm_keep(full_theta: list[Tensor], full_old: list[Tensor], adv_local: list[Tensor], masks: list[Tensor],
              delta: float) -> Tensor:
    """``compute_opsm_mask``'s ``1 - mask``: 0 where ``A < 0`` and the sequence's mean ``old - theta`` > delta."""
    out = []
    for th, old, a, m in zip(full_theta, full_old, adv_local, masks):
        m = m.float()
        seq_kl = ((old - th) * m).sum() / m.sum().clamp(min=1)
        out.append(1.0 - ((a < 0) & (seq_kl > delta)).float())
    return torch.cat(out) if out else torch.zeros(0)


def approx_kl(lp: Tensor, ref: Tensor, kind: str, ratio: Tensor | None) -> Tensor:
    """``compute_approx_kl``: k1 ``lp - ref``, k2 ``(lp - ref)^2 / 2``, k3 / low_var_kl ``e^d - 1 - d`` with
    ``d = ref - lp``; times ``ratio`` (``--use-unbiased-kl``); low_var_kl clamped to ``[-10, 10]``."""
    d = ref - lp
    kl = {"k1": -d, "k2": d * d / 2}.get(kind)
    kl = torch.exp(d) - 1 - d if kl is None else kl
    kl = kl if ratio is None else ratio * kl
    return kl.clamp(-10.0, 10.0) if kind == "low_var_kl" else kl


def policy_loss_function(args, batch: dict, ro: Rollouts, w: Tensor, lay: Layout, sample_pos: list[int]):
    """slime's ``policy_loss_function`` around its TIS function: ``args.tis_fn`` (a stand-in of slime's own, as
    the test writes it) or, by default, the plugin's ``compute_tis_for_slime``."""
    from slime_tis.slime import compute_tis_for_slime

    tot, resp = batch["total_lengths"], batch["response_lengths"]
    full_theta = [response_log_probs(ro, w, j) for j in sample_pos]
    theta = [local(x, t, r, lay) for x, t, r in zip(full_theta, tot, resp)]
    adv = torch.cat(batch["advantages"])
    old = batch["rollout_log_probs"] if args.use_rollout_logprobs else batch.get("log_probs")
    if not args.use_rollout_logprobs and not old:
        old = [x.detach() for x in theta]
    train_for_tis = batch.get("log_probs") or [x.detach() for x in theta]
    ppo_kl = torch.cat(old) - torch.cat(theta)
    pg_loss = ppo_term(ppo_kl, adv, args)
    if args.use_opsm:  # all_gather_with_cp of theta and of the anchor
        if args.use_rollout_logprobs:
            full_old = [ro.rollout_lp[j] for j in sample_pos]
        elif batch.get("log_probs"):
            full_old = [ro.pi_old_full[j] for j in sample_pos]
        else:
            full_old = [x.detach() for x in full_theta]
        pg_loss = pg_loss * opsm_keep([x.detach() for x in full_theta], full_old, batch["advantages"],
                                      batch["loss_masks"], args.opsm_delta)
    masks = batch["loss_masks"]
    if args.get_mismatch_metrics or args.use_tis:
        tis_fn = getattr(args, "tis_fn", None) or compute_tis_for_slime
        pg_loss, masks, _ = tis_fn(
            args, pg_loss=pg_loss, train_log_probs=train_for_tis, rollout_log_probs=batch["rollout_log_probs"],
            loss_masks=batch["loss_masks"], total_lengths=tot, response_lengths=resp)
    reducer = sum_of_sample_mean(batch, masks, lay)  # rebuilt with the returned masks: every term below uses it
    pg_reducer = reducer
    if args.custom_pg_loss_reducer_function_path is not None:
        pg_reducer = args.custom_reducer(tot, resp, masks, args.calculate_per_token_loss)
    loss = pg_reducer(pg_loss)
    if args.entropy_coef:
        ent = [local(response_entropy(ro, w, j), t, r, lay) for j, t, r in zip(sample_pos, tot, resp)]
        loss = loss - args.entropy_coef * reducer(torch.cat(ent))
    if args.use_kl_loss:
        lp = torch.cat(theta)
        ratio = torch.exp(lp - torch.cat(old)) if getattr(args, "use_unbiased_kl", False) else None
        loss = loss + args.kl_loss_coef * reducer(approx_kl(lp, torch.cat(batch["ref_log_probs"]),
                                                            args.kl_loss_type, ratio))
    return loss


def packed_logits(ro: Rollouts, w: Tensor, sample_pos: list[int], lay: Layout, pad: int = 3) -> Tensor:
    """slime's packed local logits ``[1, rows, V/TP]`` of a micro-batch (zigzag CP chunks, vocab shard)."""
    rows = []
    for j in sample_pos:
        lg = ro.features[j] @ w
        t = lg.shape[0]
        if lay.cp_size == 1:
            rows.append(lg)
            continue
        c = -(-t // (2 * lay.cp_size))
        padded = torch.cat([lg, torch.zeros(2 * lay.cp_size * c - t, VOCAB)])
        rows += [padded[k * c:(k + 1) * c] for k in (lay.cp_rank, 2 * lay.cp_size - 1 - lay.cp_rank)]
    out = torch.cat(rows + [torch.zeros(pad, VOCAB)])[None]
    shard = VOCAB // lay.tp_size
    return out[..., lay.tp_rank * shard:(lay.tp_rank + 1) * shard]


# ----------------------------------------------------------------------------- one rollout
@dataclass
class StepResult:
    loss: Tensor  # this rank's share of the step objective (sum over ranks = the step's loss)
    grad: Tensor  # its gradient with respect to W
    w: Tensor  # the parameters the step trained at
    positions: list[int] = field(default_factory=list)  # global sample positions of the step on this rank


def train_rollout(args, ro: Rollouts, w0: Tensor, sched, lay: Layout, *, lr: float = 0.5, all_reduce=None,
                  data_kw: dict | None = None) -> list[StepResult]:
    """Run one rollout through the hooks as slime's ``train_actor`` does (module docstring); ``all_reduce``
    sums a tensor over every rank (None: one process)."""
    import slime_tis.slime as plugin

    data = rank_data(ro, sched, lay, **(data_kw or {}))
    part = data["partition"]
    n_steps = len(data["num_microbatches"])
    if slime_recomputes_pi_old(args, n_steps):
        data["log_probs"] = [local(response_log_probs(ro, w0, j).detach(), t, r, lay)
                             for j, t, r in zip(part, data["total_lengths"], data["response_lengths"])]
        ro.pi_old_full = {j: response_log_probs(ro, w0, j).detach() for j in part}
    plugin.postprocess_rollout_data(args, 0, data)
    w = w0.clone()
    it = DataIter(data, data["micro_batch_indices"])
    keys = ["tokens", "total_lengths", "response_lengths", "loss_masks", "log_probs", "advantages",
            "rollout_log_probs", "rollout_mask_sums", "ref_log_probs"]
    results = []
    for s in range(n_steps):
        if args.custom_megatron_before_train_step_hook_path:
            plugin.before_train_step(args, 0, s, [None], None, None)
        w = w.clone().requires_grad_(True)
        total, positions = torch.zeros(()), []
        for _ in range(data["num_microbatches"][s]):
            idx = it.micro_batch_indices[it.offset]
            batch = it.get_next(keys)
            pos = [part[i] for i in idx]
            positions += pos
            if args.loss_type == "custom_loss":
                batch["unconcat_tokens"] = batch.pop("tokens")
                logits = packed_logits(ro, w, pos, lay)
                reducer = sum_of_sample_mean(batch, batch["loss_masks"], lay)
                loss, _ = plugin.reinforce_is_loss(args, batch, logits, reducer)
            else:
                loss = policy_loss_function(args, batch, ro, w, lay, pos)
            total = total + loss / data["global_batch_sizes"][s]
        (grad,) = torch.autograd.grad(total, w, allow_unused=True)
        grad = torch.zeros_like(w) if grad is None else grad
        results.append(StepResult(total.detach(), grad, w.detach().clone(), positions))
        g_all = grad.clone() if all_reduce is None else all_reduce(grad.clone())
        w = w.detach() - lr * g_all
    return results


def schedule(ro: Rollouts, *, steps: int, dp_size: int = 1, micro_batch_size: int | None = 1,
             max_tokens: int | None = None, cp_size: int = 1):
    n_rollouts = len(set(ro.rollout_ids))
    return build_dp_schedule(ro.total_lengths, ro.rollout_ids, global_batch_size=n_rollouts // steps,
                             dp_size=dp_size, micro_batch_size=None if max_tokens else micro_batch_size,
                             max_tokens_per_gpu=max_tokens, cp_size=cp_size)


def split_fraction(ro: Rollouts, sched) -> float:
    """Fraction of multi-sample rollouts whose samples the schedule puts in different micro-batches."""
    partitions, mbs, _, _ = sched
    where = {}
    for r, (part, rank_mbs) in enumerate(zip(partitions, mbs)):
        for k, mb in enumerate(rank_mbs):
            for i in mb:
                where[part[i]] = (r, k)
    multi = [g for g in set(ro.rollout_ids) if ro.rollout_ids.count(g) > 1]
    split = [g for g in multi if len({where[j] for j, rid in enumerate(ro.rollout_ids) if rid == g}) > 1]
    return len(split) / max(len(multi), 1)


def relative_error(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-12) if math.isfinite(got) else float("inf")


# ----------------------------------------------------------------------------- what the options define
def oracle_step(args, ro: Rollouts, w: Tensor, positions: list[int], gbs: int, w0: Tensor) -> Tensor:
    """The step's loss as the options define it, on whole sequences in one process (differentiable in ``w``)::

        (1 / gbs) sum over the step's rollouts g of  sum_{t in g, kept} loss_t / D_g

    ``D_g`` = valid tokens of ``g`` over all its samples (``keep``) or kept tokens (``drop``). Algorithm 3
    (custom loss): ``loss_t = -w_t A_t lp_t``, weights and keep decisions from ``sg(lp)`` at ``w``. TIS hook:
    ``loss_t = w_t ppo_term_t`` (``w_t = 1`` in algorithm 1) with decisions from ``pi_old`` (at ``w0``) when
    slime recomputed it, else from ``sg(lp)``; a token OPSM zeroes is not kept.
    """
    from slime_tis import compute_tis
    from slime_tis.slime import tis_config_from_slime_args

    custom = args.loss_type == "custom_loss"
    cfg = tis_config_from_slime_args(args, algorithm=3 if custom else None).replace(batch_normalize=False)
    pos = sorted(positions)
    lp_list = [response_log_probs(ro, w, j) for j in pos]
    lp = torch.cat(lp_list)
    rollout = torch.cat([ro.rollout_lp[j] for j in pos])
    mask = torch.cat([ro.masks[j] for j in pos])
    adv = torch.cat([ro.advantages[j] for j in pos])
    cu = torch.tensor([0, *torch.cumsum(torch.tensor([ro.response_lengths[j] for j in pos]), 0).tolist()])
    if custom:
        tis = compute_tis(cfg, lp.detach(), rollout, mask, cu, extra_finite=(adv,))
        per_tok, keep = -tis.weights * adv * lp, tis.keep_mask
    else:
        n_steps = -(-len(set(ro.rollout_ids)) // gbs)
        pi_old = (torch.cat([response_log_probs(ro, w0, j) for j in pos]).detach()
                  if slime_recomputes_pi_old(args, n_steps) else lp.detach())
        anchor = rollout if args.use_rollout_logprobs else pi_old
        pg = ppo_term(anchor - lp, adv, args)
        if args.use_opsm:
            full_anchor = list(anchor.split([ro.response_lengths[j] for j in pos]))
            pg = pg * opsm_keep([x.detach() for x in lp_list], full_anchor,
                                [ro.advantages[j] for j in pos], [ro.masks[j] for j in pos], args.opsm_delta)
        tis = compute_tis(cfg, pi_old, rollout, mask, cu, extra_finite=(pg.detach(),))
        keep = tis.keep_mask
        if args.use_opsm:
            keep = keep & ~((adv < 0) & (pg.detach() == 0))
        w_t = tis.weights if cfg.applies_weights else torch.ones_like(tis.weights)
        per_tok = w_t * pg
    sample = torch.repeat_interleave(torch.arange(len(pos)), torch.tensor([ro.response_lengths[j] for j in pos]))
    rid = torch.tensor([ro.rollout_ids[j] for j in pos])[sample]
    valid = mask != 0
    total = torch.zeros(())
    for g in sorted(set(rid.tolist())):
        sel = rid == g
        d = (valid & sel).sum() if cfg.rejected_denominator == "keep" else (keep & sel).sum()
        total = total + torch.where(keep & sel, per_tok, torch.zeros(())).sum() / d.clamp(min=1)
    return total / gbs


def slime_args(**kw) -> SimpleNamespace:
    """A slime ``args`` namespace (slime's defaults for what the hooks and the harness read)."""
    base = dict(use_tis=False, use_rollout_logprobs=False, get_mismatch_metrics=False, calculate_per_token_loss=False,
                eps_clip=0.2, eps_clip_high=None, eps_clip_c=None, rollout_temperature=TEMP, entropy_coef=0.0,
                use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1", rollout_top_p=1.0, loss_type="policy_loss",
                custom_loss_function_path=None, custom_megatron_before_train_step_hook_path=None, use_opsm=False,
                opsm_delta=1e-4, custom_pg_loss_reducer_function_path=None, advantage_estimator="grpo",
                use_routing_replay=False, compute_advantages_and_returns=True, log_probs_chunk_size=-1,
                use_rollout_entropy=False)
    base.update(kw)
    return SimpleNamespace(**base)


def custom_loss_args(**kw) -> SimpleNamespace:
    return slime_args(loss_type="custom_loss", custom_loss_function_path="slime_tis.slime.reinforce_is_loss",
                      use_rollout_logprobs=True, **kw)
