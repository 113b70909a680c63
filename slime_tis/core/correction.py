"""``compute_tis``: importance weights, keep mask and diagnostics for one packed micro-batch.

Formulas (all detached; B the safety bound)::

    l_t      = lp_train_t - lp_rollout_t                       (valid tokens; non-finite -> sequence rejected)
    L_u      = level log-ratio (token / sequence sum / geometric mean)           -- core.ratios
    w_u      = truncate / clip / mask of exp(clamp(L_u, -B, B))                  -- core.weights
    keep_t   = valid and not rejected (mask mode, RS, veto, non-finite)          -- core.rejection
    w_u     *= n_kept_units / sum_{kept u} w_u      (if batch_normalize)
    w_t      = w_{u(t)}  (0 at invalid tokens and tokens of non-finite sequences)
    stats    = tis/* diagnostics on the original mask                            -- core.diagnostics

Order of work (two phases over the ``T`` tokens, one context-parallel reduction):

1. token pass + per-sequence sums (``ratios.packed_ratios``; on CPU tensors one fused pass that also
   sums the token-domain ratio moments), one ``reducer.sequence_sum``;
2. sequence-level rules and weights on ``[n_seq]`` arrays;
3. one broadcast of the per-sequence flags and weights to the tokens (``SequenceCode``), then the
   token-level rules, the token weights and, on the torch path, the token-domain moments.

Algorithms 0 and 1 apply no weight (``w = 1``); algorithm 0 rejects nothing but non-finite data.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from slime_tis.config import TISConfig
from slime_tis.core import native
from slime_tis.core.diagnostics import tis_statistics
from slime_tis.core.metrics import MetricStats
from slime_tis.core.packing import check_packed
from slime_tis.core.ratios import PackedRatios, packed_ratios
from slime_tis.core.reducer import LocalReducer, Reducer
from slime_tis.core.rejection import sequence_rejections, token_rejections
from slime_tis.core.segments import Segments, select, valid_bits
from slime_tis.core.weights import bounded_weights

__all__ = ["TISResult", "compute_tis", "tis_on_segments", "as_valid_mask", "scalar_tensor", "normalisation_factor"]


@dataclass
class TISResult:
    """Output of :func:`compute_tis` for one micro-batch (shapes ``[T]`` unless noted).

    Attributes:
        weights: float32 applied importance weights, detached; 0 at invalid tokens and at tokens
            of non-finite sequences; unchanged by rejection.
        keep_mask: bool, valid tokens that survived every rejection rule.
        stats: ``tis.*`` statistics (see ``slime_tis.core.metrics``).
        norm_sum, norm_count: scalar float32 tensors, this micro-batch's (local, unreduced) sum of
            the unnormalised weights over kept units and the number of kept units. Summed over all
            micro-batches and ranks they give the global batch-normalisation factor
            ``norm_count / norm_sum`` (units are sequences at sequence/geometric level: reduce
            those over data-parallel ranks only).
        ratios: the per-token / per-sequence log-ratio bookkeeping (for losses and adapters).
    """

    weights: Tensor
    keep_mask: Tensor
    stats: MetricStats
    norm_sum: Tensor
    norm_count: Tensor
    ratios: PackedRatios


def as_valid_mask(loss_mask: Tensor) -> Tensor:
    """Loss mask as bool (any nonzero entry is a trainable token)."""
    return loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0


def compute_tis(
    config: TISConfig,
    lp_train: Tensor,
    lp_rollout: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    *,
    reducer: Reducer | None = None,
    batch_norm_factor: Tensor | float | None = None,
    extra_finite: tuple[Tensor, ...] = (),
) -> TISResult:
    """Importance weights of ``pi_train / pi_rollout`` with rejection and diagnostics.

    Args:
        config: the validated configuration.
        lp_train: ``[T]`` log-probs of the training-side policy (pi_old in algorithms 0 and 2,
            sg(pi_theta) in algorithms 1 and 3); any float dtype, computed in float32, detached.
        lp_rollout: ``[T]`` rollout-engine (SGLang) log-probs.
        loss_mask: ``[T]`` bool or 0/1 mask of trainable tokens.
        cu_seqlens: ``[n_seq + 1]`` integer offsets of the packed sequences.
        reducer: distributed reductions (default: single process).
        batch_norm_factor: a precomputed global factor (algorithm 2 computes it once per step from
            ``norm_count / norm_sum``); ``None`` with ``batch_normalize`` normalises over this call's
            data reduced over ``reducer`` (algorithm 3: per micro-batch over DP x CP).
        extra_finite: more ``[T]`` tensors whose non-finite valid entries reject their sequence.

    Raises:
        ValueError: on shape, length, device or dtype mismatches (naming the tensors).
    """
    reducer = reducer or LocalReducer()
    n_tokens = check_packed(
        {"lp_train": lp_train, "lp_rollout": lp_rollout, "loss_mask": loss_mask,
         **{f"extra_finite[{i}]": t for i, t in enumerate(extra_finite)}},
        cu_seqlens,
    )
    for name, t in (("lp_train", lp_train), ("lp_rollout", lp_rollout)):
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor of log-probs, got {t.dtype}")
    segments = Segments(cu_seqlens, n_tokens, lp_train.device)
    return tis_on_segments(config, lp_train, lp_rollout, as_valid_mask(loss_mask), segments, reducer,
                           batch_norm_factor=batch_norm_factor, extra_finite=extra_finite)


def tis_on_segments(
    config: TISConfig,
    lp_train: Tensor,
    lp_rollout: Tensor,
    valid: Tensor,
    segments: Segments,
    reducer: Reducer,
    *,
    batch_norm_factor: Tensor | float | None = None,
    extra_finite: tuple[Tensor, ...] = (),
) -> TISResult:
    """:func:`compute_tis` on validated inputs: ``valid`` bool ``[T]`` and the batch's ``segments``."""
    device = lp_train.device
    with torch.no_grad():
        ratios = packed_ratios(
            lp_train.detach(), lp_rollout.detach(), valid, segments, reducer,
            veto_threshold=config.veto_threshold if config.algorithm != 0 else None,
            extra_finite=tuple(t.detach() for t in extra_finite), moments_bound=config.safety_bound,
        )
        rejection = sequence_rejections(config, ratios)
        kept_seq = ratios.seq_ok & ~rejection.seq_rejected
        per_seq_units = config.level != "token"
        seq_weights = _unit_weights(config, ratios.level_log_ratio(config.level)) if per_seq_units else None

        tokens = SequenceCode(segments, ratios.seq_ok, kept_seq, seq_weights, valid)
        if not per_seq_units or config.rs_level == "token" or ratios.needs_token_log_ratio:  # l_t on token_ok
            log_ratio = ratios.set_log_ratio(ratios.log_ratio_valid * tokens.ok)
            token_rejections(config, log_ratio, rejection)
        keep = tokens.kept
        rejection.keep = keep if rejection.token_rejected is None else keep.logical_and_(~rejection.token_rejected)

        if per_seq_units:
            unit_weights, kept_units = seq_weights, kept_seq
        else:
            unit_weights, kept_units = _unit_weights(config, ratios.log_ratio), rejection.keep
        kept_weights = masked(kept_units, unit_weights)
        norm_sum = kept_weights.sum()
        norm_count = torch.count_nonzero(kept_units).float()

        factor: Tensor | None = None
        if config.batch_normalize:
            if batch_norm_factor is None:
                total = reducer.batch_sum(torch.stack([norm_sum, norm_count]), per_sequence=per_seq_units)
                factor = normalisation_factor(total[0], total[1])
            else:
                factor = scalar_tensor(batch_norm_factor, device)
            unit_weights = unit_weights * factor
            kept_weights = kept_weights * factor

        if per_seq_units:  # w_{u(t)} at valid tokens of finite sequences
            token_weights = tokens.magnitude if factor is None else tokens.magnitude.mul_(factor)
        else:  # unit_weights is f(0) at tokens outside token_ok, where log_ratio is 0
            token_weights = select(ratios.valid_bits, unit_weights * tokens.ok)
        stats = tis_statistics(config, ratios, rejection, unit_weights, kept_units, kept_weights, factor)

    return TISResult(token_weights, rejection.keep, stats, norm_sum, norm_count, ratios)


