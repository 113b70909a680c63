"""Which rollout each slime sample belongs to, and each rollout's valid / kept token counts.

slime (624b824, ``slime/ray/rollout.py``) gives every sample a rollout id (``rollout_ids``; an agentic rollout may
make several samples) and ``rollout_mask_sums[i] = N_g``, the valid tokens of all samples of ``i``'s rollout ``g``;
its reducer divides each sample's token sum by ``N_g`` (by the sample's own count without ``rollout_mask_sums``).
The hooks see neither, so the rollout-data hook registers each local sample under its loss-mask tensor object
(slime hands the loss hooks those very objects): its unit, its advantages and, once counted, its keep mask and
``(N_g, K_g)``. :func:`rollout_table` sums counts per unit over DP: one all-reduce of ``[4, n_batch]`` float64, a
shape the same on every rank.
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from slime_tis.slime.batch import SlimePacked

__all__ = ["RolloutRegistry", "batch_positions", "rollout_part_counts", "rollout_table", "unit_keys"]

NEEDS_HOOK = (
    "tis_rejected_denominator = 'drop' divides by each rollout's kept-token count, which needs the rollout of "
    "every sample: add --rollout-data-postprocess-path slime_tis.slime.postprocess_rollout_data"
)


class RolloutRegistry:
    """Per local sample of the current rollout batch, keyed by its loss-mask tensor object: the sample's
    index, its unit (rollout), its advantages and, once counted, its keep mask and ``(N_g, K_g)``."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._index: dict[int, tuple[Tensor, int]] = {}  # id(mask) -> (mask, local index)
        self._units: list[Hashable] = []
        self._advantages: list[Tensor] | None = None
        self._counted: dict[int, tuple[Tensor, Tensor | None]] = {}  # local index -> (full keep mask, lp counted)
        self.counts: Tensor | None = None  # [n_local, 2] float32 (N_g, K_g), rows of counted samples

    def register(self, loss_masks: Sequence[Tensor], units: Sequence[Hashable],
                 advantages: Sequence[Tensor] | None = None) -> None:
        """Record sample ``i``'s unit ``units[i]`` (and advantages) for ``loss_masks[i]``."""
        self.clear()
        if len(units) != len(loss_masks):
            raise ValueError(f"rollout_data['rollout_ids'] has {len(units)} entries, loss_masks {len(loss_masks)}")
        self._index = {id(m): (m, i) for i, m in enumerate(loss_masks)}  # the reference keeps the id valid
        self._units = list(units)
        self._advantages = list(advantages) if advantages is not None and len(advantages) == len(units) else None

    def indices(self, loss_masks: Sequence[Tensor]) -> list[int] | None:
        """Local indices of a micro-batch's samples, or None if one was not registered."""
        out = []
        for m in loss_masks:
            entry = self._index.get(id(m))
            if entry is None or entry[0] is not m:
                return None
            out.append(entry[1])
        return out

    def group_index(self, loss_masks: Sequence[Tensor]) -> Tensor:
        """``[n]`` int64 (CPU): the micro-batch's samples numbered by unit (0, 1, ... in order of appearance).

        Raises ``ValueError`` naming the fix when a sample was not registered by the rollout-data hook.
        """
        idx = self.indices(loss_masks)
        if idx is None:
            raise ValueError(NEEDS_HOOK)
        codes: dict[Hashable, int] = {}
        return torch.tensor([codes.setdefault(self._units[i], len(codes)) for i in idx], dtype=torch.int64)

    def advantages(self, loss_masks: Sequence[Tensor]) -> list[Tensor] | None:
        """The registered (CP-local) advantages of a micro-batch's samples, or None."""
        idx = self.indices(loss_masks)
        if idx is None or self._advantages is None:
            return None
        return [self._advantages[i] for i in idx]

    def set_counted(self, local: Sequence[int], keep_full: Sequence[Tensor], counts: Tensor,
                    log_probs: Sequence[Tensor] | None = None) -> None:
        """Register samples ``local`` as counted: full-length keep masks, rows ``(N_g, K_g)`` of ``counts``
        ``[len(local), 2]`` and, for decisions taken from given log-prob tensors, those tensors."""
        if self.counts is None:
            self.counts = torch.zeros(len(self._units), 2, device=counts.device)
        if local:
            self.counts[torch.tensor(list(local), dtype=torch.int64).to(counts.device, non_blocking=True)] = \
                counts.float()
        for k, i in enumerate(local):
            self._counted[i] = (keep_full[k], None if log_probs is None else log_probs[k])

    def counted(self, loss_masks: Sequence[Tensor],
                log_probs: Sequence[Tensor] | None = None) -> tuple[list[Tensor], Tensor] | None:
        """``(full keep masks, [n, 2] (N_g, K_g))`` of a micro-batch whose samples were all counted (from
        these very ``log_probs`` tensors, when given), else None."""
        idx = self.indices(loss_masks)
        if idx is None or self.counts is None or not idx:
            return None
        keeps = []
        for k, i in enumerate(idx):
            entry = self._counted.get(i)
            if entry is None or (log_probs is not None and entry[1] is not log_probs[k]):
                return None
            keeps.append(entry[0])
        rows = torch.tensor(idx, dtype=torch.int64).to(self.counts.device, non_blocking=True)
        return keeps, self.counts[rows]


