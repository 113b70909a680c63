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
:mod:`slime_tis.slime.config`.
"""

from slime_tis.slime.config import tis_config_from_slime_args
from slime_tis.slime.layout import cp_response_ranges, local_response_index, response_logit_rows
from slime_tis.slime.loss_hook import reinforce_is_loss
from slime_tis.slime.metrics import COLLECTOR, log_exact_metrics, token_metrics
from slime_tis.slime.postprocess import postprocess_rollout_data
from slime_tis.slime.record import flush_recorded_train_log_probs
from slime_tis.slime.step_hook import before_train_step
from slime_tis.slime.tis_hook import compute_tis_for_slime

__all__ = [
    "COLLECTOR",
    "before_train_step",
    "compute_tis_for_slime",
    "cp_response_ranges",
    "flush_recorded_train_log_probs",
    "local_response_index",
    "log_exact_metrics",
    "postprocess_rollout_data",
    "reinforce_is_loss",
    "response_logit_rows",
    "tis_config_from_slime_args",
    "token_metrics",
]
