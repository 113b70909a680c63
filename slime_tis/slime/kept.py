"""``tis_rejected_denominator: drop`` in slime: each rollout's kept-token count ``K_g``, exact or refused.

slime divides each rollout's token sum by ``N_g`` (:mod:`slime_tis.slime.rollouts`); ``drop`` divides by ``K_g``,
the rollout's kept tokens over all its samples, CP and DP ranks, with the loss's keep decisions. slime's packing
splits multi-sample rollouts across micro-batches and DP ranks, so the rollout-data hook decides once per rollout
how ``K_g`` reaches the loss (:func:`plan_rollout_drop`): **counted from pi_old** before training (TIS hook,
algorithms 1, 2, slime recomputed pi_old); **counted at each step** (custom loss, algorithm 3: step 0 from slime's
pi_old when it was recomputed, the others by :func:`slime_tis.slime.before_train_step` at the step's parameters);
or **local**, each hook counting its micro-batch, accepted only where every rollout is one sample. Anything else is
a ``ValueError`` saying what to add (docs/slime.md). Collectives: one all-reduce MAX of one number and one of
``[4, n_batch]`` per rollout, plus, when counting from pi_old, one correction's CP reductions (shared with the
batch normalisation) and one full-length keep mask; all set by the configuration and the layout alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from slime_tis.core import TISResult
from slime_tis.core.algorithms import algorithm_of
from slime_tis.engine.parallel import ParallelContext
from slime_tis.engine.step import StepEngine
from slime_tis.slime.batch import SlimePacked, pack_slime_batch
from slime_tis.slime.config import STEP_HOOK, SlimeView
from slime_tis.slime.rollouts import RolloutRegistry, batch_positions, rollout_table, unit_keys
from slime_tis.slime.schedule import n_steps, sample_steps

__all__ = ["DropPlan", "check_drop_config", "count_kept", "drop_applies", "pi_old_correction", "plan_rollout_drop"]
PER_TOKEN = ("tis_rejected_denominator = 'drop' cannot be honoured with --calculate-per-token-loss: slime "
             "divides by the step's original token count; use the default per-rollout mean or 'keep'")


@dataclass(frozen=True)
class DropPlan:
    """How this rollout's ``K_g`` reach the loss hooks (module docstring).

    ``counted``: every sample's decisions and ``K_g`` are registered before its step trains (``False``:
    local counting, accepted only for one-sample units); ``from_pi_old``: registered from these pi_old
    tensors (the TIS hook checks it gets them); ``hook_steps``: steps :func:`before_train_step` counts;
    ``positions``, ``keys``, ``n_batch``: the rollout-batch layout of the DP table.
    """

    counted: bool
    from_pi_old: bool
    hook_steps: tuple[int, ...]
    positions: list[int]
    keys: list[int]
    n_batch: int


def drop_applies(cfg: Any) -> bool:
    """``drop`` with slime's per-rollout mean (the case that needs ``K_g``)."""
    return cfg.rejected_denominator == "drop" and algorithm_of(cfg).corrects and cfg.loss_agg == "seq-mean-token-mean"


def check_drop_config(view: SlimeView) -> None:
    """Configuration-level refusals of ``drop`` (raised by the rollout-data hook and the loss hooks)."""
    cfg = view.cfg
    if cfg.rejected_denominator != "drop" or not algorithm_of(cfg).corrects:
        return
    if view.calculate_per_token_loss:
        raise ValueError(PER_TOKEN)
    reducer = view.custom_pg_loss_reducer_function_path
    if reducer is not None and algorithm_of(cfg).ppo:  # slime's own PPO loss (not the REINFORCE custom loss)
        raise ValueError(
            f"tis_rejected_denominator = 'drop' with --custom-pg-loss-reducer-function-path {reducer}: the TIS "
            "hook rescales each rollout's loss by N_g / K_g for slime's default reducer (which divides by "
            "rollout_mask_sums = N_g); a custom reducer picks its own denominators. Use 'keep' (your reducer gets "
            "the masks with rejected tokens zeroed) or slime's default reducer"
        )


