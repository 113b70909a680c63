"""``tis_rejected_denominator: drop`` in slime: each rollout's kept-token count ``K_g``, exact or refused.

slime divides each rollout's token sum by ``N_g`` (:mod:`slime_tis.slime.rollouts`); ``drop`` means dividing
by ``K_g``, the rollout's kept tokens over all its samples, CP ranks and DP ranks, with the keep decisions
the loss uses. A loss hook sees one micro-batch, and slime's packing splits multi-sample rollouts across
micro-batches and DP ranks, so ``K_g`` is known in the loss only in these cases, decided once per rollout by
the rollout-data hook (:func:`plan_rollout_drop`) from the configuration:

* **counted from pi_old** (TIS hook, algorithms 1 and 2, slime recomputed pi_old): the decisions come from
  pi_old, fixed for the rollout, so the rollout-data hook counts them before training.
* **counted at each step** (custom loss, algorithm 3: the decisions come from ``sg(pi_theta)``):
  step 0 trains at the parameters slime's pi_old was computed at, so with slime's recompute
  (``--get-mismatch-metrics``) its samples are counted with the others above; every other step is counted
  by :func:`slime_tis.slime.before_train_step` just before it trains, from a forward-only pass at the step's
  parameters. The loss then uses exactly the counted decisions.
* **local**: no count before the loss; each hook counts its micro-batch. Exact when every rollout of the
  batch is one sample (or slime has no per-rollout denominators), the only case this mode accepts.

Anything else is refused with a ``ValueError`` that says why and what to add. Collectives: one all-reduce
MAX of one number and one all-reduce of ``[4, n_batch]`` per rollout (:mod:`slime_tis.slime.rollouts`),
plus, when counting from pi_old, the CP reductions of one ``compute_tis`` (shared with the batch
normalisation of the rollout-data hook) and one full-length keep mask;
all set by the configuration and the layout alone.
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
from slime_tis.slime.rollouts import RolloutRegistry, batch_positions, rollout_table, unit_keys
from slime_tis.slime.schedule import n_steps, pi_old_pass_flags, sample_steps, slime_recomputes_pi_old

__all__ = ["DropPlan", "check_drop_config", "count_kept", "custom_loss_kl", "drop_applies", "pi_old_correction",
           "plan_rollout_drop", "step_hook_configured"]

STEP_HOOK = "slime_tis.slime.before_train_step"
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
    return cfg.rejected_denominator == "drop" and algorithm_of(cfg).rejects and cfg.loss_agg == "seq-mean-token-mean"


def custom_loss_kl(args: Any, cfg: Any) -> bool:
    """The custom loss (algorithm 3) adds slime's KL term against ``ref_log_probs`` to the loss itself
    (``--use-kl-loss`` with a nonzero ``--kl-loss-coef``): every correction of its samples checks them like the
    advantages, so a non-finite reference log-prob rejects its sequence (counted in ``tis/nonfinite_seq_fraction``)
    before the KL term reads it (``StepEngine(host_kl=...)``). At ``--kl-loss-coef 0`` the KL is a metric only and
    the reference log-probs are no input of the loss; slime's own PPO loss computes its KL term in slime."""
    return (bool(getattr(args, "use_kl_loss", False)) and float(getattr(args, "kl_loss_coef", 0.0) or 0.0) != 0.0
            and not algorithm_of(cfg).ppo)


def step_hook_configured(args: Any) -> bool:
    """slime runs :func:`slime_tis.slime.before_train_step` (or a hook of that name that calls it) before each step."""
    path = str(getattr(args, "custom_megatron_before_train_step_hook_path", None) or "")
    return path.rsplit(".", 1)[-1] == "before_train_step"


