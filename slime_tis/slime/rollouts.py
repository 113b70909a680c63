"""Which rollout each slime sample belongs to, and the rollout-level loss denominators.

slime (THUDM/slime 624b824, ``RolloutManager._convert_samples_to_train_data`` in
``slime/ray/rollout.py``) gives every training sample a rollout id (``rollout_ids``; an agentic rollout
may produce several samples) and the per-sample value

    rollout_mask_sums[i] = N_g = sum over the samples j of i's rollout g of sum_t loss_mask_j[t]

computed once over the whole rollout batch. Its loss reducer (``get_sum_of_sample_mean`` in
``slime/backends/megatron_utils/cp_utils.py``) divides every sample's token sum by ``N_g``, so the unit
of slime's "per-sample mean" is the rollout: ``sum_{t in g} loss_t / N_g``. All samples of a rollout
lie in one training step, but the micro-batch packing (``slime/utils/dp_schedule.py``) may put them in
different micro-batches, also on different data-parallel ranks.

``tis_rejected_denominator: drop`` replaces ``N_g`` by the rollout's kept-token count. A loss hook sees
one micro-batch; for the part ``P`` of rollout ``g`` in it (its samples there, all CP ranks) with
``n_P`` valid and ``k_P`` kept tokens the denominator is

    D_P = N_g * k_P / n_P          (= K_g, the rollout's kept count, when P is the whole rollout)

i.e. the part is renormalised by its own kept fraction; exact whenever the rollout lies in one
micro-batch, and for a split rollout exact when its parts keep the same fraction of their tokens.

When the keep decisions are fixed for the whole rollout, ``K_g`` itself is known before training: in
the TIS hook (algorithms 1 and 2) the decisions come from ``pi_old``, which slime computes once per
rollout. The rollout-data hook then counts every sample's kept tokens, sums them per rollout over the
data-parallel group (one all-reduce of ``[3, n_batch]``: kept count, valid count and rollout id at each
sample's position ``rollout_data['partition']`` in the rollout batch of ``n_batch`` samples, identical
on all ranks) and registers ``(N_g, K_g)`` per sample; the TIS hook then scales by ``N_g / K_g``, exact
for split rollouts too. It uses them only when ``train_log_probs`` are the very pi_old tensors counted
(not when slime passed the detached current log-probs instead).

The hooks get neither rollout ids nor (the TIS function) ``rollout_mask_sums``. The rollout-data hook
(:func:`slime_tis.slime.postprocess_rollout_data`) registers each local sample's rollout id under the
identity of its loss-mask tensor: slime's ``DataIterator.get_next`` hands the loss hooks the very
tensor objects of ``rollout_data['loss_masks']``.
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from slime_tis.slime.batch import SlimePacked

__all__ = ["RolloutRegistry", "rollout_counts_over_dp", "rollout_part_counts"]

_NEEDS_HOOK = (
    "tis_rejected_denominator = 'drop' divides by each rollout's kept-token count, which needs the rollout of "
    "every sample: add --rollout-data-postprocess-path slime_tis.slime.postprocess_rollout_data"
)


class RolloutRegistry:
    """Rollout id of each sample of the current rollout batch, keyed by its loss-mask tensor object."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._by_mask: dict[int, tuple[Tensor, Hashable]] = {}
        self._counts: dict[int, tuple[Tensor, int]] = {}  # id(mask) -> (pi_old tensor counted, row)
        self._count_table: Tensor | None = None  # [n_local, 2] (N_g, K_g)

    def register(self, loss_masks: Sequence[Tensor], rollout_ids: Sequence[Any] | None) -> None:
        """Record ``rollout_ids[i]`` for ``loss_masks[i]`` (each sample its own rollout when ``None``)."""
        if rollout_ids is not None and len(rollout_ids) != len(loss_masks):
            raise ValueError(
                f"rollout_data['rollout_ids'] has {len(rollout_ids)} entries, loss_masks {len(loss_masks)}"
            )
        self.clear()
        for i, mask in enumerate(loss_masks):
            rid = ("sample", i) if rollout_ids is None else _as_key(rollout_ids[i])
            self._by_mask[id(mask)] = (mask, rid)  # the reference keeps the id valid

    def set_rollout_counts(self, loss_masks: Sequence[Tensor], log_probs: Sequence[Tensor], table: Tensor) -> None:
        """Register ``table[i] = (N_g, K_g)`` of sample ``i``, valid while the hook gets ``log_probs[i]``."""
        self._count_table = table
        self._counts = {id(m): (lp, i) for i, (m, lp) in enumerate(zip(loss_masks, log_probs))}

    def rollout_counts(self, loss_masks: Sequence[Tensor], log_probs: Sequence[Tensor]) -> Tensor | None:
        """``[n, 2]`` ``(N_g, K_g)`` of the micro-batch's samples if all were counted from these very
        ``log_probs`` tensors (pi_old), else ``None``."""
        if self._count_table is None or not loss_masks:
            return None
        rows = []
        for mask, lp in zip(loss_masks, log_probs):
            entry = self._counts.get(id(mask))
            if entry is None or entry[0] is not lp or self.rollout_of(mask) is None:
                return None
            rows.append(entry[1])
        index = torch.tensor(rows, dtype=torch.int64).to(self._count_table.device, non_blocking=True)
        return self._count_table[index]

    def rollout_of(self, mask: Tensor) -> Hashable | None:
        entry = self._by_mask.get(id(mask))
        return entry[1] if entry is not None and entry[0] is mask else None

    def group_index(self, loss_masks: Sequence[Tensor]) -> Tensor:
        """``[n]`` int64 (CPU): the micro-batch's samples numbered by rollout (0, 1, ... in order of appearance).

        Raises ``ValueError`` naming the fix when a sample was not registered by the rollout-data hook.
        """
        ids: dict[Hashable, int] = {}
        out = []
        for mask in loss_masks:
            rid = self.rollout_of(mask)
            if rid is None:
                raise ValueError(_NEEDS_HOOK)
            out.append(ids.setdefault(rid, len(ids)))
        return torch.tensor(out, dtype=torch.int64)


