"""The ``train_rl.py`` host under torchrun (gloo, CPU): DP=2, PP=2, TP=2 (and DP=2 with
``--calculate-per-token-loss``), unpacked rows and (DP=2, PP=2) sequence-packed bins, in one launch of
``megatron_rl_worker.py``, each against a single-process oracle
on the same tiny megatron-core GPT and global batch: every gradient shard to 1e-5 relative, the loss Megatron-LM's
``train_step`` logs (``lm loss``) to 1e-5 relative and every ``tis/*`` metric it logs to 1e-5 relative to
``max(|value|, 0.01)`` (float32 sums over a different split and reduction order; metrics that are differences of
log-probs, e.g. ``tis/kl`` near 0, keep an absolute float32 error of ~1e-7); under CP=2 the host refuses
packed bins in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
from _launch import torchrun  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]

CHECKS = [("dp2", "a2_seq_clip_bn_kl", False), ("pp2", "a2_seq_clip_bn_kl", False),
          ("tp2", "a2_seq_clip_bn_kl", False), ("dp2_pt", "a3_geo_mask_drop", False),
          ("tp2", "a3_geo_mask_drop", False), ("dp2", "a2_seq_clip_bn_kl", True), ("pp2", "a3_geo_mask_drop", True)]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("megatron_rl")
    # (a control that lets a bin's sequences attend to each other fails both packed checks)
    torchrun(HERE / "megatron_rl_worker.py", ["--out", str(out)], nproc=2, timeout=420, what="megatron_rl host")
    rows = []
    for f in sorted(out.glob("rank*.jsonl")):
        rows += [json.loads(line) for line in f.read_text().splitlines()]
    assert len(rows) == 2 * len(CHECKS) + 4
    print(json.dumps([{k: r.get(k) for k in ("layout", "case", "packed", "rank", "grad_err", "factor", "oracle")}
                      for r in rows]))
    return rows


@pytest.mark.parametrize("layout,case,packed", CHECKS,
                         ids=[f"{a}-{b}-{'packed' if p else 'unpacked'}" for a, b, p in CHECKS])
def test_host_step_equals_the_single_process_oracle(results, layout: str, case: str, packed: bool) -> None:
    mine = [r for r in results if r.get("layout") == layout and r["case"] == case and r["packed"] == packed]
    assert len(mine) == 2
    for r in mine:
        assert "error" not in r, r.get("error")
        assert r["finite"] and r["n_params"] > 0
        assert r["grad_err"] < 1e-5, (r["rank"], r["grad_err"], r["grad_err_param"])
    last = [r for r in mine if "loss" in r]
    assert last, "no last-stage rank reported"
    for r in last:
        assert abs(r["loss"] - r["oracle_loss"]) <= 1e-5 * max(1.0, abs(r["oracle_loss"])), r
        assert not r["missing"] and len(r["metric_errs"]) >= 5
        assert max(r["metric_errs"].values()) < 1e-5, r["metric_errs"]


def test_batch_normalisation_over_the_rollout_collection_under_dp2(results) -> None:
    """Algorithm 2's factor, taken once where the collection is prepared and reduced over DP=2, is the same on
    both ranks, in both optimizer steps, and equals ``count / sum`` of the core over the whole global batch
    (float32 sums in another order: 1e-6 relative)."""
    mine = [r for r in results if r.get("kind") == "rollout"]
    assert len(mine) == 2
    for r in mine:
        assert "error" not in r, r.get("error")
        assert r["steps"] == [r["factor"], r["factor"]]
        assert abs(r["factor"] - r["oracle"]) <= 1e-6 * abs(r["oracle"]), r
        assert abs(r["rank_only"] - r["oracle"]) > 1e-5 * abs(r["oracle"]), r   # control: the rank's own rows
    assert mine[0]["factor"] == mine[1]["factor"]


def test_context_parallelism_with_packed_bins_is_refused_under_cp2(results) -> None:
    """Under a real CP=2 layout the host's ``begin_rollout`` and ``forward_step`` on packed bins refuse on both
    ranks, in one line naming ``--context-parallel-size 2`` and ``--rl-use-sequence-packing`` (the host splits
    unpacked rows across CP ranks, not bins)."""
    mine = [r for r in results if r.get("kind") == "cp_refused"]
    assert len(mine) == 2
    for r in mine:
        assert "error" not in r, r.get("error")
        assert r["cp"] == 2 and len(r["messages"]) == 2
        for message in r["messages"]:
            assert message is not None and "\n" not in message
            assert message.startswith("--context-parallel-size 2 with --rl-use-sequence-packing: "), message
