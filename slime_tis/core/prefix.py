"""Prefix-ratio levels: a token's log-ratio taken along its sequence's prefix (``core.levels``: ``prefix``,
``prefix_min``).

For valid token ``t`` of a finite sequence, over the valid tokens ``s <= t`` of the same sequence (``l_s`` the token
log-ratios, 0 at invalid tokens)::

    prefix      (CTPO, arXiv 2605.07331):  L_t = sum_{s <= t} l_s      the cumulative prefix product's log
    prefix_min  (MinPRO, arXiv 2601.22718): L_t = min_{s <= t} l_s      the smallest token ratio of the prefix

Context parallelism splits a sequence into chunks held by different ranks (Megatron's load balancing: ``2 CP`` chunks,
rank ``r`` holding chunks ``r`` and ``2 CP - 1 - r``). The caller then gives each token's chunk index ``c_t`` in
``[0, K)`` (``chunks = (c, K)``), in the sequence's positional order; each (sequence, chunk) lies whole on one rank, and
a rank's tokens of a sequence are its chunks in ascending order. The carry into chunk ``k`` of sequence ``i`` is the
sum / minimum over its chunks ``k' < k``: every rank fills its chunks' rows of one fixed ``[n_seq, 3K]`` float64 block
(per chunk: the sum of ``l``, the minimum of ``l`` or 0, the valid-token count; 0 in the other ranks' rows) and
``reducer.sequence_sum`` completes it: one collective of a shape set by ``n_seq`` and ``K``, whatever the data, and
exact (each entry has one nonzero contributor). Without ``chunks`` (a rank holds whole sequences) there is no
collective.

Within a (sequence, chunk) segment: the prefix sum is a float64 ``cumsum`` less its value before the segment; the
prefix minimum is exact: a ``cummin`` of the int64 key ``(n_segments - segment) 2^32 + order(l_t)`` (``order`` the
order-preserving integer of a float32; earlier segments get larger keys, so they never win), whose argmin is read
back from ``l``.
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
    """int64 in ``[0, 2^32)`` ordered as the float32 values ``x`` (no NaN): the IEEE bits, negative ones flipped."""
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
    """``[T]`` float32 ``L_t`` of ``kind`` (``"sum"`` or ``"min"``, module docstring) on ``token_ok``, 0 elsewhere.

    ``log_ratio``: ``[T]`` finite token log-ratios (``Ratios.log_ratio``, 0 off ``token_ok``). ``chunks``: see the
    module docstring; one ``reducer.sequence_sum`` when given.
    """
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
    """``[n_seg]`` float64: per (sequence, chunk) the sum (``inf``-free minimum) over the sequence's earlier chunks,
    completed over context parallelism by one ``sequence_sum`` of ``[n_seq, 3K]``."""
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
