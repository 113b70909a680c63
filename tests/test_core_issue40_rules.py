"""Issue 40's rejection rows and the metrics split by staleness, on the peers' own test cases (re-expressed on packed
sequences; each case cites its source).

* SkyRL's two-sided outlier veto: NovaSky-AI/SkyRL at a9564572eb8e91076be43c1bd5e4615e3de17265,
  ``tests/train/algorithms/test_off_policy_correction.py`` (``test_compute_outlier_token_mask_*``), the function
  ``skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py::compute_outlier_token_mask``. Its metrics
  ``outlier_seq_masked_ratio`` / ``_over_high_ratio`` / ``_under_low_ratio`` are ``tis/rejected_seq_fraction`` /
  ``tis/veto_upper_seq_fraction`` / ``tis/veto_seq_fraction`` here.
* NeMo-RL's sequence log-prob error: NVIDIA-NeMo/RL at 7ea279abfbeb698b092856d0dab61e7cf39bc909,
  ``tests/unit/algorithms/test_grpo.py::TestComputeAndApplySeqLogprobErrorMasking`` (the function
  ``nemo_rl/algorithms/grpo.py::compute_and_apply_seq_logprob_error_masking``, #1838 / #2559 / #3671). NeMo-RL drops
  the first position of each row (``[:, 1:]``): the sequences here are its rows after that slice. Its
  ``num_masked_seqs`` is ``tis/seq_logprob_error_fraction`` times the sequences; ``masked_correct_pct`` needs the
  rewards, which the correction does not see (docs/semantics.md).
* The binary KL (KPop): areal-project/AReaL at cbff54d645d2cd8ee1f1c358a82f3f473588433d,
  ``areal/utils/functional/functional.py`` (``compute_binary_kl_divergence``, ``apply_rejection_sampling`` with
  ``metric="binary_kl"``, #1405; ``tests/test_rejection_sampling.py`` has no ``binary_kl`` case there, so its edge
  cases are re-expressed with that metric) and PrimeIntellect-ai/prime-rl #3283 (open; its description's rule
  ``keep <=> D(p||q) <= phi and D(q||p) <= phi``, probabilities clamped to ``[1e-6, 1 - 1e-6]``).

Tolerances: the binary KL is computed in float64 from float32 log-probs; it is compared with a float64 evaluation of
the same formula to 1e-12.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from slime_tis import TISConfig, add_tis_arguments, compute_tis
from slime_tis.core.rules import binary_kl


def packed(rows: list[list[float]], rollout: list[list[float]] | None = None, masks: list[list[float]] | None = None):
    """Packed ``(lp_train, lp_rollout, mask, cu_seqlens)`` of per-sequence rows."""
    rollout = rollout or [[-1.0] * len(r) for r in rows]
    masks = masks or [[1.0] * len(r) for r in rows]
    cu = torch.tensor([0] + [sum(len(r) for r in rows[:i + 1]) for i in range(len(rows))])
    cat = lambda xs: torch.tensor([v for x in xs for v in x], dtype=torch.float32)  # noqa: E731
    return cat(rows), cat(rollout), cat(masks) > 0, cu


def metrics(res) -> dict[str, float]:
    return {k: float(v) for k, v in res.stats.finalize().items()}


# ---------------------------------------------------------------- SkyRL: two-sided outlier veto (item 5)

def skyrl(old: list[float], rollout: list[float], mask: list[float], low: float | None, high: float | None):
    cfg = TISConfig(use_tis=True, veto_threshold=low, veto_upper_threshold=high)
    lt, lr, m, cu = packed([old], [rollout], [mask])
    return compute_tis(cfg, lt, lr, m, cu)


@pytest.mark.parametrize("case, old, rollout, mask, low, high, kept, over, under", [
    # masks_by_token_bounds: ratios [1, 1, 148.4]: over 100
    ("masks_by_token_bounds", [-1.0, -1.0, -1.0], [-1.0, -1.0, -6.0], [1, 1, 1], 1e-4, 100.0, False, 1.0, 0.0),
    # accepts_in_bounds: ratios [1.65, 0.61, 1.0]
    ("accepts_in_bounds", [-1.0, -1.5, -1.0], [-1.5, -1.0, -1.0], [1, 1, 1], 1e-4, 100.0, True, 0.0, 0.0),
    # respects_loss_mask: the 148.4 token is masked out
    ("respects_loss_mask", [-1.0, -1.0, -1.0], [-1.0, -1.0, -6.0], [1, 1, 0], 1e-4, 100.0, True, 0.0, 0.0),
    # null_thresholds: nothing rejects
    ("null_thresholds", [-1.0, -1.0, -1.0], [-1.0, -1.0, -6.0], [1, 1, 1], None, None, True, None, None),
    # only_high_threshold
    ("only_high_threshold", [-1.0, -1.0, -1.0], [-1.0, -1.0, -6.0], [1, 1, 1], None, 100.0, False, 1.0, None),
    # only_low_threshold: ratio 4.5e-5 under 1e-4
    ("only_low_threshold", [-1.0, -1.0, -11.0], [-1.0, -1.0, -1.0], [1, 1, 1], 1e-4, None, False, None, 1.0),
])
def test_skyrl_outlier_token_mask_cases(case, old, rollout, mask, low, high, kept, over, under):
    res = skyrl(old, rollout, mask, low, high)
    m = metrics(res)
    assert bool(res.keep_mask[torch.tensor(mask) > 0].all()) is kept, case
    assert m["tis/rejected_seq_fraction"] == (0.0 if kept else 1.0)  # outlier_seq_masked_ratio
    assert m.get("tis/veto_upper_seq_fraction") == over  # outlier_seq_over_high_ratio (absent: no high bound)
    assert m.get("tis/veto_seq_fraction") == under  # outlier_seq_under_low_ratio


def test_two_sided_veto_counts_each_side_and_its_tokens():
    """One sequence per side plus a clean one: each side's row counts its own sequence, the token counters their
    tokens, and the sequence with both an under- and an over-ratio token is one rejected sequence."""
    lt, lr, m, cu = packed([[-1.0, -12.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -12.0]],
                           [[-1.0, -1.0, -1.0], [-7.0, -1.0], [-1.0, -1.0], [-7.0, -1.0]])
    res = compute_tis(TISConfig(use_tis=True, veto_threshold=1e-4, veto_upper_threshold=100.0), lt, lr, m, cu)
    got = metrics(res)
    assert res.keep_mask.tolist() == [False] * 5 + [True] * 2 + [False] * 2
    assert got["tis/veto_seq_fraction"] == 0.5 and got["tis/veto_upper_seq_fraction"] == 0.5
    assert got["tis/rejected_seq_fraction"] == 0.75
    assert got["tis/catastrophic_token_fraction"] == pytest.approx(2 / 9)
    assert got["tis/catastrophic_upper_token_fraction"] == pytest.approx(2 / 9)


# ---------------------------------------------------------------- NeMo-RL: sequence log-prob error (item 4)

def nemo(errors: list[list[float]], threshold: float | None, masks: list[list[float]] | None = None):
    """NeMo-RL's rows after its ``[:, 1:]`` slice: ``prev_logprobs = 0``, ``generation_logprobs = error``, so
    ``l = lp_train - lp_rollout = -error``; a row of sample_mask 0 is a sequence of masked tokens."""
    cfg = TISConfig(use_tis=True, seq_logprob_error_threshold=threshold)
    zeros = [[0.0] * len(e) for e in errors]
    lt, lr, m, cu = packed(zeros, errors, masks)
    res = compute_tis(cfg, lt - 1.0, lr - 1.0, m, cu)  # log-probs below 0; l is unchanged
    seq_kept = [bool(res.keep_mask[int(cu[i]):int(cu[i + 1])][m[int(cu[i]):int(cu[i + 1])]].all())
                for i in range(len(errors))]
    return res, seq_kept


def rows(n: int, length: int, errors: dict[int, tuple[slice, float]]) -> list[list[float]]:
    out = [[0.0] * length for _ in range(n)]
    for i, (where, e) in errors.items():
        for j in range(length)[where]:
            out[i][j] = e
    return out


def test_nemo_no_threshold_only_computes_metrics():
    res, kept = nemo(rows(4, 9, {0: (slice(0, 4), 0.1), 1: (slice(0, 4), 0.5), 2: (slice(0, 4), 1.0),
                                 3: (slice(0, 4), 2.0)}), None)
    assert all(kept) and "tis/seq_logprob_error_fraction" not in metrics(res)


def test_nemo_masking_with_threshold():
    """Mean of exp(|error|) over 9 tokens: 1.047, 1.047, 1.288, 1.764; threshold 1.2 masks the last two."""
    res, kept = nemo(rows(4, 9, {0: (slice(0, 4), 0.1), 1: (slice(0, 4), 0.1), 2: (slice(0, 4), 0.5),
                                 3: (slice(0, 4), 1.0)}), 1.2)
    assert kept == [True, True, False, False]
    assert metrics(res)["tis/seq_logprob_error_fraction"] == 0.5  # num_masked_seqs = 2 of 4


def test_nemo_no_sequences_masked_when_all_below_threshold():
    res, kept = nemo(rows(3, 7, {i: (slice(0, 3), 0.05) for i in range(3)}), 2.0)
    assert all(kept) and metrics(res)["tis/seq_logprob_error_fraction"] == 0.0


def test_nemo_all_sequences_masked_when_all_above_threshold():
    res, kept = nemo(rows(3, 7, {i: (slice(0, 3), 1.0) for i in range(3)}), 1.0)
    assert kept == [False] * 3 and metrics(res)["tis/seq_logprob_error_fraction"] == 1.0


def test_nemo_respects_existing_sample_mask():
    """Sequence 1 is already out (all its tokens masked): the other three are masked, 3 of the 3 with tokens."""
    masks = [[1.0] * 7, [0.0] * 7, [1.0] * 7, [1.0] * 7]
    res, kept = nemo(rows(4, 7, {i: (slice(0, 3), 1.0) for i in range(4)}), 1.0, masks)
    assert [kept[i] for i in (0, 2, 3)] == [False] * 3
    assert metrics(res)["tis/seq_logprob_error_fraction"] == 1.0 and metrics(res)["tis/num_seqs"] == 3


def test_nemo_masked_count():
    """``test_masked_correct_pct_calculation``'s masking: sequences 2-4 (error 1.5 on 3 of 7 tokens, mean 2.49)
    are masked at threshold 1.5 (its fraction of correct ones needs the rewards)."""
    res, kept = nemo(rows(5, 7, {i: (slice(0, 3), 1.5) for i in (2, 3, 4)}), 1.5)
    assert kept == [True, True, False, False, False]
    assert metrics(res)["tis/seq_logprob_error_fraction"] == pytest.approx(3 / 5)


def test_nemo_token_mask_is_respected():
    """Error 1 at positions 0-4 of 7; sequence 0 masks positions 2-4: means (2e + 2) / 4 = 1.859 and
    (5e + 2) / 7 = 2.227, threshold 2 masks sequence 1 only."""
    masks = [[1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0], [1.0] * 7]
    res, kept = nemo(rows(2, 7, {0: (slice(0, 5), 1.0), 1: (slice(0, 5), 1.0)}), 2.0, masks)
    assert kept == [True, False]
    error = 1.0 + res.ratios.column_mean("tis.seq_logprob_error_column")
    assert error.tolist() == pytest.approx([(2 * math.e + 2) / 4, (5 * math.e + 2) / 7], rel=1e-6)


def test_nemo_fully_token_masked_sequences_are_excluded():
    """Errors log 2, log 4, log 16 on one valid token each; the third sequence is fully masked: the errors are 2
    and 4 (the third counts nowhere), threshold 3 masks 1 of the 2 sequences with tokens."""
    masks = [[0.0, 1.0], [0.0, 1.0], [0.0, 0.0]]
    res, kept = nemo([[0.0, math.log(2.0)], [0.0, math.log(4.0)], [0.0, math.log(16.0)]], 3.0, masks)
    assert kept[:2] == [True, False]
    error = 1.0 + res.ratios.column_mean("tis.seq_logprob_error_column")
    assert error[:2].tolist() == pytest.approx([2.0, 4.0], rel=1e-6)
    assert metrics(res)["tis/seq_logprob_error_fraction"] == 0.5


def test_nemo_empty_batch_gives_zero():
    cfg = TISConfig(use_tis=True, seq_logprob_error_threshold=1.5)
    empty = torch.zeros(0)
    res = compute_tis(cfg, empty, empty, empty > 0, torch.tensor([0]))
    assert metrics(res)["tis/seq_logprob_error_fraction"] == 0.0


def test_nemo_threshold_boundary_values():
    """One valid token each, errors 0.4, 0.405, 0.41: exp gives 1.4918, 1.4993, 1.5068; threshold 1.5 masks the
    last only (NeMo-RL asserts at least it; its comparison keeps ``<= threshold`` as here)."""
    masks = [[0.0, 1.0]] * 3
    res, kept = nemo([[0.0, 0.4], [0.0, 0.405], [0.0, 0.41]], 1.5, masks)
    assert kept == [True, True, False]


# ---------------------------------------------------------------- binary KL, KPop (item 2)

def bernoulli_kl(p: float, q: float) -> float:
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def test_binary_kl_is_areals_formula_both_ways_in_float64():
    """AReaL's ``compute_binary_kl_divergence`` (and prime-rl's) on probabilities inside the clamp: the maximum of
    the two directions, evaluated from float32 log-probs in float64."""
    g = torch.Generator().manual_seed(0)
    lp = torch.log(torch.rand(200, generator=g) * 0.98 + 0.01)
    lq = torch.log(torch.rand(200, generator=g) * 0.98 + 0.01)
    got = binary_kl(lp, lq)
    assert got.dtype == torch.float64
    want = [max(bernoulli_kl(p, q), bernoulli_kl(q, p)) for p, q in zip(lp.double().exp().tolist(),
                                                                      lq.double().exp().tolist())]
    assert got.tolist() == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert torch.equal(got, binary_kl(lq, lp))  # symmetric by construction
    assert binary_kl(lq, lq).abs().max() < 1e-15 and bool((got >= 0).all())


def kpop(p: list[float], q: list[float], phi: float, mask: list[float] | None = None):
    cfg = TISConfig(use_tis=True, binary_kl_threshold=phi)
    lt, lr, m, cu = packed([[math.log(x) for x in p]], [[math.log(x) for x in q]], [mask or [1.0] * len(p)])
    return compute_tis(cfg, lt, lr, m, cu)


def test_kpop_band_is_wide_for_rare_tokens_and_tight_for_confident_ones():
    """prime-rl #3283: a rare token five times likelier under the trainer (q 1e-3, p 5e-3: KL 0.0037 / 0.0050) is
    kept at phi = 0.1; a confident one at ratio 0.67 (q 0.9, p 0.6: KL 0.226 one way) is rejected."""
    res = kpop([5e-3, 0.6, 0.5], [1e-3, 0.9, 0.5], 0.1)
    assert res.keep_mask.tolist() == [True, False, True]
    assert metrics(res)["tis/binary_kl_fraction"] == pytest.approx(1 / 3)


def test_kpop_rejects_when_either_direction_exceeds_phi():
    """q 0.5, p 0.95: D(p||q) = 0.495 <= 0.6 < D(q||p) = 0.830: rejected (prime-rl's ``and``, AReaL's maximum)."""
    assert bernoulli_kl(0.95, 0.5) < 0.6 < bernoulli_kl(0.5, 0.95)
    assert kpop([0.95], [0.5], 0.6).keep_mask.tolist() == [False]
    assert kpop([0.95], [0.5], 0.9).keep_mask.tolist() == [True]


def test_kpop_clamps_probabilities_that_round_to_one():
    """A log-prob of 0 (p = 1 in float32): with the clamp at 1e-6 the divergence stays finite and the decision is
    made (here against q = 0.99: D(q||p) = 0.082 < 0.1, kept; against q = 0.9: rejected)."""
    assert kpop([1.0, 1.0], [0.99, 0.9], 0.1).keep_mask.tolist() == [True, False]
    assert binary_kl(torch.zeros(1), torch.log(torch.tensor([0.99]))).item() == pytest.approx(0.0822, abs=1e-4)


def test_kpop_areal_edge_cases():
    """AReaL ``TestEdgeCases`` with ``metric="binary_kl"``: an all-masked row rejects nothing and reports 0; masked
    tokens are not counted (``test_padding_tokens_not_counted``); a -inf log-prob pair is a non-finite sequence here,
    rejected and counted (AReaL sets its log-ratio to 0 and keeps it; docs/semantics.md)."""
    res = kpop([0.9, 0.9, 0.9], [0.1, 0.1, 0.1], 0.1, mask=[0.0, 0.0, 0.0])
    assert not res.keep_mask.any() and metrics(res)["tis/binary_kl_fraction"] == 0.0
    res = kpop([0.9, 0.5, 0.5], [0.1, 0.5, 0.5], 0.1, mask=[0.0, 1.0, 1.0])
    assert res.keep_mask.tolist() == [False, True, True] and metrics(res)["tis/binary_kl_fraction"] == 0.0
    lt, lr, m, cu = packed([[0.0, -math.inf]], [[0.0, -math.inf]])
    res = compute_tis(TISConfig(use_tis=True, binary_kl_threshold=0.1), lt, lr, m, cu)
    assert not res.keep_mask.any() and metrics(res)["tis/nonfinite_seq_fraction"] == 1.0


# ---------------------------------------------------------------- staleness (item 9)

def stale_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, 6, 9, 20, 21, 30, 40])
    lr = -torch.rand(40, generator=g) * 3
    lt = lr + 0.4 * torch.randn(40, generator=g)
    mask = torch.rand(40, generator=g) > 0.2
    return lt, lr, mask, cu


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_staleness_buckets_are_the_metrics_of_their_sequences(level):
    """Each bucket's metrics equal the unsplit metrics of the sub-batch of its sequences (the rules act per token or
    per sequence, so a sub-batch decides as the whole); the buckets' token counts add up to the whole's."""
    lt, lr, mask, cu = stale_batch()
    staleness = torch.tensor([0, 3, 1, 0, 7, 2])  # buckets 0, 2plus, 1, 0, 2plus, 2plus at N = 2
    cfg = TISConfig(use_tis=True, level=level, mode="mask" if level == "token" else "truncate",
                    binary_kl_threshold=0.1, seq_logprob_error_threshold=2.0, staleness_buckets=2)
    got = metrics(compute_tis(cfg, lt, lr, mask, cu, staleness=staleness))
    plain = cfg.replace(staleness_buckets=None)
    for label, seqs in (("0", [0, 3]), ("1", [2]), ("2plus", [1, 4, 5])):
        parts = [(int(cu[i]), int(cu[i + 1])) for i in seqs]
        sub = [torch.cat([x[a:b] for a, b in parts]) for x in (lt, lr, mask)]
        sub_cu = torch.tensor([0] + list(torch.cumsum(torch.tensor([b - a for a, b in parts]), 0).tolist()))
        ref = metrics(compute_tis(plain, *sub, sub_cu))
        for name in ("kl", "k3_kl", "rejected_token_fraction", "num_tokens", "num_seqs"):
            assert got[f"tis/staleness_{label}/{name}"] == pytest.approx(ref[f"tis/{name}"], rel=1e-6, abs=1e-9)
        if level == "token":  # token units: the token-weighted mean of the weights is the weight mean
            assert got[f"tis/staleness_{label}/weight_mean"] == pytest.approx(ref["tis/weight_mean"], rel=1e-6)
    assert sum(got[f"tis/staleness_{b}/num_tokens"] for b in ("0", "1", "2plus")) == got["tis/num_tokens"]
    assert got["tis/staleness_invalid_seq_fraction"] == 0.0


def test_staleness_keys_follow_the_configuration_not_the_data():
    """All sequences in one bucket, or some invalid (negative, NaN): the same keys; the invalid are counted and in
    no bucket."""
    lt, lr, mask, cu = stale_batch(1)
    cfg = TISConfig(use_tis=True, staleness_buckets=3)
    a = metrics(compute_tis(cfg, lt, lr, mask, cu, staleness=torch.zeros(6)))
    b = metrics(compute_tis(cfg, lt, lr, mask, cu, staleness=torch.tensor([0.0, -1.0, math.nan, 2.0, 9.0, 1.5])))
    assert set(a) == set(b) and {f"tis/staleness_{x}/kl" for x in ("0", "1", "2", "3plus")} <= set(a)
    assert a["tis/staleness_0/num_seqs"] == 6 and a["tis/staleness_3plus/num_seqs"] == 0
    assert b["tis/staleness_invalid_seq_fraction"] == pytest.approx(2 / 6)
    assert [b[f"tis/staleness_{x}/num_seqs"] for x in ("0", "1", "2", "3plus")] == [1, 1, 1, 1]
    assert "tis/staleness_0/kl" not in metrics(compute_tis(cfg.replace(staleness_buckets=None), lt, lr, mask, cu))


def test_staleness_bad_input_is_one_line():
    lt, lr, mask, cu = stale_batch()
    cfg = TISConfig(use_tis=True, staleness_buckets=2)
    with pytest.raises(ValueError, match="--tis-staleness-buckets / --tis-staleness-bound-decay is set but the host "
                                         "gave no per-sequence staleness"):
        compute_tis(cfg, lt, lr, mask, cu)
    with pytest.raises(ValueError, match=r"staleness has shape \(5,\), expected \(6,\)"):
        compute_tis(cfg, lt, lr, mask, cu, staleness=torch.zeros(5))
    with pytest.raises(ValueError, match="staleness must be an integer or float tensor"):
        compute_tis(cfg, lt, lr, mask, cu, staleness=torch.zeros(6, dtype=torch.bool))
    args = add_tis_arguments(argparse.ArgumentParser()).parse_args(
        ["--use-tis", "--tis-staleness-buckets", "3", "--tis-staleness-bound-decay", "0.5"])
    plan = TISConfig.from_args(args).plan
    assert (plan.staleness_buckets, plan.staleness_decay) == (3, 0.5)
    for bad in (0, 2.5, 17, -1):
        with pytest.raises(ValueError, match=rf"--tis-staleness-buckets \(staleness_buckets\) = {bad!r}: must be an "
                                             r"integer in \[1, 16\]"):
            TISConfig(use_tis=True, staleness_buckets=bad)


@pytest.mark.parametrize("mode, level", [("truncate", "token"), ("clip", "sequence"), ("mask", "token"),
                                         ("mask", "geometric")])
def test_staleness_decay_is_each_sequence_with_its_own_bounds(mode, level):
    """``--tis-staleness-bound-decay g``: a sequence ``s`` stale has the weights and keep mask of the same sequence
    alone with ``upper_s = upper^(g^s)``, ``lower_s = lower^(g^s)``; an invalid staleness has bounds 1."""
    lt, lr, mask, cu = stale_batch(2)
    staleness = torch.tensor([0.0, 1.0, 2.0, 5.0, -1.0, math.nan])
    upper, lower, g = 1.6, 0.7, 0.5
    cfg = TISConfig(use_tis=True, mode=mode, level=level, upper=upper, lower=None if mode == "truncate" else lower,
                    staleness_decay=g)
    got = compute_tis(cfg, lt, lr, mask, cu, staleness=staleness)
    for i, s in enumerate(staleness.tolist()):
        a, b = int(cu[i]), int(cu[i + 1])
        f = g ** s if s >= 0 else 0.0
        bounds = dict(upper=upper ** f, lower=None if mode == "truncate" else lower ** f)
        if f == 0.0:  # bounds 1 and 1 cannot be configured: lower just below 1, the same decisions
            bounds = dict(upper=1.0, lower=1.0 - 1e-12)
        ref = compute_tis(cfg.replace(staleness_decay=None, **bounds), lt[a:b], lr[a:b], mask[a:b],
                          torch.tensor([0, b - a]))
        assert got.keep_mask[a:b].tolist() == ref.keep_mask.tolist(), (i, s)
        assert got.weights[a:b].tolist() == pytest.approx(ref.weights.tolist(), rel=1e-6), (i, s)


def test_staleness_decay_refused_where_no_bound_acts():
    with pytest.raises(ValueError, match=r"--tis-staleness-bound-decay \(staleness_decay\) = 0.5: algorithm 1 applies "
                                         "no weights and --tis-mode is not mask"):
        TISConfig(use_rollout_log_probs=True, staleness_decay=0.5)
    assert TISConfig(use_rollout_log_probs=True, mode="mask", staleness_decay=0.5).plan.staleness_decay == 0.5
    lt, lr, mask, cu = stale_batch()
    with pytest.raises(ValueError, match="the host gave no per-sequence staleness"):
        compute_tis(TISConfig(use_tis=True, staleness_decay=0.5), lt, lr, mask, cu)
