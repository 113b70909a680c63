"""The ``tis/`` statistics of one micro-batch.

Builds the raw sums/minima/maxima that :class:`slime_tis.core.metrics.MetricStats` turns into the
metrics documented there. The set of keys depends only on the configuration (never on the data),
so every rank contributes the same keys to the cross-rank reduction.

Token-domain sums (over this rank's valid tokens of finite sequences, summed over DP x CP) come
from this rank's per-sequence partial sums ``ratios.seq_sums_local`` masked by the (reduced)
sequence flags, and the ratio moments from ``ratios.token_moments()``::

    lc = clamp(l, -B, B),  e = expm1(lc) = r - 1
    k3:  sum (r - 1 - log r) = sum (e - lc)
    r^2: sum r^2 = sum e^2 + 2 sum e + n          (no float32 rounding of r near 1)

Sequence-domain sums (one value per sequence, replicated over CP) are column sums over the
``[n_seq]`` per-sequence values. Ratio moments of sequence units use ``e = expm1(clamp(L))`` too.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slime_tis.config import TISConfig
from slime_tis.core.metrics import MetricStats, masked_extremes
from slime_tis.core.ratios import ROW_LOG_RATIO, ROW_LP_ROLLOUT, ROW_VALID, PackedRatios
from slime_tis.core.rejection import Rejection
from slime_tis.core.weights import outside_bounds

__all__ = ["tis_statistics"]

F64 = torch.float64


def _count(mask: Tensor) -> Tensor:
    return torch.count_nonzero(mask).to(F64)


class _Sums:
    """Named statistics of one domain: scalars, bool columns (counted) and float columns (summed).

    Token-domain columns (``[T]``, ``per_column=True``) are reduced as they arrive, one reduction
    each; sequence-domain columns (``[n_seq]``) are stacked and reduced together.
    """

    def __init__(self, per_column: bool) -> None:
        self.per_column = per_column
        self.scalars: dict[str, Tensor] = {}
        self.counts: dict[str, Tensor] = {}
        self.values: dict[str, Tensor] = {}
        self.order: list[str] = []

    def __getitem__(self, name: str) -> Tensor:
        return self.scalars[name]

    def __setitem__(self, name: str, value: Tensor) -> None:
        self.order.append(name)
        if value.dim() == 0:
            self.scalars[name] = value if value.dtype == F64 else value.to(F64)
        elif self.per_column:
            self.scalars[name] = _count(value) if value.dtype == torch.bool else value.sum().to(F64)
        elif value.dtype == torch.bool:
            self.counts[name] = value
        else:
            self.values[name] = value

    def totals(self) -> dict[str, Tensor]:
        """Every statistic as a float64 scalar: one reduction for all counts, one for all float columns."""
        out = dict(self.scalars)
        if self.counts:
            out.update(zip(self.counts, torch.stack(list(self.counts.values())).sum(1).to(F64).unbind(0)))
        if self.values:
            stacked = torch.stack([v.to(F64) for v in self.values.values()])
            out.update(zip(self.values, stacked.sum(1).unbind(0)))
        return {name: out[name] for name in self.order}


def tis_statistics(
    config: TISConfig,
    ratios: PackedRatios,
    rejection: Rejection,
    unit_weights: Tensor,
    kept_units: Tensor,
    kept_weights: Tensor,
    batch_norm_factor: Tensor | None,
) -> MetricStats:
    """Raw ``tis.*`` statistics (see ``slime_tis.core.metrics`` for the metric formulas).

    Args:
        unit_weights: applied weights per unit (``[T]`` or ``[n_seq]``), after bounds and batch-norm.
        kept_units: bool mask of units that survived rejection (same shape).
        kept_weights: ``unit_weights`` on ``kept_units``, 0 elsewhere.
        batch_norm_factor: the factor applied (scalar tensor) or ``None`` when batch-norm is off.

    ``ratios`` must come from ``packed_ratios(..., moments_bound=config.safety_bound)``.
    """
    bound = config.safety_bound
    seq_ok, has = ratios.seq_ok, ratios.seq_has_tokens
    device = seq_ok.device
    zero = torch.zeros((), dtype=F64, device=device)

    # ---- token domain (this rank's tokens)
    local = ratios.seq_sums_local
    # [3, k] column sums over: all sequences, finite sequences, kept sequences (one GEMM)
    domains = torch.stack([torch.ones_like(seq_ok), seq_ok, seq_ok & ~rejection.seq_rejected]).to(F64) @ local
    n_valid, n_tok = domains[0, ROW_VALID], domains[1, ROW_VALID]
    local_ok = domains[1]
    e_sum, e2_sum, k3_sum = ratios.token_moments(local_ok).unbind(0)
    tok = _Sums(per_column=True)
    tok["tis.n_tok_valid"] = n_valid
    tok["tis.n_tok"] = n_tok
    # kept tokens = the valid tokens of kept sequences, less those of a token-level rule
    n_kept = domains[2, ROW_VALID] if rejection.token_rejected is None else _count(rejection.keep)
    tok["tis.n_tok_rejected"] = n_valid - n_kept
    tok["tis.kl_sum"] = -local_ok[ROW_LOG_RATIO]
    tok["tis.k3_sum"] = k3_sum  # sum (e - lc), exactly 0 where l = 0
    tok["tis.r2_sum"] = e2_sum + 2.0 * e_sum + n_tok

    # ---- sequence domain
    full = ratios.seq_sums
    count = full[:, ROW_VALID].clamp(min=1.0)
    log_sum = torch.where(seq_ok, full[:, ROW_LOG_RATIO], zero)
    lr_mean = torch.where(seq_ok, full[:, ROW_LP_ROLLOUT], zero) / count
    # mean_t lp_rollout - mean_t lp_train from the well-conditioned log-ratio sum (differencing the two
    # means would cancel most float32 digits on long sequences)
    mean_diff = -log_sum / count
    # exponents: training log-ppl (-mean_t lp_train), rollout log-ppl, log_ppl_diff, sum_t l (chi2_seq)
    logs = torch.stack([mean_diff - lr_mean, -lr_mean, mean_diff, log_sum])
    exponents = logs.clamp(-bound, bound)
    exponents[3] *= 2.0  # chi2_seq: exp(2 clamp(sum_t l, -B, B))
    exps = torch.where(seq_ok, exponents.exp_(), zero)
    seq = _Sums(per_column=False)
    seq["tis.n_seq_valid"] = has
    seq["tis.n_seq"] = seq_ok
    seq["tis.n_seq_nonfinite"] = ratios.seq_nonfinite
    seq["tis.n_seq_rejected"] = rejection.seq_rejected & has
    seq["tis.train_log_ppl_sum"] = logs[0]
    seq["tis.train_ppl_sum"] = exps[0]
    seq["tis.rollout_log_ppl_sum"] = logs[1]
    seq["tis.rollout_ppl_sum"] = exps[1]
    seq["tis.log_ppl_diff_sum"] = mean_diff
    seq["tis.log_ppl_abs_diff_sum"] = mean_diff.abs()
    seq["tis.ppl_ratio_sum"] = exps[2]
    seq["tis.chi2_seq_sum"] = exps[3]
    if config.veto_threshold is not None:
        seq["tis.veto_count"] = ratios.seq_veto

    # ---- level units: ratio before bounds, mode statistics, applied weights
    per_seq_units = config.level != "token"
    units = seq if per_seq_units else tok
    level_log = ratios.level_log_ratio(config.level)  # 0 outside the units' domain
    if per_seq_units:
        e_unit = torch.where(seq_ok, torch.expm1(level_log.to(F64).clamp(-bound, bound)), zero)
        units["tis.n_units"] = seq_ok
        units["tis.ratio_sum"] = e_unit + seq_ok
        units["tis.ratio_sq_sum"] = e_unit * (e_unit + 2.0) + seq_ok
    else:
        units["tis.n_units"] = n_tok
        units["tis.ratio_sum"] = e_sum + n_tok
        units["tis.ratio_sq_sum"] = tok["tis.r2_sum"]
    if config.applies_weights and config.mode in ("truncate", "clip"):
        below, above = outside_bounds(level_log, config.lower_bound, config.upper_bound)
        if config.mode == "truncate":
            units["tis.truncate_count"] = above
        else:
            units["tis.clip_low_count"] = below
            units["tis.clip_high_count"] = above
    if rejection.mode_below is not None:
        units["tis.mask_low_count"] = rejection.mode_below
        units["tis.mask_high_count"] = rejection.mode_above
    units["tis.n_kept_units"] = kept_units
    units["tis.w_sum"] = kept_weights
    units["tis.w_sq_sum"] = kept_weights * kept_weights if per_seq_units else torch.dot(kept_weights, kept_weights)

    lows, highs = masked_extremes(torch.stack([level_log.float(), unit_weights.float()]),
                                  torch.stack([ratios.unit_ok(config.level), kept_units]))
    mins = dict(zip(("tis.log_ratio_min", "tis.weight_min"), lows.unbind(0)))
    maxs = dict(zip(("tis.log_ratio_max", "tis.weight_max"), highs.unbind(0)))

    # ---- rejection sampling units
    if config.rs_level is not None:
        rs_units = seq if config.rs_level != "token" else tok
        rs_units["tis.n_rs_units"] = seq_ok if config.rs_level != "token" else n_tok
        rs_units["tis.rs_low_count"] = rejection.rs_below
        rs_units["tis.rs_high_count"] = rejection.rs_above

    if batch_norm_factor is not None:
        seq["tis.bn_factor_sum"] = batch_norm_factor.to(F64).reshape(())
        seq["tis.bn_calls"] = torch.ones((), dtype=F64, device=device)
    return MetricStats(token_sums=tok.totals(), seq_sums=seq.totals(), mins=mins, maxs=maxs)
