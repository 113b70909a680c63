"""``TISBatch``: one micro-batch's RL fields on this rank in the core's packed layout: per-token fields ``[T]`` aligned
with the flattened logits rows (``logits.reshape(-1, V/TP)``; row ``t`` predicts ``labels[t]``), ``cu_seqlens [n_seq
+ 1]`` this rank's parts of the sequences (under CP every rank has the same ``n_seq`` and order, parts may be empty).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from slime_tis.engine.parallel import megatron_parallel_state
from slime_tis.kernels.logprobs_torch import check_support

__all__ = ["TISBatch", "cp_slice_padded", "cu_seqlens_from_seq_ids"]


def cp_slice_padded(x: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """Megatron's load-balanced CP slice ``[B, S / cp_size, ...]`` of ``x [B, S, ...]``: of ``2 * cp_size`` equal
    chunks, rank ``r`` keeps ``r`` and ``2 * cp_size - 1 - r`` (``megatron.core.utils.get_batch_on_this_cp_rank``)."""
    if cp_size == 1:
        return x
    s = x.shape[1]
    if s % (2 * cp_size):
        raise ValueError(f"sequence length {s} must be divisible by "
                         f"2 * context_parallel_size = {2 * cp_size}")
    c = s // (2 * cp_size)
    v = x.reshape(x.shape[0], 2 * cp_size, c, *x.shape[2:])
    idx = torch.tensor([cp_rank, 2 * cp_size - 1 - cp_rank], device=x.device)
    return v.index_select(1, idx).reshape(x.shape[0], 2 * c, *x.shape[2:])


def cu_seqlens_from_seq_ids(seq_ids: Tensor, n_seq: int) -> Tensor:
    """``cu_seqlens [n_seq + 1]`` int64, ``cu[i] = #{t : seq_ids[t] < i}``, of non-decreasing ``seq_ids [T]`` (ids
    absent from this rank give empty sequences)."""
    bounds = torch.arange(n_seq + 1, device=seq_ids.device, dtype=torch.int64)
    return torch.searchsorted(seq_ids.to(torch.int64).contiguous(), bounds, right=False)


@dataclass
class TISBatch:
    """RL fields of one micro-batch on this rank (module docstring): ``labels [T]`` int token ids, ``loss_mask [T]``
    (nonzero: a trained response token), ``advantages [T]``, ``cu_seqlens [n_seq + 1]``; optional ``[T]`` log-probs:
    ``rollout_log_probs`` (algorithms 1-3), ``old_log_probs`` (pi_old, used as given; ``None``: recomputed per
    training call, algorithms 0 and 2), ``ref_log_probs`` (the KL term); ``support_ids [S]`` / ``support_offsets [T +
    1]``: the CSR of each position's sampling support (``--tis-sampling-support``; CP-local:
    ``support_logprobs.padded_support``); ``staleness [n_seq]``: policy versions behind (``core.staleness``)."""

    labels: Tensor
    loss_mask: Tensor
    advantages: Tensor
    cu_seqlens: Tensor
    rollout_log_probs: Tensor | None = None
    old_log_probs: Tensor | None = None
    ref_log_probs: Tensor | None = None
    support_ids: Tensor | None = None
    support_offsets: Tensor | None = None
    staleness: Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("labels", "loss_mask", "advantages", "rollout_log_probs", "old_log_probs", "ref_log_probs"):
            if (t := getattr(self, name)) is None:
                continue
            if not isinstance(t, Tensor) or t.dim() != 1:
                raise ValueError(f"TISBatch.{name} must be a packed 1-D tensor [T], got "
                                 f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
            if t.shape[0] != self.labels.shape[0]:
                raise ValueError(f"TISBatch length mismatch: {name} has {t.shape[0]} tokens, "
                                 f"labels has {self.labels.shape[0]}")
        if self.labels.dtype.is_floating_point or self.labels.dtype == torch.bool:
            raise ValueError(f"TISBatch.labels must hold integer token ids, got {self.labels.dtype}")
        cu = self.cu_seqlens
        if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.numel() < 1:
            raise ValueError("TISBatch.cu_seqlens must be a 1-D integer tensor [n_seq + 1]")
        if (self.support_ids is None) != (self.support_offsets is None):
            raise ValueError("TISBatch.support_ids and support_offsets are given together (the CSR of the supports)")
        if self.support_ids is not None:
            check_support((self.support_ids, self.support_offsets), self.labels.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.shape[0]) - 1

    def to(self, device: torch.device | str) -> TISBatch:
        """A copy with every tensor moved to ``device`` (non-blocking where possible)."""
        return dataclasses.replace(self, **{f.name: None if (t := getattr(self, f.name)) is None
                                            else t.to(device, non_blocking=True) for f in dataclasses.fields(self)})

    @classmethod
    def from_padded(cls, labels: Tensor, loss_mask: Tensor, advantages: Tensor,
                    rollout_log_probs: Tensor | None = None, *, seq_ids: Tensor | None = None,
                    cp_slice: bool = True, cp_size: int | None = None, cp_rank: int | None = None,
                    ref_log_probs: Tensor | None = None) -> TISBatch:
        """From ``[B, S]`` tensors laid out like the model input (values off the mask are ignored), sliced for this CP
        rank unless ``cp_slice=False`` (``cp_size``, ``cp_rank``: from ``parallel_state``). ``seq_ids [B, S]``: each
        position's sequence, non-decreasing row-major (several sequences per row; padding takes its row's last id);
        default: row ``b`` is sequence ``b``."""
        fields = {"labels": labels, "loss_mask": loss_mask, "advantages": advantages,
                  "rollout_log_probs": rollout_log_probs, "ref_log_probs": ref_log_probs, "seq_ids": seq_ids}
        for name, t in fields.items():
            if t is not None and (not isinstance(t, Tensor) or t.dim() != 2 or t.shape != labels.shape):
                got = tuple(t.shape) if isinstance(t, Tensor) else t
                raise ValueError(f"from_padded: {name} must be a [B, S] tensor shaped like labels "
                                 f"{tuple(labels.shape)}, got {got!r}")
        if seq_ids is None:
            n_seq = labels.shape[0]
            seq_ids = torch.arange(n_seq, device=labels.device)[:, None].expand(labels.shape)
        else:
            flat = seq_ids.reshape(-1)
            bad = flat.numel() and (bool((flat[1:] < flat[:-1]).any()) or int(flat[0]) < 0)  # host-sync-ok
            if bad:
                raise ValueError("from_padded: seq_ids must be >= 0 and non-decreasing in row-major order")
            n_seq = int(flat.max()) + 1 if flat.numel() else 0  # host-sync-ok (batch prep)
        fields["seq_ids"] = seq_ids
        if cp_slice:
            if cp_size is None or cp_rank is None:
                cp_size, cp_rank = _cp_layout()
            fields = {k: None if v is None else cp_slice_padded(v, cp_size, cp_rank) for k, v in fields.items()}
        flat = {k: None if v is None else v.reshape(-1) for k, v in fields.items()}
        local_ids = flat.pop("seq_ids")
        return cls(labels=flat.pop("labels").to(torch.int64), cu_seqlens=cu_seqlens_from_seq_ids(local_ids, n_seq),
                   **flat)


def _cp_layout() -> tuple[int, int]:
    ps = megatron_parallel_state()
    return (1, 0) if ps is None else (ps.get_context_parallel_world_size(), ps.get_context_parallel_rank())
