"""Log-ratios per token and per sequence: ``l_t = lp_train_t - lp_rollout_t``; ``L_i = sum_t l_t`` / ``mean_t l_t``.

One token pass; the per-sequence float64 sums of :data:`COLUMNS` and the rules' columns completed over CP by one
``reducer.sequence_sum``. A non-finite valid value (of the log-probs or an ``extra_finite`` tensor) makes its
sequence's sum of ``l`` non-finite: the sequence leaves the domain (``seq_ok``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from slime_tis.core.levels import Level, level_of
from slime_tis.core.packing import Layout
from slime_tis.core.reducer import Reducer

__all__ = ["Ratios", "packed_ratios", "COLUMNS", "TokenColumn", "TokenPass", "ratio_moments"]

COLUMNS = ("l", "lp_rollout", "valid")
F64 = torch.float64

#: A rule's token column ``f(l) -> [T]`` (0 where ``l = 0`` at invalid tokens), summed per sequence.
TokenColumn = Callable[[Tensor], Tensor]

#: Another implementation of the token pass (``Plan.token_pass``): ``f(lp_train, lp_rollout, valid, offsets,
#: extra_finite) -> (l [T] float32, sums [n_seq, 3] float64)`` with the torch code's values (``l``: the valid
#: log-ratios, NaN where an ``extra_finite`` value is not finite, 0 at invalid tokens; ``sums``: this rank's sums of
#: ``COLUMNS``), or ``None`` where it cannot run this call (the torch code runs).
TokenPass = Callable[[Tensor, Tensor, Tensor, Tensor, tuple[Tensor, ...]], "tuple[Tensor, Tensor] | None"]


def _sequence_sums(layout: Layout, selected: list[Tensor], valid: Tensor, columns) -> Tensor:
    """``[n_seq, k]`` float64 per-sequence sums of ``selected`` on valid tokens (selected: a NaN elsewhere changes
    nothing) and of ``columns``, as the rows of one ``[k, T]`` block."""
    columns = list(columns)
    k = len(selected) + len(columns)
    block = torch.empty((k, valid.shape[0]), dtype=F64, device=valid.device)
    for j, c in enumerate([*selected, *columns]):
        block[j] = c
    if selected:
        block[:len(selected)].masked_fill_(~valid, 0.0)
    return layout.row_sums(block)


def ratio_moments(log_ratio: Tensor, bound: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(lc, e, k3)``: ``lc = clamp(l, -B, B)``, ``e = expm1(lc) = r - 1``, ``k3 = e - lc = r - 1 - log r``."""
    lc = log_ratio.clamp(-bound, bound)
    e = torch.expm1(lc)
    return lc, e, e - lc


@dataclass(frozen=True)
class Ratios:
    """Log-ratio quantities of one packed micro-batch (``[T]`` per token, ``[n_seq]`` per sequence).

    Per-sequence values are full-sequence values (identical on every CP rank) and 0 unless ``seq_ok``. ``token_ok``:
    valid tokens of finite sequences (the token domain ``D``); ``log_ratio``: float32 ``l_t`` on ``D``, 0 elsewhere.
    ``seq_sums`` / ``local_sums``: ``[n_seq, k]`` float64 sums of ``columns`` after / before the CP reduction.
    ``token_columns``: the rules' ``[T]`` columns (read them on ``token_ok``). ``lp_rollout``: as given (detached).
    ``staleness``: ``[n_seq]`` or None; ``bound_scale``: ``([T], [n_seq])`` factors of the mode's log bounds, or None.
    """

    valid: Tensor
    seq_id: Tensor
    token_ok: Tensor
    log_ratio: Tensor
    seq_has_tokens: Tensor
    seq_nonfinite: Tensor
    seq_ok: Tensor
    seq_count: Tensor
    seq_log_ratio_sum: Tensor
    seq_log_ratio_mean: Tensor
    seq_mean_lp_train: Tensor
    seq_mean_lp_rollout: Tensor
    seq_sums: Tensor
    local_sums: Tensor
    columns: tuple[str, ...]
    token_columns: Mapping[str, Tensor] = field(default_factory=dict)
    prefix_sum_log_ratio: Tensor | None = None  # [T] the prefix levels' L_t (core.prefix), where a plan reads them
    prefix_min_log_ratio: Tensor | None = None
    lp_rollout: Tensor | None = None
    staleness: Tensor | None = None
    bound_scale: tuple[Tensor, Tensor] | None = None

    def column(self, name: str) -> Tensor:
        """``[n_seq]`` float64 full per-sequence sum of column ``name`` (0 unless ``seq_ok``)."""
        return torch.where(self.seq_ok, self.seq_sums[:, self.columns.index(name)], 0.0)

    def column_mean(self, name: str) -> Tensor:
        """``[n_seq]`` float64 per-sequence mean over valid tokens of column ``name`` (0 unless ``seq_ok``)."""
        return self.column(name) / self.seq_sums[:, 2].clamp(min=1.0)

    def local_total(self, name: str, over: Tensor) -> Tensor:
        """float64 sum of this rank's column ``name`` over the sequences in ``over`` (``[n_seq]`` bool)."""
        return torch.where(over, self.local_sums[:, self.columns.index(name)], 0.0).sum()

    def level_log_ratio(self, level: Level | str) -> Tensor:
        """Unclamped ``L_u`` of ``level`` (or its name): ``[T]`` or ``[n_seq]`` float32, 0 off the domain."""
        return level_of(level).of(self)


