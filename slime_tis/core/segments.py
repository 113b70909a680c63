"""Per-sequence sums and per-token expansion over the contiguous segments of a packed batch.

Sequence ``i`` owns tokens ``cu[i]:cu[i + 1]`` (see ``slime_tis.core.packing``). Two operations are
needed on that layout, both vectorised and free of host syncs:

* **segment sums** of several ``[T]`` rows at once: ``S[i, r] = sum_{cu[i] <= t < cu[i+1]} x_r[t]``,
  float64 ``[n_seq, k]``. ``torch.segment_reduce`` and ``index_add_`` are scalar loops on the CPU
  (about 1 ms per row of 5e5 tokens, 10x a plain ``sum``), so the sums come from prefix sums taken
  at chunk granularity: with chunks of ``C`` tokens, ``Q[j] = sum of chunk j`` (one GEMV of the
  ``[k T/C, C]`` view with ones), ``P[b] = sum_{j < b // C} Q[j] + sum_{t = C(b // C)}^{b-1} x[t]``
  (float64 cumulative sum of ``Q`` plus the partial chunk up to ``b``, read from one gathered chunk
  per boundary) and ``S[i] = P[cu[i+1]] - P[cu[i]]``. Work is ``O(k (T + n_seq C))``; zero-length
  sequences give exactly 0. The rows must be finite (a NaN would spread through ``P`` into later
  sequences): callers sanitise them and count non-finite values in a row of their own.
* **expansion** of per-sequence values to tokens, ``out[t] = v[seq_id[t]]``: on an accelerator an
  ``index_select`` with ``seq_id = repeat_interleave(lengths, output_size=T)`` (built once); on the
  CPU, where that gather is slow and does not scale with threads, each chunk of ``C`` tokens gets the
  value of its first token and the chunks holding a boundary are rewritten exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["Segments", "valid_bits", "select"]


def _chunk_size(n_tokens: int, n_seq: int) -> int:
    """Chunk length ``C``: 64 for sequences of 1024+ tokens on average, 32 from 256, else 16 (the
    gathered partial chunks cost ``O(n_seq C)``, the chunk sums ``O(T)`` nearly independently of ``C``)."""
    return 64 if n_tokens >= 1024 * max(n_seq, 1) else (32 if n_tokens >= 256 * max(n_seq, 1) else 16)


class Segments:
    """The segments ``cu_seqlens`` of a packed batch of ``n_tokens`` tokens on ``device``.

    Attributes:
        n_tokens: ``T``. n_seq: number of sequences. offsets: ``[n_seq + 1]`` int64 on ``device``.
        lengths: ``[n_seq]`` int64 tokens per sequence. chunk: ``C`` of the segment sums.
    """

    def __init__(self, cu_seqlens: Tensor, n_tokens: int, device: torch.device) -> None:
        self.n_tokens = n_tokens
        self.n_seq = cu_seqlens.numel() - 1
        self.device = device
        self.offsets = cu_seqlens.to(device=device, dtype=torch.int64)
        self.lengths = self.offsets[1:] - self.offsets[:-1]
        self.chunk = _chunk_size(n_tokens, self.n_seq)
        self._index: Tensor | None = None
        self._bounds: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
        self._plan: tuple[Tensor, Tensor, Tensor] | None = None

    @property
    def index(self) -> Tensor:
        """``[T]`` int64 sequence index of every token (computed once)."""
        if self._index is None:
            self._index = torch.repeat_interleave(self.lengths, output_size=self.n_tokens)
        return self._index

    def expand(self, values: Tensor) -> Tensor:
        """Per-sequence ``values`` ``[n_seq]`` broadcast to their tokens: ``[T]``, ``out[t] = values[seq_id[t]]``.

        On an accelerator one ``index_select``. On the CPU, where ``index_select`` is a gather that
        does not scale with threads, a broadcast per chunk of ``C`` tokens (the value of the chunk's
        first token) followed by an exact rewrite of the chunks that hold a sequence boundary.
        """
        if values.device.type != "cpu" or self.n_tokens == 0:
            return values.index_select(0, self.index)
        first, rows, row_seq = self._broadcast_plan()
        out = values.index_select(0, first).unsqueeze(1).expand(-1, self.chunk).contiguous()  # [n_chunks, C]
        out.index_copy_(0, rows, values.index_select(0, row_seq).view(-1, self.chunk))
        return out.view(-1)[: self.n_tokens]

    def _broadcast_plan(self) -> tuple[Tensor, Tensor, Tensor]:
        """Sequence of each chunk's first token, the chunks holding an offset, and their tokens' sequences.

        ``seq(p) = #{ends <= p}`` with ``ends = cu[1:]``: per chunk start from a histogram of the
        ends' chunks, inside a gathered chunk from a running count of the ends it holds.
        """
        if self._plan is None:
            chunk, n_seq = self.chunk, self.n_seq
            n_chunks = -(-self.n_tokens // chunk)
            ends = self.offsets[1:]
            ones = torch.ones_like(ends)
            at_or_before = torch.zeros(n_chunks + 1, dtype=torch.int64, device=self.device)
            at_or_before.index_add_(0, torch.div(ends + chunk - 1, chunk, rounding_mode="floor"), ones)
            first = at_or_before.cumsum_(0)[:n_chunks]  # ends <= j C
            marks = torch.zeros(n_chunks * chunk + 1, dtype=torch.int32, device=self.device)
            marks.index_add_(0, ends, ones.to(torch.int32))
            rows = torch.div(self.offsets, chunk, rounding_mode="floor").clamp_(max=n_chunks - 1)
            window = marks[: n_chunks * chunk].view(n_chunks, chunk).index_select(0, rows)
            counts = window.cumsum_(1)  # ends at or before each token of the chunk, from its start
            row_seq = (counts - counts[:, :1]).add_(first.index_select(0, rows)[:, None])
            self._plan = first, rows, row_seq.clamp_(max=n_seq - 1).view(-1)  # padding tokens: any valid index
        return self._plan

    def row_buffer(self, k: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """A ``[k, T_pad]`` buffer for :meth:`sums`: write row ``r`` into ``buf[r, :T]``.

        ``T_pad = C (T // C + 1) > T``; the padding is zeroed here and must stay zero.
        """
        padded = (self.n_tokens // self.chunk + 1) * self.chunk
        buf = torch.empty((k, padded), dtype=dtype, device=self.device)
        buf[:, self.n_tokens:].zero_()
        return buf

    def sums(self, *bufs: Tensor) -> Tensor:
        """Per-sequence sums ``[n_seq, k]`` (float64) of the finite rows of ``bufs`` (from :meth:`row_buffer`),
        their rows in order.

        Chunk and partial-chunk sums are taken in each buffer's dtype. With float32 rows a sequence's
        sum depends (at float32 rounding) on where the batch's chunk grid falls; rows whose sums must
        not depend on the rest of the batch (the log-ratio sum behind sequence weights and rejection)
        go in a float64 buffer, where that dependence is far below float32 resolution.
        """
        chunk = self.chunk
        first, before, previous, has_previous = self._boundaries()
        at_boundary = []  # the prefix sum sum_{t < b} x[t] at every offset b, per buffer
        for buf in bufs:
            k = buf.shape[0]
            ones = torch.ones(chunk, dtype=buf.dtype, device=self.device)  # sums over C: a GEMV beats .sum(-1)
            chunk_prefix = torch.cumsum((buf.view(-1, chunk) @ ones).view(k, -1), 1, dtype=torch.float64)
            window = buf.view(k, -1, chunk).index_select(1, first).mul_(before)  # chunk tokens before b
            whole_chunks = chunk_prefix.index_select(1, previous).mul_(has_previous)  # chunks before b's
            at_boundary.append(whole_chunks.add_((window.view(-1, chunk) @ ones).view(k, -1)))
        prefix = torch.cat(at_boundary) if len(at_boundary) > 1 else at_boundary[0]
        return (prefix[:, 1:] - prefix[:, :-1]).T.contiguous()

    def _boundaries(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per offset ``b``: its chunk ``j = b // C``, a ``[n_seq + 1, C]`` float mask of that chunk's tokens
        before ``b``, the index ``j - 1`` of the last whole chunk before it (clamped) and ``j > 0`` (float64)."""
        if self._bounds is None:
            chunk = self.chunk
            first = torch.div(self.offsets, chunk, rounding_mode="floor")
            within = (self.offsets - first * chunk).float()  # tokens of the chunk before b
            positions = torch.arange(chunk, dtype=torch.float32, device=self.device)
            before = (within[:, None] - positions).clamp_(0.0, 1.0)
            self._bounds = first, before, (first - 1).clamp_(min=0), (first > 0).double()
        return self._bounds


def valid_bits(valid: Tensor) -> Tensor:
    """``[T]`` int32 selection mask: all bits set (-1) at valid tokens, 0 elsewhere (see :func:`select`)."""
    return torch.mul(valid.view(torch.int8), -1, out=torch.empty(valid.shape, dtype=torch.int32, device=valid.device))


def select(bits: Tensor, x: Tensor, out: Tensor | None = None) -> Tensor:
    """``x`` where ``bits`` is -1, else +0.0: ``torch.where(mask, x, 0)`` for float32 ``x``.

    A bitwise AND of the float's bits with an all-ones / all-zeros mask: a pure selection (NaN or
    inf at a dropped position cannot leak, unlike a multiplication), and vectorised on the CPU,
    where ``torch.where`` is a scalar loop (about 4x slower).
    """
    if out is None:
        out = torch.empty_like(x)
    torch.bitwise_and(x.view(torch.int32), bits, out=out.view(torch.int32))
    return out
