"""Megatron-LM's RL flags and the plugin's into one ``TISConfig``: each mapped pair decided by which of its two
flags the user typed, a disagreement refused in one line naming both (docs/megatron_rl.md, "Flag mapping").
The launcher's parser records the typed Megatron-LM flags in ``args.tis_megatron_typed``; a namespace without the
record counts every Megatron-LM number it holds as typed.
"""

from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass
from typing import Any

from slime_tis.config import FLAG_OF, SWITCHES, TISConfig, config_fields_from_args

__all__ = ["MAPPED", "TYPED_DEST", "MegatronRLFlags", "config_from_megatron_rl_args", "record_typed_flags",
           "resolve_megatron_rl_flags"]

#: namespace attribute holding the mapped Megatron-LM flags the user typed (dests), set by the launcher's parser
TYPED_DEST = "tis_megatron_typed"

#: (Megatron-LM dest, the plugin's ``TISConfig`` field) of the numeric pairs
MAPPED = (("grpo_clamp_eps_lower", "eps_clip"), ("grpo_clamp_eps_upper", "eps_clip_high"),
          ("grpo_kl_beta", "kl_coef"), ("grpo_entropy_term_weight", "entropy_coef"))
#: every Megatron-LM dest whose typing matters (the numeric pairs, the correction switch and its coefficient)
RECORDED = (*(theirs for theirs, _ in MAPPED), "rl_inference_logprobs_is_correction",
            "rl_importance_sampling_truncation_coef")


