"""Log-ratios per token and per sequence, with the non-finite and veto bookkeeping they need.

Notation (SPEC): per valid token ``t`` of sequence ``i``, ``l_t = lp_train_t - lp_rollout_t``.
Levels::

    token:      L_t = l_t                       (one unit per token)
    sequence:   L_i = sum_{t in i} l_t          (one unit per sequence)
    geometric:  L_i = (1 / n_i) sum_{t in i} l_t

A token is *valid* if its loss mask is 1. A sequence is *non-finite* if any valid token has a
non-finite ``l_t`` (NaN/inf in either log-prob, or in an extra tensor such as the advantages); it
is then rejected and excluded from every diagnostic. Values at invalid positions are ignored
entirely, even NaN: they are dropped by selection (``segments.select``), never by multiplication.

One token pass writes the rows of a ``[k, T]`` buffer (float64 for ``l``, whose per-sequence sum
must not depend on the rest of the batch at float32 resolution; float32 for the others), each
finite (non-finite values are replaced by 0 and counted in a row of their own)::

    l      = sel(valid, lp_train) - sel(valid, lp_rollout)        (0 at invalid or non-finite tokens)
    lr     = sel(valid, lp_rollout)                                (0 at invalid tokens and where non-finite)
    valid  = 1 at valid tokens
    bad    = 1 at valid tokens where l or an extra tensor is non-finite
    veto   = 1 where l < log v                                     (only with a veto threshold)

Their per-sequence sums ``[n_seq, N_COLUMNS]`` (float64, columns ``ROW_*``; a row that is not asked
for is 0) are completed over context parallelism with a single ``reducer.sequence_sum`` call (one
all-reduce per micro-batch). ``mean_t lp_train = (sum l + sum lr) / n`` follows without a row of its
own. On the CPU the fused kernel ``slime_tis.core.native.sequence_sums`` computes the same sums in
one pass; the torch code below is the reference and the path on accelerators.

The diagnostics' ratio moments over the token domain (:meth:`PackedRatios.token_moments`)::

    lc = clamp(l, -B, B),  e = expm1(lc):   sum e,  sum e^2,  sum (e - lc)

The fused kernel sums them per sequence in the same pass (columns ``ROW_E``, ``ROW_E2``, ``ROW_K3``;
each sequence's sum is exact to float32 rounding whatever its neighbours hold). The torch path sums
them over the token domain in a pass of its own: its prefix-based segment sums would let one
sequence's ``e^2`` (up to ``e^{2B}``) swamp its neighbours' sums.
"""

from __future__ import annotations

import math
from functools import cached_property

import torch
from torch import Tensor

from slime_tis.core import native
from slime_tis.core.reducer import Reducer
from slime_tis.core.segments import Segments, select, valid_bits

__all__ = ["PackedRatios", "packed_ratios", "ROW_LOG_RATIO", "ROW_LP_ROLLOUT", "ROW_VALID", "ROW_NONFINITE",
           "ROW_VETO", "ROW_E", "ROW_E2", "ROW_K3", "N_COLUMNS"]

ROW_LOG_RATIO, ROW_LP_ROLLOUT, ROW_VALID, ROW_NONFINITE, ROW_VETO, ROW_E, ROW_E2, ROW_K3 = range(8)
N_COLUMNS = native.N_COLUMNS


def as_float32(t: Tensor) -> Tensor:
    """``t`` as float32 (no copy when it already is)."""
    return t if t.dtype == torch.float32 else t.float()


