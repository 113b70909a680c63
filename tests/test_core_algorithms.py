"""The algorithm table (``core.algorithms``) and the one non-finite policy every adapter reads from it.

Hand batch: sequence A = tokens 0..2, B = tokens 3..5, all valid. A NaN is put into one input at token 1
(sequence A); the policy says A is rejected exactly when that input is in the algorithm's ``finite`` row.
"""

from __future__ import annotations

import math

import pytest
import torch

from slime_tis import TISConfig, policy_loss
from slime_tis.core import LocalReducer, MetricStats
from slime_tis.core.algorithms import ALGORITHMS, algorithm_of
from slime_tis.core.step_metrics import reduce_step_metrics
from slime_tis.megatron import TISBatch, step_totals
from slime_tis.slime.metrics import ExactMetricsCollector

CU = torch.tensor([0, 3, 6])
MASK = torch.ones(6, dtype=torch.bool)
LP_ROLLOUT = torch.tensor([-1.0, -1.2, -0.8, -2.0, -1.5, -0.7])
LP_OLD = LP_ROLLOUT + torch.tensor([0.1, -0.2, 0.05, 0.3, -0.1, 0.0])
LP_THETA = LP_OLD + torch.tensor([0.05, 0.1, -0.05, 0.0, 0.2, -0.1])
ADV = torch.tensor([1.0, 1.0, 1.0, -0.5, -0.5, -0.5])

CONFIGS = {
    0: TISConfig(),
    1: TISConfig(use_rollout_log_probs=True),
    2: TISConfig(use_tis=True, upper=2.0),
    3: TISConfig(use_rollout_log_probs=True, use_tis=True, upper=2.0),
}


