"""``tis_record_train_log_probs``: the algorithm-3 custom loss records the training log-probs it computes.

Checked: the dump written outside the loss (by the next rollout-data hook call, or the explicit flush) holds
the log-probs the loss used, full length, for every sample of the rollout split over two micro-batches; a
replayed micro-batch (``--recompute-loss-function``) does not overwrite them; slime's own capture receives
them (a model of ``_maybe_capture_log_probs``, THUDM/slime 624b824 ``slime/backends/megatron_utils/loss.py``).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from _slime_oracle import args_ns, make_batch, slime_sum_of_sample_mean

from slime_tis.slime import flush_recorded_train_log_probs, postprocess_rollout_data, reinforce_is_loss
from slime_tis.slime.state import STATE
from slime_tis.tools.dump import read_logprob_dump

VOCAB = 11


def setup(tmp_path, **kw):
    b = make_batch(13, vocab=VOCAB)
    opts = dict(use_rollout_logprobs=True, loss_type="custom_loss", tis_mode="truncate", tis_level="token",
                custom_loss_function_path="slime_tis.slime.reinforce_is_loss", tis_record_train_log_probs=True,
                tis_dump_dir=str(tmp_path))
    args = args_ns(**(opts | kw))
    return b, args


def run_loss(args, mb, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, sum(mb.total_lengths) + 2, VOCAB, generator=g)
    batch = {"unconcat_tokens": mb.tokens, "total_lengths": mb.total_lengths, "response_lengths": mb.response_lengths,
             "loss_masks": mb.masks, "advantages": mb.advantages, "rollout_log_probs": mb.rollout}
    reinforce_is_loss(args, batch, logits, lambda x: slime_sum_of_sample_mean(x, mb, mb.masks, 0, 1))
    lps, off = [], 0
    lp_all = torch.log_softmax(logits[0], -1)
    for t, r, toks in zip(mb.total_lengths, mb.response_lengths, mb.tokens):
        p = t - r
        lps.append(lp_all[off + p - 1:off + t - 1].gather(-1, toks[p:, None]).squeeze(-1))
        off += t
    return lps


def test_recorded_log_probs_reach_the_dump_outside_the_loss(tmp_path):
    b, args = setup(tmp_path)
    postprocess_rollout_data(args, 3, b.rollout_data())  # no pi_old (no recompute): no error, recording starts
    expect = run_loss(args, b.subset([0, 1, 2]), seed=1) + run_loss(args, b.subset([3, 4, 5]), seed=2)
    run_loss(args, b.subset([3, 4, 5]), seed=9)  # a replay of the second micro-batch: first occurrence wins
    assert not list(tmp_path.iterdir())  # nothing written inside the loss
    postprocess_rollout_data(args, 4, b.rollout_data())  # the next rollout writes the previous one
    dump = read_logprob_dump(tmp_path / "logprobs_theta_dp0.jsonl")
    assert dump.meta["train_policy"] == "theta_first_forward" and dump.meta["algorithm"] == 3
    torch.testing.assert_close(dump.train_log_probs, torch.cat(expect))
    torch.testing.assert_close(dump.rollout_log_probs, b.packed("rollout"), equal_nan=True)
    assert dump.loss_mask.tolist() == (b.packed("masks") != 0).tolist()
    # rollout 4 saw no loss call: flushing writes nothing more
    assert flush_recorded_train_log_probs(args) == 0
    assert len(read_logprob_dump(tmp_path / "logprobs_theta_dp0.jsonl").train_log_probs) == sum(b.response_lengths)


@pytest.mark.parametrize("opts", [dict(tis_record_train_log_probs=True), dict(tis_record_train_log_probs=False,
                                                                           save_debug_train_data="/x/{rollout_id}.pt")])
def test_recording_feeds_slimes_own_capture(tmp_path, monkeypatch, opts):
    """slime keys its capture by ``batch['partition']`` (global rollout positions) and keeps the first value."""
    captured: dict[int, torch.Tensor] = {}

    def maybe_capture(batch, log_probs):  # model of slime 624b824 loss._maybe_capture_log_probs
        for position, lp in zip(batch.get("partition") or [], log_probs, strict=True):
            captured.setdefault(position, lp.detach().clone())

    fake = types.ModuleType("slime.backends.megatron_utils.loss")
    fake._maybe_capture_log_probs = maybe_capture
    for name in ("slime", "slime.backends", "slime.backends.megatron_utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "slime.backends.megatron_utils.loss", fake)
    sys.modules["slime.backends.megatron_utils"].loss = fake

    b, args = setup(tmp_path, tis_dump_dir=None, **opts)
    mb = b.subset([1, 4])
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, sum(mb.total_lengths), VOCAB, generator=g)
    batch = {"unconcat_tokens": mb.tokens, "total_lengths": mb.total_lengths, "response_lengths": mb.response_lengths,
             "loss_masks": mb.masks, "advantages": mb.advantages, "rollout_log_probs": mb.rollout,
             "partition": [11, 14]}
    STATE.recorder.clear()  # without the rollout-data hook only slime's capture gets the values
    reinforce_is_loss(args, batch, logits, lambda x: slime_sum_of_sample_mean(x, mb, mb.masks, 0, 1))
    assert sorted(captured) == [11, 14]
    assert [len(captured[k]) for k in (11, 14)] == [b.response_lengths[1], b.response_lengths[4]]
    assert STATE.recorder.recorded(mb.masks[0]) is None


def test_without_the_option_nothing_is_recorded(tmp_path):
    b, args = setup(tmp_path, tis_record_train_log_probs=False, tis_dump_dir=None)
    postprocess_rollout_data(args, 0, b.rollout_data())
    run_loss(args, b, seed=1)
    assert STATE.recorder.rollout is None and STATE.recorder.recorded(b.masks[0]) is None


def test_dump_without_pi_old_still_names_the_fix(tmp_path):
    b, args = setup(tmp_path, tis_record_train_log_probs=False)
    with pytest.raises(ValueError, match="tis_record_train_log_probs: true"):
        postprocess_rollout_data(args, 0, b.rollout_data())