class PackedRatios:
    """Per-token and per-sequence log-ratio quantities of one packed micro-batch.

    Shapes: ``[T]`` per token, ``[n_seq]`` per sequence (full-sequence values, identical on every
    context-parallel rank after the reduction). Per-sequence float tensors are float32 except the
    raw sums ``seq_sums`` / ``seq_sums_local`` (float64 ``[n_seq, N_COLUMNS]``, columns ``ROW_*``); the
    columns are finite (the token pass sanitises them), so masking by a product is a selection.

    Attributes:
        segments: the packed layout (sequence index per token, expansion, segment sums).
        valid: ``[T]`` bool loss mask.
        seq_sums: ``[n_seq, N_COLUMNS]`` float64 per-sequence row sums, completed over context parallelism.
        seq_sums_local: the same before the reduction (this rank's tokens only).
        seq_has_tokens: at least one valid token.
        seq_nonfinite: has valid tokens with a non-finite value. seq_ok: has valid tokens, all finite.
        seq_veto: finite and some valid token has raw ratio < veto threshold.

    Computed on first use:

    * ``[n_seq]``: ``seq_log_ratio_sum`` (sum of ``l_t`` over valid tokens, 0 unless ``seq_ok``),
      ``seq_log_ratio_mean`` (the geometric-level ``L_i``), ``seq_count`` (valid tokens),
      ``seq_mean_lp_train``, ``seq_mean_lp_rollout`` (0 unless ``seq_ok``);
    * ``[T]``: ``valid_bits`` (``valid`` as an int32 selection mask), ``log_ratio_valid`` (float32 ``l_t``
      at valid tokens with finite ``l_t``, 0 elsewhere), ``seq_id``, ``token_ok`` (valid and its sequence
      is ok: the diagnostic token domain), ``log_ratio``, ``lp_train``, ``lp_rollout`` (0 outside
      ``token_ok``).
    """

    def __init__(self, segments: Segments, valid: Tensor, lp_train: Tensor, lp_rollout: Tensor,
                 local: Tensor, full: Tensor, has_veto: bool, log_ratio_valid: Tensor | None = None,
                 moments_bound: float | None = None, moment_columns: bool = False) -> None:
        self.segments = segments
        self.valid = valid
        self.moments_bound = moments_bound
        self.moment_columns = moment_columns
        if log_ratio_valid is not None:
            self.__dict__["log_ratio_valid"] = log_ratio_valid
        self._lp_train = lp_train
        self._lp_rollout = lp_rollout
        self.seq_sums_local = local
        self.seq_sums = full

        self.seq_has_tokens = full[:, ROW_VALID] > 0
        self.seq_nonfinite = self.seq_has_tokens & (full[:, ROW_NONFINITE] > 0)
        self.seq_ok = self.seq_has_tokens & ~self.seq_nonfinite
        self.seq_veto = (self.seq_ok & (full[:, ROW_VETO] > 0)) if has_veto else torch.zeros_like(self.seq_ok)

    @cached_property
    def seq_count(self) -> Tensor:
        """``[n_seq]`` float32 number of valid tokens."""
        return self.seq_sums[:, ROW_VALID].float()

    @cached_property
    def seq_log_ratio_sum(self) -> Tensor:
        """``[n_seq]`` float32 sum of ``l_t`` over valid tokens (0 unless ``seq_ok``): the sequence-level ``L_i``."""
        return (self.seq_sums[:, ROW_LOG_RATIO] * self.seq_ok).float()  # finite column: a selection

    @cached_property
    def seq_log_ratio_mean(self) -> Tensor:
        """``[n_seq]`` float32 geometric-level ``L_i`` (0 unless ``seq_ok``)."""
        full = self.seq_sums
        return (full[:, ROW_LOG_RATIO] * self.seq_ok / full[:, ROW_VALID].clamp(min=1.0)).float()

    @property
    def n_seq(self) -> int:
        return self.segments.n_seq

    @cached_property
    def valid_bits(self) -> Tensor:
        """``[T]`` int32 selection mask of ``valid`` (see ``segments.select``)."""
        return valid_bits(self.valid)

    @cached_property
    def log_ratio_valid(self) -> Tensor:
        """``[T]`` float32 ``l_t`` at valid tokens with finite ``l_t``, 0 elsewhere."""
        return select(self.valid_bits, self._lp_train - self._lp_rollout).nan_to_num_(0.0, 0.0, 0.0)

    @cached_property
    def seq_mean_lp_rollout(self) -> Tensor:
        """``[n_seq]`` float32 mean rollout log-prob over valid tokens (0 unless ``seq_ok``)."""
        return self._seq_mean(self.seq_sums[:, ROW_LP_ROLLOUT])

    @cached_property
    def seq_mean_lp_train(self) -> Tensor:
        """``[n_seq]`` float32 mean training log-prob, ``(sum l + sum lp_rollout) / n`` (0 unless ``seq_ok``)."""
        return self._seq_mean(self.seq_sums[:, ROW_LP_ROLLOUT] + self.seq_sums[:, ROW_LOG_RATIO])

    def _seq_mean(self, total: Tensor) -> Tensor:
        return torch.where(self.seq_ok, total / self.seq_sums[:, ROW_VALID].clamp(min=1.0), 0.0).float()

    @cached_property
    def seq_id(self) -> Tensor:
        """``[T]`` int64 sequence index of every token."""
        return self.segments.index

    @cached_property
    def token_ok(self) -> Tensor:
        """``[T]`` bool: valid and its sequence is ok."""
        return self.segments.expand(self.seq_ok).logical_and_(self.valid)

    @cached_property
    def log_ratio(self) -> Tensor:
        """``[T]`` float32 raw ``l_t`` on ``token_ok``, 0 elsewhere."""
        return select(self.segments.expand(valid_bits(self.seq_ok)), self.log_ratio_valid)  # already 0 if invalid

    @cached_property
    def lp_train(self) -> Tensor:
        """``[T]`` float32 training log-probs on ``token_ok``, 0 elsewhere."""
        return torch.where(self.token_ok, self._lp_train, 0.0)

    @cached_property
    def lp_rollout(self) -> Tensor:
        """``[T]`` float32 rollout log-probs on ``token_ok``, 0 elsewhere."""
        return torch.where(self.token_ok, self._lp_rollout, 0.0)

    def token_moments(self, local_ok: Tensor | None = None) -> Tensor:
        """``[3]`` float64 ``(sum e, sum e^2, sum (e - lc))`` over ``token_ok`` (this rank's tokens), with
        ``lc = clamp(l, -B, B)``, ``e = expm1(lc)`` and ``B`` the ``moments_bound`` of :func:`packed_ratios`.

        ``local_ok``: ``seq_ok @ seq_sums_local`` (``[N_COLUMNS]``) if the caller has it already."""
        if self.moments_bound is None:
            raise ValueError("token_moments needs packed_ratios(..., moments_bound=B)")
        if self.moment_columns:
            if local_ok is None:
                local_ok = self.seq_ok.to(torch.float64) @ self.seq_sums_local
            return local_ok[ROW_E:ROW_K3 + 1]
        lc = self.log_ratio.clamp(-self.moments_bound, self.moments_bound)
        e = torch.expm1(lc)
        return torch.stack([e.sum(), torch.dot(e, e), torch.sub(e, lc, out=lc).sum()]).to(torch.float64)

    @property
    def needs_token_log_ratio(self) -> bool:
        """True if :meth:`token_moments` will read ``log_ratio`` (the torch path)."""
        return self.moments_bound is not None and not self.moment_columns

    def set_log_ratio(self, log_ratio: Tensor) -> Tensor:
        """Store ``log_ratio`` (computed by the caller, e.g. from a sequence-code expansion) and return it."""
        self.__dict__["log_ratio"] = log_ratio
        return log_ratio

    def level_log_ratio(self, level: str) -> Tensor:
        """Unclamped ``L`` per unit: ``[T]`` at token level, ``[n_seq]`` at sequence/geometric level."""
        if level == "token":
            return self.log_ratio
        if level == "sequence":
            return self.seq_log_ratio_sum
        return self.seq_log_ratio_mean

    def unit_ok(self, level: str) -> Tensor:
        """Diagnostic domain of ``level``'s units: ``token_ok`` [T] or ``seq_ok`` [n_seq]."""
        return self.token_ok if level == "token" else self.seq_ok


