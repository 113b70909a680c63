"""Agentic rollouts packed as slime packs them: ``keep`` is the per-rollout mean, exactly; ``drop`` is exact for
one-sample rollouts and refused for rollouts of several samples.

Each test trains one rollout batch (rollouts of 1-4 samples) through the hooks the way slime 624b824 does
(tests/_slime_sim.py: slime's ``build_dp_schedule`` packing, pi_old recompute, rollout-data hook, per step the
before-train-step hook and the micro-batches' losses, an optimizer step in between) and compares every step's
loss and gradient with the loss the options define, computed on whole rollouts in one process at the same
parameters (``oracle_step``). The 2-process layouts (DP = 2, CP = 2, TP = 2) are
tests/dist/test_slime_agentic_torchrun.py.
"""

from __future__ import annotations

import pytest
import torch
from _slime_sim import (
    Layout,
    custom_loss_args,
    initial_weights,
    make_rollouts,
    opsm_keep,
    oracle_step,
    ppo_term,
    response_log_probs,
    schedule,
    slime_args,
    split_fraction,
    train_rollout,
)

from slime_tis import compute_tis
from slime_tis.slime import COLLECTOR, tis_config_from_slime_args

SIZES = [1, 2, 3, 2, 4, 1, 2, 3]  # samples per rollout
HOOK = "slime_tis.slime.before_train_step"
LEVELS = {
    "token": dict(tis_mode="mask", tis_level="token", tis_upper_bound=1.3),
    "sequence": dict(tis_mode="truncate", tis_level="sequence", tis_upper_bound=1.5, tis_rs_level="sequence",
                     tis_rs_upper_bound=3.0),
    "geometric": dict(tis_mode="mask", tis_level="geometric", tis_upper_bound=1.05, tis_veto_threshold=1e-3),
}


def flags(hook: str, denominator: str, level: str) -> object:
    """slime args of a run (algorithm 3: the custom loss; 2 and 1: the TIS hook with slime's pi_old pass)."""
    kw = dict(tis_rejected_denominator=denominator, **LEVELS[level])
    if hook == "custom":
        return custom_loss_args(**kw)
    if hook == "alg2":
        return slime_args(use_tis=True, get_mismatch_metrics=True, **kw)
    return slime_args(use_rollout_logprobs=True, get_mismatch_metrics=True, **kw)  # algorithm 1


def check_rollout(args, ro, w0, sched, *, lr=0.5):
    """Train, then compare each step's loss and gradient with the oracle's; return the steps."""
    res = train_rollout(args, ro, w0, sched, Layout(), lr=lr)
    assert len(res) == len(sched[3])
    for s, r in enumerate(res):
        w = r.w.clone().requires_grad_(True)
        want = oracle_step(args, ro, w, r.positions, sched[3][s], w0)
        (grad,) = torch.autograd.grad(want, w)
        assert float(r.loss) == pytest.approx(float(want), rel=1e-5, abs=1e-7), f"step {s}"
        torch.testing.assert_close(r.grad, grad, rtol=1e-5, atol=1e-6, msg=f"step {s}")
    return res


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("level", sorted(LEVELS))
@pytest.mark.parametrize("denominator", ["keep", "drop"])
@pytest.mark.parametrize("hook", ["custom", "alg2", "alg1"])
def test_rollout_means_with_slime_packing(hook, denominator, level, steps):
    """Every step's loss and gradient equal the per-rollout means over valid (keep) / kept (drop) tokens: keep
    with multi-sample rollouts split across micro-batches (``--micro-batch-size 1``, and dynamic batching), drop
    with one-sample rollouts (each micro-batch counts its own)."""
    w0 = initial_weights(1)
    sizes = SIZES if denominator == "keep" else [1] * 8
    ro = make_rollouts(3, sizes, w0, nan_trap=hook != "alg1")  # algorithm 1: slime's own PPO term needs finite
    packing = dict(micro_batch_size=1) if (steps + len(level)) % 2 else dict(max_tokens=40)
    sched = schedule(ro, steps=steps, **packing)
    if denominator == "keep":
        assert split_fraction(ro, sched) >= 0.5  # rollouts split across micro-batches
    check_rollout(flags(hook, denominator, level), ro, w0, sched)


