"""slime's hooks over the step engine: the rollout's correction from pi_old, decided once, is what each micro-batch
of the TIS function would have decided itself.

The rollout-data hook decides the rollout (``StepEngine.decide``) where ``drop``'s counts or the batch
normalisation need it; each TIS-function call then finishes its micro-batch's part (``engine.subset.decision_part``
+ ``refine``) instead of correcting again. Both must give what one correction of the micro-batch gives: the same
weights, keep masks, rejections and statistics, for micro-batches of any samples in any order, on any
context-parallel rank (a rank may hold no token of a sample).
"""

from __future__ import annotations

import pytest
import torch
from _slime_oracle import args_ns, make_batch

import slime_tis.engine.step as step_mod
from slime_tis import TISConfig, compute_tis
from slime_tis.core import LocalReducer
from slime_tis.core.algorithms import correction_inputs
from slime_tis.engine.batch import TISBatch
from slime_tis.engine.parallel import ParallelContext
from slime_tis.engine.step import StepEngine
from slime_tis.engine.subset import decision_part
from slime_tis.engine.totals import StepTotals
from slime_tis.slime import COLLECTOR, compute_tis_for_slime, postprocess_rollout_data
from slime_tis.slime.state import STATE

CFGS = {
    "a2_token_truncate_bn": TISConfig(use_tis=True, mode="truncate", level="token", upper=1.3, batch_normalize=True),
    "a2_seq_mask_veto": TISConfig(use_tis=True, mode="mask", level="sequence", upper=2.0, veto_threshold=1e-3),
    "a2_geo_mask_drop": TISConfig(use_tis=True, mode="mask", level="geometric", upper=1.1,
                                  rejected_denominator="drop"),
    "a1_token_mask": TISConfig(use_tis=False, use_rollout_log_probs=True, mode="mask", level="token", upper=1.5),
    "a0": TISConfig(),
    "a2_kpop_logprob_error_veto2_drop": TISConfig(use_tis=True, binary_kl_threshold=0.1,
                                                  seq_logprob_error_threshold=1.5, veto_upper_threshold=50.0,
                                                  rejected_denominator="drop"),
}


def _packed(g: torch.Generator, lengths: list[int]) -> dict:
    n = sum(lengths)
    lp = -torch.rand(n, generator=g) * 3
    out = {"lp": lp, "rollout": lp + 0.3 * torch.randn(n, generator=g), "mask": torch.rand(n, generator=g) > 0.2,
           "pg": torch.randn(n, generator=g)}
    out["rollout"][3] = float("nan")  # a non-finite rollout log-prob: its sequence leaves every diagnostic
    out["pg"][n - 2] = float("inf")  # a non-finite stand-in for the advantages: its sequence too
    return out


@pytest.mark.parametrize("name", list(CFGS))
def test_the_part_of_a_decision_is_the_decision_of_the_part(name):
    cfg = CFGS[name]
    g = torch.Generator().manual_seed(3)
    lengths = [5, 0, 7, 3, 9, 1, 6]
    x = _packed(g, lengths)
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()])
    whole = TISBatch(labels=torch.zeros(cu[-1].item(), dtype=torch.int64), loss_mask=x["mask"], advantages=None,
                     cu_seqlens=cu, rollout_log_probs=x["rollout"], old_log_probs=x["lp"])
    reducer = LocalReducer()
    decided = StepEngine(cfg, reducer).decide(whole)
    seqs = [4, 0, 6, 1, 3]  # a micro-batch of some sequences, in another order
    tokens = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in seqs])
    part_len = torch.tensor([lengths[i] for i in seqs])
    seq_id = torch.repeat_interleave(torch.arange(len(seqs)), part_len)
    part_cu = torch.tensor([0, *torch.cumsum(part_len, 0).tolist()])
    part = TISBatch(labels=torch.zeros(len(tokens), dtype=torch.int64), loss_mask=x["mask"][tokens],
                    advantages=x["pg"][tokens], cu_seqlens=part_cu, rollout_log_probs=x["rollout"][tokens],
                    old_log_probs=x["lp"][tokens])
    factor = torch.tensor(1.25) if cfg.batch_normalize else None
    engine = StepEngine(cfg, reducer, totals=StepTotals(torch.ones(()), torch.ones(()), factor, 1))
    engine.decisions.put(part, decision_part(decided, torch.tensor(seqs), tokens, seq_id))
    got = engine.correct(part, part.old_log_probs)
    inputs = correction_inputs(cfg, lp_train=part.old_log_probs, lp_rollout=part.rollout_log_probs,
                               advantages=part.advantages)
    want = compute_tis(cfg, inputs.lp_train, inputs.lp_rollout, part.loss_mask, part_cu, batch_norm_factor=factor,
                       extra_finite=inputs.extra_finite, loss_finite=inputs.loss_finite)
    for field in ("weights", "keep_mask", "loss_keep", "loss_ok", "seq_loss_nonfinite"):  # selections: exact
        torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=0, atol=0, msg=field)
    assert bool(~want.loss_keep[part.loss_mask].all())  # the rejections are in the part
    got_m, want_m = got.stats.finalize(), want.stats.finalize()
    assert set(got_m) == set(want_m)
    for k in want_m:  # the same float32 inputs gathered: the same sums, in the same order
        torch.testing.assert_close(got_m[k], want_m[k], rtol=0, atol=0, equal_nan=True, msg=k)
    # the decision's rejections without the stand-in: the engine finishes it, never corrects again
    assert engine.decisions.get(part) is not None


