"""slime's ``--use-opsm``, ``--use-unbiased-kl`` and ``--custom-pg-loss-reducer-function-path`` inside the custom
loss ``slime_tis.slime.reinforce_is_loss`` (one process), against float64 references built here.

``compute_opsm_mask`` stands in for slime's (``slime/utils/ppo_utils.py`` at THUDM/slime 624b824: token ``t`` of
sample ``i`` zeroed when ``A_t < 0`` and the mean over ``i``'s valid tokens of ``old - theta`` exceeds
``--opsm-delta``) and for the per-sequence variant of an open slime change (the whole sequence zeroed on its mean
advantage, whatever the tokens' signs); the custom loss must take whichever is installed.

Tolerances: the loss runs in float32 (log-softmax of float32 logits, sums of < 50 terms of size O(1)), the
references in float64: relative 1e-5 covers the float32 rounding of those sums (~50 * 6e-8) with margin.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from _slime_oracle import args_ns, make_batch
from test_slime_loss_hook import TEMP, VOCAB, oracle_log_probs, packed_logits, reducer_for, register, slime_batch

from slime_tis.slime import STATE, reinforce_is_loss

F64 = torch.float64
DELTA = 0.05


def opsm_624b824(args, full_log_probs, full_old_log_probs, advantages, loss_masks):
    out, frac = [], torch.zeros(())
    for th, old, a, m in zip(full_log_probs, full_old_log_probs, advantages, loss_masks):
        seq_kl = ((old - th) * m).sum() / m.sum().clamp(min=1)
        z = ((a < 0) & (seq_kl > args.opsm_delta)).float()
        frac = frac + z.sum() / m.sum().clamp(min=1)
        out.append(1 - z)
    return torch.cat(out), frac


def opsm_per_sequence(args, full_log_probs, full_old_log_probs, full_advantages, loss_masks, local_advantages=None):
    out, frac = [], torch.zeros(())
    for th, old, a, m, loc in zip(full_log_probs, full_old_log_probs, full_advantages, loss_masks, local_advantages):
        n = m.sum().clamp(min=1)
        off = ((old - th) * m).sum() / n > args.opsm_delta and (a * m).sum() / n < 0
        frac = frac + float(off)
        out.append(torch.full_like(loc, 0.0 if off else 1.0))
    return torch.cat(out), frac


@pytest.fixture
def slime_opsm(monkeypatch):
    """Install a ``slime.utils.ppo_utils`` with the given ``compute_opsm_mask``."""
    def install(fn):
        for name in ("slime", "slime.utils"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        mod = types.ModuleType("slime.utils.ppo_utils")
        mod.compute_opsm_mask = fn
        monkeypatch.setitem(sys.modules, "slime.utils.ppo_utils", mod)
    return install


def mixed_sign_batch(seed):
    """make_batch with per-token advantages of both signs in every sample, and an anchor far from theta in some."""
    b = make_batch(seed, vocab=VOCAB)
    g = torch.Generator().manual_seed(seed + 100)
    b.advantages = [torch.randn(r, generator=g) for r in b.response_lengths]
    return b


def reference(b, logits, *, opsm=None, upper=1.5, on_policy=False, reduce=None):
    """float64: lp, w = min(exp(lp - lp_rollout), upper) (truncate, token level), rejected = non-finite sample,
    per-token loss -w A m_opsm lp (``on_policy``: -w A m_opsm exp(lp - sg(lp)), the same gradient), slime's
    per-sample mean (or ``reduce``)."""
    lp, rows = oracle_log_probs(b, logits.to(F64))
    ro = b.packed("rollout").to(F64)
    adv = b.packed("advantages").to(F64)
    valid = b.packed("masks") != 0
    sample = torch.repeat_interleave(torch.arange(len(b.masks)), torch.tensor(b.response_lengths))
    finite = torch.ones(len(b.masks), dtype=torch.bool)
    bad = valid & ~(torch.isfinite(ro) & torch.isfinite(lp))
    finite[sample[bad]] = False
    keep = valid & finite[sample]
    zero = torch.zeros((), dtype=F64)
    w = torch.where(keep, torch.exp(torch.where(keep, lp - ro, zero)).clamp(max=upper), zero).detach()
    m = opsm if opsm is not None else torch.ones_like(adv)
    lp_k = torch.where(keep, lp, zero)
    tok = torch.where(keep, -w * adv * m * (torch.exp(lp_k - lp_k.detach()) if on_policy else lp_k), zero)
    if reduce is not None:
        return reduce(tok, keep, sample), lp, keep
    n = torch.zeros(len(b.masks), dtype=F64).index_add_(0, sample, valid.to(F64)).clamp(min=1)
    return (tok / n[sample]).sum(), lp, keep


def run(b, args, seed=3):
    register(args, b)
    logits = packed_logits(b, seed=seed)
    loss, metrics = reinforce_is_loss(args, slime_batch(b), logits, reducer_for(b))
    loss.backward()
    return logits, loss, metrics


def check(logits, loss, ref_fn):
    ref_logits = logits.detach().to(F64).requires_grad_(True)
    ref = ref_fn(ref_logits)
    ref.backward()
    assert float(loss) == pytest.approx(float(ref), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(logits.grad.to(F64), ref_logits.grad, rtol=1e-5, atol=1e-7)


ARGS = dict(use_rollout_logprobs=True, rollout_temperature=TEMP, tis_mode="truncate", tis_level="token",
            tis_upper_bound=1.5)


@pytest.mark.parametrize("variant", ["624b824", "per_sequence"])
def test_opsm_takes_slime_own_mask(slime_opsm, variant):
    """The mask is the installed slime's: per token on A < 0, or whole sequences of mixed-sign advantages."""
    fn = opsm_624b824 if variant == "624b824" else opsm_per_sequence
    slime_opsm(fn)
    b = mixed_sign_batch(11)
    args = args_ns(use_opsm=True, opsm_delta=DELTA, **ARGS)
    logits, loss, metrics = run(b, args)

    lp, _ = oracle_log_probs(b, logits.detach())
    th_full = list(lp.split(b.response_lengths))
    ro = list(b.packed("rollout").split(b.response_lengths))  # the anchor: --use-rollout-logprobs
    if variant == "624b824":
        mask, frac = fn(args, th_full, ro, b.advantages, b.masks)
    else:
        mask, frac = fn(args, th_full, ro, b.advantages, b.masks, local_advantages=b.advantages)
    zeroed = (mask == 0) & (b.packed("masks") != 0)
    assert zeroed.any() and (mask == 1).any()  # the case distinguishes OPSM from none
    if variant == "per_sequence":  # tokens of positive advantage zeroed too: no A < 0 rule can find them
        assert (zeroed & (b.packed("advantages") > 0)).any()
    check(logits, loss, lambda x: reference(b, x, opsm=mask.to(F64))[0])
    assert float(metrics["opsm_clipfrac"]) == pytest.approx(float(frac), rel=1e-6)