def pi_old_correction(view: SlimeView, data: dict[str, Any], lp_train: Sequence[Tensor],
                      ctx: ParallelContext) -> tuple[SlimePacked, TISResult]:
    """The correction of ``data``'s samples from ``lp_train`` (CP-local per-sample log-probs) against the rollout
    log-probs, as the loss takes its decisions (non-finite advantages, and reference log-probs where the custom
    loss adds slime's KL term, reject their sequence), without batch normalisation: ``(the packed samples, its
    TISResult)``. Its keep mask feeds ``drop``'s counts and its ``norm_sum`` / ``norm_count`` the
    batch-normalisation factor; a rollout computes it once for both."""
    host_kl = view.host_kl
    packed = pack_slime_batch(list(data["loss_masks"]), data["total_lengths"], data["response_lengths"],
                              ctx.cp_rank, ctx.cp_size)
    device = packed.full_mask.device
    lp_rollout = packed.cat_local("rollout_log_probs", data["rollout_log_probs"]).to(device)
    adv = data.get("advantages")
    batch = packed.tis_batch(rollout_log_probs=lp_rollout,
                             old_log_probs=packed.cat_local("train log-probs", list(lp_train)).to(device),
                             advantages=None if adv is None else packed.cat_local("advantages", adv).to(device),
                             ref_log_probs=_reference(data, packed, device) if host_kl else None)
    engine = StepEngine(view.cfg.replace(batch_normalize=False), ctx.reducer, host_kl=host_kl)
    return packed, engine.correct(batch, batch.old_log_probs)


def _reference(data: dict[str, Any], packed: SlimePacked, device: torch.device) -> Tensor:
    """The CP-local reference log-probs of ``data``'s samples (``SlimeView.host_kl``)."""
    if data.get("ref_log_probs") is None:
        raise ValueError("--use-kl-loss with a nonzero --kl-loss-coef: the rollout data carries no ref_log_probs "
                         "(slime computes them with the reference model: check --ref-load)")
    return packed.cat_local("ref_log_probs", data["ref_log_probs"]).to(device)


def count_kept(view: SlimeView, data: dict[str, Any], lp_train: Sequence[Tensor], ctx: ParallelContext, *,
               decided: tuple[SlimePacked, TISResult] | None = None) -> tuple[list[Tensor], Tensor, Tensor]:
    """Keep decisions of ``data``'s samples from ``lp_train`` as the loss takes them (:func:`pi_old_correction`,
    or ``decided``, that correction already computed): ``(full-length keep masks, identical on all CP ranks;
    [n] valid counts; [n] kept counts)``."""
    packed, res = decided if decided is not None else pi_old_correction(view, data, lp_train, ctx)
    n = len(data["loss_masks"])
    device = packed.full_mask.device
    keep_full = [k != 0 for k in packed.full_keep_masks(res.loss_keep, ctx.reducer)] if n else []
    sample = packed.full_sample_index()
    valid = torch.zeros(n, device=device).index_add_(0, sample, (packed.full_mask != 0).float())
    kept = torch.zeros(n, device=device).index_add_(0, sample, torch.cat(keep_full).float()) if n else valid
    return keep_full, valid, kept


def _valid_counts(masks: Sequence[Tensor]) -> Tensor:
    device = masks[0].device if masks else torch.device("cpu")
    return torch.stack([(m != 0).sum() for m in masks]).float() if masks else torch.zeros(0, device=device)


