"""Numbers at scale: token counts beyond float32's 2^24 and squared ratios beyond float32's range.

A float32 count stops at 2^24 = 16,777,216 (``2^24 + 1`` rounds to ``2^24``), so a kept-token count in float32 makes
``tis/rejected_token_fraction`` of a batch with nothing rejected nonzero. At ``--tis-safety-bound 60`` a ratio
reaches ``e^60 = 1.1e26`` and its square ``1.3e52``, beyond float32's 3.4e38. Counts are integers (or float64)
and squares float64 in every statistic.
"""

from __future__ import annotations

import math

import torch

from slime_tis import TISConfig, compute_tis
from slime_tis.core.diagnostics import token_metrics

BIG = 2**24 + 1  # the smallest token count a float32 count gets wrong


def test_token_counts_are_exact_beyond_two_to_the_24():
    # one sequence of BIG valid tokens, nothing rejected: inputs are stride-0 views (no memory of their own)
    zero = torch.zeros(1).expand(BIG)
    valid = torch.ones(1, dtype=torch.bool).expand(BIG)
    res = compute_tis(TISConfig(use_tis=True), zero, zero, valid, torch.tensor([0, BIG]))
    m = res.stats.finalize()
    assert m["tis/num_tokens"].item() == BIG
    assert res.stats.token_sums["tis.n_kept_units"].item() == BIG
    assert m["tis/rejected_token_fraction"].item() == 0.0
    assert m["tis/weight_mean"].item() == 1.0


def _extreme(bound: float, level: str = "token"):
    """Two sequences; one token at log-ratio 50 (ratio e^50 = 5.2e21, square 2.7e43), the others at 0."""
    l = torch.tensor([50.0, 0.0, 0.0, 0.0])  # noqa: E741
    lr = torch.full((4,), -1.0)
    cfg = TISConfig(use_tis=True, level=level, safety_bound=bound)
    return cfg, compute_tis(cfg, lr + l, lr, torch.ones(4, dtype=torch.bool), torch.tensor([0, 2, 4]))


def test_squared_ratios_stay_finite_at_the_largest_safety_bound():
    cfg, res = _extreme(60.0)
    m = {k: v.item() for k, v in res.stats.finalize().items()}
    r = math.exp(50.0)
    # chi2_token = mean r^2 - 1 over the 4 tokens; ratio_std = population std of (e^50, 1, 1, 1)
    assert math.isclose(m["tis/chi2_token"], (r * r + 3) / 4 - 1, rel_tol=1e-6)
    mean = (r + 3) / 4
    assert math.isclose(m["tis/ratio_std"], math.sqrt((r * r + 3) / 4 - mean * mean), rel_tol=1e-6)
    per_token = token_metrics(cfg.plan, res)["tis/chi2_token"]
    assert torch.isfinite(per_token).all()
    assert math.isclose(per_token[0].item(), r * r - 1, rel_tol=1e-6)


def test_squared_sequence_ratios_stay_finite_at_the_largest_safety_bound():
    _, res = _extreme(60.0, level="sequence")
    m = {k: v.item() for k, v in res.stats.finalize().items()}
    r = math.exp(50.0)  # sequence ratios e^50 and 1
    assert math.isclose(m["tis/ratio_std"], (r - 1) / 2, rel_tol=1e-6)
    assert math.isclose(m["tis/chi2_token"], (r * r + 3) / 4 - 1, rel_tol=1e-6)
