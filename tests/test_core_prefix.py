"""Prefix-ratio levels (``core.prefix``: ``prefix`` = CTPO's cumulative prefix product, ``prefix_min`` = MinPRO's
smallest token ratio of the prefix) against a loop over each sequence, on inner masked tokens and several sequences;
the chunked carry (context parallelism's layout, here on one process) equals the unchunked values; the refusals.
None of the anchors (verl, slime, AReaL, NeMo-RL, SkyRL) implements a prefix level, so the reference is the papers'
formula written as a loop. The torchrun check of the carry across CP ranks is tests/dist/test_global_search.py.

Tolerances: ``prefix`` is a float64 cumulative sum rounded to float32 (one rounding: rel 1e-6); ``prefix_min`` selects
one of the inputs (exact).
"""

from __future__ import annotations

import math

import pytest
import torch

from slime_tis import TISConfig, compute_tis, policy_loss
from slime_tis.core import LocalReducer
from slime_tis.core.packing import packed_layout
from slime_tis.core.prefix import prefix_log_ratios


def _batch(seed: int, lengths=(1, 7, 12, 3, 20)):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    lr = -2 * torch.rand(t, generator=g)
    lt = lr + 0.7 * torch.randn(t, generator=g)
    mask = torch.rand(t, generator=g) > 0.25
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return lt, lr, mask, cu


def _loop(kind: str, l: torch.Tensor, mask: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:  # noqa: E741
    out = torch.zeros(l.shape[0], dtype=torch.float64)
    for i in range(cu.numel() - 1):
        acc, low = 0.0, math.inf
        for t in range(int(cu[i]), int(cu[i + 1])):
            if mask[t]:
                acc += float(l[t])
                low = min(low, float(l[t]))
                out[t] = acc if kind == "sum" else low
    return out


@pytest.mark.parametrize("level, attr, kind", [("prefix", "prefix_sum_log_ratio", "sum"),
                                               ("prefix_min", "prefix_min_log_ratio", "min")])
@pytest.mark.parametrize("seed", range(3))
def test_prefix_levels_equal_the_loop(level, attr, kind, seed):
    lt, lr, mask, cu = _batch(seed)
    res = compute_tis(TISConfig(use_tis=True, level=level, upper=3.0), lt, lr, mask, cu)
    want = _loop(kind, (lt - lr), mask, cu)
    got = getattr(res.ratios, attr).double()
    if kind == "min":
        assert torch.equal(got, want.float().double())
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(res.weights.double(), torch.where(mask, want.exp().clamp(max=3.0), 0.0),
                               rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["sum", "min"])
def test_chunked_carry_equals_whole_sequences(kind):
    """Every sequence cut into K = 4 chunks (a token's chunk = its quarter of the sequence): the carry over the chunks
    gives the unchunked values (here every chunk is on this process; the torchrun test splits them over ranks)."""
    lt, lr, mask, cu = _batch(7)
    layout = packed_layout(cu, lt.shape[0], lt.device)
    l = torch.where(mask, lt - lr, 0.0)  # noqa: E741
    pos = torch.arange(lt.shape[0]) - cu[:-1][layout.seq_id]
    chunk = (4 * pos) // layout.lengths[layout.seq_id]
    whole = prefix_log_ratios(kind, l, mask, layout, LocalReducer())
    chunked = prefix_log_ratios(kind, l, mask, layout, LocalReducer(), (chunk, 4))
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)


def test_prefix_mask_rejects_the_tokens_of_a_large_prefix():
    # one sequence: l = [1.0, 1.0, -3.0, 0.0]: prefix sums 1, 2, -1, -1; prefix minima 1, 1, -3, -3
    l = torch.tensor([1.0, 1.0, -3.0, 0.0])  # noqa: E741
    zero, mask, cu = torch.zeros(4), torch.ones(4, dtype=torch.bool), torch.tensor([0, 4])
    keep = compute_tis(TISConfig(use_tis=True, level="prefix", mode="mask", lower=0.2, upper=5.0), l, zero, mask,
                       cu).keep_mask
    assert keep.tolist() == [True, False, True, True]  # e^2 > 5; e^-1 kept
    res = compute_tis(TISConfig(use_tis=True, level="prefix_min", mode="mask", lower=0.2, upper=5.0), l, zero, mask, cu)
    assert res.keep_mask.tolist() == [True, True, False, False]  # once e^-3 < 0.2 is in the prefix
    assert float(res.stats.finalize()["tis/rs_seq_masked_fraction"]) == 1.0


def test_context_parallel_without_chunks_is_refused():
    class CP2(LocalReducer):
        cp_size = 2

    lt, lr, mask, cu = _batch(1)
    with pytest.raises(ValueError, match=r"^--tis-level prefix_min under context parallelism \(CP = 2\) needs"):
        policy_loss(TISConfig(use_tis=True, level="prefix_min"), lt.clone().requires_grad_(True), lt, lr,
                    torch.ones_like(lt), mask, cu, reducer=CP2())


def test_rejection_sampling_at_a_prefix_level_is_refused():
    with pytest.raises(ValueError, match="^--tis-rs-level .* a prefix level is a weight level"):
        TISConfig(use_tis=True, rs_level="prefix")
