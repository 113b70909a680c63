"""``slime_tis.core.segments``: segment sums, per-token expansion and bit selection on packed layouts,
and the properties of the core that rest on them (zero-length sequences, ``T == 0``, sums that do not
depend on the rest of the batch, non-finite values that stay in their own sequence, precision of the
ratio moments at a tiny mismatch)."""

from __future__ import annotations

import math

import pytest
import torch

from slime_tis import TISConfig, compute_tis
from slime_tis.core.segments import Segments, select, valid_bits

CPU = torch.device("cpu")


def _layout(lengths: list[int]) -> tuple[torch.Tensor, int]:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if lengths:
        cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return cu, int(cu[-1])


LAYOUTS = [
    [],  # no sequence at all
    [0],  # one empty sequence (a CP rank holding none of it)
    [0, 0, 0],
    [5],
    [0, 3, 0, 0, 7, 0],
    [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],  # many boundaries inside one chunk
    [64, 64, 0, 128],  # boundaries exactly on chunk starts
    [200, 1, 0, 37, 300, 2, 17],
]


@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("lengths", LAYOUTS)
def test_segment_sums_match_a_float64_reference(lengths: list[int], chunk: int) -> None:
    cu, n_tokens = _layout(lengths)
    segments = Segments(cu, n_tokens, CPU)
    segments.chunk = chunk
    g = torch.Generator().manual_seed(len(lengths) * 100 + chunk)
    rows32 = segments.row_buffer(2)
    rows32[:, :n_tokens] = torch.randn(2, n_tokens, generator=g) * 3.0
    rows64 = segments.row_buffer(1, torch.float64)
    rows64[:, :n_tokens] = torch.randn(1, n_tokens, generator=g, dtype=torch.float64)
    out = segments.sums(rows64, rows32)
    assert out.shape == (len(lengths), 3) and out.dtype == torch.float64
    values = torch.cat([rows64[:, :n_tokens], rows32[:, :n_tokens].double()])
    expected = torch.zeros(len(lengths), 3, dtype=torch.float64)
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        expected[i] = values[:, start:end].sum(1)
    torch.testing.assert_close(out[:, 0], expected[:, 0], rtol=1e-12, atol=1e-12)  # float64 row
    torch.testing.assert_close(out[:, 1:], expected[:, 1:], rtol=1e-6, atol=1e-5)  # float32 rows
    empty = torch.tensor(lengths, dtype=torch.int64) == 0
    assert bool((out[empty] == 0).all())  # zero-length sequences sum to exactly 0


@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("lengths", LAYOUTS)
def test_expand_matches_repeat_interleave(lengths: list[int], chunk: int) -> None:
    cu, n_tokens = _layout(lengths)
    segments = Segments(cu, n_tokens, CPU)
    segments.chunk = chunk
    reps = torch.tensor(lengths, dtype=torch.int64)
    values = torch.arange(len(lengths), dtype=torch.float32) * 0.5 - 1.0
    for v in (values, values > 0, values.to(torch.int32)):
        expanded = segments.expand(v)
        assert expanded.shape == (n_tokens,) and expanded.dtype == v.dtype
        assert torch.equal(expanded, torch.repeat_interleave(v, reps))
    assert torch.equal(segments.index, torch.repeat_interleave(torch.arange(len(lengths)), reps))


def test_select_drops_non_finite_values_without_leaking() -> None:
    x = torch.tensor([1.5, float("nan"), float("inf"), -2.0, float("-inf")])
    mask = torch.tensor([True, False, False, True, True])
    out = select(valid_bits(mask), x)
    assert out.tolist() == [1.5, 0.0, 0.0, -2.0, float("-inf")]
    assert not bool(torch.signbit(out[1:3]).any())  # dropped positions are +0.0


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_empty_batches_and_empty_sequences_for_every_level(level: str) -> None:
    cfg = TISConfig(use_tis=True, mode="mask", level=level, rs_level="token", veto_threshold=0.1)
    for cu in (torch.tensor([0]), torch.tensor([0, 0, 0, 0])):
        res = compute_tis(cfg, torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.bool), cu)
        assert res.weights.shape == (0,) and res.keep_mask.shape == (0,)
        metrics = res.stats.finalize()
        assert all(math.isfinite(float(v)) for v in metrics.values())
        assert float(metrics["tis/num_seqs"]) == 0 and float(metrics["tis/num_tokens"]) == 0


