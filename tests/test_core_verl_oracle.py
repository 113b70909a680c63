"""Differential test of the correction core against verl 0.9.1 (the oracle).

verl's ``verl/trainer/ppo/rollout_corr_helper.py`` works on padded ``[B, L]`` batches; the core on
packed 1-D tensors. Every test builds one random padded batch (variable lengths, interior mask
zeros, garbage values at masked positions), runs verl on it, converts it with
``slime_tis.padded_to_packed`` and runs the core, then compares:

* token / sequence truncated-IS weights (``rollout_is="token"|"sequence"``, threshold 2.0) against
  ``compute_tis`` with ``use_tis=True, mode="truncate"``: to 1e-5;
* sequence / geometric rejection (``seq_sum_k1`` / ``seq_mean_k1``) with reciprocal-symmetric
  bounds against ``rs_level="sequence"|"geometric"``: keep masks exactly;
* the shared off-policy diagnostics of ``compute_offpolicy_metrics`` (and the IS / RS statistics
  that have an exact counterpart): to 1e-4 relative;
* verl's divergence options (``token_k2/k3``, ``seq_sum_k2/k3``, ``seq_mean_k2/k3``, ``seq_max_k2/k3``) against
  the rows of the same names, with thresholds placed between units: keep masks exactly, fractions to 1e-4;
* one asymmetric-bounds case pinning verl's inverted k1 convention (docs/semantics.md, bounds): our
  bounds are on ``r = pi_train / pi_rollout``; verl's ``"lo_hi"`` for ``*_k1`` keeps
  ``1/hi <= r <= 1/lo``;
* algorithm 2's aggregated loss and gradient against verl's vanilla PPO loss with IS weights
  (verl's dual clip is always on with ``clip_ratio_c = 3``, so ours runs with ``dual_clip_c=3``).

Data conventions that make the two sides comparable (each deliberate):

* every row has at least one valid token: verl includes fully-masked rows in its per-sequence
  means (as a 0 term with weight 1), the core excludes sequences with no valid token;
* per-token log-ratios stay inside (-20, 20) and per-sequence mean log-probs inside (-20, 0):
  verl clamps the k1 statistics and exponentiates ``k3`` / perplexities unclamped, the core
  compares unclamped log-ratios and clamps before each ``exp``; inside the safety bound both agree;
* no per-sequence statistic lies within a float32 rounding error of a rejection bound
  (:func:`_push_off_bounds`): the two sides sum in different orders, so a sequence sitting exactly
  on a bound could legitimately fall on either side.
"""

from __future__ import annotations

import math

import _verl_light  # noqa: F401  (must precede the first verl import: stubs ray / transformers)
import pytest
import torch

from slime_tis import TISConfig, compute_tis, padded_to_packed, policy_loss

rc = pytest.importorskip(
    "verl.trainer.ppo.rollout_corr_helper",
    reason="verl 0.9.1 missing: pip install --no-deps verl==0.9.1 tensordict omegaconf codetiming orjson",
)
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
OmegaConf = pytest.importorskip("omegaconf").OmegaConf

SEEDS = (0, 1, 2, 3, 4)
WEIGHT_TOL = dict(rtol=1e-5, atol=1e-6)
METRIC_RTOL = 1e-4
#: absolute tolerances where verl's own float32 value is the less accurate side: verl takes log_ppl_diff as the
#: difference of two float32 per-sequence mean log-probs (magnitude <= 8, each rounded to ~5e-7), which cancels
#: when the difference is small; ours comes from the float64 sum of the log-ratios (see the last test)
METRIC_ATOL = {"tis/log_ppl_diff_max": 2e-6, "tis/log_ppl_diff_min": 2e-6}

