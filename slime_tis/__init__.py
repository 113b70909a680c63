"""slime_tis: importance sampling against the rollout policy for Megatron RL with SGLang rollouts (docs/CORE_API.md;
hosts: ``slime_tis.megatron``, ``slime_tis.megatron_rl``, ``slime_tis.slime``; rollouts: ``slime_tis.sglang``).
"""

from slime_tis.arguments import add_tis_arguments
from slime_tis.config import TISConfig
from slime_tis.core import (
                            LocalReducer,
                            MetricStats,
                            PolicyLossOutput,
                            Reducer,
                            TISResult,
                            compute_tis,
                            loss_denominator,
                            normalisation_factor,
                            padded_to_packed,
                            policy_loss,
)
from slime_tis.presets import PRESETS

__version__ = "0.1.0"

__all__ = ["TISConfig", "PRESETS", "add_tis_arguments", "compute_tis", "policy_loss", "loss_denominator",
           "normalisation_factor", "MetricStats", "LocalReducer", "Reducer", "TISResult", "PolicyLossOutput",
           "padded_to_packed"]
