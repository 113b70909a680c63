"""The Megatron hook with algorithms 1 / 3 + ``drop`` when its two forwards differ (tests/test_engine_two_forwards.py).

One gloo rank (TP = PP = CP = DP = 1), the harness's tiny GPT and batch, one optimizer step of 2 micro-batches. The
launcher's ``forward_step`` scales the logits by ``SCALE`` in the training forward only (gradient on; the hook's
pre-pass runs without): a stand-in for dropout, which makes the two forwards of a step differ. Recorded per
micro-batch: the pre-pass's ``lp_theta`` (``forward_only_log_probs``), the loss forward's ``lp_theta`` and the
loss's keep mask and weights (``StepEngine.loss``), the micro-batch, and the step's denominator. Saved with
``torch.save`` into ``two_forwards.pt`` in the directory given as the only argument.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _harness import (  # noqa: E402
    SEQ,
    TEMPERATURE,
    build_ddp_chunks,
    forward_step,
    full_weights_and_log_probs,
    make_items,
)
from _plans import Layout  # noqa: E402
from _rollout_harness import clean_batch, step_rows  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

import slime_tis.megatron.hook as hook_mod  # noqa: E402
from slime_tis import TISConfig  # noqa: E402
from slime_tis.engine.step import StepEngine  # noqa: E402
from slime_tis.megatron import tis_forward_backward_func  # noqa: E402

M = 2
SCALE = 2.0
RULES = dict(mode="mask", level="geometric", upper=1.1, veto_threshold=1e-3, rejected_denominator="drop")
ALGORITHMS = {1: dict(use_rollout_log_probs=True), 3: dict(use_rollout_log_probs=True, use_tis=True)}


def differing_forward_step(data_iterator, model):
    """The harness's ``forward_step``, its logits scaled in the training forward only (see module docstring)."""
    output, loss_func = forward_step(data_iterator, model)
    return (output * SCALE if torch.is_grad_enabled() else output), loss_func


def main(out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=0, world_size=1)
    record: dict = {}
    real_pass, real_loss = hook_mod.forward_only_log_probs, StepEngine.loss

    def recorded_pass(*a, **k):
        lps = real_pass(*a, **k)
        record["pre"] = [lp.clone() for lp in lps]
        return lps

    def recorded_loss(self, batch, lp_theta, **k):
        res = real_loss(self, batch, lp_theta, **k)
        record["loss"].append({"batch": batch, "lp_theta": lp_theta.detach().clone(), "keep": res.keep_mask,
                               "weights": res.weights, "denominator": self.totals.denominator})
        return res

    hook_mod.forward_only_log_probs = recorded_pass
    StepEngine.loss = recorded_loss
    weights, lp_full = full_weights_and_log_probs()
    batch = clean_batch(lp_full)
    result = {}
    for algorithm, fields in ALGORITHMS.items():
        cfg = TISConfig(**fields, **RULES)
        ddps, _ = build_ddp_chunks(Layout(), weights)
        fb = tis_forward_backward_func(get_forward_backward_func(), cfg, temperature=TEMPERATURE, chunk_size=5)
        record.clear()
        record["loss"] = []
        fb(forward_step_func=differing_forward_step, data_iterator=iter(make_items(batch, step_rows(1, 0, M, 0))),
           model=ddps, num_microbatches=M, seq_length=SEQ, micro_batch_size=2, forward_only=False)
        result[algorithm] = {"pre": record["pre"], "loss": record["loss"], "cfg": dict(**fields, **RULES)}
    torch.save(result, out / "two_forwards.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