# verl metric (after "rollout_corr/") -> core metric, compared to METRIC_RTOL relative
SHARED_DIAGNOSTICS = {
    "kl": "tis/kl",
    "k3_kl": "tis/k3_kl",
    "chi2_token": "tis/chi2_token",
    "chi2_seq": "tis/chi2_seq",
    "training_ppl": "tis/training_ppl",
    "rollout_ppl": "tis/rollout_ppl",
    "training_log_ppl": "tis/training_log_ppl",
    "rollout_log_ppl": "tis/rollout_log_ppl",
    "log_ppl_diff": "tis/log_ppl_diff",
    "log_ppl_abs_diff": "tis/log_ppl_abs_diff",
    "log_ppl_diff_max": "tis/log_ppl_diff_max",
    "log_ppl_diff_min": "tis/log_ppl_diff_min",
    "ppl_ratio": "tis/ppl_ratio",
}


# --------------------------------------------------------------------------------------------- data
class Batch:
    """One random padded batch and its packed form.

    Padded ``[B, L]``: ``lp_old`` (training side), ``lp_rollout``, ``mask`` (float 0/1). Packed
    ``[T]``: ``p_old``, ``p_rollout``, ``p_mask`` (bool) and ``cu`` (``[B + 1]`` int32). ``pack``
    converts any other padded tensor.
    """

    def __init__(self, lp_old: torch.Tensor, lp_rollout: torch.Tensor, mask: torch.Tensor) -> None:
        self.lp_old, self.lp_rollout, self.mask = lp_old, lp_rollout, mask
        self.p_old, self.cu = padded_to_packed(lp_old, mask)
        self.p_rollout, _ = padded_to_packed(lp_rollout, mask)
        self.p_mask = padded_to_packed(mask, mask)[0] != 0

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        return padded_to_packed(padded, self.mask)[0]


def _masked_seq_stats(log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 per-row (sum, mean) of ``log_ratio`` over valid tokens."""
    lr = torch.where(mask != 0, log_ratio.double(), 0.0)
    n = mask.double().sum(-1)
    return lr.sum(-1), lr.sum(-1) / n


def _push_off_bounds(
    lp_old: torch.Tensor, lp_rollout: torch.Tensor, mask: torch.Tensor, first_valid: torch.Tensor,
    sum_bounds: tuple[float, ...], mean_bounds: tuple[float, ...],
) -> None:
    """Move rows whose log-ratio sum (mean) is within a rounding margin of a log bound (in place).

    A float32 sum of a few hundred terms of size <= 1 differs between summation orders by far
    less than the margins (1e-3 on sums, 2e-5 on means); the shift moves the row's first valid
    token's ``lp_old`` so the statistic lands 4 margins further away from the bound.
    """
    sum_margin, mean_margin = 1e-3, 2e-5
    n = mask.double().sum(-1)
    rows = torch.arange(lp_old.shape[0])
    for _ in range(20):
        seq_sum, seq_mean = _masked_seq_stats(lp_old - lp_rollout, mask)
        near_sum = torch.zeros_like(seq_sum, dtype=torch.bool)
        near_mean = torch.zeros_like(near_sum)
        for b in sum_bounds:
            near_sum |= (seq_sum - b).abs() < sum_margin
        for b in mean_bounds:
            near_mean |= (seq_mean - b).abs() < mean_margin
        if not (near_sum | near_mean).any():
            return
        shift = torch.where(near_sum, 4 * sum_margin, 0.0) + torch.where(near_mean, 4 * mean_margin * n, 0.0)
        lp_old[rows, first_valid] -= shift.float()
    raise AssertionError("could not move the batch's statistics away from the rejection bounds")


def make_batch(
    seed: int,
    batch_size: int = 48,
    max_len: int = 160,
    *,
    far_drift: float = 0.05,
    far_fraction: float = 0.5,
    drift_std: float = 0.002,
    noise_std: float = 0.03,
    outlier_rate: float = 0.02,
    sum_bounds: tuple[float, ...] = (),
    mean_bounds: tuple[float, ...] = (),
) -> Batch:
    """A random padded batch (see module docstring for the conventions).

    Row ``b`` has length ``len_b`` uniform in ``[1, max_len]`` with ~15% interior mask zeros (its
    first and last positions are valid, so every row has a valid token); row 0 has length 1.
    ``lp_rollout`` in ``[-8, 0)``; ``lp_old = lp_rollout + l`` with per-token log-ratio
    ``l = d_b + N(0, noise_std)``, where the row drift ``d_b = N(0, drift_std)`` plus ``far_drift``
    on a ``far_fraction`` of the rows (a mix of near-on-policy and off-policy sequences, so the
    rejection rules act on some rows only and the batch-mean diagnostics are not ~0), and an
    ``outlier_rate`` of the tokens replaced by +-U(0.5, 3). Masked positions hold garbage in
    ``[-40, 40]`` on both sides.
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (batch_size,), generator=g)
    lengths[0] = 1
    pos = torch.arange(max_len)
    in_len = pos[None, :] < lengths[:, None]
    interior = (torch.rand(batch_size, max_len, generator=g) < 0.15) & (pos[None, :] > 0)
    interior &= pos[None, :] < (lengths[:, None] - 1)
    mask = (in_len & ~interior).float()

    def uniform() -> torch.Tensor:
        return torch.rand(batch_size, max_len, generator=g)

    lp_rollout = -8.0 * uniform() ** 2 - 1e-3
    far = torch.rand(batch_size, 1, generator=g) < far_fraction
    row_drift = torch.where(far, far_drift, 0.0) + drift_std * torch.randn(batch_size, 1, generator=g)
    log_ratio = row_drift + noise_std * torch.randn(batch_size, max_len, generator=g)
    outlier = uniform() < outlier_rate
    sign = torch.where(uniform() < 0.5, -1.0, 1.0)
    log_ratio = torch.where(outlier, sign * (0.5 + 2.5 * uniform()), log_ratio)
    lp_old = lp_rollout + log_ratio

    lp_old = torch.where(mask != 0, lp_old, 80.0 * uniform() - 40.0)
    lp_rollout = torch.where(mask != 0, lp_rollout, 80.0 * uniform() - 40.0)
    first_valid = torch.zeros(batch_size, dtype=torch.long)
    _push_off_bounds(lp_old, lp_rollout, mask, first_valid, sum_bounds, mean_bounds)
    assert bool((mask.sum(-1) > 0).all())
    return Batch(lp_old, lp_rollout, mask)


