"""k3 sequence rejection (``seq_mean_k3`` / ``seq_max_k3``) against verl 0.9.1, its flags, validation,
metrics and preset, and the k3 numerics the slime adapter now takes from the core.

verl computes ``k3_t = exp(lc) - 1 - lc`` in float32 (``lc`` = log-ratio clamped to +-20), the core
``expm1(lc) - lc``: per token they differ by float32 rounding of ``exp`` (<= ~1e-7 relative to r), so a
sequence whose float64 statistic lies within ``MARGIN`` of the threshold could fall on either side;
those rows are left out of the exact comparison (and counted, so the test cannot pass vacuously).
"""

from __future__ import annotations

import argparse

import _verl_light  # noqa: F401  (stubs ray / transformers before verl is imported)
import pytest
import torch
from test_core_verl_oracle import make_batch, run_verl

from slime_tis import TISConfig, add_tis_arguments, compute_tis
from slime_tis.core.diagnostics import token_metrics

MARGIN = 1e-4


def k3_stats64(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 per-row (mean, max) of k3 over valid tokens."""
    lc = (batch.lp_old.double() - batch.lp_rollout.double()).clamp(-20, 20)
    k3 = torch.where(batch.mask != 0, torch.expm1(lc) - lc, 0.0)
    return k3.sum(-1) / batch.mask.double().sum(-1), k3.max(-1).values


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("rule, threshold", [("seq_mean_k3", 0.01), ("seq_mean_k3", 0.05), ("seq_max_k3", 0.5),
                                             ("seq_max_k3", 2.0)])
def test_k3_rejection_matches_verl(seed, rule, threshold):
    batch = make_batch(seed, batch_size=64, max_len=120)
    _, verl_mask, verl_metrics = run_verl(batch, rollout_is=None, rollout_rs=rule, rollout_rs_threshold=threshold)
    cfg = TISConfig(use_rollout_log_probs=True, **{f"{rule}_threshold": threshold})
    res = compute_tis(cfg, batch.p_old, batch.p_rollout, batch.p_mask, batch.cu)

    stat = k3_stats64(batch)[0 if rule == "seq_mean_k3" else 1]
    clear = (stat - threshold).abs() > MARGIN * max(threshold, 1.0)
    seq_id = torch.repeat_interleave(batch.cu.diff().long())
    ours = torch.zeros(len(stat), dtype=torch.bool).index_put_((seq_id,), res.keep_mask, accumulate=True)
    verl_keep_rows = ((verl_mask != 0) | (batch.mask == 0)).all(-1)
    assert clear.sum() >= len(stat) - 2
    assert torch.equal(ours[clear], verl_keep_rows[clear])
    assert 0 < int((~ours).sum()) < len(stat), "the rule should reject some rows and keep others"
    assert torch.equal(ours, stat <= threshold)  # our own definition, in float64, on every row
    m = res.stats.finalize()
    fraction = float(m[f"tis/{rule}_fraction"])
    assert fraction == pytest.approx(float((~ours).double().mean()), abs=1e-12)
    if bool(clear.all()):
        assert fraction == pytest.approx(verl_metrics[f"rollout_rs_{rule}_seq_masked_fraction"], abs=1e-12)
    assert float(m["tis/rejected_seq_fraction"]) == pytest.approx(fraction, abs=1e-12)


def test_both_k3_rules_and_preset():
    batch = make_batch(5, batch_size=64, max_len=120)
    both = compute_tis(TISConfig(use_rollout_log_probs=True, seq_mean_k3_threshold=0.01, seq_max_k3_threshold=0.5),
                       batch.p_old, batch.p_rollout, batch.p_mask, batch.cu)
    mean_only = compute_tis(TISConfig.from_preset("bypass_ppo_clip_k3_rs"),
                            batch.p_old, batch.p_rollout, batch.p_mask, batch.cu)
    max_only = compute_tis(TISConfig(use_rollout_log_probs=True, seq_max_k3_threshold=0.5),
                           batch.p_old, batch.p_rollout, batch.p_mask, batch.cu)
    assert torch.equal(both.keep_mask, mean_only.keep_mask & max_only.keep_mask)
    preset = TISConfig.from_preset("bypass_ppo_clip_k3_rs")
    assert preset.algorithm == 1 and preset.seq_mean_k3_threshold == 0.01 and preset.rejects
    assert "k3" in preset.describe()


@pytest.mark.parametrize("field, flag", [("seq_mean_k3_threshold", "--tis-seq-mean-k3-threshold"),
                                         ("seq_max_k3_threshold", "--tis-seq-max-k3-threshold")])
def test_k3_flags_and_validation(field, flag):
    args = add_tis_arguments(argparse.ArgumentParser()).parse_args(["--use-tis", flag, "0.02"])
    assert getattr(TISConfig.from_args(args), field) == 0.02
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=flag):
            TISConfig(use_tis=True, **{field: bad})
    with pytest.raises(ValueError, match=f"{flag}.*algorithm 0"):
        TISConfig(**{field: 0.02})


def test_k3_numerics_near_on_policy():
    """k3 of |l| ~ 1e-4 is ~l^2/2 = 5e-9: the expm1 form is exact to float32 rounding and never negative;
    r - 1 - log r in float32 cancels to 0 or goes negative."""
    l = torch.tensor([1e-4, -1e-4, 3e-4, -2e-4, 0.0])  # noqa: E741
    lp_rollout = torch.full_like(l, -1.0)
    cfg = TISConfig(use_tis=True)
    res = compute_tis(cfg, lp_rollout + l, lp_rollout, torch.ones_like(l, dtype=torch.bool),
                      torch.tensor([0, 5]))
    k3 = token_metrics(cfg.plan, res)["tis/k3_kl"]
    l_used = (lp_rollout + l) - lp_rollout  # the float32 log-ratio the core sees
    expect = torch.expm1(l_used.double()) - l_used.double()
    assert bool((k3 >= 0).all())
    torch.testing.assert_close(k3.double(), expect, rtol=1e-3, atol=1e-12)
    naive = torch.exp(l_used) - 1.0 - l_used
    assert not torch.allclose(naive.double(), expect, rtol=1e-3, atol=1e-12)  # why the adapter must not redo it
    assert float(res.stats.finalize()["tis/k3_kl"]) == pytest.approx(float(expect.mean()), rel=1e-3)
