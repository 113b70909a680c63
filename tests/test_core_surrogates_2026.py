"""The 2026 surrogates (DPPO trust-region masks, GMPO, Clip-Cov, KL-Cov), CISPO's anchor and the KL term's gradient:
peers' published cases re-expressed, verl 0.9.1 as an oracle, and the refusals.

Published cases:

* SkyRL ``tests/train/algorithms/test_losses.py`` (NovaSky-AI/SkyRL at a9564572eb8e91076be43c1bd5e4615e3de17265):
  ``test_dppo_policy_loss`` (five cases; their ``reduce_loss`` without a mask is a plain sum: ``token-sum`` here;
  their anchor is the rollout policy when given, else pi_old: algorithms 1 and 0 here),
  ``test_policy_loss_cispo_rollout_anchor`` (``cispo_anchor="rollout"`` is algorithm 1 here, ``"old"`` algorithm 0),
  ``..._requires_rollout_logprobs``, ``..._ratio_min_max_ignore_masked_tokens`` (their ``cispo/ratio_min|max`` are
  the correction's ``tis/ratio_min|max`` in algorithm 1), ``test_clip_cov_policy_loss`` and
  ``test_kl_cov_policy_loss`` (sanity checks: finite, fraction in [0, 1], different from PPO).
* NeMo-RL ``tests/unit/algorithms/test_loss_functions.py`` (NVIDIA-NeMo/RL at
  7ea279abfbeb698b092856d0dab61e7cf39bc909): ``test_clipped_pg_loss_kl_penalty`` and
  ``test_clipped_pg_loss_kl_gradient_includes_sampling_term`` (both
  parametrisations; their on-policy KL approximation weights by ``pi_theta / pi_gen``: algorithm 3's weight with
  ``--tis-kl-importance-weighted`` here).
* verl 0.9.1 (the venv's ``verl.trainer.ppo.core_algos``): ``dppo_tv``, ``dppo_kl``, ``geo_mean``, ``clip_cov``,
  ``kl_cov`` as oracles, loss and gradient, float32 both (1e-5 relative: a different summation order). verl's
  newest commit (verl-project/verl at 1dda039b9c6311889a9c9a26040677e1254814f9) has the same five functions and
  no test of them (``tests/trainer/ppo/test_dynamic_policy_losses_on_cpu.py`` covers DRO only).
"""

from __future__ import annotations

import math

import pytest
import torch

from slime_tis import TISConfig, padded_to_packed, policy_loss
from slime_tis.core.surrogates import first_k, hash_keys

SUM = dict(loss_agg="token-sum")


def _run(cfg, lp, old, rollout, adv, mask=None, cu=None, **kw):
    lp = torch.as_tensor(lp, dtype=torch.float32).reshape(-1)
    mask = torch.ones_like(lp) if mask is None else torch.as_tensor(mask, dtype=torch.float32).reshape(-1)
    cu = torch.tensor([0, lp.numel()], dtype=torch.int32) if cu is None else cu
    t = lambda v: None if v is None else torch.as_tensor(v, dtype=torch.float32).reshape(-1)  # noqa: E731
    theta = lp.clone().requires_grad_(True)
    out = policy_loss(cfg, theta, t(old), t(rollout), t(adv), mask, cu, **kw)
    out.loss.backward()
    return out, theta.grad


def _metrics(out):
    return {k: float(v) for k, v in out.stats.finalize().items()}


# ------------------------------------------------------------------------------------ SkyRL DPPO cases
SKYRL_DPPO = [  # name, divergence, delta_low, delta_high, old, new, adv, rollout, expected mask, masks some
    ("tv_pos_adv_masked", "dppo_tv", 0.2, 0.2, [-1.0, -1.0, -1.0], [-0.3, -2.0, -0.9], [1.0, -1.0, 1.0], None,
     [0.0, 0.0, 1.0], True),
    ("tv_wrong_direction_not_masked", "dppo_tv", 0.2, 0.2, [-1.0, -1.0], [-2.0, -0.3], [1.0, -1.0], None,
     [1.0, 1.0], False),
    ("kl_masked", "dppo_kl", 0.05, 0.05, [-1.0, -1.0], [-0.1, -0.95], [1.0, 1.0], None, None, True),
    ("kl_no_masking_within_delta", "dppo_kl", 0.5, 0.5, [-1.0, -1.0], [-1.01, -0.99], [1.0, -1.0], None,
     [1.0, 1.0], False),
]


