"""``slime_tis.slime.compute_tis_for_slime`` called exactly as slime calls its TIS function (one process).

The 2-process context-parallel version of these checks is tests/dist/test_slime_cp.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from _slime_oracle import SlimeBatch, args_ns, make_batch, rollout_mean, slime_sum_of_sample_mean

from slime_tis import TISConfig, compute_tis
from slime_tis.slime import compute_tis_for_slime, postprocess_rollout_data, tis_config_from_slime_args
from slime_tis.slime.state import STATE


def register(args, b):
    """slime's rollout-data hook call before training (registers each sample's rollout; pi_old = ``b.train``,
    used when slime would have recomputed it)."""
    postprocess_rollout_data(args, 0, b.rollout_data() | {"log_probs": b.train})


def call(args, b, pg=None):
    pg = b.packed("pg_loss") if pg is None else pg
    return compute_tis_for_slime(
        args, pg_loss=pg, train_log_probs=b.train, rollout_log_probs=b.rollout, loss_masks=b.masks,
        total_lengths=b.total_lengths, response_lengths=b.response_lengths,
    )


# ------------------------------------------------------------------ hand-derived example
def tiny():
    from _slime_oracle import SlimeBatch

    return SlimeBatch(
        prompt_lengths=[2, 3], response_lengths=[2, 1],
        train=[torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])],
        rollout=[torch.tensor([-1.5, -1.0]), torch.tensor([float("nan")])],
        masks=[torch.tensor([1.0, 1.0]), torch.tensor([1.0])],
        pg_loss=[torch.tensor([1.0, 2.0]), torch.tensor([3.0])], advantages=[], tokens=[],
    )


@pytest.mark.parametrize(
    ("level", "w"),
    [("token", [1.5, math.exp(-1.0)]), ("sequence", [math.exp(-0.5)] * 2), ("geometric", [math.exp(-0.25)] * 2)],
)
def test_hand_values_truncate(level, w):
    b = tiny()  # sample A: l = [0.5, -1.0]; sample B: NaN rollout at a valid token -> rejected
    args = args_ns(use_tis=True, tis_mode="truncate", tis_level=level, tis_upper_bound=1.5)
    new, masks, metrics = call(args, b)
    expect = [1.0 * w[0], 2.0 * w[1], 0.0]
    assert new.tolist() == pytest.approx(expect, rel=1e-6)
    assert [m.tolist() for m in masks] == [[1.0, 1.0], [0.0]]
    # slime's per-sample mean with the modified numerator masks and the original denominators
    loss = slime_sum_of_sample_mean(new, b, masks, 0, 1)
    assert float(loss) == pytest.approx((expect[0] + expect[1]) / 2 + 0.0 / 1, rel=1e-6)
    # metrics as slime reports them: per-sample means over the original masks
    kl = slime_sum_of_sample_mean(metrics["tis/kl"], b, b.masks, 0, 1) / 2
    assert float(kl) == pytest.approx(((-0.5) + 1.0) / 2 / 2, rel=1e-6)  # sample B contributes 0
    assert float(slime_sum_of_sample_mean(metrics["tis/nonfinite_seq_fraction"], b, b.masks, 0, 1) / 2) == 0.5
    assert all(bool(torch.isfinite(v).all()) for v in metrics.values())


def test_token_mask_mode_drop_one_sample_per_rollout_is_the_sample_kept_mean():
    b = tiny()  # token ratios e^0.5 = 1.65 (kept, upper 2), e^-1 = 0.37 (rejected, lower 0.5)
    keep_args = args_ns(use_tis=True, tis_mode="mask", tis_level="token")
    drop_args = args_ns(use_tis=True, tis_mode="mask", tis_level="token", tis_rejected_denominator="drop")
    register(drop_args, b)
    new_k, masks_k, _ = call(keep_args, b)
    new_d, masks_d, _ = call(drop_args, b)
    assert [m.tolist() for m in masks_k] == [[1.0, 0.0], [0.0]]
    w0 = math.exp(0.5)
    assert float(slime_sum_of_sample_mean(new_k, b, masks_k, 0, 1)) == pytest.approx(w0 * 1.0 / 2, rel=1e-6)
    assert float(slime_sum_of_sample_mean(new_d, b, masks_d, 0, 1)) == pytest.approx(w0 * 1.0 / 1, rel=1e-6)


# ------------------------------------------------------------------ against the core on the packed batch
CONFIGS = {
    "a2_tok_trunc": dict(use_tis=True, tis_mode="truncate", tis_level="token", tis_upper_bound=1.3),
    "a2_seq_clip_veto": dict(use_tis=True, tis_mode="clip", tis_level="sequence", tis_upper_bound=3.0,
                             tis_veto_threshold=1e-3),
    "a2_geo_mask_rs": dict(use_tis=True, tis_mode="mask", tis_level="geometric", tis_upper_bound=1.2,
                           tis_rs_level="token", tis_rs_upper_bound=3.0),
    "a1_seq_rs_veto": dict(use_rollout_logprobs=True, get_mismatch_metrics=True, tis_rs_level="sequence",
                           tis_rs_upper_bound=4.0, tis_veto_threshold=1e-3),
    "a2_geo_drop": dict(use_tis=True, tis_mode="mask", tis_level="geometric", tis_upper_bound=1.1,
                        tis_rejected_denominator="drop"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_core_on_the_packed_batch(name):
    b = make_batch(3)
    args = args_ns(**CONFIGS[name])
    cfg = tis_config_from_slime_args(args)
    register(args, b)  # one sample per rollout
    pg = b.packed("pg_loss").requires_grad_(True)
    new, masks, metrics = call(args, b, pg)

    core_cfg = TISConfig(**{k: v for k, v in cfg.__dict__.items()})
    ref = compute_tis(core_cfg, b.packed("train"), b.packed("rollout"), b.packed("masks"), b.cu_seqlens(),
                      extra_finite=(b.packed("pg_loss"),))
    w = ref.weights if cfg.applies_weights else torch.ones_like(ref.weights)
    expect = torch.where(ref.keep_mask, b.packed("pg_loss") * w, torch.zeros(()))
    if cfg.rejected_denominator == "drop":
        kept = torch.zeros(len(b.masks)).index_add_(0, ref.ratios.seq_id, ref.keep_mask.float())
        expect = expect * (ref.ratios.seq_count / kept.clamp(min=1))[ref.ratios.seq_id]
    torch.testing.assert_close(new.detach(), expect, rtol=1e-6, atol=1e-7)
    assert torch.equal(torch.cat(masks), b.packed("masks") * ref.keep_mask)
    assert torch.isfinite(new).all()
    new.sum().backward()  # NaN in pg_loss / log-probs at masked or rejected positions: no NaN gradient
    assert torch.isfinite(pg.grad).all()
    assert float(pg.grad[3]) == 0.0  # masked position with a NaN loss
    torch.testing.assert_close(metrics["tis/weight"], ref.weights)
    assert metrics["tis/rejected_token_fraction"].tolist() == (ref.ratios.valid & ~ref.keep_mask).float().tolist()
    for v in metrics.values():
        assert v.shape == new.shape and torch.isfinite(v).all()


def test_metrics_only_run_changes_nothing():
    b = make_batch(1)
    args = args_ns(get_mismatch_metrics=True)  # algorithm 0: --get-mismatch-metrics without --use-tis
    pg = b.packed("pg_loss")
    new, masks, metrics = call(args, b, pg)
    assert new is pg
    assert all(m is o for m, o in zip(masks, b.masks))
    assert "tis/kl" in metrics and "tis/weight" in metrics


def test_use_tis_false_with_rollout_logprobs_applies_no_weight():
    b = make_batch(2)
    args = args_ns(use_rollout_logprobs=True, get_mismatch_metrics=True)  # algorithm 1: rejection only
    new, masks, _ = call(args, b)
    ref = compute_tis(TISConfig(use_rollout_log_probs=True), b.packed("train"), b.packed("rollout"),
                      b.packed("masks"), b.cu_seqlens(), extra_finite=(b.packed("pg_loss"),))
    expect = torch.where(ref.keep_mask, b.packed("pg_loss"), torch.zeros(()))
    torch.testing.assert_close(new, expect)
    assert not ref.keep_mask[sum(b.response_lengths[:2]):sum(b.response_lengths[:3])].any()  # NaN sample


def test_opsm_tokens_get_zero_loss_and_keep_their_masks_unless_a_rule_rejects_them():
    """--use-opsm: the tokens slime's OPSM zeroed (``A < 0``, ``pg_loss == 0``) are counted rejected and keep a
    zero loss, but the returned masks (slime's entropy / KL reducer, a custom pg-loss reducer) are those of the
    same call without OPSM: a token OPSM zeroed leaves them only where a rule of the hook rejects it (sample 4's
    catastrophic token, rejected by the token mask)."""
    b = make_batch(3)
    g = torch.Generator().manual_seed(5)
    b.advantages = [torch.randn(r, generator=g) for r in b.response_lengths]
    b.advantages[4] = -b.advantages[4].abs()  # every token of sample 4 is OPSM's, its catastrophic token too
    for i in (0, 4, 5):  # OPSM zeroed these samples' negative-advantage tokens
        b.pg_loss[i] = torch.where(b.advantages[i] < 0, torch.zeros(()), b.pg_loss[i])
    out = {}
    for opsm in (False, True):
        args = args_ns(use_tis=True, tis_mode="mask", tis_level="token", tis_upper_bound=2.0, use_opsm=opsm)
        postprocess_rollout_data(args, 0, b.rollout_data() | {"log_probs": b.train, "advantages": b.advantages})
        out[opsm] = call(args, b)
    opsm_tokens = (b.packed("advantages") < 0) & (b.packed("pg_loss") == 0) & (b.packed("masks") != 0)
    assert int(opsm_tokens.sum()) > 0
    assert [m.tolist() for m in out[True][1]] == [m.tolist() for m in out[False][1]]
    assert float(out[False][1][4][7]) == 0.0  # the rule's rejection stays
    assert out[True][0][opsm_tokens].abs().sum() == 0
    rejected = {k: v[2]["tis/rejected_token_fraction"] for k, v in out.items()}
    assert torch.equal(rejected[True], torch.maximum(rejected[False], opsm_tokens.float()))


# ------------------------------------------------------------------ agentic rollouts (several samples each)
def two_rollouts_of_two_samples():
    """Rollout 0 = samples 0, 1; rollout 1 = samples 2, 3. Log-ratios l = lp_train - lp_rollout chosen by hand:
    token mask [0.5, 2] rejects l = 1.0 (sample 0) and l = -1.0 (sample 2)."""
    lr = [[0.0, 1.0], [0.2, -0.1], [-1.0], [0.1, 0.3]]
    rollout = [torch.full((len(x),), -1.0) for x in lr]
    train = [r + torch.tensor(x) for r, x in zip(rollout, lr)]
    pg = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), torch.tensor([5.0]), torch.tensor([6.0, 7.0])]
    return SlimeBatch([3, 2, 4, 2], [2, 2, 1, 2], train, rollout, [torch.ones(len(x)) for x in lr], pg, [], [],
                      rollout_ids=[0, 0, 1, 1])


def test_drop_divides_each_one_sample_rollout_by_its_kept_count_hand_values():
    """keep: (1 + 3 + 4) / 4 + (6 + 7) / 3 (two rollouts of two samples); drop with one-sample rollouts:
    1 / 1 + (3 + 4) / 2 + 0 + (6 + 7) / 2; drop with the two-sample rollouts: refused."""
    b = two_rollouts_of_two_samples()
    for denominator, rollout_ids, expect in (("keep", [0, 0, 1, 1], 8 / 4 + 13 / 3), ("drop", None, 11.0)):
        b.rollout_ids = rollout_ids
        args = args_ns(use_rollout_logprobs=True, get_mismatch_metrics=True, tis_mode="mask", tis_level="token",
                       tis_rejected_denominator=denominator)  # algorithm 1: rejection only, w = 1
        register(args, b)
        new, masks, _ = call(args, b)
        assert [m.tolist() for m in masks] == [[1.0, 0.0], [1.0, 1.0], [0.0], [1.0, 1.0]]
        loss = slime_sum_of_sample_mean(new, b, masks, 0, 1, sample_denoms=b.rollout_mask_sums())
        assert float(loss) == pytest.approx(expect, rel=1e-6), denominator
    b.rollout_ids = [0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"^tis_rejected_denominator = 'drop' with rollouts of several samples.*"
                                         r"K_g would need a pi_old pass or an extra forward pass per optimizer step.*"
                                         r"use tis_rejected_denominator: keep \(the default\)$"):
        register(args, b)


AGENTIC = {  # --get-mismatch-metrics: slime recomputes pi_old
    "a2_tok_mask": dict(use_tis=True, get_mismatch_metrics=True, tis_mode="mask", tis_level="token",
                        tis_upper_bound=1.3),
    "a2_geo_mask_veto": dict(use_tis=True, get_mismatch_metrics=True, tis_mode="mask", tis_level="geometric",
                             tis_upper_bound=1.1, tis_veto_threshold=1e-3),
    "a2_seq_trunc_seq_rs": dict(use_tis=True, get_mismatch_metrics=True, tis_mode="truncate", tis_level="sequence",
                                tis_upper_bound=2.0, tis_rs_level="sequence", tis_rs_upper_bound=3.0),
    "a1_geo_mask": dict(use_rollout_logprobs=True, get_mismatch_metrics=True, tis_mode="mask", tis_level="geometric",
                        tis_upper_bound=1.1),
}


@pytest.mark.parametrize("name", sorted(AGENTIC))
def test_keep_and_drop_are_per_rollout_means(name):
    """slime's own reducer (rollout_mask_sums denominators) applied to the hook's output equals the rollout mean
    over valid tokens (keep); with one sample per rollout, over valid (keep) / kept (drop) tokens."""
    for rollout_ids in ([0, 0, 1, 2, 2, 2], None):
        b = make_batch(4)
        b.rollout_ids = rollout_ids
        for denominator in ("keep",) if rollout_ids else ("keep", "drop"):
            args = args_ns(tis_rejected_denominator=denominator, **AGENTIC[name])
            cfg = tis_config_from_slime_args(args)
            register(args, b)
            new, masks, _ = call(args, b)
            ref = compute_tis(cfg, b.packed("train"), b.packed("rollout"), b.packed("masks"), b.cu_seqlens(),
                              extra_finite=(b.packed("pg_loss"),))
            w = ref.weights if cfg.applies_weights else torch.ones_like(ref.weights)
            expect = rollout_mean(b.packed("pg_loss") * w, ref.keep_mask, b, denominator)
            got = slime_sum_of_sample_mean(new, b, masks, 0, 1, sample_denoms=b.rollout_mask_sums())
            assert float(got) == pytest.approx(float(expect), rel=1e-5, abs=1e-6), (rollout_ids, denominator)
            # the rejection itself differs between sequences of one rollout (else the test shows nothing)
        kept_frac = [float((m != 0).sum() / max(float(o.sum()), 1)) for m, o in zip(masks, b.masks)]
        assert len(set(kept_frac)) > 1


@pytest.mark.parametrize("get_mismatch_metrics", [False, True])
def test_drop_is_refused_for_multi_sample_rollouts_and_local_for_single_ones(get_mismatch_metrics):
    """Rollouts of several samples (which slime's packing splits) are refused before training, with or without
    slime's pi_old pass; a rollout whose other samples have no valid token, and one-sample rollouts, are counted
    exactly in their micro-batch."""
    b = make_batch(6)
    args = args_ns(use_tis=True, tis_mode="mask", tis_level="token", tis_upper_bound=1.3,
                   tis_rejected_denominator="drop", get_mismatch_metrics=get_mismatch_metrics)
    b.rollout_ids = [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="'drop' with rollouts of several samples"):
        postprocess_rollout_data(args, 0, b.rollout_data() | {"log_probs": b.train})
    assert not STATE.drop_checked
    with pytest.raises(ValueError, match="'drop' needs --rollout-data-postprocess-path"):
        call(args, b)  # the loss hooks refuse drop on a rollout the rollout-data hook did not check
    b.rollout_ids = [0, 0, 1, 2, 3, 4]
    b.masks = [b.masks[0], torch.zeros_like(b.masks[1]), *b.masks[2:]]  # rollout 0's valid tokens: sample 0's
    postprocess_rollout_data(args, 0, b.rollout_data() | {"log_probs": b.train})
    cfg = tis_config_from_slime_args(args)
    total = torch.zeros(())
    for idx in ([0, 1, 2], [3, 4, 5]):
        mb = b.subset(idx)
        new, masks, _ = call(args, mb)
        total = total + slime_sum_of_sample_mean(new, mb, masks, 0, 1, sample_denoms=mb.rollout_mask_sums())
    ref = compute_tis(cfg, b.packed("train"), b.packed("rollout"), b.packed("masks"), b.cu_seqlens(),
                      extra_finite=(b.packed("pg_loss"),))
    expect = rollout_mean(b.packed("pg_loss") * ref.weights, ref.keep_mask, b, "drop")
    assert float(total) == pytest.approx(float(expect), rel=1e-5)


# ------------------------------------------------------------------ configuration from slime's args
def test_mis_yaml_keys_are_translated():
    args = args_ns(use_tis=True, tis_mode="truncate", tis_level="token", tis_upper_bound=2.0, tis_lower_bound=0.5,
                   use_rs=True, rs_level="geometric", rs_veto_threshold=1e-4)
    cfg = tis_config_from_slime_args(args)
    assert cfg.rs_level == "geometric" and cfg.rs_upper_bound == 2.0 and cfg.rs_lower_bound == 0.5
    assert cfg.veto_threshold == 1e-4
    assert cfg.loss_agg == "seq-mean-token-mean"
    no_rs = tis_config_from_slime_args(args_ns(use_tis=True, use_rs=False, rs_level="token", rs_veto_threshold=1e-4))
    assert no_rs.rs_level is None and no_rs.veto_threshold is None  # mis.py vetoes only inside RS


def test_every_threshold_key_is_read_and_part_of_the_cache_key():
    """A k3 threshold key reaches the configuration, and changing only it gives a new configuration
    (the cached one was keyed without it before the keys came from ``DESTS_OF``)."""
    first = tis_config_from_slime_args(args_ns(use_rollout_logprobs=True, tis_seq_mean_k3_threshold=0.01))
    second = tis_config_from_slime_args(args_ns(use_rollout_logprobs=True, tis_seq_mean_k3_threshold=0.02))
    third = tis_config_from_slime_args(args_ns(use_rollout_logprobs=True, tis_seq_max_k3_threshold=0.5))
    assert (first.seq_mean_k3_threshold, second.seq_mean_k3_threshold) == (0.01, 0.02)
    assert third.seq_max_k3_threshold == 0.5 and third.seq_mean_k3_threshold is None


def test_bad_configurations_raise_clear_errors():
    b = tiny()
    with pytest.raises(ValueError, match="tis_loss_agg = 'token-mean' contradicts slime's aggregation"):
        call(args_ns(use_tis=True, tis_loss_agg="token-mean"), b)
    with pytest.raises(ValueError, match="custom-loss-function-path slime_tis.slime.reinforce_is_loss"):
        call(args_ns(use_tis=True, use_rollout_logprobs=True), b)
    with pytest.raises(ValueError, match="'drop' cannot be honoured with --calculate-per-token-loss"):
        call(args_ns(use_tis=True, calculate_per_token_loss=True, tis_rejected_denominator="drop"), b)
    STATE.clear()
    with pytest.raises(ValueError, match="'drop' needs --rollout-data-postprocess-path "
                                         "slime_tis.slime.postprocess_rollout_data"):
        call(args_ns(use_tis=True, tis_rejected_denominator="drop"), b)
    with pytest.raises(ValueError, match=r"--tis-mode \(mode\) = 'bogus'"):
        call(args_ns(use_tis=True, tis_mode="bogus"), b)
    STATE.clear()
    with pytest.raises(RuntimeError, match="--rollout-data-postprocess-path slime_tis.slime.postprocess_rollout_data"):
        call(args_ns(use_tis=True, tis_batch_normalize=True), b)


def test_layout_errors_name_the_sample():
    b = tiny()
    args = args_ns(use_tis=True)
    with pytest.raises(ValueError, match=r"train_log_probs\[1\] has 2 tokens but this context-parallel rank holds 1"):
        compute_tis_for_slime(args, pg_loss=b.packed("pg_loss"), train_log_probs=[b.train[0], torch.zeros(2)],
                              rollout_log_probs=b.rollout, loss_masks=b.masks, total_lengths=b.total_lengths,
                              response_lengths=b.response_lengths)
    with pytest.raises(ValueError, match=r"loss_masks\[0\] has 1 entries but response_lengths\[0\] = 2"):
        compute_tis_for_slime(args, pg_loss=b.packed("pg_loss"), train_log_probs=b.train,
                              rollout_log_probs=b.rollout, loss_masks=[torch.ones(1), b.masks[1]],
                              total_lengths=b.total_lengths, response_lengths=b.response_lengths)
    with pytest.raises(ValueError, match=r"pg_loss has shape \(2,\) but the CP-local log-probs have 3 tokens"):
        call(args, b, torch.zeros(2))


def test_surrogates_slime_computes_itself_are_refused_in_one_line():
    """slime's policy loss computes the PPO surrogate (or its own GSPO) and the KL / entropy terms: the TIS
    function only weights and rejects it, so ``tis_loss_mode`` other than ``ppo_clip`` and the ``tis_`` term keys
    are refused; ``ppo_clip`` is accepted."""
    b = make_batch(3)
    for key, value, match in (("tis_loss_mode", "gspo", "slime's own policy loss computes the surrogate"),
                              ("tis_loss_mode", "on_policy", "reinforce_is_loss"),
                              ("tis_kl_coef", 0.1, "--use-kl-loss"), ("tis_entropy_coef", 0.2, "--entropy-coef")):
        args = args_ns(use_tis=True, **{key: value})
        with pytest.raises(ValueError, match=match) as err:
            call(args, b)
        assert "\n" not in str(err.value)
    args = args_ns(use_tis=True, tis_loss_mode="ppo_clip")
    call(args, b)