def _refusal(view: SlimeView, steps: int) -> str:
    head = ("tis_rejected_denominator = 'drop': this rollout batch has rollouts of several samples, which slime's "
            "packing puts in different micro-batches or on different data-parallel ranks, so each rollout's "
            "kept-token count K_g must be counted before its loss is computed; ")
    custom = not algorithm_of(view.cfg).ppo  # the REINFORCE custom loss (algorithm 3)
    if custom and steps == 1:
        return head + (
            "the custom loss decides at pi_theta, which with one optimizer step per rollout is slime's pi_old: "
            f"add {view.pi_old_pass_flags} (slime's forward-only pass over the rollout; the custom loss never "
            f"calls the TIS function), or --custom-megatron-before-train-step-hook-path {STEP_HOOK} (the same "
            "pass, run by the hook)")
    if custom:
        return head + (
            f"with {steps} optimizer steps per rollout the decisions change at every step: add "
            f"--custom-megatron-before-train-step-hook-path {STEP_HOOK} (one forward-only pass over each step's "
            "micro-batches before it trains)")
    if view.use_opsm:
        return head + (
            "--use-opsm zeroes tokens by a rule that depends on the step's parameters, and slime does not hand the "
            "TIS function its mask; the hook recovers it per micro-batch, which gives K_g only for rollouts of one "
            "sample. Use 'keep', or replace --use-opsm by tis_rs_level or a k3 rejection threshold")
    return head + ("slime skipped the pi_old recompute (it reuses the training forward with one step per "
                   f"rollout): add {view.pi_old_pass_flags} (slime's forward-only pass over the rollout)")


def plan_rollout_drop(view: SlimeView, rollout_data: dict[str, Any], ctx: ParallelContext, registry: RolloutRegistry,
                      whole: Callable[[], tuple[SlimePacked, TISResult]] | None = None) -> DropPlan:
    """Decide how ``K_g`` reach the loss for this rollout, count what can be counted now, refuse the rest
    (module docstring). Runs on every rank, pipeline stages included (the counts only on the last).

    ``whole``: the rollout's :func:`pi_old_correction` over all its samples, computed at most once (the
    rollout-data hook shares it with the batch normalisation); used when every sample is counted now."""
    check_drop_config(view)
    steps = n_steps(rollout_data)
    recomputed = view.recomputes_pi_old(steps)
    custom = not algorithm_of(view.cfg).ppo  # the REINFORCE custom loss (algorithm 3)
    hook = custom and view.step_hook
    if hook and view.use_routing_replay:
        raise ValueError(f"{STEP_HOOK} counts kept tokens with an extra forward pass, which would consume slime's "
                         "routing-replay records (--use-routing-replay): use 'keep'")
    if custom:
        counted = hook or (recomputed and steps == 1)
        count_now_steps = {0} if recomputed and counted else set()
        hook_steps = tuple(s for s in range(steps) if s not in count_now_steps) if hook else ()
    else:
        counted = recomputed and not view.use_opsm
        count_now_steps, hook_steps = (set(range(steps)) if counted else set()), ()
    positions, n_batch = batch_positions(rollout_data, ctx.reducer, ctx.dp_size)
    keys = unit_keys(rollout_data, positions)
    masks = list(rollout_data["loss_masks"])
    valid, kept = _valid_counts(masks), torch.zeros(len(masks), device=masks[0].device if masks else "cpu")
    now = [i for i, s in enumerate(sample_steps(rollout_data)) if s in count_now_steps]
    keep_full: list[Tensor] = []
    if count_now_steps and ctx.last_pp_stage:
        lp_old = rollout_data.get("log_probs")
        if not lp_old:
            raise ValueError("tis_rejected_denominator = 'drop': slime's pi_old recompute was expected "
                             "(rollout_data['log_probs']) but is missing")
        part = {k: [rollout_data[k][i] for i in now] for k in
                ("loss_masks", "total_lengths", "response_lengths", "rollout_log_probs", "advantages",
                 "ref_log_probs")
                if rollout_data.get(k) is not None}
        decided = whole() if whole is not None and len(now) == len(masks) else None
        keep_full, _, kept_now = count_kept(view, part, [lp_old[i] for i in now], ctx, decided=decided)
        if now:
            kept[torch.tensor(now, dtype=torch.int64).to(kept.device)] = kept_now
    table, most = rollout_table(valid.to(kept.device), kept, keys, positions, n_batch, ctx.reducer)
    if not counted and most > 1:
        raise ValueError(_refusal(view, steps))
    if keep_full:
        lp_of = None if custom else [rollout_data["log_probs"][i] for i in now]
        registry.set_counted(now, keep_full, table[now][:, :2] if now else table[:0, :2], lp_of)
    return DropPlan(counted, bool(count_now_steps) and not custom, hook_steps, positions, keys, n_batch)
