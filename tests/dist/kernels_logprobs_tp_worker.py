"""torchrun worker (2 ranks, gloo, CPU, ``TRITON_INTERPRET=1``): the Triton log-prob kernels at TP=2.

Every rank builds the same full-vocabulary logits, keeps its vocabulary shard and calls the public
``vocab_parallel_log_probs_and_entropy(..., kernels="triton", tp_group=WORLD)``: per-rank kernel, then the
combination (one all-reduce MAX, one SUM). Compared with a float64 ``log_softmax`` of the full logits
(values on every rank; the gradient on this rank's columns) and with ``kernels="torch"`` at TP=2. Writes
``{check: [error, tolerance]}`` to ``--out/rank{r}.json``; the pytest side asserts.

Cases: targets on both sides of the shard boundary (global ids 0, Vp-1, Vp, 2Vp-1), temperature 0.7, a row
whose whole shard on rank 1 is -inf, scattered -inf, masked rows holding NaN, bfloat16 logits.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from slime_tis.kernels.dispatch import KernelFallbackWarning
from slime_tis.megatron import vocab_parallel_log_probs_and_entropy

VP, T, TAU = 24, 8, 0.7


def _oracle(full: torch.Tensor, targets: torch.Tensor, w_lp: torch.Tensor, w_h: torch.Tensor, keep: torch.Tensor):
    z = full.detach().double().requires_grad_(True)
    lsm = torch.log_softmax(z / TAU, dim=-1)
    lp = lsm.gather(-1, targets[:, None]).squeeze(-1)
    ent = -(lsm.exp() * torch.where(torch.isinf(lsm), 0.0, lsm)).sum(-1)
    lp, ent = torch.where(keep, lp, 0.0), torch.where(keep, ent, 0.0)
    (grad,) = torch.autograd.grad((lp * w_lp.double()).sum() + (ent * w_h.double()).sum(), z)
    return lp.detach(), ent.detach(), torch.where(keep[:, None], grad, 0.0)


def _run(shard: torch.Tensor, targets, w_lp, w_h, keep, kernels: str):
    z = shard.clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs_and_entropy(z, targets, temperature=TAU, tp_group=dist.group.WORLD,
                                                   row_mask=keep, kernels=kernels, chunk_size=3)
    (grad,) = torch.autograd.grad((lp * w_lp).sum() + (ent * w_h).sum(), z)
    return lp.detach(), ent.detach(), grad


def main() -> None:
    warnings.simplefilter("error", KernelFallbackWarning)  # kernels="triton" must run the kernels
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    assert os.environ.get("TRITON_INTERPRET") == "1", "launch with TRITON_INTERPRET=1"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2
    g = torch.Generator().manual_seed(11)
    full = torch.randn(T, world * VP, generator=g) * 3
    targets = torch.randint(0, world * VP, (T,), generator=g)
    targets[:4] = torch.tensor([0, VP - 1, VP, 2 * VP - 1])   # both edges of both shards
    full[4, VP:] = float("-inf")                                # rank 1's whole shard: m_r = float32 min
    full[5, ::5] = float("-inf")
    targets[5] = 1
    w_lp, w_h = torch.randn(T, generator=g), 3 * torch.randn(T, generator=g)
    keep = torch.ones(T, dtype=torch.bool)
    keep_some = keep.clone()
    keep_some[[2, 6]] = False
    checks: dict[str, list[float]] = {}
    cols = slice(rank * VP, (rank + 1) * VP)
    for name, dtype, mask in [("fp32", torch.float32, keep), ("fp32_masked", torch.float32, keep_some),
                              ("bf16", torch.bfloat16, keep)]:
        logits = full.to(dtype)
        lp_ref, ent_ref, grad_ref = _oracle(logits.float(), targets, w_lp, w_h, mask)
        if not bool(mask.all()):
            logits = logits.clone()
            logits[~mask] = float("nan")                        # masked rows are never read
        row_mask = None if bool(mask.all()) else mask
        got = {k: _run(logits[:, cols], targets, w_lp, w_h, row_mask, k) for k in ("triton", "torch")}
        lp, ent, grad = got["triton"]
        grad_tol = 2**-7 * float(grad_ref[:, cols].abs().max()) + 1e-5 if dtype == torch.bfloat16 else 1e-5
        checks[f"{name}/lp"] = [float((lp.double() - lp_ref).abs().max()), 2e-5]
        checks[f"{name}/entropy"] = [float((ent.double() - ent_ref).abs().max()), 2e-5]
        checks[f"{name}/grad"] = [float((grad.double() - grad_ref[:, cols]).abs().max()), grad_tol]
        checks[f"{name}/finite"] = [0.0 if bool(torch.isfinite(grad).all()) else 1.0, 0.0]
        for i, what in enumerate(("lp", "entropy", "grad")):
            a, b = got["triton"][i].double(), got["torch"][i].double()
            checks[f"{name}/{what}_vs_torch_path"] = [float((a - b).abs().max()), 2e-5 if i < 2 else grad_tol]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "checks": checks}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