def check_drop_config(args: Any, cfg: Any) -> None:
    """Configuration-level refusals of ``drop`` (raised by the rollout-data hook and the loss hooks)."""
    if cfg.rejected_denominator != "drop" or not algorithm_of(cfg).rejects:
        return
    if getattr(args, "calculate_per_token_loss", False):
        raise ValueError(PER_TOKEN)
    reducer = getattr(args, "custom_pg_loss_reducer_function_path", None)
    if reducer is not None and algorithm_of(cfg).ppo:  # slime's own PPO loss (not the REINFORCE custom loss)
        raise ValueError(
            f"tis_rejected_denominator = 'drop' with --custom-pg-loss-reducer-function-path {reducer}: the TIS "
            "hook rescales each rollout's loss by N_g / K_g for slime's default reducer (which divides by "
            "rollout_mask_sums = N_g); a custom reducer picks its own denominators. Use 'keep' (your reducer gets "
            "the masks with rejected tokens zeroed) or slime's default reducer"
        )


def pi_old_correction(cfg: Any, data: dict[str, Any], lp_train: Sequence[Tensor], ctx: ParallelContext, *,
                      host_kl: bool = False) -> tuple[SlimePacked, TISResult]:
    """The correction of ``data``'s samples from ``lp_train`` (CP-local per-sample log-probs) against the rollout
    log-probs, as the loss takes its decisions (non-finite advantages reject their sequence), without batch
    normalisation (``host_kl``: :func:`custom_loss_kl`): ``(the packed samples, its TISResult)``. Its keep mask
    feeds ``drop``'s counts and its ``norm_sum`` / ``norm_count`` the batch-normalisation factor; a rollout computes
    it once for both."""
    packed = pack_slime_batch(list(data["loss_masks"]), data["total_lengths"], data["response_lengths"],
                              ctx.cp_rank, ctx.cp_size)
    device = packed.full_mask.device
    lp_rollout = packed.cat_local("rollout_log_probs", data["rollout_log_probs"]).to(device)
    adv = data.get("advantages")
    batch = packed.tis_batch(rollout_log_probs=lp_rollout,
                             old_log_probs=packed.cat_local("train log-probs", list(lp_train)).to(device),
                             advantages=None if adv is None else packed.cat_local("advantages", adv).to(device),
                             ref_log_probs=_reference(data, packed, device) if host_kl else None)
    engine = StepEngine(cfg.replace(batch_normalize=False), ctx.reducer, host_kl=host_kl)
    return packed, engine.correct(batch, batch.old_log_probs)


def _reference(data: dict[str, Any], packed: SlimePacked, device: torch.device) -> Tensor:
    """The CP-local reference log-probs of ``data``'s samples (:func:`custom_loss_kl`)."""
    if data.get("ref_log_probs") is None:
        raise ValueError("--use-kl-loss with a nonzero --kl-loss-coef: the rollout data carries no ref_log_probs "
                         "(slime computes them with the reference model: check --ref-load)")
    return packed.cat_local("ref_log_probs", data["ref_log_probs"]).to(device)


def count_kept(cfg: Any, data: dict[str, Any], lp_train: Sequence[Tensor], ctx: ParallelContext, *,
               decided: tuple[SlimePacked, TISResult] | None = None,
               host_kl: bool = False) -> tuple[list[Tensor], Tensor, Tensor]:
    """Keep decisions of ``data``'s samples from ``lp_train`` as the loss takes them (:func:`pi_old_correction`,
    or ``decided``, that correction already computed): ``(full-length keep masks, identical on all CP ranks;
    [n] valid counts; [n] kept counts)``."""
    packed, res = decided if decided is not None else pi_old_correction(cfg, data, lp_train, ctx, host_kl=host_kl)
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