# ------------------------------------------------------------------------------------------ helpers
def run_verl(batch: Batch, **kwargs):
    """verl's combined IS + RS + off-policy-metrics call on the padded batch."""
    proto, new_mask, metrics = rc.compute_rollout_correction_and_rejection_mask(
        batch.lp_old, batch.lp_rollout, batch.mask, **kwargs
    )
    weights = proto.batch["rollout_is_weights"] if proto is not None else None
    return weights, new_mask, {k.removeprefix("rollout_corr/"): v for k, v in metrics.items()}


def run_core(batch: Batch, config: TISConfig):
    res = compute_tis(config, batch.p_old, batch.p_rollout, batch.p_mask, batch.cu)
    return res, {k: float(v) for k, v in res.stats.finalize().items()}


def assert_metrics_match(ours: dict[str, float], verl: dict[str, float], pairs: dict[str, str]) -> None:
    bad = []
    for verl_key, our_key in pairs.items():
        a, b = ours[our_key], verl[verl_key]
        if not math.isclose(a, b, rel_tol=METRIC_RTOL, abs_tol=METRIC_ATOL.get(our_key, 1e-12)):
            rel = abs(a - b) / max(abs(b), 1e-30)
            bad.append(f"{our_key}={a!r} vs verl {verl_key}={b!r} (rel {rel:.2e})")
    assert not bad, "metrics differ from verl:\n  " + "\n  ".join(bad)


def _sym(u: float) -> tuple[float, float]:
    """Reciprocal-symmetric bounds ``(1/u, u)``, as verl derives them from a single k1 threshold."""
    return 1.0 / u, u