@pytest.mark.parametrize("hook", ["custom", "alg2", "alg1"])
def test_drop_is_refused_for_multi_sample_rollouts(hook):
    """``drop`` with rollouts of several samples raises in the rollout-data hook, before training, naming the key,
    why and what to use instead, whatever else is configured (slime's pi_old pass, the step hook)."""
    w0 = initial_weights(1)
    ro = make_rollouts(3, SIZES, w0)
    args = flags(hook, "drop", "geometric")
    args.custom_megatron_before_train_step_hook_path = HOOK
    with pytest.raises(ValueError, match=r"^tis_rejected_denominator = 'drop' with rollouts of several samples.*K_g "
                                         r"would need a pi_old pass or an extra forward pass.*use "
                                         r"tis_rejected_denominator: keep \(the default\)$"):
        train_rollout(args, ro, w0, schedule(ro, steps=2, micro_batch_size=1), Layout())


@pytest.mark.parametrize(("hook", "steps"), [("custom", 2), ("alg2", 1)])
def test_drop_needs_no_pi_old_pass(hook, steps):
    """One-sample rollouts without slime's pi_old pass (algorithm 2: slime reuses the training forward): each
    micro-batch counts its own K_g; no flag."""
    w0 = initial_weights(2)
    ro = make_rollouts(5, [1] * 8, w0)
    args = flags(hook, "drop", "geometric")
    args.get_mismatch_metrics = False
    check_rollout(args, ro, w0, schedule(ro, steps=steps, max_tokens=40))


def test_drop_without_rollout_mask_sums_divides_each_sample_by_its_own_kept_count():
    """Without ``rollout_mask_sums`` slime divides each sample by its own count (the unit is the sample), and so
    does ``drop``, whatever the rollout ids; without ``raw_reward`` too."""
    w0 = initial_weights(1)
    ro = make_rollouts(3, SIZES, w0)
    sched = schedule(ro, steps=1, micro_batch_size=1)
    args = flags("custom", "drop", "token")
    res = train_rollout(args, ro, w0, sched, Layout(), data_kw=dict(raw_reward=False, mask_sums=False))
    ro.rollout_ids = list(range(len(ro.masks)))  # the oracle's units: samples
    want = oracle_step(args, ro, res[0].w, res[0].positions, sched[3][0], w0)
    assert float(res[0].loss) == pytest.approx(float(want), rel=1e-5)


# ----------------------------------------------------------------------------- OPSM, custom reducer
def opsm_args(denominator: str, **kw):
    return slime_args(use_tis=True, get_mismatch_metrics=True, use_opsm=True, opsm_delta=1e-3,
                      tis_rejected_denominator=denominator, **LEVELS["token"], **kw)


def test_opsm_tokens_are_recovered_exactly():
    """The hook's rule (``A < 0`` and ``pg_loss == 0``) gives slime's OPSM mask at every valid token."""
    from slime_tis.slime.opsm import opsm_rejected

    w0 = initial_weights(1)
    ro = make_rollouts(3, SIZES, w0, spread=0.6)
    w1 = w0 + 0.8 * torch.randn(w0.shape, generator=torch.Generator().manual_seed(9))  # a later step's theta
    n_masked = 0
    for eps_c in (None, 3.0):
        args = opsm_args("keep", eps_clip_c=eps_c)
        for j in range(len(ro.masks)):
            theta = response_log_probs(ro, w1, j).detach()
            old = response_log_probs(ro, w0, j).detach()
            keep = opsm_keep([theta], [old], [ro.advantages[j]], [ro.masks[j]], args.opsm_delta)
            pg = ppo_term(old - theta, ro.advantages[j], args) * keep
            got = opsm_rejected(pg, ro.advantages[j], ro.masks[j] != 0)
            assert torch.equal(got, (keep == 0) & (ro.masks[j] != 0))
            n_masked += int(got.sum())
    assert n_masked > 0


