"""slime's open changes to its loss path (merge refs on slime 624b824): refused where they would change what the
hooks compute without an error, modelled where the hooks keep working.

* #1917 (OPSM decided per sequence): probed from slime's ``compute_opsm_mask`` signature; ``--use-opsm`` with the
  TIS hook refused.
* #2083 (``--advantage-estimator reinforce``): ``--use-opsm`` refused with it; the TIS hook weights its loss.
* #2305 (``--rs-batch-refill``): refused.
* #2065 (``build_dp_schedule`` drops trailing rollouts of a step): modelled, the hooks train the kept rollouts
  exactly.
* #2258 (no KL term at ``--kl-loss-coef 0``): the custom loss already adds none; modelled.
* #2010 (temperature applied per logit chunk): modelled, the step hook's and the custom loss's log-probs agree.
Plus the start-up warning for top-k without slime's top-p replay.
"""

from __future__ import annotations

import math
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from _slime_oracle import SlimeBatch, args_ns, make_batch
from _slime_schedule import build_dp_schedule
from _slime_sim import Layout, custom_loss_args, initial_weights, make_rollouts, oracle_step, slime_args, train_rollout

from slime_tis.slime import STATE, compute_tis_for_slime, reinforce_is_loss, tis_config_from_slime_args
from slime_tis.slime.opsm import check_opsm, opsm_rejected


@pytest.fixture
def installed_slime(tmp_path, monkeypatch):
    """Install a stand-in ``slime`` package (files written by the test) for the probes; removed afterwards."""
    before = {k for k in sys.modules if k == "slime" or k.startswith("slime.")}
    monkeypatch.syspath_prepend(str(tmp_path))
    STATE.clear()

    def install(files: dict[str, str]) -> None:
        for rel, text in {"slime/__init__.py": "", "slime/utils/__init__.py": "",
                          "slime/backends/__init__.py": "", "slime/backends/megatron_utils/__init__.py": "",
                          **files}.items():
            path = tmp_path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        STATE.clear()

    yield install
    for k in [k for k in sys.modules if (k == "slime" or k.startswith("slime.")) and k not in before]:
        del sys.modules[k]
    STATE.clear()


# slime's compute_opsm_mask signature at 624b824 and with the per-sequence change (bodies are not needed)
OPSM_624B824 = "def compute_opsm_mask(args, full_log_probs, full_old_log_probs, advantages, loss_masks):\n    ...\n"
OPSM_PER_SEQUENCE = ("def compute_opsm_mask(args, full_log_probs, full_old_log_probs, full_advantages, loss_masks,\n"
                     "                      local_advantages=None):\n    ...\n")


def opsm_args(**kw):
    return slime_args(use_tis=True, use_opsm=True, custom_tis_function_path="slime_tis.slime.compute_tis_for_slime",
                      **kw)


def test_opsm_per_sequence_slime_is_refused_at_the_first_hook_call(installed_slime):
    installed_slime({"slime/utils/ppo_utils.py": OPSM_PER_SEQUENCE})
    with pytest.raises(ValueError, match="decides OPSM per sequence"):
        tis_config_from_slime_args(opsm_args())
    tis_config_from_slime_args(custom_loss_args())  # the custom loss: OPSM is not its business
    tis_config_from_slime_args(slime_args(use_tis=True))  # without --use-opsm


def test_opsm_of_slime_624b824_is_accepted(installed_slime):
    installed_slime({"slime/utils/ppo_utils.py": OPSM_624B824})
    tis_config_from_slime_args(opsm_args())


def test_without_slime_installed_the_probes_find_nothing(installed_slime):
    tis_config_from_slime_args(opsm_args())


def test_why_per_sequence_opsm_is_refused():
    """A mixed-sign sequence with a negative mean advantage: the per-sequence rule zeroes all of its tokens,
    the hook's recovery (A < 0 and pg_loss == 0) finds only the negative ones."""
    adv = torch.tensor([-2.0, 1.0, -1.0, 0.5])
    pg_loss = torch.zeros(4)  # the whole sequence zeroed by OPSM
    found = opsm_rejected(pg_loss, adv, torch.ones(4, dtype=torch.bool))
    assert found.tolist() == [True, False, True, False]