# ---------------------------------------------------------------------------------- IS weights
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_is_weights_and_metrics_match_verl(seed: int, level: str) -> None:
    batch = make_batch(seed)
    v_weights, v_mask, v_metrics = run_verl(batch, rollout_is=level, rollout_is_threshold=2.0)
    config = TISConfig(use_tis=True, mode="truncate", level=level, upper=2.0)
    res, ours = run_core(batch, config)

    assert torch.equal(v_mask, batch.mask)  # no rejection configured on either side
    assert torch.equal(res.keep_mask, batch.p_mask)
    torch.testing.assert_close(res.weights, batch.pack(v_weights), **WEIGHT_TOL)
    assert res.weights.grad_fn is None and not res.weights.requires_grad
    assert bool((res.weights <= 2.0).all())
    frac = ours["tis/truncate_fraction"]
    assert 0.0 < frac < 1.0, f"test data should truncate some but not all {level} weights, got {frac}"

    pairs = dict(SHARED_DIAGNOSTICS, rollout_is_ratio_fraction_high="tis/truncate_fraction")
    if level == "token":
        # token units: verl's applied-weight statistics are ours exactly
        pairs.update(rollout_is_mean="tis/weight_mean", rollout_is_max="tis/weight_max",
                     rollout_is_min="tis/weight_min", rollout_is_eff_sample_size="tis/ess",
                     rollout_is_std="tis/weight_std")
    else:
        # sequence units: verl reports the unclamped extreme sequence ratios (ours: ratio_min/max);
        # its mean / ESS weight sequences by their token count, ours count each sequence once
        pairs.update(rollout_is_max="tis/ratio_max", rollout_is_min="tis/ratio_min")
    assert_metrics_match(ours, v_metrics, pairs)


# ---------------------------------------------------------------------------------- rejection
# per-row log-ratio spreads that put the near-on-policy rows on both sides of the bounds
_SEQ_DATA = dict(drift_std=0.002, noise_std=0.03, outlier_rate=0.005)
RS_CASES = [
    # (our rs_level, verl option, reciprocal-symmetric upper bound u, make_batch arguments)
    ("sequence", "seq_sum_k1", 2.0, _SEQ_DATA),  # preset decoupled_seq_is_rs: [0.5, 2.0]
    ("sequence", "seq_sum_k1", 1.2, _SEQ_DATA),
    # preset decoupled_geo_rs: [0.999, 1.001]
    ("geometric", "seq_mean_k1", 1.001, dict(drift_std=0.0008, noise_std=0.005, outlier_rate=0.0)),
    ("geometric", "seq_mean_k1", 1.01, dict(drift_std=0.008, noise_std=0.03, outlier_rate=0.0)),
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("rs_level", "option", "u", "data"), RS_CASES)
def test_symmetric_rejection_matches_verl(
    seed: int, rs_level: str, option: str, u: float, data: dict
) -> None:
    lower, upper = _sym(u)
    logs = (math.log(lower), math.log(upper))
    batch = make_batch(seed, **data, sum_bounds=logs if rs_level == "sequence" else (),
                       mean_bounds=logs if rs_level == "geometric" else ())
    v_weights, v_mask, v_metrics = run_verl(
        batch, rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs=option, rollout_rs_threshold=u
    )
    config = TISConfig(use_tis=True, mode="truncate", level="sequence", upper=2.0,
                       rs_level=rs_level, rs_lower=lower, rs_upper=upper)
    res, ours = run_core(batch, config)

    v_keep = batch.pack(v_mask) != 0
    assert torch.equal(res.keep_mask, v_keep)
    rejected = ours["tis/rejected_seq_fraction"]
    assert 0.05 < rejected < 0.95, f"test data should reject some but not all sequences, got {rejected}"
    # rejection never changes a weight: verl's weights are computed on the original mask too
    torch.testing.assert_close(res.weights, batch.pack(v_weights), **WEIGHT_TOL)

    pairs = dict(
        SHARED_DIAGNOSTICS,
        rollout_rs_masked_fraction="tis/rejected_token_fraction",
        rollout_rs_seq_masked_fraction="tis/rejected_seq_fraction",
        # verl's k1 statistic is -log r: its "high" side is our "low" side and vice versa
        **{f"rollout_rs_{option}_fraction_high": "tis/rs_fraction_low",
           f"rollout_rs_{option}_fraction_low": "tis/rs_fraction_high"},
    )
    assert_metrics_match(ours, v_metrics, pairs)
    # sequence-level rejection: the sequences with a rejected token are the rejected sequences
    assert ours["tis/rs_seq_masked_fraction"] == ours["tis/rejected_seq_fraction"]


