"""``add_megatron_tis_arguments``: the plugin's flags plus the one the Megatron hook needs, for Megatron-LM.

Pass it as ``pretrain(..., extra_args_provider=add_megatron_tis_arguments)``. It adds every flag of
``slime_tis.arguments.add_tis_arguments`` and ``--rollout-temperature`` (the sampling temperature of the
rollout engine; the hook divides the training logits by it), unless the host parser already defines an
option of that name (slime does), in which case the host's is used.
"""

from __future__ import annotations

import argparse

from slime_tis.arguments import add_tis_arguments

__all__ = ["add_megatron_tis_arguments"]


def add_megatron_tis_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``add_tis_arguments(parser)`` + ``--rollout-temperature`` (float > 0, default 1.0); returns ``parser``."""
    add_tis_arguments(parser)
    if "--rollout-temperature" not in parser._option_string_actions:
        group = parser.add_argument_group("slime_tis megatron")
        group.add_argument("--rollout-temperature", type=float, default=1.0,
                           help="Sampling temperature of the rollout engine: the Megatron hook computes "
                                "log-probs of softmax(logits / T). Default: 1.0.")
    return parser
