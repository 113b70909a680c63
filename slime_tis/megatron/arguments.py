"""``add_megatron_tis_arguments``: the plugin's flags plus the Megatron hook's own, for Megatron-LM.

It is Megatron-LM's ``extra_args_provider`` (takes and returns the parser). Where it goes depends on the
Megatron-LM version:

* megatron-core <= 0.17: ``pretrain(provider, model_provider, model_type, forward_step,
  extra_args_provider=add_megatron_tis_arguments)`` (``pretrain`` parses the command line itself);
* megatron-core >= 0.18 (``pretrain`` takes a config container first and has no ``extra_args_provider``: the old
  call raises ``TypeError``): ``args = parse_and_validate_args(extra_args_provider=add_megatron_tis_arguments)``,
  then ``pretrain(pretrain_cfg_container_from_args(args, ...), provider, model_provider=...,
  model_type=..., forward_step_func=...)``.

It adds every flag of ``slime_tis.arguments.add_tis_arguments`` and, unless the host parser already defines an
option of that name (slime defines ``--rollout-temperature``; the host's is then used):

* ``--rollout-temperature T`` (float > 0): the rollout engine's sampling temperature; the hook divides the training
  logits by it. Default 1.0; on a parser with Megatron-LM's ``--rl-default-temperature`` (the temperature
  Megatron-LM's RL loop samples with) the default is that flag's value;
* ``--tis-fused-output-layer``: log-probs and entropy straight from the hidden states and the (tied) output
  weight (``slime_tis.megatron.output_layer``), no logits tensor, float32 accumulation;
* ``--tis-fp32-lm-head``: float32 logits from the output matmul (bf16 operands, float32 accumulation and
  output; float32 logits into the log-softmax).

* ``--tis-routing-replay``: mixture-of-experts rollout routing replay: every forward of the hook routes each
  MoE layer's tokens to the experts the rollout engine chose (SGLang's ``routed_experts``, carried in each
  micro-batch item as a ``routing_replay.RoutingBatch``), and counts ``moe/routing_mismatch`` /
  ``moe/router_disagreement``.

The two output-layer flags are mutually exclusive (argparse names both). ``megatron_hook_kwargs(args)`` turns the parsed
namespace into the hook's keyword arguments (read the temperature through it, not as ``args.rollout_temperature``:
a parser without this provider has no such attribute)::

    tis_forward_backward_func(get_forward_backward_func(), TISConfig.from_args(args), **megatron_hook_kwargs(args))
"""

from __future__ import annotations

import argparse
from typing import Any

from slime_tis.arguments import add_tis_arguments
from slime_tis.engine.settings import output_layer_of

__all__ = ["add_megatron_tis_arguments", "megatron_hook_kwargs", "rollout_temperature"]


def _has(parser: argparse.ArgumentParser, option: str) -> bool:
    return option in parser._option_string_actions


def add_megatron_tis_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``add_tis_arguments(parser)`` + the hook's flags (module docstring); returns ``parser``."""
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
                               help="Megatron hook: compute log-probs and entropy straight from the last hidden "
                                    "states and the (tied) output weight with the fused output-layer kernel (no "
                                    "logits tensor, float32 accumulation), in the loss and the pi_old pass. "
                                    "Excludes --tis-fp32-lm-head.")
        exclusive.add_argument("--tis-fp32-lm-head", action="store_true",
                               help="Megatron hook: compute the output-layer matmul in float32 (float32 logits "
                                    "into the log-softmax), in the loss and the pi_old pass. Excludes "
                                    "--tis-fused-output-layer.")
    if not _has(parser, "--tis-routing-replay"):
        group.add_argument("--tis-routing-replay", action="store_true",
                           help="Megatron hook, mixture-of-experts models: route every MoE layer's tokens to the "
                                "experts the rollout engine chose (SGLang's routed_experts, item['routing']) in the "
                                "pi_old pass and every training forward, through megatron-core's RouterReplay "
                                "(routers built with --moe-enable-routing-replay); counts moe/routing_mismatch.")
    return parser


def rollout_temperature(args: Any) -> float:
    """The sampling temperature from parsed args: ``--rollout-temperature`` when set, else Megatron-LM's
    ``--rl-default-temperature`` when the parser has it, else 1.0."""
    value = getattr(args, "rollout_temperature", None)
    if value is None:
        value = getattr(args, "rl_default_temperature", None)
    return 1.0 if value is None else float(value)


def megatron_hook_kwargs(args: Any) -> dict[str, Any]:
    """``temperature`` (:func:`rollout_temperature`), ``fused_output_layer``, ``fp32_lm_head``, ``routing_replay``
    for ``tis_forward_backward_func`` from parsed args (absent flags: False); both output-layer flags set is an
    error naming them."""
    fused = bool(getattr(args, "tis_fused_output_layer", False))
    fp32 = bool(getattr(args, "tis_fp32_lm_head", False))
    output_layer_of(fused, fp32)
    return {"temperature": rollout_temperature(args), "fused_output_layer": fused, "fp32_lm_head": fp32,
            "routing_replay": bool(getattr(args, "tis_routing_replay", False))}
