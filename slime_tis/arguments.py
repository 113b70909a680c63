"""Command-line flags of slime_tis, as an argparse extension.

``add_tis_arguments(parser)`` takes and returns the parser, so it can be passed directly as
Megatron's ``extra_args_provider``. Options the host parser already defines (slime defines
``--use-tis``, ``--use-rollout-logprobs``, ``--eps-clip``, ``--eps-clip-high``, ``--eps-clip-c``)
are reused, never redefined, so argparse's conflict error cannot fire.

Every option defaults to ``None`` ("not given") so that ``--tis-preset NAME`` can be expanded first
and explicit flags override it; the help text states the effective default. Switches
(``--use-tis``, ``--use-rollout-log-probs``, ``--tis-batch-normalize``) can be turned on by a flag or
a preset, never off. The rejection thresholds' flags and help come from their declarations on
``TISConfig`` (``slime_tis.config.THRESHOLDS``).
"""

from __future__ import annotations

import argparse
from typing import Any

from slime_tis.config import LEVELS, LOSS_AGGS, MODES, THRESHOLDS, config_fields_from_args
from slime_tis.kernels.dispatch import KERNELS
from slime_tis.presets import PRESETS

__all__ = ["add_tis_arguments", "config_fields_from_args"]


def _option_specs() -> list[tuple[list[str], str, dict[str, Any]]]:
    """(option strings, dest, add_argument kwargs) of every flag."""
    levels = list(LEVELS)
    return [
        (["--use-rollout-log-probs", "--use-rollout-logprobs"], "use_rollout_log_probs",
         dict(action="store_true", default=None,
              help="Use the rollout engine's (SGLang) log-probs as pi_old and skip the Megatron recompute "
                   "(algorithm 1; with --use-tis algorithm 3). Default: off.")),
        (["--use-tis"], "use_tis",
         dict(action="store_true", default=None,
              help="Apply importance weights against the rollout policy (algorithm 2; with "
                   "--use-rollout-log-probs algorithm 3). Default: off.")),
        (["--tis-mode"], "tis_mode",
         dict(choices=list(MODES), default=None,
              help="How the ratio r becomes a weight: truncate w=min(r,upper); clip w=clamp(r,lower,upper); "
                   "mask w=r and reject units outside [lower,upper]. Default: truncate.")),
        (["--tis-level"], "tis_level",
         dict(choices=levels, default=None,
              help="Ratio level: token (per token), sequence (product over the sequence), geometric "
                   "(geometric mean over the sequence). Default: token.")),
        (["--tis-upper-bound"], "tis_upper_bound",
         dict(type=float, default=None,
              help="Upper bound on r=pi_train/pi_rollout. Default: 2.0; 1.001 for --tis-mode mask at "
                   "--tis-level geometric.")),
        (["--tis-lower-bound"], "tis_lower_bound",
         dict(type=float, default=None, help="Lower bound on r (clip and mask modes). Default: 1/upper.")),
        (["--tis-rs-level"], "tis_rs_level",
         dict(choices=levels, default=None,
              help="Rejection sampling at this level, independent of --tis-mode. Default: off.")),
        (["--tis-rs-upper-bound"], "tis_rs_upper_bound",
         dict(type=float, default=None,
              help="Rejection-sampling upper bound on r. Default: 2.0; 1.001 at geometric level.")),
        (["--tis-rs-lower-bound"], "tis_rs_lower_bound",
         dict(type=float, default=None, help="Rejection-sampling lower bound on r. Default: 1/rs-upper.")),
        *(([declared.flag], declared.dest, dict(type=float, default=None, help=declared.help))
          for declared in THRESHOLDS.values()),
        (["--tis-batch-normalize"], "tis_batch_normalize",
         dict(action="store_true", default=None,
              help="Rescale weights to mean 1 over the kept units of the global batch (algorithm 2: once "
                   "per step; algorithm 3: per micro-batch over DPxCP). Default: off.")),
        (["--tis-rejected-denominator"], "tis_rejected_denominator",
         dict(choices=["keep", "drop"], default=None,
              help="Rejected tokens stay in the loss denominator (keep) or are removed from it (drop). "
                   "Default: keep.")),
        (["--tis-loss-agg"], "tis_loss_agg",
         dict(choices=list(LOSS_AGGS), default=None,
              help="Loss aggregation over the global batch. Default: token-mean.")),
        (["--eps-clip"], "eps_clip",
         dict(type=float, default=None, help="PPO clip epsilon (low side). Default: 0.2.")),
        (["--eps-clip-high"], "eps_clip_high",
         dict(type=float, default=None, help="PPO clip epsilon, high side. Default: = --eps-clip.")),
        (["--eps-clip-c"], "eps_clip_c",
         dict(type=float, default=None, help="Dual-clip constant c > 1 for negative advantages. Default: off.")),
        (["--tis-safety-bound"], "tis_safety_bound",
         dict(type=float, default=None,
              help="Log-quantities are clamped to [-B, B] before exp; 0 < B <= 60 (float32 exp overflows at "
                   "88.7). Default: 20.")),
        (["--tis-kernels"], "tis_kernels",
         dict(choices=list(KERNELS), default=None,
              help="Code for the log-probs (from logits, or fused from the hidden states) and the correction's "
                   "token pass: torch, or the Triton kernels (CUDA; where one cannot run, e.g. a compile "
                   "error, the torch code with one warning). Default: torch (the Triton kernels are not yet "
                   "measured on a GPU).")),
        (["--tis-preset"], "tis_preset",
         dict(choices=list(PRESETS), default=None,
              help="Expand a named preset; explicit flags override it. Presets: "
                   + "; ".join(f"{k}: {v[0]}" for k, v in PRESETS.items()))),
    ]


def add_tis_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the slime_tis flags to ``parser`` (reusing any it already defines) and return it."""
    existing = parser._option_string_actions  # argparse keeps every registered option string here
    existing_dests = {a.dest for a in parser._actions}
    group = parser.add_argument_group("slime_tis (rollout importance sampling)")
    for strings, dest, kwargs in _option_specs():
        free = [s for s in strings if s not in existing]
        if not free or (dest in existing_dests and len(free) < len(strings)):
            continue  # the host already defines this option: reuse it
        group.add_argument(*free, dest=dest, **kwargs)
    return parser
