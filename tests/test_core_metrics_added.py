"""The metrics added from the seed documents, on hand-made batches: ``tis/log_ppl_diff_max|min``,
``tis/weight_std``, ``tis/catastrophic_token_fraction`` and ``tis/rs_seq_masked_fraction`` (formulas, empty
domains, keys that follow the configuration only, and completeness over context parallelism). verl 0.9.1 is the
oracle for each in ``test_core_verl_oracle.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from slime_tis import TISConfig, compute_tis
from slime_tis.core import LocalReducer


def _run(cfg: TISConfig, l: list[float], cu: list[int], lp_rollout: float = -1.0, reducer=None):  # noqa: E741
    lr = torch.full((len(l),), lp_rollout)
    res = compute_tis(cfg, lr + torch.tensor(l), lr, torch.ones(len(l), dtype=torch.bool), torch.tensor(cu),
                      reducer=reducer)
    return res, {k: float(v) for k, v in res.stats.finalize().items()}


def test_log_ppl_diff_extremes_are_over_sequences():
    # per-sequence log_ppl_diff = -mean_t l: sequences (0.1, 0.3) -> -0.2; (-0.4) -> 0.4; (0, 0, 0.3) -> -0.1
    _, m = _run(TISConfig(use_tis=True), [0.1, 0.3, -0.4, 0.0, 0.0, 0.3], [0, 2, 3, 6])
    assert m["tis/log_ppl_diff_max"] == pytest.approx(0.4, abs=1e-7)
    assert m["tis/log_ppl_diff_min"] == pytest.approx(-0.2, abs=1e-7)
    assert m["tis/log_ppl_diff"] == pytest.approx((0.4 - 0.2 - 0.1) / 3, abs=1e-7)


def test_weight_std_is_the_population_std_of_kept_weights():
    cfg = TISConfig(use_tis=True, mode="mask", level="token", lower=0.5, upper=2.0)
    l = [0.0, math.log(1.5), math.log(0.8), math.log(3.0)]  # noqa: E741  (the last one is rejected)
    _, m = _run(cfg, l, [0, 4])
    w = torch.tensor([1.0, 1.5, 0.8], dtype=torch.float64)
    assert m["tis/weight_std"] == pytest.approx(float(w.std(unbiased=False)), rel=1e-6)
    _, m = _run(TISConfig(use_tis=True), [0.0, 0.0], [0, 2])
    assert m["tis/weight_std"] == 0.0  # all weights 1: zero, never a negative variance's NaN


def test_catastrophic_token_fraction_counts_the_tokens_the_veto_tests():
    cfg = TISConfig(use_tis=True, veto_threshold=1e-3)
    res, m = _run(cfg, [0.0, -8.0, -9.0, 0.0, 0.0, 0.0], [0, 3, 6])
    assert m["tis/catastrophic_token_fraction"] == pytest.approx(2 / 6)
    assert m["tis/veto_seq_fraction"] == pytest.approx(1 / 2)
    assert res.keep_mask.tolist() == [False] * 3 + [True] * 3
    _, off = _run(TISConfig(use_tis=True), [0.0, -8.0], [0, 2])
    assert "tis/catastrophic_token_fraction" not in off  # the key follows the configuration


def test_rs_seq_masked_fraction_counts_sequences_with_a_rejected_token():
    cfg = TISConfig(use_tis=True, rs_level="token", rs_lower=0.5, rs_upper=2.0)
    # sequence 0: one token outside [0.5, 2]; sequence 1: none; sequence 2: two tokens outside
    res, m = _run(cfg, [0.0, 1.0, 0.0, 0.1, -0.1, -1.0, 0.0, 2.0], [0, 3, 5, 8])
    assert res.keep_mask.tolist() == [True, False, True, True, True, False, True, False]
    assert m["tis/rs_seq_masked_fraction"] == pytest.approx(2 / 3)
    assert m["tis/rejected_seq_fraction"] == 0.0 and m["tis/rejected_token_fraction"] == pytest.approx(3 / 8)
    _, plain = _run(TISConfig(use_tis=True), [0.0, 5.0], [0, 2])
    assert plain["tis/rs_seq_masked_fraction"] == 0.0  # no rule rejects: the key is there, the value 0


class _SecondRankOf:
    """Context parallelism over two ranks in one process: this rank's per-sequence sums plus the other rank's
    (recorded by running it first with :class:`_Recorder`)."""

    def __init__(self, other: torch.Tensor) -> None:
        self.other = other

    def sequence_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.other

    batch_sum = LocalReducer.batch_sum
    batch_min = LocalReducer.batch_min
    batch_max = LocalReducer.batch_max


class _Recorder(LocalReducer):
    def sequence_sum(self, x: torch.Tensor) -> torch.Tensor:
        self.local = x.clone()
        return x


@pytest.mark.parametrize("cfg", [TISConfig(use_tis=True, rs_level="token", rs_lower=0.5, rs_upper=2.0),
                                 TISConfig(use_tis=True, token_k2_threshold=0.5)], ids=["rs_token", "token_k2"])
def test_rs_seq_masked_fraction_is_complete_over_context_parallelism(cfg):
    """Two sequences split over two CP ranks; the only rejected token (l = 1.5) lies in rank 1's half of
    sequence 0. Rank 0 holds none of it and still counts sequence 0 as masked (the per-sequence column travels
    with the CP sum), so both ranks report the single-process value 1/2."""
    rank0, rank1 = [0.0, 0.1, 0.0, 0.0], [1.5, 0.0, 0.0, 0.0]  # each rank: two tokens of each sequence
    recorder = _Recorder()
    _, m1 = _run(cfg, rank1, [0, 2, 4], reducer=recorder)
    _, m0 = _run(cfg, rank0, [0, 2, 4], reducer=_SecondRankOf(recorder.local))
    _, whole = _run(cfg, [0.0, 0.1, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0], [0, 4, 8])
    assert whole["tis/rs_seq_masked_fraction"] == 0.5
    assert m0["tis/rs_seq_masked_fraction"] == 0.5  # rank 0 alone rejects no token of its own
    assert m0["tis/rejected_token_fraction"] == 0.0


def test_weight_std_keeps_its_digits_when_the_weights_are_close_to_one():
    """std = sqrt(E[w^2] - E[w]^2) cancels by ~1 / std^2: at std 1e-3 over 1e5 tokens float32 sums would leave
    ~10% error; the float64 sums keep 1e-6 relative against the float64 truth of the applied weights."""
    g = torch.Generator().manual_seed(0)
    l = (1e-3 * torch.randn(100_000, generator=g)).tolist()  # noqa: E741
    res, m = _run(TISConfig(use_tis=True), l, [0, 100_000])
    truth = res.weights.double().std(unbiased=False)
    assert m["tis/weight_std"] == pytest.approx(float(truth), rel=1e-6)


def test_token_ratio_mean_and_outside_fraction_read_token_ratios_at_every_level():
    # token ratios 0.85, 0.95, 1.05, 1.2 (two outside [0.9, 1.1]); the sequence level does not change them
    r = [0.85, 0.95, 1.05, 1.2]
    for level in ("token", "sequence"):
        _, m = _run(TISConfig(use_tis=True, level=level), [math.log(x) for x in r], [0, 1, 4])
        assert m["tis/token_ratio_mean"] == pytest.approx(sum(r) / 4, rel=1e-6)
        assert m["tis/token_ratio_outside_10pct_fraction"] == 0.5
