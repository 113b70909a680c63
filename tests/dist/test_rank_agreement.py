"""Ranks that disagree fail fast and alike (real torchrun processes, gloo; ``agreement_worker.py``).

* Settings: rank 0 and rank 1 start the megatron hook with a different ``--tis-loss-agg`` (under CP=2 the
  denominator is then reduced over different groups: a deadlock), ``--tis-rejected-denominator`` (a silently
  mixed denominator) or hook temperature, or slime's rollout-data hook with batch normalisation on one rank
  only (an all-reduce on that rank only: a deadlock). Every rank must raise a ``ValueError`` naming the
  setting in its first call, before any collective that depends on it; equal resolved settings
  (``upper=None`` and ``upper=2.0``; ``True`` and the YAML string ``"true"``) pass.
* Steps: rank 0's first call raises before any collective and its launcher goes on, so its second call pairs
  its collectives with rank 1's first. Both must raise a ``RuntimeError`` saying the calls are out of step.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
from _launch import rank_outputs, torchrun  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]

#: a deadlock (the behaviour these checks replace) turns into a failure after this long
LAUNCH_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("agreement")
    torchrun(HERE / "agreement_worker.py", ["--out", str(out)], nproc=2, timeout=LAUNCH_TIMEOUT_S,
             what="rank agreement")
    return rank_outputs(out, 2)


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("scenario, label, values", [
    ("loss_agg", "--tis-loss-agg (loss_agg)", ("'token-mean'", "'seq-mean-token-mean'")),
    ("rejected_denominator", "--tis-rejected-denominator (rejected_denominator)", ("'keep'", "'drop'")),
    ("temperature", "tis_forward_backward_func(temperature=)", ("0.8", "1.0")),
    ("slime_batch_normalize", "--tis-batch-normalize (batch_normalize)", ("True", "False")),
])
def test_different_settings_fail_on_every_rank_naming_the_setting(ranks, scenario, label, values):
    for rank, res in enumerate(r[scenario] for r in ranks):
        assert "ok" not in res, f"rank {rank} finished a step with settings that differ across ranks"
        (err,) = res["errors"]
        assert err["error"] == "ValueError", err
        msg = err["message"]
        assert f"{label}: {values[rank]} on this rank (rank {rank}); the ranks split into 2 groups by its value: " \
               "[0] / [1]" in msg
        # only the differing setting is named (the others agree)
        assert msg.count("this rank") == 1, msg


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_equal_resolved_settings_pass(ranks):
    for res in (r["same_settings"] for r in ranks):
        assert "errors" not in res and res["calls"] == 2
        assert res["ok"]["loss"] == ranks[0]["same_settings"]["ok"]["loss"]  # the same all-reduced value
    for res in (r["slime_same_settings"] for r in ranks):  # True and the YAML string "true"
        assert "errors" not in res and "ok" in res, res


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("scenario", ["step_raised_on_one_rank", "step_raised_new_hook_per_call"])
def test_a_rank_that_went_on_after_its_step_raised_fails_both_ranks(ranks, scenario):
    r0, r1 = (r[scenario] for r in ranks)
    assert [e["error"] for e in r0["errors"]] == ["ValueError", "RuntimeError"], r0
    assert "injected" in r0["errors"][0]["message"]
    assert [e["error"] for e in r1["errors"]] == ["RuntimeError"], r1
    assert "ok" not in r0 and "ok" not in r1, "a call paired with another call's collectives returned"
    # call numbers count every training call of the process (earlier scenarios included): rank 0 is ahead (by
    # one more for every earlier scenario whose step raised on rank 0 only: out of step stays out of step)
    calls = []
    for msg in (r0["errors"][1]["message"], r1["errors"][0]["message"]):
        m = re.search(r"training calls out of step .*: this rank is in call (\d+), the ranks in calls (\d+) to (\d+)",
                      msg)
        assert m, msg
        calls.append(tuple(map(int, m.groups())))
    (c0, low, high), (c1, low1, high1) = calls
    assert c0 > c1 and (low, high) == (low1, high1) == (c1, c0), calls
