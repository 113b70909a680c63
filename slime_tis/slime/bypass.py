"""The optional slime patch's switch: ``tis_bypass_skip_recompute`` (``patches/slime_alg1_skip_recompute.patch``).

With ``--use-rollout-logprobs`` (algorithm 1) slime calls the TIS function only with ``--get-mismatch-metrics``,
and that flag forces slime's pi_old pass. The patched slime skips that pass when this YAML key is on, so the TIS
function sees the detached current log-probs (``l = sg(log pi_theta) - log pi_rollout``, algorithm 1 as
defined). The patch reads the key through :func:`skips_pi_old_recompute`, and the plugin's own idea of whether
slime recomputes pi_old (:func:`slime_tis.slime.schedule.slime_recomputes_pi_old`) does too, so both agree.

The key is a switch like every other of the plugin (``slime_tis.config_fields.parse_switch``): a YAML boolean
or ``true``/``false``, ``yes``/``no``, ``on``/``off``, ``1``/``0``; a quoted ``"false"`` is off, and anything else
is a ``ValueError`` naming the key.
"""

from __future__ import annotations

from typing import Any

from slime_tis.config_fields import parse_switch

__all__ = ["SKIP_RECOMPUTE_KEY", "skip_recompute_requested", "skips_pi_old_recompute"]

SKIP_RECOMPUTE_KEY = "tis_bypass_skip_recompute"


def skip_recompute_requested(args: Any) -> bool:
    """The key's value (absent: off), parsed strictly; raises ``ValueError`` naming the key."""
    value = getattr(args, SKIP_RECOMPUTE_KEY, None)
    return value is not None and parse_switch(SKIP_RECOMPUTE_KEY, value)


def skips_pi_old_recompute(args: Any) -> bool:
    """Whether the patched slime skips its pi_old pass: the key is on and ``--use-rollout-logprobs`` is set."""
    return skip_recompute_requested(args) and bool(getattr(args, "use_rollout_logprobs", False))
