"""slime's ``--use-opsm`` as the TIS function sees it: which tokens OPSM has already taken out.

slime's ``policy_loss_function`` (``slime/backends/megatron_utils/loss.py``, THUDM/slime 624b824) multiplies
OPSM's mask into ``pg_loss`` before it calls the TIS function, and passes neither the mask nor the
advantages. OPSM (``compute_opsm_mask``, ``slime/utils/ppo_utils.py``) zeroes token ``t`` of sample ``i`` when

    A_t < 0  and  mean over i's valid tokens of (lp_anchor - lp_theta) > --opsm-delta

These tokens are trained by nothing, so the hook must not count them as kept (metrics, the returned masks,
``drop``'s kept counts). It recovers them exactly: with slime's PPO term (``compute_policy_loss``, with or
without dual clip) and ``eps_clip < 1``, a valid token with ``A_t < 0`` has
``pg_loss_t >= |A_t| (1 - eps_clip) > 0`` unless OPSM zeroed it, so

    opsm_t = valid_t and A_t < 0 and pg_loss_t == 0

with ``A`` the advantages the rollout-data hook registered (slime hands the loss the same tensors). CISPO and
the REINFORCE estimator of an open slime change (``--advantage-estimator reinforce``, ``pg_loss = -A lp_theta``;
both losses are 0 wherever ``lp_theta = 0``) do not allow this: refused (``eps_clip < 1`` is validated with the
configuration). A slime that decides OPSM per sequence is refused by :mod:`slime_tis.slime.compat`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["check_opsm", "opsm_rejected"]

#: slime's estimators whose per-token loss is 0 wherever lp_theta = 0 (``compute_cispo_loss``; the REINFORCE
#: estimator of an open slime change, ``-A lp_theta``), so that a zero loss does not mean OPSM zeroed the token
ZERO_AT_CERTAIN_TOKENS = ("cispo", "reinforce")

NEEDS_ADVANTAGES = ("--use-opsm: the TIS hook recovers the tokens OPSM zeroed from the advantages, which slime does "
                    "not pass it: add --rollout-data-postprocess-path slime_tis.slime.postprocess_rollout_data")


def check_opsm(view: Any) -> None:
    """Refuse the configurations where OPSM's tokens cannot be recovered (module docstring); ``view``: the
    :class:`~slime_tis.slime.config.SlimeView`."""
    if not view.use_opsm:
        return
    estimator = view.advantage_estimator
    if estimator in ZERO_AT_CERTAIN_TOKENS:
        raise ValueError(f"--use-opsm with --advantage-estimator {estimator}: the TIS hook cannot tell the tokens "
                         f"OPSM zeroed (slime does not pass its mask, and the {estimator} loss is 0 wherever "
                         "log pi = 0); use tis_rs_level or a k3 rejection threshold in place of --use-opsm")


def opsm_rejected(pg_loss: Tensor, advantages: Tensor, valid: Tensor) -> Tensor:
    """``[T]`` bool, the CP-local tokens OPSM zeroed: ``valid and A < 0 and pg_loss == 0`` (no sync)."""
    return valid & (advantages.to(pg_loss.device) < 0) & (pg_loss.detach() == 0)


def registered_advantages(registry: Any, loss_masks: Any, cat_local: Any) -> Tensor:
    """The micro-batch's CP-local advantages registered by the rollout-data hook (raises naming the fix)."""
    adv = registry.advantages(loss_masks)
    if adv is None:
        raise ValueError(NEEDS_ADVANTAGES)
    return cat_local("advantages", adv) if adv else torch.zeros(0)
