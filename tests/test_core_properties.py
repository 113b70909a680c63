"""Property tests of the correction core (hypothesis).

Random packed batches (variable and zero sequence lengths, random loss masks, log-ratios from
~0 to far beyond the safety bound, optional NaN/inf injected at valid and masked positions) and
random valid configurations (every algorithm, mode, level, bounds, rejection sampling, veto,
batch-norm, denominator policy, loss aggregation, surrogate, dual clip). Properties:

* weights are detached (no ``grad_fn``, ``requires_grad`` False) even when inputs require grad;
* truncate never exceeds ``upper``; clip stays in ``[lower, upper]``; weights are 0 outside the
  valid finite tokens and never NaN;
* sequence / geometric weights are constant within a sequence;
* the keep mask is a subset of the loss mask;
* rejection (mask mode, rejection sampling, veto) never changes a weight, only the keep mask;
* splitting a batch at a sequence boundary into two micro-batches and combining with the global
  normaliser (``loss_denominator`` summed over both halves; for batch-norm the global factor from
  ``norm_count / norm_sum`` summed over the halves) gives the whole-batch loss and gradient, and
  the merged ``MetricStats`` finalize to the whole-batch metrics; the loss and gradient are finite.

The run is reproducible: ``derandomize=True`` (examples are a function of the test only) and no
example database; ``max_examples`` is kept small enough for the CI budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slime_tis import MetricStats, TISConfig, compute_tis, loss_denominator, normalisation_factor, policy_loss

PROPERTY_SETTINGS = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SPLIT_SETTINGS = settings(PROPERTY_SETTINGS, max_examples=200)

FLOAT_TOL = dict(rtol=2e-5, atol=1e-6)


# ------------------------------------------------------------------------------------ strategies
@dataclass
class Packed:
    """A packed batch: per-token ``[T]`` tensors, ``cu`` ``[n_seq + 1]`` int32."""

    lp_rollout: torch.Tensor
    lp_old: torch.Tensor
    lp_theta: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor  # bool
    cu: torch.Tensor

    @property
    def n_seq(self) -> int:
        return self.cu.numel() - 1

    def seq_id(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(self.n_seq), (self.cu[1:] - self.cu[:-1]).long())

    def split(self, k: int) -> tuple[Packed, Packed]:
        """Micro-batches of sequences ``[0, k)`` and ``[k, n_seq)``."""
        cut = int(self.cu[k])
        names = ("lp_rollout", "lp_old", "lp_theta", "advantages", "mask")
        first = Packed(*(getattr(self, n)[:cut] for n in names), self.cu[: k + 1].clone())
        second = Packed(*(getattr(self, n)[cut:] for n in names), self.cu[k:] - self.cu[k])
        return first, second


@st.composite
def packed_batches(draw: st.DrawFn, *, nonfinite: bool = True) -> Packed:
    """Random packed batch; the bulk values come from a torch generator seeded by hypothesis."""
    lengths = draw(st.lists(st.integers(0, 12), min_size=1, max_size=8))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-4, 0.01, 0.1, 1.0, 8.0]))  # log-ratio scale (8 -> sums beyond B=20)
    density = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    lp_rollout = -8.0 * torch.rand(n, generator=g) - 1e-3
    log_ratio = scale * torch.randn(n, generator=g)
    if draw(st.booleans()):  # a few outliers
        outlier = torch.rand(n, generator=g) < 0.1
        log_ratio = torch.where(outlier, 30.0 * torch.randn(n, generator=g), log_ratio)
    lp_old = lp_rollout + log_ratio
    lp_theta = lp_old + 0.4 * torch.randn(n, generator=g)
    advantages = torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) < density
    if nonfinite and n and draw(st.booleans()):
        # NaN / +-inf in any input, at valid and at masked positions
        for t in (lp_rollout, lp_old, lp_theta, advantages):
            hit = torch.rand(n, generator=g) < 0.08
            bad = torch.tensor([math.nan, math.inf, -math.inf])[torch.randint(0, 3, (n,), generator=g)]
            t.copy_(torch.where(hit, bad, t))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return Packed(lp_rollout, lp_old, lp_theta, advantages, mask, cu)


_BOUND_PAIRS = [(None, None), (None, 1.2), (None, 5.0), (0.5, 2.0), (0.9, 1.5), (0.999, 1.001), (0.2, 1.0)]


@st.composite
def configs(draw: st.DrawFn, *, algorithms=(0, 1, 2, 3), modes=("truncate", "clip", "mask"), rs=True,
            veto=True, batch_normalize=None) -> TISConfig:
    """A valid ``TISConfig`` (combinations the constructor rejects are never drawn)."""
    alg = draw(st.sampled_from(algorithms))
    has_rollout_rules = alg != 0
    mode = draw(st.sampled_from([m for m in modes if has_rollout_rules or m != "mask"]))
    lower, upper = draw(st.sampled_from(_BOUND_PAIRS))
    rs_levels = [None, "token", "sequence", "geometric"] if rs and has_rollout_rules else [None]
    rs_level = draw(st.sampled_from(rs_levels))
    rs_lower, rs_upper = draw(st.sampled_from(_BOUND_PAIRS)) if rs_level else (None, None)
    bn = draw(st.booleans()) if batch_normalize is None else batch_normalize
    surrogates = ["reinforce", "on_policy"] + (["ppo_clip", "gspo", "cispo"] if alg != 3 else [])
    return TISConfig(
        use_rollout_log_probs=alg in (1, 3),
        use_tis=alg in (2, 3),
        mode=mode,
        level=draw(st.sampled_from(["token", "sequence", "geometric"])),
        lower=lower,
        upper=upper,
        rs_level=rs_level,
        rs_lower=rs_lower,
        rs_upper=rs_upper,
        veto_threshold=draw(st.sampled_from([None, 1e-3, 0.3])) if veto and has_rollout_rules else None,
        batch_normalize=bn and alg in (2, 3),
        rejected_denominator=draw(st.sampled_from(["keep", "drop"])),
        loss_agg=draw(st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"])),
        loss_mode=draw(st.sampled_from([None, *surrogates])),
        eps_clip_high=draw(st.sampled_from([None, 0.28])),
        dual_clip_c=draw(st.sampled_from([None, 3.0])),
    )


def lp_train_of(config: TISConfig, batch: Packed) -> torch.Tensor:
    """The training-side log-probs of the algorithm: pi_old (0, 2) or pi_theta (1, 3)."""
    return batch.lp_old if config.algorithm in (0, 2) else batch.lp_theta


def tis_of(config: TISConfig, batch: Packed, **kwargs):
    return compute_tis(config, lp_train_of(config, batch), batch.lp_rollout, batch.mask, batch.cu, **kwargs)


# ------------------------------------------------------------------------------ weight properties
@PROPERTY_SETTINGS
@given(batch=packed_batches(), config=configs(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_weights_are_detached_finite_and_zero_outside_valid_tokens(
    batch: Packed, config: TISConfig, dtype: torch.dtype
) -> None:
    lp_train = lp_train_of(config, batch).to(dtype).requires_grad_(True)
    lp_rollout = batch.lp_rollout.to(dtype).requires_grad_(True)
    res = compute_tis(config, lp_train, lp_rollout, batch.mask, batch.cu)
    assert res.weights.grad_fn is None and not res.weights.requires_grad
    assert res.weights.dtype == torch.float32 and res.weights.shape == batch.mask.shape
    assert bool(torch.isfinite(res.weights).all())
    assert bool((res.weights >= 0).all())
    assert bool((res.weights[~res.ratios.token_ok] == 0).all())
    # the keep mask is a subset of the loss mask (and of the finite-sequence tokens)
    assert not bool((res.keep_mask & ~batch.mask).any())
    assert not bool((res.keep_mask & ~res.ratios.token_ok).any())
    for value in res.stats.finalize().values():
        assert bool(torch.isfinite(value)), res.stats.finalize()

    out = policy_loss(config, lp_train_of(config, batch).requires_grad_(True), batch.lp_old, batch.lp_rollout,
                      batch.advantages, batch.mask, batch.cu)
    assert out.weights.grad_fn is None and not out.weights.requires_grad
    assert not bool((out.keep_mask & ~batch.mask).any())


@PROPERTY_SETTINGS
@given(
    batch=packed_batches(),
    config=configs(algorithms=(2, 3), modes=("truncate", "clip"), batch_normalize=False),
)
def test_truncate_and_clip_bounds(batch: Packed, config: TISConfig) -> None:
    res = tis_of(config, batch)
    w = res.weights[res.ratios.token_ok]
    assert bool((w <= config.upper_bound).all())
    if config.mode == "clip":
        assert bool((w >= config.lower_bound).all())
    else:
        assert bool((w > 0).all())  # truncate has no lower bound: exp(-B) > 0


@PROPERTY_SETTINGS
@given(batch=packed_batches(), config=configs(algorithms=(2, 3)))
def test_sequence_and_geometric_weights_are_constant_within_a_sequence(
    batch: Packed, config: TISConfig
) -> None:
    config = config.replace(level="sequence") if config.level == "token" else config
    res = tis_of(config, batch)
    ok = res.ratios.token_ok
    seq = batch.seq_id()
    w = res.weights.double()
    hi = torch.full((batch.n_seq,), -math.inf, dtype=torch.float64).scatter_reduce(0, seq[ok], w[ok], "amax")
    lo = torch.full((batch.n_seq,), math.inf, dtype=torch.float64).scatter_reduce(0, seq[ok], w[ok], "amin")
    has = torch.zeros(batch.n_seq, dtype=torch.bool).index_fill(0, seq[ok], True)
    assert torch.equal(hi[has], lo[has])


@PROPERTY_SETTINGS
@given(batch=packed_batches(), config=configs(algorithms=(1, 2, 3), batch_normalize=False))
def test_rejection_never_changes_weights(batch: Packed, config: TISConfig) -> None:
    """Turning rejection sampling, veto and mask mode off leaves every weight unchanged."""
    res = tis_of(config, batch)
    free = config.replace(rs_level=None, rs_lower=None, rs_upper=None, veto_threshold=None)
    res_free = tis_of(free, batch)
    assert torch.equal(res.weights, res_free.weights)
    assert not bool((res.keep_mask & ~res_free.keep_mask).any())  # rules only ever remove tokens
    if config.use_tis and config.mode == "mask":
        # mask mode's weight is the raw (safety-clamped) ratio, also on rejected units
        level_log = res.ratios.level_log_ratio(config.level)
        r = torch.exp(level_log.clamp(-config.safety_bound, config.safety_bound))
        r_tok = r if config.level == "token" else r[res.ratios.seq_id]
        ok = res.ratios.token_ok
        assert torch.equal(res.weights[ok], r_tok[ok])


# ----------------------------------------------------------------------- micro-batch invariance
def _loss_extra_finite(config: TISConfig, batch: Packed) -> tuple[torch.Tensor, ...]:
    """Tensors whose non-finite valid entries ``policy_loss`` also rejects (advantages; alg 2: pi_theta)."""
    if config.algorithm == 0:
        return ()
    return (batch.advantages,) + ((batch.lp_theta,) if config.algorithm == 2 else ())


def _global_batch_norm_factor(config: TISConfig, halves: tuple[Packed, Packed]) -> torch.Tensor | None:
    """``sum(norm_count) / sum(norm_sum)`` over the micro-batches, with the loss's own rejections."""
    if not config.batch_normalize:
        return None
    parts = [tis_of(config, h, extra_finite=_loss_extra_finite(config, h)) for h in halves]
    return normalisation_factor(sum(p.norm_sum for p in parts), sum(p.norm_count for p in parts))


