"""Packed (THD) layout: ``[T]`` per-token tensors, ``cu_seqlens [n_seq + 1]`` (0, non-decreasing, T; empty sequences
allowed). Validation, :class:`Layout` (segment sums, expansion to tokens) and padded -> packed conversion.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["check_packed", "Layout", "packed_layout", "check_offsets", "offsets_on", "padded_to_packed"]


def check_packed(tensors: Mapping[str, Tensor | None], cu_seqlens: Tensor, floats: tuple[str, ...] = ()) -> int:
    """The token count ``T`` of packed ``[T]`` tensors (same length and device) and integer ``cu_seqlens``;
    ``ValueError`` naming the tensor otherwise (also for a ``floats`` tensor of another dtype). Contents of
    ``cu_seqlens``: :func:`check_offsets`."""
    present = {name: t for name, t in tensors.items() if t is not None}
    if not present:
        raise ValueError("no per-token tensors given")
    for name, t in present.items():
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1:
            raise ValueError(
                f"{name} must be a packed 1-D tensor [T], got shape {tuple(t.shape)}; "
                "convert padded [B, L] batches with slime_tis.padded_to_packed"
            )
    first_name, first = next(iter(present.items()))
    n_tokens = first.shape[0]
    for name, t in present.items():
        if t.shape[0] != n_tokens:
            shapes = ", ".join(f"{k}={tuple(v.shape)}" for k, v in present.items())
            raise ValueError(f"length mismatch: {name} has {t.shape[0]} tokens, {first_name} has {n_tokens} ({shapes})")
        if t.device != first.device:
            raise ValueError(f"device mismatch: {name} is on {t.device}, {first_name} is on {first.device}")
        if name in floats and not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        shape = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, Tensor) else type(cu_seqlens).__name__
        raise ValueError(f"cu_seqlens must be a 1-D tensor of length n_seq + 1, got {shape}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must have an integer dtype, got {cu_seqlens.dtype}")
    check_offsets(cu_seqlens, n_tokens)
    return n_tokens


def offsets_valid(cu_seqlens: Tensor, n_tokens: int) -> Tensor:
    """0-d bool tensor on ``cu_seqlens``' device: ``cu[0] == 0``, ``cu[-1] == T`` and non-decreasing."""
    c = cu_seqlens
    return (c[0] == 0) & (c[-1] == n_tokens) & (c[1:] >= c[:-1]).all()


def assert_offsets_async(cu_seqlens: Tensor, n_tokens: int) -> None:
    """``torch._assert_async`` of :func:`offsets_valid` (no host sync; on a CPU tensor it raises now)."""
    torch._assert_async(offsets_valid(cu_seqlens, n_tokens))


def check_offsets(cu_seqlens: Tensor, n_tokens: int) -> None:
    """Check ``cu_seqlens`` contents where it lives: ``ValueError`` on the CPU, an asynchronous device-side
    assertion on an accelerator."""
    if cu_seqlens.device.type != "cpu":
        assert_offsets_async(cu_seqlens, n_tokens)
        return
    if not bool(offsets_valid(cu_seqlens, n_tokens)):  # host-sync-ok (CPU tensor)
        c = cu_seqlens
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and end at T={n_tokens}; "
            f"got first={int(c[0])}, last={int(c[-1])}, values {c.tolist()[:16]}"  # host-sync-ok (CPU tensor)
        )


_OFFSETS: dict[tuple[int, str], tuple[weakref.ref, int, Tensor]] = {}


def offsets_on(cu_seqlens: Tensor, device: torch.device) -> Tensor:
    """``cu_seqlens`` as int64 on ``device``; from another device one asynchronous (pinned) copy per tensor,
    cached by identity and version."""
    if cu_seqlens.device == device:
        return cu_seqlens.to(torch.int64)
    key = (id(cu_seqlens), str(device))
    hit = _OFFSETS.get(key)
    if hit is not None and hit[0]() is cu_seqlens and hit[1] == cu_seqlens._version:
        return hit[2]
    src = cu_seqlens.to(torch.int64)
    if src.device.type == "cpu" and device.type == "cuda":
        src = src.pin_memory()
    out = src.to(device, non_blocking=True)
    if len(_OFFSETS) > 256:
        _OFFSETS.clear()
    _OFFSETS[key] = (weakref.ref(cu_seqlens), cu_seqlens._version, out)
    return out


@dataclass(frozen=True)
class Layout:
    """The packed layout of one batch on the data's device: int64 ``offsets`` ``[n_seq + 1]``, ``lengths``
    ``[n_seq]``, ``seq_id`` ``[T]``."""

    offsets: Tensor
    lengths: Tensor
    seq_id: Tensor

    @property
    def n_seq(self) -> int:
        return self.lengths.shape[0]

    def sums(self, values: Tensor) -> Tensor:
        """``S[i] = sum_{cu[i] <= t < cu[i+1]} values[t]``: ``[T, k]`` -> ``[n_seq, k]`` (a NaN stays in its row)."""
        return torch.segment_reduce(values, "sum", lengths=self.lengths, axis=0, unsafe=True)

    def row_sums(self, block: Tensor) -> Tensor:
        """:meth:`sums` of the transpose of a ``[k, T]`` block (each row summed contiguously): ``[n_seq, k]``."""
        if block.shape[0] == 0:
            return block.new_zeros((self.n_seq, 0))
        lengths = self.lengths.expand(block.shape[0], -1).contiguous()
        return torch.segment_reduce(block, "sum", lengths=lengths, axis=1, unsafe=True).T

    def expand(self, per_sequence: Tensor) -> Tensor:
        """``out[t] = per_sequence[seq_id[t]]``: ``[n_seq]`` -> ``[T]``."""
        return per_sequence.index_select(0, self.seq_id)


def packed_layout(cu_seqlens: Tensor, n_tokens: int, device: torch.device) -> Layout:
    """The :class:`Layout` of ``cu_seqlens`` (validated) for ``n_tokens`` tokens on ``device``."""
    offsets = offsets_on(cu_seqlens, device)
    lengths = offsets[1:] - offsets[:-1]
    return Layout(offsets, lengths, torch.repeat_interleave(lengths, output_size=n_tokens))


def padded_to_packed(padded: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(packed [T], cu_seqlens [B + 1] int32)`` of a right-padded ``[B, L]`` tensor: each row's tokens up to the
    last nonzero of its ``mask`` row (interior zeros stay, with mask 0). Syncs to size the output."""
    if padded.shape != mask.shape or padded.dim() != 2:
        raise ValueError(f"padded and mask must both be [B, L], got {tuple(padded.shape)} and {tuple(mask.shape)}")
    n_cols = mask.shape[1]
    col = torch.arange(1, n_cols + 1, device=mask.device)
    lengths = ((mask != 0) * col).amax(dim=1) if n_cols else torch.zeros(mask.shape[0], dtype=torch.long)
    keep = torch.arange(n_cols, device=mask.device)[None, :] < lengths[:, None]
    cu = torch.zeros(mask.shape[0] + 1, dtype=torch.int32, device=mask.device)
    cu[1:] = torch.cumsum(lengths, 0)
    return padded[keep], cu
