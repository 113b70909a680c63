"""Drop-in entry points for slime's existing hooks, no change to slime needed (flags and options: docs/slime.md).

``compute_tis_for_slime`` (``--custom-tis-function-path``), ``reinforce_is_loss`` (``--custom-loss-function-path``),
``postprocess_rollout_data`` (``--rollout-data-postprocess-path``), ``before_train_step``
(``--custom-megatron-before-train-step-hook-path``); their shared state is :data:`STATE` (``COLLECTOR``: its
exact-metric collector; ``COLLECTOR.flush()`` reports a run's last step).
"""

from slime_tis.slime.config import slime_view, tis_config_from_slime_args
from slime_tis.slime.layout import cp_response_ranges, local_response_index, response_logit_rows
from slime_tis.slime.loss_hook import reinforce_is_loss
from slime_tis.slime.metrics import token_metrics
from slime_tis.slime.postprocess import flush_recorded_train_log_probs, postprocess_rollout_data
from slime_tis.slime.state import STATE
from slime_tis.slime.step_hook import before_train_step, log_exact_metrics
from slime_tis.slime.tis_hook import compute_tis_for_slime

COLLECTOR = STATE.collector

__all__ = [
    "COLLECTOR",
    "STATE",
    "before_train_step",
    "compute_tis_for_slime",
    "cp_response_ranges",
    "flush_recorded_train_log_probs",
    "local_response_index",
    "log_exact_metrics",
    "postprocess_rollout_data",
    "reinforce_is_loss",
    "response_logit_rows",
    "slime_view",
    "tis_config_from_slime_args",
    "token_metrics",
]
