"""Bad data: non-finite log-probs, empty masks, mismatched shapes. No NaN may reach the loss."""

from __future__ import annotations

import math

import pytest
import torch

from slime_tis import TISConfig, compute_tis, policy_loss

CU = torch.tensor([0, 3, 5])
MASK = torch.tensor([1, 1, 1, 1, 1], dtype=torch.bool)
ALGORITHMS = {
    0: TISConfig(),
    1: TISConfig(use_rollout_log_probs=True),
    2: TISConfig(use_tis=True, level="sequence"),
    3: TISConfig(use_rollout_log_probs=True, use_tis=True, level="geometric", mode="clip"),
}


def batch():
    g = torch.Generator().manual_seed(0)
    lp_rollout = -torch.rand(5, generator=g) - 0.5
    lp_old = lp_rollout + 0.1 * torch.randn(5, generator=g)
    theta = (lp_old + 0.1 * torch.randn(5, generator=g)).requires_grad_(True)
    adv = torch.randn(5, generator=g)
    return theta, lp_old, lp_rollout, adv


def run(alg, theta, lp_old, lp_rollout, adv, mask=MASK, cu=CU):
    out = policy_loss(ALGORITHMS[alg], theta, lp_old, lp_rollout, adv, mask, cu)
    out.loss.backward()
    return out


