"""Megatron-LM's RL loss (the stand-in in tests/_megatron_rl.py, commit d98e8a64dd) against the core.

* ``calculate_grpo_loss`` with the correction on and a truncation coefficient is the core's algorithm 2, token
  level, truncate mode (upper bound = the coefficient), with the k3 reference KL and an entropy term: same loss and
  same gradient on the same batch.
* The stand-in's layouts and reduction: packed bins and unpacked rows give the same token sums; the loss the
  schedule backpropagates is a per-micro-batch token mean, while ``train_step`` logs a token mean over the step.
* Its three defects reproduce here (measured values in docs/megatron_rl.md): pi_old rounded to bf16 under
  ``--bf16``, no temperature in the training log-probs, an infinite loss for a 100-nat log-ratio without the
  coefficient.
"""

from __future__ import annotations

import torch
from _megatron_lm import train_step_loss_reduced
from _megatron_rl import (
    RLArgs,
    forward_step,
    grpo_loss,
    is_weights,
    pack_bins,
    scheduled_loss,
    stored_old_logprobs,
    token_logprobs,
)

from slime_tis import TISConfig
from slime_tis.core import padded_to_packed, policy_loss

EPS32 = torch.finfo(torch.float32).eps


def _batch(seed: int, rows: int = 4, cols: int = 12):
    """Unpacked Megatron-LM RL rows: ``loss_mask [B, S]`` (prompt 0, response 1 with interior zeros, padding 0),
    log-probs ``[B, S-1]``, advantages ``[B]``."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 4, (rows,), generator=g)
    length = torch.randint(6, cols + 1, (rows,), generator=g)
    col = torch.arange(cols)[None, :]
    mask = ((col >= prompt[:, None]) & (col < length[:, None])).float()
    mask *= (torch.rand(rows, cols, generator=g) > 0.15).float()
    inf = -torch.rand(rows, cols - 1, generator=g) * 4
    old = inf + 0.4 * torch.randn(rows, cols - 1, generator=g)
    theta = old + 0.3 * torch.randn(rows, cols - 1, generator=g)
    ref = old + 0.2 * torch.randn(rows, cols - 1, generator=g)
    return dict(mask=mask, inf=inf, old=old, theta=theta, ref=ref, adv=torch.randn(rows, generator=g),
                length=length)


def _args(**kw) -> RLArgs:
    base = dict(grpo_clamp_eps_lower=0.2, grpo_clamp_eps_upper=0.28, grpo_kl_beta=0.05, grpo_entropy_term_weight=0.01,
                rl_inference_logprobs_is_correction=True, rl_importance_sampling_truncation_coef=1.5)
    return RLArgs(**{**base, **kw})


def test_calculate_grpo_loss_is_algorithm_2_token_truncate_with_kl_and_entropy() -> None:
    """One micro-batch: the schedule's loss ``sum(loss * mask) / n_tokens`` equals the core's ``policy_loss``
    (token-mean over the same tokens) and so do the gradients with respect to the current log-probs.

    Tolerance: both run in float32 with the same formulas in a different order (``max(-x, -y)`` vs ``-min(x, y)``
    is exact; ``exp(r) - r - 1`` vs ``exp(-d) - 1 + d`` and the products differ by a few ulp per token), so the
    loss may differ by ``8 eps * sum |per-token loss| / n`` and each gradient entry by ``8 eps * max |grad|``."""
    args = _args()
    for seed in range(3):
        b = _batch(seed)
        theta = b["theta"].clone().requires_grad_(True)
        per_token, *_ = grpo_loss(theta, b["old"], b["ref"], b["adv"], args, b["inf"])
        mask = b["mask"][:, 1:]
        total, n, _ = forward_step_loss = _loss_of(per_token, mask)
        ours = scheduled_loss(total, n, 1, args)
        ours.backward()
        g_mlm = theta.grad.clone()

        cfg = TISConfig(use_tis=True, mode="truncate", level="token", upper=1.5, eps_clip=0.2, eps_clip_high=0.28,
                        kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01)
        theta2 = b["theta"].clone().requires_grad_(True)
        pk = {k: padded_to_packed(v, mask)[0] for k, v in (("old", b["old"]), ("inf", b["inf"]), ("ref", b["ref"]))}
        lp, cu = padded_to_packed(theta2, mask)
        adv = padded_to_packed(b["adv"][:, None].expand_as(mask), mask)[0]
        out = policy_loss(cfg, lp, pk["old"], pk["inf"], adv, padded_to_packed(mask, mask)[0], cu,
                          lp_ref=pk["ref"], entropy=-torch.exp(lp) * lp)
        out.loss.backward()

        tol = 8 * EPS32 * float((per_token.detach().abs() * mask).sum() / n)
        core_loss, mlm_loss = float(out.loss.detach()), float(ours.detach())
        assert abs(core_loss - mlm_loss) <= tol, (core_loss, mlm_loss, tol)
        torch.testing.assert_close(theta2.grad, g_mlm, rtol=0, atol=8 * EPS32 * float(g_mlm.abs().max()))
        assert forward_step_loss[1] == int(mask.sum())


def _loss_of(per_token, mask):
    from _megatron_rl import loss_func
    z = torch.zeros_like(per_token)
    return loss_func(mask, z, z, z, z, z, per_token)


def _bigram_model(vocab: int, seed: int):
    weight = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
    return weight, lambda tokens, pos: token_logprobs(weight[tokens], tokens)


def test_packed_bins_and_unpacked_rows_give_the_same_token_sums() -> None:
    """``forward_step`` on packed bins and on unpacked rows of the same sequences (a bigram model: the
    log-probs do not depend on the layout): with ``--calculate-per-token-loss`` the summed loss, the gradient and
    every logged ``rl/*`` sum agree; the default reduction (a mean per micro-batch) depends on the layout."""
    b = _batch(7, rows=5, cols=10)
    vocab, rows, cols = 11, 5, 10
    tokens = torch.randint(1, vocab, (rows, cols), generator=torch.Generator().manual_seed(3))
    lengths = [int(x) for x in b["length"]]
    for r, n in enumerate(lengths):
        tokens[r, n:] = 0
    per_seq = {k: b[k] for k in ("old", "ref", "inf")}

    results = {}
    for packed in (False, True):
        args = _args(rl_use_sequence_packing=packed, calculate_per_token_loss=True)
        weight, logprobs_of = _bigram_model(vocab, 0)
        if packed:
            items = []
            for bin_ in pack_bins(tokens, lengths, b["mask"].bool(), bin_size=16, max_per_bin=3):
                grids = {k: torch.zeros(1, 15) for k in per_seq}
                for i, start in zip(bin_.seq_indices, bin_.seq_starts):
                    for k in per_seq:
                        grids[k][0, start:start + lengths[i] - 1] = per_seq[k][i, :lengths[i] - 1]
                items.append((bin_, b["adv"][bin_.seq_indices], grids["old"], grids["ref"], grids["inf"]))
        else:
            pos = torch.arange(cols).expand(rows, cols)
            items = [(tokens, b["adv"], b["old"], b["mask"], pos, b["ref"], b["inf"])]
        total, logged = torch.zeros(()), []
        for item in items:
            out, lf = forward_step(item, logprobs_of, args)
            s, n, d = lf(out)
            total = total + scheduled_loss(s, n, len(items), args)
            logged.append(d)
        total.backward()
        sums = {k: torch.stack([d[k] for d in logged]).sum(0) for k in logged[0]}
        results[packed] = (total.detach(), weight.grad, sums, len(items))
    (t0, g0, s0, m0), (t1, g1, s1, m1) = results[False], results[True]
    assert m1 > 1 and m0 == 1
    torch.testing.assert_close(t1, t0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-6)
    for k in s0:
        torch.testing.assert_close(s1[k], s0[k], rtol=1e-6, atol=1e-6)


def test_default_reduction_is_a_token_mean_per_micro_batch_while_the_log_is_the_step_token_mean() -> None:
    """Two micro-batches with 3 and 17 tokens: the schedule backpropagates ``(s1/3 + s2/17) / 2``;
    ``train_step`` logs ``(s1 + s2) / 20`` under ``lm loss``; with ``--calculate-per-token-loss`` both are the
    step token mean (the gradient divided by the token total)."""
    sums, counts = [torch.tensor(1.2), torch.tensor(-3.4)], [torch.tensor(3), torch.tensor(17)]
    dicts = [{"lm loss": torch.stack([s, c.float()])} for s, c in zip(sums, counts)]
    logged = train_step_loss_reduced(dicts)["lm loss"]
    default = sum(scheduled_loss(s, c, 2, RLArgs()) for s, c in zip(sums, counts))
    per_token = sum(scheduled_loss(s, c, 2, RLArgs(calculate_per_token_loss=True)) for s, c in zip(sums, counts))
    assert torch.isclose(logged, torch.tensor(-2.2 / 20))
    assert torch.isclose(default, torch.tensor((1.2 / 3 - 3.4 / 17) / 2))
    assert torch.isclose(per_token / sum(counts), logged)
    assert not torch.isclose(default, logged)


def test_bf16_pi_old_gives_weights_below_one_for_equal_policies() -> None:
    """pi_old = pi_inference: under ``--bf16`` the stored pi_old is rounded (8 significant bits), so the weight
    is ``exp(bf16(lp) - lp)``; float32 storage gives exactly 1, as does the core with float32 inputs."""
    lp = torch.tensor([-0.3, -2.7, -5.3, -9.1])
    w_bf16 = is_weights(stored_old_logprobs(lp, RLArgs(bf16=True)), lp, None)
    torch.testing.assert_close(w_bf16, torch.tensor([0.9992, 0.9969, 0.9876, 0.9753]), rtol=0, atol=1e-4)
    assert torch.equal(is_weights(stored_old_logprobs(lp, RLArgs(bf16=False)), lp, None), torch.ones(4))
    core = policy_loss(TISConfig(use_tis=True), lp.clone(), lp.clone(), lp.clone(), torch.ones(4), torch.ones(4),
                       torch.tensor([0, 4], dtype=torch.int32))
    assert torch.equal(core.weights, torch.ones(4))
    lp9 = torch.full((3,), -9.0)
    assert torch.equal(is_weights(lp9, lp9, None), torch.ones(3))


def test_training_log_probs_ignore_the_sampling_temperature() -> None:
    """``get_logprobs`` returns ``log_softmax(logits)`` whatever ``--rl-default-temperature`` the engine sampled
    with; the sampling distribution at T = 0.7 is ``log_softmax(logits / 0.7)``."""
    g = torch.Generator().manual_seed(0)
    logits = 2.0 * torch.randn(2, 9, 32, generator=g)
    tokens = torch.randint(0, 32, (2, 9), generator=g)
    got = token_logprobs(logits, tokens)
    plain = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    sampled = torch.log_softmax(logits[:, :-1] / 0.7, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(got, plain)
    assert (got - sampled).abs().mean() > 0.3


def test_a_100_nat_log_ratio_without_the_coefficient_gives_an_infinite_loss() -> None:
    """``exp(100)`` overflows float32: the weight is ``inf`` and the loss ``-inf`` (A > 0) or NaN (A = 0); with
    the coefficient, and in the core (truncate always has an upper bound), the loss is finite."""
    old, inf = torch.full((1, 3), -1.0), torch.full((1, 3), -101.0)
    ref = old.clone()
    no_coef = _args(rl_importance_sampling_truncation_coef=None)
    loss, *_ = grpo_loss(old.clone(), old, ref, torch.tensor([1.0]), no_coef, inf)
    assert torch.isneginf(loss).all()
    loss0, *_ = grpo_loss(old.clone(), old, ref, torch.tensor([0.0]), no_coef, inf)
    assert torch.isnan(loss0).all()
    capped, *_ = grpo_loss(old.clone(), old, ref, torch.tensor([1.0]), _args(), inf)
    assert torch.isfinite(capped).all()
    core = policy_loss(TISConfig(use_tis=True), old[0].clone(), old[0], inf[0], torch.ones(3), torch.ones(3),
                       torch.tensor([0, 3], dtype=torch.int32))
    assert torch.isfinite(core.loss)