@pytest.mark.parametrize("case", SKYRL_DPPO, ids=[c[0] for c in SKYRL_DPPO])
def test_skyrl_dppo_cases(case) -> None:
    """Loss ``-sum(rho A m)`` with their expected mask, and whether any token is masked (their ``clip_ratio``)."""
    _, mode, lo, hi, old, new, adv, _, mask, masks_some = case
    out, grad = _run(TISConfig(loss_mode=mode, eps_clip=lo, eps_clip_high=hi, **SUM), new, old, None, adv)
    rho = torch.exp(torch.tensor(new) - torch.tensor(old))
    if mask is not None:
        expected = -(rho * torch.tensor(adv) * torch.tensor(mask)).sum()
        torch.testing.assert_close(out.loss.detach(), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, -rho * torch.tensor(adv) * torch.tensor(mask), rtol=1e-5, atol=1e-6)
    assert (_metrics(out)["policy/clipfrac"] > 0) == masks_some


def test_skyrl_dppo_uses_the_rollout_anchor() -> None:
    """SkyRL ``tv_uses_rollout_logprobs``: anchored at the rollout policy (algorithm 1) the mask and the loss differ
    from the pi_old anchor (algorithm 0)."""
    new, old, rollout, adv = [-0.3, -0.95], [-1.0, -1.0], [-0.35, -1.0], [1.0, 1.0]
    at_rollout, _ = _run(TISConfig(use_rollout_log_probs=True, loss_mode="dppo_tv"), new, None, rollout, adv)
    at_old, _ = _run(TISConfig(loss_mode="dppo_tv"), new, old, None, adv)
    assert not torch.allclose(at_rollout.loss, at_old.loss)
    assert _metrics(at_old)["policy/clipfrac"] == 0.5 and _metrics(at_rollout)["policy/clipfrac"] == 0.0


# ------------------------------------------------------------------------------------ SkyRL CISPO anchor
CISPO = dict(adv=[1.0, -1.0, -4.0], old=[-1.0, -1.0, -3.0], lp=[-1.69315, -1.0, -0.69741],
             rollout=[-1.30685, -1.5, -1.0])


def test_skyrl_cispo_rollout_anchor() -> None:
    """``cispo_anchor="rollout"``: ``sum(-clip(pi_theta / pi_rollout) A lp)`` = algorithm 1; the ``"old"`` anchor
    (algorithm 0) differs on the same inputs; without rollout log-probs algorithm 1 refuses."""
    c = {k: torch.tensor(v) for k, v in CISPO.items()}
    out, _ = _run(TISConfig(use_rollout_log_probs=True, loss_mode="cispo", **SUM), c["lp"], None, c["rollout"],
                  c["adv"])
    expected = (-torch.exp(c["lp"] - c["rollout"]).clamp(0.8, 1.2) * c["adv"] * c["lp"]).sum()
    torch.testing.assert_close(out.loss.detach(), expected, rtol=1e-5, atol=1e-6)
    at_old, _ = _run(TISConfig(loss_mode="cispo", **SUM), c["lp"], c["old"], None, c["adv"])
    assert not torch.allclose(out.loss, at_old.loss)
    with pytest.raises(ValueError, match="needs lp_rollout"):
        _run(TISConfig(use_rollout_log_probs=True, loss_mode="cispo"), c["lp"], None, None, c["adv"])


def test_skyrl_cispo_ratio_extremes_ignore_masked_tokens() -> None:
    """Their ``cispo/ratio_min|max`` over the active tokens only: ours are ``tis/ratio_min|max`` of
    ``sg(pi_theta) / pi_rollout`` in algorithm 1 (the CISPO ratio), over valid tokens (the masked one has ratio 1,
    neither extreme)."""
    c = {k: torch.tensor(v) for k, v in CISPO.items()}
    out, _ = _run(TISConfig(use_rollout_log_probs=True, loss_mode="cispo"), c["lp"], None, c["old"], c["adv"],
                  mask=[1.0, 0.0, 1.0])
    m, active = _metrics(out), torch.exp(c["lp"] - c["old"])[[0, 2]]
    assert m["tis/ratio_min"] == pytest.approx(float(active.min()), rel=1e-5)
    assert m["tis/ratio_max"] == pytest.approx(float(active.max()), rel=1e-5)