@pytest.mark.parametrize("alg", [1, 2, 3])
@pytest.mark.parametrize("where", ["rollout", "train"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_log_prob_rejects_its_sequence(alg, where, bad):
    theta, lp_old, lp_rollout, adv = batch()
    if where == "rollout":
        lp_rollout = lp_rollout.clone()
        lp_rollout[4] = bad
    elif alg == 2:
        lp_old = lp_old.clone()
        lp_old[4] = bad
    else:  # algorithms 1 and 3 train against sg(theta)
        theta = theta.detach().clone()
        theta[4] = bad
        theta.requires_grad_(True)
    out = run(alg, theta, lp_old, lp_rollout, adv)
    assert torch.isfinite(out.loss)
    assert torch.isfinite(theta.grad).all()
    assert out.keep_mask.tolist() == [True, True, True, False, False]
    assert theta.grad[3:].tolist() == [0.0, 0.0]
    m = out.stats.finalize()
    assert m["tis/nonfinite_seq_fraction"].item() == pytest.approx(0.5)
    assert m["policy/nonfinite_seq_fraction"].item() == pytest.approx(0.5)
    assert all(math.isfinite(v.item()) for v in m.values())


def test_nonfinite_sequence_loss_equals_loss_without_it_up_to_denominator():
    theta, lp_old, lp_rollout, adv = batch()
    bad = lp_rollout.clone()
    bad[3] = float("nan")
    cfg = ALGORITHMS[2]
    out = policy_loss(cfg, theta, lp_old, bad, adv, MASK, CU)
    first = policy_loss(cfg, theta[:3], lp_old[:3], lp_rollout[:3], adv[:3], MASK[:3], torch.tensor([0, 3]),
                        denominator=5.0)  # 'keep': the rejected tokens stay in the denominator
    assert out.loss.item() == pytest.approx(first.loss.item(), rel=1e-6)


@pytest.mark.parametrize("alg", [0, 1, 2, 3])
def test_nonfinite_at_masked_positions_changes_nothing(alg):
    theta, lp_old, lp_rollout, adv = batch()
    mask = MASK.clone()
    mask[1] = False
    ref = run(alg, theta.detach().clone().requires_grad_(True), lp_old, lp_rollout, adv, mask=mask)
    poisoned = [t.detach().clone() for t in (theta, lp_old, lp_rollout, adv)]
    for t in poisoned:
        t[1] = float("nan")
    theta_p = poisoned[0].requires_grad_(True)
    out = run(alg, theta_p, *poisoned[1:], mask=mask)
    assert out.loss.item() == ref.loss.item()
    assert torch.equal(theta_p.grad, torch.nan_to_num(theta_p.grad)) and theta_p.grad[1].item() == 0.0
    assert out.keep_mask.tolist() == ref.keep_mask.tolist()
    fin, fin_ref = out.stats.finalize(), ref.stats.finalize()
    assert fin.keys() == fin_ref.keys()
    for k in fin:
        assert fin[k].item() == pytest.approx(fin_ref[k].item(), rel=1e-6, abs=1e-7), k


def test_nonfinite_advantage_rejects_its_sequence():
    theta, lp_old, lp_rollout, adv = batch()
    adv = adv.clone()
    adv[0] = float("nan")
    out = run(2, theta, lp_old, lp_rollout, adv)
    assert out.keep_mask.tolist() == [False, False, False, True, True]
    assert torch.isfinite(out.loss) and torch.isfinite(theta.grad).all()


def test_algorithm_0_nonfinite_old_log_prob_rejects_sequence():
    theta, lp_old, lp_rollout, adv = batch()
    lp_old = lp_old.clone()
    lp_old[0] = float("inf")
    out = run(0, theta, lp_old, None, adv)
    assert out.keep_mask.tolist() == [False, False, False, True, True]
    assert out.stats.finalize()["policy/nonfinite_seq_fraction"].item() == pytest.approx(0.5)
    assert torch.isfinite(theta.grad).all()


@pytest.mark.parametrize("alg", [0, 1, 2, 3])
def test_all_masked_batch_gives_zero_loss_and_zero_gradient(alg):
    theta, lp_old, lp_rollout, adv = batch()
    out = run(alg, theta, lp_old, lp_rollout, adv, mask=torch.zeros(5, dtype=torch.bool))
    assert out.loss.item() == 0.0
    assert theta.grad is not None and theta.grad.abs().sum().item() == 0.0
    assert all(math.isfinite(v.item()) for v in out.stats.finalize().values())


def test_empty_batch_and_empty_sequences():
    cfg = ALGORITHMS[3]
    theta = torch.zeros(0, requires_grad=True)
    out = policy_loss(cfg, theta, None, torch.zeros(0), torch.zeros(0), torch.zeros(0), torch.tensor([0, 0, 0]))
    out.loss.backward()
    assert out.loss.item() == 0.0 and theta.grad.shape == (0,)
    m = out.stats.finalize()
    assert m["tis/num_seqs"].item() == 0 and m["tis/ratio_max"].item() == 0.0


def test_zero_length_sequence_in_the_middle():
    lp_rollout = torch.tensor([-1.0, -1.0, -2.0])
    lp_train = lp_rollout + torch.tensor([math.log(2.0), math.log(2.0), math.log(0.5)])
    res = compute_tis(TISConfig(use_tis=True, level="sequence", upper=10.0), lp_train, lp_rollout, torch.ones(3),
                      torch.tensor([0, 2, 2, 3]))
    assert res.weights.tolist() == pytest.approx([4.0, 4.0, 0.5])
    assert res.stats.finalize()["tis/num_seqs"].item() == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lp_rollout=torch.zeros(4)), "length mismatch: lp_rollout has 4 tokens, lp_train has 5"),
        (dict(loss_mask=torch.ones(2, 5)), r"loss_mask must be a packed 1-D tensor \[T\], got shape \(2, 5\)"),
        (dict(cu_seqlens=torch.tensor([0, 3, 6])), "cu_seqlens must start at 0, be non-decreasing and end at T=5"),
        (dict(cu_seqlens=torch.tensor([0.0, 5.0])), "cu_seqlens must have an integer dtype"),
        (dict(cu_seqlens=torch.tensor([[0, 5]])), "cu_seqlens must be a 1-D tensor"),
        (dict(lp_rollout=torch.zeros(5, dtype=torch.long)), "lp_rollout must be a floating-point tensor"),
        (dict(lp_rollout=torch.zeros(5, device="meta")), "device mismatch: lp_rollout is on meta"),
    ],
)
def test_shape_length_dtype_device_errors_name_the_tensors(kwargs, message):
    args = dict(lp_train=torch.zeros(5), lp_rollout=torch.zeros(5), loss_mask=MASK, cu_seqlens=CU)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        compute_tis(TISConfig(use_tis=True), **args)


def test_policy_loss_missing_inputs_are_named():
    theta, lp_old, lp_rollout, adv = batch()
    with pytest.raises(ValueError, match="algorithm 2 .* needs lp_old"):
        policy_loss(ALGORITHMS[2], theta, None, lp_rollout, adv, MASK, CU)
    with pytest.raises(ValueError, match="algorithm 3 .* needs lp_rollout"):
        policy_loss(ALGORITHMS[3], theta, None, None, adv, MASK, CU)
    with pytest.raises(ValueError, match="length mismatch: advantages has 4 tokens"):
        policy_loss(ALGORITHMS[0], theta, lp_old, None, adv[:4], MASK, CU)


def test_huge_log_ratios_stay_finite():
    lp_rollout = torch.tensor([-1e4, -1.0, -1.0, -1.0, -1.0])
    theta, lp_old, _, adv = batch()
    lp_old = torch.tensor([-1.0, -1e4, -1.0, -1.0, -1.0])
    for alg in (1, 2, 3):
        th = theta.detach().clone().requires_grad_(True)
        out = run(alg, th, lp_old, lp_rollout, adv)
        assert torch.isfinite(out.loss) and torch.isfinite(th.grad).all()
        assert all(math.isfinite(v.item()) for v in out.stats.finalize().values())
