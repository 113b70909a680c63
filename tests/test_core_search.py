"""The global searches of ``core.search``: M2PO's cut against the exact sort, the auto truncation bound against a
brute-force ESS, the monotonicity the bisection relies on, the precision of a fixed number of steps, and the
configuration's refusals.

M2PO's reference is the paper's rule (arXiv 2510.01161) written as an exact sort: keep the longest ascending prefix
of ``q = (log r)^2`` whose mean is ``<= tau``. AReaL implements it as ``_get_m2po_loss_mask`` in
``areal/trainer/ppo/actor.py`` (inclusionAI/AReaL 4aef98d8d818af55b43621aaadba047ae10f4e77, added in #480 =
c431dd6c4); AReaL has no test of it at that commit (``git grep -i m2po`` finds none under tests/), so its cases here
are the behaviours of that function, re-expressed: the exact cut, its strict ``<`` (ours ``<=``, the paper's "at most
tau"), ties at the cut (AReaL's sort splits them, ours keeps or rejects them together), and the all-above case
(AReaL keeps one token, ours none). docs/semantics.md, "Global searches", records these as decisions.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from slime_tis import TISConfig, compute_tis
from slime_tis.arguments import add_tis_arguments
from slime_tis.core import LocalReducer
from slime_tis.core.search import SEARCH_STEPS

F64 = torch.float64


def _one_seq(l: torch.Tensor):  # noqa: E741
    """lp_train, lp_rollout, mask, cu of one sequence whose log-ratios are ``l`` (exactly: lp_rollout = 0)."""
    rollout = torch.zeros_like(l)
    return rollout + l, rollout, torch.ones_like(l, dtype=torch.bool), torch.tensor([0, l.numel()])


def _kept(cfg: TISConfig, l: torch.Tensor) -> torch.Tensor:  # noqa: E741
    return compute_tis(cfg, *_one_seq(l)).keep_mask


def _exact_m2po(q: torch.Tensor, tau: float, strict: bool = False) -> torch.Tensor:
    """Keep mask of the exact rule: the longest ascending prefix of ``q`` with mean ``<= tau`` (``< tau``: strict),
    ties split by sort order (AReaL's behaviour; its all-above fallback is not modelled here)."""
    order = torch.argsort(q, stable=True)
    means = q[order].cumsum(0) / torch.arange(1, q.numel() + 1, dtype=q.dtype)
    ok = means < tau if strict else means <= tau
    n = int(ok.to(torch.int64).cumprod(0).sum())
    keep = torch.zeros_like(q, dtype=torch.bool)
    keep[order[:n]] = True
    return keep


M2PO = TISConfig(use_tis=True, m2po_threshold=0.04)


@pytest.mark.parametrize("seed", range(5))
def test_m2po_equals_the_exact_sort_on_distinct_values(seed):
    g = torch.Generator().manual_seed(seed)
    l = (0.3 * torch.randn(400, generator=g, dtype=F64)).float()  # noqa: E741
    q = l.double().square()
    keep = _kept(M2PO, l)
    assert torch.equal(keep, _exact_m2po(q, 0.04))
    assert q[keep].mean() <= 0.04 < q[keep | (q <= q[~keep].min())].mean()  # the next token would break it


def test_m2po_areal_cases_ties_strictness_and_all_above():
    # ties at the cut: AReaL's sort keeps one of the two 0.1 tokens (mean of [0, 0, 0.1] < 0.04); ours neither
    l = torch.tensor([0.0, 0.0, 0.1 ** 0.5, 0.1 ** 0.5], dtype=F64).float()  # noqa: E741
    q = l.double().square()
    assert int(_exact_m2po(q, 0.04, strict=True).sum()) == 3
    assert _kept(M2PO, l).tolist() == [True, True, False, False]
    # the mean lands exactly on tau (0 and 0.08, in float64): AReaL's strict '<' drops the 0.08 token, '<=' keeps it
    l = torch.tensor([0.0, 0.08 ** 0.5]).float()  # noqa: E741
    q = l.double().square()
    tau = float(q.mean())
    assert _exact_m2po(q, tau, strict=True).tolist() == [True, False]
    assert _kept(TISConfig(use_tis=True, m2po_threshold=tau), l).tolist() == [True, True]
    # every token above tau: AReaL keeps one (its fallback), ours keeps none (every kept mean would exceed tau)
    assert not _kept(M2PO, torch.full((5,), 1.0)).any()
    # every token below tau: nothing is cut
    assert _kept(M2PO, torch.full((5,), 0.1)).all()


def _ess(w: torch.Tensor) -> float:
    return float(w.sum() ** 2 / (w.numel() * w.square().sum()))


def test_ess_of_truncated_weights_falls_as_the_bound_rises():
    """The property the bisection needs (docs/semantics.md): ``ESS(min(r, c))`` is non-increasing in ``c``."""
    g = torch.Generator().manual_seed(3)
    r = torch.exp(torch.randn(300, generator=g, dtype=F64))
    grid = torch.exp(torch.linspace(-2, 4, 400, dtype=F64))
    ess = torch.tensor([_ess(torch.minimum(r, c)) for c in grid])
    assert (ess[1:] <= ess[:-1] + 1e-12).all()


@pytest.mark.parametrize("f", [0.2, 0.5, 0.8])
def test_auto_bound_is_the_largest_reaching_the_target(f):
    """Targets between the raw ratios' ESS (no truncation) and that of ``min(r, 1)`` (the lowest bound), where the
    bound binds."""
    g = torch.Generator().manual_seed(int(f * 10))
    l = (1.2 * torch.randn(500, generator=g, dtype=F64)).float()  # noqa: E741
    r = l.double().exp()
    target = _ess(r) + f * (_ess(torch.minimum(r, torch.ones(()))) - _ess(r))
    cfg = TISConfig(use_tis=True, upper="auto", target_ess=target)
    res = compute_tis(cfg, *_one_seq(l))
    c = float(res.stats.finalize()["tis/auto_upper_bound"])
    assert _ess(torch.minimum(r, torch.tensor(c, dtype=F64))) >= target - 1e-6
    assert _ess(torch.minimum(r, torch.tensor(c * (1 + 1e-6), dtype=F64))) < target  # the largest, to 1e-6
    assert res.weights.max() == pytest.approx(c, rel=1e-6)
    assert float(res.stats.finalize()["tis/ess"]) >= target - 1e-6


def test_auto_bound_ends_of_its_range():
    # the raw ratios already reach the target: no truncation (the bound sits above every ratio)
    l = torch.tensor([0.0, 0.01, -0.01, 0.02])  # noqa: E741
    res = compute_tis(TISConfig(use_tis=True, upper="auto", target_ess=0.5), *_one_seq(l))
    assert float(res.stats.finalize()["tis/auto_upper_bound"]) > math.exp(20)
    assert torch.allclose(res.weights, l.exp())
    # even c = 1 misses the target (most ratios far below 1): the bound stops at 1, never below
    l = torch.tensor([-8.0, -6.0, -4.0, 0.0, 0.0])  # noqa: E741
    res = compute_tis(TISConfig(use_tis=True, upper="auto", target_ess=0.95), *_one_seq(l))
    assert float(res.stats.finalize()["tis/auto_upper_bound"]) == pytest.approx(1.0, abs=1e-6)


def precision(lo: float, hi: float) -> float:
    """``p``: ``SEARCH_STEPS`` bisection steps on ``[lo, hi]`` answer within ``[x exp(-p), x]`` of the boundary."""
    return (math.log(hi) - math.log(lo)) / 2 ** SEARCH_STEPS


def test_precision_of_the_fixed_steps():
    """``SEARCH_STEPS`` bisection steps: the auto bound's range ``[1, 2 e^20]`` to 2e-8 relative."""
    assert precision(1.0, 2 * math.exp(20)) < 2e-8
    assert precision(0.04, 2 * 20.0 ** 2) < 1e-8
    assert SEARCH_STEPS == 30


def test_auto_bound_per_sequence_units():
    g = torch.Generator().manual_seed(5)
    n_seq, length = 40, 6
    l = (0.3 * torch.randn(n_seq * length, generator=g, dtype=F64)).float()  # noqa: E741
    rollout = torch.full_like(l, -1.0)
    cu = torch.arange(0, n_seq * length + 1, length)
    res = compute_tis(TISConfig(use_tis=True, level="sequence", upper="auto", target_ess=0.7), rollout + l, rollout,
                      torch.ones_like(l, dtype=torch.bool), cu)
    r = l.double().reshape(n_seq, length).sum(1).exp()
    c = float(res.stats.finalize()["tis/auto_upper_bound"])
    assert _ess(torch.minimum(r, torch.tensor(c, dtype=F64))) >= 0.7 - 1e-6
    assert _ess(torch.minimum(r, torch.tensor(c * (1 + 1e-6), dtype=F64))) < 0.7


def test_search_collectives_do_not_depend_on_data():
    """One correction with both searches: ``2 * SEARCH_STEPS`` batch sums, whatever the data (empty mask included)."""
    class Counting(LocalReducer):
        def __init__(self):
            self.calls = []

        def batch_sum(self, x, *, per_sequence=False):
            self.calls.append(("batch_sum", tuple(x.shape), per_sequence))
            return x

        def sequence_sum(self, x):
            self.calls.append(("sequence_sum", x.shape[1]))
            return x

    cfg = TISConfig(use_tis=True, upper="auto", target_ess=0.9, m2po_threshold=0.04)
    logs = []
    for scale, masked in ((0.01, False), (3.0, False), (1.0, True)):
        lt, lr, mask, cu = _one_seq(scale * torch.randn(50))
        reducer = Counting()
        compute_tis(cfg, lt, lr, mask & ~torch.tensor(masked), cu, reducer=reducer)
        logs.append(reducer.calls)
    assert logs[0] == logs[1] == logs[2]
    assert sum(c[0] == "batch_sum" for c in logs[0]) == 2 * SEARCH_STEPS


@pytest.mark.parametrize("fields, words", [
    (dict(use_tis=True, upper="auto"), "needs --tis-target-ess"),
    (dict(use_tis=True, target_ess=0.9), "needs --tis-upper-bound auto"),
    (dict(use_tis=True, upper="auto", target_ess=0.9, mode="clip"), "auto needs --tis-mode truncate"),
    (dict(use_tis=True, upper="auto", target_ess=0.9, mode="mask"), "auto needs --tis-mode truncate"),
    (dict(use_rollout_log_probs=True, upper="auto", target_ess=0.9), "applies no importance weights"),
    (dict(upper="auto", target_ess=0.9), "applies no importance weights"),
    (dict(m2po_threshold=0.04), "algorithm 0"),
    (dict(use_tis=True, m2po_threshold=0.0), "must be > 0"),
    (dict(use_tis=True, upper="auto", target_ess=1.0), "must lie in (0, 1)"),
    (dict(use_tis=True, upper="often"), "must be a finite number or 'auto'"),
    (dict(use_tis=True, upper="auto", target_ess=0.9, staleness_decay=0.5), "use one of the two"),
])
def test_refusals_name_the_flag(fields, words):
    with pytest.raises(ValueError, match="^--") as err:
        TISConfig(**fields)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_flags_reach_the_config():
    parser = add_tis_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--use-tis", "--tis-upper-bound", "auto", "--tis-target-ess", "0.9",
                              "--tis-m2po-threshold", "0.04"])
    cfg = TISConfig.from_args(args)
    assert (cfg.upper, cfg.target_ess, cfg.m2po_threshold) == ("auto", 0.9, 0.04)
    assert cfg.plan.target_ess == 0.9
    assert TISConfig.from_args(parser.parse_args(["--use-tis", "--tis-upper-bound", "3"])).upper == 3.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--tis-upper-bound", "often"])