def _as_key(value: Any) -> Hashable:
    if isinstance(value, Tensor):
        value = value.item()  # host-sync-ok (rollout-data hook, before training; CPU ints in slime)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


def unit_keys(rollout_data: dict[str, Any], positions: Sequence[int]) -> list[Hashable]:
    """The unit of each local sample: its rollout id when slime divides by ``rollout_mask_sums``, else the
    sample itself (its position in the rollout batch)."""
    ids = rollout_data.get("rollout_ids")
    if rollout_data.get("rollout_mask_sums") is None or ids is None:
        return [int(p) for p in positions]
    return [_as_key(r) for r in ids]


def batch_positions(rollout_data: dict[str, Any], reducer: Any, dp_size: int) -> tuple[list[int], int]:
    """``(positions, n_batch)``: each local sample's position in the rollout batch (slime's ``partition``) and
    the batch size, ``1 + max`` position over the data-parallel ranks (one all-reduce MAX of one number; no
    ``raw_reward`` needed). Without ``partition`` the local samples are the batch (one data-parallel rank)."""
    n = len(rollout_data.get("loss_masks") or [])
    part = rollout_data.get("partition")
    if part is None:
        if dp_size > 1:
            raise ValueError("tis_rejected_denominator = 'drop' with data parallelism needs rollout_data['partition']"
                             " (each sample's position in the rollout batch, which slime's scheduler sets)")
        part = list(range(n))
    positions = [int(p) for p in part]
    if len(positions) != n:
        raise ValueError(f"rollout_data['partition'] has {len(positions)} entries, loss_masks {n}")
    device = rollout_data["loss_masks"][0].device if n else torch.device("cpu")
    top = torch.tensor([float(max(positions) + 1 if positions else 0)], dtype=torch.float64).to(device)
    return positions, int(reducer.batch_max(top)[0])  # host-sync-ok (rollout-data hook, before training)


def rollout_table(valid: Tensor, kept: Tensor, keys: Sequence[int], positions: Sequence[int], n_batch: int,
                  reducer: Any) -> tuple[Tensor, int]:
    """``([n, 3], most)``: per local sample (float32) its unit's valid count ``N_g``, kept count ``K_g`` and
    number of samples, each summed over the unit's samples on every data-parallel rank; and the largest
    number of samples of any unit in the whole batch (the same on every rank).

    Args:
        valid, kept: ``[n]`` per-sample counts of this rank (complete over CP; kept 0 where not counted).
        keys: unit of each local sample (:func:`unit_keys`); positions, n_batch: :func:`batch_positions`.
    """
    if not all(isinstance(k, int) and 0 <= k < 2**52 for k in keys):
        raise ValueError("tis_rejected_denominator = 'drop' sums each rollout over the data-parallel ranks, which "
                         "needs rollout_data['rollout_ids'] to be non-negative integers below 2**52")
    device = valid.device
    pos = torch.tensor(list(positions), dtype=torch.int64).to(device, non_blocking=True)
    key = torch.tensor(list(keys), dtype=torch.float64).to(device, non_blocking=True) + 1.0
    table = torch.zeros(4, n_batch, dtype=torch.float64, device=device)
    table[0, pos] = valid.double()
    table[1, pos] = kept.double()
    table[2, pos] = key  # 0 marks positions of no rank (trailing rollouts slime left out)
    table[3, pos] = 1.0
    table = reducer.batch_sum(table, per_sequence=True)
    same = (table[2][None, :] == key[:, None]).double()  # [n, n_batch]: batch samples of my sample's unit
    present = table[2][table[2] > 0]
    most = int(torch.unique(present, return_counts=True)[1].max()) if present.numel() else 0  # host-sync-ok
    return (same @ table[[0, 1, 3]].T).float(), most


def rollout_part_counts(packed: SlimePacked, kept_masks: Sequence[Tensor], groups: Tensor) -> tuple[Tensor, Tensor]:
    """Valid and kept token counts ``(n_P, k_P)`` of each sample's unit part in this micro-batch.

    Args:
        packed: the micro-batch (full-length original masks in ``packed.full_mask``).
        kept_masks: full-length per-sample masks with rejected tokens zeroed, identical on all CP ranks
            (:meth:`SlimePacked.full_keep_masks`).
        groups: ``[n]`` int64 unit number of each sample (:meth:`RolloutRegistry.group_index`).

    Returns:
        two ``[n]`` float32 tensors on the masks' device: for sample ``i`` the counts summed over the
        samples of this micro-batch that share its unit. No collective, no host synchronisation.
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
