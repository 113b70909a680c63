"""Megatron-core host of the rollout correction: the ``forward_backward_func`` hook, ``tis_patch`` for Megatron-LM
launchers, pi_old once per rollout, the hook's flags (API and contracts: docs/megatron.md). Importing this package
does not import megatron-core.
"""

from slime_tis.engine.batch import TISBatch, cp_slice_padded, cu_seqlens_from_seq_ids
from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy
from slime_tis.engine.megatron_schedule import data_parallel_grad_average
from slime_tis.engine.metrics import aggregate_metrics
from slime_tis.engine.reduce import MegatronReducer
from slime_tis.engine.totals import StepTotals, needs_pre_pass, step_totals
from slime_tis.megatron.arguments import add_megatron_tis_arguments, megatron_hook_kwargs
from slime_tis.megatron.hook import TISForwardBackward, tis_forward_backward_func, tis_patch
from slime_tis.megatron.loss import LossForm, loss_form_for, make_loss_func
from slime_tis.megatron.rank_failure import RankFailedError
from slime_tis.megatron.recompute import compute_old_log_probs, recompute_log_probs, rollout_step_iterator
from slime_tis.megatron.routing_replay import RoutingBatch
from slime_tis.megatron.schedule import default_get_tis_batch

__all__ = ["tis_forward_backward_func", "tis_patch", "RankFailedError", "compute_old_log_probs",
           "rollout_step_iterator", "add_megatron_tis_arguments", "megatron_hook_kwargs",
           "data_parallel_grad_average", "TISForwardBackward", "TISBatch", "RoutingBatch", "default_get_tis_batch",
           "cp_slice_padded", "cu_seqlens_from_seq_ids", "vocab_parallel_log_probs_and_entropy", "MegatronReducer",
           "LossForm", "loss_form_for", "make_loss_func", "StepTotals", "step_totals", "needs_pre_pass",
           "recompute_log_probs", "aggregate_metrics"]
