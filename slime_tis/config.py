"""``TISConfig``: every knob of the correction, validated once at construction (``ValueError`` naming the flag, field
and value); ``TISConfig.plan`` resolves it. Each field is declared once with its flag, range and help
(``slime_tis.config_fields``): the flags, dests, per-field checks and docs/reference.md's flag table follow.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from slime_tis.config_fields import (
    MAX_SAFETY_BOUND,
    Option,
    declared_fields,
    divergence_threshold,
    fields_from_args,
    option,
    parse_switch,
    surrogate_option,
    threshold,
)
from slime_tis.core.aggregation import AGGREGATIONS
from slime_tis.core.algorithms import algorithm_of
from slime_tis.core.levels import DEFAULT_UPPER, LEVELS, MODES, level_of, mode_of
from slime_tis.core.plan import Plan
from slime_tis.core.surrogates import SURROGATES, surrogate_of
from slime_tis.core.terms import KL_ESTIMATORS, KL_GRADIENTS
from slime_tis.engine.settings import SAMPLING_SUPPORT_MODES
from slime_tis.kernels.dispatch import DEFAULT_KERNELS, KERNELS
from slime_tis.kernels.token_pass import token_pass_for
from slime_tis.presets import PRESETS, preset_fields

__all__ = ["TISConfig", "FLAG_OF", "THRESHOLDS", "OPTIONS", "ALL_OPTIONS", "config_fields_from_args", "parse_switch"]

logger = logging.getLogger("slime_tis")
_WARNED: set = set()  # configurations whose inert options were logged


def _bad(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{FLAG_OF.get(field, field)} ({field}) = {value!r}: {why}")


def _check_bounds(config: TISConfig, prefix: str) -> None:
    """``upper >= 1`` (checked before ``1 / upper`` is formed), ``0 < lower < upper``, ``lower <= 1`` of the resolved
    bounds ``<prefix>lower_bound`` / ``<prefix>upper_bound`` (``prefix``: ``""`` or ``"rs_"``)."""
    lower_field, upper_field = prefix + "lower", prefix + "upper"
    upper = getattr(config, upper_field + "_bound")
    if upper < 1:
        raise _bad(upper_field, upper, "bounds must include 1 (upper >= 1); bounds are on r = pi_train/pi_rollout")
    lower = getattr(config, lower_field + "_bound")
    if lower <= 0:
        raise _bad(lower_field, lower, "ratio bounds must be > 0")
    if lower >= upper:
        raise _bad(lower_field, lower, f"must be < {FLAG_OF[upper_field]} = {upper!r}")
    if lower > 1:
        raise _bad(lower_field, lower, "bounds must include 1 (lower <= 1); bounds are on r = pi_train/pi_rollout")


@dataclass(frozen=True)
class TISConfig:
    """Rollout-correction configuration, validated at construction: every field's flag, range and meaning are its
    declaration (the help text); the rules between fields are in ``__post_init__``."""

    use_rollout_log_probs: bool = option(
        False, flag="--use-rollout-log-probs", aliases=("--use-rollout-logprobs",), kind="switch",
        help="Use the rollout engine's log-probs as pi_old and skip the recompute (algorithm 1; with --use-tis 3). "
             "Default: off.")
    use_tis: bool = option(
        False, flag="--use-tis", kind="switch",
        help="Apply importance weights against the rollout policy (algorithm 2; with --use-rollout-log-probs 3). "
             "Default: off.")
    mode: str = option(
        "truncate", flag="--tis-mode", kind="choice", choices=tuple(MODES),
        help="How the ratio r becomes a weight: truncate w=min(r,upper); clip w=clamp(r,lower,upper); "
             "mask w=r and reject units outside [lower,upper]. Default: truncate.")
    level: str = option(
        "token", flag="--tis-level", kind="choice", choices=tuple(LEVELS),
        help="Ratio level: token, sequence (product over the sequence), geometric (its geometric mean), prefix (CTPO: "
             "product over the token's prefix), prefix_min (MinPRO: the prefix's smallest ratio). Default: token.")
    upper: float | str | None = option(
        None, flag="--tis-upper-bound", words=("auto",),
        help="Upper bound on r=pi_train/pi_rollout, or auto (truncate mode, with --tis-target-ess: searched each "
             "step). Default: 2.0; 1.001 for --tis-mode mask at --tis-level geometric.")
    lower: float | None = option(
        None, flag="--tis-lower-bound", help="Lower bound on r (clip and mask modes). Default: 1/upper.")
    rs_level: str | None = option(
        None, flag="--tis-rs-level", kind="choice", choices=tuple(LEVELS),
        help="Rejection sampling at this level, independent of --tis-mode. Default: off.")
    rs_upper: float | None = option(
        None, flag="--tis-rs-upper-bound",
        help="Rejection-sampling upper bound on r. Default: 2.0; 1.001 at geometric level.")
    rs_lower: float | None = option(
        None, flag="--tis-rs-lower-bound", help="Rejection-sampling lower bound on r. Default: 1/rs-upper.")
    # rejection thresholds: one declaration each (rule: the row naming the field in core.rules.RULES)
    veto_threshold: float | None = threshold(
        flag="--tis-veto-threshold", valid="in (0, 1)",
        help="Reject a whole sequence if any valid token has raw ratio < v (0<v<1). Default: off.",
        describe="veto: reject sequences with any token ratio < {value:g}")
    # verl's divergence rejection options <statistic>_<k2|k3> (core.rules._divergence)
    seq_mean_k3_threshold: float | None = divergence_threshold("seq_mean_k3")
    seq_max_k3_threshold: float | None = divergence_threshold("seq_max_k3")
    token_k2_threshold: float | None = divergence_threshold("token_k2")
    token_k3_threshold: float | None = divergence_threshold("token_k3")
    seq_sum_k2_threshold: float | None = divergence_threshold("seq_sum_k2")
    seq_sum_k3_threshold: float | None = divergence_threshold("seq_sum_k3")
    seq_mean_k2_threshold: float | None = divergence_threshold("seq_mean_k2")
    seq_max_k2_threshold: float | None = divergence_threshold("seq_max_k2")
    # the upper veto (SkyRL), the binary KL (KPop) and the sequence log-prob error (NeMo-RL)
    veto_upper_threshold: float | None = threshold(
        flag="--tis-veto-upper-threshold", valid="> 1", why="the upper side of the veto, r > V",
        help="Reject a whole sequence if any valid token has raw ratio > V (V > 1; with --tis-veto-threshold the "
             "two-sided veto, SkyRL's outlier bounds [1e-4, 100]). Default: off.",
        describe="upper veto: reject sequences with any token ratio > {value:g}")
    binary_kl_threshold: float | None = threshold(
        flag="--tis-binary-kl-threshold", valid="> 0", why="a Bernoulli KL is >= 0",
        help="Reject a token whose Bernoulli KL between pi_train and pi_rollout of the sampled token exceeds phi in "
             "either direction (KPop; the paper's phi = 0.1). Default: off.",
        describe="binary-KL rejection: reject tokens with max(D(p||q), D(q||p)) > {value:g}")
    seq_logprob_error_threshold: float | None = threshold(
        flag="--tis-seq-logprob-error-threshold", valid=">= 1", why="mean_t exp(abs(l_t)) >= 1",
        help="Reject a sequence whose mean over valid tokens of exp(abs(lp_train - lp_rollout)) exceeds this (>= 1), "
             "as NeMo-RL's seq_logprob_error_threshold (its recipes: 2). Default: off.",
        describe="log-prob error rejection: reject sequences whose mean of exp(abs(l)) > {value:g}")
    batch_normalize: bool = option(
        False, flag="--tis-batch-normalize", kind="switch",
        help="Rescale weights to mean 1 over the kept units of the global batch (algorithm 2: once per step; 3: per "
             "micro-batch over DPxCP). Default: off.")
    rejected_denominator: str = option(
        "keep", flag="--tis-rejected-denominator", kind="choice", choices=("keep", "drop"),
        help="Rejected tokens stay in the loss denominator (keep) or are removed from it (drop). Default: keep.")
    loss_agg: str = option(
        "token-mean", flag="--tis-loss-agg", kind="choice", choices=tuple(AGGREGATIONS),
        help="Loss aggregation over the global batch (token-sum: the sum over the global batch's counted tokens, "
             "whatever the DP size). Default: token-mean.")
    eps_clip: float = option(
        0.2, flag="--eps-clip", valid="in [0, 1)", why="so that 1 - eps_clip > 0",
        help="PPO clip epsilon (low side). Default: 0.2.")
    eps_clip_high: float | None = option(
        None, flag="--eps-clip-high", valid=">= 0", help="PPO clip epsilon, high side. Default: = --eps-clip.")
    dual_clip_c: float | None = option(
        None, flag="--eps-clip-c", valid="> 1", why="the dual-clip constant",
        help="Dual-clip constant c > 1 for negative advantages. Default: off.")
    loss_mode: str | None = option(
        None, flag="--tis-loss-mode", kind="choice", choices=tuple(SURROGATES),
        help="Policy-loss surrogate (verl's loss_mode names; docs/semantics.md): reinforce and on_policy fit every "
             "algorithm, the others need a ratio anchor (algorithms 0-2). Default: ppo_clip; reinforce in algorithm 3.")
    kl_coef: float = option(
        0.0, flag="--tis-kl-coef", valid=">= 0",
        help="Coefficient of the reference-KL term added per kept token (needs reference log-probs). Default: 0.")
    kl_estimator: str = option(
        "k3", flag="--tis-kl-estimator", kind="choice", choices=KL_ESTIMATORS,
        help="Reference-KL estimator of d = log pi_theta - log pi_ref: k1 = d, k2 = d^2/2, k3 = exp(-d) - 1 + d, "
             "low_var_kl = clamp(k3, -10, 10) of d clamped to [-20, 20]. Default: k3.")
    kl_importance_weighted: bool = option(
        False, flag="--tis-kl-importance-weighted", kind="switch",
        help="Multiply the KL term by the token's rollout-correction weight (algorithms 2, 3). Default: off.")
    kl_gradient: str = option(
        "direct", flag="--tis-kl-gradient", kind="choice", choices=KL_GRADIENTS,
        help="Gradient of the KL term: direct = the estimator's own gradient beta [w] k'(d) (verl, slime); with_score "
             "adds the score-function term beta [w] k(d) grad log pi_theta (NeMo-RL). Default: direct.")
    entropy_coef: float = option(
        0.0, flag="--tis-entropy-coef", valid=">= 0",
        help="Entropy bonus: subtract this times the policy's entropy per kept token. Default: 0 (off).")
    sapo_tau_pos: float = surrogate_option(
        "sapo", 1.0, flag="--tis-sapo-tau-pos", valid="> 0",
        help="SAPO gate temperature for tokens with positive advantage (--tis-loss-mode sapo). Default: 1.0.")
    sapo_tau_neg: float = surrogate_option(
        "sapo", 1.05, flag="--tis-sapo-tau-neg", valid="> 0",
        help="SAPO gate temperature for tokens with advantage <= 0 (--tis-loss-mode sapo). Default: 1.05.")
    staleness_buckets: float | None = option(
        None, flag="--tis-staleness-buckets", valid="integer in [1, 16]",
        help="Split tis/staleness_<b>/* metrics by per-sequence staleness s (policy versions behind the trainer, "
             "given by the host) into the buckets s = 0, 1, ..., N-1 and s >= N. Default: off.")
    staleness_decay: float | None = option(
        None, flag="--tis-staleness-bound-decay", valid="in (0, 1)",
        help="Tighten the --tis-mode bounds of a sequence s policy versions stale (given by the host) to "
             "log upper_s = g^s log upper, log lower_s = g^s log lower (0 < g < 1; invalid s: bounds 1). "
             "Default: off.")
    clip_cov_ratio: float = surrogate_option(
        "clip_cov", 2e-4, flag="--tis-clip-cov-ratio", valid="in (0, 1)",
        help="Clip-Cov: the fraction of the kept tokens (at least 1) taken out of the loss, at random among those "
             "whose covariance lies in (lb, ub). Default: 0.0002.")
    clip_cov_lb: float = surrogate_option(
        "clip_cov", 1.0, flag="--tis-clip-cov-lb",
        help="Clip-Cov: lower bound of the candidates' covariance (A - mean A)(lp - mean lp). Default: 1.0.")
    clip_cov_ub: float = surrogate_option(
        "clip_cov", 5.0, flag="--tis-clip-cov-ub",
        help="Clip-Cov: upper bound of the candidates' covariance (> --tis-clip-cov-lb). Default: 5.0.")
    kl_cov_ratio: float = surrogate_option(
        "kl_cov", 2e-4, flag="--tis-kl-cov-ratio", valid="in (0, 1)",
        help="KL-Cov: the fraction of the kept tokens (at least 1), those of largest covariance, given the penalty "
             "coef abs(log rho). Default: 0.0002.")
    kl_cov_coef: float = surrogate_option(
        "kl_cov", 1.0, flag="--tis-kl-cov-coef", valid=">= 0",
        help="KL-Cov: the coefficient of abs(log rho) at the selected tokens (verl's ppo_kl_coef). Default: 1.0.")
    safety_bound: float = option(
        20.0, flag="--tis-safety-bound", valid=f"in (0, {MAX_SAFETY_BOUND:g}]",
        why="exp(B) stays far below float32's largest value, exp(88.7)",
        help="Log-quantities are clamped to [-B, B] before exp (0 < B <= 60). Default: 20.")
    kernels: str = option(
        DEFAULT_KERNELS, flag="--tis-kernels", kind="choice", choices=KERNELS,
        help="Code for the log-probs and the correction's token pass: torch, or the Triton kernels (CUDA; where one "
             "cannot run, the torch code with one warning; docs/kernels.md). Default: torch.")
    # global searches (core.search): each a fixed-iteration bisection over the global batch
    target_ess: float | None = option(
        None, flag="--tis-target-ess", valid="in (0, 1)",
        help="With --tis-upper-bound auto: the truncation bound is the largest whose truncated weights reach this "
             "effective sample size (sum w)^2/(N sum w^2) over the global batch (algorithm 2: once per step; "
             "3: per micro-batch over DPxCP). Default: off.")
    m2po_threshold: float | None = threshold(
        flag="--tis-m2po-threshold", valid="> 0", why="the mean of (log r)^2 >= 0",
        help="M2PO: reject the tokens with the largest (log r)^2 until the mean of (log r)^2 over the kept tokens "
             "of the global batch is <= this (the paper and AReaL use 0.04; algorithm 2: once per step; 1, 3: per "
             "micro-batch over DPxCP). Default: off.",
        describe="M2PO: reject the largest (log r)^2 until their global mean over kept tokens <= {value:g}")
    sampling_support: str | None = option(
        None, flag="--tis-sampling-support", kind="choice", choices=SAMPLING_SUPPORT_MODES,
        help="The trainer's log-probs over the full vocabulary (full) or renormalised over each token's top-p / top-k "
             "sampling support (replay; docs/sampling_support.md). Default: replay when the batch carries a support, "
             "full otherwise.")

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        for field, declared in OPTIONS.items():  # each field alone, as declared
            value = getattr(self, field)
            if (problem := declared.problem(value, allow_none=DEFAULTS[field] is None)) is not None:
                raise _bad(field, value, problem)
        # rules between fields
        _check_bounds(self, "")
        if self.rs_level is None and (self.rs_upper is not None or self.rs_lower is not None):
            raise _bad("rs_upper" if self.rs_upper is not None else "rs_lower",
                       self.rs_upper if self.rs_upper is not None else self.rs_lower,
                       "rejection-sampling bounds given but --tis-rs-level is not set")
        if self.rs_level is not None:
            if level_of(self.rs_level).prefix is not None:
                raise _bad("rs_level", self.rs_level, "rejection sampling takes the token, sequence or geometric "
                           "level; a prefix level is a weight level (--tis-level)")
            _check_bounds(self, "rs_")
        self._check_algorithm_combinations()
        self._check_auto_upper()

    def _check_auto_upper(self) -> None:
        """``--tis-upper-bound auto`` needs ``--tis-target-ess`` (and the reverse), truncate mode and weights."""
        if not self.auto_upper:
            if self.target_ess is not None:
                raise _bad("target_ess", self.target_ess, "needs --tis-upper-bound auto")
            return
        if self.target_ess is None:
            raise _bad("upper", self.upper, "needs --tis-target-ess E (the ESS the searched bound reaches)")
        alg = algorithm_of(self.algorithm)
        if not alg.weighted:
            raise _bad("upper", self.upper, f"algorithm {alg.number} applies no importance weights: there is no "
                       "weight to truncate; use --use-tis")
        if self.mode != "truncate":  # the search needs an ESS monotone in the bound over a fixed set of units
            raise _bad("upper", self.upper, f"auto needs --tis-mode truncate ({self.mode}: docs/semantics.md, "
                       "\"Global searches\")")
        if self.staleness_decay is not None:
            raise _bad("staleness_decay", self.staleness_decay, "--tis-upper-bound auto searches one bound for the "
                       "batch's ESS, which tightening it per sequence would change: use one of the two")

    def _check_algorithm_combinations(self) -> None:
        alg = algorithm_of(self.algorithm)
        if not alg.corrects:
            why = ("algorithm 0 (neither --use-rollout-log-probs nor --use-tis) has no rollout log-probs in its "
                   "loss, so it cannot reject; use algorithm 1, 2 or 3")
            if self.rs_level is not None:
                raise _bad("rs_level", self.rs_level, why)
            for field in THRESHOLDS:
                if getattr(self, field) is not None:
                    raise _bad(field, getattr(self, field), why)
            if mode_of(self.mode).masks:
                raise _bad("mode", self.mode, why)
        sur = surrogate_of(self.surrogate)
        if sur.anchored and alg.anchor is None:
            raise _bad("loss_mode", self.loss_mode, f"{sur.name} reads a ratio against an anchor, algorithm 3 has "
                       "none: its weight sg(pi_theta) / pi_rollout is that ratio (the weight would count twice); use "
                       "algorithm 1 (--use-rollout-log-probs, anchor pi_rollout, no weight) or 2 (--use-tis, anchor "
                       "pi_old, weight pi_old / pi_rollout)")
        if self.staleness_decay is not None and not alg.weighted and not (alg.corrects and mode_of(self.mode).masks):
            raise _bad("staleness_decay", self.staleness_decay, f"algorithm {alg.number} applies no weights and "
                       "--tis-mode is not mask: no bound acts to be tightened; use --use-tis or --tis-mode mask")
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise _bad("clip_cov_lb", self.clip_cov_lb, f"must be < --tis-clip-cov-ub = {self.clip_cov_ub!r}")
        if self.kl_gradient == "with_score" and self.kl_estimator == "k2":
            raise _bad("kl_gradient", self.kl_gradient, "k2's own gradient d grad log pi_theta already is the unbiased "
                       "gradient of KL(pi_theta || pi_ref); the score term would add (d^2 / 2) grad log pi_theta")
        if not alg.weighted and self.batch_normalize:
            raise _bad("batch_normalize", True, f"algorithm {alg.number} applies no importance weights "
                       "(weights are identically 1); batch normalisation needs --use-tis")

    # ------------------------------------------------------------------ derived values
    @property
    def algorithm(self) -> int:
        """``use_rollout_log_probs + 2 use_tis`` (``core.algorithms``)."""
        return int(self.use_rollout_log_probs) + 2 * int(self.use_tis)

    @property
    def surrogate(self) -> str:
        """The policy-loss surrogate: ``loss_mode``, or the algorithm's own (``core.algorithms``)."""
        return self.loss_mode if self.loss_mode is not None else algorithm_of(self.algorithm).surrogate

    def inert_options(self) -> list[str]:
        """One line per option that is set but does nothing in this combination (logged once at start-up)."""
        alg, sur = algorithm_of(self.algorithm), surrogate_of(self.surrogate)
        lines = []
        if self.dual_clip_c is not None and not sur.dual_clip:
            lines.append(f"--eps-clip-c does nothing with the {sur.name} surrogate (algorithm {alg.number})")
        if (self.eps_clip != DEFAULTS["eps_clip"] or self.eps_clip_high is not None) and not sur.clips:
            lines.append(f"--eps-clip / --eps-clip-high do nothing with the {sur.name} surrogate, which does not clip")
        mode = mode_of(self.mode)
        if self.lower is not None and not mode.has_lower:
            lines.append(f"--tis-lower-bound does nothing in {mode} mode ({mode.formula})")
        if (self.upper is not None or self.lower is not None) and not alg.weighted and not mode.masks:
            lines.append(f"--tis-upper-bound / --tis-lower-bound do nothing: algorithm {alg.number} applies no "
                         "weights and --tis-mode is not mask")
        if (self.level != DEFAULTS["level"] or self.mode != DEFAULTS["mode"]) and not alg.weighted and not mode.masks:
            lines.append(f"--tis-level {self.level} / --tis-mode {self.mode} do nothing: algorithm {alg.number} "
                         "applies no weights and --tis-mode is not mask (add --use-tis for algorithm 2 or 3)")
        if self.kl_coef == 0.0 and (self.kl_estimator != DEFAULTS["kl_estimator"] or self.kl_importance_weighted):
            lines.append("--tis-kl-estimator / --tis-kl-importance-weighted do nothing while --tis-kl-coef is 0")
        elif self.kl_importance_weighted and not alg.weighted:
            lines.append(f"--tis-kl-importance-weighted does nothing: algorithm {alg.number} applies no weights")
        if self.kl_coef == 0.0 and self.kl_gradient != DEFAULTS["kl_gradient"]:
            lines.append("--tis-kl-gradient does nothing while --tis-kl-coef is 0")
        for field, owner in SURROGATE_OPTIONS.items():
            if owner != sur.name and getattr(self, field) != DEFAULTS[field]:
                lines.append(f"{FLAG_OF[field]} does nothing with the {sur.name} surrogate (it is {owner}'s)")
        if sur.name == "gspo" and max(self.eps_clip, self.eps_high) >= 0.01:
            lines.append(f"gspo clips the sequence's geometric-mean ratio at [1-{self.eps_clip:g}, 1+{self.eps_high:g}]"
                         ": token-level clip ranges rarely clip it (the GSPO paper uses --eps-clip 3e-4 "
                         "--eps-clip-high 4e-4)")
        if sur.name == "dppo_kl" and max(self.eps_clip, self.eps_high) > 0.1:
            lines.append(f"dppo_kl bounds the Bernoulli KL of each token at --eps-clip {self.eps_clip:g} / "
                         f"--eps-clip-high {self.eps_high:g}: the DPPO paper uses 0.05 for the KL (0.2 for dppo_tv)")
        return lines

    def warn_inert(self) -> None:
        """Log :meth:`inert_options` once per configuration (start-up)."""
        if self in _WARNED:
            return
        _WARNED.add(self)
        for line in self.inert_options():
            logger.warning("slime_tis: %s", line)

    @property
    def needs_old_log_probs(self) -> bool:
        """Algorithms 0 and 2 need the recompute of pi_old (``Algorithm.needs_pi_old``)."""
        return algorithm_of(self.algorithm).needs_pi_old

    @property
    def applies_weights(self) -> bool:
        """Algorithms 2 and 3 (``Algorithm.weighted``)."""
        return algorithm_of(self.algorithm).weighted

    @property
    def rejects(self) -> bool:
        """Whether any configured rule can reject tokens or sequences (besides non-finite data)."""
        plan = self.plan
        return plan.mask or plan.rs_level is not None or bool(plan.thresholds)

    @property
    def plan(self) -> Plan:
        """This configuration resolved once into plain bounds and switches (what the core reads)."""
        return _resolve(self)

    @property
    def auto_upper(self) -> bool:
        """``--tis-upper-bound auto``: the truncation bound is searched (``core.search``)."""
        return self.upper == "auto"

    @property
    def upper_bound(self) -> float:
        """The upper bound on r; with ``auto`` the search's upper end ``2 e^B`` (a placeholder the search replaces)."""
        if self.auto_upper:
            return 2.0 * math.exp(self.safety_bound)
        if self.upper is not None:
            return float(self.upper)
        return mode_of(self.mode).default_upper(level_of(self.level))

    @property
    def lower_bound(self) -> float:
        return float(self.lower) if self.lower is not None else 1.0 / self.upper_bound

    @property
    def rs_upper_bound(self) -> float:
        if self.rs_upper is not None:
            return float(self.rs_upper)
        return level_of(self.rs_level).rejection_upper if self.rs_level is not None else DEFAULT_UPPER

    @property
    def rs_lower_bound(self) -> float:
        return float(self.rs_lower) if self.rs_lower is not None else 1.0 / self.rs_upper_bound

    @property
    def eps_high(self) -> float:
        return float(self.eps_clip if self.eps_clip_high is None else self.eps_clip_high)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> TISConfig:
        """A named preset (see ``slime_tis.presets.PRESETS``), with explicit fields overriding it."""
        return cls(**{**preset_fields(name), **overrides})

    @classmethod
    def from_args(cls, args: Any) -> TISConfig:
        """Build from an argparse namespace produced with ``slime_tis.arguments.add_tis_arguments``."""
        return cls(**config_fields_from_args(args))

    def replace(self, **changes: Any) -> TISConfig:
        """A validated copy with some fields changed (unset bounds re-default for the new mode/level)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One block of text with the algorithm and every resolved bound, printed at start-up."""
        lines = [f"slime_tis: algorithm {self.algorithm}: {algorithm_of(self.algorithm).name}"]
        if self.algorithm != 0:
            bounds = (f"lower={self.lower_bound:g} upper={self.upper_bound:g}" if mode_of(self.mode).has_lower
                      else f"upper={self.upper_bound:g} ({self.mode}: no lower bound)")
            if self.auto_upper:
                bounds = f"upper=auto (searched: ESS >= {self.target_ess:g}) ({self.mode}: no lower bound)"
            lines.append(f"  tis: mode={self.mode} level={self.level} bounds on r=pi_train/pi_rollout: {bounds}"
                         + ("" if self.applies_weights else " (weights off: only mask-mode rejection acts)"))
        else:
            lines.append("  tis: off (diagnostics only when rollout log-probs are available)")
        if self.rs_level is not None:
            lines.append(f"  rejection sampling: level={self.rs_level} "
                         f"lower={self.rs_lower_bound:g} upper={self.rs_upper_bound:g}")
        for field, declared in THRESHOLDS.items():
            if getattr(self, field) is not None:
                lines.append("  " + declared.describe.format(value=getattr(self, field)))
        if self.staleness_buckets is not None or self.staleness_decay is not None:
            buckets = None if self.staleness_buckets is None else int(self.staleness_buckets)
            lines.append(f"  staleness (per sequence, from the host): buckets={buckets} "
                         f"bound_decay={self.staleness_decay} (log bound_s = decay^s log bound)")
        lines.append(f"  batch_normalize={self.batch_normalize} rejected_denominator={self.rejected_denominator} "
                     f"loss_agg={self.loss_agg}")
        lines.append(f"  loss={self.surrogate} clip=[1-{self.eps_clip:g}, 1+{self.eps_high:g}] "
                     f"dual_clip_c={self.dual_clip_c} safety_bound={self.safety_bound:g}")
        if self.kl_coef != 0.0 or self.entropy_coef != 0.0:
            lines.append(f"  kl_coef={self.kl_coef:g} kl_estimator={self.kl_estimator} "
                         f"kl_importance_weighted={self.kl_importance_weighted} kl_gradient={self.kl_gradient} "
                         f"entropy_coef={self.entropy_coef:g}")
        lines += [f"  kernels={self.kernels}", *(f"  warning: {line}" for line in self.inert_options())]
        return "\n".join(lines)


