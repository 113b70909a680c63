"""Every formula of the core pinned to hand-computed numbers.

The batch (two sequences, packed) used throughout::

    seq A: tokens 0..2, seq B: tokens 3..4 (token 4 masked, NaN everywhere -> must be ignored)
    lp_rollout = [-1, -1, -1, -2, nan]
    r = pi_train / pi_rollout per valid token = [3, 0.25, 1.5, 0.8]
    sequence ratios: A = 3 * 0.25 * 1.5 = 1.125, B = 0.8; geometric: A = 1.125 ** (1/3), B = 0.8
    PPO: rho = pi_theta / pi_old = [1.5, 0.5, 1, 1.1], advantages = [1, -1, 2, -0.5], eps = 0.2
        -> ppo_t = [-1.2 (clipped), 0.8 (clipped), -2, 0.55]
"""

from __future__ import annotations

import math

import pytest
import torch
from _hand_batch import CU, LP_ROLLOUT, LP_TRAIN, MASK, NAN, R

from slime_tis import TISConfig, compute_tis, loss_denominator, policy_loss

RHO = [1.5, 0.5, 1.0, 1.1]
ADV = torch.tensor([1.0, -1.0, 2.0, -0.5, NAN])
PPO = [-1.2, 0.8, -2.0, 0.55]


def lp_theta_from(anchor: torch.Tensor, rho: list[float]) -> torch.Tensor:
    theta = anchor + torch.tensor([math.log(x) for x in rho] + [NAN])
    return theta.clone().requires_grad_(True)


def tis(cfg: TISConfig, **kw):
    return compute_tis(cfg, LP_TRAIN, LP_ROLLOUT, MASK, CU, **kw)


def approx(values, rel=1e-6, abs=1e-7):
    return pytest.approx(values, rel=rel, abs=abs)


# ----------------------------------------------------------------------------- weights: mode x level
@pytest.mark.parametrize(
    "mode, level, expected",
    [
        ("truncate", "token", [2.0, 0.25, 1.5, 0.8]),
        ("clip", "token", [2.0, 0.5, 1.5, 0.8]),
        ("mask", "token", [3.0, 0.25, 1.5, 0.8]),
        ("truncate", "sequence", [1.125] * 3 + [0.8]),
        ("clip", "sequence", [1.125] * 3 + [0.8]),
        ("mask", "sequence", [1.125] * 3 + [0.8]),
        ("truncate", "geometric", [1.125 ** (1 / 3)] * 3 + [0.8]),
        ("clip", "geometric", [1.125 ** (1 / 3)] * 3 + [0.8]),
    ],
)
def test_weights_per_mode_and_level(mode, level, expected):
    res = tis(TISConfig(use_tis=True, mode=mode, level=level, upper=2.0, lower=0.5))
    assert res.weights[:4].tolist() == approx(expected)
    assert res.weights[4].item() == 0.0  # masked token: weight 0, never NaN


def test_token_mask_mode_rejects_outside_bounds_but_keeps_weights():
    res = tis(TISConfig(use_tis=True, mode="mask", level="token", lower=0.5, upper=2.0))
    assert res.keep_mask.tolist() == [False, False, True, True, False]
    assert res.weights[:4].tolist() == approx([3.0, 0.25, 1.5, 0.8])  # rejection never changes a weight
    m = res.stats.finalize()
    assert m["tis/mask_fraction_low"].item() == approx(0.25)
    assert m["tis/mask_fraction_high"].item() == approx(0.25)
    assert m["tis/rejected_token_fraction"].item() == approx(0.5)
    assert m["tis/rejected_seq_fraction"].item() == 0.0  # no sequence rejected as a whole


def test_geometric_mask_default_bounds_reject_both_sequences():
    cfg = TISConfig(use_tis=True, mode="mask", level="geometric")
    assert (cfg.lower_bound, cfg.upper_bound) == (pytest.approx(1 / 1.001), 1.001)
    res = tis(cfg)
    assert res.keep_mask.tolist() == [False] * 5  # 1.125^(1/3) = 1.040 and 0.8 are both outside
    assert res.stats.finalize()["tis/mask_fraction_high"].item() == approx(0.5)


def test_asymmetric_bounds_are_on_train_over_rollout_not_its_inverse():
    """Bounds (0.9, 1.2): A (r = 1.125) is inside, B (r = 0.8) below. Inverted (1/r) would reject A, keep none."""
    res = tis(TISConfig(use_tis=True, mode="mask", level="sequence", lower=0.9, upper=1.2))
    assert res.keep_mask.tolist() == [True, True, True, False, False]
    m = res.stats.finalize()
    assert m["tis/mask_fraction_low"].item() == approx(0.5)
    assert m["tis/mask_fraction_high"].item() == 0.0


