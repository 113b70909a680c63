"""Worker of ``test_uneven_ranks.py``: the core under DP=2 x CP=2 (4 gloo processes) with very different data
per rank, reduced with a plain ``torch.distributed`` reducer that logs every collective it issues.

Ranks (dp, cp): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1). Every sequence of a DP rank is split
between its two CP ranks (first half / second half). Data:

* DP rank 0 (ranks 0, 1): every token far off-policy (l = +5), so every rule rejects everything; in the
  algorithm-0 scenario these ranks have no rollout log-probs at all;
* rank 2: one NaN in a valid token (only on this rank; its sequence is split with rank 3);
* rank 3: all of its tokens masked out.

Per scenario the worker writes its metrics, its loss and its collective log; the test compares them with
one process on the whole (unsplit) batch and across ranks. Where the configuration splits metrics by staleness, the
sequences' staleness is :func:`staleness_of` (DP rank 0: buckets 0, 1 and 2plus; DP rank 1: an invalid one too),
given to ``compute_tis`` whose result the loss takes (``policy_loss(correction=...)``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from slime_tis import TISConfig, compute_tis, policy_loss

N_SEQ, MAX_LEN = 5, 12

SCENARIOS = {
    "token_mask_rs_veto_k3_drop": TISConfig(
        use_tis=True, mode="mask", level="token", lower=0.5, upper=2.0, rs_level="geometric", rs_upper=1.5,
        veto_threshold=1e-3, seq_max_k3_threshold=3.0, rejected_denominator="drop", loss_agg="seq-mean-token-mean"),
    "seq_truncate_rs_batchnorm": TISConfig(
        use_tis=True, mode="truncate", level="sequence", rs_level="sequence", rs_lower=0.2, rs_upper=5.0,
        batch_normalize=True, seq_mean_k3_threshold=0.5, loss_agg="seq-mean-token-sum"),
    "bypass_k3_rs": TISConfig.from_preset("bypass_ppo_clip_k3_rs"),
    "alg0_partial_rollout": TISConfig(),
    # issue 40: two-sided veto, binary KL, sequence log-prob error, metrics split by staleness, bounds tightened
    "kpop_logprob_error_veto2_staleness": TISConfig(
        use_tis=True, veto_threshold=1e-4, veto_upper_threshold=100.0, binary_kl_threshold=0.1,
        seq_logprob_error_threshold=2.0, staleness_buckets=2, staleness_decay=0.5),
    "geo_mean_geo_rs": TISConfig(use_tis=True, rs_level="geometric", rs_upper=1.5, loss_mode="geo_mean",
                                 eps_clip=0.05, loss_agg="seq-mean-token-mean"),
}


class LoggingReducer:
    """The core's ``Reducer`` on explicit groups; records (method, op, shape, dtype) of each collective."""

    def __init__(self, cp_group, dp_group) -> None:
        self.cp_group, self.dp_group, self.log = cp_group, dp_group, []

    def _all_reduce(self, name: str, x: torch.Tensor, op, group) -> torch.Tensor:
        self.log.append([name, str(op), list(x.shape), str(x.dtype)])
        y = x.detach().clone()
        dist.all_reduce(y, op=op, group=group)
        return y

    def sequence_sum(self, x):
        return self._all_reduce("sequence_sum", x, dist.ReduceOp.SUM, self.cp_group)

    def batch_sum(self, x, *, per_sequence=False):
        return self._all_reduce("batch_sum", x, dist.ReduceOp.SUM, self.dp_group if per_sequence else None)

    def batch_min(self, x):
        return self._all_reduce("batch_min", x, dist.ReduceOp.MIN, None)

    def batch_max(self, x):
        return self._all_reduce("batch_max", x, dist.ReduceOp.MAX, None)