def test_reinforce_estimator_with_opsm_is_refused():
    with pytest.raises(ValueError, match="--advantage-estimator reinforce.*log pi = 0"):
        check_opsm(SimpleNamespace(use_opsm=True, advantage_estimator="reinforce"))


def test_reinforce_estimator_loss_is_weighted_by_the_tis_hook():
    """``pg_loss = -A lp_theta`` (the REINFORCE estimator) reaches the TIS function like any other term: the hook
    returns ``w * pg_loss`` with the weights of the configuration, rejected sequences at 0."""
    adv, lp = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([-1.0, -2.0, -0.5])
    b = SlimeBatch(prompt_lengths=[2, 3], response_lengths=[2, 1],
                   train=[lp[:2], lp[2:]], rollout=[torch.tensor([-1.5, -1.0]), torch.tensor([float("nan")])],
                   masks=[torch.ones(2), torch.ones(1)], pg_loss=[], advantages=[], tokens=[])
    args = args_ns(use_tis=True, tis_mode="truncate", tis_level="token", tis_upper_bound=1.5,
                   advantage_estimator="reinforce")
    pg = -adv * lp
    new, masks, _ = compute_tis_for_slime(args, pg_loss=pg, train_log_probs=b.train, rollout_log_probs=b.rollout,
                                          loss_masks=b.masks, total_lengths=b.total_lengths,
                                          response_lengths=b.response_lengths)
    w = [1.5, math.exp(-1.0)]  # min(exp(lp - lp_rollout), 1.5); sample 2 rejected (NaN rollout log-prob)
    assert new.tolist() == pytest.approx([w[0] * float(pg[0]), w[1] * float(pg[1]), 0.0], rel=1e-6)


def test_rs_batch_refill_is_refused():
    with pytest.raises(ValueError, match="--rs-batch-refill"):
        tis_config_from_slime_args(slime_args(use_tis=True, rs_batch_refill=True))


def test_skip_recompute_key_without_the_patched_slime_is_refused(installed_slime):
    kw = dict(use_rollout_logprobs=True, get_mismatch_metrics=True, tis_bypass_skip_recompute=True)
    installed_slime({"slime/backends/megatron_utils/actor.py": "def train_actor():\n    pass\n"})
    with pytest.raises(ValueError, match="lacks patches/slime_alg1_skip_recompute.patch"):
        tis_config_from_slime_args(slime_args(**kw))
    installed_slime({"slime/backends/megatron_utils/actor.py":
                     "from slime_tis.slime.bypass import skips_pi_old_recompute\n"})
    tis_config_from_slime_args(slime_args(**kw))


def test_top_k_without_slimes_top_p_replay_warns_once():
    with pytest.warns(UserWarning, match="--rollout-top-k 20 with --rollout-top-p 1"):
        tis_config_from_slime_args(slime_args(use_tis=True, rollout_top_k=20, tis_upper_bound=1.7))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tis_config_from_slime_args(slime_args(use_tis=True, rollout_top_k=20, rollout_top_p=0.9))  # replayed


# ----------------------------------------------------------------------------------- #2065: dropped rollouts
SIZES = [1, 2, 3, 2, 4, 1, 2, 3]


def schedule_dropping_trailing(ro, dropped: int):
    """The schedule slime builds when it drops the step's last ``dropped`` rollouts: their samples are in no
    micro-batch and on no rank, and the step's ``global_batch_sizes`` counts the kept rollouts."""
    order = list(dict.fromkeys(ro.rollout_ids))
    kept = set(order[:len(order) - dropped])
    keep = [j for j, r in enumerate(ro.rollout_ids) if r in kept]
    parts, mbs, num, gbs = build_dp_schedule([ro.total_lengths[j] for j in keep], [ro.rollout_ids[j] for j in keep],
                                             global_batch_size=len(kept), dp_size=1, micro_batch_size=1)
    return [[keep[p] for p in part] for part in parts], mbs, num, gbs


