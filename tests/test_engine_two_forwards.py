"""Algorithms 1 and 3 with ``drop``: the step totals correct at the pre-pass's ``lp_theta``, each loss at the
``lp_theta`` of its own forward, the one that produces the gradient.

The pre-pass (a forward-only pass before the step) only fixes the step's ``drop`` denominator. Every part of these
algorithms' correction reads ``lp_theta`` (the log-ratio ``l = sg(lp_theta) - lp_rollout`` feeds every rule, weight and
statistic), so the pre-pass's correction cannot stand for the loss's: where the two forwards differ (dropout, a
non-deterministic kernel, a weight change between them) its keep mask and weights are not the loss's. These tests run
the real ``StepEngine`` with two different ``lp_theta``, then the real Megatron hook on a tiny GPT whose training
forward differs from its pre-pass, and show that the loss follows its own forward and the denominator the pre-pass, and
that reusing the pre-pass's decision would change the loss. Comparisons are exact: the same float operations on the same
values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slime_tis import TISConfig, compute_tis, policy_loss
from slime_tis.core import LocalReducer
from slime_tis.core.algorithms import correction_inputs
from slime_tis.engine.batch import TISBatch
from slime_tis.engine.step import StepEngine

RULES = dict(mode="mask", level="geometric", upper=1.3, veto_threshold=1e-3, rejected_denominator="drop")
ALGORITHMS = {1: dict(use_rollout_log_probs=True), 3: dict(use_rollout_log_probs=True, use_tis=True)}
CU = torch.tensor([0, 6, 13, 20, 24])


def _data():
    g = torch.Generator().manual_seed(7)
    n = int(CU[-1])
    lp_rollout = -torch.rand(n, generator=g) * 2
    pre = lp_rollout + 0.02 * torch.randn(n, generator=g)  # every sequence within the bound at the pre-pass
    live = pre + 0.01 * torch.randn(n, generator=g)  # the training forward: another draw of the same policy
    live[6:13] += 0.5  # sequence 1: geometric ratio ~exp(0.5) > 1.3 at the training forward only
    mask = torch.ones(n, dtype=torch.bool)
    mask[[0, 14]] = False
    adv = torch.randn(n, generator=g)
    batch = TISBatch(labels=torch.zeros(n, dtype=torch.long), loss_mask=mask, advantages=adv, cu_seqlens=CU,
                     rollout_log_probs=lp_rollout)
    return batch, pre, live


def _decision(cfg, batch, lp_theta):
    """The correction one full call makes at ``lp_theta`` (what the loss would take)."""
    inputs = correction_inputs(cfg, lp_train=lp_theta, lp_rollout=batch.rollout_log_probs,
                               advantages=batch.advantages)
    return compute_tis(cfg, inputs.lp_train, inputs.lp_rollout, batch.loss_mask, batch.cu_seqlens,
                       extra_finite=inputs.extra_finite, loss_finite=inputs.loss_finite)


@pytest.mark.parametrize("algorithm", [1, 3])
def test_the_loss_corrects_at_its_own_forward_and_the_denominator_at_the_pre_pass(algorithm):
    cfg = TISConfig(**ALGORITHMS[algorithm], **RULES)
    batch, pre, live = _data()
    at_pre, at_live = _decision(cfg, batch, pre), _decision(cfg, batch, live)
    assert torch.equal(at_pre.loss_keep, batch.loss_mask)  # the pre-pass keeps every valid token
    assert not at_live.loss_keep[6:13].any() and at_live.loss_keep[13:].equal(batch.loss_mask[13:])

    engine = StepEngine(cfg, LocalReducer())
    totals = engine.begin([batch], pre_log_probs=[pre])
    assert totals.denominator.item() == batch.loss_mask.sum().item()  # drop counts the pre-pass's kept tokens

    theta = live.clone().requires_grad_(True)
    out = engine.loss(batch, theta)
    out.loss.backward()
    assert torch.equal(out.keep_mask, at_live.loss_keep)  # the loss's own forward decides what it keeps ...
    assert torch.equal(out.weights, at_live.weights)  # ... and its weights
    assert (theta.grad[6:13] == 0).all() and (theta.grad[1:6] != 0).all()  # no gradient from the rejected one
    expect = policy_loss(cfg, live, None, batch.rollout_log_probs, batch.advantages, batch.loss_mask, CU,
                         denominator=totals.denominator)
    assert torch.equal(out.loss, expect.loss)

    # the pre-pass's decision in its place would keep sequence 1 and weigh every token by the pre-pass's ratios
    reused = policy_loss(cfg, live, None, batch.rollout_log_probs, batch.advantages, batch.loss_mask, CU,
                         denominator=totals.denominator, correction=at_pre)
    assert reused.keep_mask[6:13].all() and not torch.equal(reused.loss, out.loss)
    if algorithm == 3:  # its weight is sg(pi_theta) / pi_rollout: the pre-pass's is another number
        kept = at_live.loss_keep
        assert not torch.equal(at_pre.weights[kept], at_live.weights[kept])


@pytest.mark.parametrize("algorithm", [1, 3])
def test_equal_forwards_give_the_pre_pass_decision(algorithm):
    """Where the two forwards agree bit for bit (no dropout, deterministic kernels, no weight change), the loss's
    correction is the pre-pass's: the second pass changes a number only where the forwards differ."""
    cfg = TISConfig(**ALGORITHMS[algorithm], **RULES)
    batch, pre, _ = _data()
    engine = StepEngine(cfg, LocalReducer())
    totals = engine.begin([batch], pre_log_probs=[pre])
    out = engine.loss(batch, pre.clone().requires_grad_(True))
    reused = policy_loss(cfg, pre, None, batch.rollout_log_probs, batch.advantages, batch.loss_mask, CU,
                         denominator=totals.denominator, correction=_decision(cfg, batch, pre))
    assert torch.equal(out.loss, reused.loss) and torch.equal(out.keep_mask, reused.keep_mask)


CHILD = Path(__file__).parent / "dist" / "two_forwards_worker.py"


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory):
    """One step through the real Megatron hook whose training forward differs from its pre-pass (logits scaled by
    2 with the gradient on, a stand-in for dropout): one gloo rank in a child process."""
    out = tmp_path_factory.mktemp("two_forwards")
    proc = subprocess.run([sys.executable, str(CHILD), str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out / "two_forwards.pt", weights_only=False)


@pytest.mark.parametrize("algorithm", [1, 3])
def test_megatron_hook_loss_follows_the_training_forward(megatron_run, algorithm):
    """The hook's denominator is the pre-pass's kept count; each loss keeps and weighs by its own forward's
    ``lp_theta``, which here differs from the pre-pass's and rejects other sequences."""
    run = megatron_run[algorithm]
    cfg = TISConfig(**run["cfg"])
    kept_pre = 0
    differs = valid = 0
    for pre, call in zip(run["pre"], run["loss"], strict=True):
        batch = call["batch"]
        at_pre, at_live = _decision(cfg, batch, pre), _decision(cfg, batch, call["lp_theta"])
        assert torch.equal(call["keep"], at_live.loss_keep) and torch.equal(call["weights"], at_live.weights)
        differs += int((at_pre.loss_keep != at_live.loss_keep).sum())
        kept_pre += int(at_pre.loss_keep.sum())
        valid += int(batch.loss_mask.sum())
    assert differs and kept_pre < valid, "here the forwards keep different tokens, and the pre-pass rejects some"
    assert [c["denominator"].item() for c in run["loss"]] == [kept_pre] * len(run["loss"])