def packed_ratios(lp_train: Tensor, lp_rollout: Tensor, valid: Tensor, layout: Layout, reducer: Reducer, *,
                  extra_finite: tuple[Tensor, ...] = (), rule_columns: Mapping[str, TokenColumn] | None = None,
                  token_pass: TokenPass | None = None) -> Ratios:
    """:class:`Ratios` of detached ``[T]`` log-probs (computed in float32); ``rule_columns``: token columns summed per
    sequence (``core.rules``); ``token_pass``: the base columns from another implementation (:data:`TokenPass`)."""
    rules = rule_columns or {}
    passed = None if token_pass is None else token_pass(lp_train, lp_rollout, valid, layout.offsets, extra_finite)
    if passed is not None:  # the same base columns from one pass of the supplied implementation
        l, base = passed  # noqa: E741
        raw = l
        token_columns = {name: fn(l) for name, fn in rules.items()}
        local = torch.cat([base, _sequence_sums(layout, [], valid, token_columns.values())], dim=1)
    else:
        lt, lr = lp_train.float(), lp_rollout.float()
        raw = lt - lr
        for x in extra_finite:
            raw = raw + 0.0 * x  # NaN where x is not finite
        l = torch.where(valid, raw, 0.0) if rules else None  # noqa: E741  (the formula's name; the rules read it)
        token_columns = {name: fn(l) for name, fn in rules.items()}
        local = _sequence_sums(layout, [raw, lr], valid, [valid, *token_columns.values()])  # [n_seq, k]
    names = [*COLUMNS, *rules]
    full = reducer.sequence_sum(local)

    count = full[:, 2]
    seq_has = count > 0
    seq_nonfinite = seq_has & ~torch.isfinite(full[:, 0])
    seq_ok = seq_has & ~seq_nonfinite
    n = count.clamp(min=1.0)
    log_sum = torch.where(seq_ok, full[:, 0], 0.0)
    lp_roll_sum = torch.where(seq_ok, full[:, 1], 0.0)
    token_ok = layout.expand(seq_ok) & valid
    return Ratios(
        valid=valid,
        seq_id=layout.seq_id,
        token_ok=token_ok,
        log_ratio=torch.where(token_ok, raw, 0.0),  # finite: non-finite values sit in non-finite sequences
        seq_has_tokens=seq_has,
        seq_nonfinite=seq_nonfinite,
        seq_ok=seq_ok,
        seq_count=count.float(),
        seq_log_ratio_sum=log_sum.float(),
        seq_log_ratio_mean=(log_sum / n).float(),
        seq_mean_lp_train=(log_sum + lp_roll_sum) / n,
        seq_mean_lp_rollout=lp_roll_sum / n,
        seq_sums=full,
        local_sums=local,
        columns=tuple(names),
        token_columns=token_columns,
        lp_rollout=lp_rollout,
    )
