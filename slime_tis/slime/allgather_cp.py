"""slime's ``--allgather-cp`` layout for the custom loss: CP rank ``r`` holds positions ``[r L, (r + 1) L)`` of the
concatenated, padded micro-batch; response token ``j`` of sample ``i`` (offset ``o_i``, prompt ``P_i``) is predicted
at ``o_i + P_i - 1 + j``. The loss returns its log-probs to slime's zigzag layout with one differentiable CP sum.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["allgather_response_rows", "to_zigzag"]


def allgather_response_rows(total_lengths: Sequence[int], response_lengths: Sequence[int], cp_rank: int,
                            local_len: int, *, device: torch.device | str | None = None
                            ) -> tuple[Tensor, Tensor, Tensor]:
    """``(rows, token_index, response_pos)``, ``[T_ag]`` int64 on ``device``: the local logit rows holding response
    log-probs, their targets (indices into ``torch.cat(unconcat_tokens)``) and their positions in the concatenated
    full-length responses. ``O(n)`` host integers, one ``arange`` per sample segment."""
    chunk_start, chunk_end = cp_rank * local_len, (cp_rank + 1) * local_len
    rows, toks, pos = [], [], []
    seq_start = resp_offset = 0
    for total, resp in zip(total_lengths, response_lengths):
        total, resp = int(total), int(resp)
        first = seq_start + total - resp - 1  # global logit position predicting response token 0
        s, e = max(first, chunk_start), min(first + resp, chunk_end)
        if e > s:
            g = torch.arange(s, e, dtype=torch.int64)
            rows.append(g - chunk_start)
            toks.append(g + 1)
            pos.append(g - first + resp_offset)
        seq_start += total
        resp_offset += resp
    if not rows:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return empty, empty, empty
    return tuple(torch.cat(x).to(device, non_blocking=True) for x in (rows, toks, pos))  # type: ignore[return-value]


def to_zigzag(values: Tensor, response_pos: Tensor, n_full: int, zigzag_index: Tensor, cp_group) -> Tensor:
    """``[T_ag]`` allgather-layout values -> ``[T_local]`` zigzag-layout values (differentiable; one CP sum)."""
    from torch.distributed.nn.functional import all_reduce

    full = torch.zeros(n_full, dtype=values.dtype, device=values.device).index_add(0, response_pos, values)
    return all_reduce(full, group=cp_group)[zigzag_index]