# ------------------------------------------------------------------------------------ SkyRL Clip-Cov / KL-Cov
COV = dict(old=-torch.ones(8), mask=torch.tensor([1.0] * 7 + [0.0]))


def test_skyrl_clip_cov_case() -> None:
    torch.manual_seed(42)
    adv = torch.tensor([2.0, -1.0, 1.5, 0.8, 1.0, 0.5, -2.0, 1.2])
    lp = torch.tensor([-0.5, -1.5, -0.8, -1.2, -1.3, -0.7, -1.8, -0.9])
    cfg = TISConfig(loss_mode="clip_cov", clip_cov_ratio=0.5, clip_cov_lb=-5.0, clip_cov_ub=5.0)
    out, _ = _run(cfg, lp, COV["old"], None, adv, COV["mask"])
    ppo, _ = _run(TISConfig(), lp, COV["old"], None, adv, COV["mask"])
    assert math.isfinite(float(out.loss.detach())) and not torch.allclose(out.loss, ppo.loss, rtol=1e-3)
    frac = _metrics(out)["policy/cov_selected_fraction"]
    assert 0 < frac * 7 <= 3.0 + 1e-9  # at most floor(0.5 * 7) = 3 tokens, among the unclipped ones


def test_skyrl_kl_cov_case() -> None:
    torch.manual_seed(42)
    adv = torch.tensor([1.5, -0.5, 2.0, 0.8, 0.5, 1.0, -1.5, 1.2])
    lp = torch.tensor([-0.8, -1.2, -0.6, -1.1, -1.1, -0.9, -1.4, -0.7])
    out, _ = _run(TISConfig(loss_mode="kl_cov", kl_cov_ratio=0.5, kl_cov_coef=1.0), lp, COV["old"], None, adv,
                  COV["mask"])
    ppo, _ = _run(TISConfig(), lp, COV["old"], None, adv, COV["mask"])
    assert math.isfinite(float(out.loss.detach())) and not torch.allclose(out.loss, ppo.loss, rtol=1e-3)
    assert "policy/clipfrac" not in _metrics(out)  # theirs: clip_ratio 0.0 (KL-Cov does not clip)


