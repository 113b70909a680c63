"""How often each host runs the correction, and how many reductions it issues, per rollout, step and micro-batch.

For every algorithm x denominator (``keep`` / ``drop``) x host (slime's hooks, the Megatron hook), one rollout
trained in several optimizer steps of several micro-batches, with ``core.correction.correct`` (what
``compute_tis`` and ``policy_loss`` run) and the reducer counted per phase:

* ``rollout``: slime's rollout-data hook (``postprocess_rollout_data``) / the Megatron rollout pass;
* ``step``: slime's before-train-step hook / the Megatron step totals;
* ``loss``: one micro-batch's loss call.

What must hold: no loss call corrects twice, the rollout hook corrects the rollout at most once (algorithm 2's
batch-normalisation factor), and a phase's reductions are the same for every micro-batch / step
(they depend on the configuration only). slime: each hook call is a translator over the step engine (``correct``
in the rollout hook, ``correct`` / ``loss`` and ``record`` in each micro-batch's loss, ``end`` at the metrics
flush). Megatron: the step totals correct each micro-batch where ``drop`` or algorithm 2's batch normalisation need
it (algorithms 1 and 3 at the pre-pass's ``lp_theta``: tests/test_engine_two_forwards.py), and each loss corrects
its own micro-batch once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from _slime_sim import Layout, custom_loss_args, initial_weights, make_rollouts, schedule, slime_args, train_rollout

import slime_tis.core.correction as correction_mod
import slime_tis.core.losses as losses_mod
import slime_tis.slime as plugin
from slime_tis.core import LocalReducer
from slime_tis.engine.parallel import ParallelContext
from slime_tis.engine.step import StepEngine

STEP_HOOK = "slime_tis.slime.before_train_step"
RULES0: dict = {}  # algorithm 0 only diagnoses: no rule to configure
RULES = dict(tis_mode="mask", tis_level="geometric", tis_upper_bound=1.3, tis_veto_threshold=1e-3)


class Counts:
    """Corrections and reductions per phase event (``rollout``, ``step``, ``loss``), in call order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Counter]] = []
        self.phase: str | None = None

    def begin(self, phase: str) -> None:
        self.phase = phase
        self.events.append((phase, Counter()))

    def add(self, what: str) -> None:
        if self.events and self.phase is not None:
            self.events[-1][1][what] += 1

    def of(self, phase: str) -> list[Counter]:
        return [c for p, c in self.events if p == phase]


class CountingReducer(LocalReducer):
    """The single-process reducer, counting each call as one collective of the phase."""

    def __init__(self, counts: Counts) -> None:
        self.counts = counts

    def sequence_sum(self, x):
        self.counts.add("collectives")
        return super().sequence_sum(x)

    def batch_sum(self, x, *, per_sequence: bool = False):
        self.counts.add("collectives")
        return super().batch_sum(x, per_sequence=per_sequence)

    def batch_min(self, x):
        self.counts.add("collectives")
        return super().batch_min(x)

    def batch_max(self, x):
        self.counts.add("collectives")
        return super().batch_max(x)


def _count_corrections(monkeypatch, counts: Counts) -> None:
    real = correction_mod.correct

    def counted(*a, **k):
        counts.add("corrections")
        return real(*a, **k)

    monkeypatch.setattr(correction_mod, "correct", counted)  # compute_tis
    monkeypatch.setattr(losses_mod, "correct", counted)  # policy_loss


def _count_engine(monkeypatch, counts: Counts) -> None:
    """Count every call of the step engine's protocol."""
    for name in ("begin", "correct", "loss", "record", "end"):
        real = getattr(StepEngine, name)

        def call(self, *a, _real=real, _name=name, **k):
            counts.add(f"engine.{_name}")
            return _real(self, *a, **k)

        monkeypatch.setattr(StepEngine, name, call)


def _phase(monkeypatch, counts: Counts, name: str, phase: str) -> None:
    fn = getattr(plugin, name)

    def wrapped(*a, **k):
        counts.begin(phase)
        try:
            return fn(*a, **k)
        finally:
            counts.phase = None

    monkeypatch.setattr(plugin, name, wrapped)


SLIME_CASES = {
    # algorithm: slime args (two optimizer steps; drop: one-sample rollouts, each counted in its micro-batch)
    0: lambda d: slime_args(get_mismatch_metrics=True, tis_rejected_denominator=d, **RULES0),
    1: lambda d: slime_args(use_rollout_logprobs=True, get_mismatch_metrics=True, tis_rejected_denominator=d,
                            **RULES),
    2: lambda d: slime_args(use_tis=True, get_mismatch_metrics=True, tis_rejected_denominator=d,
                            tis_batch_normalize=True, **RULES),
    3: lambda d: custom_loss_args(custom_megatron_before_train_step_hook_path=STEP_HOOK, tis_rejected_denominator=d,
                                  **RULES),
}


def _slime_counts(monkeypatch, args, sizes: list[int], steps: int) -> Counts:
    counts = Counts()
    _count_corrections(monkeypatch, counts)
    _count_engine(monkeypatch, counts)
    ctx = ParallelContext(0, 1, CountingReducer(counts))
    for mod in ("loss_hook", "tis_hook", "postprocess"):
        monkeypatch.setattr(f"slime_tis.slime.{mod}.parallel_context", lambda: ctx)
    monkeypatch.setattr("slime_tis.engine.parallel.parallel_context", lambda: ctx)
    _phase(monkeypatch, counts, "postprocess_rollout_data", "rollout")
    _phase(monkeypatch, counts, "before_train_step", "step")
    _phase(monkeypatch, counts, "reinforce_is_loss", "loss")
    _phase(monkeypatch, counts, "compute_tis_for_slime", "loss")
    w0 = initial_weights(1)
    ro = make_rollouts(3, sizes, w0, nan_trap=False)
    train_rollout(args, ro, w0, schedule(ro, steps=steps, micro_batch_size=1), Layout())
    counts.begin("flush")
    plugin.COLLECTOR.flush()  # the last step's metrics
    counts.phase = None
    return counts


