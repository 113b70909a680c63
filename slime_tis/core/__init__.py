"""Correction core: packed sequences in, weights / masks / losses / statistics out.

Plain, device-agnostic torch, read top to bottom: ``plan`` (the resolved configuration) ->
``ratios`` (log-ratios per token and sequence) -> ``weights`` -> ``rules`` (keep mask) ->
``losses``, with ``diagnostics`` / ``metrics`` for the statistics and ``reducer`` as the only door to
distributed behaviour. No Megatron, slime or SGLang import below this package.
"""

from slime_tis.core.correction import TISResult, compute_tis
from slime_tis.core.losses import PolicyLossOutput, loss_denominator, policy_loss, ppo_clip_term
from slime_tis.core.metrics import MetricStats
from slime_tis.core.packing import padded_to_packed, sequence_ids
from slime_tis.core.plan import Plan
from slime_tis.core.reducer import LocalReducer, Reducer
from slime_tis.core.weights import normalisation_factor

__all__ = [
    "TISResult",
    "compute_tis",
    "normalisation_factor",
    "Plan",
    "PolicyLossOutput",
    "policy_loss",
    "ppo_clip_term",
    "loss_denominator",
    "MetricStats",
    "LocalReducer",
    "Reducer",
    "padded_to_packed",
    "sequence_ids",
]
