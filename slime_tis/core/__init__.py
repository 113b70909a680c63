"""Correction core: packed sequences in, weights / masks / losses / statistics out.

Device-agnostic torch; on CPU tensors the token pass runs in an optional fused C kernel
(``slime_tis.core.native``), with the torch code as its reference and fallback. No Megatron, slime or
SGLang import anywhere below this package.
"""

from slime_tis.core.correction import TISResult, compute_tis, normalisation_factor
from slime_tis.core.losses import PolicyLossOutput, loss_denominator, policy_loss, ppo_clip_term
from slime_tis.core.metrics import MetricStats
from slime_tis.core.packing import packed_to_padded, padded_to_packed, segment_sum, sequence_ids
from slime_tis.core.reducer import LocalReducer, Reducer

__all__ = [
    "TISResult",
    "compute_tis",
    "normalisation_factor",
    "PolicyLossOutput",
    "policy_loss",
    "ppo_clip_term",
    "loss_denominator",
    "MetricStats",
    "LocalReducer",
    "Reducer",
    "padded_to_packed",
    "packed_to_padded",
    "segment_sum",
    "sequence_ids",
]