@pytest.mark.parametrize("seed", SEEDS[:3])
@pytest.mark.parametrize("u", [2.0, 1.05])
def test_token_rejection_is_verl_token_k1(seed: int, u: float) -> None:
    """``rs_level="token"`` with bounds ``[1/u, u]`` is verl's ``token_k1`` (the third k1 option, with
    ``seq_sum_k1`` = sequence and ``seq_mean_k1`` = geometric above): keep masks exactly. Token log-ratios are
    random float32 values, none equal to ``+-log u``."""
    batch = make_batch(seed)
    _, v_mask, v_metrics = run_verl(batch, rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1",
                                    rollout_rs_threshold=u)
    res, ours = run_core(batch, TISConfig(use_tis=True, upper=2.0, rs_level="token", rs_lower=1 / u, rs_upper=u))
    assert torch.equal(res.keep_mask, batch.pack(v_mask) != 0)
    assert 0.0 < ours["tis/rejected_token_fraction"] < 0.95
    assert_metrics_match(ours, v_metrics, {
        "rollout_rs_masked_fraction": "tis/rejected_token_fraction",
        "rollout_rs_seq_masked_fraction": "tis/rs_seq_masked_fraction",
        "rollout_rs_token_k1_fraction_high": "tis/rs_fraction_low",
        "rollout_rs_token_k1_fraction_low": "tis/rs_fraction_high",
    })


@pytest.mark.parametrize(("rs_level", "option"), [("geometric", "seq_mean_k1"), ("sequence", "seq_sum_k1")])
def test_asymmetric_bounds_document_verl_k1_inversion(rs_level: str, option: str) -> None:
    """verl's ``"lo_hi"`` k1 bounds keep ``1/hi <= r <= 1/lo``; ours keep ``lo <= r <= hi``.

    So our ``[lo, hi]`` equals verl's ``"(1/hi)_(1/lo)"`` exactly, and differs from verl's
    ``"lo_hi"`` precisely on the sequences with ``r`` in ``[1/hi, lo)`` (verl keeps, we reject) or
    ``(1/lo, hi]`` (we keep, verl rejects).
    """
    lo, hi = 0.8, 1.5  # on r = pi_train / pi_rollout; deliberately not reciprocal (1/hi = 0.667, 1/lo = 1.25)
    log_bounds = tuple(math.log(x) for x in (lo, hi, 1 / hi, 1 / lo))
    stat = dict(sequence="sum_bounds", geometric="mean_bounds")[rs_level]
    batch = make_batch(7, batch_size=96, far_drift=0.0, drift_std=0.2 if rs_level == "geometric" else 0.004,
                       outlier_rate=0.005, **{stat: log_bounds})
    config = TISConfig(use_tis=True, mode="truncate", level="sequence", upper=2.0,
                       rs_level=rs_level, rs_lower=lo, rs_upper=hi)
    res, ours = run_core(batch, config)

    _, v_same_numbers, _ = run_verl(batch, rollout_is="sequence", rollout_rs=option,
                                    rollout_rs_threshold=f"{lo}_{hi}")
    _, v_inverted, v_metrics = run_verl(batch, rollout_is="sequence", rollout_rs=option,
                                        rollout_rs_threshold=f"{1 / hi!r}_{1 / lo!r}")
    keep_same_numbers = batch.pack(v_same_numbers) != 0
    keep_inverted = batch.pack(v_inverted) != 0

    # our [lo, hi] on r == verl's k1 "1/hi_1/lo"
    assert torch.equal(res.keep_mask, keep_inverted)
    # ... and != verl's "lo_hi" = keep [1/hi, 1/lo]: they disagree exactly on r in [1/hi, lo) or (1/lo, hi]
    seq_sum, seq_mean = _masked_seq_stats(batch.lp_old - batch.lp_rollout, batch.mask)
    r = torch.exp(seq_mean if rs_level == "geometric" else seq_sum)
    disagree_rows = ((r >= 1 / hi) & (r < lo)) | ((r > 1 / lo) & (r <= hi))
    assert int(disagree_rows.sum()) >= 3, "test data must contain sequences in the disputed ranges"
    disagree_tokens = batch.pack(disagree_rows[:, None].expand_as(batch.mask).float()) != 0
    assert torch.equal(res.keep_mask != keep_same_numbers, disagree_tokens & batch.p_mask)
    # ours keeps r in (1/lo, hi] = (1.25, 1.5], which verl's "0.8_1.5" rejects
    high_rows = batch.pack(((r > 1 / lo) & (r <= hi))[:, None].expand_as(batch.mask).float()) != 0
    assert bool(res.keep_mask[high_rows & batch.p_mask].all())
    assert not bool(keep_same_numbers[high_rows & batch.p_mask].any())

    assert_metrics_match(ours, v_metrics, {
        "rollout_rs_masked_fraction": "tis/rejected_token_fraction",
        "rollout_rs_seq_masked_fraction": "tis/rejected_seq_fraction",
        f"rollout_rs_{option}_fraction_high": "tis/rs_fraction_low",
        f"rollout_rs_{option}_fraction_low": "tis/rs_fraction_high",
    })


