"""The metric schema (``core.metric_schema.METRICS``) is the one declaration of every metric: the statistics, the
per-token values, the finalisation and the reference table come from it; ``policy/kl`` and ``policy/entropy`` (the
loss's reference-KL and entropy terms) are rows of it. The levels and modes are typed objects (``core.levels``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slime_tis import TISConfig, compute_tis, policy_loss
from slime_tis.core.diagnostics import token_metrics
from slime_tis.core.levels import GEOMETRIC, LEVELS, MODES, SEQUENCE, TOKEN
from slime_tis.core.metric_schema import METRIC_TABLE_HEADER, METRICS, REDUCTIONS, metric_table
from slime_tis.core.rules import RULES
from slime_tis.core.terms import kl_estimate


def test_readme_metric_table_is_the_generated_one():
    """docs/reference.md's metric table is ``metric_table()`` (``python scripts/reference_tables.py --write``), so a
    metric's name and formula change in one place."""
    readme = (Path(__file__).resolve().parent.parent / "docs" / "reference.md").read_text()
    table = metric_table()
    start = readme.index(METRIC_TABLE_HEADER)
    assert readme[start:start + len(table)] == table
    assert not readme[start + len(table):].startswith("|"), "docs/reference.md has metric rows the schema lacks"


def test_every_row_is_whole_and_unique():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    assert {rule.metric for rule in RULES} <= set(names)
    for m in METRICS:
        assert m.reduction in REDUCTIONS and m.doc, m.name
        assert (m.denominator is None) == (m.reduction in ("exp", "extreme", "value")), m.name
        assert (m.extra is not None) == (m.reduction in ("std", "ess")), m.name


def _batch(seed: int = 0, n: int = 64):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, 10, 25, 26, 47, n])
    lr = -torch.rand(n, generator=g) * 2
    lt = lr + 0.2 * torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) > 0.1
    return lt, lr, mask, cu, g


def test_finalize_and_token_values_cover_every_row_present():
    """Each statistic a configuration produces is read by a row, and each row whose statistics are present is
    reported: nothing computed and dropped, nothing reported from nothing."""
    lt, lr, mask, cu, _ = _batch()
    cfg = TISConfig(use_tis=True, mode="mask", level="geometric", rs_level="token", veto_threshold=1e-4,
                    batch_normalize=True)
    res = compute_tis(cfg, lt, lr, mask, cu)
    keys = {k for d in (res.stats.token_sums, res.stats.seq_sums, res.stats.mins, res.stats.maxs) for k in d}
    read = {k for m in METRICS for k in (m.numerator, m.denominator, m.extra) if k is not None}
    assert keys <= read
    finals = res.stats.finalize()
    expected = {m.name for m in METRICS if m.numerator in keys and (m.denominator or m.numerator) in keys
                and (m.extra or m.numerator) in keys}
    assert set(finals) == expected
    per_token = token_metrics(cfg.plan, res, torch.tensor(1.0))
    assert {"tis/kl", "tis/ratio", "tis/weight", "tis/batch_norm_factor", "tis/veto_seq_fraction"} <= set(per_token)
    assert all(v.shape == lt.shape for v in per_token.values())


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
def test_policy_kl_and_entropy_are_means_over_kept_tokens(estimator):
    lt, lr, mask, cu, g = _batch(1)
    n = lt.shape[0]
    theta = (lt + 0.05 * torch.randn(n, generator=g)).requires_grad_()
    ref = lt + 0.1 * torch.randn(n, generator=g)
    entropy = torch.rand(n, generator=g)
    adv = torch.randn(n, generator=g)
    cfg = TISConfig(use_tis=True, mode="mask", lower=0.9, upper=1.1, kl_coef=0.1, kl_estimator=estimator,
                    entropy_coef=0.01)
    out = policy_loss(cfg, theta, lt, lr, adv, mask, cu, lp_ref=ref, entropy=entropy)
    m = out.stats.finalize()
    keep = out.keep_mask
    assert 0 < int(keep.sum()) < int(mask.sum())  # some tokens rejected: the mean is over kept ones only
    k = kl_estimate(theta.detach()[keep], ref[keep], estimator).double()
    assert float(m["policy/kl"]) == pytest.approx(float(k.mean()), rel=1e-6, abs=1e-9)  # float32 terms
    assert float(m["policy/entropy"]) == pytest.approx(float(entropy[keep].double().mean()), rel=1e-6)
    plain = policy_loss(TISConfig(use_tis=True), theta, lt, lr, adv, mask, cu).stats.finalize()
    assert "policy/kl" not in plain and "policy/entropy" not in plain  # keys follow the configuration


def test_levels_and_modes_carry_their_formula_unit_and_bounds():
    assert (TOKEN.per_sequence, SEQUENCE.per_sequence, GEOMETRIC.per_sequence) == (False, True, True)
    assert [m.default_upper(GEOMETRIC) for m in MODES.values()] == [2.0, 2.0, 1.001]
    assert [m.default_upper(SEQUENCE) for m in MODES.values()] == [2.0, 2.0, 2.0]
    for name, level in LEVELS.items():
        cfg = TISConfig(use_tis=True, mode="mask", level=name)
        assert cfg.plan.level is level and cfg.plan.level == name and cfg.upper_bound == level.rejection_upper
    r = torch.tensor([0.25, 1.0, 4.0])
    assert MODES["truncate"].weight(r.clone(), 0.5, 2.0).tolist() == [0.25, 1.0, 2.0]
    assert MODES["clip"].weight(r.clone(), 0.5, 2.0).tolist() == [0.5, 1.0, 2.0]
    assert MODES["mask"].weight(r.clone(), 0.5, 2.0).tolist() == r.tolist()
    lt, lr, mask, cu, _ = _batch(2)
    ratios = compute_tis(TISConfig(use_tis=True), lt, lr, mask, cu).ratios
    assert GEOMETRIC.of(ratios) is ratios.seq_log_ratio_mean and ratios.level_log_ratio("sequence") is \
        ratios.seq_log_ratio_sum and TOKEN.domain(ratios) is ratios.token_ok