@pytest.mark.parametrize("denominator", ["keep", "drop"])
def test_opsm_tokens_are_not_kept(denominator):
    """--use-opsm: slime zeroes tokens before the TIS function; they count as rejected in the exact metrics and,
    with ``drop``, leave the rollout's kept count."""
    w0 = initial_weights(1)
    ro = make_rollouts(4, [1] * 8, w0, spread=0.6)
    args = opsm_args(denominator, custom_megatron_before_train_step_hook_path=HOOK)  # flushes metrics per step
    sched = schedule(ro, steps=2, micro_batch_size=1)
    res = train_rollout(args, ro, w0, sched, Layout(), lr=3.0)
    exact = COLLECTOR.flush()  # step 1's
    r = res[1]
    want = oracle_step(args, ro, r.w.clone(), r.positions, sched[3][1], w0)
    assert float(r.loss) == pytest.approx(float(want), rel=1e-5, abs=1e-7)
    pos = sorted(r.positions)
    theta = [response_log_probs(ro, r.w, j).detach() for j in pos]
    old = [response_log_probs(ro, w0, j).detach() for j in pos]
    opsm = opsm_keep(theta, old, [ro.advantages[j] for j in pos], [ro.masks[j] for j in pos], args.opsm_delta) == 0
    mask = torch.cat([ro.masks[j] for j in pos])
    cu = torch.tensor([0, *torch.cumsum(torch.tensor([ro.response_lengths[j] for j in pos]), 0).tolist()])
    rules = compute_tis(tis_config_from_slime_args(args), torch.cat(old), torch.cat([ro.rollout_lp[j] for j in pos]),
                        mask, cu).keep_mask
    valid = mask != 0
    assert int((opsm & valid & rules).sum()) > 0  # OPSM takes out tokens the rules keep
    rejected = valid & (~rules | opsm)
    assert exact["tis/rejected_token_fraction"] == pytest.approx(float(rejected.sum() / valid.sum()), rel=1e-6)


def slime_own_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **_):
    """slime's own ``--use-tis`` (``vanilla_tis_function``, slime 624b824): ``pg_loss * clamp(exp(lp_train -
    lp_rollout), --tis-clip-low, --tis-clip)``, the masks returned unchanged."""
    w = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    return pg_loss * w.clamp(args.tis_clip_low, args.tis_clip), loss_masks, {}


@pytest.mark.parametrize("reducer", [False, True])
def test_opsm_leaves_entropy_kl_and_reducer_masks_as_slime_own_opsm(reducer):
    """Issue 39 item 4: ``--use-opsm --use-kl-loss --use-unbiased-kl --entropy-coef`` with the TIS hook at
    truncate/token/1.3 trains exactly what slime's own ``--use-tis --tis-clip 1.3`` trains: OPSM's tokens keep
    their entropy and KL terms (slime rebuilds that reducer from the hook's masks) and stay in a custom pg-loss
    reducer's masks, as slime's own OPSM leaves them (every step's loss and gradient, float32 sums of a few
    hundred terms: rel 1e-5)."""
    w0 = initial_weights(1)
    terms = dict(use_opsm=True, opsm_delta=1e-3, use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type="low_var_kl",
                 use_unbiased_kl=True, entropy_coef=0.01, tis_clip=1.3, tis_clip_low=0.0)
    if reducer:
        terms |= dict(custom_pg_loss_reducer_function_path="user.reducer", custom_reducer=sample_mean_reducer)
    own = slime_args(use_tis=True, tis_fn=slime_own_tis, **terms)
    hook = slime_args(use_tis=True, tis_mode="truncate", tis_level="token", tis_upper_bound=1.3,
                      custom_tis_function_path="slime_tis.slime.compute_tis_for_slime", **terms)
    runs = {}
    for name, args in (("own", own), ("hook", hook), ("no_opsm", slime_args(**{**vars(hook), "use_opsm": False}))):
        ro = make_rollouts(4, [1] * 8, w0, spread=0.6, nan_trap=False)  # slime's own TIS has no NaN guard
        runs[name] = train_rollout(args, ro, w0, schedule(ro, steps=2, micro_batch_size=1), Layout(), lr=3.0)
        COLLECTOR.flush()
    for got, want in zip(runs["hook"], runs["own"]):
        assert float(got.loss) == pytest.approx(float(want.loss), rel=1e-5, abs=1e-7)
        assert torch.allclose(got.grad, want.grad, rtol=1e-5, atol=1e-7)
    assert abs(float(runs["no_opsm"][1].loss - runs["hook"][1].loss)) > 1e-3  # OPSM acts at step 2