def test_sequence_sums_do_not_depend_on_the_batch_around_them() -> None:
    """A sequence's weight is the same alone and at any offset in a larger batch (float64 log-ratio row)."""
    g = torch.Generator().manual_seed(5)
    lp_rollout = -3.0 * torch.rand(300, generator=g)
    lp_train = lp_rollout + 0.4 * torch.randn(300, generator=g)
    cfg = TISConfig(use_tis=True, mode="mask", level="geometric", upper=10.0)
    alone = compute_tis(cfg, lp_train[100:250], lp_rollout[100:250], torch.ones(150), torch.tensor([0, 150]))
    for lengths in ([100, 150, 50], [37, 63, 150, 50], [1] * 100 + [150, 50]):
        cu, _ = _layout(lengths)
        res = compute_tis(cfg, lp_train, lp_rollout, torch.ones(300), cu)
        torch.testing.assert_close(res.weights[100:250], alone.weights, rtol=2e-7, atol=0)
        assert torch.equal(res.keep_mask[100:250], alone.keep_mask)


def test_non_finite_values_stay_in_their_sequence() -> None:
    """NaN / inf in one sequence reject it and change no other sequence's weight or keep mask."""
    g = torch.Generator().manual_seed(6)
    lp_rollout = -3.0 * torch.rand(90, generator=g)
    lp_train = lp_rollout + 0.3 * torch.randn(90, generator=g)
    cu = torch.tensor([0, 20, 50, 51, 90])
    cfg = TISConfig(use_tis=True, mode="truncate", level="sequence", upper=3.0, rs_level="geometric",
                    rs_lower=0.5, rs_upper=2.0)
    clean = compute_tis(cfg, lp_train, lp_rollout, torch.ones(90), cu)
    for bad in (float("nan"), float("inf"), float("-inf")):
        dirty_train = lp_train.clone()
        dirty_train[30] = bad
        res = compute_tis(cfg, dirty_train, lp_rollout, torch.ones(90), cu)
        others = torch.ones(90, dtype=torch.bool)
        others[20:50] = False
        assert torch.equal(res.weights[others], clean.weights[others])
        assert torch.equal(res.keep_mask[others], clean.keep_mask[others])
        assert not bool(res.keep_mask[20:50].any()) and bool((res.weights[20:50] == 0).all())
        assert float(res.stats.finalize()["tis/nonfinite_seq_fraction"]) == pytest.approx(0.25)


@pytest.mark.parametrize("sd", [1e-4, 1e-3])
def test_ratio_moments_are_accurate_for_a_tiny_mismatch(sd: float) -> None:
    """``ratio_std`` and ``chi2_token`` from ``e = expm1(l)`` keep their digits when ``r`` is ~1
    (docs/requests/core.md item 3: computed from float32 ``r`` and ``r^2`` they were 42% / 1.2% off)."""
    g = torch.Generator().manual_seed(7)
    n = 100_000
    lp_rollout = -4.0 * torch.rand(n, generator=g)
    log_ratio = sd * torch.randn(n, generator=g)
    lp_train = lp_rollout + log_ratio
    res = compute_tis(TISConfig(use_tis=True), lp_train, lp_rollout, torch.ones(n), torch.tensor([0, n]))
    metrics = res.stats.finalize()
    r = torch.exp((lp_train - lp_rollout).double())  # the float32 inputs' own ratio, in float64
    assert float(metrics["tis/ratio_std"]) == pytest.approx(float(r.std(unbiased=False)), rel=1e-3)
    assert float(metrics["tis/chi2_token"]) == pytest.approx(float((r * r).mean() - 1.0), rel=1e-3)
    assert float(metrics["tis/k3_kl"]) == pytest.approx(float((r - 1 - r.log()).mean()), rel=1e-3)