def test_opsm_anchor_is_slime_recomputed_log_probs_without_rollout_logprobs(slime_opsm, monkeypatch):
    seen = {}

    def spy(args, full_log_probs, full_old_log_probs, advantages, loss_masks):
        seen["old"] = full_old_log_probs
        return opsm_624b824(args, full_log_probs, full_old_log_probs, advantages, loss_masks)

    slime_opsm(spy)
    STATE.warned.discard("recompute")  # the recompute warning is once per process
    b = mixed_sign_batch(12)
    old = [t - 0.3 for t in b.rollout]
    args = args_ns(use_opsm=True, opsm_delta=DELTA, **(ARGS | {"use_rollout_logprobs": False}))
    register(args, b)
    with pytest.warns(UserWarning, match="in place of --use-tis"):
        reinforce_is_loss(args, slime_batch(b) | {"log_probs": old}, packed_logits(b), reducer_for(b))
    for got, want in zip(seen["old"], old):
        torch.testing.assert_close(got, want.float(), equal_nan=True)


@pytest.mark.parametrize("kind", ["k1", "k3", "low_var_kl"])
def test_unbiased_kl_is_slime_estimator(kind):
    b = make_batch(13, vocab=VOCAB)
    ref_lp = [t - 0.2 for t in b.train]
    args = args_ns(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type=kind, use_unbiased_kl=True, **ARGS)
    register(args, b)
    logits = packed_logits(b, seed=4)
    loss, metrics = reinforce_is_loss(args, slime_batch(b) | {"ref_log_probs": ref_lp}, logits, reducer_for(b))
    loss.backward()

    def ref_fn(x):
        pg, lp, keep = reference(b, x)
        zero = torch.zeros((), dtype=F64)
        lp_k = torch.where(keep, lp, zero)
        d = lp_k - torch.where(keep, torch.cat(ref_lp).to(F64), zero)
        k = d if kind == "k1" else torch.exp(-d) - 1 + d
        kl = torch.exp(lp_k - torch.where(keep, b.packed("rollout").to(F64), zero)) * k  # anchor: rollout lp
        if kind == "low_var_kl":
            kl = kl.clamp(-10, 10)
        kl_loss = reducer_for(b)(torch.where(keep, kl, zero))
        ref_fn.kl = kl_loss
        return pg + 0.1 * kl_loss

    check(logits, loss, ref_fn)
    assert float(metrics["kl_loss"]) == pytest.approx(float(ref_fn.kl), rel=1e-5)


def token_sum_over_kept(total_lengths, response_lengths, masks, per_token):
    """A user's pg-loss reducer in slime's contract: the per-sample mean over the masks it is given."""
    denoms = torch.cat([torch.full((len(m),), float(m.sum().clamp(min=1))) for m in masks])
    full = torch.cat(masks)
    return lambda x: (x * full.to(x.dtype) / denoms.to(x.dtype)).sum()


