"""Log-ratios per token and per sequence, with the non-finite and veto bookkeeping they need.

Notation (SPEC): per valid token ``t`` of sequence ``i``, ``l_t = lp_train_t - lp_rollout_t``.
Levels::

    token:      L_t = l_t                       (one unit per token)
    sequence:   L_i = sum_{t in i} l_t          (one unit per sequence)
    geometric:  L_i = (1 / n_i) sum_{t in i} l_t

A token is *valid* if its loss mask is 1. A sequence is *non-finite* if any valid token has a
non-finite ``l_t`` (NaN/inf in either log-prob, or in an extra tensor such as the advantages); it
is then rejected and excluded from every diagnostic. Values at invalid positions are ignored
entirely, even NaN: they are replaced by selection (``torch.where``), never by multiplication.

All per-sequence partial sums are stacked into one ``[n_seq, k]`` tensor and completed with a
single ``reducer.sequence_sum`` call (one context-parallel all-reduce per micro-batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from slime_tis.core.packing import segment_sum
from slime_tis.core.reducer import Reducer

__all__ = ["PackedRatios", "packed_ratios"]


@dataclass
class PackedRatios:
    """Per-token and per-sequence log-ratio quantities of one packed micro-batch.

    Shapes: ``[T]`` per token, ``[n_seq]`` per sequence (full-sequence values, identical on every
    context-parallel rank after the reduction).
    """

    seq_id: Tensor  # [T] int64
    valid: Tensor  # [T] bool, loss mask
    token_ok: Tensor  # [T] bool, valid and its sequence is finite (the diagnostic token domain)
    log_ratio: Tensor  # [T] float32, raw l_t (0 outside token_ok)
    lp_train: Tensor  # [T] float32, 0 outside token_ok
    lp_rollout: Tensor  # [T] float32, 0 outside token_ok
    seq_log_ratio_sum: Tensor  # [n_seq] float32, sum of l_t over valid tokens (finite sequences)
    seq_count: Tensor  # [n_seq] float32, number of valid tokens
    seq_has_tokens: Tensor  # [n_seq] bool, at least one valid token
    seq_nonfinite: Tensor  # [n_seq] bool, has valid tokens with a non-finite value
    seq_ok: Tensor  # [n_seq] bool, has valid tokens and all are finite
    seq_veto: Tensor  # [n_seq] bool, finite and some valid token has raw ratio < veto threshold
    seq_mean_lp_train: Tensor  # [n_seq] float32, 0 where not seq_ok
    seq_mean_lp_rollout: Tensor  # [n_seq] float32, 0 where not seq_ok

    def level_log_ratio(self, level: str) -> Tensor:
        """Unclamped ``L`` per unit: ``[T]`` at token level, ``[n_seq]`` at sequence/geometric level."""
        if level == "token":
            return self.log_ratio
        if level == "sequence":
            return self.seq_log_ratio_sum
        return self.seq_log_ratio_sum / self.seq_count.clamp(min=1.0)

    def unit_ok(self, level: str) -> Tensor:
        """Diagnostic domain of ``level``'s units: ``token_ok`` [T] or ``seq_ok`` [n_seq]."""
        return self.token_ok if level == "token" else self.seq_ok


def packed_ratios(
    lp_train: Tensor,
    lp_rollout: Tensor,
    valid: Tensor,
    seq_id: Tensor,
    n_seq: int,
    reducer: Reducer,
    *,
    veto_threshold: float | None = None,
    extra_finite: tuple[Tensor, ...] = (),
) -> PackedRatios:
    """Compute :class:`PackedRatios` (one ``reducer.sequence_sum`` call).

    Args:
        lp_train, lp_rollout: ``[T]`` log-probs (any float dtype; computed in float32).
        valid: ``[T]`` bool loss mask.
        seq_id: ``[T]`` int64 sequence index of each token.
        n_seq: number of sequences (``len(cu_seqlens) - 1``).
        reducer: completes per-sequence sums over context parallelism.
        veto_threshold: if set, flag sequences with a valid token whose raw ratio ``< v``
            (compared in log space: ``l_t < log v``).
        extra_finite: further ``[T]`` tensors that must be finite at valid tokens (e.g. advantages).
    """
    lt = lp_train.float()
    lr = lp_rollout.float()
    diff = lt - lr  # NaN or +-inf whenever either input is
    finite = torch.isfinite(diff)
    for extra in extra_finite:
        finite = finite & torch.isfinite(extra)
    good = valid & finite
    zero = torch.zeros((), dtype=torch.float32, device=lt.device)
    log_ratio = torch.where(good, diff, zero)
    lt_good = torch.where(good, lt, zero)
    lr_good = torch.where(good, lr, zero)

    columns = [log_ratio, valid.float(), (valid & ~finite).float(), lt_good, lr_good]
    if veto_threshold is not None:
        columns.append((good & (log_ratio < math.log(veto_threshold))).float())
    per_seq = reducer.sequence_sum(segment_sum(torch.stack(columns, dim=1), seq_id, n_seq))

    seq_count = per_seq[:, 1]
    seq_has_tokens = seq_count > 0
    seq_nonfinite = seq_has_tokens & (per_seq[:, 2] > 0)
    seq_ok = seq_has_tokens & ~seq_nonfinite
    seq_zero = torch.zeros((), dtype=torch.float32, device=lt.device)
    seq_log_ratio_sum = torch.where(seq_ok, per_seq[:, 0], seq_zero)
    denom = seq_count.clamp(min=1.0)
    seq_veto = seq_ok & (per_seq[:, 5] > 0) if veto_threshold is not None else torch.zeros_like(seq_ok)
    token_ok = valid & seq_ok[seq_id]
    return PackedRatios(
        seq_id=seq_id,
        valid=valid,
        token_ok=token_ok,
        log_ratio=torch.where(token_ok, log_ratio, zero),
        lp_train=torch.where(token_ok, lt_good, zero),
        lp_rollout=torch.where(token_ok, lr_good, zero),
        seq_log_ratio_sum=seq_log_ratio_sum,
        seq_count=seq_count,
        seq_has_tokens=seq_has_tokens,
        seq_nonfinite=seq_nonfinite,
        seq_ok=seq_ok,
        seq_veto=seq_veto,
        seq_mean_lp_train=torch.where(seq_ok, per_seq[:, 3] / denom, seq_zero),
        seq_mean_lp_rollout=torch.where(seq_ok, per_seq[:, 4] / denom, seq_zero),
    )