SLIME = {
    "a2_tok_trunc_bn": dict(use_tis=True, tis_mode="truncate", tis_level="token", tis_upper_bound=1.3,
                            tis_batch_normalize=True),
    "a2_seq_clip_bn": dict(use_tis=True, tis_mode="clip", tis_level="sequence", tis_upper_bound=3.0,
                           tis_veto_threshold=1e-3, tis_batch_normalize=True),
    "a2_geo_mask_drop": dict(use_tis=True, get_mismatch_metrics=True, tis_mode="mask", tis_level="geometric",
                             tis_upper_bound=1.15, tis_rejected_denominator="drop"),
    "a1_tok_mask_drop": dict(use_rollout_logprobs=True, get_mismatch_metrics=True, tis_mode="mask",
                             tis_level="token", tis_upper_bound=1.5, tis_rejected_denominator="drop"),
}


@pytest.mark.parametrize("cp_rank", [0, 1])
@pytest.mark.parametrize("name", list(SLIME))
def test_tis_function_reuses_the_rollout_decision(monkeypatch, name, cp_rank):
    """Context-parallel rank ``cp_rank`` of 2 (zigzag-local log-probs; single-process reductions): the TIS function
    over micro-batches of the rollout, once with the rollout-data hook's decision kept, once without (each
    micro-batch corrects itself), gives the same loss, masks and metrics."""
    ctx = ParallelContext(cp_rank, 2, LocalReducer())
    for mod in ("tis_hook", "postprocess"):
        monkeypatch.setattr(f"slime_tis.slime.{mod}.parallel_context", lambda: ctx)
    b = make_batch(9)
    b.rollout_ids = [0, 1, 1, 2, 2, 3]
    args = args_ns(**SLIME[name])
    train = b.local("train", cp_rank, 2)
    rollout = b.local("rollout", cp_rank, 2)
    pg = b.local("pg_loss", cp_rank, 2)

    def run() -> list:
        out = []
        for idx in ([4, 0, 3], [2, 5, 1]):
            mb = b.subset(idx)
            new, masks, metrics = compute_tis_for_slime(
                args, pg_loss=torch.cat([pg[i] for i in idx]), train_log_probs=[train[i] for i in idx],
                rollout_log_probs=[rollout[i] for i in idx], loss_masks=mb.masks, total_lengths=mb.total_lengths,
                response_lengths=mb.response_lengths)
            out.append((new, masks, metrics))
        return out + [COLLECTOR.flush()]

    refines = []
    real_refine = step_mod.refine
    monkeypatch.setattr(step_mod, "refine", lambda *a, **k: refines.append(1) or real_refine(*a, **k))
    postprocess_rollout_data(args, 0, b.rollout_data() | {"log_probs": train, "rollout_log_probs": rollout})
    assert STATE.decision is not None
    reused = run()
    assert len(refines) == 2  # each micro-batch finished its part of the rollout's decision
    STATE.decision = None  # the same rollout, every micro-batch corrected in its own call
    fresh = run()
    assert len(refines) == 2
    for (new_a, masks_a, met_a), (new_b, masks_b, met_b) in zip(reused[:-1], fresh[:-1]):
        torch.testing.assert_close(new_a, new_b, rtol=0, atol=0, equal_nan=True)
        for ma, mb_ in zip(masks_a, masks_b):
            torch.testing.assert_close(ma, mb_, rtol=0, atol=0)
        assert set(met_a) == set(met_b)
        for k in met_a:
            torch.testing.assert_close(met_a[k], met_b[k], rtol=0, atol=0, equal_nan=True, msg=k)
    assert reused[-1].keys() == fresh[-1].keys() and reused[-1]
    for k, v in fresh[-1].items():
        assert reused[-1][k] == pytest.approx(v, rel=0, abs=0, nan_ok=True), k


def test_other_train_log_probs_than_the_decided_ones_are_corrected_afresh(monkeypatch):
    """A micro-batch whose train log-probs are not the tensors the rollout hook decided from (slime skipped the
    recompute, or another caller) is corrected in its own call, never given the rollout's decision."""
    calls = []
    real = StepEngine.correct

    def spy(self, batch, *a, **k):
        calls.append(self.decisions.get(batch) is not None)
        return real(self, batch, *a, **k)

    monkeypatch.setattr(StepEngine, "correct", spy)
    b = make_batch(4)
    args = args_ns(**SLIME["a2_tok_trunc_bn"])
    postprocess_rollout_data(args, 0, b.rollout_data() | {"log_probs": b.train})
    mb = b.subset([1, 2])
    for train in ([b.train[1], b.train[2]], [b.train[1].clone(), b.train[2]]):
        compute_tis_for_slime(args, pg_loss=mb.packed("pg_loss"), train_log_probs=train,
                              rollout_log_probs=mb.rollout, loss_masks=mb.masks, total_lengths=mb.total_lengths,
                              response_lengths=mb.response_lengths)
    assert calls == [True, False]
    COLLECTOR.flush()
