"""slime's policy-loss options inside the custom loss, applied as slime's ``policy_loss_function`` (624b824) applies
them: ``--use-opsm`` (slime's own ``compute_opsm_mask``, on the policy term), ``--use-unbiased-kl`` and
``--custom-pg-loss-reducer-function-path`` (docs/slime.md). Collectives depend on the options only.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from slime_tis.core.correction import plan_of
from slime_tis.core.packing import packed_layout
from slime_tis.core.reducer import Reducer
from slime_tis.core.surrogates import SurrogateInputs, surrogate_of
from slime_tis.core.terms import kl_estimate
from slime_tis.slime.batch import SlimePacked

__all__ = ["opsm_mask", "per_token_pg_loss", "slime_anchor", "slime_pg_loss_reducer", "unbiased_kl"]


def slime_anchor(view: Any, batch: dict[str, Any], packed: SlimePacked, lp_theta: Tensor) -> Tensor:
    """``[T_local]`` slime's ``old_log_probs`` (detached): rollout log-probs with ``--use-rollout-logprobs``,
    else slime's recomputed ``log_probs``, else ``sg(lp_theta)``."""
    if view.use_rollout_logprobs:
        return packed.cat_local("rollout_log_probs", batch["rollout_log_probs"]).to(lp_theta.device).float()
    old = batch.get("log_probs")
    if old:
        return packed.cat_local("log_probs", old).to(lp_theta.device).float()
    return lp_theta.detach().float()


def opsm_mask(args: Any, batch: dict[str, Any], packed: SlimePacked, lp_theta: Tensor, anchor: Tensor,
              advantages: Tensor, reducer: Reducer) -> tuple[Tensor, Tensor]:
    """``([T_local] float32 mask, opsm_clipfrac)`` from slime's ``compute_opsm_mask`` (module docstring)."""
    try:
        from slime.utils.ppo_utils import compute_opsm_mask  # slime's own decision (runs inside slime)
    except ImportError as err:
        raise ValueError(f"--use-opsm: the custom loss takes slime's own OPSM mask from "
                         f"slime.utils.ppo_utils.compute_opsm_mask, which is not importable here ({err})") from None

    params = inspect.signature(compute_opsm_mask).parameters
    kwargs: dict[str, Any] = {
        "args": args,
        "full_log_probs": packed.gather_full(lp_theta.detach(), reducer),
        "full_old_log_probs": packed.gather_full(anchor, reducer),
        "loss_masks": list(batch["loss_masks"]),
    }
    local_adv = list(advantages.split(packed.local_lengths.tolist()))  # host-sync-ok (CPU lengths)
    kwargs.update({name: local_adv for name in ("advantages", "local_advantages") if name in params})
    if "full_advantages" in params:
        kwargs["full_advantages"] = packed.gather_full(advantages, reducer)
    mask, clipfrac = compute_opsm_mask(**kwargs)
    mask = mask.to(lp_theta.device).float().reshape(-1)
    if mask.shape[0] != lp_theta.shape[0]:
        raise ValueError(f"slime's compute_opsm_mask returned {mask.shape[0]} entries for this rank's "
                         f"{lp_theta.shape[0]} response tokens")
    return mask, torch.as_tensor(clipfrac, dtype=torch.float32, device=lp_theta.device)


def unbiased_kl(lp_theta: Tensor, lp_ref: Tensor, lp_old: Tensor, kind: str) -> Tensor:
    """slime's ``--use-unbiased-kl``: ``exp(lp_theta - lp_old) * k(lp_theta, lp_ref)``, then low_var_kl's clamp."""
    base = kl_estimate(lp_theta, lp_ref, "k3" if kind == "low_var_kl" else kind)
    kl = torch.exp(lp_theta.float() - lp_old.float()) * base
    return kl.clamp(-10.0, 10.0) if kind == "low_var_kl" else kl


def per_token_pg_loss(cfg: Any, lp_theta: Tensor, advantages: Tensor, weights: Tensor, keep: Tensor,
                      cu_seqlens: Tensor, reducer: Reducer) -> Tensor:
    """``[T_local]`` the custom loss's per-token policy term ``w_t * f(lp_theta_t, A_t)`` (the configured anchorless
    surrogate, ``-A lp`` or ``-A exp(lp - sg(lp))``), 0 where not kept: what slime hands a pg-loss reducer."""
    theta = torch.where(keep, lp_theta.float(), 0.0)
    adv = torch.where(keep, advantages.detach().float(), 0.0)
    layout = packed_layout(cu_seqlens, int(lp_theta.shape[0]), lp_theta.device)
    sur = surrogate_of(plan_of(cfg).surrogate)
    loss = sur.fn(SurrogateInputs(theta, None, adv, keep, layout, reducer), plan_of(cfg)).loss
    return torch.where(keep, weights.detach() * loss, 0.0)


def slime_pg_loss_reducer(view: Any, batch: dict[str, Any], keep_masks: list[Tensor]) -> Callable[[Tensor], Tensor]:
    """The user's reducer built with slime's contract (module docstring)."""
    path = view.custom_pg_loss_reducer_function_path
    module, _, attr = path.rpartition(".")  # slime's load_function convention
    if not module:
        raise ValueError(f"--custom-pg-loss-reducer-function-path {path!r}: expected module.attr")
    make = getattr(importlib.import_module(module), attr)
    return make(batch["total_lengths"], batch["response_lengths"], keep_masks, bool(view.calculate_per_token_loss))