def _keep_masks(config: TISConfig, halves: tuple[Packed, Packed], factor) -> list[torch.Tensor]:
    """First pass: each micro-batch's keep mask (what a trainer knows after the forward pass)."""
    return [
        policy_loss(config, h.lp_theta, h.lp_old, h.lp_rollout, h.advantages, h.mask, h.cu,
                    batch_norm_factor=factor).keep_mask
        for h in halves
    ]


def _assert_metrics_close(merged: dict[str, torch.Tensor], whole: dict[str, torch.Tensor]) -> None:
    """Every metric to 1e-5 relative / 1e-6 absolute (second moments such as ratio_std included: the core
    accumulates its statistic sums in float64, so the summation order does not matter)."""
    assert merged.keys() == whole.keys()
    for key in whole:
        torch.testing.assert_close(merged[key], whole[key], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=key: f"{k}: {m}")


@SPLIT_SETTINGS
@given(batch=packed_batches(), config=configs(), data=st.data())
def test_split_into_micro_batches_with_global_normaliser_equals_whole_batch(
    batch: Packed, config: TISConfig, data: st.DataObject
) -> None:
    """Whole batch == sum over two micro-batches, for every algorithm / loss_agg / denominator.

    The global denominator is ``loss_denominator`` summed over the halves, computed from their keep
    masks (needed for ``drop`` in algorithms 1 and 3, where the kept count depends on theta); with
    batch-norm, the global factor ``sum(norm_count) / sum(norm_sum)`` is passed to both halves
    (algorithm 2's once-per-step normalisation; for algorithm 3, whose default is per micro-batch
    over DP x CP, passing the global factor gives the whole-batch result too).
    """
    k = data.draw(st.integers(0, batch.n_seq), label="split after sequence")
    halves = batch.split(k)

    theta = batch.lp_theta.clone().requires_grad_(True)
    whole = policy_loss(config, theta, batch.lp_old, batch.lp_rollout, batch.advantages, batch.mask, batch.cu)
    whole.loss.backward()
    assert bool(torch.isfinite(whole.loss)) and bool(torch.isfinite(theta.grad).all())

    factor = _global_batch_norm_factor(config, halves)
    keeps = _keep_masks(config, halves, factor)
    denominator = sum(
        loss_denominator(config, h.mask, h.cu, keep_mask=keep) for h, keep in zip(halves, keeps, strict=True)
    )
    theta_split = batch.lp_theta.clone().requires_grad_(True)
    cut = int(batch.cu[k])
    outs = [
        policy_loss(config, part, h.lp_old, h.lp_rollout, h.advantages, h.mask, h.cu,
                    denominator=denominator, batch_norm_factor=factor)
        for part, h in zip((theta_split[:cut], theta_split[cut:]), halves, strict=True)
    ]
    total = outs[0].loss + outs[1].loss
    total.backward()

    torch.testing.assert_close(total, whole.loss, **FLOAT_TOL)
    torch.testing.assert_close(theta_split.grad, theta.grad, **FLOAT_TOL)
    assert torch.equal(torch.cat([o.keep_mask for o in outs]), whole.keep_mask)
    merged: MetricStats = outs[0].stats.merge(outs[1].stats)
    _assert_metrics_close(merged.finalize(), whole.stats.finalize())


