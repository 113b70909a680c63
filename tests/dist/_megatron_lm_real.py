"""Megatron-LM's own ``train_step`` (``megatron.training.training``, shipped in megatron-core >= 0.17 wheels) around
the hooked schedule: the global state it reads (parsed arguments, micro-batch calculator, timers) is set up the way
``pretrain`` does, from Megatron-LM's own argument parser with its defaults; the optimizer and its scheduler are
megatron's (SGD at learning rate 0 without gradient clipping, so the gradients stay readable after the step)."""

from __future__ import annotations

import sys

import torch.distributed as dist


def available() -> bool:
    try:
        import megatron.training.training  # noqa: F401
    except ImportError:
        return False
    return True


def set_megatron_lm_globals(*, num_microbatches: int, micro_batch_size: int, dp: int, seq_length: int) -> None:
    """Megatron-LM's global arguments and micro-batch calculator for one step (re-set per check)."""
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args

    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        args = parse_args(ignore_unknown_args=True)
    finally:
        sys.argv = argv
    args.gtp_weight_remat_size = 1  # derived by validate_args (which also checks GPU-only settings)
    args.micro_batch_size, args.seq_length, args.data_parallel_size = micro_batch_size, seq_length, dp
    args.global_batch_size = micro_batch_size * num_microbatches * dp
    args.rank, args.world_size = dist.get_rank(), dist.get_world_size()
    global_vars.unset_global_variables()
    global_vars.set_global_variables(args, build_tokenizer=False)


def train_step(forward_step, data_iterator, model: list, forward_backward_func, *, num_microbatches: int,
               micro_batch_size: int, dp: int, seq_length: int) -> dict:
    """One ``megatron.training.training.train_step``; returns its ``loss_reduced`` (what Megatron-LM logs)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.utils import get_model_config
    from megatron.training.training import train_step as megatron_train_step

    set_megatron_lm_globals(num_microbatches=num_microbatches, micro_batch_size=micro_batch_size, dp=dp,
                            seq_length=seq_length)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.0, weight_decay=0.0, clip_grad=0.0), model,
                                       use_gloo_process_groups=False)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=0.0, min_lr=0.0, lr_warmup_steps=0,
                                        lr_decay_steps=1, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=1, wd_incr_style="constant")
    out = megatron_train_step(forward_step, data_iterator, model, optimizer, scheduler,
                              get_model_config(model[0]), forward_backward_func, iteration=0)
    loss_reduced, skipped = out[0], out[1]
    assert not skipped, "Megatron-LM skipped the step"
    return {k: float(v) for k, v in loss_reduced.items()}
