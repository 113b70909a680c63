"""Packed-sequence layout: validation, segment ids, segment sums, padded <-> packed conversion.

The one internal layout of slime_tis is Megatron's THD packing: every per-token quantity is a
1-D tensor of ``T`` tokens (all sequences concatenated) and ``cu_seqlens`` is an integer tensor of
length ``n_seq + 1`` with ``cu_seqlens[0] == 0`` and ``cu_seqlens[-1] == T``. Sequence ``i`` owns
tokens ``cu_seqlens[i]:cu_seqlens[i + 1]``; zero-length sequences are allowed (a context-parallel
rank may hold no token of a sequence).

Everything here is vectorised: a sequence id per token comes from ``repeat_interleave`` with
``output_size`` (no host sync, no Python loop over sequences); :class:`Layout` holds the offsets,
lengths and sequence ids of one batch and gives per-sequence sums (``segment_reduce``) and the
expansion of per-sequence values to tokens (``index_select``).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "check_packed",
    "Layout",
    "packed_layout",
    "check_offsets",
    "offsets_on",
    "sequence_ids",
    "padded_to_packed",
]


def check_packed(tensors: Mapping[str, Tensor | None], cu_seqlens: Tensor) -> int:
    """Validate packed per-token tensors against ``cu_seqlens``; return the token count ``T``.

    Metadata checks (no device work): every tensor is 1-D with the same length ``T`` and on the same
    device as the first; ``cu_seqlens`` is a 1-D integer tensor with at least one entry. Contents
    (starts at 0, non-decreasing, ends at ``T``) are checked where ``cu_seqlens`` lives
    (:func:`check_offsets`): on the CPU with a ``ValueError``, on an accelerator with an asynchronous
    device-side assertion (no host sync).

    Raises:
        ValueError: naming the offending tensor(s), their shapes, dtypes or devices.
    """
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
    """The accelerator check: ``torch._assert_async`` of :func:`offsets_valid` (no host sync; on CUDA a
    failure surfaces at a later kernel launch as a device-side assertion; on a CPU tensor it raises now)."""
    torch._assert_async(offsets_valid(cu_seqlens, n_tokens))


def check_offsets(cu_seqlens: Tensor, n_tokens: int) -> None:
    """Check ``cu_seqlens`` contents where it lives: a ``ValueError`` for a CPU tensor (no device
    involved), ``torch._assert_async`` on an accelerator (fails at a later kernel launch, no sync)."""
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
    """``cu_seqlens`` as int64 on ``device``.

    Same device: a dtype conversion (no copy if already int64). Another device (a CPU ``cu_seqlens``
    with accelerator log-probs): one asynchronous copy through pinned memory per ``cu_seqlens``
    tensor, cached by identity and version, so the loss path of a micro-batch (``compute_tis``,
    ``policy_loss``, ``loss_denominator``) copies it once and never blocks.
    """
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
    """The packed layout of one batch on the data's device (built once per call by :func:`packed_layout`).

    Attributes: ``offsets`` ``[n_seq + 1]`` int64, ``lengths`` ``[n_seq]`` int64, ``seq_id`` ``[T]`` int64.
    """

    offsets: Tensor
    lengths: Tensor
    seq_id: Tensor

    @property
    def n_seq(self) -> int:
        return self.lengths.shape[0]

    def sums(self, values: Tensor) -> Tensor:
        """Per-sequence sums ``S[i] = sum_{cu[i] <= t < cu[i+1]} values[t]``: ``[T, k]`` -> ``[n_seq, k]`` (dtype of
        ``values``; each sequence its own sum, so a NaN stays in its row; empty sequences give 0). ``unsafe``:
        the offsets were checked by :func:`check_packed`, no check that would sync."""
        return torch.segment_reduce(values, "sum", lengths=self.lengths, axis=0, unsafe=True)

    def row_sums(self, block: Tensor) -> Tensor:
        """Per-sequence sums of the rows of a ``[k, T]`` block: ``[n_seq, k]``, as :meth:`sums` of its transpose (each
        row summed along the tokens, contiguous: the same sums in the same order)."""
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


def sequence_ids(cu_seqlens: Tensor, n_tokens: int, device: torch.device) -> Tensor:
    """Sequence index of every token: ``seq_id[t] = i`` for ``cu_seqlens[i] <= t < cu_seqlens[i+1]``.

    Shape ``[T]`` int64: ``repeat_interleave(lengths, output_size=T)`` (no host sync given the size;
    zero-length sequences are skipped).
    """
    offsets = offsets_on(cu_seqlens, device)
    return torch.repeat_interleave(offsets[1:] - offsets[:-1], output_size=n_tokens)


def padded_to_packed(padded: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Convert a right-padded ``[B, L]`` tensor to packed form, keeping each row's first ``len_b`` tokens.

    ``len_b`` is the position after the last nonzero entry of row ``b`` of ``mask`` (so interior
    zeros, e.g. tool tokens, stay in the packed sequence with mask 0). Returns ``(packed [T],
    cu_seqlens [B+1] int32)``. Test/edge helper: it syncs to size the output.
    """
    if padded.shape != mask.shape or padded.dim() != 2:
        raise ValueError(f"padded and mask must both be [B, L], got {tuple(padded.shape)} and {tuple(mask.shape)}")
    n_cols = mask.shape[1]
    col = torch.arange(1, n_cols + 1, device=mask.device)
    lengths = ((mask != 0) * col).amax(dim=1) if n_cols else torch.zeros(mask.shape[0], dtype=torch.long)
    keep = torch.arange(n_cols, device=mask.device)[None, :] < lengths[:, None]
    cu = torch.zeros(mask.shape[0] + 1, dtype=torch.int32, device=mask.device)
    cu[1:] = torch.cumsum(lengths, 0)
    return padded[keep], cu