@PROPERTY_SETTINGS
@given(
    batch=packed_batches(nonfinite=False),
    config=configs(algorithms=(2,), batch_normalize=True),
    data=st.data(),
)
def test_batch_norm_global_factor_gives_mean_one_over_kept_units(
    batch: Packed, config: TISConfig, data: st.DataObject
) -> None:
    """Algorithm 2: the factor from the summed halves makes the kept units' mean weight exactly 1."""
    halves = batch.split(data.draw(st.integers(0, batch.n_seq), label="split after sequence"))
    factor = _global_batch_norm_factor(config, halves)
    parts = [tis_of(config, h, batch_norm_factor=factor) for h in halves]
    merged = parts[0].stats.merge(parts[1].stats).finalize()
    whole = tis_of(config, batch).stats.finalize()
    torch.testing.assert_close(merged["tis/weight_mean"], whole["tis/weight_mean"], rtol=1e-5, atol=1e-6)
    weight_sum = float(sum(p.norm_sum for p in parts))
    if weight_sum > 0:  # else nothing is kept (or every weight underflowed) and the factor is 1
        assert math.isclose(float(merged["tis/weight_mean"]), 1.0, rel_tol=1e-5)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_split_example_all_features(k: int) -> None:
    """A fixed example of the split property with every feature on, kept out of hypothesis so a
    regression shows a readable failure even if the shrinker would pick a simpler case."""
    g = torch.Generator().manual_seed(11)
    lengths = torch.tensor([5, 0, 7, 3, 9])
    n = int(lengths.sum())
    lp_rollout = -4 * torch.rand(n, generator=g)
    lp_old = lp_rollout + 0.6 * torch.randn(n, generator=g)
    lp_theta = lp_old + 0.5 * torch.randn(n, generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(lengths, 0).int()])
    advantages, mask = torch.randn(n, generator=g), torch.rand(n, generator=g) < 0.8
    batch = Packed(lp_rollout, lp_old, lp_theta, advantages, mask, cu)
    for alg in (2, 3):
        config = TISConfig(use_rollout_log_probs=alg == 3, use_tis=True, mode="clip", level="geometric",
                           lower=0.8, upper=1.2, rs_level="token", rs_lower=0.5, rs_upper=2.0,
                           veto_threshold=0.3,
                           batch_normalize=True, rejected_denominator="drop", loss_agg="seq-mean-token-mean",
                           dual_clip_c=3.0)
        halves = batch.split(k)
        factor = _global_batch_norm_factor(config, halves)
        keeps = _keep_masks(config, halves, factor)
        den = sum(
            loss_denominator(config, h.mask, h.cu, keep_mask=kp) for h, kp in zip(halves, keeps, strict=True)
        )
        theta = batch.lp_theta.clone().requires_grad_(True)
        whole = policy_loss(config, theta, lp_old, lp_rollout, batch.advantages, batch.mask, batch.cu)
        split = sum(policy_loss(config, h.lp_theta, h.lp_old, h.lp_rollout, h.advantages, h.mask, h.cu,
                                denominator=den, batch_norm_factor=factor).loss for h in halves)
        torch.testing.assert_close(split, whole.loss, **FLOAT_TOL)
        assert 0 < float(whole.stats.finalize()["tis/rejected_token_fraction"]) < 1