def _check(counts: Counts, *, micro_batches: int, rollout_max: int, custom: bool) -> dict:
    """``custom``: slime's loss is the custom loss (else its PPO loss with the TIS function)."""
    loss = counts.of("loss")
    assert len(loss) == micro_batches
    assert {c["corrections"] for c in loss} == {1}, "a micro-batch's loss corrected more than once"
    assert len({c["collectives"] for c in loss}) == 1, "reductions per micro-batch depend on the data"
    # every loss call goes through the step engine: the custom loss's loss (and, where drop counts in the
    # micro-batch, the correction it applies) or the TIS function's correction, and one record; the metrics flush
    # is the engine's end
    assert {c["engine.loss"] for c in loss} == {int(custom)}
    assert {c["engine.correct"] for c in loss} <= ({0, 1} if custom else {1})
    assert {c["engine.record"] for c in loss} == {1}
    assert {c["engine.begin"] for c in loss} == {0}
    flush = counts.of("flush")[-1]
    assert flush["engine.end"] == 1 and flush["collectives"] > 0
    rollout = counts.of("rollout")
    assert len(rollout) == 1 and rollout[0]["corrections"] <= rollout_max
    steps = counts.of("step")
    return {"rollout": dict(rollout[0]), "step": [dict(c) for c in steps], "loss per micro-batch": dict(loss[0])}


@pytest.mark.parametrize("denominator", ["keep", "drop"])
@pytest.mark.parametrize("algorithm", [0, 1, 2, 3])
def test_slime_corrects_each_micro_batch_once(monkeypatch, algorithm, denominator):
    """slime host: 8 rollouts (keep: of 1-4 samples; drop: of one sample), 2 optimizer steps, one sample per
    micro-batch."""
    sizes = [1, 2, 3, 2, 4, 1, 2, 3] if denominator == "keep" else [1] * 8
    counts = _slime_counts(monkeypatch, SLIME_CASES[algorithm](denominator), sizes, steps=2)
    # the rollout hook corrects once where algorithm 2 normalises, never twice
    table = _check(counts, micro_batches=sum(sizes), rollout_max=1, custom=algorithm == 3)
    assert table["rollout"].get("corrections", 0) == int(algorithm == 2)
    assert table["rollout"].get("engine.correct", 0) == int(algorithm == 2)
    assert [c.get("corrections", 0) for c in counts.of("step")] == ([0, 0] if algorithm == 3 else [])
    if algorithm == 3:  # drop: the keep mask that sets the per-rollout coefficients is the loss's one correction
        assert {c["engine.correct"] for c in counts.of("loss")} == {int(denominator == "drop")}
    print(json.dumps({"host": "slime", "algorithm": algorithm, "denominator": denominator, **table}))


CHILD = Path(__file__).parent / "dist" / "correction_count_worker.py"


@pytest.fixture(scope="module")
def megatron_counts(tmp_path_factory):
    """Every algorithm x denominator through the Megatron hook: one gloo rank in a child process (a fresh
    torch.distributed state), two rollouts of two epochs of two optimizer steps of two micro-batches each."""
    out = tmp_path_factory.mktemp("counts")
    proc = subprocess.run([sys.executable, str(CHILD), str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "counts.json").read_text())


@pytest.mark.parametrize("denominator", ["keep", "drop"])
@pytest.mark.parametrize("algorithm", [0, 1, 2, 3])
def test_megatron_corrects_each_micro_batch_once(megatron_counts, algorithm, denominator):
    """Every loss call corrects its micro-batch once; the step totals correct each micro-batch once more where
    ``drop`` or algorithm 2's batch normalisation (on in both of its rows here) need it before the first loss
    (algorithms 1 and 3 at the pre-pass's ``lp_theta``, a second forward). The reductions of a loss call are the
    same in every call."""
    rows = megatron_counts[f"{algorithm}-{denominator}"]
    m, steps, epochs, rollouts = rows["micro_batches"], rows["steps"], rows["epochs"], rows["rollouts"]
    calls = rows["calls"]
    assert len(calls) == rollouts * epochs * steps
    in_totals = denominator == "drop" or algorithm == 2
    loss_collectives = set()
    for call in calls:
        assert len(call["totals"]) == 1 and len(call["loss"]) == m
        totals, loss = call["totals"][0], call["loss"]
        assert totals.get("corrections", 0) == (m if in_totals else 0), call
        assert [c.get("corrections", 0) for c in loss] == [1] * m, call
        loss_collectives |= {c["collectives"] for c in loss}
    assert len(loss_collectives) == 1, "reductions per micro-batch loss depend on the data"
    per_rollout = sum(c["totals"][0].get("corrections", 0) + sum(x.get("corrections", 0) for x in c["loss"])
                      for c in calls) // rollouts
    expect = epochs * steps * m * (2 if in_totals else 1)
    assert per_rollout == expect
    print(json.dumps({"host": "megatron", "algorithm": algorithm, "denominator": denominator,
                      "corrections per rollout": per_rollout, "first call": calls[0], "later epoch": calls[-1]}))


def test_counting_reducer_counts_every_reduction():
    counts = Counts()
    counts.begin("loss")
    r = CountingReducer(counts)
    r.sequence_sum(torch.ones(2))
    r.batch_sum(torch.ones(()), per_sequence=True)
    r.batch_min(torch.ones(()))
    r.batch_max(torch.ones(()))
    assert counts.of("loss") == [Counter(collectives=4)]
