"""Prefix levels (docs/semantics.md, "Prefix levels"): ``prefix`` ``L_t = sum_{s <= t} l_s``, ``prefix_min``
``L_t = min_{s <= t} l_s`` over the sequence's valid tokens. Under CP, ``chunks = (c [T], K)`` gives each token's
chunk in positional order; one ``reducer.sequence_sum`` of a ``[n_seq, 3K]`` block (per chunk: sum, minimum, count;
one nonzero contributor per entry) carries the earlier chunks. ``prefix_min`` is exact (a ``cummin`` of int64 keys).
"""

from __future__ import annotations

import torch
from torch import Tensor

from slime_tis.core.packing import Layout
from slime_tis.core.reducer import Reducer

__all__ = ["prefix_log_ratios", "Chunks"]

F64 = torch.float64
#: ``(chunk index [T] int, K)``: each token's context-parallel chunk, in positional order within its sequence.
Chunks = tuple[Tensor, int]


def _order(x: Tensor) -> Tensor:
    """int64 in ``[0, 2^32)`` ordered as the float32 values ``x`` (no NaN)."""
    bits = x.float().view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) + 2 ** 31


def _segments(layout: Layout, chunks: Chunks | None) -> tuple[Tensor, int, int]:
    """``(segment id [T], number of segments, K)``: segment ``seq_id K + c_t``."""
    if chunks is None:
        return layout.seq_id, layout.n_seq, 1
    chunk, k = chunks
    return layout.seq_id * k + chunk.to(device=layout.seq_id.device, dtype=torch.int64), layout.n_seq * k, k


def prefix_log_ratios(kind: str, log_ratio: Tensor, token_ok: Tensor, layout: Layout, reducer: Reducer,
                      chunks: Chunks | None = None) -> Tensor:
    """``[T]`` float32 ``L_t`` of ``kind`` (``"sum"`` / ``"min"``) on ``token_ok``, 0 elsewhere, from the finite
    ``log_ratio`` (``Ratios.log_ratio``); one ``reducer.sequence_sum`` with ``chunks``."""
    seg, n_seg, k = _segments(layout, chunks)
    n = log_ratio.shape[0]
    idx = torch.arange(n, device=log_ratio.device)
    starts = torch.ones(n, dtype=torch.bool, device=log_ratio.device)
    starts[1:] = seg[1:] != seg[:-1]
    start = torch.cummax(torch.where(starts, idx, 0), 0).values  # first token of each token's segment
    l64 = torch.where(token_ok, log_ratio.to(F64), 0.0)
    if kind == "sum":
        cs = torch.cumsum(l64, 0)
        local = cs - (cs.index_select(0, start) - l64.index_select(0, start))
    else:
        key = (n_seg - seg) * 2 ** 32 + torch.where(token_ok, _order(log_ratio), 2 ** 32 - 1)
        local = l64.index_select(0, torch.cummin(key, 0).indices)
        local = torch.where(token_ok, local, torch.inf)
    if chunks is not None:
        carry = _carry(kind, l64, token_ok, seg, n_seg, k, layout.n_seq, reducer).index_select(0, seg)
        local = local + carry if kind == "sum" else torch.minimum(local, carry)
    return torch.where(token_ok, local, 0.0).float()


def _carry(kind: str, l64: Tensor, token_ok: Tensor, seg: Tensor, n_seg: int, k: int, n_seq: int,
           reducer: Reducer) -> Tensor:
    """``[n_seg]`` float64: per (sequence, chunk) the sum / minimum over the sequence's earlier chunks."""
    dev = l64.device
    ok = token_ok.to(F64)
    sums = torch.zeros(n_seg, dtype=F64, device=dev).index_add_(0, seg, l64)
    counts = torch.zeros(n_seg, dtype=F64, device=dev).index_add_(0, seg, ok)
    mins = torch.full((n_seg,), torch.inf, dtype=F64, device=dev).scatter_reduce_(
        0, seg, torch.where(token_ok, l64, torch.inf), "amin")
    block = torch.stack([sums, torch.where(counts > 0, mins, 0.0), counts], dim=1)  # [n_seg, 3], finite
    full = reducer.sequence_sum(block.reshape(n_seq, 3 * k)).reshape(n_seq, k, 3)
    if kind == "sum":  # exclusive cumulative sum over the chunks
        carry = torch.cumsum(full[:, :, 0], 1) - full[:, :, 0]
    else:  # exclusive cumulative minimum over the chunks holding a valid token
        m = torch.where(full[:, :, 2] > 0, full[:, :, 1], torch.inf)
        shifted = torch.cat([torch.full_like(m[:, :1], torch.inf), m[:, :-1]], dim=1)
        carry = torch.cummin(shifted, 1).values
    return carry.reshape(n_seg)
