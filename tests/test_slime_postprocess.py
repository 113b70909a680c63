"""``slime_tis.slime.postprocess_rollout_data``: global batch normalisation across micro-batches, and dumps."""

from __future__ import annotations

import pytest
import torch
from _slime_oracle import SlimeBatch, args_ns, make_batch

from slime_tis import TISConfig, compute_tis
from slime_tis.slime import compute_tis_for_slime, postprocess_rollout_data
from slime_tis.slime.state import STATE
from slime_tis.tools.dump import read_logprob_dump


def rollout_data(b: SlimeBatch) -> dict:
    return {"log_probs": b.train, "rollout_log_probs": b.rollout, "loss_masks": b.masks,
            "total_lengths": b.total_lengths, "response_lengths": b.response_lengths,
            "rewards": [float(i) for i in range(len(b.masks))]}


def sub(b: SlimeBatch, idx: list[int]) -> SlimeBatch:
    pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
    return SlimeBatch(pick(b.prompt_lengths), pick(b.response_lengths), pick(b.train), pick(b.rollout),
                      pick(b.masks), pick(b.pg_loss), pick(b.advantages), pick(b.tokens))


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_global_batch_norm_over_micro_batches_matches_core_on_the_whole_batch(level):
    b = make_batch(11)
    kw = dict(use_tis=True, tis_mode="truncate", tis_level=level, tis_upper_bound=1.5, tis_batch_normalize=True)
    args = args_ns(**kw)
    postprocess_rollout_data(args, 4, rollout_data(b))
    assert STATE.rollout_id == 4 and STATE.batch_norm_factor is not None

    # the loss sees the rollout in two micro-batches; weights must be those of the whole-batch normalisation
    weights = []
    for idx in ([0, 1, 2], [3, 4, 5]):
        mb = sub(b, idx)
        _, _, metrics = compute_tis_for_slime(
            args, pg_loss=mb.packed("pg_loss"), train_log_probs=mb.train, rollout_log_probs=mb.rollout,
            loss_masks=mb.masks, total_lengths=mb.total_lengths, response_lengths=mb.response_lengths)
        weights.append(metrics["tis/weight"])
    cfg = TISConfig(use_tis=True, mode="truncate", level=level, upper=1.5, batch_normalize=True,
                    loss_agg="seq-mean-token-mean")
    ref = compute_tis(cfg, b.packed("train"), b.packed("rollout"), b.packed("masks"), b.cu_seqlens())
    torch.testing.assert_close(torch.cat(weights), ref.weights, rtol=1e-6, atol=1e-7)
    kept = ref.keep_mask
    if level == "token":
        assert float(ref.weights[kept].mean()) == pytest.approx(1.0, rel=1e-6)
    else:  # one weight per kept sequence
        seq_w = torch.zeros(len(b.masks)).index_add_(0, ref.ratios.seq_id, ref.weights)
        seq_w = seq_w / ref.ratios.seq_count.clamp(min=1)
        ok = ref.ratios.seq_ok
        assert float(seq_w[ok].mean()) == pytest.approx(1.0, rel=1e-6)


def test_nothing_to_do_clears_state(tmp_path):
    b = make_batch(12)
    postprocess_rollout_data(args_ns(use_tis=True, tis_batch_normalize=True), 1, rollout_data(b))
    assert STATE.batch_norm_factor is not None
    postprocess_rollout_data(args_ns(use_tis=True), 2, rollout_data(b))
    assert STATE.batch_norm_factor is None


def test_missing_recompute_is_a_clear_error():
    b = make_batch(13)
    data = rollout_data(b)
    del data["log_probs"]
    with pytest.raises(ValueError, match="add --get-mismatch-metrics .*to force the recompute"):
        postprocess_rollout_data(args_ns(use_tis=True, tis_batch_normalize=True), 0, data)


def test_dump_is_written_in_the_documented_format(tmp_path):
    b = make_batch(14)
    args = args_ns(use_tis=True, tis_dump_dir=str(tmp_path))
    postprocess_rollout_data(args, 3, rollout_data(b))
    postprocess_rollout_data(args, 4, rollout_data(b))
    dump = read_logprob_dump(tmp_path / "logprobs_dp0.jsonl")
    assert dump.n_seq == 2 * len(b.masks)
    assert dump.step.tolist() == [3] * 6 + [4] * 6
    assert dump.reward.tolist() == [0.0, 1, 2, 3, 4, 5] * 2
    torch.testing.assert_close(dump.train_log_probs, torch.cat([b.packed("train")] * 2), equal_nan=True)
    torch.testing.assert_close(dump.rollout_log_probs, torch.cat([b.packed("rollout")] * 2), equal_nan=True)
    assert dump.loss_mask.tolist() == (torch.cat([b.packed("masks")] * 2) != 0).tolist()
    assert dump.meta["train_policy"] == "old" and dump.meta["algorithm"] == 2


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_norm_factor_leaves_out_samples_with_non_finite_advantages(level):
    """A sample whose advantages are non-finite at a valid token is rejected by the loss, so the
    rollout-level batch-norm factor leaves it out as well (``extra_finite`` = the advantages)."""
    b = make_batch(14)
    b.advantages[5][1] = float("nan")
    kw = dict(use_tis=True, tis_mode="truncate", tis_level=level, tis_upper_bound=1.5, tis_batch_normalize=True)
    postprocess_rollout_data(args_ns(**kw), 7, {**rollout_data(b), "advantages": b.advantages})
    cfg = TISConfig(use_tis=True, mode="truncate", level=level, upper=1.5)
    ref = compute_tis(cfg, b.packed("train"), b.packed("rollout"), b.packed("masks"), b.cu_seqlens(),
                      extra_finite=(b.packed("advantages"),))
    expected = ref.norm_count / ref.norm_sum
    torch.testing.assert_close(STATE.batch_norm_factor.reshape(()), expected.reshape(()), rtol=1e-6, atol=0)
    without = compute_tis(cfg, b.packed("train"), b.packed("rollout"), b.packed("masks"), b.cu_seqlens())
    assert float(without.norm_count) > float(ref.norm_count)  # the NaN sample did count without the check
