"""torchrun entry point: run a list of (layout, case, micro-batch count) checks and write one JSON line each.

    torchrun --nproc-per-node 2 tests/dist/megatron_worker.py --out DIR --plan main2

Plans (which checks) are defined in ``PLANS``; every rank writes ``DIR/rank{r}.jsonl``. Process groups
are initialised once (gloo) and model parallel is re-initialised per check, so the ~3 s import is paid
once per launch.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from _harness import (
    TEMPERATURE,
    full_weights_and_log_probs,
    init_distributed,
    oracle_for,
    run_case,
    setup_parallel,
)
from _plans import CASES, LAYOUTS, plan_checks
from _rollout_harness import clean_batch, hand_reference, run_rollout_case

from slime_tis import TISConfig
from slime_tis.megatron import MegatronReducer


class NoCPReducer(MegatronReducer):
    """Control: per-rank (unreduced) sequence sums under CP. The CP test must fail with it."""

    def sequence_sum(self, x):
        return x


class MeanOfMinimaReducer(MegatronReducer):
    """Control: a mean of per-rank minima / maxima instead of a true MIN / MAX."""

    def _mean(self, x):
        out = x.clone()
        dist.all_reduce(out, group=self.dp_cp_group)
        return out / self.dp_cp_size

    def batch_min(self, x):
        return self._mean(x)

    def batch_max(self, x):
        return self._mean(x)


def _patched_fb(cfg):
    """The user-facing patch: an 'existing launcher' that calls get_forward_backward_func() itself."""
    import types

    from megatron.core.pipeline_parallel import get_forward_backward_func

    from slime_tis.megatron import tis_patch

    launcher = types.SimpleNamespace(get_forward_backward_func=get_forward_backward_func)
    with tis_patch(cfg, temperature=TEMPERATURE, chunk_size=5, modules=[launcher]):
        fb = launcher.get_forward_backward_func()
    assert launcher.get_forward_backward_func is get_forward_backward_func, "patch not undone on exit"
    return fb


def _reference(check: dict, weights, lp_full):
    """The check's oracle (TP=PP=CP=1 model parallel must be initialised)."""
    if check.get("kind"):
        cfg = TISConfig(**CASES[check["case"]])
        return hand_reference(cfg, weights, clean_batch(lp_full),
                              supplied_shift=-0.5 if check["kind"] == "supplied" else None)
    return oracle_for(check["layout"], check["case"], check["M"], weights=weights, lp_full=lp_full,
                      masked_rank_rows=tuple(check.get("masked", ())))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--plan", default="main2")
    args = parser.parse_args()
    init_distributed()
    rank = dist.get_rank()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # 2 cores shared by every rank
    weights, lp_full = full_weights_and_log_probs()  # initialises model parallel with TP=PP=CP=1
    checks = sorted(plan_checks(args.plan), key=lambda c: list(LAYOUTS).index(c["layout"]))
    oracles = [_reference(c, weights, lp_full) for c in checks]
    reducers = {"nocp": NoCPReducer, "meanmin": MeanOfMinimaReducer}
    current = None
    with open(out / f"rank{rank}.jsonl", "w") as fh:
        for check, ref in zip(checks, oracles):
            t0 = time.perf_counter()
            if LAYOUTS[check["layout"]] != current:
                current = LAYOUTS[check["layout"]]
                setup_parallel(current)
            try:
                if check.get("kind"):
                    res = run_rollout_case(check["layout"], check["case"], check["M"], weights=weights,
                                           lp_full=lp_full, ref=ref, supplied=check["kind"] == "supplied",
                                           per_step_control=check["kind"] == "per_step_control")
                else:
                    res = run_case(check["layout"], check["case"], check["M"], weights=weights, lp_full=lp_full,
                                   ref=ref, reducer_factory=reducers.get(check.get("reducer")),
                                   masked_rank_rows=tuple(check.get("masked", ())),
                                   fb_factory=_patched_fb if check.get("patch") else None,
                                   tp0_data=check.get("tp0_data", False),
                                   average_in_collective=check.get("avg_coll", False),
                                   opaque_wrapper=check.get("opaque", False),
                                   schedule_keyword=check.get("keyword", False),
                                   no_rollout_dp_rank=check.get("no_rollout_dp_rank"),
                                   via_train_step=check.get("train_step", False))
            except Exception:  # report, keep going: the other checks still run (all ranks raise alike)
                res = {"layout": check["layout"], "case": check["case"], "M": check["M"], "rank": rank,
                       "error": traceback.format_exc()}
            res["tag"] = check.get("tag", "")
            res["seconds"] = time.perf_counter() - t0
            fh.write(json.dumps(res) + "\n")
            fh.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
