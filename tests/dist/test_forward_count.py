"""Model forwards per optimizer step through the hook (1 process, real megatron-core GPT, M = 2 micro-batches).

One step per rollout (the default; slime's ``can_reuse_log_probs`` case): pi_old is the step's own policy, so the
default path takes it from the training forward and costs no extra forward pass; only configurations whose plan
needs pi_old (or algorithms 1/3's lp_theta) of the whole step before the first loss (``drop`` with a rejecting
rule, algorithm 2's batch normalisation) run a forward-only pass. Two steps per rollout: pi_old once per rollout
(``compute_old_log_probs``: one forward per micro-batch of the rollout), then M forwards per step (2M where
algorithms 1/3 need the pre-pass)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
from _launch import torchrun  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    out = tmp_path_factory.mktemp("forward_count") / "counts.jsonl"
    torchrun(HERE / "forward_count_worker.py", ["--out", str(out)], nproc=1, timeout=420, what="forward count")
    return {(r["alg"], r["den"], r["steps"]): r for r in map(json.loads, out.read_text().splitlines())}


@pytest.mark.timeout(480)
@pytest.mark.parametrize("alg", [0, 1, 2, 3])
@pytest.mark.parametrize("den", ["keep", "drop"])
def test_forwards_per_step(counts, alg, den):
    m = 2
    one = counts[(alg, den, 1)]
    two = counts[(alg, den, 2)]
    # a forward-only pass before the first loss only where the plan needs the whole step's log-probs: drop with
    # geometric masking rejects (every algorithm but 0, whose drop sees only non-finite data, still needs pi_old)
    pre_pass = den == "drop"
    assert one["rollout_pass"] == 0
    assert one["per_step"] == [m * (2 if pre_pass else 1)], one
    # several steps per rollout: pi_old once per rollout for algorithms 0 and 2, never per step
    assert two["rollout_pass"] == (2 * m if alg in (0, 2) else 0), two
    assert two["per_step"] == [m * (2 if pre_pass and alg in (1, 3) else 1)] * 2, two
