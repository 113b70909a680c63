"""The slime hooks' settings, compared across the ranks of a pipeline stage once per configuration.

slime builds the plugin's configuration from its ``args`` in every training process
(:func:`slime_tis.slime.config.tis_config_from_slime_args`); the hooks then reduce over megatron's CP, DP and
DP x CP groups (the postprocess hook's batch-normalisation sums and rollout counts, the loss hooks' sequence
sums and TP log-probs) with collectives chosen by that configuration. Ranks whose configurations differ would
deadlock or mix two definitions, so when a configuration is first built every rank of the stage (the TP x DP
x CP group: the ranks that run the same hooks at the same points) compares it with
:func:`slime_tis.engine.agreement.check_settings_agree` and raises ``ValueError`` naming the differing
setting. Without megatron's ``parallel_state`` (one process) there is nothing to compare.
"""

from __future__ import annotations

from typing import Any

from slime_tis.config import TISConfig

__all__ = ["check_slime_settings_agree", "slime_settings"]


def slime_settings(args: Any, cfg: TISConfig) -> dict[str, Any]:
    """The resolved configuration and the ``args`` the hooks' collectives and numbers depend on."""
    from slime_tis.engine.agreement import config_settings
    from slime_tis.slime.record import recording_enabled

    return {
        **config_settings(cfg),
        "tis_dump_dir (given)": bool(getattr(args, "tis_dump_dir", None)),
        "tis_record_train_log_probs": recording_enabled(args),
        "--rollout-temperature": getattr(args, "rollout_temperature", None),
        "--log-probs-chunk-size": getattr(args, "log_probs_chunk_size", None),
        "--entropy-coef": getattr(args, "entropy_coef", None),
    }


def check_slime_settings_agree(args: Any, cfg: TISConfig) -> None:
    """Compare :func:`slime_settings` across this rank's pipeline stage (a no-op without ``parallel_state``)."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError:  # megatron-core is optional for single-process use
        return
    if not ps.model_parallel_is_initialized():
        return
    from slime_tis.engine.agreement import check_settings_agree

    check_settings_agree(slime_settings(args, cfg), what="slime_tis (slime hooks)",
                         group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True))
