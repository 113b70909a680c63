"""``core.correction.refine``: a decision taken without ``lp_theta`` (pi_old and pi_rollout only, once per rollout),
finished with ``lp_theta``'s finiteness and the step's batch-normalisation factor, equals one ``correct`` that saw
everything: weights, keep masks, loss masks and every statistic, bit for bit (the same float operations on the
same values; only the order of the finiteness checks differs)."""

from __future__ import annotations

import pytest
import torch

from slime_tis import TISConfig
from slime_tis.core.algorithms import correction_inputs
from slime_tis.core.correction import as_valid_mask, correct, refine
from slime_tis.core.packing import packed_layout
from slime_tis.core.reducer import LocalReducer

CONFIGS = {
    "alg0": dict(),
    "alg2-token-truncate-bn": dict(use_tis=True, batch_normalize=True, level="token", mode="truncate", upper=2.0),
    "alg2-geo-mask-veto-bn": dict(use_tis=True, batch_normalize=True, level="geometric", mode="mask", upper=1.3,
                                  veto_threshold=1e-3),
    "alg2-seq-clip": dict(use_tis=True, level="sequence", mode="clip", upper=2.0, lower=0.5),
}


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, 5, 9, 16, 20, 27])
    n = int(cu[-1])
    lp_old = -torch.rand(n, generator=g) * 2
    lp_roll = lp_old + 0.3 * torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) > 0.2
    adv = torch.randn(n, generator=g)
    theta = lp_old + 0.05 * torch.randn(n, generator=g)
    theta[[2, 17]] = torch.tensor([float("nan"), float("inf")])  # sequences 0 and 3 (if valid there)
    mask[[2, 17]] = True
    theta[11] = float("nan")
    mask[11] = False  # masked: changes nothing
    lp_roll[22] = float("nan")  # non-finite before lp_theta is known
    return cu, lp_old, lp_roll, mask, adv, theta


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("factor", [None, 0.7])
def test_refine_equals_one_correction_with_lp_theta(name, factor):
    cfg = TISConfig(**CONFIGS[name])
    plan = cfg.plan
    cu, lp_old, lp_roll, mask, adv, theta = _batch(0)
    valid = as_valid_mask(mask)
    layout = packed_layout(cu, len(mask), lp_old.device)
    red = LocalReducer()
    full = correction_inputs(cfg, lp_train=lp_old, lp_rollout=lp_roll, advantages=adv, lp_theta=theta)
    part = correction_inputs(cfg, lp_train=lp_old, lp_rollout=lp_roll, advantages=adv)
    want = correct(plan, full.lp_train, full.lp_rollout, valid, layout, red, batch_norm_factor=factor,
                   extra_finite=full.extra_finite, loss_finite=full.loss_finite)
    decided = correct(plan, part.lp_train, part.lp_rollout, valid, layout, red, batch_norm_factor=1.0,
                      extra_finite=part.extra_finite, loss_finite=part.loss_finite)
    rejects = bool(part.loss_finite) is False
    got = refine(plan, decided, valid, layout, red, batch_norm_factor=factor,
                 extra_finite=(theta,) if rejects else (), loss_finite=() if rejects else (theta,))
    # lp_theta decides something here (the test could fail): a sequence leaves the loss
    assert not torch.equal(decided.loss_keep, want.loss_keep)
    for field in ("weights", "keep_mask", "loss_keep", "loss_ok", "seq_loss_nonfinite", "norm_sum", "norm_count"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    a, b = got.stats.finalize(), want.stats.finalize()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, equal_nan=True, msg=k)


def test_refine_loss_finite_needs_a_decision_with_it():
    cfg = TISConfig(use_tis=True)
    cu, lp_old, lp_roll, mask, adv, theta = _batch(1)
    valid = as_valid_mask(mask)
    layout = packed_layout(cu, len(mask), lp_old.device)
    decided = correct(cfg.plan, lp_old, lp_roll, valid, layout, LocalReducer())
    with pytest.raises(ValueError, match="loss_finite"):
        refine(cfg.plan, decided, valid, layout, LocalReducer(), loss_finite=(theta,))


def test_a_decision_is_reused_unchanged():
    """One decision finished for two steps (another lp_theta, another factor) stays what it was: the second
    finish equals a fresh correction too (a rollout's cached decision serves every epoch)."""
    cfg = TISConfig(**CONFIGS["alg2-geo-mask-veto-bn"])
    cu, lp_old, lp_roll, mask, adv, theta = _batch(2)
    valid = as_valid_mask(mask)
    layout = packed_layout(cu, len(mask), lp_old.device)
    red = LocalReducer()
    part = correction_inputs(cfg, lp_train=lp_old, lp_rollout=lp_roll, advantages=adv)
    decided = correct(cfg.plan, part.lp_train, part.lp_rollout, valid, layout, red, batch_norm_factor=1.0,
                      extra_finite=part.extra_finite)
    first = refine(cfg.plan, decided, valid, layout, red, batch_norm_factor=0.5, extra_finite=(theta,))
    theta2 = torch.where(torch.isfinite(theta), theta, 0.0)  # the next step: lp_theta finite everywhere
    again = refine(cfg.plan, decided, valid, layout, red, batch_norm_factor=1.25, extra_finite=(theta2,))
    full = correction_inputs(cfg, lp_train=lp_old, lp_rollout=lp_roll, advantages=adv, lp_theta=theta2)
    want = correct(cfg.plan, full.lp_train, full.lp_rollout, valid, layout, red, batch_norm_factor=1.25,
                   extra_finite=full.extra_finite)
    assert not torch.equal(first.loss_keep, again.loss_keep)
    for field in ("weights", "keep_mask", "loss_keep", "norm_sum"):
        assert torch.equal(getattr(again, field), getattr(want, field)), field
    a, b = again.stats.finalize(), want.stats.finalize()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, equal_nan=True, msg=k)
