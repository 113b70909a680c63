"""Per-token sampling supports of SGLang responses -> a packed, validated CSR (the input of the support replay).

Wire shapes (SGLang's ``output_token_sampling_mask``, slime's ``top_p_token_ids`` / ``top_p_token_offsets``), the
packed form (``ids [S]`` int32, ``offsets [R + 1]`` int64) and the validation rules: docs/sampling_support.md.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["SUPPORT_INVALID_METRIC", "SamplingSupport", "read_support", "validate_support"]

#: the collate metric counting sequences rejected for an invalid support
SUPPORT_INVALID_METRIC = "sglang/support_invalid_seq_fraction"
_MASK_KEY = "output_token_sampling_mask"
_SLIME_IDS = ("top_p_token_ids", "top_p_kept_token_ids")
_SLIME_OFFSETS = ("top_p_token_offsets", "top_p_kept_token_offsets")


@dataclass
class SamplingSupport:
    """The kept ids of ``R`` tokens: ``ids [S]`` int32, ``offsets [R + 1]`` int64 (``offsets[0] = 0``)."""

    ids: Tensor
    offsets: Tensor

    @property
    def num_rows(self) -> int:
        return int(self.offsets.numel()) - 1

    @classmethod
    def from_lengths(cls, ids: Tensor, lengths: Tensor) -> SamplingSupport:
        """Rows of ``lengths [R]`` ids each, taken from ``ids`` in order."""
        return cls(ids, torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths.to(torch.int64), 0)]))

    @classmethod
    def empty_rows(cls, n: int) -> SamplingSupport:
        """``n`` rows without ids (tool / environment tokens, not trained on)."""
        return cls.from_lengths(torch.zeros(0, dtype=torch.int32), torch.zeros(n, dtype=torch.int64))

def _int32(values: Sequence[int], name: str) -> Tensor:
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} holds a non-integer token id {v!r}")
    # ids outside int32 cannot be vocabulary ids: keep them visible to validation as -1 (out of range)
    return torch.tensor([v if -(2**31) <= v < 2**31 else -1 for v in values], dtype=torch.int32)


def _decode_int32(value: Any, name: str) -> Tensor:
    """base64 of little-endian int32, bytes, or a list of ints -> int32 ``[n]``."""
    if isinstance(value, str):
        try:
            value = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as err:
            raise ValueError(f"meta_info[{name!r}] is not base64: {err}") from err
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if len(raw) % 4:
            raise ValueError(f"meta_info[{name!r}] has {len(raw)} bytes, not a whole number of int32")
        return torch.frombuffer(bytearray(raw), dtype=torch.int32).clone() if raw else torch.zeros(0, dtype=torch.int32)
    if isinstance(value, (list, tuple)):
        return _int32(list(value), f"meta_info[{name!r}]")
    raise ValueError(f"meta_info[{name!r}] must be base64, bytes or a list of ints, got {type(value).__name__}")


def read_support(meta: Mapping[str, Any], n_tokens: int) -> tuple[SamplingSupport, list[str]]:
    """The support of ``n_tokens`` output tokens in ``meta`` and alignment errors (then ``n_tokens`` empty rows). A
    response without one, or a wire value of the wrong type, raises ``ValueError`` naming the key."""
    if meta.get(_MASK_KEY) is not None:
        rows = meta[_MASK_KEY]
        if not isinstance(rows, (list, tuple)) or not all(isinstance(r, (list, tuple)) for r in rows):
            raise ValueError(f"meta_info[{_MASK_KEY!r}] must be a list of token-id lists (one per output token)")
        if len(rows) != n_tokens:
            return SamplingSupport.empty_rows(n_tokens), [
                f"len({_MASK_KEY}) = {len(rows)} but len(output_token_logprobs) = {n_tokens}"]
        ids = _int32([t for r in rows for t in r], _MASK_KEY)
        return SamplingSupport.from_lengths(ids, torch.tensor([len(r) for r in rows], dtype=torch.int64)), []
    ids_entry = next(((k, meta[k]) for k in _SLIME_IDS if meta.get(k) is not None), None)
    off_entry = next(((k, meta[k]) for k in _SLIME_OFFSETS if meta.get(k) is not None), None)
    if ids_entry is None and off_entry is None:
        raise ValueError(
            "sampling_support=True needs the per-token support: send the /generate request with "
            "\"return_sampling_mask\": true (SGLang >= 0.5.23: meta_info['output_token_sampling_mask']) or slime's "
            "custom_params {\"return_top_p_token_ids\": true} (meta_info['top_p_token_ids'] / "
            "['top_p_token_offsets']), or parse with sampling_support=False")
    if ids_entry is None or off_entry is None:
        raise ValueError("meta_info carries only one of slime's top-p token ids / offsets "
                         f"({_SLIME_IDS[0]!r}, {_SLIME_OFFSETS[0]!r}); both are needed")
    ids = _decode_int32(ids_entry[1], ids_entry[0])
    offsets = _decode_int32(off_entry[1], off_entry[0]).to(torch.int64)
    if offsets.numel() != n_tokens + 1:
        reason = f"len({off_entry[0]}) = {offsets.numel()} but len(output_token_logprobs) + 1 = {n_tokens + 1}"
    elif offsets[0] != 0 or bool((offsets[1:] < offsets[:-1]).any()) or offsets[-1] != ids.numel():
        reason = (f"{off_entry[0]} must start at 0, never decrease and end at len({ids_entry[0]}) = {ids.numel()}; "
                  f"got first {int(offsets[0])}, last {int(offsets[-1])}")
    else:
        return SamplingSupport(ids, offsets), []
    return SamplingSupport.empty_rows(n_tokens), [reason]


def _positions(where: Tensor) -> str:
    idx = where.nonzero().flatten()[:6].tolist()  # host-sync-ok: an error message's positions, rollout parsing
    return ", ".join(map(str, idx[:5])) + (", ..." if len(idx) > 5 else "")


def validate_support(support: SamplingSupport, token_ids: Tensor,
                     vocab_size: int) -> tuple[SamplingSupport, Tensor, list[str]]:
    """Check every row of the generated tokens ``token_ids [R]`` against the rules of docs/sampling_support.md:
    returns the support with bad rows emptied, ``bad [R]`` bool, and one reason per failed rule (count, first
    positions)."""
    n = support.num_rows
    lengths = support.offsets.diff()
    row = torch.repeat_interleave(torch.arange(n), lengths)
    ids = support.ids.to(torch.int64)
    in_range = (ids >= 0) & (ids < vocab_size)
    out_of_range = torch.zeros(n, dtype=torch.int64).index_add_(0, row, (~in_range).to(torch.int64)) > 0
    key = row * vocab_size + ids.clamp(0, vocab_size - 1)
    ordered = key[in_range].sort().values
    duplicate = torch.zeros(n, dtype=torch.bool)
    dup_keys = ordered[1:][ordered[1:] == ordered[:-1]]
    duplicate[torch.div(dup_keys, vocab_size, rounding_mode="floor")] = True
    has_token = torch.zeros(n, dtype=torch.int64).index_add_(0, row, (ids == token_ids.to(torch.int64)[row]).long())
    rules = (
        ("empty sampling support", lengths == 0),
        (f"sampling support longer than the vocabulary ({vocab_size})", lengths > vocab_size),
        (f"sampling support id(s) outside [0, {vocab_size})", out_of_range),
        ("sampling support with a repeated id", duplicate),
        ("sampled token outside its sampling support", (has_token == 0) & (lengths > 0)),
    )
    bad = torch.zeros(n, dtype=torch.bool)
    reasons = []
    for name, failed in rules:
        if bool(failed.any()):
            reasons.append(f"{int(failed.sum())} token(s) with {name} at generated token(s) {_positions(failed)}")
            bad |= failed
    if not reasons:
        return support, bad, reasons
    emptied = SamplingSupport.from_lengths(support.ids[~bad[row]], torch.where(bad, torch.zeros_like(lengths), lengths))
    return emptied, bad, reasons
