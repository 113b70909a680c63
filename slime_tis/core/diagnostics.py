"""The ``tis/`` statistics of one micro-batch, gathered in one pass per domain.

Builds the raw sums/minima/maxima that :class:`slime_tis.core.metrics.MetricStats` turns into the
metrics documented there. The set of keys depends only on the configuration (never on the data),
so every rank contributes the same keys to the cross-rank reduction.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slime_tis.config import TISConfig
from slime_tis.core.metrics import MetricStats, column_sums, masked_max, masked_min
from slime_tis.core.ratios import PackedRatios
from slime_tis.core.rejection import Rejection
from slime_tis.core.weights import outside_bounds

__all__ = ["tis_statistics"]


def tis_statistics(
    config: TISConfig,
    ratios: PackedRatios,
    rejection: Rejection,
    unit_weights: Tensor,
    kept_units: Tensor,
    batch_norm_factor: Tensor | None,
) -> MetricStats:
    """Raw ``tis.*`` statistics (see ``slime_tis.core.metrics`` for the metric formulas).

    Args:
        unit_weights: applied weights per unit (``[T]`` or ``[n_seq]``), after bounds and batch-norm.
        kept_units: bool mask of units that survived rejection (same shape).
        batch_norm_factor: the factor applied (scalar tensor) or ``None`` when batch-norm is off.
    """
    bound = config.safety_bound
    token_ok, seq_ok = ratios.token_ok, ratios.seq_ok
    zero = torch.zeros((), dtype=torch.float32, device=token_ok.device)

    # ---- token domain
    log_r = ratios.log_ratio.clamp(-bound, bound)  # 0 outside token_ok
    r_tok = torch.exp(log_r)
    tok: dict[str, Tensor] = {
        "tis.n_tok_valid": ratios.valid,
        "tis.n_tok": token_ok,
        "tis.n_tok_rejected": ratios.valid & ~rejection.keep,
        "tis.kl_sum": ratios.lp_rollout - ratios.lp_train,
        "tis.k3_sum": r_tok - 1.0 - log_r,  # exactly 0 where log_r = 0
        "tis.r2_sum": torch.where(token_ok, r_tok * r_tok, zero),
    }

    # ---- sequence domain
    # mean_t lp_rollout - mean_t lp_train, from the well-conditioned log-ratio sum (differencing the two
    # means would cancel most float32 digits on long sequences)
    mean_diff = torch.where(seq_ok, -ratios.seq_log_ratio_sum / ratios.seq_count.clamp(min=1.0), zero)
    seq_log_sum = ratios.seq_log_ratio_sum.clamp(-bound, bound)
    seq: dict[str, Tensor] = {
        "tis.n_seq_valid": ratios.seq_has_tokens,
        "tis.n_seq": seq_ok,
        "tis.n_seq_nonfinite": ratios.seq_nonfinite,
        "tis.n_seq_rejected": rejection.seq_rejected & ratios.seq_has_tokens,
        "tis.train_log_ppl_sum": -ratios.seq_mean_lp_train,
        "tis.train_ppl_sum": torch.where(seq_ok, torch.exp((-ratios.seq_mean_lp_train).clamp(-bound, bound)), zero),
        "tis.rollout_log_ppl_sum": -ratios.seq_mean_lp_rollout,
        "tis.rollout_ppl_sum": torch.where(
            seq_ok, torch.exp((-ratios.seq_mean_lp_rollout).clamp(-bound, bound)), zero
        ),
        "tis.log_ppl_diff_sum": mean_diff,
        "tis.log_ppl_abs_diff_sum": mean_diff.abs(),
        "tis.ppl_ratio_sum": torch.where(seq_ok, torch.exp(mean_diff.clamp(-bound, bound)), zero),
        "tis.chi2_seq_sum": torch.where(seq_ok, torch.exp(2.0 * seq_log_sum), zero),
    }
    if config.veto_threshold is not None:
        seq["tis.veto_count"] = ratios.seq_veto

    # ---- level units: ratio before bounds, mode statistics, applied weights
    per_seq_units = config.level != "token"
    units = seq if per_seq_units else tok
    unit_ok = ratios.unit_ok(config.level)
    level_log = ratios.level_log_ratio(config.level)
    r_unit = torch.where(unit_ok, torch.exp(level_log.clamp(-bound, bound)), zero)
    units["tis.n_units"] = unit_ok
    units["tis.ratio_sum"] = r_unit
    units["tis.ratio_sq_sum"] = r_unit * r_unit
    if config.applies_weights and config.mode in ("truncate", "clip"):
        below, above = outside_bounds(level_log, config.lower_bound, config.upper_bound)
        if config.mode == "truncate":
            units["tis.truncate_count"] = above & unit_ok
        else:
            units["tis.clip_low_count"] = below & unit_ok
            units["tis.clip_high_count"] = above & unit_ok
    if rejection.mode_below is not None:
        units["tis.mask_low_count"] = rejection.mode_below
        units["tis.mask_high_count"] = rejection.mode_above
    w_kept = torch.where(kept_units, unit_weights, zero)
    units["tis.n_kept_units"] = kept_units
    units["tis.w_sum"] = w_kept
    units["tis.w_sq_sum"] = w_kept * w_kept

    mins = {"tis.log_ratio_min": masked_min(level_log, unit_ok), "tis.weight_min": masked_min(unit_weights, kept_units)}
    maxs = {"tis.log_ratio_max": masked_max(level_log, unit_ok), "tis.weight_max": masked_max(unit_weights, kept_units)}

    # ---- rejection sampling units
    if config.rs_level is not None:
        rs_units = seq if config.rs_level != "token" else tok
        rs_units["tis.n_rs_units"] = ratios.unit_ok(config.rs_level)
        rs_units["tis.rs_low_count"] = rejection.rs_below
        rs_units["tis.rs_high_count"] = rejection.rs_above

    seq_sums = column_sums(seq)
    if batch_norm_factor is not None:
        seq_sums["tis.bn_factor_sum"] = batch_norm_factor.double().reshape(())
        seq_sums["tis.bn_calls"] = torch.ones((), dtype=torch.float64, device=token_ok.device)
    return MetricStats(token_sums=column_sums(tok), seq_sums=seq_sums, mins=mins, maxs=maxs)
