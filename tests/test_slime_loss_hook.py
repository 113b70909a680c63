"""``slime_tis.slime.reinforce_is_loss`` (algorithm 3) called as slime calls a custom loss (one process).

Oracle: per sample, the response logits are read at the rows slime's packing assigns (prompt + response
back to back, the logit at position g predicts token g + 1), log-softmax of logits / T, then one core
``policy_loss`` (algorithm 3) on the whole packed batch with slime's per-sample-mean aggregation.
"""

from __future__ import annotations

import pytest
import torch
from _slime_oracle import args_ns, make_batch, rollout_mean, slime_sum_of_sample_mean

from slime_tis import TISConfig, compute_tis, policy_loss
from slime_tis.slime import postprocess_rollout_data, reinforce_is_loss
from slime_tis.slime.state import STATE

VOCAB = 11
TEMP = 0.7


def packed_logits(b, seed=0, pad=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, sum(b.total_lengths) + pad, VOCAB, generator=g).requires_grad_(True)


def oracle_log_probs(b, logits):
    rows, targets, off = [], [], 0
    for t, r, toks in zip(b.total_lengths, b.response_lengths, b.tokens):
        p = t - r
        rows += [off + p - 1 + j for j in range(r)]
        targets += toks[p:].tolist()
        off += t
    lp_all = torch.log_softmax(logits[0] / TEMP, dim=-1)
    return lp_all[torch.tensor(rows)].gather(-1, torch.tensor(targets)[:, None]).squeeze(-1), lp_all[torch.tensor(rows)]


def slime_batch(b):
    return {"unconcat_tokens": b.tokens, "total_lengths": b.total_lengths, "response_lengths": b.response_lengths,
            "loss_masks": b.masks, "advantages": b.advantages, "rollout_log_probs": b.rollout}


def register(args, b):
    """slime's rollout-data hook call before training (registers each sample's rollout)."""
    args.loss_type, args.custom_loss_function_path = "custom_loss", "slime_tis.slime.reinforce_is_loss"
    postprocess_rollout_data(args, 0, b.rollout_data())


def reducer_for(b):
    return lambda x: slime_sum_of_sample_mean(x, b, b.masks, 0, 1)