def test_truncate_and_clip_fractions():
    m = tis(TISConfig(use_tis=True, mode="truncate")).stats.finalize()
    assert m["tis/truncate_fraction"].item() == approx(0.25)
    m = tis(TISConfig(use_tis=True, mode="clip", lower=0.5, upper=2.0)).stats.finalize()
    assert (m["tis/clip_fraction_low"].item(), m["tis/clip_fraction_high"].item()) == approx((0.25, 0.25))


# ----------------------------------------------------------------------------- rejection sampling and veto
def test_sequence_rejection_sampling_with_asymmetric_bounds():
    cfg = TISConfig(use_tis=True, rs_level="sequence", rs_lower=0.9, rs_upper=1.2)
    res = tis(cfg)
    assert res.keep_mask.tolist() == [True, True, True, False, False]
    assert res.weights[:4].tolist() == approx([2.0, 0.25, 1.5, 0.8])  # weights untouched by RS
    m = res.stats.finalize()
    assert (m["tis/rs_fraction_low"].item(), m["tis/rs_fraction_high"].item()) == approx((0.5, 0.0))
    assert m["tis/rejected_seq_fraction"].item() == approx(0.5)


def test_token_rejection_sampling():
    res = tis(TISConfig(use_tis=True, rs_level="token", rs_lower=0.5, rs_upper=2.0))
    assert res.keep_mask.tolist() == [False, False, True, True, False]
    m = res.stats.finalize()
    assert (m["tis/rs_fraction_low"].item(), m["tis/rs_fraction_high"].item()) == approx((0.25, 0.25))


def test_geometric_rejection_sampling_default_bounds():
    cfg = TISConfig(use_tis=True, rs_level="geometric")
    assert cfg.rs_upper_bound == 1.001
    assert tis(cfg).keep_mask.tolist() == [False] * 5


def test_veto_without_rejection_sampling():
    """A token with r = 0.25 < 0.3 vetoes sequence A; RS is off."""
    res = tis(TISConfig(use_tis=True, veto_threshold=0.3))
    assert res.keep_mask.tolist() == [False, False, False, True, False]
    m = res.stats.finalize()
    assert m["tis/veto_seq_fraction"].item() == approx(0.5)
    assert m["tis/rejected_token_fraction"].item() == approx(0.75)
    assert m["tis/rejected_seq_fraction"].item() == approx(0.5)
    assert tis(TISConfig(use_tis=True, veto_threshold=0.2)).keep_mask[:4].all()


def test_veto_in_algorithm_1():
    cfg = TISConfig(use_rollout_log_probs=True, veto_threshold=0.3)
    assert tis(cfg).keep_mask.tolist() == [False, False, False, True, False]


# ----------------------------------------------------------------------------- batch normalisation
def test_batch_normalize_token_level():
    res = tis(TISConfig(use_tis=True, batch_normalize=True))
    factor = 4 / (2 + 0.25 + 1.5 + 0.8)
    assert res.weights[:4].tolist() == approx([w * factor for w in [2, 0.25, 1.5, 0.8]])
    assert res.stats.finalize()["tis/batch_norm_factor"].item() == approx(factor)
    assert res.stats.finalize()["tis/weight_mean"].item() == approx(1.0)


def test_batch_normalize_sequence_level_is_over_sequences():
    res = tis(TISConfig(use_tis=True, level="sequence", batch_normalize=True))
    factor = 2 / (1.125 + 0.8)  # one weight per sequence, not per token
    assert res.weights[:4].tolist() == approx([1.125 * factor] * 3 + [0.8 * factor])


def test_batch_normalize_over_kept_units_only():
    res = tis(TISConfig(use_tis=True, mode="mask", lower=0.5, upper=2.0, batch_normalize=True))
    factor = 2 / (1.5 + 0.8)
    assert res.weights[2:4].tolist() == approx([1.5 * factor, 0.8 * factor])


def test_batch_normalize_with_precomputed_factor():
    res = tis(TISConfig(use_tis=True, batch_normalize=True), batch_norm_factor=0.5)
    assert res.weights[:4].tolist() == approx([1.0, 0.125, 0.75, 0.4])
    assert res.norm_sum.item() == approx(4.55) and res.norm_count.item() == 4


