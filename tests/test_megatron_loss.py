"""Step plan + loss function on one process: micro-batch losses add up to the whole-batch loss, the returned
form pre-compensates megatron's scaling exactly, metrics survive in-place scaling, masked micro-batches.

The oracle is one core ``policy_loss`` call on the whole batch with plain ``log_softmax`` log-probs.
Multi-process behaviour (CP/DP/TP/PP, megatron's real schedules and DDP) is in tests/dist.
"""

from __future__ import annotations

import types

import pytest
import torch
from _interpret import reset_dispatch
from _megatron_lm import train_step_loss_reduced
from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss

from slime_tis import TISConfig, policy_loss
from slime_tis.core import LocalReducer
from slime_tis.megatron import LossForm, TISBatch, aggregate_metrics, make_loss_func, step_totals

V, S, ROWS, TAU = 12, 6, 8, 0.9


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, S, V, generator=g) * 2
    labels = torch.randint(0, V, (ROWS, S), generator=g)
    mask = (torch.rand(ROWS, S, generator=g) < 0.8).float()
    mask[3] = 0  # a fully masked sequence
    adv = torch.randn(ROWS, 1, generator=g).expand(ROWS, S).clone()
    lp = torch.log_softmax(logits / TAU, -1).gather(-1, labels[..., None]).squeeze(-1)
    rollout = lp + 0.4 * torch.randn(ROWS, S, generator=g)
    rollout[5, 2] = float("nan") if mask[5, 2] else rollout[5, 2]
    return logits, labels, mask, adv, lp, rollout


CFGS = {
    "alg0": TISConfig(),
    "alg1_seq_mask": TISConfig(use_rollout_log_probs=True, mode="mask", level="sequence", upper=2.5),
    "alg2_tok_trunc_bn": TISConfig(use_tis=True, upper=1.5, batch_normalize=True),
    "alg2_geo_mask_drop_seqmean": TISConfig(use_tis=True, mode="mask", level="geometric", upper=1.3,
                                            rejected_denominator="drop", loss_agg="seq-mean-token-mean"),
    "alg3_tok_clip_veto": TISConfig(use_rollout_log_probs=True, use_tis=True, mode="clip", upper=1.5,
                                    veto_threshold=0.2, loss_agg="seq-mean-token-sum"),
}


def _microbatches(labels, mask, adv, rollout, lp, m):
    rows = ROWS // m
    out = []
    for k in range(m):
        sl = slice(k * rows, (k + 1) * rows)
        tb = TISBatch.from_padded(labels[sl], mask[sl], adv[sl], rollout[sl], cp_slice=False)
        tb.old_log_probs = lp[sl].reshape(-1).detach()
        out.append(tb)
    return out


