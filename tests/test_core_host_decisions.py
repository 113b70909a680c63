"""Decisions a host makes outside the core: ``compute_tis(reject=...)`` and ``policy_loss(keep_override=...)``.

Same hand batch as tests/test_core_formulas.py: sequence A = tokens 0..2, B = tokens 3..4 (token 4 masked and NaN),
token ratios r = [3, 0.25, 1.5, 0.8].
"""

from __future__ import annotations

import pytest
import torch
from _hand_batch import CU, LP_ROLLOUT, LP_TRAIN, MASK, NAN

from slime_tis import TISConfig, compute_tis, policy_loss

ADV = torch.tensor([1.0, -1.0, 2.0, -0.5, NAN])


def test_reject_is_one_more_token_rejection():
    """Truncate at 2 rejects nothing; the host rejects token 2 (and masked token 4, ignored): kept = 0, 1, 3; the
    rejected fraction is 1/4; weights and diagnostics are those without the host's decision."""
    cfg = TISConfig(use_tis=True, mode="truncate", level="token", upper=2.0)
    host = torch.tensor([False, False, True, False, True])
    plain = compute_tis(cfg, LP_TRAIN, LP_ROLLOUT, MASK, CU)
    res = compute_tis(cfg, LP_TRAIN, LP_ROLLOUT, MASK, CU, reject=host)
    assert res.keep_mask.tolist() == [True, True, False, True, False]
    torch.testing.assert_close(res.weights, plain.weights)
    m, p = res.stats.finalize(), plain.stats.finalize()
    assert float(m["tis/rejected_token_fraction"]) == pytest.approx(0.25)
    assert float(p["tis/rejected_token_fraction"]) == 0.0
    assert float(m["tis/kl"]) == pytest.approx(float(p["tis/kl"]))
    assert float(m["tis/weight_max"]) == pytest.approx(2.0)  # over kept tokens: min(3, 2) at token 0
    assert float(m["tis/weight_mean"]) == pytest.approx((2.0 + 0.25 + 0.8) / 3)


def test_keep_override_replaces_the_rules_in_the_loss_only():
    """Algorithm 3, token mask [0.5, 2]: the rules keep tokens 2, 3 (ratios 1.5, 0.8). An override keeping 0 and 2
    gives loss = -(w_0 A_0 lp_0 + w_2 A_2 lp_2) with the unbounded mask weights, whatever the rules say; a
    masked token stays out."""
    cfg = TISConfig(use_tis=True, use_rollout_log_probs=True, mode="mask", level="token", loss_agg="token-mean")
    theta = LP_TRAIN.clone().requires_grad_(True)
    override = torch.tensor([True, False, True, False, True])
    out = policy_loss(cfg, theta, None, LP_ROLLOUT, ADV, MASK, CU, denominator=1.0, keep_override=override)
    rules = policy_loss(cfg, theta, None, LP_ROLLOUT, ADV, MASK, CU, denominator=1.0)
    assert rules.keep_mask.tolist() == [False, False, True, True, False]
    assert out.keep_mask.tolist() == [True, False, True, False, False]
    lp = LP_TRAIN.tolist()
    expect = -(3.0 * 1.0 * lp[0] + 1.5 * 2.0 * lp[2])
    assert float(out.loss) == pytest.approx(expect, rel=1e-6)
    out.loss.backward()
    assert theta.grad.tolist() == pytest.approx([-3.0, 0.0, -3.0, 0.0, 0.0], rel=1e-6)
    assert float(out.stats.finalize()["tis/rejected_token_fraction"]) == pytest.approx(0.5)  # the rules' count
