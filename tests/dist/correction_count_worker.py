"""Correction passes and reductions of the Megatron hook per phase (tests/test_engine_correction_counts.py).

One gloo rank (TP = PP = CP = DP = 1), the harness's tiny GPT and 8-row batch: 2 rollouts, each trained for 2 epochs of
2 optimizer steps x 2 micro-batches; pi_old once per rollout (``compute_old_log_probs``). For each algorithm x
denominator and each training call (rollout, epoch, step): the corrections (``core.correction.correct``) and the reducer
calls of the step totals and of each loss call (``StepEngine.loss``). Writes ``counts.json`` into the directory given as
the only argument.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import torch.distributed as dist  # noqa: E402
from _harness import (  # noqa: E402
    SEQ,
    TEMPERATURE,
    build_ddp_chunks,
    forward_step,
    full_weights_and_log_probs,
    make_items,  # noqa: E402
)
from _plans import Layout  # noqa: E402
from _rollout_harness import clean_batch, step_rows  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

import slime_tis.core.correction as correction_mod  # noqa: E402
import slime_tis.core.losses as losses_mod  # noqa: E402
import slime_tis.engine.step as step_mod  # noqa: E402
from slime_tis import TISConfig  # noqa: E402
from slime_tis.core import LocalReducer  # noqa: E402
from slime_tis.megatron import rollout_step_iterator, tis_forward_backward_func  # noqa: E402

ROLLOUTS, EPOCHS, STEPS, M = 2, 2, 2, 2
ALGORITHMS = {0: dict(), 1: dict(use_rollout_log_probs=True), 2: dict(use_tis=True, batch_normalize=True),
              3: dict(use_rollout_log_probs=True, use_tis=True)}
RULES = dict(mode="mask", level="geometric", upper=1.3, veto_threshold=1e-3)

EVENTS: list[tuple[str, Counter]] = []
PHASE: list[str | None] = [None]


def add(what: str) -> None:
    if PHASE[0] is not None:
        EVENTS[-1][1][what] += 1


class CountingReducer(LocalReducer):
    def sequence_sum(self, x):
        add("collectives")
        return super().sequence_sum(x)

    def batch_sum(self, x, *, per_sequence: bool = False):
        add("collectives")
        return super().batch_sum(x, per_sequence=per_sequence)

    def batch_min(self, x):
        add("collectives")
        return super().batch_min(x)

    def batch_max(self, x):
        add("collectives")
        return super().batch_max(x)


def phase(name: str, fn):
    def wrapped(*a, **k):
        PHASE[0] = name
        EVENTS.append((name, Counter()))
        try:
            return fn(*a, **k)
        finally:
            PHASE[0] = None

    return wrapped


def main(out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=0, world_size=1)  # lives with out
    real = correction_mod.correct

    def counted(*a, **k):
        add("corrections")
        return real(*a, **k)

    correction_mod.correct = losses_mod.correct = counted
    step_mod.step_totals = phase("step", step_mod.step_totals)
    step_mod.StepEngine.loss = phase("loss", step_mod.StepEngine.loss)
    weights, lp_full = full_weights_and_log_probs()
    batch = clean_batch(lp_full)
    result = {}
    for algorithm, fields in ALGORITHMS.items():
        for denominator in ("keep", "drop"):
            rules = RULES if algorithm else {}  # algorithm 0 only diagnoses: no rule to configure
            cfg = TISConfig(**fields, **rules, rejected_denominator=denominator)
            ddps, _ = build_ddp_chunks(Layout(), weights)
            fb = tis_forward_backward_func(get_forward_backward_func(), cfg, temperature=TEMPERATURE, chunk_size=5,
                                           reducer=CountingReducer())
            calls = []
            for r in range(ROLLOUTS):
                items = []
                for s in range(STEPS):
                    items += make_items(batch, step_rows(1, 0, M, s))
                items = fb.compute_old_log_probs(forward_step_func=forward_step, data_iterator=iter(items),
                                                 model=ddps, num_microbatches=M, num_steps=STEPS, seq_length=SEQ,
                                                 micro_batch_size=2)
                for e in range(EPOCHS):
                    for s in range(STEPS):
                        for d in ddps:
                            d.zero_grad_buffer()
                        EVENTS.clear()
                        fb(forward_step_func=forward_step, data_iterator=rollout_step_iterator(items, s, M),
                           model=ddps, num_microbatches=M, seq_length=SEQ, micro_batch_size=2, forward_only=False)
                        calls.append({"rollout": r, "epoch": e, "step": s,
                                      "totals": [dict(c) for p, c in EVENTS if p == "step"],
                                      "loss": [dict(c) for p, c in EVENTS if p == "loss"]})
            result[f"{algorithm}-{denominator}"] = {"rollouts": ROLLOUTS, "epochs": EPOCHS, "steps": STEPS,
                                                    "micro_batches": M, "calls": calls}
    (out / "counts.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