@pytest.mark.parametrize(("hook", "denominator"), [("alg2", "drop"), ("custom", "drop"), ("alg2", "keep")])
def test_trailing_rollouts_dropped_by_the_schedule_train_exactly(hook, denominator):
    w0 = initial_weights(1)
    ro = make_rollouts(3, SIZES if denominator == "keep" else [1] * 8, w0)  # drop: one-sample rollouts
    sched = schedule_dropping_trailing(ro, dropped=2)
    assert sched[3] == [len(SIZES) - 2]
    kw = dict(tis_mode="mask", tis_level="geometric", tis_upper_bound=1.05, tis_veto_threshold=1e-3,
              tis_rejected_denominator=denominator, get_mismatch_metrics=True)
    args = custom_loss_args(**kw) if hook == "custom" else slime_args(use_tis=True, **kw)
    (res,) = train_rollout(args, ro, w0, sched, Layout())
    dropped = {j for j, r in enumerate(ro.rollout_ids) if r in list(dict.fromkeys(ro.rollout_ids))[-2:]}
    assert dropped and not dropped & set(res.positions)
    w = res.w.clone().requires_grad_(True)
    want = oracle_step(args, ro, w, res.positions, sched[3][0], w0)
    (grad,) = torch.autograd.grad(want, w)
    assert float(res.loss) == pytest.approx(float(want), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(res.grad, grad, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------- #2258, #2010
VOCAB, TEMP = 11, 0.7


def _custom_loss(b, args, batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, sum(b.total_lengths) + 3, VOCAB, generator=g).requires_grad_(True)
    rsum = lambda x: sum((xi * m).sum() / m.sum() for xi, m in zip(x.split(b.response_lengths), b.masks))  # noqa: E731
    loss, metrics = reinforce_is_loss(args, batch, logits, rsum)
    (grad,) = torch.autograd.grad(loss, logits)
    return loss, grad, metrics


def test_zero_kl_coefficient_adds_no_kl_term_even_with_non_finite_reference():
    """slime's change keeps the KL metric at ``--kl-loss-coef 0`` but adds no term (and no gradient); the custom
    loss does the same, so a non-finite reference log-prob cannot reach the loss."""
    b = make_batch(7, vocab=VOCAB)
    batch = {"unconcat_tokens": b.tokens, "total_lengths": b.total_lengths, "response_lengths": b.response_lengths,
             "loss_masks": b.masks, "advantages": b.advantages, "rollout_log_probs": b.rollout}
    ref = [t.clone() for t in b.train]
    ref[0][0] = float("nan")
    common = dict(use_rollout_logprobs=True, rollout_temperature=TEMP, tis_mode="truncate", tis_level="token")
    loss0, grad0, _ = _custom_loss(b, args_ns(**common), batch)
    loss1, grad1, metrics = _custom_loss(b, args_ns(use_kl_loss=True, kl_loss_coef=0.0, **common),
                                         batch | {"ref_log_probs": ref})
    assert torch.equal(loss0, loss1) and torch.equal(grad0, grad1)
    assert "kl_loss" in metrics and bool(torch.isfinite(metrics["kl_loss"]))


def test_temperature_per_logit_chunk_gives_the_custom_losss_log_probs():
    """slime's change divides each sample's logit chunk by the temperature instead of the whole tensor; the log-probs
    of its forward (the step hook's counting pass) equal, bit for bit, those the custom loss computes."""
    from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy

    g = torch.Generator().manual_seed(3)
    logits, targets = torch.randn(9, VOCAB, generator=g), torch.randint(0, VOCAB, (9,), generator=g)
    chunks = [slice(0, 4), slice(4, 9)]
    per_chunk = torch.cat([torch.log_softmax(logits[c].div(TEMP), -1).gather(-1, targets[c, None])[:, 0]
                           for c in chunks])
    whole = torch.log_softmax(logits.div(TEMP), -1).gather(-1, targets[:, None])[:, 0]
    assert torch.equal(per_chunk, whole)
    ours, _ = vocab_parallel_log_probs_and_entropy(logits, targets, temperature=TEMP, tp_group=None,
                                                   with_entropy=False)
    torch.testing.assert_close(ours, whole, rtol=1e-6, atol=1e-6)  # float32 log-softmax, same operations


@pytest.mark.parametrize("mode", ["full", "replay"])
def test_sampling_support_key_is_refused_on_slime(mode):
    """slime computes the trainer's log-probs itself (and replays its own top-p support): the plugin's
    --tis-sampling-support cannot act there, so the key is refused in one line instead of being ignored."""
    with pytest.raises(ValueError, match=f"tis_sampling_support = '{mode}': slime computes") as e:
        tis_config_from_slime_args(slime_args(use_tis=True, tis_sampling_support=mode))
    assert "\n" not in str(e.value)
