"""slime_tis: importance sampling against the rollout policy for Megatron RL with SGLang rollouts.

Public API::

    TISConfig                      validated configuration (algorithm 0-3, mode, level, bounds, ...)
    add_tis_arguments(parser)      argparse flags (usable as Megatron's extra_args_provider)
    compute_tis(...)               weights, keep mask and tis/ diagnostics on packed sequences
    policy_loss(...)               aggregated loss of algorithms 0-3 with policy/ and tis/ statistics
    loss_denominator(...)          per-micro-batch contribution to the global loss denominator
    MetricStats                    reducible statistics -> merge / reduce / finalize
    LocalReducer, Reducer          the distributed-reduction interface (identity by default)

Hosts (each a thin translator over one step engine, ``slime_tis.engine``) and the rollout side::

    slime_tis.megatron             megatron-core: tis_forward_backward_func, tis_patch (Megatron-LM pretrain)
    slime_tis.megatron_rl          Megatron-LM's train_rl.py: python -m slime_tis.megatron_rl train_rl.py ...
    slime_tis.slime                slime's hooks (compute_tis_for_slime, postprocess_rollout_data, ...)
    slime_tis.sglang               SGLang /generate responses -> aligned rollout log-probs

Tools: ``slime-tis diagnose DUMP`` (``slime_tis.cli``). Documentation: README.md, docs/getting_started.md
(the first configuration per host), docs/troubleshooting.md (what each metric's values mean), docs/reference.md.
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

__all__ = [
    "TISConfig",
    "PRESETS",
    "add_tis_arguments",
    "compute_tis",
    "policy_loss",
    "loss_denominator",
    "normalisation_factor",
    "MetricStats",
    "LocalReducer",
    "Reducer",
    "TISResult",
    "PolicyLossOutput",
    "padded_to_packed",
]