# ----------------------------------------------------------------------------- diagnostics
def test_diagnostics_by_hand():
    m = tis(TISConfig(use_tis=True)).stats.finalize()
    logs = [math.log(x) for x in R]
    assert m["tis/kl"].item() == approx(-sum(logs) / 4)
    assert m["tis/k3_kl"].item() == approx(sum(r - 1 - math.log(r) for r in R) / 4)
    assert m["tis/chi2_token"].item() == approx(sum(r * r for r in R) / 4 - 1)
    assert m["tis/chi2_seq"].item() == approx((1.125**2 + 0.8**2) / 2 - 1)
    mean_train = [-1 + math.log(1.125) / 3, -2 + math.log(0.8)]
    mean_roll = [-1.0, -2.0]
    assert m["tis/training_ppl"].item() == approx(sum(math.exp(-x) for x in mean_train) / 2, rel=1e-5)
    assert m["tis/rollout_ppl"].item() == approx(sum(math.exp(-x) for x in mean_roll) / 2, rel=1e-5)
    assert m["tis/training_log_ppl"].item() == approx(-sum(mean_train) / 2)
    diffs = [r - t for r, t in zip(mean_roll, mean_train)]
    assert m["tis/log_ppl_diff"].item() == approx(sum(diffs) / 2)
    assert m["tis/log_ppl_abs_diff"].item() == approx(sum(abs(d) for d in diffs) / 2)
    assert m["tis/ppl_ratio"].item() == approx(sum(math.exp(d) for d in diffs) / 2)
    assert m["tis/ratio_mean"].item() == approx(sum(R) / 4)
    assert m["tis/ratio_std"].item() == approx(math.sqrt(sum(r * r for r in R) / 4 - (sum(R) / 4) ** 2), rel=1e-5)
    assert (m["tis/ratio_min"].item(), m["tis/ratio_max"].item()) == approx((0.25, 3.0))
    w = [2.0, 0.25, 1.5, 0.8]
    assert m["tis/ess"].item() == approx(sum(w) ** 2 / (4 * sum(x * x for x in w)))
    assert (m["tis/weight_min"].item(), m["tis/weight_max"].item()) == approx((0.25, 2.0))
    assert (m["tis/num_tokens"].item(), m["tis/num_seqs"].item()) == (4, 2)


def test_ratio_extremes_are_unclamped_at_sequence_level():
    """A sequence log-ratio of 30 exceeds the safety bound 20: ratio_max reports e^30, weight is capped."""
    lp_rollout = torch.zeros(3)
    lp_train = torch.tensor([10.0, 10.0, 10.0])
    res = compute_tis(TISConfig(use_tis=True, level="sequence", upper=1e12), lp_train, lp_rollout,
                      torch.ones(3), torch.tensor([0, 3]))
    m = res.stats.finalize()
    assert m["tis/ratio_max"].item() == approx(math.exp(30), rel=1e-6)
    assert res.weights[0].item() == approx(math.exp(20), rel=1e-6)  # the safety bound B = 20 caps exp


# ----------------------------------------------------------------------------- losses per algorithm
def test_algorithm_0_ppo_loss_and_gradient():
    theta = lp_theta_from(LP_TRAIN, RHO)
    out = policy_loss(TISConfig(), theta, LP_TRAIN, None, ADV, MASK, CU)
    assert out.loss.item() == approx(sum(PPO) / 4)
    out.loss.backward()
    # clipped tokens have zero gradient; t2: d(-A rho)/d theta = -2 * 1; t3: 0.5 * 1.1
    assert theta.grad.tolist() == approx([0.0, 0.0, -2.0 / 4, 0.55 / 4, 0.0])
    m = out.stats.finalize()
    assert m["policy/clipfrac"].item() == approx(0.5)
    assert m["policy/ppo_kl"].item() == approx(-sum(math.log(x) for x in RHO) / 4)


def test_algorithm_0_with_rollout_log_probs_only_adds_diagnostics():
    theta = lp_theta_from(LP_TRAIN, RHO)
    cfg = TISConfig()
    with_rollout = policy_loss(cfg, theta, LP_TRAIN, LP_ROLLOUT, ADV, MASK, CU)
    without = policy_loss(cfg, theta, LP_TRAIN, None, ADV, MASK, CU)
    assert with_rollout.loss.item() == without.loss.item()
    # the metric schema is a function of the configuration only: without rollout log-probs the tis/
    # diagnostics are zero-filled (same keys, so every rank reduces the same collectives)
    m_with, m_without = with_rollout.stats.finalize(), without.stats.finalize()
    assert m_with["tis/kl"].item() == approx(-sum(math.log(x) for x in R) / 4)
    assert set(m_with) == set(m_without) and m_without["tis/kl"].item() == 0.0
    for part in ("token_sums", "seq_sums", "mins", "maxs"):
        assert list(getattr(with_rollout.stats, part)) == list(getattr(without.stats, part))


