"""Megatron-core integration of the rollout correction (see docs/megatron.md).

Public API::

    tis_forward_backward_func(get_forward_backward_func(), cfg, temperature=...)   the hook
    tis_patch                              hook a launcher that calls get_forward_backward_func() itself
    compute_old_log_probs, rollout_step_iterator   pi_old once per rollout (several steps, PPO epochs)
    add_megatron_tis_arguments, megatron_hook_kwargs   the plugin's flags + --rollout-temperature,
                                   --tis-fused-output-layer, --tis-fp32-lm-head; parsed args -> hook kwargs
    TISBatch                               per-micro-batch RL fields (packed, CP-local)
    RoutingBatch                           MoE: the engine's experts per token (item["routing"], --tis-routing-replay)
    vocab_parallel_log_probs_and_entropy   fp32 log-probs / entropy from vocab-parallel logits (kernels="triton": fused)
    MegatronReducer                        the core's Reducer on parallel_state groups
    step_totals, make_loss_func, recompute_log_probs, aggregate_metrics   lower-level pieces, in the hook's order

The last two and the log-probs live in the host-neutral ``slime_tis.engine`` (shared with the slime host);
this package translates megatron's call order and data into it.

Importing this package does not import megatron-core; the functions that need it import it lazily.
"""

from slime_tis.engine.batch import TISBatch, cp_slice_padded, cu_seqlens_from_seq_ids
from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy
from slime_tis.engine.megatron_schedule import data_parallel_grad_average
from slime_tis.engine.metrics import aggregate_metrics
from slime_tis.engine.reduce import MegatronReducer
from slime_tis.engine.totals import StepTotals, needs_pre_pass, step_totals
from slime_tis.megatron.arguments import add_megatron_tis_arguments, megatron_hook_kwargs
from slime_tis.megatron.hook import TISForwardBackward, tis_forward_backward_func
from slime_tis.megatron.loss import LossForm, loss_form_for, make_loss_func
from slime_tis.megatron.patch import tis_patch
from slime_tis.megatron.rank_failure import RankFailedError
from slime_tis.megatron.recompute import recompute_log_probs
from slime_tis.megatron.rollout import compute_old_log_probs, rollout_step_iterator
from slime_tis.megatron.routing_replay import RoutingBatch
from slime_tis.megatron.tp_data import default_get_tis_batch

__all__ = [
    "tis_forward_backward_func",
    "tis_patch",
    "RankFailedError",
    "compute_old_log_probs",
    "rollout_step_iterator",
    "add_megatron_tis_arguments",
    "megatron_hook_kwargs",
    "data_parallel_grad_average",
    "TISForwardBackward",
    "TISBatch",
    "RoutingBatch",
    "default_get_tis_batch",
    "cp_slice_padded",
    "cu_seqlens_from_seq_ids",
    "vocab_parallel_log_probs_and_entropy",
    "MegatronReducer",
    "LossForm",
    "loss_form_for",
    "make_loss_func",
    "StepTotals",
    "step_totals",
    "needs_pre_pass",
    "recompute_log_probs",
    "aggregate_metrics",
]