def sample_mean_reducer(total_lengths, response_lengths, masks, per_token):
    """A user's pg-loss reducer: each sample's mean over its mask (the masks slime hands it)."""
    return lambda x: sum((xi * m).sum() / m.sum().clamp(min=1) for xi, m in zip(x.split(response_lengths), masks))


def test_refused_combinations():
    w0 = initial_weights(1)
    ro = make_rollouts(3, [1] * 4, w0)
    sched = schedule(ro, steps=1, micro_batch_size=1)

    def run(args):
        train_rollout(args, ro, w0, sched, Layout())

    with pytest.raises(ValueError, match="custom-pg-loss-reducer-function-path.*use tis_rejected_denominator: keep"):
        run(slime_args(use_tis=True, tis_rejected_denominator="drop", custom_pg_loss_reducer_function_path="m.f"))
    with pytest.raises(ValueError, match="'drop' with --use-opsm.*keep"):
        run(custom_loss_args(use_opsm=True, tis_rejected_denominator="drop"))
    with pytest.raises(ValueError, match="'drop' with --custom-pg-loss-reducer-function-path m.f.*keep"):
        run(custom_loss_args(custom_pg_loss_reducer_function_path="m.f", tis_rejected_denominator="drop"))
    with pytest.raises(ValueError, match="cispo"):
        run(opsm_args("keep", advantage_estimator="cispo"))
    with pytest.raises(ValueError, match="tis_batch_normalize with --use-opsm"):
        run(opsm_args("keep", tis_batch_normalize=True))


def test_custom_reducer_with_keep_gets_the_masks_without_rejected_tokens():
    """``keep`` with --custom-pg-loss-reducer-function-path: slime hands the reducer the returned masks, in which
    rejected tokens are 0 (a reducer dividing by them is slime's old per-sample 'drop'); OPSM's tokens stay, as
    slime's own OPSM leaves them (test_opsm_leaves_entropy_kl_and_reducer_masks_as_slime_own_opsm)."""
    w0 = initial_weights(1)
    ro = make_rollouts(4, [1] * 8, w0, spread=0.6)
    seen = []

    def reducer(total_lengths, response_lengths, masks, per_token):
        seen.append([m.clone() for m in masks])
        return lambda x: sum((xi * m).sum() for xi, m in zip(x.split(response_lengths), masks))

    args = opsm_args("keep", custom_pg_loss_reducer_function_path="user.reducer")
    args.custom_reducer = reducer
    train_rollout(args, ro, w0, schedule(ro, steps=2, micro_batch_size=1), Layout(), lr=3.0)
    kept = torch.cat([m for ms in seen for m in ms]) != 0
    valid = torch.cat(ro.masks) != 0
    assert 0 < int(kept.sum()) < int(valid.sum())