def _refusal(args: Any, cfg: Any, steps: int, recomputed: bool) -> str:
    head = ("tis_rejected_denominator = 'drop': this rollout batch has rollouts of several samples, which slime's "
            "packing puts in different micro-batches or on different data-parallel ranks, so each rollout's "
            "kept-token count K_g must be counted before its loss is computed; ")
    custom = not algorithm_of(cfg).ppo  # the REINFORCE custom loss (algorithm 3)
    if custom and steps == 1:
        return head + (
            "the custom loss decides at pi_theta, which with one optimizer step per rollout is slime's pi_old: "
            f"add {pi_old_pass_flags(args)} (slime's forward-only pass over the rollout; the custom loss never "
            f"calls the TIS function), or --custom-megatron-before-train-step-hook-path {STEP_HOOK} (the same "
            "pass, run by the hook)")
    if custom:
        return head + (
            f"with {steps} optimizer steps per rollout the decisions change at every step: add "
            f"--custom-megatron-before-train-step-hook-path {STEP_HOOK} (one forward-only pass over each step's "
            "micro-batches before it trains)")
    if getattr(args, "use_opsm", False):
        return head + (
            "--use-opsm zeroes tokens by a rule that depends on the step's parameters, and slime does not hand the "
            "TIS function its mask; the hook recovers it per micro-batch, which gives K_g only for rollouts of one "
            "sample. Use 'keep', or replace --use-opsm by tis_rs_level or a k3 rejection threshold")
    return head + ("slime skipped the pi_old recompute (it reuses the training forward with one step per "
                   f"rollout): add {pi_old_pass_flags(args)} (slime's forward-only pass over the rollout)")


def plan_rollout_drop(args: Any, cfg: Any, rollout_data: dict[str, Any], ctx: ParallelContext,
                      registry: RolloutRegistry,
                      whole: Callable[[], tuple[SlimePacked, TISResult]] | None = None) -> DropPlan:
    """Decide how ``K_g`` reach the loss for this rollout, count what can be counted now, refuse the rest
    (module docstring). Runs on every rank, pipeline stages included (the counts only on the last).

    ``whole``: the rollout's :func:`pi_old_correction` over all its samples, computed at most once (the
    rollout-data hook shares it with the batch normalisation); used when every sample is counted now."""
    check_drop_config(args, cfg)
    steps = n_steps(rollout_data)
    recomputed = slime_recomputes_pi_old(args, steps)
    custom = not algorithm_of(cfg).ppo  # the REINFORCE custom loss (algorithm 3)
    hook = custom and step_hook_configured(args)
    if hook and getattr(args, "use_routing_replay", False):
        raise ValueError(f"{STEP_HOOK} counts kept tokens with an extra forward pass, which would consume slime's "
                         "routing-replay records (--use-routing-replay): use 'keep'")
    if custom:
        counted = hook or (recomputed and steps == 1)
        count_now_steps = {0} if recomputed and counted else set()
        hook_steps = tuple(s for s in range(steps) if s not in count_now_steps) if hook else ()
    else:
        counted = recomputed and not getattr(args, "use_opsm", False)
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
        view = {k: [rollout_data[k][i] for i in now] for k in
                ("loss_masks", "total_lengths", "response_lengths", "rollout_log_probs", "advantages",
                 "ref_log_probs")
                if rollout_data.get(k) is not None}
        decided = whole() if whole is not None and len(now) == len(masks) else None
        keep_full, _, kept_now = count_kept(cfg, view, [lp_old[i] for i in now], ctx, decided=decided,
                                            host_kl=custom_loss_kl(args, cfg))
        if now:
            kept[torch.tensor(now, dtype=torch.int64).to(kept.device)] = kept_now
    table, most = rollout_table(valid.to(kept.device), kept, keys, positions, n_batch, ctx.reducer)
    if not counted and most > 1:
        raise ValueError(_refusal(args, cfg, steps, recomputed))
    if keep_full:
        lp_of = None if custom else [rollout_data["log_probs"][i] for i in now]
        registry.set_counted(now, keep_full, table[now][:, :2] if now else table[:0, :2], lp_of)
    return DropPlan(counted, bool(count_now_steps) and not custom, hook_steps, positions, keys, n_batch)
