"""The hook under Megatron-LM's real ``megatron.training.training.train_step`` (megatron-core >= 0.17 wheels ship
``megatron.training``; the Python 3.12 CI leg runs these): what Megatron-LM logs (its ``loss_reduced``: the loss and
every ``tis/*`` / ``policy/*`` metric) equals the single-process oracle, and so does every gradient, as for the
direct wrapper (tests/dist/test_megatron_dist.py), at 1 process and at DP=2, PP=2, TP=2."""

from __future__ import annotations

import pytest
from _megatron_lm_real import available
from _plans import check_id, plan_checks
from test_megatron_dist import LAUNCH_TIMEOUT_S, _assert_matches_oracle, _of, _results

pytestmark = [pytest.mark.dist, pytest.mark.slow,
              pytest.mark.skipif(not available(), reason="megatron.training ships with megatron-core >= 0.17")]


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("check", plan_checks("train_step1"), ids=check_id)
def test_one_process_train_step_logs_the_oracle(check, tmp_path_factory):
    _assert_matches_oracle(_of(_results("train_step1", tmp_path_factory), check))


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("check", plan_checks("train_step2"), ids=check_id)
def test_two_processes_train_step_logs_the_oracle(check, tmp_path_factory):
    _assert_matches_oracle(_of(_results("train_step2", tmp_path_factory), check))