def test_algorithm_1_uses_rollout_as_old():
    theta = lp_theta_from(LP_TRAIN, RHO)  # rho vs rollout = r * rho = [4.5, 0.125, 1.5, 0.88]
    out = policy_loss(TISConfig(use_rollout_log_probs=True), theta, None, LP_ROLLOUT, ADV, MASK, CU)
    assert out.loss.item() == approx((-1.2 + 0.8 - 2.4 + 0.44) / 4)
    assert out.weights[:4].tolist() == [1.0] * 4


@pytest.mark.parametrize("denominator, expected", [("keep", (-2.4 + 0.44) / 4), ("drop", (-2.4 + 0.44) / 2)])
def test_algorithm_1_mask_mode_rejects_on_theta_ratio(denominator, expected):
    cfg = TISConfig(use_rollout_log_probs=True, mode="mask", lower=0.5, upper=2.0, rejected_denominator=denominator)
    theta = lp_theta_from(LP_TRAIN, RHO)
    out = policy_loss(cfg, theta, None, LP_ROLLOUT, ADV, MASK, CU)
    assert out.keep_mask.tolist() == [False, False, True, True, False]
    assert out.loss.item() == approx(expected)
    out.loss.backward()
    assert theta.grad[:2].tolist() == [0.0, 0.0]  # rejected tokens: zero gradient


def test_algorithm_2_token_truncate():
    theta = lp_theta_from(LP_TRAIN, RHO)
    out = policy_loss(TISConfig(use_tis=True), theta, LP_TRAIN, LP_ROLLOUT, ADV, MASK, CU)
    w = [2.0, 0.25, 1.5, 0.8]
    assert out.loss.item() == approx(sum(a * b for a, b in zip(w, PPO)) / 4)
    out.loss.backward()
    assert theta.grad.tolist() == approx([0.0, 0.0, 1.5 * -2.0 / 4, 0.8 * 0.55 / 4, 0.0])


def test_algorithm_2_sequence_truncate():
    theta = lp_theta_from(LP_TRAIN, RHO)
    out = policy_loss(TISConfig(use_tis=True, level="sequence"), theta, LP_TRAIN, LP_ROLLOUT, ADV, MASK, CU)
    assert out.loss.item() == approx((1.125 * (-1.2 + 0.8 - 2.0) + 0.8 * 0.55) / 4)


def test_algorithm_2_batch_normalized():
    theta = lp_theta_from(LP_TRAIN, RHO)
    out = policy_loss(TISConfig(use_tis=True, batch_normalize=True), theta, LP_TRAIN, LP_ROLLOUT, ADV, MASK, CU)
    w = [2.0, 0.25, 1.5, 0.8]
    factor = 4 / sum(w)
    assert out.loss.item() == approx(factor * sum(a * b for a, b in zip(w, PPO)) / 4)


def test_algorithm_3_reinforce_with_detached_weights():
    theta = lp_theta_from(LP_TRAIN, RHO)  # w from sg(theta) - rollout: r' = [4.5, 0.125, 1.5, 0.88] -> trunc 2
    cfg = TISConfig(use_rollout_log_probs=True, use_tis=True)
    out = policy_loss(cfg, theta, None, LP_ROLLOUT, ADV, MASK, CU)
    w = [2.0, 0.125, 1.5, 0.88]
    th = theta.detach()[:4].tolist()
    adv = ADV[:4].tolist()
    assert out.loss.item() == approx(-sum(wi * a * t for wi, a, t in zip(w, adv, th)) / 4)
    out.loss.backward()
    # gradient = -w A / N exactly: w carries no gradient (stop-gradient)
    assert theta.grad[:4].tolist() == approx([-wi * a / 4 for wi, a in zip(w, adv)])
    assert out.stats.finalize()["policy/ppo_kl"].item() == approx(-sum(math.log(x * y) for x, y in zip(R, RHO)) / 4)