# ------------------------------------------------------------------------- divergence rejection
def _divergence_rows() -> list:
    """The rows of ``RULES`` that are verl rejection options (threshold field ``<option>_threshold``)."""
    from slime_tis.core.rules import RULES

    return [rule for rule in RULES if rule.threshold is not None
            and rule.threshold.removesuffix("_threshold") in rc.SUPPORTED_ROLLOUT_RS_OPTIONS]


def _unit_statistics(batch: Batch, option: str) -> torch.Tensor:
    """float64 statistic of verl's ``option`` per valid token (token options) or per row, as verl defines it:
    ``k2 = lc^2 / 2``, ``k3 = exp(lc) - 1 - lc`` of ``lc = clamp(lp_old - lp_rollout, -20, 20)``."""
    statistic, k = option.rsplit("_", 1)
    lc = (batch.lp_old - batch.lp_rollout).double().clamp(-20.0, 20.0)
    per_token = 0.5 * lc.square() if k == "k2" else torch.expm1(lc) - lc
    valid = batch.mask != 0
    if statistic == "token":
        return per_token[valid]
    if statistic == "seq_max":
        return torch.where(valid, per_token, -math.inf).max(-1).values
    total = torch.where(valid, per_token, 0.0).sum(-1)
    return total if statistic == "seq_sum" else total / batch.mask.double().sum(-1)


def _threshold_in_a_gap(values: torch.Tensor) -> float:
    """A threshold between two neighbouring unit statistics in the middle of their distribution, at the widest
    such gap: every unit is then at least half that gap away from it, far more than the float32 rounding by which
    the two sides' statistics differ (~1e-6 relative for sums of <= 160 terms), so the masks must agree exactly.
    """
    v = values.sort().values
    lo, hi = int(0.3 * len(v)), int(0.7 * len(v))
    gaps = v[lo + 1:hi + 1] - v[lo:hi]
    i = lo + int(gaps.argmax())
    assert float(gaps.max()) > 1e-3 * float(v[i + 1]), "test data must leave a gap between unit statistics"
    return float((v[i] + v[i + 1]) / 2)


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_catastrophic_token_fraction_is_verl_token_k1_high_side(seed: int) -> None:
    """``tis/catastrophic_token_fraction`` (valid tokens with raw ratio ``r_t < v``, the tokens the veto tests)
    is verl's ``token_k1`` fraction above ``log(1/v)`` of ``-clamp(l, -20, 20)`` (verl 0.9.1 has no veto; for
    ``v > e^-20`` the clamp changes nothing); the veto's keep mask is every sequence without such a token."""
    v = math.exp(-1.5)  # the outliers of make_batch reach l = -3; no token lies at l = -1.5 exactly (random)
    batch = make_batch(seed)
    _, _, v_metrics = run_verl(batch, rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1",
                               rollout_rs_threshold=f"{v!r}_{1 / v!r}")
    res, ours = run_core(batch, TISConfig(use_tis=True, upper=2.0, veto_threshold=v))
    assert 0.0 < ours["tis/catastrophic_token_fraction"] < 0.05
    assert_metrics_match(ours, v_metrics, {"rollout_rs_token_k1_fraction_high": "tis/catastrophic_token_fraction"})
    catastrophic_rows = ((batch.lp_old - batch.lp_rollout < math.log(v)) & (batch.mask != 0)).any(-1)
    expected_keep = batch.pack((~catastrophic_rows)[:, None].expand_as(batch.mask).float()) != 0
    assert torch.equal(res.keep_mask, expected_keep & batch.p_mask)


