"""A host's per-sequence staleness reaches the correction through the engine: ``TISBatch.staleness`` is read by the
step totals, ``StepEngine.correct`` and ``StepEngine.loss`` exactly as ``compute_tis(..., staleness=)`` /
``policy_loss(..., staleness=)`` read it (same float operations on the same values, so compared exactly), and a
configuration that reads staleness on a batch without it is refused in one line naming the flag."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slime_tis import TISConfig, compute_tis, policy_loss
from slime_tis.core import LocalReducer
from slime_tis.engine.batch import TISBatch
from slime_tis.engine.step import StepEngine

CU = torch.tensor([0, 5, 12, 18, 24])
STALE = torch.tensor([0.0, 1.0, 2.0, 5.0])  # one sequence per bucket of --tis-staleness-buckets 2, one beyond
CFG = TISConfig(use_tis=True, mode="truncate", level="token", upper=1.5, staleness_buckets=2, staleness_decay=0.5)


def _batch(staleness=STALE):
    g = torch.Generator().manual_seed(11)
    n = int(CU[-1])
    rollout = -torch.rand(n, generator=g) * 2
    return TISBatch(labels=torch.zeros(n, dtype=torch.long), loss_mask=torch.ones(n, dtype=torch.bool),
                    advantages=torch.randn(n, generator=g), cu_seqlens=CU, rollout_log_probs=rollout,
                    old_log_probs=rollout + 0.3 * torch.randn(n, generator=g), staleness=staleness)


def test_engine_reads_the_batch_staleness_as_the_core_does():
    batch = _batch()
    engine = StepEngine(CFG, LocalReducer())
    engine.begin([batch])
    lp_theta = batch.old_log_probs.clone().requires_grad_()
    out = engine.loss(batch, lp_theta)
    out.loss.backward()
    theta = batch.old_log_probs.clone().requires_grad_()
    ref = policy_loss(CFG, theta, batch.old_log_probs, batch.rollout_log_probs, batch.advantages, batch.loss_mask,
                      CU, staleness=STALE)
    ref.loss.backward()
    assert torch.equal(out.loss.detach(), ref.loss.detach()) and torch.equal(lp_theta.grad, theta.grad)
    direct = compute_tis(CFG, batch.old_log_probs, batch.rollout_log_probs, batch.loss_mask, CU, staleness=STALE)
    assert torch.equal(engine.correct(batch, batch.old_log_probs).weights, direct.weights)
    # the bounds are tightened per sequence: the weights differ from the run without decay
    plain = compute_tis(dataclasses.replace(CFG, staleness_decay=None), batch.old_log_probs,
                        batch.rollout_log_probs, batch.loss_mask, CU, staleness=STALE)
    assert not torch.equal(plain.weights, direct.weights)


def test_engine_staleness_metrics_split_by_bucket():
    engine = StepEngine(CFG, LocalReducer())
    batch = _batch()
    engine.begin([batch])
    engine.record(engine.loss(batch, batch.old_log_probs.clone()).stats)
    m = engine.end()
    assert [float(m[f"tis/staleness_{b}/num_seqs"]) for b in ("0", "1", "2plus")] == [1.0, 1.0, 2.0]


def test_staleness_configured_without_the_batch_giving_it_is_refused():
    engine, batch = StepEngine(CFG, LocalReducer()), _batch(staleness=None)
    engine.begin([batch])
    with pytest.raises(ValueError, match="--tis-staleness-buckets / --tis-staleness-bound-decay is set but the host"):
        engine.loss(batch, batch.old_log_probs.clone())
