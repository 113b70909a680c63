"""Worker of ``test_global_search.py``: the global searches (``core.search``: M2PO's cut, the auto truncation bound)
under DP=2 x CP=2 (4 gloo processes), with data so uneven that rank 0 holds every large ratio.

Ranks (dp, cp): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1). Each DP rank has ``M`` micro-batches of ``N_SEQ``
sequences; every sequence is split between its two CP ranks (first half / rest). Log-ratios: ``N(0, 0.05^2)``
everywhere, except on rank 0 (the first halves of DP rank 0's sequences), where they are ``2 + N(0, 1)``: the only
tokens with large ``(log r)^2`` and large ratios. A second pass of the same scenario runs on even data (another seed,
no large ratios): the collectives it issues must be the same.

Every ``torch.distributed.all_reduce`` of the worker is counted (the function is wrapped), and the reducer logs
(method, op, shape, dtype) of each collective it issues. Per scenario the worker writes its metrics, the global loss
(all-reduced) and both logs; rank 0 also writes one process's result on the whole batch (``LocalReducer``, no
communication): algorithm 2 one step over the same micro-batches, whole sequences; algorithm 3 micro-batch ``k`` the
union of the DP ranks' micro-batch ``k``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from uneven_worker import LoggingReducer, pack

from slime_tis import TISConfig, policy_loss
from slime_tis.core import LocalReducer
from slime_tis.engine.batch import TISBatch
from slime_tis.engine.step import StepEngine

N_SEQ, M, MAX_LEN = 4, 2, 14
KEYS = ("old", "rollout", "theta", "adv", "mask")

SCENARIOS = {
    # algorithm 2: both searches once per step (engine.totals), drop and batch normalisation read their values
    "alg2_token_auto_m2po_drop_bn": TISConfig(use_tis=True, upper="auto", target_ess=0.99, m2po_threshold=0.04,
                                              batch_normalize=True, rejected_denominator="drop"),
    # algorithm 2 at sequence units (sums over DP only: each sequence is replicated over CP)
    "alg2_sequence_auto": TISConfig(use_tis=True, level="sequence", upper="auto", target_ess=0.5,
                                    loss_agg="seq-mean-token-mean"),
    # algorithm 3: weights read lp_theta, so each micro-batch searches over DP x CP
    "alg3_token_auto_m2po": TISConfig(use_tis=True, use_rollout_log_probs=True, upper="auto", target_ess=0.99,
                                      m2po_threshold=0.04),
    # prefix levels (core.prefix) on Megatron's load-balanced CP split (4 chunks, rank r: chunks r and 3 - r): the
    # carry across CP ranks, with the auto bound on top (algorithm 2: per micro-batch, given no step values)
    "alg2_prefix_min_mask_zigzag": TISConfig(use_tis=True, level="prefix_min", mode="mask", lower=0.3, upper=3.0),
    "alg3_prefix_auto_zigzag": TISConfig(use_tis=True, use_rollout_log_probs=True, level="prefix", upper="auto",
                                         target_ess=0.6),
}


class Counted:
    """``torch.distributed.all_reduce`` wrapped: every call counted with its shape (the worker's own census, below
    the reducer)."""

    def __init__(self) -> None:
        self.calls: list[list] = []
        self._inner = dist.all_reduce

    def __call__(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.calls.append([list(tensor.shape), str(op)])
        return self._inner(tensor, op=op, group=group, async_op=async_op)


def micro_batches(dp: int, seed: int, uneven: bool) -> list[dict[str, list[torch.Tensor]]]:
    """DP rank ``dp``'s micro-batches, whole sequences (lists per key)."""
    g = torch.Generator().manual_seed(100 * seed + dp)
    out = []
    for _ in range(M):
        mb: dict[str, list[torch.Tensor]] = {k: [] for k in KEYS}
        for _ in range(N_SEQ):
            n = int(torch.randint(2, MAX_LEN + 1, (1,), generator=g))
            rollout = -2.0 * torch.rand(n, generator=g) - 0.1
            l = 0.05 * torch.randn(n, generator=g)  # noqa: E741
            if uneven and dp == 0:  # the first half (CP rank 0's part): every large ratio of the batch
                half = (n + 1) // 2
                l[:half] = 2.0 + torch.randn(half, generator=g)
            old = rollout + l
            theta = old + 0.02 * torch.randn(n, generator=g)
            mask = torch.rand(n, generator=g) > 0.15
            mask[0] = True
            adv = torch.randn(n, generator=g)
            for k, v in zip(KEYS, (old, rollout, theta, adv, mask)):
                mb[k].append(v)
        out.append(mb)
    return out


