"""Worker of ``test_rank_failure.py``: one rank's training call raises and its process ends.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python tests/dist/rank_failure_worker.py --out DIR  (r = 0, 1)

DP = 2 on the tiny GPT of ``_harness.py``, the megatron hook (``tis_forward_backward_func``). Training call 1
runs on both ranks (healthy: afterwards the job's store holds no failure record). In call 2 rank 1's
``forward_step_func`` raises in its second micro-batch, uncaught: rank 1's process ends with its traceback.
Rank 0 meets the broken connection in the data-parallel gradient all-reduce and writes ``DIR/rank0.json``:
``{"healthy_record": bool, "error": type, "message": text, "is_runtime_error": bool}``.
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
from _plans import LAYOUTS
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from slime_tis import TISConfig
from slime_tis.megatron import tis_forward_backward_func
from slime_tis.megatron.rank_failure import KEY

M = 2


class FailingForwardStep:
    """``forward_step`` that raises on rank 1 in the second micro-batch of the second training call."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, data_iterator, model):
        self.calls += 1
        if dist.get_rank() == 1 and self.calls == M + 2:
            raise ValueError("injected: rank 1's micro-batch is malformed")
        return forward_step(data_iterator, model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    init_distributed()
    weights, lp_full = full_weights_and_log_probs()
    setup_parallel(LAYOUTS["dp2"])
    rows = row_assignment(2, ps.get_data_parallel_rank(), M)
    ddps, _ = build_ddp_chunks(LAYOUTS["dp2"], weights)
    batch = make_global_batch(lp_full)
    fb = tis_forward_backward_func(get_forward_backward_func(), TISConfig(use_rollout_log_probs=True, use_tis=True),
                                   temperature=TEMPERATURE, chunk_size=5)
    step = FailingForwardStep()

    def call():
        fb(forward_step_func=step, data_iterator=iter(make_items(batch, rows)), model=ddps, num_microbatches=M,
           seq_length=SEQ, micro_batch_size=len(rows[0]), forward_only=False)

    call()
    dist.barrier()
    record: dict = {"healthy_record": dist.distributed_c10d._get_default_store().check([KEY])}
    try:
        call()  # rank 1 raises (uncaught: its process ends); rank 0's gradient all-reduce breaks
    except Exception as e:
        if dist.get_rank() != 0:
            raise  # the failing rank's process ends with its own traceback
        record.update(error=type(e).__name__, message=str(e), is_runtime_error=isinstance(e, RuntimeError))
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
