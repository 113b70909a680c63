"""The reference log-probs are a checked input of every correction wherever a KL term reads them: the core's
(``kl_coef``) or the host's own (``StepEngine(host_kl=True)``, slime's custom loss). A non-finite valid reference
log-prob rejects its sequence like a non-finite advantage, in a host's own correction (``correct``), in the step totals
and in the loss, so the three agree on which sequences count. Comparisons are exact: the same float operations on the
same values."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slime_tis import TISConfig
from slime_tis.core import LocalReducer
from slime_tis.engine.batch import TISBatch
from slime_tis.engine.step import StepEngine
from slime_tis.engine.totals import _step_correction

CU = torch.tensor([0, 6, 13, 20, 24])
CFG = TISConfig(use_tis=True, mode="mask", level="geometric", upper=1.3)  # algorithm 2: decides from pi_old


def _batch():
    g = torch.Generator().manual_seed(3)
    n = int(CU[-1])
    rollout = -torch.rand(n, generator=g) * 2
    old = rollout + 0.02 * torch.randn(n, generator=g)
    ref = old - 0.05
    ref[8] = float("nan")  # sequence 1
    ref[21] = float("-inf")  # sequence 3
    return TISBatch(labels=torch.zeros(n, dtype=torch.long), loss_mask=torch.ones(n, dtype=torch.bool),
                    advantages=torch.randn(n, generator=g), cu_seqlens=CU, rollout_log_probs=rollout,
                    old_log_probs=old, ref_log_probs=ref)


def _with_nonfinite_advantages(batch):
    adv = batch.advantages.clone()
    adv[[8, 21]] = float("nan")
    return dataclasses.replace(batch, advantages=adv, ref_log_probs=batch.ref_log_probs.nan_to_num(0.0, 0.0, 0.0))


def _pi_old(batch):
    return batch, batch.old_log_probs


def _rejected(res):
    return res.ratios.seq_nonfinite.tolist()


@pytest.mark.parametrize("host_kl", [False, True])
def test_correct_checks_the_reference_log_probs_where_the_host_adds_a_kl_term(host_kl):
    batch = _batch()
    res = StepEngine(CFG, LocalReducer(), host_kl=host_kl).correct(batch, batch.old_log_probs)
    assert _rejected(res) == ([False, True, False, True] if host_kl else [False] * 4)
    if host_kl:  # the same decision as non-finite advantages in those sequences
        same = StepEngine(CFG, LocalReducer()).correct(*_pi_old(_with_nonfinite_advantages(batch)))
        assert torch.equal(res.keep_mask, same.keep_mask) and torch.equal(res.weights, same.weights)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_correct_and_the_step_totals_take_the_same_decision(kl_coef):
    """A host's own correction (slime) and the step totals' (Megatron) read the same inputs: with the core's KL term
    on, both reject the sequences of a non-finite reference log-prob."""
    cfg = CFG.replace(kl_coef=kl_coef)
    batch = _batch()
    decided = StepEngine(cfg, LocalReducer()).correct(batch, batch.old_log_probs)
    totals = _step_correction(cfg, batch, batch.old_log_probs, LocalReducer(), None)
    assert torch.equal(decided.keep_mask, totals.keep_mask)
    assert _rejected(decided) == ([False, True, False, True] if kl_coef else [False] * 4)


def test_the_loss_rejects_what_the_correction_rejected():
    """``loss`` checks the host's reference log-probs itself: the same keep mask as ``correct`` and a finite loss
    and gradient."""
    batch = _batch()
    engine = StepEngine(CFG, LocalReducer(), host_kl=True)
    engine.begin([batch])
    lp_theta = batch.old_log_probs.clone().requires_grad_(True)
    out = engine.loss(batch, lp_theta)
    decided = StepEngine(CFG, LocalReducer(), host_kl=True).correct(batch, batch.old_log_probs)
    assert torch.equal(out.keep_mask, decided.keep_mask)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(lp_theta.grad).all()
    plain = StepEngine(CFG, LocalReducer())
    plain.begin([batch])
    assert not torch.equal(plain.loss(batch, batch.old_log_probs).keep_mask, out.keep_mask)
