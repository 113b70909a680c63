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

The hooks get neither rollout ids nor (the TIS function) ``rollout_mask_sums``. The rollout-data hook
(:func:`slime_tis.slime.postprocess_rollout_data`) registers each local sample's rollout id under the
identity of its loss-mask tensor: slime's ``DataIterator.get_next`` hands the loss hooks the very
tensor objects of ``rollout_data['loss_masks']``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from slime_tis.slime.batch import SlimePacked

__all__ = ["RolloutRegistry", "rollout_part_counts"]

_NEEDS_HOOK = (
    "tis_rejected_denominator = 'drop' divides by each rollout's kept-token count, which needs the rollout of "
    "every sample: add --rollout-data-postprocess-path slime_tis.slime.postprocess_rollout_data"
)


class RolloutRegistry:
    """Rollout id of each sample of the current rollout batch, keyed by its loss-mask tensor object."""

    def __init__(self) -> None:
        self._by_mask: dict[int, tuple[Tensor, Hashable]] = {}

    def clear(self) -> None:
        self._by_mask = {}

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
        return value.item()  # host-sync-ok (rollout-data hook, before training; CPU ints in slime)
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