def _unit_weights(config: TISConfig, level_log: Tensor) -> Tensor:
    """Bounded weights of the level log-ratios (ones when the algorithm applies no weights)."""
    if not config.applies_weights:
        return torch.ones_like(level_log)
    return bounded_weights(config.mode, level_log, config.lower_bound, config.upper_bound, config.safety_bound)


class SequenceCode:
    """Per-sequence flags and weights broadcast to tokens (one fused pass on the CPU, exact decoding).

    ``m_i = max(w_i, FLT_MIN)`` on ``seq_ok`` sequences and 0 elsewhere, with ``w_i`` the sequence
    weight (1 at token level; ``w_i`` differs from ``m_i`` only if ``exp(-B)`` underflows, i.e. for a
    safety bound above 87). Per token:

    * ``magnitude``: ``m`` at valid tokens, 0 elsewhere (the token weights before batch-norm);
    * ``kept``: bool, valid tokens of kept sequences;
    * ``ok`` (on first use): 1.0 at valid tokens of ``seq_ok`` sequences, else 0.0 (``sign(magnitude)``).
    """

    def __init__(self, segments: Segments, seq_ok: Tensor, kept_seq: Tensor, weights: Tensor | None,
                 valid: Tensor) -> None:
        m = seq_ok.float() if weights is None else torch.where(seq_ok, weights.clamp(min=_FLT_MIN), 0.0)
        if native.enabled(m):
            self.magnitude, self.kept = native.expand(segments.offsets, valid, m, kept_seq)
        else:
            self.kept = segments.expand(kept_seq).logical_and_(valid)
            self.magnitude = select(valid_bits(valid), segments.expand(m))

    @cached_property
    def ok(self) -> Tensor:
        return torch.sign(self.magnitude)


_FLT_MIN = torch.finfo(torch.float32).tiny


def masked(mask: Tensor, x: Tensor) -> Tensor:
    """``x`` where ``mask``, else 0 (a selection; float32 ``x``)."""
    if x.dim() == 1 and x.numel() >= _SELECT_MIN:
        return select(valid_bits(mask), x)
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


_SELECT_MIN = 1 << 14  # below this, torch.where's one kernel beats building a bit mask first


def scalar_tensor(value: Tensor | float, device: torch.device) -> Tensor:
    """A float32 0-d tensor on ``device``; a Python number is filled in place (``torch.as_tensor`` of a
    number would copy host-to-device, a synchronising transfer on CUDA)."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=torch.float32).reshape(())
    return torch.full((), float(value), dtype=torch.float32, device=device)


def normalisation_factor(weight_sum: Tensor, unit_count: Tensor) -> Tensor:
    """Batch-normalisation factor ``count / sum`` (1 when nothing is kept): mean weight becomes 1."""
    ok = weight_sum > 0
    return torch.where(ok, unit_count / torch.where(ok, weight_sum, torch.ones_like(weight_sum)),
                       torch.ones_like(weight_sum))
