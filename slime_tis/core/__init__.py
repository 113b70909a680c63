"""Correction core: packed sequences in, weights / masks / losses / statistics out (plain torch; docs/CORE_API.md).

No Megatron, slime, SGLang or kernel import below this package; ``reducer`` is the only door to distributed behaviour.
"""

from slime_tis.core.correction import TISResult, compute_tis
from slime_tis.core.losses import PolicyLossOutput, loss_denominator, policy_loss
from slime_tis.core.metrics import MetricStats
from slime_tis.core.packing import padded_to_packed
from slime_tis.core.plan import Plan
from slime_tis.core.reducer import LocalReducer, Reducer
from slime_tis.core.weights import normalisation_factor

__all__ = ["TISResult", "compute_tis", "normalisation_factor", "Plan", "PolicyLossOutput", "policy_loss",
           "loss_denominator", "MetricStats", "LocalReducer", "Reducer", "padded_to_packed"]