class CountingReducer(LocalReducer):
    """A single-process reducer that counts its collectives."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def sequence_sum(self, x):
        self._count("sequence_sum")
        return x

    def batch_sum(self, x, *, per_sequence=False):
        self._count("batch_sum")
        return x


def _inputs(poison: str | None) -> dict[str, torch.Tensor]:
    inputs = {"lp_theta": LP_THETA.clone(), "lp_old": LP_OLD.clone(), "lp_rollout": LP_ROLLOUT.clone(),
              "advantages": ADV.clone()}
    if poison is not None:
        inputs[poison][1] = math.nan
    return inputs


def test_table_agrees_with_the_config_switches():
    for number, cfg in CONFIGS.items():
        row = algorithm_of(cfg)
        assert row is ALGORITHMS[number] and row.number == number
        assert row.needs_pi_old == cfg.needs_old_log_probs
        assert row.weighted == cfg.applies_weights
        assert algorithm_of(cfg.plan) is row
    assert [r.lp_train for r in ALGORITHMS.values()] == ["lp_old", "lp_theta", "lp_old", "lp_theta"]
    assert [r.anchor for r in ALGORITHMS.values()] == ["lp_old", "lp_rollout", "lp_old", None]
    with pytest.raises(ValueError, match="algorithm = 7"):
        algorithm_of(7)


#: the inputs each algorithm's loss reads, which must be finite for a sequence to count (docs/semantics.md)
FINITE = {0: ("lp_theta", "lp_old", "advantages"), 1: ("lp_theta", "lp_rollout", "advantages"),
          2: ("lp_theta", "lp_old", "lp_rollout", "advantages"), 3: ("lp_theta", "lp_rollout", "advantages")}


@pytest.mark.parametrize("alg", [0, 1, 2, 3])
@pytest.mark.parametrize("poison", ["lp_theta", "lp_old", "lp_rollout", "advantages"])
def test_one_non_finite_policy(alg, poison):
    """Sequence A is rejected iff the poisoned input is one the algorithm's loss reads (algorithm 0's loss does not
    read lp_rollout: a NaN there only leaves A out of its diagnostics); loss and gradient stay finite either way."""
    x = _inputs(poison)
    theta = x["lp_theta"].requires_grad_(True)
    out = policy_loss(CONFIGS[alg], theta, x["lp_old"], x["lp_rollout"], x["advantages"], MASK, CU)
    out.loss.backward()
    rejected = poison in FINITE[alg]
    assert out.keep_mask.tolist() == [not rejected] * 3 + [True] * 3
    assert out.stats.finalize()["policy/nonfinite_seq_fraction"].item() == pytest.approx(0.5 if rejected else 0.0)
    assert torch.isfinite(out.loss) and torch.isfinite(theta.grad).all()
    diagnosed = poison in ("lp_rollout", "lp_old") if alg == 0 else rejected  # algorithm 0: lp_old vs lp_rollout
    assert out.stats.finalize()["tis/nonfinite_seq_fraction"].item() == pytest.approx(0.5 if diagnosed else 0.0)


@pytest.mark.parametrize("with_rollout", [True, False])
def test_algorithm_0_runs_the_correction_once(with_rollout):
    """One correction call: one CP ``sequence_sum`` per micro-batch (it used to run a second one for the mask)."""
    reducer = CountingReducer()
    out = policy_loss(CONFIGS[0], LP_THETA, LP_OLD, LP_ROLLOUT if with_rollout else None, ADV, MASK, CU,
                      reducer=reducer, denominator=6.0)
    assert reducer.calls == {"sequence_sum": 1}
    stats = out.stats.finalize()
    reference = policy_loss(CONFIGS[0], LP_THETA, LP_OLD, LP_ROLLOUT, ADV, MASK, CU).stats.finalize()
    assert stats.keys() == reference.keys()  # the same keys with or without rollout log-probs
    if not with_rollout:  # zero-filled diagnostics
        assert stats["tis/num_tokens"].item() == 0.0 and stats["tis/kl"].item() == 0.0
        assert stats["tis/ratio_max"].item() == 0.0


def _batch(x: dict[str, torch.Tensor]) -> TISBatch:
    return TISBatch(labels=torch.zeros(6, dtype=torch.long), loss_mask=MASK.float(), advantages=x["advantages"],
                    cu_seqlens=CU, rollout_log_probs=x["lp_rollout"], old_log_probs=x["lp_old"])


@pytest.mark.parametrize("alg", [0, 2])
def test_step_totals_keep_what_the_loss_keeps_with_a_nan_only_in_lp_theta(alg):
    """``drop``: the step's denominator counts exactly the loss's kept tokens, also when only lp_theta (known before
    the step from the pass at its parameters) is non-finite. The step plan used to test lp_old twice instead."""
    cfg = CONFIGS[alg].replace(rejected_denominator="drop")
    x = _inputs("lp_theta")
    plan = step_totals(cfg, [_batch(x)], LocalReducer(), pre_log_probs=[x["lp_theta"]])
    out = policy_loss(cfg, x["lp_theta"], x["lp_old"], x["lp_rollout"], x["advantages"], MASK, CU,
                      denominator=plan.denominator)
    assert out.keep_mask.tolist() == [False] * 3 + [True] * 3
    assert plan.denominator.item() == out.keep_mask.sum().item() == 3


def test_step_batch_norm_factor_leaves_out_what_the_loss_rejects():
    """Algorithm 2's once-per-step factor from the step totals equals the loss's own factor on the same batch."""
    cfg = CONFIGS[2].replace(batch_normalize=True)
    x = _inputs("lp_theta")
    plan = step_totals(cfg, [_batch(x)], LocalReducer(), pre_log_probs=[x["lp_theta"]])
    out = policy_loss(cfg, x["lp_theta"], x["lp_old"], x["lp_rollout"], x["advantages"], MASK, CU)
    assert out.tis is not None
    own = out.stats.finalize()["tis/batch_norm_factor"]
    torch.testing.assert_close(plan.batch_norm_factor.double(), own, rtol=1e-6, atol=0.0)  # float32 sums of 3


class _Disagreeing(LocalReducer):
    """Another rank holds other statistic names: its signature differs in the MIN / MAX of the check."""

    def batch_min(self, x):
        low = x.clone()
        low[0] -= 1.0  # the token-sum names' signature; the step number (last entry) agrees
        return low


def test_both_adapters_check_that_the_ranks_hold_the_same_statistics():
    stats = MetricStats(token_sums={"policy.n_tok_valid": torch.tensor(3.0, dtype=torch.float64)})
    with pytest.raises(ValueError, match="differ across"):
        reduce_step_metrics(stats, _Disagreeing())
    collector = ExactMetricsCollector()  # slime's exact metrics: the same check (it had none)
    collector.add(stats, [torch.zeros(1)], _Disagreeing())
    with pytest.raises(ValueError, match="differ across"):
        collector.flush()
