"""Worker of ``test_rank_agreement.py``: ranks that disagree, and a rank that went on after its step raised.

    torchrun --nproc-per-node 2 tests/dist/agreement_worker.py --out DIR [--only SCENARIO ...]

Each scenario runs the megatron hook (``tis_forward_backward_func``) on the tiny GPT of ``_harness.py``, or
slime's rollout-data hook (``postprocess_rollout_data``, DP=2), with settings that differ between rank 0 and
rank 1, and records per rank ``{"calls": n, "errors": [{"error": type, "message": text}, ...], "ok": metrics}``
(errors of training calls are caught and the next call made, as a launcher that catches errors would; a call
stops the scenario when a check fired). ``DIR/rank{r}.json`` holds ``{scenario: record}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist
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
    setup_parallel,
)
from _plans import LAYOUTS, Layout
from _slime_oracle import args_ns, make_batch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from slime_tis import TISConfig
from slime_tis.megatron import default_get_tis_batch, tis_forward_backward_func
from slime_tis.slime import postprocess_rollout_data

ALG3 = dict(use_rollout_log_probs=True, use_tis=True)
M = 2


def per_rank(a, b):
    return a if dist.get_rank() == 0 else b


#: scenario -> (layout, TISConfig fields, hook keywords, training calls); values differ by rank via per_rank
SCENARIOS = {
    # CP=2: token-mean reduces the denominator over DP x CP, seq-mean over CP then DP (a deadlock before)
    "loss_agg": lambda: ("cp2", dict(**ALG3, loss_agg=per_rank("token-mean", "seq-mean-token-mean")), {}, 1),
    # DP=2: both finish, with a denominator mixed from two definitions (silently, before)
    "rejected_denominator": lambda: ("dp2", dict(**ALG3, mode="mask", rejected_denominator=per_rank("keep", "drop")),
                                     {}, 1),
    "temperature": lambda: ("dp2", dict(**ALG3), dict(temperature=per_rank(TEMPERATURE, 1.0)), 1),
    "same_settings": lambda: ("dp2", dict(**ALG3, upper=per_rank(None, 2.0)), {}, 2),  # resolved bounds agree
    # rank 0's first call raises before any collective; its launcher goes on with the next call, with the same
    # hook or (as Megatron-LM's train_step under tis_patch) a new hook per call
    "step_raised_on_one_rank": lambda: ("dp2", dict(**ALG3), dict(get_tis_batch=RaiseOnce(rank=0)), 2),
    "step_raised_new_hook_per_call": lambda: ("dp2", dict(**ALG3),
                                              dict(get_tis_batch=RaiseOnce(rank=0), new_hook_per_call=True), 2),
}


#: slime scenario -> YAML keys / flags of slime's args on this rank
SLIME_SCENARIOS = {
    # batch normalisation: one DP all-reduce of the normalisation sums on rank 0 only (a deadlock before)
    "slime_batch_normalize": lambda: dict(use_tis=True, tis_batch_normalize=per_rank(True, False)),
    "slime_same_settings": lambda: dict(use_tis=True, tis_batch_normalize=per_rank(True, "true")),
}


class RaiseOnce:
    """``get_tis_batch`` that raises on its first call on one rank (a data error of that rank's step)."""

    def __init__(self, rank: int) -> None:
        self.armed = dist.get_rank() == rank

    def __call__(self, item):
        if self.armed:
            self.armed = False
            raise ValueError("injected: this rank's data for the step is malformed")
        return default_get_tis_batch(item)


def run(name: str, weights, lp_full) -> dict:
    layout_name, fields, hook_kw, calls = SCENARIOS[name]()
    layout = LAYOUTS[layout_name]
    setup_parallel(layout)
    rows = row_assignment(layout.dp(dist.get_world_size()), ps.get_data_parallel_rank(), M)
    ddps, _ = build_ddp_chunks(layout, weights)
    batch = make_global_batch(lp_full)
    new_hook_per_call = hook_kw.pop("new_hook_per_call", False)

    def hook():
        return tis_forward_backward_func(get_forward_backward_func(), TISConfig(**fields),
                                         **{"temperature": TEMPERATURE, "chunk_size": 5, **hook_kw})

    fb = hook()
    record: dict = {"calls": 0}
    for _ in range(calls):
        record["calls"] += 1
        fb = hook() if new_hook_per_call else fb
        try:
            fb(forward_step_func=forward_step, data_iterator=iter(make_items(batch, rows)), model=ddps,
               num_microbatches=M, seq_length=SEQ, micro_batch_size=len(rows[0]), forward_only=False)
        except Exception as e:
            record.setdefault("errors", []).append({"error": type(e).__name__, "message": str(e)})
            if not isinstance(e, ValueError) or "injected" not in str(e):
                break  # a check fired: stop, as every rank does at the same point
            continue
        record["ok"] = {k: float(v) for k, v in fb.last_metrics.items()}
    return record


def run_slime(name: str) -> dict:
    setup_parallel(Layout())  # DP = 2
    b = make_batch(21, vocab=13)
    record: dict = {"calls": 1}
    try:
        postprocess_rollout_data(args_ns(**SLIME_SCENARIOS[name]()), 0, b.rollout_data() | {"log_probs": b.train})
        record["ok"] = {}
    except Exception as e:
        record["errors"] = [{"error": type(e).__name__, "message": str(e)}]
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="*", default=[*SCENARIOS, *SLIME_SCENARIOS])
    args = parser.parse_args()
    init_distributed()
    weights, lp_full = full_weights_and_log_probs()
    results = {name: run_slime(name) if name in SLIME_SCENARIOS else run(name, weights, lp_full)
               for name in args.only}
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