@pytest.mark.parametrize("name", list(CFGS))
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("per_token", [False, True])
def test_microbatch_losses_reproduce_the_whole_batch(name, m, per_token):
    cfg = CFGS[name]
    logits, labels, mask, adv, lp, rollout = _data()
    batches = _microbatches(labels, mask, adv, rollout, lp, m)
    pre = [b.old_log_probs for b in batches] if cfg.algorithm in (1, 3) else None
    plan = step_totals(cfg, batches, LocalReducer(), pre_log_probs=pre)
    form = LossForm(per_token=per_token, num_microbatches=m, cp_size=1, grad_average=1)
    collector: list = []
    leaf = logits.clone().requires_grad_(True)
    rows = ROWS // m
    grad_total = torch.zeros(())
    loss_dicts = []
    for k, b in enumerate(batches):
        fn = make_loss_func(cfg, b, plan, form, LocalReducer(), collector=collector, temperature=TAU, chunk_size=5)
        out = fn(leaf[k * rows:(k + 1) * rows])
        if per_token:
            loss, n_local, metrics = out
            assert n_local.dtype == torch.int32 and int(n_local) == int((b.loss_mask != 0).sum())
            scaled = loss / plan.num_tokens  # megatron: sum of grads / sum of n_local = N
        else:
            loss, metrics = out
            scaled = loss / m  # megatron: 2-tuple loss * cp / M, grads averaged over 1 rank
        grad_total = grad_total + scaled
        assert metrics["loss"].shape == (2,) and float(metrics["loss"][1]) == 1.0  # Megatron-LM [value, count]
        loss_dicts.append(metrics)
    grad_total.backward()

    oracle_leaf = logits.clone().requires_grad_(True)
    lp_o = torch.log_softmax(oracle_leaf / TAU, -1).gather(-1, labels[..., None]).squeeze(-1)
    cu = torch.arange(ROWS + 1) * S
    ref = policy_loss(cfg, lp_o.reshape(-1), lp.reshape(-1), rollout.reshape(-1), adv.reshape(-1),
                      mask.reshape(-1), cu)
    ref.loss.backward()
    torch.testing.assert_close(grad_total.detach(), ref.loss.detach(), rtol=1e-5, atol=1e-7)
    logged = train_step_loss_reduced(loss_dicts)["loss"]  # what Megatron-LM's train_step logs (1 DP rank)
    torch.testing.assert_close(logged, ref.loss.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(leaf.grad, oracle_leaf.grad, rtol=1e-5, atol=1e-7)
    metrics = aggregate_metrics(collector, LocalReducer())
    expected = {k: float(v) for k, v in ref.stats.finalize().items()}
    for key, value in expected.items():
        assert abs(float(metrics[key]) - value) <= 1e-5 + 1e-5 * abs(value), (key, float(metrics[key]), value)
    assert abs(float(metrics["loss"]) - float(ref.loss.detach())) <= 1e-6
    assert set(metrics) == set(expected) | {"loss"}  # policy/entropy: the core's, with --tis-entropy-coef only


@pytest.mark.parametrize("cp_size,grad_average", [(1, 1), (2, 2), (2, 6), (1, 3)])
def test_two_tuple_scale_undoes_megatron_scaling(cp_size, grad_average):
    """The returned 2-tuple goes through megatron-core's own ``forward_step_calc_loss`` (it multiplies the
    loss by ``cp`` and divides it by ``M`` in place); the wrapper then divides the gradient summed over the
    ``g`` data-parallel x context-parallel ranks by ``g`` (megatron DDP). Each simulated rank is a group of
    rows; the global plan spans all of them. The result must be the whole-batch gradient, and a form that
    ignores ``cp`` or ``g`` must not give it."""
    cfg = CFGS["alg2_tok_trunc_bn"]
    logits, labels, mask, adv, lp, rollout = _data(6)
    m = 2
    ranks = 2  # rows are split over 2 "ranks" x M micro-batches; the plan is global over all of them
    batches = _microbatches(labels, mask, adv, rollout, lp, m * ranks)
    plan = step_totals(cfg, batches, LocalReducer())
    mcfg = types.SimpleNamespace(calculate_per_token_loss=False, timers=None)
    rows = ROWS // (m * ranks)

    def gradient(form):
        leaf = logits.clone().requires_grad_(True)
        total = torch.zeros(())
        for k, b in enumerate(batches):
            fn = make_loss_func(cfg, b, plan, form, LocalReducer(), collector=[], temperature=TAU)
            store: list = []
            out, _ = forward_step_calc_loss(None, leaf[k * rows:(k + 1) * rows], fn, mcfg, None, False, m, store,
                                            cp_group_size=cp_size, is_last_stage=True)
            total = total + out
        (total / grad_average).backward()  # DDP: sum over ranks, then divide by g
        return leaf.grad

    good = gradient(LossForm(per_token=False, num_microbatches=m, cp_size=cp_size, grad_average=grad_average))
    oracle_leaf = logits.clone().requires_grad_(True)
    lp_o = torch.log_softmax(oracle_leaf / TAU, -1).gather(-1, labels[..., None]).squeeze(-1)
    policy_loss(cfg, lp_o.reshape(-1), lp.reshape(-1), rollout.reshape(-1), adv.reshape(-1), mask.reshape(-1),
                torch.arange(ROWS + 1) * S).loss.backward()
    torch.testing.assert_close(good, oracle_leaf.grad, rtol=1e-5, atol=1e-7)
    if cp_size > 1 or grad_average > 1:
        wrong = gradient(LossForm(per_token=False, num_microbatches=m, cp_size=1, grad_average=1))
        ratio = float(wrong.abs().max() / good.abs().max())
        assert abs(ratio - cp_size / grad_average) < 1e-4, ratio


def test_metrics_are_clones_safe_from_in_place_scaling():
    """The schedule runs ``output_tensor *= cp; /= M`` on the returned loss in place: the metrics must not alias it."""
    cfg = CFGS["alg2_tok_trunc_bn"]
    logits, labels, mask, adv, lp, rollout = _data(1)
    batches = _microbatches(labels, mask, adv, rollout, lp, 1)
    plan = step_totals(cfg, batches, LocalReducer())
    collector: list = []
    fn = make_loss_func(cfg, batches[0], plan, LossForm(False, 1, 1, 1), LocalReducer(), collector=collector,
                        temperature=TAU)
    loss, metrics = fn(logits)
    before = metrics["loss"].clone()
    stats_before = collector[0].token_sums["megatron.loss_sum"].clone()
    loss.mul_(7.0).div_(3.0)
    assert torch.equal(metrics["loss"], before)
    assert torch.equal(collector[0].token_sums["megatron.loss_sum"], stats_before)


def test_all_masked_microbatch_gives_zero_loss_and_gradient():
    cfg = CFGS["alg2_tok_trunc_bn"]
    logits, labels, mask, adv, lp, rollout = _data(2)
    mask[:4] = 0  # micro-batch 0 of 2 has no valid token
    rollout[:4] = float("nan")  # and garbage where it is masked
    batches = _microbatches(labels, mask, adv, rollout, lp, 2)
    plan = step_totals(cfg, batches, LocalReducer())
    leaf = logits[:4].clone().requires_grad_(True)
    fn = make_loss_func(cfg, batches[0], plan, LossForm(False, 2, 1, 1), LocalReducer(), collector=[],
                        temperature=TAU)
    loss, metrics = fn(leaf)
    loss.backward()
    assert float(loss.detach()) == 0.0 and metrics["loss"].tolist() == [0.0, 1.0]
    assert torch.isfinite(leaf.grad).all() and (leaf.grad == 0).all()


def test_plan_batch_norm_factor_is_global_for_algorithm_2():
    cfg = CFGS["alg2_tok_trunc_bn"]
    logits, labels, mask, adv, lp, rollout = _data(3)
    one = step_totals(cfg, _microbatches(labels, mask, adv, rollout, lp, 1), LocalReducer())
    four = step_totals(cfg, _microbatches(labels, mask, adv, rollout, lp, 4), LocalReducer())
    torch.testing.assert_close(one.batch_norm_factor, four.batch_norm_factor)
    torch.testing.assert_close(one.denominator, four.denominator)
    assert float(one.denominator) == float((mask != 0).sum())
    assert step_totals(CFGS["alg0"], _microbatches(labels, mask, adv, rollout, lp, 2),
                     LocalReducer()).batch_norm_factor is None


def test_plan_errors_name_the_missing_input():
    cfg = CFGS["alg2_tok_trunc_bn"]
    logits, labels, mask, adv, lp, rollout = _data(4)
    b = TISBatch.from_padded(labels, mask, adv, rollout, cp_slice=False)
    with pytest.raises(ValueError, match="micro-batch 0: algorithm 2 needs old_log_probs"):
        step_totals(cfg, [b], LocalReducer())
    b2 = TISBatch.from_padded(labels, mask, adv, None, cp_slice=False)
    with pytest.raises(ValueError, match="micro-batch 0: algorithm 1 needs rollout_log_probs"):
        step_totals(CFGS["alg1_seq_mask"], [b2], LocalReducer())
    with pytest.raises(ValueError, match="at least one micro-batch"):
        step_totals(cfg, [], LocalReducer())


def test_logits_token_count_mismatch_is_explained():
    cfg = CFGS["alg0"]
    logits, labels, mask, adv, lp, rollout = _data(5)
    batches = _microbatches(labels, mask, adv, rollout, lp, 1)
    plan = step_totals(cfg, batches, LocalReducer())
    fn = make_loss_func(cfg, batches[0], plan, LossForm(False, 1, 1, 1), LocalReducer(), collector=[])
    with pytest.raises(ValueError, match="logits have 24 positions .* but the micro-batch's TISBatch has 48 tokens"):
        fn(logits[:4])


def test_tis_kernels_reaches_both_kernels_of_the_loss(monkeypatch):
    """``TISConfig(kernels="triton")``: the loss asks for the log-prob kernel and the correction kernel (here, CPU
    tensors without the interpreter: one fallback warning each, then the torch code: the same loss and gradient)."""
    import warnings

    from slime_tis.kernels import dispatch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    logits, labels, mask, adv, lp, rollout = _data(3)
    out = {}
    for kernels in ("torch", "triton"):
        cfg = CFGS["alg2_tok_trunc_bn"].replace(kernels=kernels)
        batches = _microbatches(labels, mask, adv, rollout, lp, 1)
        leaf = logits.clone().requires_grad_(True)
        reset_dispatch()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            plan = step_totals(cfg, batches, LocalReducer())
            fn = make_loss_func(cfg, batches[0], plan, LossForm(False, 1, 1, 1), LocalReducer(), collector=[],
                                temperature=TAU)
            loss, _ = fn(leaf)
            loss.backward()
        msgs = [str(w.message) for w in seen if issubclass(w.category, dispatch.KernelFallbackWarning)]
        out[kernels] = (loss.detach(), leaf.grad, msgs)
    reset_dispatch()
    assert out["torch"][2] == []
    assert sorted(m.split(" kernel cannot")[0].split("the ")[-1] for m in out["triton"][2]) == ["correction",
                                                                                              "logprobs"]
    assert torch.equal(out["torch"][0], out["triton"][0]) and torch.equal(out["torch"][1], out["triton"][1])


def test_nan_logits_reject_the_sequence_with_finite_loss_and_gradient():
    """A NaN logit at a valid token: its log-prob is NaN, the core rejects the sequence (counted), and neither the
    loss nor the logits' gradient holds a NaN (the rejected token's upstream gradient is 0: an exact zero row)."""
    cfg = CFGS["alg2_tok_trunc_bn"]
    logits, labels, mask, adv, lp, rollout = _data(4)
    mask[1, 2] = 1.0
    logits[1, 2, 5] = float("nan")
    batches = _microbatches(labels, mask, adv, rollout, lp, 1)
    plan = step_totals(cfg, batches, LocalReducer())
    collector: list = []
    leaf = logits.clone().requires_grad_(True)
    fn = make_loss_func(cfg, batches[0], plan, LossForm(False, 1, 1, 1), LocalReducer(), collector=collector,
                        temperature=TAU)
    loss, _ = fn(leaf)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(leaf.grad).all()
    assert (leaf.grad[1] == 0).all()  # the whole rejected sequence
    assert float(collector[0].finalize()["tis/nonfinite_seq_fraction"]) > 0