@pytest.mark.parametrize("loss_mode", [None, "on_policy"])
def test_custom_pg_loss_reducer_gets_slime_contract(monkeypatch, loss_mode):
    mod = types.ModuleType("user_reducers")
    calls = []

    def make(total_lengths, response_lengths, masks, per_token):
        calls.append((list(total_lengths), list(response_lengths), [m.clone() for m in masks], per_token))
        return token_sum_over_kept(total_lengths, response_lengths, masks, per_token)

    mod.kept_mean = make
    monkeypatch.setitem(sys.modules, "user_reducers", mod)
    b = make_batch(14, vocab=VOCAB)
    extra = {"tis_loss_mode": loss_mode} if loss_mode else {}
    args = args_ns(custom_pg_loss_reducer_function_path="user_reducers.kept_mean", **ARGS, **extra)
    logits, loss, _ = run(b, args)
    (tot, resp, masks, per_token), = calls
    assert (tot, resp, per_token) == (b.total_lengths, b.response_lengths, False)

    def ref_fn(x):
        def reduce(tok, keep, sample):
            k = torch.zeros(len(b.masks), dtype=F64).index_add_(0, sample, keep.to(F64)).clamp(min=1)
            return (tok / k[sample]).sum()
        pg, _, keep = reference(b, x, reduce=reduce, on_policy=loss_mode == "on_policy")
        ref_fn.keep = keep
        return pg

    check(logits, loss, ref_fn)
    torch.testing.assert_close(torch.cat(masks) != 0, ref_fn.keep)  # the rejected (non-finite) sample is zeroed


def test_refusals_name_the_nearest_supported_command(slime_opsm):
    slime_opsm(opsm_624b824)
    b = make_batch(15, vocab=VOCAB)
    logits = packed_logits(b)
    drop = dict(ARGS, tis_mode="mask", tis_rejected_denominator="drop")
    for extra, match in ((dict(use_opsm=True), "'drop' with --use-opsm.*use tis_rejected_denominator: keep"),
                         (dict(custom_pg_loss_reducer_function_path="m.f"),
                          "'drop' with --custom-pg-loss-reducer-function-path m.f.*keep")):
        args = args_ns(**drop, **extra)
        with pytest.raises(ValueError, match=match):  # by the rollout-data hook, before training
            register(args, b)
        with pytest.raises(ValueError, match=match):  # and by the loss itself
            reinforce_is_loss(args, slime_batch(b), logits, reducer_for(b))
    with pytest.raises(ValueError, match="TIS hook.*compute_tis_for_slime.*or sample with --rollout-top-p 1"):
        reinforce_is_loss(args_ns(**ARGS, rollout_top_p=0.9), slime_batch(b), logits, reducer_for(b))


def test_refusal_advice_is_a_command_slime_accepts_and_trains(slime_opsm):
    """Each refusal's advice, applied to the refused command line, is one slime's checks accept, and with it the
    custom loss trains a rollout of multi-sample rollouts (the slime harness, slime's OPSM rule installed)."""
    from _slime_args import slime_accepts
    from _slime_sim import Layout, initial_weights, make_rollouts, schedule, train_rollout
    from test_slime_command_lines import ALG2, ALG3, SIZES, _harness_args

    slime_opsm(opsm_624b824)
    w0 = initial_weights(1)
    ro = make_rollouts(3, SIZES, w0)
    sched = schedule(ro, steps=1, micro_batch_size=1)
    drop = "tis_rejected_denominator: drop\ntis_mode: mask\ntis_level: geometric\ntis_upper_bound: 1.05\n"
    keep = drop.replace("drop", "keep")
    for extra in ("--use-opsm --opsm-delta 1e-4", "--custom-pg-loss-reducer-function-path user_reducers.kept_mean"):
        cmd = f"{ALG3} {extra}"
        slime_accepts(cmd.split(), yaml_text=drop)
        with pytest.raises(ValueError, match="use tis_rejected_denominator: keep"):
            train_rollout(_harness_args(cmd, drop), ro, w0, sched, Layout())
        slime_accepts(cmd.split(), yaml_text=keep)
        sys.modules["user_reducers"] = types.ModuleType("user_reducers")
        sys.modules["user_reducers"].kept_mean = token_sum_over_kept
        try:
            assert len(train_rollout(_harness_args(cmd, keep), ro, w0, sched, Layout())) == 1
        finally:
            del sys.modules["user_reducers"]
    # top-p: the TIS hook with slime's replay, or the custom loss at --rollout-top-p 1
    slime_accepts(f"{ALG2} --rollout-top-p 0.9".split(), yaml_text="tis_mode: truncate\n")
    slime_accepts(f"{ALG3} --rollout-top-p 1".split(), yaml_text="tis_mode: truncate\n")
    # the recompute warning: --use-rollout-logprobs in place of --use-tis
    with pytest.raises(Exception, match="--use-rollout-logprobs and --use-tis"):
        slime_accepts(f"{ALG3} --use-tis".split(), yaml_text="tis_mode: truncate\n")