def dp_batch(dp: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """Per-sequence tensors of DP rank ``dp`` (whole sequences): lengths 1..MAX_LEN, inner masked tokens."""
    g = torch.Generator().manual_seed(seed * 10 + dp)
    seqs: dict[str, list[torch.Tensor]] = {k: [] for k in ("old", "rollout", "theta", "adv", "mask")}
    for _ in range(N_SEQ):
        n = int(torch.randint(1, MAX_LEN + 1, (1,), generator=g))
        rollout = -3.0 * torch.rand(n, generator=g)
        shift = 5.0 if dp == 0 else 0.0  # DP rank 0: everything rejected
        old = rollout + shift + 0.3 * torch.randn(n, generator=g)
        theta = old + 0.1 * torch.randn(n, generator=g)
        mask = torch.rand(n, generator=g) > 0.2
        mask[0] = True
        adv = torch.randn(n, generator=g)
        for k, v in zip(("old", "rollout", "theta", "adv", "mask"), (old, rollout, theta, adv, mask)):
            seqs[k].append(v)
    return seqs


def split(seqs: dict[str, list[torch.Tensor]], cp: int) -> dict[str, list[torch.Tensor]]:
    """CP rank ``cp``'s part of every sequence: first half (cp 0) or the rest (cp 1)."""
    out = {}
    for k, vs in seqs.items():
        out[k] = [v[: (len(v) + 1) // 2] if cp == 0 else v[(len(v) + 1) // 2:] for v in vs]
    return out


def pack(seqs: dict[str, list[torch.Tensor]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    lengths = torch.tensor([len(v) for v in seqs["old"]])
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    return {k: torch.cat(v) for k, v in seqs.items()}, cu


def rank_data(dp: int, cp: int, seed: int) -> dict[str, list[torch.Tensor]]:
    part = split(dp_batch(dp, seed), cp)
    if (dp, cp) == (1, 0):  # NaN at a valid token, on this rank only
        part["rollout"][1] = part["rollout"][1].clone()
        part["rollout"][1][0] = math.nan
        part["old"][1] = part["old"][1].clone()
        part["old"][1][0] = math.nan
    if (dp, cp) == (1, 1):  # fully masked rank
        part["mask"] = [torch.zeros_like(m) for m in part["mask"]]
    return part


def whole_batch(seed: int, dps: tuple[int, ...]) -> dict[str, list[torch.Tensor]]:
    """The same data as the ranks hold, sequences of the DP ranks ``dps`` put back together."""
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ("old", "rollout", "theta", "adv", "mask")}
    for dp in dps:
        halves = [rank_data(dp, cp, seed) for cp in (0, 1)]
        for k in out:
            out[k] += [torch.cat([a, b]) for a, b in zip(halves[0][k], halves[1][k])]
    return out


def staleness_of(dps: tuple[int, ...]) -> torch.Tensor:
    """Per-sequence staleness of the sequences of DP ranks ``dps``, in order: 0, 1, 2, 5, 3 on DP rank 0 and
    1, -1 (invalid), 0, 7, 2 on DP rank 1."""
    table = {0: [0.0, 1.0, 2.0, 5.0, 3.0], 1: [1.0, -1.0, 0.0, 7.0, 2.0]}
    return torch.tensor([s for dp in dps for s in table[dp]])


def run(cfg: TISConfig, data: dict[str, torch.Tensor], cu: torch.Tensor, reducer, with_rollout: bool,
        dps: tuple[int, ...] = ()):
    theta = data["theta"].clone().requires_grad_(True)
    rollout = data["rollout"] if with_rollout else None
    correction = None
    if cfg.staleness_buckets:  # algorithm 2: the correction of pi_old against pi_rollout, with the staleness
        correction = compute_tis(cfg, data["old"], rollout, data["mask"], cu, reducer=reducer,
                                 staleness=staleness_of(dps))
    out = policy_loss(cfg, theta, data["old"], rollout, data["adv"], data["mask"], cu, reducer=reducer,
                      correction=correction)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == 4
    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp, cp = divmod(rank, 2)
    results = {}
    for seed, (name, cfg) in enumerate(SCENARIOS.items()):
        reducer = LoggingReducer(cp_groups[dp], dp_groups[cp])
        with_rollout = not (name.startswith("alg0") and dp == 0)
        data, cu = pack(rank_data(dp, cp, seed))
        out = run(cfg, data, cu, reducer, with_rollout, (dp,))
        loss = out.loss.detach().reshape(1).clone()
        dist.all_reduce(loss)  # the global loss: sum of the ranks' losses (global denominator)
        metrics = {k: float(v) for k, v in out.stats.reduce(reducer).finalize().items()}
        logs = [None] * 4
        dist.all_gather_object(logs, reducer.log)

        ref = {}
        if rank == 0:  # one process, whole sequences of both DP ranks, no communication
            whole, wcu = pack(whole_batch(seed, (0, 1)))
            if name.startswith("alg0"):  # DP rank 0 has no rollout log-probs: tis/* from DP rank 1 only
                ref_out = run(cfg, whole, wcu, None, False)
                tis_part, tcu = pack(whole_batch(seed, (1,)))
                tis = compute_tis(cfg, tis_part["old"], tis_part["rollout"], tis_part["mask"], tcu)
                ref = {k: float(v) for k, v in ref_out.stats.finalize().items() if k.startswith("policy/")}
                ref.update({k: float(v) for k, v in tis.stats.finalize().items()})
            else:
                ref_out = run(cfg, whole, wcu, None, True, (0, 1))
                ref = {k: float(v) for k, v in ref_out.stats.finalize().items()}
            ref["loss"] = float(ref_out.loss)
        results[name] = {"metrics": metrics, "loss": float(loss), "logs": logs, "ref": ref,
                         "all_rejected_here": bool(dp == 0 and not out.keep_mask.any())}
    (args.out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
