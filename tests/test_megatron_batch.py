"""``TISBatch``: packed CP-local layout from padded [B, S] tensors (hand-derived expectations), errors."""

from __future__ import annotations

import pytest
import torch

from slime_tis.megatron import TISBatch, cp_slice_padded, cu_seqlens_from_seq_ids


def test_cp_slice_is_megatrons_load_balanced_layout():
    x = torch.arange(16).reshape(2, 8)  # S = 8, cp = 2: chunks of 2; rank 0 keeps chunks 0, 3; rank 1 keeps 1, 2
    assert cp_slice_padded(x, 2, 0).tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert cp_slice_padded(x, 2, 1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert cp_slice_padded(x, 1, 0) is x
    with pytest.raises(ValueError, match="sequence length 6 must be divisible by 2 \\* context_parallel_size = 4"):
        cp_slice_padded(torch.zeros(1, 6), 2, 0)


def test_cu_seqlens_from_sorted_ids_has_zero_length_sequences():
    ids = torch.tensor([0, 0, 2, 2, 2, 4])
    assert cu_seqlens_from_seq_ids(ids, 5).tolist() == [0, 2, 2, 5, 5, 6]


def test_from_padded_one_sequence_per_row():
    labels = torch.arange(8).reshape(2, 4)
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]])
    tb = TISBatch.from_padded(labels, mask, mask * 0.5, mask * -1.0, cp_slice=False)
    assert tb.labels.tolist() == list(range(8)) and tb.labels.dtype == torch.int64
    assert tb.cu_seqlens.tolist() == [0, 4, 8]
    assert tb.loss_mask.tolist() == [0, 1, 1, 0, 0, 0, 1, 1]
    assert tb.rollout_log_probs.tolist() == [-0.0, -1.0, -1.0, -0.0, -0.0, -0.0, -1.0, -1.0]
    assert tb.num_tokens == 8 and tb.num_sequences == 2 and tb.old_log_probs is None


def test_from_padded_packed_rows_under_cp_give_zero_length_parts():
    """Row 0 packs sequences 0 (positions 0-1) and 1 (2-7); row 1 is sequence 2. With CP=2 rank 1 holds
    positions 2-5 of each row: no token of sequence 0 (zero-length part), 4 of sequence 1."""
    labels = torch.arange(16).reshape(2, 8)
    seq_ids = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [2] * 8])
    mask = torch.ones(2, 8)
    r0 = TISBatch.from_padded(labels, mask, mask, seq_ids=seq_ids, cp_size=2, cp_rank=0)
    r1 = TISBatch.from_padded(labels, mask, mask, seq_ids=seq_ids, cp_size=2, cp_rank=1)
    assert r0.labels.tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert r0.cu_seqlens.tolist() == [0, 2, 4, 8]
    assert r1.labels.tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    assert r1.cu_seqlens.tolist() == [0, 0, 4, 8]


def test_from_padded_without_megatron_initialised_is_cp1():
    tb = TISBatch.from_padded(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4), torch.ones(1, 4))
    assert tb.num_tokens == 4 and tb.cu_seqlens.tolist() == [0, 4]


def test_errors_name_the_field():
    with pytest.raises(ValueError, match="seq_ids must be >= 0 and non-decreasing"):
        TISBatch.from_padded(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4), torch.ones(1, 4),
                             seq_ids=torch.tensor([[0, 1, 0, 1]]), cp_slice=False)
    with pytest.raises(ValueError, match=r"advantages must be a \[B, S\] tensor shaped like labels \(1, 4\)"):
        TISBatch.from_padded(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4), torch.ones(4), cp_slice=False)
    with pytest.raises(ValueError, match="length mismatch: advantages has 3 tokens, labels has 4"):
        TISBatch(torch.zeros(4, dtype=torch.long), torch.ones(4), torch.ones(3), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="labels must hold integer token ids"):
        TISBatch(torch.zeros(4), torch.ones(4), torch.ones(4), torch.tensor([0, 4]))
