"""torchrun worker (2 ranks, gloo, CPU): the sampling-support replay of the log-softmax at TP=2.

Every rank builds the same full logits and supports (``tests/test_support_logprobs.py``'s case: a one-token
row, a whole-vocabulary row, ids on both sides of the shard boundary), keeps its vocabulary shard and calls
``vocab_parallel_log_probs_and_entropy(..., support=..., tp_group=WORLD)``; compared with the same call at TP=1
(the full logits, no group) and with the float64 masked log-softmax (values on every rank, the gradient on this
rank's columns); then the replay from hidden states (``kernels.output_layer_support``) on this rank's output-weight
shard against the float64 oracle of ``h W^T`` (the hidden-state gradient summed over TP); with triton importable and
``TRITON_INTERPRET=1``, the Triton replay kernels at TP=2 against the torch replay at TP=2. Writes
``{check: [error, tolerance]}`` to ``--out/rank{r}.json``; the pytest side asserts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_support_logprobs import TAU, T, V, make_case, oracle  # noqa: E402
from test_support_output_layer import case as fused_case  # noqa: E402
from test_support_output_layer import oracle as fused_oracle  # noqa: E402

from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy  # noqa: E402
from slime_tis.kernels.dispatch import KernelFallbackWarning  # noqa: E402
from slime_tis.kernels.output_layer_support import fused_support_log_probs_and_entropy  # noqa: E402

#: the Triton replay kernels are checked too when triton imports and runs here (the launch sets TRITON_INTERPRET=1)
TRITON = importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"


def _run(logits, targets, ids, offsets, w_lp, w_h, keep, group, kernels="torch"):
    z = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs_and_entropy(z, targets, temperature=TAU, tp_group=group, row_mask=keep,
                                                   support=(ids, offsets), kernels=kernels)
    (grad,) = torch.autograd.grad((lp * w_lp).sum() + (ent * w_h).sum(), z)
    return lp.detach(), ent.detach(), grad


def main() -> None:
    warnings.simplefilter("error", KernelFallbackWarning)  # kernels="triton" must run the kernels
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2 and V % 2 == 0
    vp = V // world
    cols = slice(rank * vp, (rank + 1) * vp)
    checks: dict[str, list[float]] = {}
    for seed in (0, 1):
        logits, targets, ids, offsets, rows = make_case(seed)
        g = torch.Generator().manual_seed(7 + seed)
        w_lp, w_h = torch.randn(T, generator=g), torch.randn(T, generator=g)
        keep = torch.ones(T, dtype=torch.bool)
        keep[5] = seed == 0
        tp2 = _run(logits[:, cols], targets, ids, offsets, w_lp, w_h, keep, dist.group.WORLD)
        tp1 = _run(logits, targets, ids, offsets, w_lp, w_h, keep, None)
        lp_ref, ent_ref, grad_ref, _ = oracle(logits, targets, rows, w_lp, w_h, keep=keep)
        for i, what in enumerate(("lp", "entropy", "grad")):
            a, b = tp2[i].double(), (tp1[i][:, cols] if what == "grad" else tp1[i]).double()
            checks[f"{seed}/{what}_tp2_vs_tp1"] = [float((a - b).abs().max()), 2e-5]
        checks[f"{seed}/lp_vs_float64"] = [float((tp2[0].double() - lp_ref).abs().max()), 2e-5]
        checks[f"{seed}/entropy_vs_float64"] = [float((tp2[1].double() - ent_ref).abs().max()), 2e-5]
        checks[f"{seed}/grad_vs_float64"] = [float((tp2[2].double() - grad_ref[:, cols]).abs().max()), 2e-5]
        if TRITON:  # the Triton replay kernels at TP=2 (interpreter), every check against the torch replay at TP=2
            tri = _run(logits[:, cols], targets, ids, offsets, w_lp, w_h, keep, dist.group.WORLD, "triton")
            for i, what in enumerate(("lp", "entropy", "grad")):
                checks[f"{seed}/triton_{what}_vs_torch"] = [float((tri[i] - tp2[i]).abs().max()), 2e-5]
    # the replay from hidden states: each rank its weight shard, dL/dhidden all-reduced over TP
    hidden, weight, targets, ids, offsets, rows, w_lp, w_h, keep = fused_case(0)
    h, w = hidden.clone().requires_grad_(True), weight[cols].clone().requires_grad_(True)
    lp, ent = fused_support_log_probs_and_entropy(h, w, targets, (ids, offsets), temperature=TAU, loss_mask=keep,
                                                  tp_group=dist.group.WORLD, chunk_size=5)
    gh, gw = torch.autograd.grad((lp * w_lp).sum() + (ent * w_h).sum(), (h, w))
    ref = fused_oracle(hidden, weight, targets, rows, w_lp, w_h, keep)
    for name, a, b in (("lp", lp, ref[0]), ("entropy", ent, ref[1]), ("d_hidden", gh, ref[2]),
                       ("d_weight", gw, ref[3][cols])):
        checks[f"fused/{name}_vs_float64"] = [float((a.double() - b).abs().max()), 2e-5]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "checks": checks}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