def test_verl_rejection_family_is_covered() -> None:
    """Every option of verl 0.9.1's ``rollout_rs`` is a row here: the k1 options are ``rs_level`` (token_k1 =
    token, seq_sum_k1 = sequence, seq_mean_k1 = geometric; bounds on r, tested above), every other one is the
    divergence row of its name."""
    k1 = {"token_k1", "seq_sum_k1", "seq_mean_k1"}
    assert k1 <= set(rc.SUPPORTED_ROLLOUT_RS_OPTIONS)
    rows = {rule.threshold.removesuffix("_threshold") for rule in _divergence_rows()}
    assert rows == set(rc.SUPPORTED_ROLLOUT_RS_OPTIONS) - k1


@pytest.mark.parametrize("seed", SEEDS[:3])
@pytest.mark.parametrize("rule", _divergence_rows(), ids=lambda r: r.threshold.removesuffix("_threshold"))
def test_divergence_rejection_matches_verl(seed: int, rule) -> None:
    """Every divergence row (``token_k2``, ``seq_sum_k3``, ``seq_max_k2``, ...) against verl's option of that name,
    with a threshold between units (:func:`_threshold_in_a_gap`): keep masks exactly, fractions to METRIC_RTOL
    (ratios of exact counts; the rtol only covers verl's float32 means)."""
    option = rule.threshold.removesuffix("_threshold")
    batch = make_batch(seed)
    t = _threshold_in_a_gap(_unit_statistics(batch, option))
    _, v_mask, v_metrics = run_verl(batch, rollout_is="token", rollout_is_threshold=2.0, rollout_rs=option,
                                    rollout_rs_threshold=t)
    res, ours = run_core(batch, TISConfig(use_tis=True, mode="truncate", level="token", upper=2.0,
                                          **{rule.threshold: t}))

    assert torch.equal(res.keep_mask, batch.pack(v_mask) != 0)
    rejected = ours["tis/rejected_token_fraction"]
    assert 0.05 < rejected < 0.95, f"test data should reject some but not all tokens, got {rejected}"
    assert_metrics_match(ours, v_metrics, {
        f"rollout_rs_{option}_fraction_high": rule.metric,
        "rollout_rs_masked_fraction": "tis/rejected_token_fraction",
        "rollout_rs_seq_masked_fraction": "tis/rs_seq_masked_fraction",
    })
    if rule.level(TISConfig(use_tis=True, **{rule.threshold: t}).plan) == "token":  # some sequences partly kept
        assert ours["tis/rs_seq_masked_fraction"] > ours["tis/rejected_seq_fraction"]


# ------------------------------------------------------------------------- algorithm 2 loss
VERL_PPO = dict(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0)


