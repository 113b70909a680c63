"""slime's zigzag context-parallel layout of response tokens (``cp_utils.py`` of slime 624b824, re-derived).

A sample of ``total_length`` tokens (the last ``response_length`` the response) is cut into ``2 cp`` chunks of
``c = ceil(total_length / (2 cp))`` positions; CP rank ``r`` holds chunks ``r`` and ``2cp - 1 - r``. Response
token ``j`` is predicted at position ``P - 1 + j`` (``P = total_length - response_length``), so rank ``r`` holds,
chunk 0 first, ``j in [max(s_k, P - 1), min(e_k, total_length - 1)) - (P - 1)`` for its chunks ``[s_k, e_k)``.
Log-prob lists are CP-local, loss masks full length; the index helpers are vectorised CPU integer arithmetic
expanded on the device (no loop over samples, no device sync).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["cp_response_ranges", "local_response_index", "response_logit_rows"]


def cp_response_ranges(total_lengths: Sequence[int], response_lengths: Sequence[int], cp_rank: int,
                       cp_size: int) -> Tensor:
    """Response-index ranges of this CP rank: int64 ``[n, 2, 2]`` = ``(sample, chunk, (start, end))``; empty chunks
    ``(0, 0)``; with ``cp_size == 1`` chunk 0 is the whole response."""
    if len(total_lengths) != len(response_lengths):
        raise ValueError(f"total_lengths has {len(total_lengths)} samples but response_lengths has "
                         f"{len(response_lengths)}")
    for i, (t, r) in enumerate(zip(total_lengths, response_lengths)):
        if not 0 <= r < t:
            raise ValueError(f"sample {i}: response_length = {r} must satisfy 0 <= response_length < total_length = "
                             f"{t} (a prompt token precedes the response)")
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank = {cp_rank} must lie in [0, cp_size = {cp_size})")
    total = torch.as_tensor(list(total_lengths), dtype=torch.int64).reshape(-1)
    resp = torch.as_tensor(list(response_lengths), dtype=torch.int64).reshape(-1)
    out = torch.zeros((total.numel(), 2, 2), dtype=torch.int64)
    if cp_size == 1:
        out[:, 0, 1] = resp
        return out
    first_logit = total - resp - 1  # P - 1
    chunk = (total + 2 * cp_size - 1) // (2 * cp_size)
    starts = torch.stack([cp_rank * chunk, (2 * cp_size - cp_rank - 1) * chunk], dim=1)
    lo = torch.maximum(starts, first_logit[:, None])
    hi = torch.minimum(starts + chunk[:, None], (total - 1)[:, None])
    nonempty = lo < hi
    out[:, :, 0] = torch.where(nonempty, lo - first_logit[:, None], 0)
    out[:, :, 1] = torch.where(nonempty, hi - first_logit[:, None], 0)
    return out


def _positions(ranges: Tensor, device: torch.device | str | None) -> tuple[Tensor, Tensor]:
    """``(segment [N], j [N])`` on ``device`` for every response index ``j`` of the ``[n, 2, 2]`` ``ranges``
    (segment ``2 i + k``: chunk ``k`` of sample ``i``), with ``N`` known on the host (no device synchronisation)."""
    start = ranges[:, :, 0].reshape(-1)
    seg_len = ranges[:, :, 1].reshape(-1) - start
    total = int(seg_len.sum())
    seg = torch.repeat_interleave(torch.arange(seg_len.numel(), device=device), _h2d(seg_len, device),
                                  output_size=total)
    return seg, torch.arange(total, device=device) - _h2d(torch.cumsum(seg_len, 0) - seg_len - start, device)[seg]


def _h2d(t: Tensor, device: torch.device | str | None) -> Tensor:
    """Host-to-device copy that does not block on the device."""
    return t if device is None else t.to(device, non_blocking=True)


def local_response_index(total_lengths: Sequence[int], response_lengths: Sequence[int], cp_rank: int, cp_size: int,
                         *, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """``(index [T_local] int64 on device, local_lengths [n] int64 on the CPU)``: ``torch.cat(full-length
    tensors)[index]`` is ``torch.cat`` of slime's CP-local per-sample tensors (chunk 0 then chunk 1)."""
    ranges = cp_response_ranges(total_lengths, response_lengths, cp_rank, cp_size)
    resp = torch.as_tensor(list(response_lengths), dtype=torch.int64).reshape(-1)
    offsets = torch.cumsum(resp, 0) - resp  # start of each sample in the concatenation
    seg, j = _positions(ranges, device)
    return _h2d(offsets, device)[seg // 2] + j, (ranges[:, :, 1] - ranges[:, :, 0]).sum(dim=1)


def response_logit_rows(total_lengths: Sequence[int], response_lengths: Sequence[int], cp_rank: int, cp_size: int,
                        *, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """``(rows [T_local], token_index [T_local])`` int64 on ``device``: the rows of slime's packed local logits
    ``[1, T_pad, V/TP]`` (samples back to back; with zigzag CP ``2 c_i`` rows each, chunk 0 then chunk 1) that
    predict this rank's response tokens, and the targets' indices into ``torch.cat(unconcat_tokens)``, in the order
    of :func:`local_response_index`."""
    ranges = cp_response_ranges(total_lengths, response_lengths, cp_rank, cp_size)  # [n, 2, 2]
    total = torch.as_tensor(list(total_lengths), dtype=torch.int64).reshape(-1)
    resp = torch.as_tensor(list(response_lengths), dtype=torch.int64).reshape(-1)
    first_logit = total - resp - 1  # P - 1: global position predicting response token 0
    token_offset = torch.cumsum(total, 0) - total
    if cp_size == 1:
        row_base = torch.stack([token_offset + first_logit, torch.zeros_like(total)], dim=1)
    else:
        chunk = (total + 2 * cp_size - 1) // (2 * cp_size)
        local_offset = torch.cumsum(2 * chunk, 0) - 2 * chunk
        chunk_start = torch.stack([cp_rank * chunk, (2 * cp_size - cp_rank - 1) * chunk], dim=1)
        row_base = local_offset[:, None] + torch.stack([torch.zeros_like(chunk), chunk], dim=1) + first_logit[:, None] \
            - chunk_start
    seg, j = _positions(ranges, device)
    return _h2d(row_base.reshape(-1), device)[seg] + j, _h2d(token_offset + first_logit + 1, device)[seg // 2] + j
