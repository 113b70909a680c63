"""slime's per-sample micro-batch (CP-local per-sample lists, full-length loss masks) <-> the packed ``[T_local]``
layout and ``cu_seqlens`` the engine takes (a CP rank may hold no token of a sample; it joins every reduction).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from slime_tis.core import Reducer
from slime_tis.engine.batch import TISBatch
from slime_tis.slime.layout import local_response_index

__all__ = ["SlimePacked", "mask_sums", "pack_slime_batch"]


@dataclass
class SlimePacked:
    """One micro-batch in packed form (tensors on the device of the loss masks unless said)."""

    index: Tensor  # [T_local] int64 gather index into the concatenated full-length responses
    cu_seqlens: Tensor  # [n + 1] int64 boundaries of the local per-sample segments
    full_mask: Tensor  # [sum_i R_i] the concatenated full-length loss masks (original dtype)
    local_mask: Tensor  # [T_local] bool, this rank's part of the loss masks
    response_lengths: list[int]  # R_i
    local_lengths: Tensor  # [n] int64 (CPU) local tokens per sample

    def cat_local(self, name: str, tensors: Sequence[Tensor]) -> Tensor:
        """Concatenate CP-local per-sample tensors after checking each length against the layout."""
        if len(tensors) != len(self.response_lengths):
            raise ValueError(
                f"{name} has {len(tensors)} samples, loss_masks has {len(self.response_lengths)}"
            )
        got = [int(t.shape[0]) if t.dim() else -1 for t in tensors]
        want = self.local_lengths.tolist()  # host-sync-ok (CPU tensor: no device sync)
        if got != want:
            bad = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
            raise ValueError(
                f"{name}[{bad}] has {got[bad]} tokens but this context-parallel rank holds {want[bad]} "
                f"response tokens of sample {bad} (response_length {self.response_lengths[bad]}); "
                "slime's per-sample log-probs must be CP-local (zigzag chunks), loss masks full length"
            )
        if not tensors:
            return torch.zeros(0, device=self.full_mask.device)
        return torch.cat(list(tensors))

    def tis_batch(self, *, advantages: Tensor | None, rollout_log_probs: Tensor, old_log_probs: Tensor | None = None,
                  ref_log_probs: Tensor | None = None) -> TISBatch:
        """These samples as the engine's packed batch: this CP rank's response tokens, sample by sample (slime
        predicts no labels here: the engine's corrections and losses read none)."""
        labels = torch.zeros((), dtype=torch.int64, device=self.local_mask.device).expand(self.local_mask.shape[0])
        return TISBatch(labels=labels, loss_mask=self.local_mask, advantages=advantages, cu_seqlens=self.cu_seqlens,
                        rollout_log_probs=rollout_log_probs, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs)

    def counts(self, masks: Sequence[Tensor] | None = None) -> Tensor:
        """``[n]`` float32 non-zero entries of each sample's full-length ``masks`` (default: the loss masks)."""
        n = len(self.response_lengths)
        flat = self.full_mask if masks is None or not n else torch.cat(list(masks))
        sample = torch.repeat_interleave(torch.arange(n), torch.tensor(self.response_lengths, dtype=torch.int64))
        return torch.zeros(n, device=flat.device).index_add_(0, sample.to(flat.device, non_blocking=True),
                                                             (flat != 0).float())

    def local_sample_index(self) -> Tensor:
        """``[T_local]`` int64 sample number of each CP-local token (on the masks' device)."""
        idx = torch.repeat_interleave(torch.arange(len(self.response_lengths)), self.local_lengths)
        return idx.to(self.full_mask.device, non_blocking=True)

    def _full(self, local: Tensor, reducer: Reducer) -> Tensor:
        """CP-local packed ``[T_local]`` values -> ``[sum_i R_i]`` float32, the same on every CP rank (one
        ``reducer.sequence_sum``: each rank contributes its positions, zeros elsewhere)."""
        full = torch.zeros(self.full_mask.shape[0], dtype=torch.float32, device=local.device)
        full[self.index] = local.float()
        return reducer.sequence_sum(full.unsqueeze(1))[:, 0]

    def gather_full(self, local: Tensor, reducer: Reducer) -> list[Tensor]:
        """CP-local packed ``[T_local]`` values -> full-length ``[R_i]`` float32 per-sample tensors."""
        return list(self._full(local, reducer).split(self.response_lengths))

    def full_keep_masks(self, keep: Tensor, reducer: Reducer) -> list[Tensor]:
        """Full-length per-sample loss masks with the tokens ``keep`` ``[T_local]`` rejects zeroed (every CP rank)."""
        full = torch.where(self._full(keep, reducer) > 0, self.full_mask, torch.zeros_like(self.full_mask))
        return list(full.split(self.response_lengths))


def mask_sums(rollout_mask_sums: Any, n: int, device: torch.device) -> Tensor:
    """slime's per-sample ``rollout_mask_sums`` (a tensor or a list of numbers) as ``[n]`` float32 on ``device``."""
    if isinstance(rollout_mask_sums, Tensor):
        sums = rollout_mask_sums.reshape(-1)
    else:
        sums = torch.stack([torch.as_tensor(d).reshape(()) for d in rollout_mask_sums]) if n else torch.zeros(0)
    if sums.numel() != n:
        raise ValueError(f"rollout_mask_sums has {sums.numel()} entries, expected one per sample ({n})")
    return sums.to(device=device, dtype=torch.float32, non_blocking=True)


def pack_slime_batch(
    loss_masks: Sequence[Tensor],
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    cp_rank: int,
    cp_size: int,
) -> SlimePacked:
    """Index and masks of one slime micro-batch on this CP rank (see :class:`SlimePacked`)."""
    n = len(loss_masks)
    if n != len(total_lengths) or n != len(response_lengths):
        raise ValueError(
            f"loss_masks has {n} samples, total_lengths {len(total_lengths)}, response_lengths "
            f"{len(response_lengths)}: they must agree"
        )
    resp = [int(r) for r in response_lengths]
    got = [int(m.shape[0]) if m.dim() else -1 for m in loss_masks]
    if got != resp:
        bad = next(i for i, (g, r) in enumerate(zip(got, resp)) if g != r)
        raise ValueError(
            f"loss_masks[{bad}] has {got[bad]} entries but response_lengths[{bad}] = {resp[bad]}: "
            "slime's loss masks are full-length (not CP-sliced)"
        )
    device = loss_masks[0].device if n else torch.device("cpu")
    index, local_lengths = local_response_index(total_lengths, resp, cp_rank, cp_size, device=device)
    full_mask = torch.cat(list(loss_masks)) if n else torch.zeros(0, device=device)
    cu = torch.zeros(n + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(local_lengths, 0)
    return SlimePacked(
        index=index,
        cu_seqlens=cu.to(device, non_blocking=True),
        full_mask=full_mask,
        local_mask=full_mask[index] != 0,
        response_lengths=resp,
        local_lengths=local_lengths,
    )
