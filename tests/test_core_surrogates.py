"""The policy-loss registry: peers' published cases, verl 0.9.1 as an oracle, and invariants.

Published cases (inputs and expected values from the peers' test files, asked of ``policy_loss``):

* NeMo-RL ``tests/unit/algorithms/data/clipped_pg_loss_goldens.json`` (NVIDIA-NeMo/RL at
  4e6a3f238d28df991d9978e57d0c80a5a5dec924, generated from their loss at aa739509; read by
  ``test_clipped_pg_loss_goldens.py``): cases ``ppo_token``, ``force_on_policy``, ``reinforce``,
  ``cispo_with_token_is`` and ``gspo_sequence_is``, loss and gradient (float64 there, float32 here: 1e-5
  relative). Their rows shift by one position (``token_mask[:, 1:]``); the packed tokens below are the shifted
  ones.
* NeMo-RL ``tests/unit/algorithms/test_loss_functions.py`` (NVIDIA-NeMo/RL at
  03886ff31d7ab31bc71247527f7dbad6f5c821c4): ``test_clipped_pg_loss_gspo``,
  ``test_clipped_pg_loss_gspo_batch_size_2``, ``test_clipped_pg_loss_gspo_importance_sampling_correction``
  (hand values to 4 digits: 1e-3 relative, as theirs).
* SkyRL ``skyrl-train/tests/cpu/algorithms/test_losses.py`` (NovaSky-AI/SkyRL at
  041ed9e2e6d6937c040e41fe5b01fbed26c3c53b): ``test_policy_loss_cispo`` (the value of its own formula line,
  ``mean(-clip(r) A lp)``) and ``test_gspo_importance_sampling_levels`` (its sequence-mean GSPO formula);
  ``cispo_rollout_anchor_rejects_tis`` as a configuration error.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_tis import TISConfig, loss_denominator, padded_to_packed, policy_loss
from slime_tis.core import LocalReducer
from slime_tis.core.aggregation import AGGREGATIONS
from slime_tis.core.surrogates import SURROGATES
from slime_tis.core.terms import kl_estimate

F32_VS_F64 = dict(rtol=1e-5, atol=1e-6)  # float32 loss against a float64 golden, values O(1)

# ------------------------------------------------------------------------------- NeMo-RL goldens
# BASE_INPUTS of the goldens, shifted by one position (their next-token alignment): two rows of 4 tokens
NEMO = dict(
    mask=[[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]],
    adv=[[1.2, -0.7, 0.4, 2.0], [-1.1, 0.6, 1.5, -0.3]],
    prev=[[-1.0, -1.1, -0.8, -1.3], [-0.9, -1.0, -1.2, -0.8]],
    gen=[[-1.2, -1.5, -0.7, -1.1], [-1.4, -0.7, -1.3, -1.0]],
    ref=[[-1.1, -0.7, -1.4, -1.0], [-1.3, -0.8, -1.0, -1.4]],
    lp=[[-1.6, -0.8, -1.1, -1.4], [-0.7, -1.4, -0.9, -1.2]],
)
NEMO_GOLDENS = {  # case -> (our configuration, expected loss, expected gradient of next_token_logprobs)
    "ppo_token": (dict(), 0.18627018364195694,
                  [[-0.13171479239913675, 0.18898023268267997, -0.05926545753600652, 0.0],
                   [0.26870860625782017, -0.08043840536339991, 0.0, 0.0]]),
    "force_on_policy": (dict(loss_mode="on_policy"), -0.07999999984,
                        [[-0.23999999952, 0.13999999972, -0.07999999984, 0.0],
                         [0.21999999956000002, -0.11999999976, 0.0, 0.0]]),
    "reinforce": (dict(loss_mode="reinforce"), 0.373999999252,
                  [[-0.23999999952, 0.13999999972, -0.07999999984, 0.0],
                   [0.21999999956000002, -0.11999999976, 0.0, 0.0]]),
    # token IS weight exp(prev - gen) (at most exp(0.5) < 2: the default truncation never acts)
    "cispo_with_token_is": (dict(use_tis=True, loss_mode="cispo"), 0.03329652014119518,
                            [[-0.23450932909773395, 0.2506265487024803, -0.057909594638482234, 0.0],
                             [0.435262414594309, -0.07111854904320782, 0.0, 0.0]]),
    # sequence IS weight exp(sum(prev - gen)), sequence-mean aggregation (their token_level_loss=False)
    "gspo_sequence_is": (dict(use_tis=True, level="sequence", loss_mode="gspo", loss_agg="seq-mean-token-mean"),
                         -0.06433245613699731,
                         [[-0.06749293963637779, -0.06749293963637779, -0.06749293963637779, 0.0],
                          [0.06907318137816686, 0.06907318137816686, 0.0, 0.0]]),
}


def _nemo_batch():
    mask = torch.tensor(NEMO["mask"])
    packed = {k: padded_to_packed(torch.tensor(v), torch.ones_like(mask))[0] for k, v in NEMO.items()}
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    return packed, cu


def _run(cfg: TISConfig, lp, lp_old, lp_rollout, adv, mask, cu, **kw):
    theta = lp.clone().requires_grad_(True)
    out = policy_loss(cfg, theta, lp_old, lp_rollout, adv, mask, cu, **kw)
    out.loss.backward()
    return out, theta.grad


@pytest.mark.parametrize("case", NEMO_GOLDENS)
def test_nemo_rl_goldens_loss(case: str) -> None:
    fields, loss, grad = NEMO_GOLDENS[case]
    b, cu = _nemo_batch()
    out, g = _run(TISConfig(**fields), b["lp"], b["prev"], b["gen"], b["adv"], b["mask"], cu)
    assert float(out.loss.detach()) == pytest.approx(loss, rel=1e-5, abs=1e-7)
    expected = torch.tensor(grad).reshape(-1)
    if case == "gspo_sequence_is":
        # NeMo-RL differentiates the sequence mean itself (every token of a sequence gets the sequence's mean
        # gradient); ours is GSPO-token (verl, SkyRL): each token carries its own advantage. The two agree on
        # the loss and on each sequence's gradient sum (and token by token when A is constant in a sequence).
        seq = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
        torch.testing.assert_close(torch.zeros(2).index_add_(0, seq, g),
                                   torch.zeros(2).index_add_(0, seq, expected.float()), **F32_VS_F64)
        assert not torch.allclose(g, expected.float(), atol=1e-3)  # the per-token split differs
    else:
        torch.testing.assert_close(g, expected.float(), **F32_VS_F64)


@pytest.mark.parametrize("rows, expected, gen", [
    # test_clipped_pg_loss_gspo: one sequence, ratios 0.5 / 1 / 1.5 -> geometric mean 0.9086
    ([[-1.0, -1.0, -1.0]], -0.6057, None),
    # test_clipped_pg_loss_gspo_batch_size_2: the second sequence's ratio 2.4697 is clipped at 1.2
    ([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]], -0.4912, None),
    # test_clipped_pg_loss_gspo_importance_sampling_correction: sequence weight exp(sum(prev - gen)) = 0.8187
    ([[-1.0, -1.0, -1.0]], -0.4959, [[-0.5, -1.5, -0.8]]),
])
def test_nemo_rl_gspo_hand_values(rows, expected, gen) -> None:
    n = len(rows)
    curr = torch.tensor([-1.69315, -1.0, -0.59453]).repeat(n)
    adv = torch.tensor([1.0, -1.0, 2.0]).repeat(n)
    prev = torch.tensor(rows).reshape(-1)
    cu = torch.arange(0, 3 * n + 1, 3, dtype=torch.int32)
    mask = torch.ones(3 * n)
    fields = dict(loss_mode="gspo", loss_agg="seq-mean-token-mean")
    if gen is not None:
        fields.update(use_tis=True, level="sequence")
    lp_rollout = torch.tensor(gen).reshape(-1) if gen is not None else None
    out, _ = _run(TISConfig(**fields), curr, prev, lp_rollout, adv, mask, cu)
    assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-3)


def test_skyrl_cispo_case() -> None:
    """SkyRL ``test_policy_loss_cispo``: ratios 0.5 / 1 / 10 clipped to [0.8, 1.2], token mean of
    ``-sg(clip(r)) A lp`` = (1.35452 - 1.0 - 3.347568) / 3 (the value of the test's formula line)."""
    adv = torch.tensor([1.0, -1.0, -4.0])
    old = torch.tensor([-1.0, -1.0, -3.0])
    lp = torch.tensor([-1.69315, -1.0, -0.69741])
    out, g = _run(TISConfig(loss_mode="cispo"), lp, old, None, adv, torch.ones(3), torch.tensor([0, 3]))
    assert float(out.loss.detach()) == pytest.approx((1.35452 - 1.0 - 3.347568) / 3, abs=1e-4)
    # the clipped ratio is a detached weight: d loss / d lp_t = -clip(r_t) A_t / 3
    torch.testing.assert_close(g, -torch.tensor([0.8, 1.0, 1.2]) * adv / 3, rtol=1e-5, atol=1e-6)
    assert float(out.stats.token_sums["policy.clip_count"]) == 2.0  # 0.5 and 10 are clipped


def test_skyrl_gspo_importance_sampling_levels_case() -> None:
    """SkyRL ``test_gspo_importance_sampling_levels``: lengths 5 / 2 / 4, extreme token ratios; sequence mean of
    the per-token GSPO loss with ``s = exp(sg(mean log r) + lp - sg(lp))``, clip [0.8, 1.2]."""
    adv = torch.tensor([[1.5, 2.0, 1.0, 0.8, 0.5], [3.0, 1.5, 0, 0, 0], [0.5, 0.8, 1.2, 2.5, 0]])
    lp = torch.tensor([[0.2, -2.5, -0.3, 0.1, -1.8], [0.8, -0.2, -1.0, -1.0, -1.0], [-0.5, 0.3, -1.7, 0.4, -1.0]])
    mask = torch.tensor([[1.0] * 5, [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    old = -torch.ones_like(lp)
    # their expected value, written out: masked sequence means of -min(s A, clip(s) A), then the mean
    s = torch.exp(((lp - old) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True)).expand_as(lp)
    per_token = -torch.minimum(s * adv, s.clamp(0.8, 1.2) * adv)
    expected = ((per_token * mask).sum(1) / mask.sum(1)).mean()
    flat = {k: v.reshape(-1) for k, v in dict(adv=adv, lp=lp, mask=mask, old=old).items()}
    cu = torch.tensor([0, 5, 10, 15], dtype=torch.int32)
    out, _ = _run(TISConfig(loss_mode="gspo", loss_agg="seq-mean-token-mean"), flat["lp"], flat["old"], None,
                  flat["adv"], flat["mask"], cu)
    torch.testing.assert_close(out.loss.detach(), expected, rtol=1e-5, atol=1e-7)
    ppo, _ = _run(TISConfig(loss_agg="seq-mean-token-mean"), flat["lp"], flat["old"], None, flat["adv"],
                  flat["mask"], cu)
    assert not torch.allclose(ppo.loss.detach(), out.loss.detach(), rtol=1e-3)  # their "levels differ" check


def test_cispo_with_a_rollout_anchor_and_tis_weight_is_refused() -> None:
    """SkyRL's ``cispo_rollout_anchor_rejects_tis``: CISPO anchored at the rollout policy plus the TIS weight of
    the same ratio counts the weight twice. Algorithm 3 (w = sg(pi_theta)/pi_rollout) refuses every anchored
    surrogate, CISPO with its own reason; CISPO anchored at pi_rollout without a weight (algorithm 1) or at pi_old
    with the weight (algorithm 2) is accepted."""
    with pytest.raises(ValueError, match="weight would count twice") as err:
        TISConfig(use_rollout_log_probs=True, use_tis=True, loss_mode="cispo")
    assert "\n" not in str(err.value) and "--tis-loss-mode" in str(err.value)
    for mode in ("ppo_clip", "gspo"):
        with pytest.raises(ValueError, match="algorithm 3 has none"):
            TISConfig(use_rollout_log_probs=True, use_tis=True, loss_mode=mode)
    TISConfig(use_rollout_log_probs=True, loss_mode="cispo")
    TISConfig(use_tis=True, loss_mode="cispo")
    for mode in ("reinforce", "on_policy"):
        for alg in range(4):
            TISConfig(use_rollout_log_probs=bool(alg & 1), use_tis=bool(alg & 2), loss_mode=mode)


# ------------------------------------------------------------------------------------ verl oracle
verl = pytest.importorskip("_verl_light", reason="verl shim missing")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")


def _verl_actor_config(**kw):
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="fsdp", rollout_n=1, use_torch_compile=False, ppo_micro_batch_size_per_gpu=1,
                       ppo_mini_batch_size=1, **kw)


def _padded_batch(seed: int, rows: int = 5, cols: int = 9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    mask = (torch.arange(cols)[None, :] < lengths[:, None]).float()
    mask[:, 1:] *= (torch.rand(rows, cols - 1, generator=g) > 0.2).float()  # interior zeros, column 0 valid
    rollout = -torch.rand(rows, cols, generator=g) * 3
    old = rollout + 0.3 * torch.randn(rows, cols, generator=g)
    theta = old + 0.3 * torch.randn(rows, cols, generator=g)
    adv = torch.randn(rows, cols, generator=g)
    return dict(mask=mask, rollout=rollout, old=old, theta=theta, adv=adv)


def _packed(batch):
    packed = {k: padded_to_packed(v, batch["mask"])[0] for k, v in batch.items()}
    return packed, padded_to_packed(batch["mask"], batch["mask"])[1]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode, agg", [("gspo", "seq-mean-token-mean"), ("gspo", "token-mean"),
                                       ("cispo", "token-mean"), ("cispo", "seq-mean-token-sum")])
def test_surrogates_with_rollout_correction_match_verl(seed: int, mode: str, agg: str) -> None:
    """Algorithm 2 (w = min(pi_old / pi_rollout, 2) per token) with verl's ``gspo`` / ``cispo`` given the same
    ``rollout_is_weights``: loss and gradient to 1e-5 (float32 both, different summation order)."""
    b = _padded_batch(seed)
    cfg = TISConfig(use_tis=True, loss_mode=mode, loss_agg=agg, eps_clip=0.1, eps_clip_high=0.15)
    p, cu = _packed(b)
    out, g = _run(cfg, p["theta"], p["old"], p["rollout"], p["adv"], p["mask"], cu)
    w = torch.exp(b["old"] - b["rollout"]).clamp(max=2.0)
    theta = b["theta"].clone().requires_grad_(True)
    fn = {"gspo": core_algos.compute_policy_loss_gspo, "cispo": core_algos.compute_policy_loss_cispo}[mode]
    ref, _ = fn(b["old"], theta, b["adv"], b["mask"], agg, _verl_actor_config(clip_ratio_low=0.1,
                                                                              clip_ratio_high=0.15),
                rollout_is_weights=w)
    ref.backward()
    torch.testing.assert_close(out.loss.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g, padded_to_packed(theta.grad, b["mask"])[0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators_match_verl(kind: str) -> None:
    """verl's ``kl_penalty``; its ``k3`` is an alias of ``low_var_kl`` (clamped to [-10, 10]); ours is slime's and
    NeMo-RL's unclamped k3 (docs/semantics.md): equal where the clamp does not act, different where it does."""
    g = torch.Generator().manual_seed(0)
    lp, ref = -torch.rand(50, generator=g) * 4, -torch.rand(50, generator=g) * 4
    lp[0], ref[0] = -0.1, -25.0  # low_var_kl's clamp at 10 acts
    lp[1], ref[1] = -100.5, -0.5  # d = -100: exp(-d) overflows float32 unless d is clamped first
    ours, theirs = kl_estimate(lp, ref, kind), core_algos.kl_penalty(lp, ref, kind)
    inside = theirs.abs() < 10.0
    torch.testing.assert_close(ours[inside], theirs[inside], rtol=1e-6, atol=1e-6)
    if kind == "k3":
        assert float(ours[0]) > 10.0 and float(theirs[0]) == 10.0
    else:
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["k1", "k2", "low_var_kl"])
def test_bounded_kl_estimators_have_finite_gradients_at_extreme_log_ratios(kind: str) -> None:
    """``d = lp - lp_ref`` of -100 and +100 (a token the policy has all but ruled out, or the reverse): the estimators
    that are finite there also have a finite gradient. low_var_kl clamps ``d`` to [-20, 20] before its exponential,
    as verl does; without it ``exp(100)`` is inf in float32 and the saturated clamp's zero gradient meets it as NaN."""
    lp = torch.tensor([-100.5, -0.5, -1.0], requires_grad=True)
    ref = torch.tensor([-0.5, -100.5, -1.2])
    k = kl_estimate(lp, ref, kind)
    k.sum().backward()
    assert torch.isfinite(k).all() and torch.isfinite(lp.grad).all()
    if kind == "low_var_kl":
        assert k[:2].tolist() == [10.0, 10.0] and lp.grad[:2].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_token_sum_matches_verl_dp_scaling(dp: int) -> None:
    """verl's ``token-sum`` multiplies each DP rank's local sum by ``dp`` so that the DP mean of the rank losses is
    the global sum; ours divides the global numerator by 1 and leaves the DP average to the host's scaling
    (Megatron's ``LossForm`` multiplies by the averaging factor): mean over ranks of verl's = sum of ours."""
    b = _padded_batch(3, rows=8)
    p, cu = _packed(b)
    cfg = TISConfig(loss_mode="reinforce", loss_agg="token-sum")
    rows_per_rank = 8 // dp
    ours, verls = [], []
    for r in range(dp):
        sl = slice(r * rows_per_rank, (r + 1) * rows_per_rank)
        part = {k: v[sl] for k, v in b.items()}
        pp, pcu = _packed(part)
        ours.append(policy_loss(cfg, pp["theta"], pp["old"], None, pp["adv"], pp["mask"], pcu,
                                denominator=torch.zeros(())).loss)
        verls.append(core_algos.agg_loss(-part["adv"] * part["theta"], part["mask"], "token-sum", dp_size=dp))
    whole = policy_loss(cfg, p["theta"], p["old"], None, p["adv"], p["mask"], cu).loss
    torch.testing.assert_close(sum(ours), whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sum(verls) / dp, whole, rtol=1e-5, atol=1e-5)
    assert float(loss_denominator(cfg, p["mask"], cu)) == 0.0  # token-sum: the loss divides by max(0, 1)


# ------------------------------------------------------------------------------------ invariants
def _random_packed(seed: int, n_seq: int = 6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 8, (n_seq,), generator=g)
    cu = torch.zeros(n_seq + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    t = int(cu[-1])
    return dict(lp_rollout=-torch.rand(t, generator=g) * 3, lp_old=None, adv=torch.randn(t, generator=g),
                mask=torch.rand(t, generator=g) > 0.2, cu=cu, g=g, t=t)


INVARIANT_SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None)


@INVARIANT_SETTINGS
@given(seed=st.integers(0, 2**31 - 1))
def test_gspo_ratio_is_a_sequence_constant_times_a_token_gradient_carrier(seed: int) -> None:
    """Unclipped GSPO (wide clip): loss_t = -A_t s_i with s_i = exp(mean_{t in i} (lp - old)) in value, and
    d loss / d lp_t = -A_t s_i / N: the gradient divided by -A_t / N is the same s_i at every token of i."""
    b = _random_packed(seed)
    old = b["lp_rollout"] + 0.2 * torch.randn(b["t"], generator=b["g"])
    theta = old + 0.2 * torch.randn(b["t"], generator=b["g"])
    cfg = TISConfig(loss_mode="gspo", eps_clip=0.99, eps_clip_high=100.0)
    out, g = _run(cfg, theta, old, None, b["adv"], b["mask"], b["cu"])
    seq = torch.repeat_interleave(torch.arange(6), (b["cu"][1:] - b["cu"][:-1]).long())
    valid = b["mask"]
    s = torch.exp(torch.zeros(6).index_add_(0, seq[valid], (theta - old)[valid])
                  / torch.zeros(6).index_add_(0, seq[valid], torch.ones(int(valid.sum()))).clamp(min=1))
    carrier = g * valid.sum() / -b["adv"]
    torch.testing.assert_close(carrier[valid], s[seq][valid], rtol=1e-5, atol=1e-6)
    assert torch.equal(g[~valid], torch.zeros_like(g[~valid]))
    n = float(valid.sum())
    assert float(out.loss.detach()) == pytest.approx(float((-b["adv"] * s[seq])[valid].sum()) / n, rel=1e-5)


@INVARIANT_SETTINGS
@given(seed=st.integers(0, 2**31 - 1))
def test_cispo_weight_carries_no_gradient(seed: int) -> None:
    """d loss / d lp_t = -w_t sg(clip(r_t)) A_t / N exactly: no term from the ratio inside the clip (which a
    differentiable clipped ratio would add: -A_t lp_t r_t / N where r_t is inside the clip range)."""
    b = _random_packed(seed)
    old = b["lp_rollout"] + 0.3 * torch.randn(b["t"], generator=b["g"])
    theta = old + 0.3 * torch.randn(b["t"], generator=b["g"])
    out, g = _run(TISConfig(use_tis=True, loss_mode="cispo"), theta, old, b["lp_rollout"], b["adv"], b["mask"],
                  b["cu"])
    n = b["mask"].sum()
    r = torch.exp(theta - old).clamp(0.8, 1.2)
    expected = torch.where(b["mask"], -out.weights * r * b["adv"] / n, 0.0)
    torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-7)
    with_grad = torch.where(b["mask"], -out.weights * b["adv"] * (r + theta * torch.exp(theta - old)
                                                                    * ((r > 0.8) & (r < 1.2))) / n, 0.0)
    assert not torch.allclose(g, with_grad, atol=1e-4)


def test_on_policy_gradient_is_reinforce_and_its_value_is_minus_a() -> None:
    b = _random_packed(7)
    theta = b["lp_rollout"] + 0.3 * torch.randn(b["t"], generator=b["g"])
    cfgs = [TISConfig(use_rollout_log_probs=True, use_tis=True, loss_mode=m) for m in ("on_policy", "reinforce")]
    (on, g_on), (rf, g_rf) = (_run(c, theta, None, b["lp_rollout"], b["adv"], b["mask"], b["cu"]) for c in cfgs)
    torch.testing.assert_close(g_on, g_rf, rtol=1e-6, atol=1e-8)
    n = b["mask"].sum()
    torch.testing.assert_close(on.loss.detach(), (-on.weights * b["adv"])[b["mask"]].sum() / n, rtol=1e-5,
                               atol=1e-7)


TERM_CASES = [dict(kl_coef=0.3, kl_estimator=e) for e in ("k1", "k2", "k3", "low_var_kl")] + [
    dict(kl_coef=0.3, kl_importance_weighted=True), dict(entropy_coef=0.01),
    dict(kl_coef=0.1, entropy_coef=0.02, kl_estimator="k2")]


@pytest.mark.parametrize("terms", TERM_CASES)
@pytest.mark.parametrize("agg", list(AGGREGATIONS))
def test_terms_are_added_per_kept_token_and_split_invariant(terms: dict, agg: str) -> None:
    """The terms' loss = aggregate(beta [w] k(lp - ref) - h H) over the kept tokens with the surrogate's
    denominator, and the sum over two micro-batches with the global denominator is the whole-batch loss."""
    b = _random_packed(11, n_seq=8)
    g = b["g"]
    theta = b["lp_rollout"] + 0.3 * torch.randn(b["t"], generator=g)
    ref = b["lp_rollout"] + 0.3 * torch.randn(b["t"], generator=g)
    entropy = torch.rand(b["t"], generator=g) * 2
    base = dict(use_rollout_log_probs=True, use_tis=True, mode="mask", upper=1.5, loss_agg=agg)
    cfg, plain = TISConfig(**base, **terms), TISConfig(**base)
    kw = dict(lp_ref=ref, entropy=entropy)
    out, _ = _run(cfg, theta, None, b["lp_rollout"], b["adv"], b["mask"], b["cu"], **kw)
    off, _ = _run(plain, theta, None, b["lp_rollout"], b["adv"], b["mask"], b["cu"])
    keep = out.keep_mask
    assert bool(keep.any()) and not bool(keep[b["mask"]].all())  # the mask mode rejects some tokens
    kl = kl_estimate(theta, ref, cfg.kl_estimator) * (out.weights if cfg.kl_importance_weighted else 1.0)
    added = torch.where(keep, cfg.kl_coef * kl - cfg.entropy_coef * entropy, 0.0)
    # the same aggregation as the surrogate: the difference of the two losses is the terms' aggregate
    ones = TISConfig(**{**base, "loss_mode": "on_policy", "use_tis": False, "use_rollout_log_probs": True})
    unit = policy_loss(ones, theta, None, b["lp_rollout"], -added, b["mask"], b["cu"]).loss
    torch.testing.assert_close(out.loss.detach() - off.loss.detach(), unit.detach(), rtol=1e-5, atol=1e-6)
    # micro-batch split at sequence 3 with the global denominator
    k = 3
    cut = int(b["cu"][k])
    halves = [(slice(0, cut), b["cu"][: k + 1]), (slice(cut, None), b["cu"][k:] - b["cu"][k])]
    den = sum(loss_denominator(cfg, b["mask"][s], c) for s, c in halves)
    total = sum(policy_loss(cfg, theta[s], None, b["lp_rollout"][s], b["adv"][s], b["mask"][s], c,
                            denominator=den, lp_ref=ref[s], entropy=entropy[s]).loss for s, c in halves)
    torch.testing.assert_close(total, out.loss.detach(), rtol=2e-5, atol=1e-6)


def test_terms_need_their_inputs_and_reject_non_finite_ones() -> None:
    b = _random_packed(5)
    theta = b["lp_rollout"].clone()
    cfg = TISConfig(use_rollout_log_probs=True, use_tis=True, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef = 0.1 .*needs lp_ref"):
        policy_loss(cfg, theta, None, b["lp_rollout"], b["adv"], b["mask"], b["cu"])
    with pytest.raises(ValueError, match="entropy_coef"):
        policy_loss(TISConfig(entropy_coef=0.1), theta, theta, None, b["adv"], b["mask"], b["cu"])
    ref = b["lp_rollout"].clone()
    first_valid = int(torch.nonzero(b["mask"])[0])
    ref[first_valid] = math.nan
    out = policy_loss(cfg, theta.requires_grad_(True), None, b["lp_rollout"], b["adv"], b["mask"], b["cu"],
                      lp_ref=ref)
    assert bool(torch.isfinite(out.loss))
    assert float(out.stats.seq_sums["policy.n_seq_nonfinite"]) == 1.0  # the sequence is rejected and counted


def test_each_surrogate_row_runs_with_every_aggregation_and_reducer() -> None:
    """Every row of the registry under every aggregation: finite loss and gradient, zero gradient off the kept
    tokens (the table is what the flag offers)."""
    b = _random_packed(2)
    old = b["lp_rollout"] + 0.2 * torch.randn(b["t"], generator=b["g"])
    theta = old + 0.2 * torch.randn(b["t"], generator=b["g"])
    for name, row in SURROGATES.items():
        for agg in AGGREGATIONS:
            cfg = TISConfig(use_tis=True, mode="mask", upper=1.3, loss_mode=name, loss_agg=agg)
            out, g = _run(cfg, theta, old, b["lp_rollout"], b["adv"], b["mask"], b["cu"], reducer=LocalReducer())
            assert bool(torch.isfinite(out.loss)) and bool(torch.isfinite(g).all()), (name, agg)
            assert torch.equal(g[~out.keep_mask], torch.zeros_like(g[~out.keep_mask])), (name, agg)
            assert ("policy.clip_count" in out.stats.token_sums) == row.clips


def test_inert_options_are_named_once_at_start_up(caplog) -> None:
    cfg = TISConfig(use_rollout_log_probs=True, use_tis=True, dual_clip_c=3.0, lower=0.5, eps_clip=0.1)
    lines = cfg.inert_options()
    assert any("--eps-clip-c does nothing with the reinforce surrogate" in s for s in lines)
    assert any("--tis-lower-bound does nothing in truncate mode" in s for s in lines)
    assert any("--eps-clip / --eps-clip-high do nothing" in s for s in lines)
    assert TISConfig(kl_coef=0.0, kl_estimator="k1").inert_options() == [
        "--tis-kl-estimator / --tis-kl-importance-weighted do nothing while --tis-kl-coef is 0"]
    assert TISConfig(use_tis=True, loss_mode="gspo", eps_clip=3e-4, eps_clip_high=4e-4).inert_options() == []
    assert TISConfig().inert_options() == []
    with caplog.at_level("WARNING", logger="slime_tis"):
        cfg.warn_inert()
        cfg.warn_inert()
    assert [r.getMessage() for r in caplog.records] == [f"slime_tis: {line}" for line in lines]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("taus", [(1.0, 1.05), (0.5, 2.0)])
def test_sapo_with_rollout_correction_matches_verl(seed: int, taus: tuple[float, float]) -> None:
    """verl's ``sapo`` (which always aggregates seq-mean-token-mean) with the same ``rollout_is_weights``."""
    b = _padded_batch(seed)
    cfg = TISConfig(use_tis=True, loss_mode="sapo", loss_agg="seq-mean-token-mean", sapo_tau_pos=taus[0],
                    sapo_tau_neg=taus[1])
    p, cu = _packed(b)
    out, g = _run(cfg, p["theta"], p["old"], p["rollout"], p["adv"], p["mask"], cu)
    theta = b["theta"].clone().requires_grad_(True)
    ref, _ = core_algos.compute_policy_loss_sapo(b["old"], theta, b["adv"], b["mask"], "seq-mean-token-mean",
                                                 _verl_actor_config(tau_pos=taus[0], tau_neg=taus[1]),
                                                 rollout_is_weights=torch.exp(b["old"] - b["rollout"]).clamp(max=2.0))
    ref.backward()
    torch.testing.assert_close(out.loss.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g, padded_to_packed(theta.grad, b["mask"])[0], rtol=1e-5, atol=1e-7)
    assert "sapo_tau_pos" not in dict(TISConfig(use_tis=True).plan.surrogate_params)
    assert any("--tis-sapo-tau-pos does nothing" in s for s in TISConfig(sapo_tau_pos=2.0).inert_options())