#: ``{field: Option}``: every field's declaration, in field order.
OPTIONS: dict[str, Option] = declared_fields(TISConfig, "option")
#: ``{field: Option}``: the rejection thresholds (each drives the row of ``core.rules.RULES`` naming it).
THRESHOLDS: dict[str, Option] = declared_fields(TISConfig, "threshold")
DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(TISConfig)}
#: The option that is not a field: the preset, expanded before the fields' flags.
PRESET_OPTION = Option(
    flag="--tis-preset", kind="choice", choices=tuple(PRESETS), metavar="NAME",
    help="Expand a named preset; explicit flags override it. Presets: "
         + "; ".join(f"{k}: {v[0]}" for k, v in PRESETS.items()),
    readme="Expand a named preset (table below); explicit flags override it. Default: none.")
#: Every flag of ``slime_tis.arguments.add_tis_arguments``, in order (the flag table of docs/reference.md).
ALL_OPTIONS: list[Option] = [*OPTIONS.values(), PRESET_OPTION]
FLAG_OF: dict[str, str] = {field: declared.flag for field, declared in OPTIONS.items()}
DESTS_OF: dict[str, tuple[str, ...]] = {field: declared.dests for field, declared in OPTIONS.items()}
#: ``{field: surrogate}``: the options of one surrogate each (``Plan.surrogate_params`` while it is chosen).
SURROGATE_OPTIONS: dict[str, str] = declared_fields(TISConfig, "surrogate")
SWITCHES = tuple(field for field, declared in OPTIONS.items() if declared.kind == "switch")