CONFIGS = {
    "seq_trunc": dict(tis_mode="truncate", tis_level="sequence", tis_upper_bound=1.5),
    "geo_mask_veto": dict(tis_mode="mask", tis_level="geometric", tis_upper_bound=1.3, tis_veto_threshold=1e-3),
    "tok_clip_bn": dict(tis_mode="clip", tis_level="token", tis_upper_bound=1.4, tis_batch_normalize=True),
    "tok_mask_drop": dict(tis_mode="mask", tis_level="token", tis_upper_bound=1.3,
                          tis_rejected_denominator="drop"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loss_and_gradient_match_core_oracle(name):
    b = make_batch(5, vocab=VOCAB)
    args = args_ns(use_rollout_logprobs=True, rollout_temperature=TEMP, **CONFIGS[name])
    register(args, b)
    logits = packed_logits(b)
    loss, metrics = reinforce_is_loss(args, slime_batch(b), logits, reducer_for(b))
    loss.backward()
    got_grad = logits.grad.clone()

    ref_logits = logits.detach().clone().requires_grad_(True)
    lp, _ = oracle_log_probs(b, ref_logits)
    fields = dict(mode=CONFIGS[name]["tis_mode"], level=CONFIGS[name]["tis_level"],
                  upper=CONFIGS[name]["tis_upper_bound"], veto_threshold=CONFIGS[name].get("tis_veto_threshold"),
                  batch_normalize=CONFIGS[name].get("tis_batch_normalize", False),
                  rejected_denominator=CONFIGS[name].get("tis_rejected_denominator", "keep"))
    cfg = TISConfig(use_rollout_log_probs=True, use_tis=True, loss_agg="seq-mean-token-mean", **fields)
    out = policy_loss(cfg, lp, None, b.packed("rollout"), b.packed("advantages"), b.packed("masks"),
                      b.cu_seqlens(), denominator=1.0)
    out.loss.backward()
    assert float(loss) == pytest.approx(float(out.loss), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(got_grad, ref_logits.grad, rtol=1e-5, atol=1e-7)
    assert torch.isfinite(got_grad).all()
    assert got_grad[0, -3:].abs().sum() == 0  # padding rows get no gradient
    assert float(metrics["pg_loss"]) == pytest.approx(float(out.loss), rel=1e-5, abs=1e-7)
    # ppo_kl reported as slime does: per-sample means of lp_rollout - lp_theta over the original masks
    valid = out.tis.ratios.token_ok
    kl_tok = torch.where(valid, b.packed("rollout") - lp.detach(), torch.zeros(()))
    assert float(metrics["ppo_kl"]) == pytest.approx(float(reducer_for(b)(kl_tok)), rel=1e-5, abs=1e-7)


def test_hand_computed_single_token():
    """One sample, one response token: loss = -w A lp with w = min(exp(lp - lp_rollout), 1.5)."""
    from _slime_oracle import SlimeBatch

    tokens = [torch.tensor([1, 2])]
    b = SlimeBatch([1], [1], [torch.zeros(1)], [torch.tensor([-1.5])], [torch.ones(1)], [torch.zeros(1)],
                   [torch.tensor([2.0])], tokens)
    logits = torch.zeros(1, 2, 4)
    logits[0, 0, 2] = 1.0  # row 0 predicts token 2: lp = 1 - log(e + 3)
    logits.requires_grad_(True)
    args = args_ns(use_rollout_logprobs=True, tis_mode="truncate", tis_level="token", tis_upper_bound=1.5)
    loss, _ = reinforce_is_loss(args, slime_batch(b), logits, reducer_for(b))
    lp = 1.0 - torch.log(torch.tensor(torch.e + 3.0))
    w = min(float(torch.exp(lp + 1.5)), 1.5)
    assert float(loss) == pytest.approx(-w * 2.0 * float(lp), rel=1e-6)
    loss.backward()
    p = torch.softmax(logits.detach()[0, 0], -1)
    expect = -w * 2.0 * (torch.nn.functional.one_hot(torch.tensor(2), 4).float() - p)
    torch.testing.assert_close(logits.grad[0, 0], expect)


def test_entropy_and_kl_terms():
    b = make_batch(7, vocab=VOCAB)
    ref_lp = [t - 0.1 for t in b.train]
    batch = slime_batch(b) | {"ref_log_probs": ref_lp}
    args = args_ns(use_rollout_logprobs=True, rollout_temperature=TEMP, tis_mode="truncate", tis_level="token",
                   entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3")
    logits = packed_logits(b, seed=1)
    loss, metrics = reinforce_is_loss(args, batch, logits, reducer_for(b))

    lp, lp_rows = oracle_log_probs(b, logits.detach())
    cfg = TISConfig(use_rollout_log_probs=True, use_tis=True, loss_agg="seq-mean-token-mean")
    out = policy_loss(cfg, lp, None, b.packed("rollout"), b.packed("advantages"), b.packed("masks"),
                      b.cu_seqlens(), denominator=1.0)
    keep = out.keep_mask
    ent = -(lp_rows.exp() * lp_rows).sum(-1)
    d = lp - torch.cat(ref_lp)
    k3 = torch.exp(-d) - 1 + d
    zero = torch.zeros(())
    ent_loss = reducer_for(b)(torch.where(keep, ent, zero))
    kl_loss = reducer_for(b)(torch.where(keep, k3, zero))
    assert float(metrics["entropy_loss"]) == pytest.approx(float(ent_loss), rel=1e-5)
    assert float(metrics["kl_loss"]) == pytest.approx(float(kl_loss), rel=1e-5)
    assert float(loss) == pytest.approx(float(out.loss - 0.01 * ent_loss + 0.1 * kl_loss), rel=1e-5)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl", "unbiased_k3"])
def test_nonfinite_reference_log_probs_reject_their_sequences(kind):
    """A NaN or -inf reference log-prob (a failed reference forward) rejects its sequence, as a non-finite advantage
    does: loss, KL term, rejection metric and gradient equal those of the clean reference log-probs with the
    advantages non-finite in the same samples, and no NaN reaches the gradient (k2, k3 and low_var_kl read the
    reference log-prob in their derivative, so a token masked out after the estimator would still pass it on)."""
    b = make_batch(7, vocab=VOCAB)
    ref_clean = [t - 0.1 for t in b.train]
    ref_bad = [r.clone() for r in ref_clean]
    ref_bad[1][ref_bad[1].shape[0] // 2] = float("nan")
    ref_bad[3][0] = float("-inf")
    adv_bad = [a.clone() for a in b.advantages]
    adv_bad[1][0] = float("nan")
    adv_bad[3][-1] = float("inf")
    unbiased = kind.startswith("unbiased_")
    args = args_ns(use_rollout_logprobs=True, rollout_temperature=TEMP, tis_mode="truncate", tis_level="token",
                   use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type=kind.removeprefix("unbiased_"),
                   use_unbiased_kl=unbiased)
    runs = []
    for ref, adv in ((ref_bad, b.advantages), (ref_clean, adv_bad)):
        logits = packed_logits(b, seed=1)
        batch = slime_batch(b) | {"ref_log_probs": ref, "advantages": adv}
        if unbiased:
            batch["log_probs"] = b.train
        loss, metrics = reinforce_is_loss(args, batch, logits, reducer_for(b))
        loss.backward()
        runs.append((loss.detach(), metrics, logits.grad))
    (loss, metrics, grad), (loss_ref, metrics_ref, grad_ref) = runs
    assert torch.isfinite(grad).all() and torch.isfinite(loss)
    torch.testing.assert_close(loss, loss_ref)
    torch.testing.assert_close(grad, grad_ref)
    for name in ("kl_loss", "pg_loss", "tis/nonfinite_seq_fraction"):
        torch.testing.assert_close(metrics[name], metrics_ref[name])
    assert float(metrics["tis/nonfinite_seq_fraction"]) >= 2.0  # samples 1 and 3, each wholly rejected


def test_per_token_loss_mode_returns_the_token_sum():
    b = make_batch(8, vocab=VOCAB)
    args = args_ns(use_rollout_logprobs=True, calculate_per_token_loss=True, tis_mode="truncate",
                   rollout_temperature=TEMP)
    logits = packed_logits(b, seed=2)
    loss, _ = reinforce_is_loss(args, slime_batch(b), logits, lambda x: x.sum())
    lp, _ = oracle_log_probs(b, logits.detach())
    cfg = TISConfig(use_rollout_log_probs=True, use_tis=True, loss_agg="token-mean")
    out = policy_loss(cfg, lp, None, b.packed("rollout"), b.packed("advantages"), b.packed("masks"),
                      b.cu_seqlens(), denominator=1.0)
    assert float(loss) == pytest.approx(float(out.loss), rel=1e-5)


def test_errors_and_recompute_warning():
    b = make_batch(9, vocab=VOCAB)
    logits = packed_logits(b)
    with pytest.warns(UserWarning, match="add --use-rollout-logprobs"):
        reinforce_is_loss(args_ns(tis_mode="truncate"), slime_batch(b), logits, reducer_for(b))
    with pytest.raises(ValueError, match=r"logits must be slime's packed \[1, T, V/TP\]"):
        reinforce_is_loss(args_ns(use_rollout_logprobs=True), slime_batch(b), logits[0], reducer_for(b))
    with pytest.raises(ValueError, match="top-p replay is not supported"):
        reinforce_is_loss(args_ns(use_rollout_logprobs=True, rollout_top_p=0.9), slime_batch(b), logits,
                          reducer_for(b))
    with pytest.raises(ValueError, match="'drop' cannot be honoured with --calculate-per-token-loss"):
        reinforce_is_loss(args_ns(use_rollout_logprobs=True, calculate_per_token_loss=True,
                                  tis_rejected_denominator="drop"), slime_batch(b), logits, reducer_for(b))
    with pytest.raises(ValueError, match="--kl-loss-type = 'k9'"):
        reinforce_is_loss(args_ns(use_rollout_logprobs=True, use_kl_loss=True, kl_loss_type="k9"),
                          slime_batch(b) | {"ref_log_probs": b.train}, logits, reducer_for(b))


def test_rollout_group_denominators_follow_slime():
    """slime's ``rollout_mask_sums`` may give sibling samples of one rollout a shared denominator D_i."""
    from slime_tis import compute_tis

    b = make_batch(10, vocab=VOCAB)
    n = [float(m.sum()) for m in b.masks]
    denoms = torch.tensor([n[0] + n[1], n[0] + n[1], n[2], n[3] + n[4], n[3] + n[4], n[5]])
    args = args_ns(use_rollout_logprobs=True, rollout_temperature=TEMP, tis_mode="truncate", tis_level="geometric",
                   tis_upper_bound=1.2)
    logits = packed_logits(b, seed=3)
    loss, _ = reinforce_is_loss(args, slime_batch(b) | {"rollout_mask_sums": denoms}, logits, reducer_for(b))
    loss.backward()

    ref_logits = logits.detach().clone().requires_grad_(True)
    lp, _ = oracle_log_probs(b, ref_logits)
    cfg = TISConfig(use_rollout_log_probs=True, use_tis=True, mode="truncate", level="geometric", upper=1.2)
    tis = compute_tis(cfg, lp.detach(), b.packed("rollout"), b.packed("masks"), b.cu_seqlens(),
                      extra_finite=(b.packed("advantages"),))
    per_tok = torch.where(tis.keep_mask, -tis.weights * b.packed("advantages") * lp, torch.zeros(()))
    expect = sum(x.sum() / d.clamp(min=1) for x, d in zip(per_tok.split(b.response_lengths), denoms))
    expect.backward()
    assert float(loss) == pytest.approx(float(expect), rel=1e-5)
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-7)


AGENTIC = {
    "tok_mask": dict(tis_mode="mask", tis_level="token", tis_upper_bound=1.3),
    "geo_mask_veto": dict(tis_mode="mask", tis_level="geometric", tis_upper_bound=1.3, tis_veto_threshold=1e-3),
    "seq_trunc_seq_rs": dict(tis_mode="truncate", tis_level="sequence", tis_upper_bound=1.5, tis_rs_level="sequence",
                             tis_rs_upper_bound=4.0),
}


@pytest.mark.parametrize("name", sorted(AGENTIC))
def test_keep_and_drop_are_per_rollout_means(name):
    """Loss and gradient equal the rollout mean of -w A lp over valid tokens of each rollout (all its samples,
    slime's ``rollout_mask_sums`` in the batch: keep); with one sample per rollout over valid (keep) / kept (drop)
    tokens."""
    for rollout_ids in ([0, 0, 1, 2, 2, 2], None):
        b = make_batch(11, vocab=VOCAB)
        b.rollout_ids = rollout_ids
        deltas = [r - t for r, t in zip(b.rollout, b.train)]
        for denominator in ("keep",) if rollout_ids else ("keep", "drop"):
            args = args_ns(use_rollout_logprobs=True, rollout_temperature=TEMP, tis_rejected_denominator=denominator,
                           **AGENTIC[name])
            logits = packed_logits(b, seed=4)
            lp0, _ = oracle_log_probs(b, logits.detach())  # rollout log-probs near the policy (make_batch's
            b.rollout = [x + d for x, d in zip(lp0.split(b.response_lengths), deltas)]  # offsets, NaN, traps)
            register(args, b)
            batch = slime_batch(b) | {"rollout_mask_sums": b.rollout_mask_sums()}
            loss, metrics = reinforce_is_loss(args, batch, logits, reducer_for(b))
            loss.backward()

            ref_logits = logits.detach().clone().requires_grad_(True)
            lp, _ = oracle_log_probs(b, ref_logits)
            kw = AGENTIC[name]
            cfg = TISConfig(use_rollout_log_probs=True, use_tis=True, mode=kw["tis_mode"], level=kw["tis_level"],
                            upper=kw["tis_upper_bound"], veto_threshold=kw.get("tis_veto_threshold"),
                            rs_level=kw.get("tis_rs_level"), rs_upper=kw.get("tis_rs_upper_bound"))
            tis = compute_tis(cfg, lp.detach(), b.packed("rollout"), b.packed("masks"), b.cu_seqlens(),
                              extra_finite=(b.packed("advantages"),))
            per_tok = -tis.weights * b.packed("advantages") * lp
            expect = rollout_mean(per_tok, tis.keep_mask, b, denominator)
            expect.backward()
            assert float(loss) == pytest.approx(float(expect), rel=1e-5, abs=1e-7), (rollout_ids, denominator)
            torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-7)
            assert float(metrics["pg_loss"]) == pytest.approx(float(expect), rel=1e-5, abs=1e-7)
        kept = [float(k.sum()) for k in tis.keep_mask.split(b.response_lengths)]
        assert any(0 < k < float(m.sum()) for k, m in zip(kept, b.masks)) or len(set(kept)) > 1


def test_drop_counts_reject_what_the_kl_terms_reference_rejects():
    """``drop`` counts each rollout's kept tokens with the loss's correction; with slime's KL term in the loss it
    checks the reference log-probs, so a non-finite one gives the loss and gradient of the clean reference with
    non-finite advantages in its samples."""
    b = make_batch(11, vocab=VOCAB)
    ref_clean = [t - 0.1 for t in b.train]
    ref_bad = [r.clone() for r in ref_clean]
    ref_bad[1][0] = float("nan")
    ref_bad[4][-1] = float("-inf")
    adv_bad = [a.clone() for a in b.advantages]
    adv_bad[1][0] = float("nan")
    adv_bad[4][-1] = float("nan")
    lp0, _ = oracle_log_probs(b, packed_logits(b, seed=4).detach())
    deltas = [r - t for r, t in zip(b.rollout, b.train)]  # rollout log-probs near the policy: most tokens kept
    b.rollout = [x + d for x, d in zip(lp0.split(b.response_lengths), deltas)]
    runs = []
    for ref, adv in ((ref_bad, b.advantages), (ref_clean, adv_bad)):
        args = args_ns(use_rollout_logprobs=True, rollout_temperature=TEMP, tis_rejected_denominator="drop",
                       tis_mode="mask", tis_level="token", tis_upper_bound=1.3, use_kl_loss=True, kl_loss_coef=0.1,
                       kl_loss_type="low_var_kl", loss_type="custom_loss",
                       custom_loss_function_path="slime_tis.slime.reinforce_is_loss")
        logits = packed_logits(b, seed=4)
        postprocess_rollout_data(args, 0, b.rollout_data() | {"ref_log_probs": ref, "advantages": adv})
        batch = slime_batch(b) | {"rollout_mask_sums": b.rollout_mask_sums(), "ref_log_probs": ref,
                                  "advantages": adv}
        loss, metrics = reinforce_is_loss(args, batch, logits, reducer_for(b))
        loss.backward()
        runs.append((loss.detach(), logits.grad, metrics["kl_loss"]))
    (loss, grad, kl), (loss_ref, grad_ref, kl_ref) = runs
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(loss, loss_ref)
    torch.testing.assert_close(grad, grad_ref)
    torch.testing.assert_close(kl, kl_ref)


def test_drop_needs_the_rollout_data_hook():
    b = make_batch(12, vocab=VOCAB)
    STATE.clear()
    args = args_ns(use_rollout_logprobs=True, tis_mode="mask", tis_rejected_denominator="drop")
    with pytest.raises(ValueError, match="--rollout-data-postprocess-path slime_tis.slime.postprocess_rollout_data"):
        reinforce_is_loss(args, slime_batch(b), packed_logits(b), reducer_for(b))


def test_on_policy_surrogate_matches_the_core_and_anchored_ones_are_refused():
    """The custom loss (algorithm 3) expresses ``reinforce`` and ``on_policy``: with ``tis_loss_mode: on_policy``
    the value is the core's ``-w A`` mean and the gradient REINFORCE's; anchored surrogates and the ``tis_`` KL /
    entropy keys (slime's own flags carry those terms) are refused in one line."""
    b = make_batch(5, vocab=VOCAB)
    grads = {}
    for mode in ("on_policy", "reinforce"):
        args = args_ns(use_rollout_logprobs=True, rollout_temperature=TEMP, tis_mode="truncate", tis_level="token",
                       tis_loss_mode=mode)
        register(args, b)
        logits = packed_logits(b)
        loss, _ = reinforce_is_loss(args, slime_batch(b), logits, reducer_for(b))
        loss.backward()
        grads[mode] = logits.grad
        if mode == "on_policy":
            lp, _ = oracle_log_probs(b, logits.detach())
            cfg = TISConfig(use_rollout_log_probs=True, use_tis=True, loss_agg="seq-mean-token-mean",
                            loss_mode="on_policy")
            out = policy_loss(cfg, lp, None, b.packed("rollout"), b.packed("advantages"), b.packed("masks"),
                              b.cu_seqlens(), denominator=1.0)
            assert float(loss) == pytest.approx(float(out.loss), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grads["on_policy"], grads["reinforce"], rtol=1e-5, atol=1e-8)
    for key, value, match in (("tis_loss_mode", "cispo", "weight would count twice"),
                              ("tis_kl_coef", 0.1, "--use-kl-loss"), ("tis_entropy_coef", 0.1, "--entropy-coef")):
        args = args_ns(use_rollout_logprobs=True, rollout_temperature=TEMP, **{key: value})
        with pytest.raises(ValueError, match=match) as err:
            reinforce_is_loss(args, slime_batch(b), packed_logits(b), reducer_for(b))
        assert "\n" not in str(err.value)
