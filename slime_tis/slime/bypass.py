"""The optional slime patch's switch ``tis_bypass_skip_recompute`` (``patches/slime_alg1_skip_recompute.patch``).

The patched slime and the plugin read it with :func:`skips_pi_old_recompute`, a switch like every other: anything
but a boolean word is a ``ValueError`` naming the key.
"""

from __future__ import annotations

from typing import Any

from slime_tis.config_fields import parse_switch

__all__ = ["SKIP_RECOMPUTE_KEY", "skips_pi_old_recompute"]

SKIP_RECOMPUTE_KEY = "tis_bypass_skip_recompute"


def skips_pi_old_recompute(args: Any) -> bool:
    """Whether the patched slime skips its pi_old pass: the key is on and ``--use-rollout-logprobs`` is set."""
    value = getattr(args, SKIP_RECOMPUTE_KEY, None)
    return value is not None and parse_switch(SKIP_RECOMPUTE_KEY, value) and bool(getattr(args, "use_rollout_logprobs",
                                                                                         False))