def _as_key(value: Any) -> Hashable:
    if isinstance(value, Tensor):
        value = value.item()  # host-sync-ok (rollout-data hook, before training; CPU ints in slime)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


def rollout_part_counts(packed: SlimePacked, kept_masks: Sequence[Tensor], groups: Tensor) -> tuple[Tensor, Tensor]:
    """Valid and kept token counts ``(n_P, k_P)`` of each sample's rollout part in this micro-batch.

    Args:
        packed: the micro-batch (full-length original masks in ``packed.full_mask``).
        kept_masks: full-length per-sample masks with rejected tokens zeroed, identical on all CP ranks
            (:meth:`SlimePacked.full_keep_masks`).
        groups: ``[n]`` int64 rollout number of each sample (:meth:`RolloutRegistry.group_index`).

    Returns:
        two ``[n]`` float32 tensors on the masks' device: for sample ``i`` the counts summed over the
        samples of this micro-batch that share its rollout. No collective, no host synchronisation.
    """
    device = packed.full_mask.device
    n = len(packed.response_lengths)
    if n == 0:
        empty = torch.zeros(0, device=device)
        return empty, empty
    sample = packed.full_sample_index()
    valid = torch.zeros(n, device=device).index_add_(0, sample, (packed.full_mask != 0).float())
    kept = torch.zeros(n, device=device).index_add_(0, sample, (torch.cat(list(kept_masks)) != 0).float())
    g = groups.to(device, non_blocking=True)
    n_groups = int(groups.max()) + 1  # host-sync-ok (CPU tensor)
    valid_g = torch.zeros(n_groups, device=device).index_add_(0, g, valid)
    kept_g = torch.zeros(n_groups, device=device).index_add_(0, g, kept)
    return valid_g[g], kept_g[g]


def rollout_counts_over_dp(
    valid: Tensor, kept: Tensor, rollout_ids: Sequence[Any], positions: Sequence[int] | None, n_batch: int | None,
    reducer: Any,
) -> Tensor:
    """``[n, 2]`` float32 ``(N_g, K_g)`` per local sample: valid / kept tokens of its whole rollout.

    Args:
        valid, kept: ``[n]`` per-sample counts of this rank (complete over CP).
        rollout_ids: rollout id of each local sample.
        positions: each sample's position in the rollout batch (slime's ``partition``) and ``n_batch``
            the batch's sample count: then one DP all-reduce of ``[3, n_batch]`` float64 (same shape on
            every rank) sums the rollouts over DP ranks; with ``None`` only this rank's samples count.
    """
    device = valid.device
    keys = [_as_key(r) for r in rollout_ids]
    codes: dict[Hashable, int] = {}
    for k in keys:
        codes.setdefault(k, len(codes))
    if positions is None or n_batch is None:
        local = torch.tensor([codes[k] for k in keys], dtype=torch.int64).to(device, non_blocking=True)
        n_codes = len(codes)
        sums = torch.zeros(n_codes, 2, device=device).index_add_(0, local, torch.stack([valid, kept], 1).float())
        return sums[local]
    if not all(isinstance(k, int) and 0 <= k < 2**52 for k in keys):
        raise ValueError("rollout_ids must be non-negative integers below 2**52 to be summed across DP ranks")
    pos = torch.tensor(list(positions), dtype=torch.int64).to(device, non_blocking=True)
    rid = torch.tensor(keys, dtype=torch.float64).to(device, non_blocking=True)
    table = torch.zeros(3, n_batch, dtype=torch.float64, device=device)
    table[0, pos] = valid.double()
    table[1, pos] = kept.double()
    table[2, pos] = rid + 1.0  # 0 marks positions of no rank (none after the all-reduce)
    table = reducer.batch_sum(table, per_sequence=True)
    same = table[2][None, :] == (rid + 1.0)[:, None]  # [n, n_batch]: batch samples of my sample's rollout
    return (same.double() @ table[:2].T).float()
