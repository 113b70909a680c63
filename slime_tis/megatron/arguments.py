"""``add_megatron_tis_arguments``: Megatron-LM's ``extra_args_provider`` adding ``add_tis_arguments``' flags and the
hook's (``--rollout-temperature``, ``--tis-fused-output-layer`` | ``--tis-fp32-lm-head``, ``--tis-routing-replay``),
each unless the parser defines it already; ``megatron_hook_kwargs(args)``: the parsed flags as the hook's keywords
(docs/megatron.md, "The two-line change to a launcher").
"""

from __future__ import annotations

import argparse
from typing import Any

from slime_tis.arguments import add_tis_arguments
from slime_tis.engine.settings import output_layer_of

__all__ = ["add_megatron_tis_arguments", "megatron_hook_kwargs"]


def _has(parser: argparse.ArgumentParser, option: str) -> bool:
    return option in parser._option_string_actions


def add_megatron_tis_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``add_tis_arguments(parser)`` + the hook's flags; returns ``parser``."""
    add_tis_arguments(parser)
    group = parser.add_argument_group("slime_tis megatron")
    if not _has(parser, "--rollout-temperature"):
        megatron_rl = _has(parser, "--rl-default-temperature")
        group.add_argument("--rollout-temperature", type=float, default=None if megatron_rl else 1.0,
                           help="Sampling temperature of the rollout engine: the Megatron hook computes "
                                "log-probs of softmax(logits / T). Default: "
                                + ("--rl-default-temperature." if megatron_rl else "1.0."))
    if not (_has(parser, "--tis-fused-output-layer") or _has(parser, "--tis-fp32-lm-head")):
        exclusive = group.add_mutually_exclusive_group()
        exclusive.add_argument("--tis-fused-output-layer", action="store_true",
                               help="Megatron hook: log-probs and entropy from the hidden states and the (tied) "
                                    "output weight, no logits tensor, float32 accumulation (every pass).")
        exclusive.add_argument("--tis-fp32-lm-head", action="store_true",
                               help="Megatron hook: the output-layer matmul with float32 output (every pass).")
    if not _has(parser, "--tis-routing-replay"):
        group.add_argument("--tis-routing-replay", action="store_true",
                           help="Megatron hook, MoE: every forward routes to the rollout engine's experts "
                                "(item['routing']) through megatron-core's RouterReplay (--moe-enable-routing-replay).")
    return parser


def megatron_hook_kwargs(args: Any) -> dict[str, Any]:
    """The hook's ``temperature`` (``--rollout-temperature``, else ``--rl-default-temperature``, else 1.0),
    ``fused_output_layer``, ``fp32_lm_head``, ``routing_replay`` from parsed args (absent flags: False); both
    output-layer flags set is an error naming them."""
    fused = bool(getattr(args, "tis_fused_output_layer", False))
    fp32 = bool(getattr(args, "tis_fp32_lm_head", False))
    output_layer_of(fused, fp32)
    temperature = getattr(args, "rollout_temperature", None)
    if temperature is None:
        temperature = getattr(args, "rl_default_temperature", None)
    return {"temperature": 1.0 if temperature is None else float(temperature), "fused_output_layer": fused,
            "fp32_lm_head": fp32, "routing_replay": bool(getattr(args, "tis_routing_replay", False))}
