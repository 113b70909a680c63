"""torchrun entry point (1 process): model forwards per optimizer step through the hook, per algorithm and
denominator, with one step per rollout (``pi_old="auto"``) and with two steps per rollout (pi_old once per rollout
by ``compute_old_log_probs``). Writes one JSON line per configuration to ``--out``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from _harness import (
    SEQ,
    TEMPERATURE,
    build_ddp_chunks,
    forward_step,
    full_weights_and_log_probs,
    init_distributed,
    make_global_batch,
    make_items,
    row_assignment,
)
from _plans import LAYOUTS
from megatron.core.pipeline_parallel import get_forward_backward_func

from slime_tis import TISConfig
from slime_tis.megatron import rollout_step_iterator, tis_forward_backward_func

ALGS = {0: {}, 1: {"use_rollout_log_probs": True}, 2: {"use_tis": True},
        3: {"use_rollout_log_probs": True, "use_tis": True}}
DENOMINATORS = {"keep": {}, "drop": {"rejected_denominator": "drop", "mode": "mask", "level": "geometric"}}
M = 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    init_distributed()
    torch.set_num_threads(1)
    weights, lp_full = full_weights_and_log_probs()
    batch = make_global_batch(lp_full)
    rows = row_assignment(1, 0, M)
    with open(out, "w") as fh:
        for alg, alg_kw in ALGS.items():
            for den, den_kw in DENOMINATORS.items():
                if alg == 0 and den == "drop":
                    den_kw = {"rejected_denominator": "drop"}  # algorithm 0 has no mode
                cfg = TISConfig(**alg_kw, **den_kw)
                for steps in (1, 2):
                    ddps, _ = build_ddp_chunks(LAYOUTS["single"], weights)
                    calls = [0]

                    def counting(data_iterator, model, *a, calls=calls, **kw):
                        calls[0] += 1
                        return forward_step(data_iterator, model)

                    fb = tis_forward_backward_func(get_forward_backward_func(), cfg, temperature=TEMPERATURE)
                    kw = dict(model=ddps, seq_length=SEQ, micro_batch_size=len(rows[0]))
                    per_step = []
                    items = [make_items(batch, rows) for _ in range(steps)]
                    data = [it for step_items in items for it in step_items]
                    if steps > 1:
                        data = fb.compute_old_log_probs(forward_step_func=counting, data_iterator=iter(data),
                                                        num_microbatches=M, num_steps=steps, **kw)
                    rollout_pass = calls[0]
                    for s in range(steps):
                        before = calls[0]
                        it = rollout_step_iterator(data, s, M) if steps > 1 else iter(data)
                        losses = fb(forward_step_func=counting, data_iterator=it, num_microbatches=M,
                                    forward_only=False, **kw)
                        assert all(torch.isfinite(d["loss"]).all() for d in losses)
                        per_step.append(calls[0] - before)
                    fh.write(json.dumps({"alg": alg, "den": den, "steps": steps, "rollout_pass": rollout_pass,
                                         "per_step": per_step, "M": M}) + "\n")


if __name__ == "__main__":
    main()
