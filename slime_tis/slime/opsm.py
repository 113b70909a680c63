"""slime's ``--use-opsm`` as the TIS function sees it: which tokens OPSM has already zeroed.

slime multiplies OPSM's mask into ``pg_loss`` and passes neither the mask nor the advantages; with its PPO term
and ``eps_clip < 1`` a valid token with ``A_t < 0`` has ``pg_loss_t > 0`` unless OPSM zeroed it, so
``opsm_t = valid_t and A_t < 0 and pg_loss_t == 0`` (``A``: the advantages the rollout-data hook registered).
Estimators whose loss is 0 wherever ``lp_theta = 0`` are refused.
"""

from __future__ import annotations

from typing import Any

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


def registered_advantages(registered: dict, loss_masks: Any, cat_local: Any) -> Tensor:
    """The micro-batch's CP-local advantages registered by the rollout-data hook (``STATE.advantages``: id of a
    loss-mask tensor -> ``(mask, advantages)``); raises naming the fix when one is missing."""
    entries = [registered.get(id(m)) for m in loss_masks]
    if any(e is None or e[0] is not m for e, m in zip(entries, loss_masks)):
        raise ValueError(NEEDS_ADVANTAGES)
    return cat_local("advantages", [e[1] for e in entries])