def test_dual_clip():
    lp_old = torch.zeros(2)
    theta = torch.tensor([math.log(5.0), math.log(5.0)], requires_grad=True)
    adv = torch.tensor([-1.0, 1.0])
    cu, mask = torch.tensor([0, 2]), torch.ones(2)
    out = policy_loss(TISConfig(dual_clip_c=3.0), theta, lp_old, None, adv, mask, cu)
    # t0: A<0: max(5, 1.2) = 5 -> dual clip min(5, 3) = 3; t1: A>0: max(-5, -1.2) = -1.2
    assert out.loss.item() == approx((3.0 - 1.2) / 2)
    out.loss.backward()
    assert theta.grad.tolist() == [0.0, 0.0]
    m = out.stats.finalize()
    assert m["policy/dual_clipfrac"].item() == approx(0.5)
    without = policy_loss(TISConfig(), theta, lp_old, None, adv, mask, cu)
    assert without.loss.item() == approx((5.0 - 1.2) / 2)


def test_asymmetric_ppo_clip():
    lp_old = torch.zeros(2)
    theta = torch.tensor([math.log(1.5), math.log(0.5)], requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    out = policy_loss(TISConfig(eps_clip=0.1, eps_clip_high=0.3), theta, lp_old, None, adv, torch.ones(2),
                      torch.tensor([0, 2]))
    assert out.loss.item() == approx((-1.3 + 0.9) / 2)


# ----------------------------------------------------------------------------- aggregation and denominators
@pytest.mark.parametrize(
    "agg, expected",
    [
        ("token-mean", sum(PPO) / 4),
        ("seq-mean-token-mean", ((-1.2 + 0.8 - 2.0) / 3 + 0.55) / 2),
        ("seq-mean-token-sum", ((-1.2 + 0.8 - 2.0) + 0.55) / 2),
    ],
)
def test_loss_aggregations(agg, expected):
    theta = lp_theta_from(LP_TRAIN, RHO)
    out = policy_loss(TISConfig(loss_agg=agg), theta, LP_TRAIN, None, ADV, MASK, CU)
    assert out.loss.item() == approx(expected)


@pytest.mark.parametrize(
    "agg, denominator, expected",
    [
        # token mask (0.5, 2) keeps tokens 2 and 3 (ppo -2.0, 0.55 with weights 1.5, 0.8)
        ("token-mean", "keep", (1.5 * -2.0 + 0.8 * 0.55) / 4),
        ("token-mean", "drop", (1.5 * -2.0 + 0.8 * 0.55) / 2),
        ("seq-mean-token-mean", "keep", (1.5 * -2.0 / 3 + 0.8 * 0.55 / 1) / 2),
        ("seq-mean-token-mean", "drop", (1.5 * -2.0 / 1 + 0.8 * 0.55 / 1) / 2),
        ("seq-mean-token-sum", "keep", (1.5 * -2.0 + 0.8 * 0.55) / 2),
    ],
)
def test_rejected_denominator_policies(agg, denominator, expected):
    cfg = TISConfig(use_tis=True, mode="mask", lower=0.5, upper=2.0, loss_agg=agg, rejected_denominator=denominator)
    theta = lp_theta_from(LP_TRAIN, RHO)
    out = policy_loss(cfg, theta, LP_TRAIN, LP_ROLLOUT, ADV, MASK, CU)
    assert out.loss.item() == approx(expected)


def test_drop_denominator_counts_only_sequences_with_kept_tokens():
    cfg = TISConfig(use_tis=True, mode="mask", level="sequence", lower=0.9, upper=1.2,
                    loss_agg="seq-mean-token-sum", rejected_denominator="drop")
    keep = tis(cfg).keep_mask
    assert loss_denominator(cfg, MASK, CU, keep_mask=keep).item() == 1.0
    assert loss_denominator(cfg.replace(rejected_denominator="keep"), MASK, CU).item() == 2.0


def test_global_denominator_is_used_when_given():
    theta = lp_theta_from(LP_TRAIN, RHO)
    out = policy_loss(TISConfig(), theta, LP_TRAIN, None, ADV, MASK, CU, denominator=torch.tensor(8.0))
    assert out.loss.item() == approx(sum(PPO) / 8)


def test_bfloat16_inputs_are_computed_in_float32():
    res32 = tis(TISConfig(use_tis=True, level="sequence"))
    res16 = compute_tis(TISConfig(use_tis=True, level="sequence"), LP_TRAIN.bfloat16(), LP_ROLLOUT.bfloat16(),
                        MASK, CU)
    assert res16.weights.dtype == torch.float32
    assert res16.weights[:4].tolist() == pytest.approx(res32.weights[:4].tolist(), rel=2e-2)
