"""The optional slime patch's switch ``tis_bypass_skip_recompute`` (``patches/slime_alg1_skip_recompute.patch``).

With ``--use-rollout-logprobs`` slime calls the TIS function only with ``--get-mismatch-metrics``, which forces
its pi_old pass; the patched slime skips it when this key is on (algorithm 1 as defined: ``sg(log pi_theta)``).
The patch reads the key through :func:`skips_pi_old_recompute`, as the plugin does (``SlimeView``). A switch like
every other (``parse_switch``): anything but a boolean word is a ``ValueError`` naming the key.
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
