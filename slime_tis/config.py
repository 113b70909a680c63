"""``TISConfig``: every knob of the correction, validated once at construction.

The algorithm is derived from two switches (SPEC "Algorithms"):

=========================  ==========  =========  ==========================================
``use_rollout_log_probs``  ``use_tis``  algorithm  per-token loss
=========================  ==========  =========  ==========================================
False                      False        0          PPO-clip, old = Megatron recompute
True                       False        1          PPO-clip, old = SGLang log-probs (bypass)
False                      True         2          ``w * ppo_term``, w from ``lp_old - lp_rollout``
True                       True         3          ``-w * A * lp_theta``, w from ``sg(lp_theta) - lp_rollout``
=========================  ==========  =========  ==========================================

Bounds are on ``r = pi_train / pi_rollout`` (never its inverse). Unset bounds take the SPEC
defaults: ``upper = 2.0`` except mask mode at geometric level (and geometric rejection sampling),
where ``upper = 1.001``; ``lower = 1 / upper``. The resolved values are the ``*_bound`` properties;
``describe()`` prints them at start-up.

Every invalid value or combination raises ``ValueError`` naming the field, its command-line flag
and the value.

A rejection rule's threshold is one field declared with :func:`~slime_tis.core.plan.threshold` (flag,
valid range, help, start-up line): its flag (``slime_tis.arguments``), validation, ``describe()`` line,
``from_args`` dests and ``Plan`` value are generated from that declaration (:data:`THRESHOLDS`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from slime_tis.core.plan import Plan, declared_thresholds, resolve, threshold
from slime_tis.kernels.dispatch import DEFAULT_KERNELS, KERNELS
from slime_tis.presets import preset_fields

__all__ = ["TISConfig", "MODES", "LEVELS", "LOSS_AGGS", "DENOMINATORS", "FLAG_OF", "THRESHOLDS",
           "config_fields_from_args", "parse_switch"]

MODES = ("truncate", "clip", "mask")
LEVELS = ("token", "sequence", "geometric")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
DENOMINATORS = ("keep", "drop")

DEFAULT_UPPER = 2.0
DEFAULT_GEOMETRIC_UPPER = 1.001
#: Largest ``--tis-safety-bound``: ``exp(B)`` is float32's largest value at ``B = 88.7``; at 60, ``exp(B) = 1.1e26``
#: leaves a factor 3e12 for the advantages and the sums over tokens in which clamped ratios appear.
MAX_SAFETY_BOUND = 60.0
#: Spellings of a switch's value (case-insensitive strings; YAML quotes keep ``"false"`` a string).
SWITCH_WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}

#: Command-line flag of every field but the thresholds (used in error messages; completed below the class
#: with the thresholds' declared flags).
FLAG_OF = {
    "use_rollout_log_probs": "--use-rollout-log-probs",
    "use_tis": "--use-tis",
    "mode": "--tis-mode",
    "level": "--tis-level",
    "upper": "--tis-upper-bound",
    "lower": "--tis-lower-bound",
    "rs_level": "--tis-rs-level",
    "rs_upper": "--tis-rs-upper-bound",
    "rs_lower": "--tis-rs-lower-bound",
    "batch_normalize": "--tis-batch-normalize",
    "rejected_denominator": "--tis-rejected-denominator",
    "loss_agg": "--tis-loss-agg",
    "eps_clip": "--eps-clip",
    "eps_clip_high": "--eps-clip-high",
    "dual_clip_c": "--eps-clip-c",
    "safety_bound": "--tis-safety-bound",
    "kernels": "--tis-kernels",
}

#: TISConfig field -> argparse dests that may carry it (first = ours; others = host aliases such as slime's);
#: the thresholds' dests are added below the class.
DESTS_OF: dict[str, tuple[str, ...]] = {
    "use_rollout_log_probs": ("use_rollout_log_probs", "use_rollout_logprobs"),
    "use_tis": ("use_tis",),
    "mode": ("tis_mode",),
    "level": ("tis_level",),
    "upper": ("tis_upper_bound",),
    "lower": ("tis_lower_bound",),
    "rs_level": ("tis_rs_level",),
    "rs_upper": ("tis_rs_upper_bound",),
    "rs_lower": ("tis_rs_lower_bound",),
    "batch_normalize": ("tis_batch_normalize",),
    "rejected_denominator": ("tis_rejected_denominator",),
    "loss_agg": ("tis_loss_agg",),
    "eps_clip": ("eps_clip",),
    "eps_clip_high": ("eps_clip_high",),
    "dual_clip_c": ("eps_clip_c",),
    "safety_bound": ("tis_safety_bound",),
    "kernels": ("tis_kernels",),
}
SWITCHES = ("use_rollout_log_probs", "use_tis", "batch_normalize")

ALGORITHM_NAMES = {
    0: "standard PPO (old = Megatron recompute)",
    1: "bypass PPO (old = rollout log-probs)",
    2: "decoupled PPO (w = pi_old / pi_rollout)",
    3: "REINFORCE + IS (w = sg(pi_theta) / pi_rollout)",
}


def _bad(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{FLAG_OF.get(field, field)} ({field}) = {value!r}: {why}")


def _check_choice(field: str, value: Any, choices: tuple[str, ...], allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value not in choices:
        raise _bad(field, value, f"must be one of {', '.join(choices)}" + (" or None" if allow_none else ""))


def _check_number(field: str, value: Any, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(field, value, "must be a finite number")


def parse_switch(name: str, value: Any) -> bool:
    """A switch's value from a flag, a preset or a YAML key: a bool, 0 / 1, or one of :data:`SWITCH_WORDS`.

    Anything else (``"flase"``, ``2``, ``[]``) raises ``ValueError`` naming ``name`` and the value, so that a
    quoted ``"false"`` can never turn a switch on.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in SWITCH_WORDS:
        return SWITCH_WORDS[value.strip().lower()]
    raise ValueError(f"{name} = {value!r}: expected a boolean (true/false, yes/no, on/off or 1/0)")


