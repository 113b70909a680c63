"""slime's zigzag CP layout: vectorised helpers vs a brute-force, position-by-position oracle."""

from __future__ import annotations

import random

import pytest
import torch
from _slime_oracle import owner_layout
from torch import Tensor

from slime_tis.slime.layout import (
    cp_response_ranges,
    local_response_index,
    response_logit_rows,
)


def slice_response_for_cp(
    x: Tensor, total_length: int, response_length: int, cp_rank: int, cp_size: int
) -> Tensor:
    """One full-length response tensor ``[R, ...]`` -> this rank's CP-local part (chunk 0 then chunk 1)."""
    if x.shape[0] != response_length:
        raise ValueError(f"x has {x.shape[0]} entries along dim 0 but response_length = {response_length}")
    ranges = cp_response_ranges([total_length], [response_length], cp_rank, cp_size)[0]
    (s0, e0), (s1, e1) = ranges.tolist()  # host-sync-ok (CPU tensor of Python ints)
    return torch.cat([x[s0:e0], x[s1:e1]], dim=0)


def _cases(n: int = 60, seed: int = 0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        cp = rng.choice([1, 2, 3, 4])
        k = rng.randint(1, 5)
        resp = [rng.randint(0, 20) for _ in range(k)]
        prompt = [rng.randint(1, 20) for _ in range(k)]
        out.append((cp, [p + r for p, r in zip(prompt, resp)], resp))
    return out


@pytest.mark.parametrize(("cp", "total", "resp"), _cases())
def test_local_index_matches_bruteforce_and_partitions(cp, total, resp):
    seen = []
    for rank in range(cp):
        index, lengths = local_response_index(total, resp, rank, cp)
        offsets = [sum(resp[:i]) for i in range(len(resp))]
        expect = [offsets[i] + j for i in range(len(resp)) for j in owner_layout(total[i], resp[i], cp)[rank]]
        assert index.tolist() == expect
        assert lengths.tolist() == [len(owner_layout(t, r, cp)[rank]) for t, r in zip(total, resp)]
        seen += expect
    assert sorted(seen) == list(range(sum(resp)))  # every response token on exactly one rank


def test_rank_without_response_tokens():
    # prompt 14, response 2, cp 2: chunks of 4; logit positions 13, 14 are in chunk 3 -> rank 0
    assert cp_response_ranges([16], [2], 1, 2).tolist() == [[[0, 0], [0, 0]]]
    assert cp_response_ranges([16], [2], 0, 2).tolist() == [[[0, 0], [0, 2]]]
    index, lengths = local_response_index([16], [2], 1, 2)
    assert index.numel() == 0 and lengths.tolist() == [0]


def test_slice_response_for_cp_orders_chunk0_then_chunk1():
    x = torch.arange(10.0)  # response of 10 tokens after a prompt of 3: total 13, cp 2 -> chunk 4
    # logit positions 2..11; chunks [0,4) [4,8) [8,12) [12,16): rank 0 holds chunks 0 and 3, rank 1 chunks 1, 2
    assert slice_response_for_cp(x, 13, 10, 0, 2).tolist() == [0.0, 1.0]
    assert slice_response_for_cp(x, 13, 10, 1, 2).tolist() == [2.0, 3, 4, 5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="x has 9 entries along dim 0 but response_length = 10"):
        slice_response_for_cp(x[:9], 13, 10, 0, 2)


@pytest.mark.parametrize(("cp", "total", "resp"), _cases(25, seed=1))
def test_response_logit_rows_bruteforce(cp, total, resp):
    """Build slime's packed local logits where every row records (sample, global position)."""
    for rank in range(cp):
        tags = []  # row -> (sample, global position) of slime's packed layout on this rank
        for i, t in enumerate(total):
            if cp == 1:
                tags += [(i, g) for g in range(t)]
            else:
                c = -(-t // (2 * cp))
                for k in (rank, 2 * cp - 1 - rank):
                    tags += [(i, g) for g in range(k * c, (k + 1) * c)]
        rows, tok = response_logit_rows(total, resp, rank, cp)
        token_base = [sum(total[:i]) for i in range(len(total))]
        expect_rows, expect_tok = [], []
        for i, (t, r) in enumerate(zip(total, resp)):
            for j in owner_layout(t, r, cp)[rank]:
                g = t - r - 1 + j
                expect_rows.append(tags.index((i, g)))
                expect_tok.append(token_base[i] + g + 1)
        assert rows.tolist() == expect_rows
        assert tok.tolist() == expect_tok


def test_bad_lengths_raise():
    with pytest.raises(ValueError, match="sample 0: response_length = 5 must satisfy 0 <= response_length < total"):
        local_response_index([5], [5], 0, 1)
    with pytest.raises(ValueError, match="total_lengths has 2 samples but response_lengths has 1"):
        local_response_index([5, 6], [2], 0, 1)
    with pytest.raises(ValueError, match=r"cp_rank = 2 must lie in \[0, cp_size = 2\)"):
        cp_response_ranges([5], [2], 2, 2)