@lru_cache(maxsize=64)
def _resolve(config: TISConfig) -> Plan:
    """The :class:`~slime_tis.core.plan.Plan` of a validated configuration (cached)."""
    rejecting = algorithm_of(config.algorithm).corrects
    rs_level = level_of(config.rs_level) if rejecting and config.rs_level is not None else None
    mode = mode_of(config.mode)
    return Plan(
        algorithm=config.algorithm, weighted=config.applies_weights, mode=mode, level=level_of(config.level),
        lower=config.lower_bound, upper=config.upper_bound, log_lower=math.log(config.lower_bound),
        log_upper=math.log(config.upper_bound), mask=mode.masks and rejecting, rs_level=rs_level,
        rs_log_lower=math.log(config.rs_lower_bound) if rs_level else 0.0,
        rs_log_upper=math.log(config.rs_upper_bound) if rs_level else 0.0,
        batch_normalize=config.batch_normalize, drop_rejected=config.rejected_denominator == "drop",
        loss_agg=config.loss_agg, eps_low=float(config.eps_clip), eps_high=config.eps_high,
        dual_clip_c=None if config.dual_clip_c is None else float(config.dual_clip_c), bound=float(config.safety_bound),
        thresholds=tuple((name, float(getattr(config, name))) for name in THRESHOLDS
                         if rejecting and getattr(config, name) is not None),
        token_pass=token_pass_for(config.kernels), surrogate=config.surrogate,
        surrogate_params=tuple((f, float(getattr(config, f))) for f, owner in SURROGATE_OPTIONS.items()
                               if owner == config.surrogate),
        kl_coef=float(config.kl_coef), kl_estimator=config.kl_estimator, kl_gradient=config.kl_gradient,
        kl_importance_weighted=config.kl_importance_weighted and config.applies_weights,
        entropy_coef=float(config.entropy_coef), target_ess=float(config.target_ess) if config.auto_upper else None,
        staleness_buckets=int(config.staleness_buckets or 0),
        staleness_decay=None if config.staleness_decay is None else float(config.staleness_decay),
    )


def config_fields_from_args(args: Any) -> dict[str, Any]:
    """``TISConfig`` fields from a namespace: preset first, then every flag that was given."""
    preset = getattr(args, PRESET_OPTION.dest, None)
    return fields_from_args(OPTIONS, args, preset_fields(preset) if preset else {})