@pytest.mark.parametrize("seed", SEEDS[:3])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize(
    ("level", "rs"), [("token", None), ("sequence", None), ("sequence", ("geometric", 1.01))]
)
def test_decoupled_ppo_loss_and_grad_match_verl(seed: int, loss_agg: str, level: str, rs) -> None:
    """Algorithm 2 == verl decoupled mode: vanilla PPO (dual clip c=3) times verl's IS weights.

    verl's decoupled RS overwrites ``response_mask`` before the loss, so rejected tokens leave the
    denominator: that is our ``rejected_denominator="drop"``.
    """
    mean_bounds = tuple(math.log(x) for x in _sym(rs[1])) if rs else ()
    batch = make_batch(seed, drift_std=0.008, outlier_rate=0.0 if rs else 0.02, mean_bounds=mean_bounds)
    g = torch.Generator().manual_seed(100 + seed)
    # pi_theta moves away from pi_old (sd 0.6 in log space) so both PPO clips and the dual clip (r > 3) act
    lp_theta = batch.lp_old + 0.6 * torch.randn(batch.mask.shape, generator=g)
    advantages = torch.randn(batch.mask.shape, generator=g)

    rs_kwargs = dict(rollout_rs="seq_mean_k1", rollout_rs_threshold=rs[1]) if rs else {}
    v_weights, v_mask, _ = run_verl(batch, rollout_is=level, rollout_is_threshold=2.0, **rs_kwargs)
    theta_v = lp_theta.clone().requires_grad_(True)
    cfg_v = OmegaConf.create(dict(VERL_PPO, global_batch_info={}, policy_loss={}))
    v_loss, v_pg = core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=batch.lp_old, log_prob=theta_v, advantages=advantages, response_mask=v_mask,
        loss_agg_mode=loss_agg, config=cfg_v, rollout_is_weights=v_weights,
    )
    v_loss.backward()

    config = TISConfig(use_tis=True, mode="truncate", level=level, upper=2.0, eps_clip=0.2, dual_clip_c=3.0,
                       loss_agg=loss_agg, rejected_denominator="drop",
                       **(dict(rs_level=rs[0], rs_lower=_sym(rs[1])[0], rs_upper=rs[1]) if rs else {}))
    theta = batch.pack(lp_theta).requires_grad_(True)
    out = policy_loss(config, theta, batch.p_old, batch.p_rollout, batch.pack(advantages), batch.p_mask,
                      batch.cu)
    out.loss.backward()

    torch.testing.assert_close(out.loss, v_loss.float(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(theta.grad, batch.pack(theta_v.grad), rtol=1e-5, atol=1e-8)
    stats = {k: float(v) for k, v in out.stats.finalize().items()}
    assert 0 < stats["policy/clipfrac"] < 1 and 0 < stats["policy/dual_clipfrac"] < 1
    assert_metrics_match(stats, {k: float(v) for k, v in v_pg.items()}, {
        "actor/pg_clipfrac": "policy/clipfrac",
        "actor/pg_clipfrac_lower": "policy/dual_clipfrac",
        "actor/ppo_kl": "policy/ppo_kl",
    })


# ------------------------------------------------------------------------- precision (core bug)
def test_log_ppl_diff_is_accurate_for_long_sequences_with_small_mismatch() -> None:
    """``log_ppl_diff`` must not lose the mismatch to float32 cancellation.

    Realistic bf16-vs-fp32 mismatch: 2048-token sequences, ``lp ~ U(-10, 0)``, ``l ~ 1e-3``. The
    metric is ``mean_i (mean_t lp_rollout - mean_t lp_train)``; computing it as the difference
    of two per-sequence mean log-probs (magnitude ~5, each a float32 sum of ~1e4) cancels almost
    every significant digit (relative error ~3e-3 here before the fix; verl's own float32 value is off by
    ~2e-4). The core now takes it from the per-sequence log-ratio sum, to ~1e-6:
    ``mean_t lp_rollout - mean_t lp_train = -seq_log_ratio_sum / n``.
    """
    g = torch.Generator().manual_seed(0)
    lp_rollout = -10.0 * torch.rand(8, 2048, generator=g)
    lp_old = lp_rollout + 1e-3 + 1e-3 * torch.randn(8, 2048, generator=g)
    mask = torch.ones(8, 2048)
    batch = Batch(lp_old, lp_rollout, mask)
    _, ours = run_core(batch, TISConfig(use_tis=True))

    per_seq = (lp_rollout.double() - lp_old.double()).mean(-1)  # float64 truth of the per-sequence diff
    truth = {"tis/log_ppl_diff": per_seq.mean(), "tis/log_ppl_abs_diff": per_seq.abs().mean(),
             "tis/ppl_ratio": per_seq.exp().mean()}
    for key, value in truth.items():
        assert math.isclose(ours[key], float(value), rel_tol=1e-4), f"{key}: {ours[key]!r} vs {value!r}"