def packed_ratios(
    lp_train: Tensor,
    lp_rollout: Tensor,
    valid: Tensor,
    segments: Segments,
    reducer: Reducer,
    *,
    veto_threshold: float | None = None,
    extra_finite: tuple[Tensor, ...] = (),
    moments_bound: float | None = None,
) -> PackedRatios:
    """Compute :class:`PackedRatios` (one token pass, one ``reducer.sequence_sum`` call).

    Args:
        lp_train, lp_rollout: ``[T]`` log-probs (any float dtype; computed in float32), detached.
        valid: ``[T]`` bool loss mask.
        segments: the packed layout of the batch.
        reducer: completes per-sequence sums over context parallelism.
        veto_threshold: if set, flag sequences with a valid token whose raw ratio ``< v``
            (compared in log space: ``l_t < log v``).
        extra_finite: further ``[T]`` tensors that must be finite at valid tokens (e.g. advantages).
        moments_bound: the safety bound ``B`` of :meth:`PackedRatios.token_moments` (``None``: not needed).
    """
    lt, lr = as_float32(lp_train), as_float32(lp_rollout)
    log_veto = math.log(veto_threshold) if veto_threshold is not None else None
    log_ratio_valid = None
    fused = native.enabled(lt) and len(extra_finite) <= native.MAX_EXTRA
    if fused:
        local = native.sequence_sums(lt, lr, valid, segments.offsets, tuple(as_float32(t) for t in extra_finite),
                                     log_veto=log_veto, moments_bound=moments_bound)
    else:
        local, log_ratio_valid = _torch_sums(lt, lr, valid, segments, log_veto, extra_finite)
    full = reducer.sequence_sum(local)
    return PackedRatios(segments, valid, lt, lr, local, full, veto_threshold is not None, log_ratio_valid,
                        moments_bound, moment_columns=fused and moments_bound is not None)


