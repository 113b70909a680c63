"""Drop-in entry points for slime's existing hooks (no change to slime needed; see docs/slime.md).

=====================================================  ===============================================
slime flag                                             value
=====================================================  ===============================================
``--custom-tis-function-path``                         ``slime_tis.slime.compute_tis_for_slime``
``--custom-loss-function-path`` (``--loss-type``       ``slime_tis.slime.reinforce_is_loss``
``custom_loss``; algorithm 3)
``--rollout-data-postprocess-path``                    ``slime_tis.slime.postprocess_rollout_data``
``--custom-megatron-before-train-step-hook-path``      ``slime_tis.slime.before_train_step`` (exact metrics; and
                                                       ``drop``'s kept counts of algorithm 3 at each step)
=====================================================  ===============================================

Options come as ``--custom-config-path`` YAML keys (``tis_mode``, ``tis_level``, ...), see
:mod:`slime_tis.slime.config`. The hooks' shared state is :data:`STATE` (``COLLECTOR``: its exact-metric
collector; ``COLLECTOR.flush()`` reports a run's last step).
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