def _check_upper(field: str, upper: float) -> None:
    """The upper bound alone (before ``1 / upper``, the default lower bound, is formed)."""
    if upper < 1:
        raise _bad(field, upper, "bounds must include 1 (upper >= 1); bounds are on r = pi_train/pi_rollout")


def _check_bounds(lower_field: str, lower: float, upper_field: str, upper: float) -> None:
    """``0 < lower < upper`` and ``lower <= 1`` (``upper`` already passed :func:`_check_upper`)."""
    if lower <= 0:
        raise _bad(lower_field, lower, "ratio bounds must be > 0")
    if lower >= upper:
        raise _bad(lower_field, lower, f"must be < {FLAG_OF[upper_field]} = {upper!r}")
    if lower > 1:
        raise _bad(lower_field, lower, "bounds must include 1 (lower <= 1); bounds are on r = pi_train/pi_rollout")


@dataclass(frozen=True)
class TISConfig:
    """Rollout-correction configuration (validated in ``__post_init__``).

    Attributes:
        use_rollout_log_probs: use SGLang log-probs in the loss instead of a recompute (alg 1, 3).
        use_tis: apply importance weights (alg 2, 3).
        mode: ``truncate`` (w = min(r, upper)), ``clip`` (w = clamp(r, lower, upper)) or ``mask``
            (w = r, units with r outside [lower, upper] rejected).
        level: ``token`` (L_t = l_t), ``sequence`` (L = sum_t l_t) or ``geometric`` (L = mean_t l_t).
        upper, lower: bounds on r for the mode; ``None`` = SPEC default.
        rs_level: optional rejection-sampling level (independent of the mode); ``None`` = off.
        rs_upper, rs_lower: rejection-sampling bounds on r at ``rs_level``; ``None`` = SPEC default.
        veto_threshold, seq_mean_k3_threshold, seq_max_k3_threshold: rejection thresholds (``None`` = off),
            each declared with its flag, valid range and meaning at the field (rule rows: ``core.rules``).
        batch_normalize: rescale applied weights to mean 1 over the kept units of the global batch.
        rejected_denominator: ``keep`` (rejected tokens stay in the loss denominator) or ``drop``.
        loss_agg: ``token-mean``, ``seq-mean-token-mean`` or ``seq-mean-token-sum``.
        eps_clip, eps_clip_high: PPO clip range ``[1 - eps_clip, 1 + eps_clip_high]``
            (``eps_clip_high=None`` means symmetric).
        dual_clip_c: dual-clip constant ``c > 1`` for negative advantages; ``None`` = off.
        safety_bound: ``B``; log-quantities are clamped to ``[-B, B]`` before ``exp``.
        kernels: ``"torch"`` (default) or ``"triton"``: which code computes the log-probs (from logits or, fused,
            from the hidden states) and the correction's token pass; the one switch for every Triton kernel
            (``slime_tis.kernels.dispatch``: where a kernel cannot run, the torch code with one warning).
    """

    use_rollout_log_probs: bool = False
    use_tis: bool = False
    mode: str = "truncate"
    level: str = "token"
    upper: float | None = None
    lower: float | None = None
    rs_level: str | None = None
    rs_upper: float | None = None
    rs_lower: float | None = None
    # rejection thresholds: one declaration each (rule: the row naming the field in core.rules.RULES)
    veto_threshold: float | None = threshold(
        flag="--tis-veto-threshold", valid="in (0, 1)",
        help="Reject a whole sequence if any valid token has raw ratio < v (0<v<1), with or without "
             "rejection sampling. Default: off.",
        describe="veto: reject sequences with any token ratio < {value:g}")
    seq_mean_k3_threshold: float | None = threshold(
        flag="--tis-seq-mean-k3-threshold", valid="> 0", why="k3 = r - 1 - log r >= 0",
        help="Reject a sequence whose mean over valid tokens of k3 = r - 1 - log r exceeds this (> 0), "
             "as verl's seq_mean_k3. Default: off.",
        describe="k3 rejection: reject sequences whose mean of k3 = r - 1 - log r > {value:g}")
    seq_max_k3_threshold: float | None = threshold(
        flag="--tis-seq-max-k3-threshold", valid="> 0", why="k3 = r - 1 - log r >= 0",
        help="Reject a sequence whose max over valid tokens of k3 = r - 1 - log r exceeds this (> 0), "
             "as verl's seq_max_k3. Default: off.",
        describe="k3 rejection: reject sequences whose max of k3 = r - 1 - log r > {value:g}")
    batch_normalize: bool = False
    rejected_denominator: str = "keep"
    loss_agg: str = "token-mean"
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    dual_clip_c: float | None = None
    safety_bound: float = 20.0
    kernels: str = DEFAULT_KERNELS

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        for field in ("use_rollout_log_probs", "use_tis", "batch_normalize"):
            if not isinstance(getattr(self, field), bool):
                raise _bad(field, getattr(self, field), "must be a bool")
        _check_choice("mode", self.mode, MODES)
        _check_choice("level", self.level, LEVELS)
        _check_choice("rs_level", self.rs_level, LEVELS, allow_none=True)
        _check_choice("rejected_denominator", self.rejected_denominator, DENOMINATORS)
        _check_choice("loss_agg", self.loss_agg, LOSS_AGGS)
        _check_choice("kernels", self.kernels, KERNELS)
        for field in ("upper", "lower", "rs_upper", "rs_lower", *THRESHOLDS, "eps_clip_high", "dual_clip_c"):
            _check_number(field, getattr(self, field))
        for field in ("eps_clip", "safety_bound"):
            _check_number(field, getattr(self, field), allow_none=False)

        _check_upper("upper", self.upper_bound)
        _check_bounds("lower", self.lower_bound, "upper", self.upper_bound)
        if self.rs_level is None and (self.rs_upper is not None or self.rs_lower is not None):
            raise _bad("rs_upper" if self.rs_upper is not None else "rs_lower",
                       self.rs_upper if self.rs_upper is not None else self.rs_lower,
                       "rejection-sampling bounds given but --tis-rs-level is not set")
        if self.rs_level is not None:
            _check_upper("rs_upper", self.rs_upper_bound)
            _check_bounds("rs_lower", self.rs_lower_bound, "rs_upper", self.rs_upper_bound)
        for field, declared in THRESHOLDS.items():
            value = getattr(self, field)
            if value is not None and (problem := declared.problem(value)) is not None:
                raise _bad(field, value, problem)
        if not 0 <= self.eps_clip < 1:
            raise _bad("eps_clip", self.eps_clip, "must lie in [0, 1) so that 1 - eps_clip > 0")
        if self.eps_clip_high is not None and self.eps_clip_high < 0:
            raise _bad("eps_clip_high", self.eps_clip_high, "must be >= 0")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise _bad("dual_clip_c", self.dual_clip_c, "dual-clip constant must be > 1")
        if not 0 < self.safety_bound <= MAX_SAFETY_BOUND:
            raise _bad("safety_bound", self.safety_bound,
                       f"must lie in (0, {MAX_SAFETY_BOUND:g}]: exp(B) must stay far below float32's largest value "
                       f"(exp(88.7)) so that clamped ratios, their products and sums stay finite")
        self._check_algorithm_combinations()

    def _check_algorithm_combinations(self) -> None:
        alg = self.algorithm
        if alg == 0:
            why = ("algorithm 0 (neither --use-rollout-log-probs nor --use-tis) has no rollout log-probs in its "
                   "loss, so it cannot reject; use algorithm 1, 2 or 3")
            if self.rs_level is not None:
                raise _bad("rs_level", self.rs_level, why)
            for field in THRESHOLDS:
                if getattr(self, field) is not None:
                    raise _bad(field, getattr(self, field), why)
            if self.mode == "mask":
                raise _bad("mode", self.mode, why)
        if alg in (0, 1) and self.batch_normalize:
            raise _bad("batch_normalize", True, f"algorithm {alg} applies no importance weights "
                       "(weights are identically 1); batch normalisation needs --use-tis")

    # ------------------------------------------------------------------ derived values
    @property
    def algorithm(self) -> int:
        """0..3 from (use_rollout_log_probs, use_tis), see the module table."""
        return int(self.use_rollout_log_probs) + 2 * int(self.use_tis)

    @property
    def algorithm_name(self) -> str:
        return ALGORITHM_NAMES[self.algorithm]

    @property
    def needs_old_log_probs(self) -> bool:
        """Algorithms 0 and 2 need the Megatron recompute of pi_old; 1 and 3 skip it."""
        return self.algorithm in (0, 2)

    @property
    def applies_weights(self) -> bool:
        """Importance weights multiply the loss (algorithms 2 and 3)."""
        return self.use_tis

    @property
    def rejects(self) -> bool:
        """Whether any configured rule can reject tokens or sequences (besides non-finite data)."""
        return self.algorithm != 0 and (
            self.mode == "mask" or self.rs_level is not None
            or any(getattr(self, field) is not None for field in THRESHOLDS)
        )

    @property
    def plan(self) -> Plan:
        """This configuration resolved once into plain bounds and switches (what the core reads)."""
        return resolve(self)

    @property
    def upper_bound(self) -> float:
        if self.upper is not None:
            return float(self.upper)
        return DEFAULT_GEOMETRIC_UPPER if (self.mode == "mask" and self.level == "geometric") else DEFAULT_UPPER

    @property
    def lower_bound(self) -> float:
        return float(self.lower) if self.lower is not None else 1.0 / self.upper_bound

    @property
    def rs_upper_bound(self) -> float:
        if self.rs_upper is not None:
            return float(self.rs_upper)
        return DEFAULT_GEOMETRIC_UPPER if self.rs_level == "geometric" else DEFAULT_UPPER

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
        lines = [f"slime_tis: algorithm {self.algorithm}: {self.algorithm_name}"]
        if self.algorithm != 0 or self.use_tis:
            bounds = (f"upper={self.upper_bound:g} (truncate: no lower bound)" if self.mode == "truncate"
                      else f"lower={self.lower_bound:g} upper={self.upper_bound:g}")
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
        lines.append(f"  batch_normalize={self.batch_normalize} rejected_denominator={self.rejected_denominator} "
                     f"loss_agg={self.loss_agg}")
        lines.append(f"  ppo clip=[1-{self.eps_clip:g}, 1+{self.eps_high:g}] dual_clip_c={self.dual_clip_c} "
                     f"safety_bound={self.safety_bound:g}")
        lines.append(f"  kernels={self.kernels}" + (" (Triton: not yet measured on a GPU; torch code where it "
                                                     "cannot run, with a warning)" if self.kernels == "triton" else ""))
        return "\n".join(lines)


#: ``{field: Threshold}``: every rejection threshold declared on :class:`TISConfig`, in field order.
THRESHOLDS = declared_thresholds(TISConfig)
for _field, _declared in THRESHOLDS.items():
    FLAG_OF[_field] = _declared.flag
    DESTS_OF[_field] = (_declared.dest, *_declared.aliases)
assert set(DESTS_OF) == set(FLAG_OF) == {f.name for f in dataclasses.fields(TISConfig)}, "every field needs a flag"


def config_fields_from_args(args: Any) -> dict[str, Any]:
    """``TISConfig`` fields from a namespace: preset first, then every flag that was given."""
    preset = getattr(args, "tis_preset", None)
    fields: dict[str, Any] = preset_fields(preset) if preset else {}
    for field, dests in DESTS_OF.items():
        given = {d: getattr(args, d) for d in dests if getattr(args, d, None) is not None}
        if field in SWITCHES:  # strictly parsed: a YAML "false" (a string) must not turn the switch on
            if any([parse_switch(f"{FLAG_OF[field]} ({d})", v) for d, v in given.items()]):
                fields[field] = True
            else:
                fields.setdefault(field, False)
        elif given:
            fields[field] = next(iter(given.values()))
    return fields