def record_typed_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make ``parser`` record which of :data:`RECORDED` the user typed in ``args.tis_megatron_typed`` (argparse runs
    a flag's action only when it is typed); returns it."""
    actions = [a for a in parser._actions if a.dest in RECORDED]  # argparse has no public list of them
    if actions:  # a parser without Megatron-LM's flags records nothing (its namespace gets them elsewhere)
        parser.set_defaults(**{TYPED_DEST: ()})
    for action in actions:
        if not getattr(action, "_tis_records", False):
            base = type(action)

            def __call__(self, parser, namespace, values, option_string=None, _base=base):
                _base.__call__(self, parser, namespace, values, option_string)
                setattr(namespace, TYPED_DEST, (*getattr(namespace, TYPED_DEST, ()), self.dest))

            action.__class__ = type(f"Recorded{base.__name__}", (base,), {"__call__": __call__,
                                                                         "_tis_records": True})
    return parser


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _show(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class MegatronRLFlags:
    """The configuration, and whether the entropy term is Megatron-LM's sampled-token estimate ``-exp(lp) lp`` (its
    coefficient came from ``--grpo-entropy-term-weight`` alone) instead of the distribution's entropy."""

    cfg: TISConfig
    sampled_entropy: bool


class _Flags:
    """Which flags of a namespace were typed, and how to name them."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.fields = config_fields_from_args(args)
        preset = getattr(args, "tis_preset", None)
        self.preset_only = set()
        if preset:
            typed = config_fields_from_args(argparse.Namespace(**{k: v for k, v in vars(args).items()
                                                                  if k != "tis_preset"}))
            self.preset_only = {k for k in self.fields if k not in typed}
            self.preset = preset
        self.recorded = getattr(args, TYPED_DEST, None)

    def ours(self, field: str) -> bool:
        return field in self.fields and (field not in SWITCHES or bool(self.fields[field]))

    def name_ours(self, field: str) -> str:
        value = "" if field in SWITCHES else " " + _show(self.fields[field])
        if field in self.preset_only:
            return f"--tis-preset {self.preset} ({FLAG_OF[field]}{value})"
        return f"{FLAG_OF[field]}{value}"

    def theirs(self, dest: str) -> bool:
        value = getattr(self.args, dest, None)
        if value is None:
            return False
        if self.recorded is None:  # no record: a number counts as typed, a switch's default cannot be told apart
            return not isinstance(value, bool)
        return dest in self.recorded

    def name_theirs(self, dest: str) -> str:
        value = getattr(self.args, dest)
        if isinstance(value, bool):
            return _flag(dest) if value else "--no-" + _flag(dest)[2:]
        return f"{_flag(dest)} {_show(value)}"


def _conflict(a: str, b: str) -> ValueError:
    return ValueError(f"{a} conflicts with {b}: set one of them (docs/megatron_rl.md, flag mapping)")


def resolve_megatron_rl_flags(args: Any) -> MegatronRLFlags:
    """The configuration from a namespace holding Megatron-LM's RL flags and the plugin's (the mapping table and
    the refusals: docs/megatron_rl.md, "Flag mapping")."""
    t = _Flags(args)
    f = dict(t.fields)
    correction = getattr(args, "rl_inference_logprobs_is_correction", None)
    if t.theirs("rl_inference_logprobs_is_correction") and correction is False and f.get("use_tis"):
        raise _conflict(t.name_theirs("rl_inference_logprobs_is_correction"), t.name_ours("use_tis"))
    f["use_tis"] = bool(f.get("use_tis", False) or correction)

    coef = getattr(args, "rl_importance_sampling_truncation_coef", None)
    if coef is not None:
        named = t.name_theirs("rl_importance_sampling_truncation_coef")
        if not f["use_tis"]:
            raise ValueError(f"{named} needs --rl-inference-logprobs-is-correction or --use-tis")
        if f.get("mode", "truncate") != "truncate":
            raise _conflict(named, t.name_ours("mode"))
        if f.get("upper") is not None and float(f["upper"]) != float(coef):
            raise _conflict(named, t.name_ours("upper"))
        f["upper"] = float(coef)
    elif correction and f.get("upper") is None:
        raise ValueError("--rl-inference-logprobs-is-correction without --rl-importance-sampling-truncation-coef "
                         "or --tis-upper-bound: the weight would have no upper bound")

    for theirs, ours in MAPPED:
        if getattr(args, theirs, None) is None:  # not a Megatron-LM namespace: the plugin's flags alone
            continue
        value = float(getattr(args, theirs))
        if t.ours(ours):
            if t.theirs(theirs) and float(f[ours]) != value:
                raise _conflict(t.name_theirs(theirs), t.name_ours(ours))
        elif not (ours == "eps_clip_high" and t.ours("eps_clip") and not t.theirs(theirs)):
            f[ours] = value  # (--eps-clip alone keeps the plugin's symmetric range)
    if t.theirs("grpo_kl_beta") and f.get("kl_coef") and f.get("kl_estimator", "k3") != "k3":
        raise _conflict(f"{t.name_theirs('grpo_kl_beta')} (the k3 estimator)", t.name_ours("kl_estimator"))
    if f.get("sampling_support") == "replay":
        raise ValueError(f"{t.name_ours('sampling_support')}: Megatron-LM's inference engine returns no per-token "
                         "sampling support with its log-probs, so there is none to replay; use "
                         "--tis-sampling-support full (docs/sampling_support.md)")
    if getattr(args, "tis_routing_replay", False):
        raise ValueError("--tis-routing-replay: Megatron-LM's RL loop hands the trainer no routed experts (its "
                         "inference engine records them under --moe-enable-routing-replay, but rl_utils does not carry "
                         "them into the training data), so there is none to replay; remove the flag "
                         "(docs/megatron.md, routing replay)")
    top_p, top_k = getattr(args, "rl_default_top_p", 0) or 0, getattr(args, "rl_default_top_k", -1) or -1
    if 0 < top_p < 1 or top_k > 0:  # a truncated distribution: every ratio carries the log of the kept mass
        warnings.warn(f"--rl-default-top-p {top_p:g} / --rl-default-top-k {top_k}: the engine samples from a "
                      "truncated distribution and returns no support to replay, so every importance ratio carries "
                      "the log of the kept mass (a bias no bound removes); sample with --rl-default-top-p 0 "
                      "--rl-default-top-k -1 for unbiased ratios (docs/sampling_support.md)", stacklevel=2)
    sampled = bool(f.get("entropy_coef")) and not t.ours("entropy_coef")
    return MegatronRLFlags(TISConfig(**f), sampled_entropy=sampled)


def config_from_megatron_rl_args(args: Any) -> TISConfig:
    """``resolve_megatron_rl_flags(args).cfg``."""
    return resolve_megatron_rl_flags(args).cfg