def cp_part(mb: dict[str, list[torch.Tensor]], cp: int) -> dict[str, list[torch.Tensor]]:
    return {k: [v[: (len(v) + 1) // 2] if cp == 0 else v[(len(v) + 1) // 2:] for v in vs] for k, vs in mb.items()}


def zigzag(mb: dict[str, list[torch.Tensor]], cp: int) -> dict[str, list[torch.Tensor]]:
    """CP rank ``cp``'s part of every sequence on Megatron's load-balanced split: 4 chunks in position order, rank
    ``cp`` holding chunks ``cp`` and ``3 - cp`` (in that order); key ``chunk``: each token's chunk index."""
    out: dict[str, list[torch.Tensor]] = {k: [] for k in (*KEYS, "chunk")}
    for i in range(len(mb["old"])):
        n = len(mb["old"][i])
        bounds = [round(n * j / 4) for j in range(5)]
        mine = (cp, 3 - cp)
        for k in KEYS:
            out[k].append(torch.cat([mb[k][i][bounds[j]:bounds[j + 1]] for j in mine]))
        out["chunk"].append(torch.cat([torch.full((bounds[j + 1] - bounds[j],), j) for j in mine]))
    return out


def merge(mbs: list[dict[str, list[torch.Tensor]]]) -> dict[str, list[torch.Tensor]]:
    return {k: [v for mb in mbs for v in mb[k]] for k in KEYS}


def run(cfg: TISConfig, mbs: list[dict[str, list[torch.Tensor]]], reducer) -> tuple[float, dict[str, float]]:
    """The step's loss (this rank's sum over its micro-batches) and its metrics."""
    packed = [pack(mb) for mb in mbs]
    if cfg.level.startswith("prefix"):  # the core directly: hosts do not pass chunk indices
        loss, stats = torch.zeros(()), None
        for d, cu in packed:
            chunks = (d["chunk"], 4) if "chunk" in d else None
            out = policy_loss(cfg, d["theta"].clone().requires_grad_(True), d["old"], d["rollout"], d["adv"],
                              d["mask"], cu, reducer=reducer, chunks=chunks)
            loss = loss + out.loss.detach()
            stats = out.stats if stats is None else stats.merge(out.stats)
        return float(loss), {k: float(v) for k, v in stats.reduce(reducer).finalize().items()}
    if cfg.algorithm == 2:  # the engine: begin (the step's searches) then each micro-batch's loss
        batches = [TISBatch(labels=torch.zeros(len(d["old"]), dtype=torch.long), loss_mask=d["mask"],
                            advantages=d["adv"], cu_seqlens=cu, rollout_log_probs=d["rollout"],
                            old_log_probs=d["old"]) for d, cu in packed]
        engine = StepEngine(cfg, reducer)
        engine.begin(batches)
        loss = torch.zeros(())
        for b, (d, _) in zip(batches, packed):
            out = engine.loss(b, d["theta"].clone().requires_grad_(True))
            engine.record(out.stats)
            loss = loss + out.loss.detach()
        return float(loss), {k: float(v) for k, v in engine.end().items()}
    loss, stats = torch.zeros(()), None  # algorithm 3: policy_loss per micro-batch, each searching over DP x CP
    for d, cu in packed:
        out = policy_loss(cfg, d["theta"].clone().requires_grad_(True), None, d["rollout"], d["adv"], d["mask"], cu,
                          reducer=reducer)
        loss = loss + out.loss.detach()
        stats = out.stats if stats is None else stats.merge(out.stats)
    return float(loss), {k: float(v) for k, v in stats.reduce(reducer).finalize().items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    counted = Counted()
    dist.all_reduce = counted  # the census of every all-reduce issued from here on
    rank = dist.get_rank()
    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp, cp = divmod(rank, 2)
    results = {}
    for seed, (name, cfg) in enumerate(SCENARIOS.items()):
        passes = {}
        for uneven in (True, False):
            counted.calls = []
            reducer = LoggingReducer(cp_groups[dp], dp_groups[cp])
            split = zigzag if name.endswith("zigzag") else cp_part
            mbs = [split(mb, cp) for mb in micro_batches(dp, seed + 10 * (not uneven), uneven)]
            loss, metrics = run(cfg, mbs, reducer)
            census = list(counted.calls)
            total = torch.tensor([loss], dtype=torch.float64)
            dist.all_reduce(total)  # the global loss: every rank's sum (global denominators)
            passes["uneven" if uneven else "even"] = {"loss": float(total), "metrics": metrics, "log": reducer.log,
                                                      "census": census}
        ref = {}
        if rank == 0:  # one process on the whole batch of the uneven pass
            whole = [micro_batches(d, seed, True) for d in (0, 1)]
            if cfg.algorithm == 2 and not name.endswith("zigzag"):
                mbs = [merge(whole[0] + whole[1])]  # one step: the micro-batch split does not matter
            else:
                mbs = [merge([whole[0][k], whole[1][k]]) for k in range(M)]
            loss, metrics = run(cfg, mbs, LocalReducer())
            ref = {"loss": loss, "metrics": metrics}
        results[name] = {**passes, "ref": ref}
    (args.out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
