"""The exact-metrics path of the slime hooks: micro-batches merged, loss-recompute replays counted once,
true min/max, and ``log_exact_metrics`` as slime's before-train-step hook."""

from __future__ import annotations

import json

import pytest
import torch
from _slime_oracle import SlimeBatch, args_ns, make_batch, slime_sum_of_sample_mean
from torch.utils.checkpoint import checkpoint

from slime_tis import TISConfig, compute_tis
from slime_tis.slime import COLLECTOR, compute_tis_for_slime, log_exact_metrics, reinforce_is_loss


def sub(b: SlimeBatch, idx: list[int]) -> SlimeBatch:
    pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
    return SlimeBatch(pick(b.prompt_lengths), pick(b.response_lengths), pick(b.train), pick(b.rollout),
                      pick(b.masks), pick(b.pg_loss), pick(b.advantages), pick(b.tokens))


def hook(args, mb):
    return compute_tis_for_slime(args, pg_loss=mb.packed("pg_loss"), train_log_probs=mb.train,
                                 rollout_log_probs=mb.rollout, loss_masks=mb.masks, total_lengths=mb.total_lengths,
                                 response_lengths=mb.response_lengths)


def test_micro_batches_merge_to_the_whole_batch_and_replays_count_once(tmp_path):
    COLLECTOR.flush()
    b = make_batch(31)
    args = args_ns(use_tis=True, tis_mode="clip", tis_level="token", tis_upper_bound=1.2,
                   tis_veto_threshold=1e-3, tis_metrics_path=str(tmp_path / "m.jsonl"))
    first, second = sub(b, [0, 1, 2]), sub(b, [3, 4, 5])
    hook(args, first)
    hook(args, first)  # activation checkpointing replays the loss function in backward
    hook(args, second)
    got = log_exact_metrics(args, 3, 0)
    cfg = TISConfig(use_tis=True, mode="clip", level="token", upper=1.2, veto_threshold=1e-3,
                    loss_agg="seq-mean-token-mean")
    ref = compute_tis(cfg, b.packed("train"), b.packed("rollout"), b.packed("masks"), b.cu_seqlens(),
                      extra_finite=(b.packed("pg_loss"),))
    expect = {k: float(v) for k, v in ref.stats.finalize().items()}
    assert got == pytest.approx(expect, rel=1e-5, abs=1e-6)  # float32 sums in another order
    assert got["tis/ratio_min"] < 1e-3  # the catastrophic token: a true minimum, not an average
    line = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[0])
    assert line["rollout_id"] == 3 and line["tis/kl"] == pytest.approx(expect["tis/kl"], rel=1e-6)
    assert COLLECTOR.flush() == {}  # reset after the flush


def test_slime_average_of_minima_differs_from_the_true_minimum():
    """Why the exact path exists: slime's reducer averages what it is given."""
    COLLECTOR.flush()
    b = make_batch(32)
    args = args_ns(use_tis=True, tis_mode="truncate", tis_level="token")
    _, _, metrics = hook(args, b)
    exact = COLLECTOR.flush()
    per_sample_mean_ratio = float(slime_sum_of_sample_mean(metrics["tis/ratio"], b, b.masks, 0, 1)) / len(b.masks)
    assert exact["tis/ratio_min"] < 1e-3 < per_sample_mean_ratio
    assert "tis/ratio_min" not in metrics and "tis/ratio_max" not in metrics


def test_reinforce_is_loss_under_activation_checkpointing():
    """slime wraps the loss in torch.utils.checkpoint with --recompute-loss-function: same loss and
    gradient, statistics counted once."""
    COLLECTOR.flush()
    b = make_batch(33, vocab=9)
    batch = {"unconcat_tokens": b.tokens, "total_lengths": b.total_lengths, "response_lengths": b.response_lengths,
             "loss_masks": b.masks, "advantages": b.advantages, "rollout_log_probs": b.rollout}
    args = args_ns(use_rollout_logprobs=True, tis_mode="truncate", tis_level="sequence")
    reducer = lambda x: slime_sum_of_sample_mean(x, b, b.masks, 0, 1)  # noqa: E731
    base = torch.randn(1, sum(b.total_lengths), 9, generator=torch.Generator().manual_seed(1))
    plain = base.clone().requires_grad_(True)
    loss_plain, _ = reinforce_is_loss(args, batch, plain, reducer)
    loss_plain.backward()
    stats_plain = COLLECTOR.flush()
    ckpt = base.clone().requires_grad_(True)
    loss_ckpt, _ = checkpoint(reinforce_is_loss, args, batch, ckpt, reducer, use_reentrant=False)
    loss_ckpt.backward()
    stats_ckpt = COLLECTOR.flush()
    assert float(loss_ckpt) == pytest.approx(float(loss_plain), rel=1e-6)
    torch.testing.assert_close(ckpt.grad, plain.grad)
    assert stats_ckpt == pytest.approx(stats_plain, rel=1e-9)
    assert stats_ckpt["tis/num_seqs"] == stats_plain["tis/num_seqs"] == 6  # counted once, not twice
    assert stats_ckpt["tis/nonfinite_seq_fraction"] == pytest.approx(1 / 6)