def _torch_sums(lt: Tensor, lr: Tensor, valid: Tensor, segments: Segments, log_veto: float | None,
                extra_finite: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """The per-sequence sums of :func:`packed_ratios` with torch ops: ``([n_seq, N_COLUMNS], log_ratio_valid)``."""
    bits = valid_bits(valid)
    n_tokens = segments.n_tokens
    rows = [ROW_LP_ROLLOUT, ROW_VALID, ROW_NONFINITE]
    rows += [ROW_VETO] if log_veto is not None else []
    buf64 = segments.row_buffer(1, torch.float64)  # the log-ratio row: sums independent of the batch around
    buf = segments.row_buffer(len(rows))
    row = {r: buf[i, :n_tokens] for i, r in enumerate(rows)}
    lr_valid, bad = row[ROW_LP_ROLLOUT], row[ROW_NONFINITE]

    select(bits, lr, out=lr_valid)
    log_ratio = select(bits, lt).sub_(lr_valid)  # NaN or +-inf whenever either input is
    torch.sub(log_ratio, log_ratio, out=bad)  # 0, or NaN where l is not finite
    for extra in extra_finite:
        bad.add_(extra, alpha=0.0)  # + 0 * extra: stays 0 where extra is finite, NaN elsewhere
    bad.ne_(0.0)
    if extra_finite:
        select(bits, bad, out=bad)
    log_ratio.nan_to_num_(0.0, 0.0, 0.0)
    lr_valid.nan_to_num_(0.0, 0.0, 0.0)
    row[ROW_VALID].copy_(valid.view(torch.uint8))
    if log_veto is not None:
        torch.lt(log_ratio, log_veto, out=row[ROW_VETO])
    buf64[0, :n_tokens].copy_(log_ratio)

    sums = segments.sums(buf64, buf)
    local = sums.new_zeros((segments.n_seq, N_COLUMNS))
    local[:, [ROW_LOG_RATIO, *rows]] = sums
    return local, log_ratio