# ------------------------------------------------------------------------------------ NeMo-RL KL gradient
@pytest.mark.parametrize("on_policy_approximation", [False, True])
@pytest.mark.parametrize("kl_gradient", ["with_score", "direct"])
def test_nemo_rl_kl_gradient_includes_sampling_term(on_policy_approximation: bool, kl_gradient: str) -> None:
    """The KL term's gradient ``grad(beta) - grad(0)``: NeMo-RL's ``beta w (k3 + k3') / N`` with ``with_score``,
    ``beta w k3' / N`` (verl, slime) with ``direct``. ``w = pi_theta / pi_gen`` (algorithm 3, weighted KL) or 1."""
    curr, gen = torch.tensor([-1.2, -0.7]), torch.tensor([-1.5, -0.4])
    ref, adv, beta = torch.tensor([-0.9, -1.1]), torch.tensor([0.4, -0.2]), 0.3
    alg = dict(use_rollout_log_probs=True, use_tis=on_policy_approximation,
               kl_importance_weighted=on_policy_approximation)

    def grad(coef: float) -> torch.Tensor:
        cfg = TISConfig(**alg, kl_coef=coef, kl_gradient=kl_gradient if coef else "direct")
        return _run(cfg, curr, None, gen, adv, lp_ref=ref)[1]

    actual = grad(beta) - grad(0.0)
    log_ratio = ref - curr
    k3, k3_grad = torch.exp(log_ratio) - 1 - log_ratio, 1 - torch.exp(log_ratio)
    w = torch.exp(curr - gen) if on_policy_approximation else torch.ones(2)
    expected = beta * w * ((k3 + k3_grad) if kl_gradient == "with_score" else k3_grad) / 2
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-7)
    if not on_policy_approximation:  # the values the two conventions give on this case
        want = [-0.045, 0.06] if kl_gradient == "with_score" else [-0.05248, 0.04945]
        torch.testing.assert_close(actual, torch.tensor(want), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kl_gradient", ["direct", "with_score"])
def test_nemo_rl_kl_penalty_value(kl_gradient: str) -> None:
    """NeMo-RL ``test_clipped_pg_loss_kl_penalty``: zero advantages, ``0.1 * mean(k3)`` over ``d = [1, 0, -1]`` is
    0.0362 (3 digits, theirs), whichever gradient."""
    cfg = TISConfig(kl_coef=0.1, kl_gradient=kl_gradient)
    out, _ = _run(cfg, [0.0, -1.0, -2.0], [0.0, 0.0, 0.0], None, [0.0, 0.0, 0.0], lp_ref=torch.full((3,), -1.0))
    assert float(out.loss.detach()) == pytest.approx(0.0362, rel=1e-3)


def test_kl_score_term_leaves_the_value() -> None:
    lp, ref, adv = torch.tensor([-1.2, -0.7, -2.0]), torch.tensor([-0.9, -1.1, -1.0]), torch.tensor([0.4, -0.2, 1.0])
    for est in ("k1", "k3", "low_var_kl"):
        a, b = (_run(TISConfig(kl_coef=0.3, kl_estimator=est, kl_gradient=g), lp, lp, None, adv, lp_ref=ref)[0]
                for g in ("direct", "with_score"))
        torch.testing.assert_close(a.loss, b.loss)


# ------------------------------------------------------------------------------------ verl 0.9.1 oracle
verl = pytest.importorskip("_verl_light", reason="verl shim missing")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")


def _verl_config(loss_mode: str, **kw):
    from verl.workers.config import ActorConfig, PolicyLossConfig

    policy = {k: kw.pop(k) for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")
              if k in kw}
    return ActorConfig(strategy="fsdp", rollout_n=1, use_torch_compile=False, ppo_micro_batch_size_per_gpu=1,
                       ppo_mini_batch_size=1, policy_loss=PolicyLossConfig(loss_mode=loss_mode, **policy), **kw)


def _batch(seed: int, rows: int = 6, cols: int = 10, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    mask = (torch.arange(cols)[None, :] < lengths[:, None]).float()
    mask[:, 1:] *= (torch.rand(rows, cols - 1, generator=g) > 0.2).float()
    rollout = -torch.rand(rows, cols, generator=g) * 2
    old = (rollout + 0.3 * torch.randn(rows, cols, generator=g)).clamp(max=-1e-3)  # log-probs: p <= 1
    theta = (old + spread * torch.randn(rows, cols, generator=g)).clamp(max=-1e-3)
    return dict(mask=mask, rollout=rollout, old=old, theta=theta, adv=torch.randn(rows, cols, generator=g))


def _ours(cfg, b, **kw):
    p = {k: padded_to_packed(v, b["mask"])[0] for k, v in b.items()}
    cu = padded_to_packed(b["mask"], b["mask"])[1]
    return _run(cfg, p["theta"], p["old"], p["rollout"], p["adv"], p["mask"], cu, **kw)


def _theirs(mode: str, b, agg: str, weights=None, **kw):
    theta = b["theta"].clone().requires_grad_(True)
    fn = core_algos.get_policy_loss_fn(mode)
    loss, metrics = fn(b["old"], theta, b["adv"], b["mask"], agg, _verl_config(mode, **kw), rollout_is_weights=weights)
    loss.backward()
    return loss.detach(), padded_to_packed(theta.grad, b["mask"])[0], metrics


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode, delta", [("dppo_tv", 0.05), ("dppo_kl", 0.004)])
@pytest.mark.parametrize("use_tis", [False, True])
def test_dppo_matches_verl(seed: int, mode: str, delta: float, use_tis: bool) -> None:
    """verl's ``-A sg(min(r, c)) lp m`` has our gradient ``-A r m grad lp`` where ``r < c`` (c = 1e6 here) and our
    masked fraction (``pg_clipfrac``; no zero advantage in this data); its value is another function (documented)."""
    b = _batch(seed)
    cfg = TISConfig(use_tis=use_tis, loss_mode=mode, eps_clip=delta, eps_clip_high=1.5 * delta)
    out, grad = _ours(cfg, b)
    w = torch.exp(b["old"] - b["rollout"]).clamp(max=2.0) if use_tis else None
    _, their_grad, metrics = _theirs(mode, b, "token-mean", w, clip_ratio_low=delta, clip_ratio_high=1.5 * delta,
                                     clip_ratio_c=1e6)
    torch.testing.assert_close(grad, their_grad, rtol=1e-5, atol=1e-7)
    frac = _metrics(out)["policy/clipfrac"]
    assert frac == pytest.approx(metrics["actor/pg_clipfrac"], abs=1e-6) and 0.05 < frac < 0.95


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("use_tis", [False, True])
def test_geo_mean_matches_verl(seed: int, use_tis: bool) -> None:
    """verl's ``geo_mean`` (a mean over sequences, whatever its aggregation argument): ours with
    ``seq-mean-token-mean``; with rollout correction at ``--tis-level geometric`` (one weight per sequence, which
    verl's geometric mean of token weights leaves as it is)."""
    b = _batch(seed, spread=0.2)
    cfg = TISConfig(use_tis=use_tis, level="geometric", loss_mode="geo_mean", loss_agg="seq-mean-token-mean",
                    eps_clip=0.1, eps_clip_high=0.15)
    out, grad = _ours(cfg, b)
    n = b["mask"].sum(1, keepdim=True)
    w = torch.exp(((b["old"] - b["rollout"]) * b["mask"]).sum(1, keepdim=True) / n).clamp(max=2.0).expand_as(b["old"])
    loss, their_grad, _ = _theirs("geo_mean", b, "token-mean", w if use_tis else None, clip_ratio_low=0.1,
                                  clip_ratio_high=0.15)
    torch.testing.assert_close(out.loss.detach(), loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, their_grad, rtol=1e-5, atol=1e-7)
    assert 0 < _metrics(out)["policy/clipfrac"] < 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_cov_matches_verl_where_every_candidate_is_taken(seed: int) -> None:
    """verl picks its ``k`` tokens at random among the candidates; where there are at most ``k`` of them both take all
    of them, so loss and gradient agree exactly."""
    b = _batch(seed)
    kw = dict(clip_cov_ratio=0.3, clip_cov_lb=0.5, clip_cov_ub=5.0)
    out, grad = _ours(TISConfig(loss_mode="clip_cov", **kw), b)
    loss, their_grad, _ = _theirs("clip_cov", b, "token-mean", **kw)
    n = int(b["mask"].sum())
    selected = _metrics(out)["policy/cov_selected_fraction"] * n
    assert 1 <= round(selected) < int(0.3 * n)  # fewer than k candidates: all of them taken
    torch.testing.assert_close(out.loss.detach(), loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, their_grad, rtol=1e-5, atol=1e-7)


def test_clip_cov_takes_k_pseudo_random_candidates() -> None:
    """Many candidates (a wide band): exactly ``floor(ratio N)`` of them, taken out of loss and gradient; the pick is
    a function of the data (the same twice, whatever torch's generator), and other log-probs pick another set."""
    b = _batch(5, rows=8, cols=16)
    cfg = TISConfig(loss_mode="clip_cov", clip_cov_ratio=0.1, clip_cov_lb=-10.0, clip_cov_ub=10.0)
    torch.manual_seed(0)
    out, grad = _ours(cfg, b)
    n = int(b["mask"].sum())
    assert _metrics(out)["policy/cov_selected_fraction"] * n == pytest.approx(int(0.1 * n))
    ppo, ppo_grad = _ours(TISConfig(), b)
    differs = grad != ppo_grad
    assert int(differs.sum()) == int(0.1 * n) and torch.equal(grad[differs], torch.zeros(int(differs.sum())))
    torch.manual_seed(1)
    assert torch.equal(_ours(cfg, b)[1], grad)
    _, grad2 = _ours(cfg, {**b, "theta": b["theta"] - 1e-3})
    assert not torch.equal(grad2 == 0, grad == 0)


def test_hash_keys_look_uniform() -> None:
    """The draw's keys over 20000 tokens: mean and quartiles of ``key / 2^32`` within 1 % of a uniform's (their
    standard errors are ~0.2 %), and all distinct up to a handful of 32-bit collisions."""
    keys = hash_keys(-torch.rand(20000, generator=torch.Generator().manual_seed(0)) * 5).double() / 2**32
    assert abs(float(keys.mean()) - 0.5) < 0.01
    for q in (0.25, 0.5, 0.75):
        assert abs(float(keys.quantile(q)) - q) < 0.01
    assert keys.unique().numel() > 19990


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ratio, coef", [(0.1, 1.0), (0.3, 0.5)])
def test_kl_cov_matches_verl(seed: int, ratio: float, coef: float) -> None:
    b = _batch(seed)
    out, grad = _ours(TISConfig(loss_mode="kl_cov", kl_cov_ratio=ratio, kl_cov_coef=coef), b)
    loss, their_grad, _ = _theirs("kl_cov", b, "token-mean", kl_cov_ratio=ratio, ppo_kl_coef=coef)
    torch.testing.assert_close(out.loss.detach(), loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, their_grad, rtol=1e-5, atol=1e-7)
    n = int(b["mask"].sum())
    assert _metrics(out)["policy/cov_selected_fraction"] * n == pytest.approx(max(int(ratio * n), 1))


def test_first_k_is_a_stable_rank_selection() -> None:
    mask = torch.tensor([True, False, True, True, True])
    key = torch.tensor([3.0, -9.0, 1.0, 1.0, 0.0])
    assert first_k(mask, key, torch.tensor(2.0)).tolist() == [False, False, True, False, True]
    assert first_k(mask, key, torch.tensor(9.0)).tolist() == mask.tolist()


# ------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl", "geo_mean", "clip_cov", "kl_cov"])
def test_new_surrogates_need_an_anchor(mode: str) -> None:
    """Algorithm 3 has no anchor (its weight is the ratio against the rollout policy): one line with the reason."""
    with pytest.raises(ValueError, match="algorithm 3 has none") as err:
        TISConfig(use_rollout_log_probs=True, use_tis=True, loss_mode=mode)
    assert "\n" not in str(err.value) and "--tis-loss-mode" in str(err.value)
    for alg in range(3):
        TISConfig(use_rollout_log_probs=bool(alg & 1), use_tis=bool(alg & 2), loss_mode=mode)


def test_bad_combinations_are_refused_in_one_line() -> None:
    cases = [(dict(clip_cov_lb=5.0, clip_cov_ub=1.0), "--tis-clip-cov-lb"),
             (dict(kl_coef=0.1, kl_estimator="k2", kl_gradient="with_score"), "--tis-kl-gradient"),
             (dict(clip_cov_ratio=0.0), "--tis-clip-cov-ratio"), (dict(kl_cov_coef=-1.0), "--tis-kl-cov-coef")]
    for fields, flag in cases:
        with pytest.raises(ValueError, match=flag) as err:
            TISConfig(**fields)
        assert "\n" not in str(err.value)
    assert TISConfig(kl_gradient="with_score").inert_options() == [
        "--tis-kl-gradient does nothing while --tis-kl-coef is 0"]
    assert any("--tis-kl-cov-coef does nothing" in s for s in TISConfig(kl_cov_coef=2.0).inert_options())
    assert any("paper uses 0.05" in s for s in TISConfig(loss_mode="dppo_kl").inert_options())
    assert TISConfig(loss_mode="dppo_kl", eps_clip=0.05).inert_options() == []
    assert TISConfig(loss_mode="dppo_tv").inert_options() == []


@pytest.mark.parametrize("mode", ["clip_cov", "kl_cov"])
def test_covariance_selection_refuses_context_parallelism(mode: str) -> None:
    class SplitReducer:  # a reducer over CP = 2 (identity sums: the refusal comes before any reduction)
        cp_size = 2

        def sequence_sum(self, x):
            return x

        batch_sum = batch_min = batch_max = lambda self, x, **kw: x  # noqa: E731

    with pytest.raises(ValueError, match="context parallelism") as err:
        _run(TISConfig(loss_mode=mode), [-1.0, -2.0], [-1.1, -1.9], None, [1.0, -1.0], reducer=SplitReducer())
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl", "geo_mean", "clip_cov", "kl_cov"])
def test_new_rows_read_no_value_back_to_the_host(mode: str, monkeypatch) -> None:
    """The rows' own code (masks, sequence sums, the covariance's rank selection) never reads a tensor's value on the
    host: ``item``, ``tolist``, ``bool`` and ``int`` of a tensor raise while the row runs (on an accelerator each would
    be a synchronisation)."""
    from slime_tis.core.packing import packed_layout
    from slime_tis.core.reducer import LocalReducer
    from slime_tis.core.surrogates import SURROGATES, SurrogateInputs

    b = _batch(3)
    p = {k: padded_to_packed(v, b["mask"])[0] for k, v in b.items()}
    cu = padded_to_packed(b["mask"], b["mask"])[1]
    keep = p["mask"] > 0
    x = SurrogateInputs(torch.where(keep, p["theta"], 0.0).requires_grad_(True), torch.where(keep, p["old"], 0.0),
                        torch.where(keep, p["adv"], 0.0), keep, packed_layout(cu, keep.numel(), keep.device),
                        LocalReducer())
    plan = TISConfig(loss_mode=mode).plan

    def refuse(*_a, **_k):
        raise AssertionError("host read of a tensor value")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    out = SURROGATES[mode].fn(x, plan)
    out.loss.sum().backward()
    monkeypatch.undo()
    assert torch.isfinite(x.lp.grad).all()


def _halves(b, cut_seq: int):
    p = {k: padded_to_packed(v, b["mask"])[0] for k, v in b.items()}
    cu = padded_to_packed(b["mask"], b["mask"])[1]
    cut = int(cu[cut_seq])
    parts = [({k: v[:cut] for k, v in p.items()}, cu[: cut_seq + 1]),
             ({k: v[cut:] for k, v in p.items()}, cu[cut_seq:] - cut)]
    return p, cu, parts


@pytest.mark.parametrize("fields", [dict(loss_mode="dppo_tv", eps_clip=0.05), dict(loss_mode="dppo_kl", eps_clip=0.004),
                                    dict(loss_mode="geo_mean", loss_agg="seq-mean-token-mean"),
                                    dict(loss_mode="geo_mean", use_tis=True, mode="mask", upper=1.3),
                                    dict(kl_coef=0.2, kl_gradient="with_score")])
def test_split_into_micro_batches_with_the_global_denominator(fields: dict) -> None:
    """Per-token and per-sequence rows: two micro-batches with the global denominator sum to the whole batch's loss
    and gradient."""
    from slime_tis import loss_denominator

    b = _batch(4, rows=8)
    b["ref"] = b["rollout"] + 0.2
    cfg = TISConfig(**fields)
    p, cu, parts = _halves(b, 3)
    whole, g = _run(cfg, p["theta"], p["old"], p["rollout"], p["adv"], p["mask"], cu, lp_ref=p["ref"])
    den = sum(loss_denominator(cfg, q["mask"], c) for q, c in parts)
    outs = [_run(cfg, q["theta"], q["old"], q["rollout"], q["adv"], q["mask"], c, denominator=den, lp_ref=q["ref"])
            for q, c in parts]
    torch.testing.assert_close(outs[0][0].loss.detach() + outs[1][0].loss.detach(), whole.loss.detach(),
                               rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([outs[0][1], outs[1][1]]), g, rtol=1e-5, atol=1e-7)


def test_kl_cov_selects_per_micro_batch() -> None:
    """The documented locality: ``k = max(floor(ratio N), 1)`` per micro-batch, so a tiny ratio selects one token in
    the whole batch and one in each of two micro-batches."""
    b = _batch(4, rows=8)
    cfg = TISConfig(loss_mode="kl_cov", kl_cov_ratio=1e-4)
    p, cu, parts = _halves(b, 3)
    count = lambda out: float(out.stats.token_sums["policy.cov_selected_count"])  # noqa: E731
    assert count(_run(cfg, p["theta"], p["old"], None, p["adv"], p["mask"], cu)[0]) == 1.0
    assert [count(_run(cfg, q["theta"], q["old"], None, q["adv"], q["mask"], c)[0]) for q, c in parts] == [1.0, 1.0]
